"""``h2o-kv serve --policy h2o --budget 0.2`` over HTTP (issue 26 items 1, 7, 11; issue 22 section 2): a short chat
under the server-wide ratio runs as the full cache (the ``min_entries`` floor, logged once for that request), a
long prompt above the floor still evicts (its blocks stop at the bounded size, its tokens equal the transformers
backend's at the same rule), an unknown ``h2o_*`` key or a head-adaptive policy is a 400, and the start log names
the plugin, its setting and the vLLM version once. One server for the module. Skips where vLLM is not installed.
"""

from __future__ import annotations

import importlib.util
import math
import os
import re
import threading
import urllib.request

import pytest

HAS_VLLM = getattr(importlib.util.find_spec("vllm"), "origin", None) is not None  # not tests/serving as a namespace
pytestmark = [
    pytest.mark.skipif(not HAS_VLLM, reason="vLLM is not installed (pip install 'h2o-kv[vllm]')"),
    pytest.mark.slow,
]
PORT = int(os.environ.get("H2O_KV_TEST_SERVE_PORT", "8201")) + 2
BUDGET = 0.2
CHAT = [{"role": "user", "content": "What is 2+2?"}]  # the short chat (about 38 prompt tokens)
NEW = 24


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from h2o_kv.vllm.config import ServeConfig
    from h2o_kv.vllm.serve import ServeOptions, ServerProcess

    log = tmp_path_factory.mktemp("serve-floor") / "server.log"
    options = ServeOptions(ServeConfig("h2o", budget=BUDGET), port=PORT, kv_cache_gb=0.25, max_model_len=2560)
    with ServerProcess(options, log=log, startup_timeout=600) as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def _log(server) -> str:
    return server.log_path.read_text(errors="replace")


def _chat(client, server, **xargs) -> str:
    extra = {"ignore_eos": True} | ({"vllm_xargs": xargs} if xargs else {})
    reply = client.chat.completions.create(model=server.model, messages=CHAT, max_tokens=NEW, temperature=0,
                                           extra_body=extra)  # fmt: skip
    assert reply.usage.completion_tokens == NEW
    return reply.choices[0].message.content


def test_start_log_names_the_plugin_its_setting_and_vllm_once(server):
    import vllm

    import h2o_kv

    lines = [line for line in _log(server).splitlines() if "vLLM plugin active" in line]
    assert len(lines) == 1, lines
    assert f"h2o-kv {h2o_kv.__version__} vLLM plugin active: policy h2o, budget=0.2, min_entries=256" in lines[0]
    assert f"(vLLM {vllm.__version__})" in lines[0]


def test_a_short_chat_under_a_ratio_runs_as_the_full_cache_and_is_logged_once(server, client):
    before = _log(server).count("under min_entries")
    floored = _chat(client, server)
    assert _log(server).count("under min_entries") == before + 1  # once for this request
    full = _chat(client, server, h2o_policy="full")
    assert floored == full
    paper = _chat(client, server, h2o_min_entries=0)  # the paper's rule: 3 + 3 entries of the chat prompt
    assert paper != full  # what the floor prevents (the garbled answers), so the check above can fail
    assert _log(server).count("under min_entries") == before + 1  # neither of those is under the floor


def _long_prompt(tokenizer, tokens: int) -> list[int]:
    """A varied text of about ``tokens`` tokens (distinct sentences: no long runs of equal scores)."""
    colors, animals = ("red", "green", "blue", "amber", "violet", "grey", "white"), ("fox", "owl", "cat", "hare", "elk")
    places = ("river", "market", "tower", "orchard", "harbour", "library")
    text, i = "", 0
    while len(tokenizer(text).input_ids) < tokens:
        text += (f"On day {i} the {colors[i % 7]} {animals[i % 5]} walked past the {places[i % 6]} and counted "
                 f"{(i * 37) % 101} stones. ")  # fmt: skip
        i += 1
    return tokenizer(text).input_ids[:tokens]


def _metric(text: str, name: str) -> float:
    return float(re.search(rf"^{re.escape(name)}{{[^}}]*}} (\S+)$", text, re.M)[1])


def test_a_long_prompt_above_the_floor_still_evicts(server, client):
    """1,800 tokens at 0.2: 180 + 180 entries (> the 256 floor), so the request evicts: while it decodes it holds
    the blocks of 361 slots, not of its 1,800-token prompt, and its tokens equal ``H2OCache`` at the same rule."""
    import torch

    import h2o_kv

    model, tokenizer = h2o_kv.load_model()
    model.generation_config.eos_token_id = None
    prompt = _long_prompt(tokenizer, 1800)
    heavy, recent = h2o_kv.Budget.of(BUDGET, min_entries=256).split(len(prompt))
    assert (heavy, recent) == (180, 180)
    metrics = urllib.request.urlopen(server.url + "/metrics", timeout=10).read().decode()
    info = re.search(r"^vllm:cache_config_info{([^}]*)}", metrics, re.M)[1]
    blocks, block_size = (int(re.search(rf'{key}="(\d+)"', info)[1]) for key in ("num_gpu_blocks", "block_size"))
    used: list[float] = []

    def sample(stop: threading.Event) -> None:  # the KV usage while the request decodes
        while not stop.wait(0.5):
            text = urllib.request.urlopen(server.url + "/metrics", timeout=10).read().decode()
            used.append(_metric(text, "vllm:kv_cache_usage_perc") * blocks)

    stream = client.completions.create(model=server.model, prompt=prompt, max_tokens=NEW, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})  # fmt: skip
    pieces, stop, watcher = [], threading.Event(), None
    for chunk in stream:
        pieces.append(chunk.choices[0].text)
        if watcher is None:  # the prompt is computed and compressed: sample while it decodes
            watcher = threading.Thread(target=sample, args=(stop,))
            watcher.start()
    stop.set()
    watcher.join()
    bounded = math.ceil((heavy + recent + 1) / block_size)
    assert used and max(used) <= bounded + 0.5, (used, bounded)  # never the prompt's ceil(1800 / 16) = 113 blocks
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), past_key_values=h2o_kv.H2OCache(budget=BUDGET, min_entries=256),
                             do_sample=False, max_new_tokens=NEW, pad_token_id=0)  # fmt: skip
    assert "".join(pieces) == tokenizer.decode(out[0, len(prompt) :], skip_special_tokens=True)


def test_an_unknown_h2o_key_or_a_head_adaptive_policy_is_a_400(server, client):
    import openai

    with pytest.raises(openai.BadRequestError) as caught:
        _chat(client, server, h2o_hevy=8)
    message = str(caught.value)
    assert caught.value.status_code == 400 and "h2o_hevy" in message and "h2o_heavy" in message
    assert "h2o_min_entries" in message
    with pytest.raises(openai.BadRequestError, match="ada_h2o gives each KV head its own budget"):
        _chat(client, server, h2o_policy="ada_h2o")
    assert _chat(client, server)  # the server keeps serving
