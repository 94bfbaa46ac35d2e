"""Smoke tests of the benchmark harness (``h2o-kv bench``) on a tiny random model. Timing is never asserted."""

from __future__ import annotations

import importlib.util
import json
import os

import pytest
import torch
from helpers import needs_data
from transformers import DynamicCache

from h2o_kv import H2OCache
from h2o_kv.bench import harness, memory, report, runner, workload
from h2o_kv.bench.cli import app
from h2o_kv.bench.harness import BenchConfig
from h2o_kv.harness.setting import is_bounded
from h2o_kv.hf.compat import cache_kwargs

PG19 = needs_data("pg19")  # the bench prompts are PG-19 text

SMALL = dict(context=64, batch=2, new_tokens=5)


def config(policy: str, **options) -> BenchConfig:
    """A small configuration; evicting settings get the paper's 20% budget."""
    return BenchConfig(policy=policy, budget=0.2 if is_bounded(policy) else None, **{**SMALL, **options})


@pytest.fixture(scope="module")
def tiny():
    """``random:tiny``: the GPU script's code path (random weights of a named shape) at a few MB."""
    return workload.load_bench_model("random:tiny", device="cpu")


@PG19
def test_prompts_are_real_text_distinct_and_deterministic(tiny):
    ids = workload.make_prompts(tiny.tokenizer, 3, 50)
    assert ids.shape == (3, 50) and ids.dtype == torch.long
    assert torch.equal(ids, workload.make_prompts(tiny.tokenizer, 3, 50))
    assert len({tuple(row.tolist()) for row in ids}) == 3
    text = workload.pg19_text()
    assert "*** START" not in text and "*** END" not in text and "PROJECT GUTENBERG LICENSE" not in text.upper()
    with pytest.raises(ValueError, match="length"):
        workload.make_prompts(tiny.tokenizer, 1, 0)


@PG19
@pytest.mark.parametrize("policy", ["dynamic", "full", "h2o", "sink"])
def test_greedy_loop_equals_model_generate(tiny, policy):
    """The harness' decode loop produces exactly the tokens of ``model.generate`` with the same cache."""
    cfg = config(policy)
    prompts = workload.make_prompts(tiny.tokenizer, cfg.batch, cfg.context)
    run = harness._Run(tiny, cfg, cfg.context)
    cache, first = harness._prefill(run, prompts)
    tokens, times = harness.greedy_decode(tiny.model, cache, first, cfg.context, cfg.new_tokens - 1, tiny.device)
    assert len(times) == cfg.new_tokens - 1
    if policy == "dynamic":
        reference_cache = DynamicCache()
    else:
        reference_cache = H2OCache(policy=policy) if policy == "full" else H2OCache(budget=cfg.budget, policy=policy)
    tiny.model.set_attn_implementation("sdpa" if policy == "dynamic" else "h2o")
    expected = tiny.model.generate(
        prompts, attention_mask=torch.ones_like(prompts), **cache_kwargs(reference_cache), do_sample=False,
        max_new_tokens=cfg.new_tokens, min_new_tokens=cfg.new_tokens, pad_token_id=0,
    )[:, cfg.context :]  # fmt: skip
    assert torch.equal(tokens, expected)


@PG19
def test_measure_reports_consistent_numbers(tiny):
    full = harness.measure(tiny, config("dynamic"))
    h2o = harness.measure(tiny, config("h2o"))
    for r in (full, h2o):
        assert r["decode_steps"] == 4 and r["generated_tokens"] == 10
        assert r["e2e_tok_s"] == pytest.approx(10 / (r["prefill_s"] + r["decode_s"]))
        assert r["step_ms_p50"] <= r["step_ms_p99"]
        assert r["prefill_peak_bytes"] >= r["prefill_peak_increase_bytes"] >= 0
        assert r["seq_length_end"] == 64 + 4
    assert full["kv_tokens_per_layer_head_end"] == 68 and full["kept_after_prefill"] is None
    kept = 2 * int(0.2 * 64 / 2)
    assert h2o["kept_after_prefill"] == kept and h2o["kv_tokens_per_layer_head_end"] == kept
    # the bounded cache holds kept + 1 slots of the 68 a full cache holds (plus slot bookkeeping)
    assert h2o["kv_bytes_end"] == full["kv_bytes_end"] * (kept + 1) // 68
    assert h2o["cache_bytes_end"] > h2o["kv_bytes_end"]


@PG19
def test_replicated_prefill_decodes_the_full_batch(tiny):
    r = harness.measure(tiny, config("h2o", batch=4, new_tokens=3, prefill_batch=2))
    assert r["prefill_rows"] == 2 and r["e2e_tok_s"] is None
    assert r["cache_bytes_end"] == 2 * r["cache_bytes_after_prefill"]


def test_peak_memory_sees_an_allocation():
    with memory.PeakMemory(torch.device("cpu")) as peak:
        block = torch.ones(64 * 2**20 // 4)  # 64 MiB, touched
        del block
    assert peak.increase >= 48 * 2**20


def test_parse_sizes_and_limits():
    assert memory.parse_bytes("377MB") == 377 * 10**6 and memory.parse_bytes("1.5GiB") == int(1.5 * 2**30)
    assert runner.parse_limit("dynamic@4") == ("dynamic", 4) and runner.parse_limit("full@2") == ("full", 2)
    assert runner.parse_limit("1kB") == (None, 1000)
    for bad in ("lots", "-5MB", "dynamic@0", "dynamic@x", "h2o@4", "nope@4"):
        with pytest.raises(ValueError, match="memory-limit"):
            runner.parse_limit(bad)


def test_config_validation():
    with pytest.raises(ValueError, match="policy must be one of dynamic"):
        BenchConfig(policy="nope", **SMALL)
    with pytest.raises(ValueError, match="h2o evicts: give budget"):
        BenchConfig(policy="h2o", **SMALL)
    with pytest.raises(ValueError, match="dynamic keeps every entry"):
        BenchConfig(policy="dynamic", budget=0.2, **SMALL)
    assert config("dynamic").key == "dynamic|L=64|B=2|new=5" and config("full").key == "full|L=64|B=2|new=5"
    assert config("h2o").key == "h2o|L=64|B=2|new=5|b=0.2|h=None|r=None"
    with pytest.raises(ValueError, match="context"):
        config("h2o", context=0)
    with pytest.raises(ValueError, match="new_tokens"):
        config("h2o", new_tokens=1)
    with pytest.raises(ValueError, match="prefill_batch"):
        config("h2o", batch=3, prefill_batch=2)


@PG19
def test_grid_alternates_resumes_and_fits_a_memory_limit(tiny, tmp_path):
    settings = runner.RunSettings(model="random:tiny", device="cpu", isolate="none")
    inner = runner.Executor(settings)
    inner._lm = tiny
    calls = []

    def executor(cfg):
        calls.append(cfg.key)
        return inner(cfg)

    grid = [config(p) for p in ("dynamic", "h2o")]
    store = runner.ResultStore(tmp_path / "r.json", {"command": "first"})
    runner.run_measurements(grid, store, runner.RunSettings(repeats=2), executor)
    assert calls == [grid[0].key, grid[1].key, grid[1].key, grid[0].key]  # alternating, reversed on repeat 1
    resumed = runner.ResultStore(tmp_path / "r.json", {"command": "second"})
    runner.run_measurements(grid, resumed, runner.RunSettings(repeats=2), executor)
    assert len(calls) == 4 and len(resumed.records) == 4

    fitted = runner.fit_runs(grid, "dynamic@2", resumed, runner.RunSettings(), executor)
    (fit,) = fitted
    assert fit["config"]["tag"] == "fit" and fit["fits"]
    assert fit["fit_batch"] > 2  # a cache of 13 of 68 entries fits several times the batch
    assert fit["cache_bytes_peak"] <= fit["memory_limit_bytes"]

    saved = report.load(tmp_path / "r.json")
    assert [run["command"] for run in saved["runs"]] == ["first", "second"]  # every invocation, in order
    assert {r["run"] for r in saved["records"]} == {0, 1} and saved["records"][-1]["run"] == 1
    rows = report.summarise(saved["records"])
    by_key = {r["key"]: r for r in rows}
    assert by_key[grid[0].key]["repeats"] == 2
    assert by_key[grid[1].key]["kv_ratio"] < 0.25 and by_key[fit["key"]]["vs"] == grid[0].key
    table = report.markdown_table(rows)
    assert "| h2o (fit) |" in table and "median over its repeats" in table and "decode tok/s (mean)" in table
    model = report.bytes_model(rows)
    assert model and model[0]["ratio_stock"] > model[0]["ratio_ideal"] > 1
    assert report.plot(rows, tmp_path / "p.png").stat().st_size > 0


@pytest.mark.slow
@PG19
def test_worker_process_measures_one_configuration():
    executor = runner.Executor(runner.RunSettings(model="random:tiny", device="cpu", isolate="process"))
    result = executor(config("local", context=32, batch=1, new_tokens=3))
    assert result["isolated_process"] and result["random_init"] and result["model"] == "random:tiny"
    assert result["memory_method"] in ("rss_hwm", "rss_sampled_1ms") and result["decode_steps"] == 2


@PG19
def test_profile_split_adds_up(tiny):
    from h2o_kv.bench.profile import profile_decode

    cfg = BenchConfig(policy="h2o", context=48, batch=2, new_tokens=16, heavy=8, recent=8)
    out = profile_decode(tiny, cfg, steps=4, warmup_steps=1)
    assert sum(out["split_ms"].values()) == pytest.approx(out["step_ms"])
    assert 0 < out["bookkeeping_percent"] < 100 and "aten::" in out["profiler_table"]


@pytest.mark.skipif(  # CI's kvpress job (H2O_KV_REQUIRE_PEERS=1) runs it, and fails where kvpress is missing
    importlib.util.find_spec("kvpress") is None and os.environ.get("H2O_KV_REQUIRE_PEERS") != "1",
    reason="the kvpress peer is optional: pip install 'h2o-kv[peers]'",
)
def test_kvpress_keeps_the_same_number_of_entries(tiny):
    r = harness.measure(tiny, config("kvpress:snapkv", context=100, batch=1, new_tokens=3))
    assert r["kv_tokens_per_layer_head_end"] == 2 * int(0.2 * 100 / 2) + 2  # kept + 2 decoded entries


def test_cli_rejects_bad_input_before_work(tmp_path):
    from typer.testing import CliRunner

    cli = CliRunner()
    out = ["--out", str(tmp_path / "x.json")]
    result = cli.invoke(app, ["run", "--contexts", "0", *out])
    assert result.exit_code != 0 and "--contexts" in result.output
    result = cli.invoke(app, ["run", "--policies", "dynamic,bogus", *out])
    assert result.exit_code != 0 and "--policies must be one of" in result.output
    result = cli.invoke(app, ["run", "--memory-limit", "dynamic@0", *out])
    assert result.exit_code != 0 and "memory-limit" in result.output
    result = cli.invoke(app, ["run", "--fit-only", *out])
    assert result.exit_code != 0 and "--fit-only needs --memory-limit" in result.output
    result = cli.invoke(app, ["run", "--model", "random:tiny", "--contexts", "8192", *out])
    assert result.exit_code != 0 and "positions" in result.output
    result = cli.invoke(app, ["run", "--model", "random:nope", *out])
    assert result.exit_code != 0 and "shape must be one of" in result.output
    result = cli.invoke(app, ["run", "--model", "random:tiny"])  # never into the repository by default
    assert result.exit_code != 0 and "--out" in result.output
    assert not (tmp_path / "x.json").exists()


@pytest.mark.slow
@PG19
def test_a_setting_needing_a_missing_extra_is_refused_before_any_work(monkeypatch, tmp_path):
    """``bench run --policies dynamic --kv-bits 4`` without optimum-quanto: one line naming the extra, exit 2, no
    traceback, nothing measured (the other setting of the grid would otherwise run first)."""
    from typer.testing import CliRunner

    from h2o_kv.harness import setting

    monkeypatch.setattr(setting, "_installed", lambda module: False)
    out = tmp_path / "run.json"
    result = CliRunner().invoke(app, ["run", "--model", "random:tiny", "--contexts", "32", "--batches", "1",
                                      "--policies", "h2o,dynamic", "--kv-bits", "4", "--out", str(out)])  # fmt: skip
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    assert "dynamic-kv4 runs transformers' QuantizedCache (optimum-quanto)" in result.output
    assert "pip install -e '.[quant-peer]'" in result.output and not out.exists()


@PG19
@pytest.mark.parametrize("quanto", [False, True])
def test_kv_memory_defaults_skip_a_missing_extra_before_work(tmp_path, monkeypatch, quanto):
    """``bench kv-memory`` with its default settings: without optimum-quanto the QuantizedCache row is skipped in
    one line naming the extra (not a traceback after the other rows); with it, every default row is measured.
    (``random:tiny`` has head_dim 16, below the quantization group of 64: the default model, 128 tokens.)"""
    from typer.testing import CliRunner

    from h2o_kv.bench import kv_memory
    from h2o_kv.harness import setting

    installed = setting._installed
    if quanto and not installed("optimum.quanto"):
        pytest.skip("optimum-quanto not installed: pip install 'h2o-kv[quant-peer]' (CI job 3 has it)")
    monkeypatch.setattr(
        setting, "_installed", lambda module: quanto if module == "optimum.quanto" else installed(module)
    )
    out = tmp_path / "kv.json"
    result = CliRunner().invoke(app, ["kv-memory", "--tokens", "128", "--json", str(out)])  # the default model
    assert result.exit_code == 0, result.output
    rows = json.loads(out.read_text())["rows"]
    assert all(r["kv_bytes"] > 0 for r in rows) and next(r for r in rows if r["setting"] == "h2o")["vs_full"] < 0.5
    measured = [r["setting"] for r in rows]
    if quanto:
        assert measured == list(kv_memory.SETTINGS) and "skipping" not in result.output
    else:
        assert measured == [s for s in kv_memory.SETTINGS if s != "dynamic-kv4"]
        skip = "skipping dynamic-kv4: it needs the quant-peer extra (pip install 'h2o-kv[quant-peer]')"
        assert skip in result.output and result.output.index(skip) < result.output.index("dynamic N=")
