"""``h2o-kv serve`` with real H2O eviction: the server's greedy tokens equal the transformers backend's at the same
budget, it streams, a valid per-request setting is honoured, and an invalid one is an HTTP 400 that leaves the
server serving. Skips where vLLM is not installed.
"""

from __future__ import annotations

import importlib.util
import os

import pytest

HAS_VLLM = getattr(importlib.util.find_spec("vllm"), "origin", None) is not None  # not tests/serving as a namespace
pytestmark = [
    pytest.mark.skipif(not HAS_VLLM, reason="vLLM is not installed (pip install 'h2o-kv[vllm]')"),
    pytest.mark.slow,
]
PORT = int(os.environ.get("H2O_KV_TEST_SERVE_PORT", "8201")) + 1
HEAVY = RECENT = 8
PROMPT = "The water cycle is the path that water follows as it moves between the air, the land and the sea. It begins"
NEW = 24


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from h2o_kv.vllm.config import ServeConfig
    from h2o_kv.vllm.serve import ServeOptions, ServerProcess

    log = tmp_path_factory.mktemp("serve-h2o") / "server.log"
    options = ServeOptions(ServeConfig("h2o", heavy=HEAVY, recent=RECENT), port=PORT, kv_cache_gb=0.25,
                           max_model_len=1024)  # fmt: skip
    with ServerProcess(options, log=log, startup_timeout=420) as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def reference():
    """Greedy tokens of the transformers backend with the same budget: ``reference(heavy, recent) -> token ids``."""
    import torch

    import h2o_kv

    model, tokenizer = h2o_kv.load_model()
    model.generation_config.eos_token_id = None
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids

    def generate(heavy: int, recent: int) -> tuple[list[int], list[int]]:
        with torch.no_grad():
            out = model.generate(ids, past_key_values=h2o_kv.H2OCache(heavy=heavy, recent=recent), do_sample=False,
                                 max_new_tokens=NEW, pad_token_id=0)  # fmt: skip
        return ids[0].tolist(), out[0, ids.shape[1] :].tolist()

    return generate


def _text(client, server, prompt_ids, **extra) -> str:
    reply = client.completions.create(model=server.model, prompt=prompt_ids, max_tokens=NEW, temperature=0,
                                      extra_body={"ignore_eos": True, **extra})  # fmt: skip
    assert reply.usage.completion_tokens == NEW
    return reply.choices[0].text


def test_server_evicts_like_the_transformers_backend(server, client, reference):
    from h2o_kv import load_model

    _, tokenizer = load_model()
    prompt_ids, expected = reference(HEAVY, RECENT)
    assert len(prompt_ids) > HEAVY + RECENT  # the prompt is compressed: eviction really runs
    assert _text(client, server, prompt_ids) == tokenizer.decode(expected, skip_special_tokens=True)


def test_per_request_setting_is_honoured(server, client, reference):
    from h2o_kv import load_model

    _, tokenizer = load_model()
    prompt_ids, expected = reference(4, 4)
    text = _text(client, server, prompt_ids, vllm_xargs={"h2o_heavy": 4, "h2o_recent": 4})
    assert text == tokenizer.decode(expected, skip_special_tokens=True)


def test_invalid_per_request_setting_is_a_400_and_the_server_keeps_serving(server, client):
    import openai

    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=server.model, prompt="Hello", max_tokens=4,
                                  extra_body={"vllm_xargs": {"h2o_heavy": -1, "h2o_recent": 4}})  # fmt: skip
    assert caught.value.status_code == 400 and "heavy" in str(caught.value)
    with pytest.raises(openai.BadRequestError, match="policy"):
        client.completions.create(model=server.model, prompt="Hello", max_tokens=4,
                                  extra_body={"vllm_xargs": {"h2o_policy": "bogus"}})  # fmt: skip
    reply = client.completions.create(model=server.model, prompt="Hello", max_tokens=4, temperature=0)
    assert reply.choices[0].text and reply.usage.completion_tokens == 4


def test_chat_stream_equals_the_reply(server, client):
    messages = [{"role": "user", "content": "Explain the water cycle in two sentences."}]
    reply = client.chat.completions.create(model=server.model, messages=messages, max_tokens=NEW, temperature=0)
    chunks = list(client.chat.completions.create(model=server.model, messages=messages, max_tokens=NEW,
                                                 temperature=0, stream=True))  # fmt: skip
    assert len(chunks) > 3
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == reply.choices[0].message.content
