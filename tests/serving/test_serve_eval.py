"""``h2o-kv eval ruler/needle --server``: the items of a transformers run, sent through ``h2o-kv serve``'s OpenAI
API (issue 23 part 3). With eviction at 20% of each prompt the server's answers equal the transformers backend's
item for item (h2o, the server's retrieval policy ``snapkv:kernel=21``, and the full cache as ``h2o_policy: full``
on the same evicting server), the record says where the items ran, and the resumable item log is the server's own.
One server for the module; skips without vLLM.
"""

from __future__ import annotations

import importlib.util
import json
import os

import pytest
from helpers import needs_data

from h2o_kv.eval.needle import HAYSTACK_DIR

HAS_VLLM = getattr(importlib.util.find_spec("vllm"), "origin", None) is not None  # not tests/serving as a namespace
pytestmark = [
    pytest.mark.skipif(not HAS_VLLM, reason="vLLM is not installed (pip install 'h2o-kv[vllm]')"),
    pytest.mark.slow,
]
haystack = needs_data(HAYSTACK_DIR)
PORT = int(os.environ.get("H2O_KV_TEST_SERVE_PORT", "8201")) + 4
BUDGET = 0.2


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from h2o_kv.vllm.config import ServeConfig
    from h2o_kv.vllm.serve import ServeOptions, ServerProcess

    log = tmp_path_factory.mktemp("serve-eval") / "server.log"
    options = ServeOptions(ServeConfig("h2o", budget=BUDGET, min_entries=0), port=PORT, kv_cache_gb=0.25,
                           max_model_len=1024)  # fmt: skip
    with ServerProcess(options, log=log, startup_timeout=600) as running:
        yield running


@pytest.fixture(scope="module")
def default_model():
    from h2o_kv import load_model

    return load_model()


@haystack
@pytest.mark.parametrize("policy", ["h2o", "snapkv:kernel=21", "dynamic"])
def test_ruler_through_the_server_equals_the_transformers_backend(server, default_model, policy, tmp_path):
    from h2o_kv.eval.ruler import RulerJob, run_ruler
    from h2o_kv.eval.server import ServerRunner
    from h2o_kv.harness.setting import KVSetting

    model, tokenizer = default_model
    setting = KVSetting.of(policy, budget=None if policy == "dynamic" else BUDGET)
    job = RulerJob.create(setting, tokenizer, lengths="512", tasks="niah_single,niah_multivalue,vt", n=2,
                          protocol="question_in_prompt")  # fmt: skip
    local = run_ruler(job, model, tokenizer, model_name="m")
    runner = ServerRunner(server.url, setting)
    path = tmp_path / "served.json"
    served = run_ruler(job, None, tokenizer, path, model_name="m", runner=runner)
    assert [i["answer"] for i in served["items"]] == [i["answer"] for i in local["items"]]
    assert served["metrics"] == local["metrics"]
    if policy != "dynamic":  # eviction is real: a fifth of each ~500-token prompt
        assert all(i["kept"] == 2 * int(BUDGET * i["prompt_tokens"] / 2) < i["prompt_tokens"] for i in served["items"])
        assert runner.xargs == {"h2o_policy": policy, "h2o_budget": BUDGET, "h2o_min_entries": 0}
    else:
        assert runner.xargs == {"h2o_policy": "full"}
    record = json.loads(path.read_text())
    assert record["server"]["url"] == server.url and record["server"]["vllm"] and record["server"]["vllm_xargs"]
    assert record["fused_cpu_kernels"] is None  # nothing ran in this process


@haystack
def test_needle_and_the_cli_through_the_server(server, default_model, tmp_path):
    """The CLI end to end (no model loads in the client); the needle's cell equals the transformers backend's."""
    from typer.testing import CliRunner

    from h2o_kv.eval.cli import app
    from h2o_kv.eval.needle import NeedleJob, run_needle
    from h2o_kv.harness.setting import KVSetting

    model, tokenizer = default_model
    path = tmp_path / "needle.json"
    args = ["needle", "--server", server.url, "--policy", "h2o", "--budget", str(BUDGET), "--lengths", "600",
            "--depths", "50", "--json", str(path)]  # fmt: skip
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    served = json.loads(path.read_text())
    job = NeedleJob.create(KVSetting.of("h2o", budget=BUDGET), "600", "50", tokenizer)
    local = run_needle(job, model, tokenizer, model_name="m")
    assert served["cells"][0]["answer"] == local["cells"][0]["answer"]
    assert served["cells"][0]["kept"] < served["cells"][0]["prompt_tokens"]
    refused = CliRunner().invoke(app, ["ruler", "--server", server.url, "--policy", "global_window_h2o",
                                       "--budget", "0.2", "--protocol", "question_in_prompt"])  # fmt: skip
    assert refused.exit_code == 2 and "shares one budget across all layers" in refused.output
