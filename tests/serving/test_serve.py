"""``h2o-kv serve``: option errors without vLLM, and a real vLLM server (one per module) answering the ``openai``
client, enforcing its API key, bound to 127.0.0.1, and surviving a short load-and-fault soak.

The server tests need vLLM (``pip install 'h2o-kv[vllm]'``) and skip with that reason where it is missing.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

HAS_VLLM = getattr(importlib.util.find_spec("vllm"), "origin", None) is not None  # not tests/serving as a namespace
needs_vllm = pytest.mark.skipif(not HAS_VLLM, reason="vLLM is not installed (pip install 'h2o-kv[vllm]')")
PORT = int(os.environ.get("H2O_KV_TEST_SERVE_PORT", "8201"))  # a port in this project's test range
API_KEY = "test-key-h2o"
CONTEXT = 2048

# -- option errors: one line, exit status 2, before torch or vLLM is imported -----------------------------------

CHECK_SCRIPT = (
    "import sys\nfrom h2o_kv.cli import app\ntry:\n    app(sys.argv[1:])\nexcept SystemExit as done:\n"
    "    code = done.code\nheavy = {'torch', 'transformers', 'vllm'} & set(sys.modules)\n"
    "assert not heavy, heavy\nsys.exit(code)"
)


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", CHECK_SCRIPT, *args], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize(
    "args, names",
    [
        (["--policy", "bogus"], "--policy"),
        (["--policy", "h2o"], "--budget"),
        (["--policy", "h2o", "--heavy", "-1", "--recent", "4"], "--heavy"),
        (["--policy", "h2o", "--heavy", "8"], "--recent"),
        (["--policy", "h2o", "--budget", "1.5"], "--budget"),
        (["--policy", "h2o", "--budget", "0.2", "--heavy", "4", "--recent", "4"], "--budget"),
        (["--policy", "full", "--heavy", "4", "--recent", "4"], "--policy full"),
        (["--policy", "full", "--port", "70000"], "--port"),
        (["--policy", "full", "--kv-cache-gb", "0"], "--kv-cache-gb"),
        (["--policy", "full", "--max-model-len", "0"], "--max-model-len"),
        (["--policy", "full", "--dtype", "int8"], "--dtype"),
        (["--policy", "full", "--model", "/no/such/dir"], "--model"),
        (["--policy", "full", "--", "--port", "9"], "--port"),
        (["--policy", "full", "--no-such-option"], "--no-such-option"),
        (["--policy", "h2o", "--budget", "0.2", "--dtype", "bfloat16"], "--dtype bfloat16"),  # fp32 cache only
        (["--policy", "ada_h2o", "--budget", "0.2"], "ada_h2o"),  # per-head budgets: not in the server
        (["--policy", "global_h2o", "--budget", "0.2"], "global_h2o"),
        (["--policy", "h2o", "--heavy", "8", "--recent", "8", "--min-entries", "64"], "--min-entries"),
        (["--policy", "h2o", "--budget", "0.2", "--min-entries", "-1"], "--min-entries"),
        (["--policy", "full", "--min-entries", "64"], "--min-entries"),
        (["--policy", "h2o", "--budget", "0.2", "--", "--kv-transfer-config", "{}"], "--kv-transfer-config"),
        (["--policy", "h2o", "--budget", "0.2", "--", "--kv-cache-dtype=fp8"], "--kv-cache-dtype"),
    ],
)
def test_a_bad_option_is_one_line_naming_it_before_vllm_starts(args, names):
    done = run_cli("serve", *args)
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert done.stdout == "" and done.stderr.count("\n") == 1, done.stderr
    assert done.stderr.startswith("error: ") and "Traceback" not in done.stderr
    assert names in done.stderr, done.stderr


@needs_vllm
def test_a_model_the_backend_cannot_run_is_one_line_before_vllm_starts(tmp_path):
    """A sliding-window model (its config is enough: the check reads it before vLLM starts)."""
    from transformers import MistralConfig

    MistralConfig(num_hidden_layers=2, sliding_window=64).save_pretrained(tmp_path)
    done = subprocess.run([sys.executable, "-m", "h2o_kv.cli", "serve", "--model", str(tmp_path), "--policy", "h2o",
                           "--budget", "0.2"], capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert done.stderr.startswith("error: --model ") and "sliding-window attention" in done.stderr


def test_help_is_fast_and_lists_the_options():
    done = run_cli("serve", "--help")
    assert done.returncode == 0, done.stderr
    for option in ("--policy", "--heavy", "--recent", "--budget", "--min-entries", "--kv-cache-gb", "--host", "--port",
                   "--api-key", "--max-model-len"):  # fmt: skip
        assert option in done.stdout


def test_the_command_is_vllms_server_with_the_setting_in_the_environment(tmp_path):
    from h2o_kv.vllm.config import ENV, ServeConfig
    from h2o_kv.vllm.serve import ServeOptions, flag, serve_command

    if not HAS_VLLM:
        pytest.skip("vLLM is not installed")
    options = ServeOptions(ServeConfig("full"), kv_cache_gb=0.25, port=8299, api_key="k", extra=("--seed", "3"))
    argv, env = serve_command(options, tmp_path)
    assert ENV not in env  # full: the plugin (if installed) changes nothing
    assert argv[argv.index("--host") + 1] == "127.0.0.1" and argv[argv.index("--port") + 1] == "8299"
    assert argv[argv.index("--kv-cache-memory-bytes") + 1] == str(2**28)
    assert argv[argv.index("--dtype") + 1] == "float32" and argv[-2:] == ["--seed", "3"]
    assert "vllm" in " ".join(argv[:4])
    assert flag("enable_prefix_caching", False) == ["--no-enable-prefix-caching"]
    config = ServeConfig("h2o", heavy=8, recent=8)
    assert flag("max_num_seqs", 4) == ["--max-num-seqs", "4"]
    assert [f for k, v in config.engine_args().items() for f in flag(k, v)] == ["--no-enable-prefix-caching"]


def test_served_processes_keep_no_onednn_primitive_cache_unless_told(tmp_path, monkeypatch):
    """oneDNN's own primitive cache grew the worker for a whole soak (h2o_kv.vllm.heap): off by default, the start
    line shows it, and a value the user set is kept."""
    from h2o_kv.vllm.config import ServeConfig
    from h2o_kv.vllm.serve import ServeOptions, describe, serve_command

    if not HAS_VLLM:
        pytest.skip("vLLM is not installed")
    monkeypatch.delenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", raising=False)
    argv, env = serve_command(ServeOptions(ServeConfig("h2o", heavy=8, recent=8), port=8299), tmp_path)
    assert env["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == "0"
    assert describe(argv, env).startswith("ONEDNN_PRIMITIVE_CACHE_CAPACITY=0 H2O_KV_VLLM=")
    monkeypatch.setenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "256")
    assert (
        serve_command(ServeOptions(ServeConfig("full"), port=8299), tmp_path)[1]["ONEDNN_PRIMITIVE_CACHE_CAPACITY"]
        == "256"
    )


# -- a real server ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    if not HAS_VLLM:
        pytest.skip("vLLM is not installed (pip install 'h2o-kv[vllm]')")
    from h2o_kv.vllm.config import ServeConfig
    from h2o_kv.vllm.serve import ServeOptions, ServerProcess

    log = tmp_path_factory.mktemp("serve") / "server.log"
    options = ServeOptions(ServeConfig("full"), port=PORT, api_key=API_KEY, kv_cache_gb=0.25, max_model_len=CONTEXT)
    with ServerProcess(options, log=log, startup_timeout=420) as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0)


MESSAGES = [{"role": "user", "content": "Name three colours."}]


@needs_vllm
@pytest.mark.slow
def test_chat_completion_and_its_stream_agree(server, client):
    reply = client.chat.completions.create(model=server.model, messages=MESSAGES, max_tokens=24, temperature=0)
    text = reply.choices[0].message.content
    assert text.strip() and reply.usage.completion_tokens <= 24 and reply.usage.prompt_tokens > 5
    chunks = list(client.chat.completions.create(model=server.model, messages=MESSAGES, max_tokens=24,
                                                 temperature=0, stream=True))  # fmt: skip
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert len(chunks) > 3  # really streamed, not one message
    assert streamed == text  # greedy: the stream carries the same tokens
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")


@needs_vllm
@pytest.mark.slow
def test_api_key_is_enforced_and_only_loopback_is_bound(server):
    from h2o_kv.bench.soak import auth_checks, listen_addresses

    auth = auth_checks(server.url, server.model, API_KEY)
    assert (auth["no_key"], auth["wrong_key"], auth["right_key"]) == (401, 401, 200)
    assert listen_addresses(server.pid, PORT) == ["127.0.0.1"]


@needs_vllm
@pytest.mark.slow
@pytest.mark.data
def test_short_soak_with_disconnects_and_bad_requests(server):
    from h2o_kv.bench.soak import SoakConfig, run_soak
    from h2o_kv.harness.data import has_data

    if not has_data("pg19"):
        pytest.skip("the shared data folder (pg19) is missing: set $H2O_KV_DATA")
    cfg = SoakConfig(clients=5, duration_s=8, disconnect_fraction=0.4, max_tokens=(8, 24), warmup_fraction=0.5)
    result = run_soak(server, cfg, api_key=API_KEY, context=CONTEXT, h2o_active=False,
                      progress=lambda _: None)  # fmt: skip
    checks = result["checks"]
    accounting = result["accounting"]
    assert accounting["requests"] >= cfg.clients and accounting["disconnected"] >= 1, accounting
    assert accounting["error"] == 0, accounting["error_samples"]
    for name in ("server_kept_serving", "every_request_accounted", "none_lost_or_duplicated",
                 "kv_usage_back_to_zero", "api_key_enforced", "binds_loopback_only"):  # fmt: skip
        assert checks[name], (name, accounting["engine_finished"], accounting["requests"], result["drain"])
    by_case = {row["case"]: row for row in result["bad_requests"]}
    for case in ("prompt longer than the context", "negative max_tokens", "huge max_tokens", "malformed JSON"):
        assert 400 <= by_case[case]["status"] < 500 and by_case[case]["message"], by_case[case]
        assert by_case[case]["healthy_after"], case
    # RSS flatness needs minutes of load to mean anything; the 5-minute soak checks it (docs/serving.md)
