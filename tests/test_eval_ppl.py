"""Streaming perplexity: the fast stepwise path equals one token per forward and the slow reference; an unbounded
setting's one-forward path equals the stepwise one."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from helpers import needs_data
from reference import reference_logits
from typer.testing import CliRunner

from h2o_kv import H2OCache, load_model
from h2o_kv.eval.cli import app
from h2o_kv.eval.ppl import PPLInputError, PPLJob, read_text, streaming_nll, summarize
from h2o_kv.harness.data import data_path, strip_gutenberg
from h2o_kv.harness.setting import KVSetting
from h2o_kv.hf.compat import cache_kwargs

BOOKS = {
    "pg19/pg10146_reminiscences_of_pioneer_days_in_st_paul.txt": "E-text prepared by Josephine Paolucci",
    "pg19/pg10321_dragons_blood.txt": "Produced by Juliet Sutherland",
}
BOOK = next(iter(BOOKS))
# feeding one token per forward makes every forward a 1-token "prompt" shorter than the budget: expected
pytestmark = pytest.mark.filterwarnings("ignore:H2OCache")


@pytest.fixture(scope="module")
def tiny_llama(tiny_models):
    return load_model(tiny_models["llama"], device="cpu")[0]


def make_cache(policy, heavy, recent, stepwise):
    if policy == "full":
        return H2OCache(policy="full", stepwise=stepwise)
    return H2OCache(heavy, recent, policy=policy, stepwise=stepwise)


@torch.no_grad()
def one_token_at_a_time(model, ids, cache) -> torch.Tensor:
    """The slow definition: one forward per token through an H2OCache, NLL of the next token."""
    nll = []
    for t in range(ids.shape[1] - 1):
        logits = model(ids[:, t : t + 1], **cache_kwargs(cache)).logits[0, -1]
        nll.append(-torch.log_softmax(logits.double(), -1)[ids[0, t + 1]])
    return torch.stack(nll)


def reference_nll(model, ids, heavy, recent, policy) -> torch.Tensor:
    logits = reference_logits(model, ids, heavy, recent, policy).double()
    return -torch.log_softmax(logits[:-1], -1).gather(-1, ids[0, 1:, None])[:, 0]


@pytest.mark.parametrize("policy", ["h2o", "local", "sink", "tova"])
def test_fast_path_equals_token_by_token_and_reference_tiny(tiny_llama, policy):
    ids = torch.randint(3, 500, (1, 64), generator=torch.Generator().manual_seed(3))
    fast = streaming_nll(tiny_llama, ids, make_cache(policy, 6, 6, True), chunk=24)
    slow_cache = make_cache(policy, 6, 6, False)
    slow = one_token_at_a_time(tiny_llama, ids, slow_cache)
    torch.testing.assert_close(fast, slow, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(fast, reference_nll(tiny_llama, ids, 6, 6, policy), atol=1e-5, rtol=1e-5)
    assert slow_cache.stats()["evicted_tokens"] > 0


@pytest.mark.parametrize("policy", ["full", "snapkv", "random"])
def test_fast_path_equals_token_by_token_other_policies(tiny_llama, policy):
    ids = torch.randint(3, 500, (1, 48), generator=torch.Generator().manual_seed(4))
    fast = streaming_nll(tiny_llama, ids, make_cache(policy, 5, 5, True), chunk=17)
    slow = one_token_at_a_time(tiny_llama, ids, make_cache(policy, 5, 5, False))
    torch.testing.assert_close(fast, slow, atol=1e-5, rtol=1e-5)


def test_eviction_changes_the_nll(tiny_llama):
    ids = torch.randint(3, 500, (1, 64), generator=torch.Generator().manual_seed(3))
    full = streaming_nll(tiny_llama, ids, make_cache("full", 0, 0, True))
    small = streaming_nll(tiny_llama, ids, make_cache("h2o", 3, 3, True))
    torch.testing.assert_close(full[:6], small[:6])  # nothing evicted before the budget is reached
    assert (full - small).abs().max() > 1e-3


@pytest.mark.parametrize("chunk", [7, 64])
def test_unbounded_fast_path_equals_stepwise(tiny_llama, tmp_path, chunk):
    """``full`` needs no step-by-step path: one causal forward per chunk gives the stepwise NLLs (and ``dynamic``,
    the stock cache, the same numbers)."""
    ids = torch.randint(3, 500, (1, 64), generator=torch.Generator().manual_seed(5))
    stepwise = streaming_nll(tiny_llama, ids, H2OCache(policy="full", stepwise=True), chunk=chunk)
    text = tmp_path / "t.txt"
    text.write_text("x" * 64)
    for name in ("full", "dynamic"):
        job = PPLJob.create(text, 64, KVSetting(name), chunk=chunk)
        cache = job.make_cache()
        assert not getattr(cache, "stepwise", False) and job.path == "causal chunks (nothing evicted: exact)"
        fast = streaming_nll(tiny_llama, ids, cache, chunk=chunk)
        torch.testing.assert_close(fast, stepwise, atol=1e-5, rtol=1e-5)
    bounded = PPLJob.create(text, 64, KVSetting.of("h2o", budget=0.5), chunk=chunk)
    assert bounded.make_cache().stepwise and bounded.heavy_recent == (16, 16)


# -- text, budgets and bad input -------------------------------------------------------------------------------


@needs_data(*BOOKS)
@pytest.mark.parametrize("name", BOOKS)
def test_strip_gutenberg_real_books(name):
    raw = data_path(name).read_text()
    book = read_text(data_path(name), gutenberg=True)
    assert book.startswith(BOOKS[name])
    assert "*** END" not in book and "***END" not in book and "FULL LICENSE" not in book
    assert len(book) > 0.7 * len(raw)


def test_strip_gutenberg_markers_and_errors():
    text = "h\n*** START OF THIS PROJECT GUTENBERG EBOOK X ***\n\nBody line.\n*** END OF THIS PROJECT GUTENBERG EBOOK"
    assert strip_gutenberg(text) == "Body line."
    two_lines = (
        "h\n***START OF THE PROJECT GUTENBERG EBOOK A LONG\nTITLE***\nBody.\n***END OF THE PROJECT GUTENBERG EBOOK"
    )
    assert strip_gutenberg(two_lines) == "Body."
    with pytest.raises(ValueError, match="START"):
        strip_gutenberg("no markers here")
    with pytest.raises(ValueError, match="END"):
        strip_gutenberg("*** START OF THE PROJECT GUTENBERG EBOOK X ***\nbody")


def test_budget_is_the_one_rule(tmp_path):
    """A ratio of the N evaluated tokens, clamped to one heavy and one recent entry (Budget.split)."""
    text = tmp_path / "t.txt"
    text.write_text("word " * 2000)
    split = lambda setting, tokens=4096: PPLJob.create(text, tokens, setting).heavy_recent  # noqa: E731
    assert split(KVSetting.of("h2o", budget=0.2)) == (409, 409)
    assert split(KVSetting.of("local", heavy=7, recent=3), 100) == (7, 3)
    assert split(KVSetting.of("h2o", budget=0.01), 100) == (1, 1)  # floor(0.5) = 0, clamped
    assert split(KVSetting("full")) == (None, None)


def test_job_rejects_bad_input(tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("a few words of text")
    h2o = KVSetting.of("h2o", budget=0.5)
    with pytest.raises(PPLInputError, match="does not exist"):
        PPLJob.create(tmp_path / "missing.txt", 10, h2o)
    with pytest.raises(PPLInputError, match="larger than the text"):
        PPLJob.create(text, 1000, h2o)
    with pytest.raises(PPLInputError, match="--tokens"):
        PPLJob.create(text, 1, h2o)
    with pytest.raises(PPLInputError, match="--window"):
        PPLJob.create(text, 10, h2o, window=0)
    with pytest.raises(PPLInputError, match="window"):
        PPLJob.create(text, 10, KVSetting.of("snapkv", budget=0.5), policy_options={"window": 0})
    with pytest.raises(PPLInputError, match="--strip-gutenberg: no .*GUTENBERG"):
        PPLJob.create(text, 10, h2o, gutenberg=True)
    with pytest.raises(PPLInputError, match="--streaming needs a bounded policy"):
        PPLJob.create(text, 10, KVSetting("full"), streaming=True)
    with pytest.raises(PPLInputError, match="kvpress"):
        PPLJob.create(text, 10, KVSetting.of("kvpress:tova", budget=0.5))


def test_summarize_windows_and_blocks():
    nll = torch.arange(300, dtype=torch.float64) / 100
    out = summarize(nll, window=128)
    assert out["nll"] == pytest.approx(float(nll.mean())) and out["ppl"] == pytest.approx(math.exp(out["nll"]))
    assert [(w["start"], w["end"]) for w in out["windows"]] == [(1, 129), (129, 257), (257, 301)]
    assert out["windows"][2]["ppl"] == pytest.approx(math.exp(float(nll[256:].mean())))
    assert len(out["block_nll"]) == 300 // 64 and out["nll_stderr"] > 0


# -- command line --------------------------------------------------------------------------------------------


def test_cli_bad_input_fails_before_loading(tmp_path, monkeypatch):
    def boom(*args, **kwargs):
        raise AssertionError("the model must not load for bad input")

    monkeypatch.setattr("h2o_kv.eval.runner.ModelHandle.model", boom)
    runner = CliRunner()
    result = runner.invoke(app, ["ppl", "--text", str(tmp_path / "missing.txt"), "--tokens", "64", "--budget", "0.2"])
    assert result.exit_code == 2 and "does not exist" in result.output
    (tmp_path / "t.txt").write_text("short text")
    result = runner.invoke(app, ["ppl", "--text", str(tmp_path / "t.txt"), "--tokens", "64", "--budget", "0.2"])
    assert result.exit_code == 2 and "larger than the text" in result.output
    result = runner.invoke(app, ["ppl", "--text", str(tmp_path / "t.txt"), "--tokens", "8", "--budget", "2"])
    assert result.exit_code == 2 and "budget must be a ratio in (0, 1]" in result.output
    result = runner.invoke(
        app, ["ppl", "--text", str(tmp_path / "t.txt"), "--tokens", "8", "--policy", "full", "--budget", "0.2"]
    )
    assert result.exit_code == 2 and "full keeps every entry" in result.output and "Traceback" not in result.output


@pytest.mark.parametrize("command", ["ppl", "xsum", "needle"])
def test_a_missing_extra_fails_before_loading(command, monkeypatch):
    """``--policy dynamic --kv-bits 4`` runs transformers' quanto cache: without the extra, one line naming it."""
    monkeypatch.setattr("h2o_kv.harness.setting._installed", lambda module: module != "optimum.quanto")
    monkeypatch.setattr("h2o_kv.eval.runner.ModelHandle.model", lambda *a, **k: pytest.fail("the model loaded"))
    args = ["--text", str(Path(__file__).parents[1] / "README.md"), "--tokens", "8"] if command == "ppl" else []
    result = CliRunner().invoke(app, [command, *args, "--policy", "dynamic", "--kv-bits", "4"])
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert result.output.strip().splitlines() == [
        "error: --policy/--kv-bits: dynamic-kv4 runs transformers' QuantizedCache (optimum-quanto), which is not "
        "installed here: pip install -e '.[quant-peer]'"
    ]


@pytest.mark.slow
@needs_data(BOOK)
def test_cli_writes_result_json(tmp_path, default_model):
    out = tmp_path / "r.json"
    book = data_path(BOOK)
    args = ["ppl", "--text", str(book), "--strip-gutenberg", "--tokens", "48", "--budget", "0.5", "--window", "16"]
    result = CliRunner().invoke(app, [*args, "--policy", "sink", "--json", str(out)])
    assert result.exit_code == 0, result.output
    record = json.loads(out.read_text())
    for key in ("ppl", "nll", "tokens", "policy", "heavy", "recent", "time_s", "settings", "data", "versions", "git",
                "fused_cpu_kernels", "machine", "command", "created", "bounded"):  # fmt: skip
        assert key in record
    assert (record["policy"], record["heavy"], record["recent"], record["tokens"]) == ("sink", 12, 12, 48)
    assert record["metrics"]["ppl"] == pytest.approx(math.exp(record["nll"]))
    assert record["data"]["sha256"] == "c147225ac52a9f97359e8475316759df5e93fd5af3dc611e927430b0fc1d8fe6"
    assert len(record["windows"]) == 3 and record["cache"]["kv_tokens"] == 24
    model, tokenizer = default_model
    job = PPLJob.create(book, 48, KVSetting.of("sink", budget=0.5), gutenberg=True)
    expected = streaming_nll(model, job.token_ids(tokenizer), job.make_cache())
    assert record["nll"] == pytest.approx(float(expected.mean()), abs=1e-5)


@pytest.mark.slow
@needs_data(*BOOKS, "wikitext2/wiki.test.raw.crlf_noblank.txt")
def test_streaming_tuning_stream_is_disjoint_from_the_evaluation_stream(tmp_path, default_model):
    from h2o_kv.eval.streaming_plot import build_stream

    tokenizer = default_model[1]
    evaluation, meta = build_stream(tokenizer, 300, tmp_path)
    tuning, tuning_meta = build_stream(tokenizer, 300, tmp_path, skip_tokens=300)
    assert evaluation != tuning and [s["skip"] for s in tuning_meta["sources"]] == [300, 300, 300]
    assert len(meta["boundaries"]) == len(tuning_meta["boundaries"]) == 2
    assert tuning.read_text()[:120] not in evaluation.read_text()
    assert evaluation.read_text()[:120] not in tuning.read_text()
    with pytest.raises(ValueError, match="--skip-tokens \\+ --part-tokens"):
        build_stream(tokenizer, 300, tmp_path, skip_tokens=10**7)


def test_streaming_recent_share_labels_and_bad_input():
    from h2o_kv.eval.streaming_plot import app as streaming_app
    from h2o_kv.eval.streaming_plot import configurations

    even = configurations([256], ["a2sf"], False, False, 8192, 9000)
    assert even == [("a2sf-256-streaming", "a2sf", 256, True, 9000)]
    assert configurations([256], ["a2sf"], False, False, 8192, 9000, 0.9)[0][0] == "a2sf-256-recent0.9-streaming"
    result = CliRunner().invoke(streaming_app, ["run", "--recent-share", "1"])
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert "--recent-share must be in (0, 1), got 1.0" in result.output


def test_streaming_versus_table_pairs_blocks_within_each_source():
    from h2o_kv.eval.streaming_plot import versus_table

    stream = {"sources": [{"name": "pg19/a_x.txt"}, {"name": "wiki/b_y.txt"}], "boundaries": [128]}

    def record(policy, nll):
        return {"policy": policy, "size": 256, "streaming": True, "tokens": 256, "run": f"{policy}-256-streaming",
                "stream": stream, "block_nll": {"size": 64, "mean": nll}}  # fmt: skip

    sink = record("sink", [2.0, 2.2, 3.0, 3.1])
    a2sf = record("a2sf", [1.9, 2.1, 3.0, 3.1])  # 0.1 nats better on the first source only
    lines = versus_table([sink, a2sf], "sink").splitlines()
    assert lines[0] == "| run (vs sink, same size) | a | b |" and len(lines) == 3
    first, second = lines[2].split(" | ")[1:3]
    assert first.startswith(f"{100 * (math.exp(-0.1) - 1):+.2f}%") and second.startswith("+0.00% [+0.00, +0.00]")
    assert versus_table([sink], "sink") == ""
