"""Result records you can trust: every field of the shared schema, a recorded command that reruns, the one data-path
lookup, and the shared statistics."""

from __future__ import annotations

import json
import math
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import needs_data

from h2o_kv import Budget
from h2o_kv.harness import records
from h2o_kv.harness.data import ENV, data_dir, data_path, strip_gutenberg
from h2o_kv.harness.setting import KVSetting
from h2o_kv.harness.tables import Z95, Estimate, average, markdown, mean, median, over_groups, paired, percentile

ROOT = Path(__file__).resolve().parents[1]


def test_command_line_is_the_command_as_typed(monkeypatch):
    monkeypatch.delenv("H2O_KV_FUSED", raising=False)
    monkeypatch.delenv("H2O_KV_DATA", raising=False)
    monkeypatch.delenv("H2O_KV_CACHE_DIR", raising=False)
    script = ["/venv/bin/python3", "/venv/bin/h2o-kv", "bench", "run", "--out", "a b.json"]
    assert records.command_line(script) == "h2o-kv bench run --out 'a b.json'"  # not "h2o-kv bench bench run"
    assert records.command_line(["/venv/bin/h2o-kv", "eval", "ppl"]) == "h2o-kv eval ppl"
    module = ["/usr/bin/python3.11", "-m", "h2o_kv.eval.cli", "ppl", "--tokens", "8"]
    assert records.command_line(module) == "python -m h2o_kv.eval.cli ppl --tokens 8"
    monkeypatch.setenv("H2O_KV_FUSED", "0")
    assert records.command_line(["x/h2o-kv", "bench", "profile"]) == "H2O_KV_FUSED=0 h2o-kv bench profile"


def test_a_record_carries_its_provenance(tmp_path):
    data = records.write(tmp_path / "r.json", "toy", {"policy": "h2o", "metrics": {"x": 1.0}}, device="cpu")
    assert json.loads((tmp_path / "r.json").read_text()) == data
    assert data["schema"] == records.SCHEMA and data["kind"] == "toy" and data["metrics"] == {"x": 1.0}
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    assert data["git"]["commit"] == head and isinstance(data["git"]["dirty"], bool)
    assert data["fused_cpu_kernels"] in (True, False)  # an H2OCache on the CPU: whether the kernels served it
    assert records.record("toy", {}, device="cuda:0")["fused_cpu_kernels"] is None  # no H2OCache on the CPU
    assert records.record("toy", {}, device="cpu", h2o_cache=False)["fused_cpu_kernels"] is None
    versions = data["versions"]
    assert {"python", "h2o-kv", "torch", "transformers"} <= set(versions)
    assert data["machine"]["cpu_count"] == os.cpu_count() and data["machine"]["platform"]
    assert data["command"] == records.command_line() and data["created"].endswith("+0000")


def test_dirty_flag_sees_an_uncommitted_source_file():
    probe = ROOT / "src" / "h2o_kv" / "_dirty_probe.py"
    records.git_state.cache_clear()
    try:
        probe.write_text("# an uncommitted change\n")
        assert records.git_state()["dirty"] is True
    finally:
        probe.unlink()
        records.git_state.cache_clear()


def test_bounded_comes_from_the_record_or_the_setting():
    assert records.bounded({"policy": "full"}) is False and records.bounded({"policy": "dynamic"}) is False
    assert records.bounded({"policy": "kvpress:tova"}) is True and records.bounded({"policy": "h2o"}) is True
    assert records.bounded({"policy": "h2o", "bounded": False}) is False  # the record's own field wins


@needs_data("pg19/pg10146_reminiscences_of_pioneer_days_in_st_paul.txt")
def test_recorded_bench_command_reruns(tmp_path):
    """The command a bench file records is the one that ran, and running it again reproduces the measurement grid."""
    first = tmp_path / "first.json"
    args = ["--model", "random:tiny", "--contexts", "32", "--batches", "1", "--policies", "dynamic,h2o",
            "--new-tokens", "3", "--isolate", "none", "--out", str(first)]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    subprocess.run([sys.executable, "-m", "h2o_kv.bench.cli", "run", *args], env=env, check=True, capture_output=True)
    saved = json.loads(first.read_text())
    command = saved["runs"][0]["command"]
    assert command.endswith(shlex.join(["python", "-m", "h2o_kv.bench.cli", "run", *args]))
    words = shlex.split(command)
    while "=" in words[0]:  # H2O_KV_* variables that were set: part of the command
        name, _, value = words.pop(0).partition("=")
        env[name] = value
    assert words[0] == "python"
    again = tmp_path / "again.json"
    subprocess.run([sys.executable, *words[1:-1], str(again)], env=env, check=True, capture_output=True)
    keys = [r["key"] for r in json.loads(again.read_text())["records"]]
    assert (
        keys
        == [r["key"] for r in saved["records"]]
        == ["dynamic|L=32|B=1|new=3", "h2o|L=32|B=1|new=3|b=0.2|h=None|r=None"]
    )


# -- the shared data folder --------------------------------------------------------------------------------------


def test_data_folder_lookup(tmp_path, monkeypatch):
    monkeypatch.setenv(ENV, str(tmp_path))
    (tmp_path / "pg19").mkdir()
    assert data_dir() == tmp_path and data_path("pg19") == tmp_path / "pg19"
    with pytest.raises(FileNotFoundError, match=r"pg19/missing.txt not found .*\$H2O_KV_DATA"):
        data_path("pg19/missing.txt")
    monkeypatch.setenv(ENV, str(tmp_path / "nowhere"))
    with pytest.raises(FileNotFoundError, match=r"\$H2O_KV_DATA is .*nowhere, which is not a folder"):
        data_dir()
    monkeypatch.delenv(ENV)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError, match=r"set \$H2O_KV_DATA to the folder holding MANIFEST.md"):
        data_dir()
    (tmp_path / "shared" / "data").mkdir(parents=True)
    assert data_dir() == tmp_path / "shared" / "data"  # ./shared/data
    checkout = tmp_path / "checkout"
    checkout.mkdir()
    monkeypatch.chdir(checkout)
    assert data_dir() == tmp_path / "shared" / "data"  # ../shared/data, next to the checkout


def test_gutenberg_stripper_is_strict():
    text = (
        "licence\n*** START OF THE PROJECT GUTENBERG EBOOK X ***\r\nBody.\r\n*** END OF THE PROJECT GUTENBERG EBOOK X"
    )
    assert strip_gutenberg(text) == "Body."
    for broken in ("Body only.", "*** START OF THE PROJECT GUTENBERG EBOOK X ***\nBody."):
        with pytest.raises(ValueError, match="marker found"):
            strip_gutenberg(broken)


# -- one budget rule, one statistics module ----------------------------------------------------------------------


@pytest.mark.parametrize("length", [1, 3, 7, 100, 4096])
def test_every_setting_counts_entries_with_budget(length):
    """h2o-kv policies and kvpress presses keep Budget.entries(L), clamped to one heavy and one recent entry."""
    for ratio in (0.01, 0.2, 1.0):
        expected = Budget(ratio=ratio).entries(length)
        assert expected == min(length, 2 * max(1, math.floor(ratio * length / 2)))
        for name in ("h2o", "sink", "kvpress:snapkv"):
            assert KVSetting.of(name, budget=ratio).entries(length) == expected
    assert KVSetting("dynamic").entries(length) == KVSetting("full").entries(length) == length


def test_statistics():
    m = mean([1.0, 2.0, 3.0, 4.0])
    assert m.value == 2.5 and m.se == pytest.approx(math.sqrt(5 / 3 / 4)) and m.statistic == "mean"
    d = paired([3.0, 5.0, 4.0], [1.0, 2.0, 4.0])
    assert d.value == pytest.approx(5 / 3) and d.statistic == "paired mean difference"
    with pytest.raises(ValueError, match="same items"):
        paired([1.0], [1.0, 2.0])
    a = average([Estimate(0.5, 0.3), Estimate(0.1, 0.4)])
    assert a.value == pytest.approx(0.3) and a.se == pytest.approx(0.25)
    assert median([5.0, 1.0, 3.0]) == Estimate(3.0, None, 3, "median")
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5 and math.isnan(percentile([], 50))
    assert Estimate(-0.00001, 0.0082).format(100, 2, sign=True) == "+0.00 ± 0.82"  # no "-0.00"
    assert Estimate(0.5, 0.1).format(interval=True) == "0.50 [0.30, 0.70]"
    assert markdown(["a", "b"], [["x", "1"]]) == ["| a | b |", "|---|---:|", "| x | 1 |"]


def test_intervals_are_bootstrap_within_the_items_range():
    """Means of items get percentile-bootstrap intervals: a paired difference of 0/1 items never runs past -1 (the
    normal interval of these five items, -0.80 ± 1.96 * 0.2, would reach -1.19), and the same items give the same
    interval every time."""
    worse = paired([0, 0, 0, 0, 0], [1, 1, 1, 1, 0])
    low, high = worse.interval()
    assert worse.value == pytest.approx(-0.8) and low == pytest.approx(-1.0) and high == pytest.approx(-0.4)
    assert worse.value - Z95 * worse.se < -1.0  # what the normal interval would have said
    assert paired([0, 0, 0, 0, 0], [1, 1, 1, 1, 0]).interval() == (low, high)  # reproducible
    assert mean([1.0] * 7).interval() == (1.0, 1.0)  # no spread, no interval width
    # the stratified bootstrap of a mean over groups: inside the groups' range, and tighter than either group alone
    groups = [mean([0, 1, 1, 0, 1, 1, 0, 1]), mean([1, 1, 0, 1, 0, 0, 1, 1])]
    combined = average(groups)
    c_low, c_high = combined.interval()
    assert 0 <= c_low < combined.value < c_high <= 1
    assert c_high - c_low < min(high - low for low, high in (g.interval() for g in groups))
    # a suite of equal-sized groups (2 items per task) resamples all items together, not two per task
    suite = over_groups([[0, 1], [1, 1], [0, 0]])
    assert suite.value == pytest.approx(0.5) and suite.n == 6
    assert suite.interval() == mean([0, 1, 1, 1, 0, 0]).interval()
    uneven = over_groups([[0, 1, 1], [1]])
    assert uneven.value == pytest.approx((2 / 3 + 1) / 2) and uneven.statistic == "average of 2 means"
    with pytest.raises(ValueError, match="some group"):
        over_groups([[1.0], []])
    # an estimate known only by its standard error (e.g. lm-eval's acc_stderr) keeps the normal interval
    assert Estimate(0.5, 0.1).interval() == pytest.approx((0.304, 0.696))


def test_src_tree_names_the_sources_as_they_ran(tmp_path):
    def git(*args):
        return subprocess.run(["git", "-C", str(tmp_path), *args], capture_output=True, text=True, check=True).stdout

    git("init", "-q")
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a.py").write_text("x = 1\n")
    git("add", "src")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "one")
    assert records.src_tree(tmp_path) == git("rev-parse", "HEAD:src").strip()
    (tmp_path / "src" / "b.py").write_text("y = 2\n")  # untracked: part of what runs
    changed = records.src_tree(tmp_path)
    assert changed != git("rev-parse", "HEAD:src").strip()
    git("add", "src")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "two")
    assert changed == git("rev-parse", "HEAD:src").strip()
    assert git("status", "--porcelain") == ""  # the scratch object store left the checkout untouched
