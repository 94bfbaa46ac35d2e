"""Sweeps (grid, resume, pluggable kinds) and reports (tables, paired comparison, plots)."""

from __future__ import annotations

import json
import os

import pytest
from helpers import needs_data
from typer.testing import CliRunner

from h2o_kv.eval.cli import app
from h2o_kv.eval.kinds import KINDS, Kind, register_kind
from h2o_kv.eval.report import build_report, load_records
from h2o_kv.eval.runner import ModelHandle
from h2o_kv.eval.sweep import cell_name, parse_options, plan_cells, run_sweep
from h2o_kv.harness import records
from h2o_kv.harness.data import data_path

BOOK = "pg19/pg10321_dragons_blood.txt"
pytestmark = pytest.mark.filterwarnings("ignore:H2OCache")


def test_parse_options():
    args = ["--text", "a.txt", "--strip-gutenberg", "--tokens=64", "--window", "8", "--flag"]
    assert parse_options(args) == {
        "text": "a.txt",
        "strip_gutenberg": True,
        "tokens": "64",
        "window": "8",
        "flag": True,
    }
    with pytest.raises(ValueError, match="unexpected argument"):
        parse_options(["stray"])


def test_plan_cells():
    """Unbounded settings (by their policy object, not their name) run once; bounded ones at every budget."""
    cells = plan_cells(["dynamic", "full", "h2o", "local", "h2o", "kvpress:tova"], [0.1, 0.2])
    assert [(c.name, c.budget and c.budget.ratio) for c in cells] == [
        ("dynamic", None), ("full", None), ("h2o", 0.1), ("h2o", 0.2), ("local", 0.1), ("local", 0.2),
        ("kvpress:tova", 0.1), ("kvpress:tova", 0.2),
    ]  # fmt: skip
    assert [cell_name(c) for c in cells[:3] + cells[-1:]] == ["dynamic.json", "full.json", "h2o_b0.1.json",
                                                             "kvpress_tova_b0.2.json"]  # fmt: skip
    with pytest.raises(ValueError, match="--policies must be one of"):
        plan_cells(["h2o", "nope"], [0.1])
    with pytest.raises(ValueError, match="--budgets"):
        plan_cells(["h2o"], [0.0])
    with pytest.raises(ValueError, match="--budgets"):
        plan_cells(["h2o"], [1.5])


@pytest.fixture
def handle(default_model):
    """A ModelHandle holding the already loaded default model (no second load)."""
    handle = ModelHandle()
    handle._model, handle._tokenizer = default_model
    return handle


@pytest.mark.slow
@needs_data(BOOK)
def test_ppl_sweep_resumes_and_reports(tmp_path, handle):
    out = tmp_path / "sweep"
    book = data_path(BOOK)
    options = {"text": str(book), "strip_gutenberg": True, "tokens": "130"}  # two 64-token blocks
    paths = run_sweep("ppl", ["full", "h2o", "local"], [0.25, 0.5], out, options, handle)
    assert sorted(p.name for p in paths) == ["full.json", "h2o_b0.25.json", "h2o_b0.5.json", "local_b0.25.json",
                                             "local_b0.5.json"]  # fmt: skip
    saved = {p.name: json.loads(p.read_text()) for p in paths}
    assert saved["h2o_b0.25.json"]["heavy"] == 16 and saved["h2o_b0.25.json"]["cache"]["kv_tokens"] == 32
    assert saved["full.json"]["cache"]["evicted_tokens"] == 0 and saved["full.json"]["bounded"] is False
    assert saved["local_b0.25.json"]["ppl"] > saved["full.json"]["ppl"]
    (manifest,) = out.glob("sweep-*.json")
    assert json.loads(manifest.read_text())["kind"] == "sweep" and "command" in json.loads(manifest.read_text())

    # resume: only the missing cell runs again
    mtimes = {p.name: p.stat().st_mtime_ns for p in paths}
    (out / "local_b0.5.json").unlink()
    run_sweep("ppl", ["full", "h2o", "local"], [0.25, 0.5], out, options, handle)
    assert (out / "local_b0.5.json").exists() and len(list(out.glob("sweep-*.json"))) == 2  # one manifest per sweep
    assert all(p.stat().st_mtime_ns == mtimes[p.name] for p in paths if p.name != "local_b0.5.json")
    with pytest.raises(ValueError, match="other settings"):
        run_sweep("ppl", ["h2o"], [0.25], out, {**options, "tokens": "129"}, handle)
    relative = os.path.relpath(book)  # the same file named another way is the same sweep
    assert run_sweep("ppl", ["h2o"], [0.25], out, {**options, "text": relative}, handle) == [out / "h2o_b0.25.json"]
    with pytest.raises(ValueError, match="larger than the text|--tokens"):
        run_sweep("ppl", ["h2o"], [0.25], tmp_path / "other", {**options, "tokens": "10000000"}, handle)
    with pytest.raises(ValueError, match="--streaming needs a bounded policy"):  # every cell checked before any runs
        run_sweep("ppl", ["h2o", "full"], [0.5], tmp_path / "tiny", {**options, "streaming": True}, handle)
    assert not list((tmp_path / "tiny").glob("h2o_*.json"))

    # report: tables, the paired comparison with full, a plot
    report_md = tmp_path / "report" / "report.md"
    text = build_report([out], report_md, baselines=("full", "h2o"))
    assert "| policy | 25% | 50% | 100% |" in text
    assert "| full |  |  | " in text and "perplexity change vs full" in text
    h2o_line = next(line for line in text.splitlines() if line.startswith("| h2o |") and "%" in line)
    assert h2o_line.count("[") == 2  # a CI in both budget columns
    vs_h2o = text.split("perplexity change vs h2o")[1]
    local_line = next(line for line in vs_h2o.splitlines() if line.startswith("| local |"))
    assert local_line.count("[") == 2 and "| h2o |" not in vs_h2o.split("![")[0]
    pngs = list(report_md.parent.glob("*.png"))
    assert len(pngs) == 1 and pngs[0].stat().st_size > 10_000 and f"]({pngs[0].name})" in text


def test_report_with_peers_stderr_and_ci(tmp_path):
    common = dict(label="toy task", model="m", primary_metric="acc")
    for policy, budget, acc in (("dynamic", 1.0, 0.8), ("h2o", 0.2, 0.78), ("local", 0.2, 0.5), ("h2o", 0.1, 0.7)):
        metrics = {"acc": acc, "acc_stderr": 0.01, "acc_norm": acc - 0.1, "acc_norm_ci": [acc - 0.15, acc - 0.05]}
        fields = dict(policy=policy, budget=budget, metrics=metrics, **common)
        records.write(tmp_path / f"{policy}_{budget}.json", "tasks", fields)
    fields = dict(policy="kvpress:snapkv", budget=0.2, peer=True, metrics={"acc": 0.75}, **common)
    records.write(tmp_path / "peer.json", "tasks", fields)
    records.write(tmp_path / "sweep-1.json", "sweep", {"evaluation": "tasks"})
    (tmp_path / "notes.json").write_text("[1, 2]")  # not a result: ignored
    assert len(load_records([tmp_path])) == 5
    text = build_report([tmp_path], tmp_path / "out" / "r.md")
    assert "| policy | 10% | 20% | 100% |" in text
    assert "| h2o | 0.700 ± 0.010 | 0.780 ± 0.010 |  |" in text
    assert "| h2o | 0.600 [0.550, 0.650] | 0.680 [0.630, 0.730] |  |" in text  # acc_norm with its CI
    assert "| kvpress:snapkv |  | 0.750 |  |" in text
    assert (tmp_path / "out" / "toy_task_m_acc.png").stat().st_size > 10_000
    assert "perplexity change" not in text


def test_custom_kind_plugs_in_by_name(tmp_path):
    seen = []

    def prepare(options, models):
        if "scale" not in options:
            raise ValueError("--kind toy needs --scale")
        return float(options["scale"])

    def check_cell(scale, setting):
        if setting.name == "random":
            raise ValueError("toy cannot run random")

    def run_cell(scale, setting, path, models, progress):
        budget = setting.fields()["budget"]
        seen.append((setting.name, budget))
        progress(1)
        fields = dict(**setting.fields(), label="toy", metrics={"score": scale * budget})
        return records.write(path, "toy", fields, h2o_cache=False)

    register_kind(Kind("toy", prepare, run_cell, check_cell))
    try:
        runner = CliRunner()
        base = ["sweep", "--kind", "toy", "--policies", "full,h2o", "--budgets", "0.1,0.2"]
        result = runner.invoke(app, [*base, "--out", str(tmp_path / "a"), "--scale", "10"])
        assert result.exit_code == 0, result.output
        assert seen == [("full", 1.0), ("h2o", 0.1), ("h2o", 0.2)]
        assert json.loads((tmp_path / "a" / "h2o_b0.2.json").read_text())["metrics"]["score"] == pytest.approx(2.0)
        assert json.loads((tmp_path / "a" / "h2o_b0.2.json").read_text())["schema"] == records.SCHEMA
        result = runner.invoke(app, [*base, "--out", str(tmp_path / "b")])
        assert result.exit_code == 2 and "needs --scale" in result.output
        result = runner.invoke(app, [*base[:4], "h2o,random", *base[5:], "--out", str(tmp_path / "c"), "--scale", "1"])
        assert result.exit_code == 2 and "cannot run random" in result.output
        result = runner.invoke(app, ["sweep", "--kind", "nope", "--out", str(tmp_path / "d")])
        assert result.exit_code == 2 and "--kind must be one of" in result.output
        result = runner.invoke(app, ["report", str(tmp_path / "a"), "--out", str(tmp_path / "a" / "report.md")])
        assert result.exit_code == 0 and "| h2o | 1.000 | 2.000 |  |" in (tmp_path / "a" / "report.md").read_text()
        (tmp_path / "empty").mkdir()
        result = runner.invoke(app, ["report", str(tmp_path / "empty"), "--out", str(tmp_path / "r.md")])
        assert result.exit_code == 2 and "no result JSONs" in result.output
    finally:
        KINDS.pop("toy")
    assert set(KINDS) == {"ppl", "tasks", "xsum", "needle", "ruler"}


def test_ppl_kind_rejects_unknown_options(tmp_path):
    with pytest.raises(ValueError, match="does not take --bogus"):
        KINDS["ppl"].prepare({"text": "x", "tokens": "4", "bogus": "1"}, ModelHandle())
    with pytest.raises(ValueError, match="needs --text"):
        KINDS["ppl"].prepare({"tokens": "4"}, ModelHandle())
    with pytest.raises(ValueError, match="--tokens must be an integer"):
        KINDS["ppl"].prepare({"text": "x", "tokens": "many"}, ModelHandle())
