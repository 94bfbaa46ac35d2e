"""scripts/leaderboard.py: each cell is the setting's score and its paired change vs the full cache, computed from
the records' items (a hand count here), and the table names every setting and benchmark found."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def load_leaderboard():
    spec = importlib.util.spec_from_file_location("leaderboard", ROOT / "scripts" / "leaderboard.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def ruler_record(policy, scores, budget=None, dirty=False):
    items = [{"task": task, "length": 1024, "index": i, "score": s} for (task, i), s in scores.items()]
    git = {"commit": "abc", "dirty": dirty}
    return {"kind": "ruler", "policy": policy, "budget": budget, "tasks": ["a", "b"], "items": items, "git": git}


def test_paired_change_against_the_full_cache_by_hand(tmp_path, monkeypatch, capsys):
    folder = tmp_path / "results" / "quality" / "ruler-eval"
    folder.mkdir(parents=True)
    full = {("a", 0): 1.0, ("a", 1): 1.0, ("b", 0): 0.5, ("b", 1): 0.0}
    mine = {("a", 0): 1.0, ("a", 1): 0.0, ("b", 0): 0.0, ("b", 1): 0.0}
    (folder / "dynamic.json").write_text(json.dumps(ruler_record("dynamic", full)))
    (folder / "h2o_0.2.json").write_text(json.dumps(ruler_record("h2o", mine, 0.2)))
    legacy = dict(ruler_record("h2o", full, 0.2), git=None)  # the same setting measured before: the trusted one wins
    (folder / "h2o_0.2_z_legacy.json").write_text(json.dumps(legacy))
    (folder / "h2o_0.4.json").write_text(json.dumps(ruler_record("h2o", full, 0.4, dirty=True)))  # its own row
    record = dict(ruler_record("window_h2o", full, 0.2), reconstruct="max")
    (folder / "window_h2o+recmax_0.2.json").write_text(json.dumps(record))
    monkeypatch.chdir(tmp_path)
    board = load_leaderboard()
    assert set(board.collect([0.2])["RULER 1k, question after (10)"]) == {
        "dynamic",
        "h2o @ 20%",
        "window_h2o+recmax @ 20%",
    }
    table = board.collect()
    assert list(table) == ["RULER 1k, question after (10)"]  # benchmarks without records are left out
    cells = table["RULER 1k, question after (10)"]
    assert set(cells) == {"dynamic", "h2o @ 20%", "h2o @ 40%", "window_h2o+recmax @ 20%"}
    assert cells["dynamic"][1] is None and cells["h2o @ 40%"][1].value == 0
    score, change, trusted = cells["h2o @ 20%"]
    assert trusted and not cells["h2o @ 40%"][2]  # a dirty record is marked
    assert score.value == pytest.approx((0.5 + 0.0) / 2)  # mean over tasks of the task means
    assert change.value == pytest.approx(((0.0 - 1.0) / 2 + (0.0 - 0.5) / 2) / 2)  # paired, item by item
    monkeypatch.setattr("sys.argv", ["leaderboard.py", "--plot", str(tmp_path / "board.png")])
    board.main()
    out = capsys.readouterr().out
    assert "| h2o @ 20% | 0.25 (-0.38 [" in out and (tmp_path / "board.png").stat().st_size > 0
    assert "| h2o @ 40% | 0.62 (+0.00 [+0.00, +0.00]) † |" in out
    monkeypatch.setattr("sys.argv", ["leaderboard.py", "--settings", "window_h2o+recmax", "--budgets", "0.2"])
    board.main()
    out = capsys.readouterr().out
    assert "| window_h2o+recmax @ 20% | 0.62 (+0.00 [" in out and "| dynamic | 0.62 |" in out and "| h2o @" not in out


def test_quality_table_reads_folders_and_files_and_labels_count_budgets(tmp_path, monkeypatch, capsys):
    """scripts/quality_table.py: a folder and a record file together; a heavy/recent budget is labelled by its
    counts; the paired change is against the baseline's same items."""
    spec = importlib.util.spec_from_file_location("quality_table", ROOT / "scripts" / "quality_table.py")
    table = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(table)
    full = {("a", 0): 1.0, ("a", 1): 1.0, ("b", 0): 0.5, ("b", 1): 0.0}
    mine = {("a", 0): 1.0, ("a", 1): 0.0, ("b", 0): 0.0, ("b", 1): 0.0}
    (tmp_path / "runs").mkdir()
    counts = dict(ruler_record("h2o", mine), heavy=9, recent=1, bounded=True, kv_kept_ratio=0.1)
    (tmp_path / "runs" / "h2o_h9_r1.json").write_text(json.dumps(counts))
    base = dict(ruler_record("dynamic", full), bounded=False, kv_kept_ratio=1.0)
    (tmp_path / "dynamic.json").write_text(json.dumps(base))
    monkeypatch.setattr("sys.argv", ["quality_table.py", str(tmp_path / "runs"), str(tmp_path / "dynamic.json")])
    table.main()
    out = capsys.readouterr().out
    assert "| h2o @ 9+1 | 0.50 | 0.00 | 0.25 [" in out and "| -0.38 [" in out and "| dynamic | 1.00 | 0.25 |" in out


def test_quality_table_reads_an_unfinished_cell_on_its_finished_tasks(tmp_path, monkeypatch, capsys):
    """--partial: an item log without its record is a row marked partial; --tasks keeps the tasks every row
    finished, and the paired change covers the items both ran."""
    spec = importlib.util.spec_from_file_location("quality_table", ROOT / "scripts" / "quality_table.py")
    table = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(table)
    full = {("a", 0): 1.0, ("a", 1): 1.0, ("b", 0): 0.5, ("b", 1): 0.0}
    (tmp_path / "dynamic.json").write_text(json.dumps(dict(ruler_record("dynamic", full), bounded=False,
                                                           kv_kept_ratio=1.0)))  # fmt: skip
    settings = {"settings": {"policy": "h2o", "bounded": True, "budget": 0.2, "peer": False, "reconstruct": None}}
    items = [{"task": "a", "length": 1024, "index": 0, "score": 0.0}, {"task": "a", "length": 1024, "index": 1,
             "score": 1.0}]  # fmt: skip
    log = tmp_path / "h2o_0.2.items.jsonl"
    log.write_text("\n".join(json.dumps(line) for line in [settings, *items]) + "\n")
    monkeypatch.setattr("sys.argv", ["quality_table.py", str(tmp_path)])
    table.main()
    assert "h2o" not in capsys.readouterr().out  # item logs only with --partial
    monkeypatch.setattr("sys.argv", ["quality_table.py", str(tmp_path), "--partial", "--tasks", "a"])
    table.main()
    out = capsys.readouterr().out
    assert "| h2o @ 20% | 0.50 | 0.50 [" in out and "| -0.50 [" in out and "| 2 | partial |" in out
    monkeypatch.setattr("sys.argv", ["quality_table.py", str(tmp_path), "--partial"])
    table.main()
    captured = capsys.readouterr()
    assert "h2o @ 20%" not in captured.out and "skipped h2o: no items of ['b']" in captured.err


def test_quality_table_merges_one_settings_records_of_different_tasks(tmp_path, monkeypatch, capsys):
    """--merge: a setting's run of tasks a/b and its run of task c are one row over the three tasks (mean over tasks,
    paired over all items); two records of one setting sharing a task are refused; without --merge, a separate row."""
    spec = importlib.util.spec_from_file_location("quality_table", ROOT / "scripts" / "quality_table.py")
    table = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(table)

    def write(folder, name, policy, scores, tasks):
        record = dict(ruler_record(policy, scores, None if policy == "dynamic" else 0.2), tasks=tasks,
                      bounded=policy != "dynamic", kv_kept_ratio=1.0 if policy == "dynamic" else 0.2)  # fmt: skip
        (folder / name).write_text(json.dumps(record))

    suite, words = tmp_path / "suite", tmp_path / "words"
    suite.mkdir(), words.mkdir()
    write(suite, "dynamic.json", "dynamic", {("a", 0): 1.0, ("b", 0): 1.0}, ["a", "b"])
    write(suite, "h2o_0.2.json", "h2o", {("a", 0): 1.0, ("b", 0): 0.0}, ["a", "b"])
    write(words, "dynamic.json", "dynamic", {("c", 0): 0.5, ("c", 1): 0.5}, ["c"])
    write(words, "h2o_0.2.json", "h2o", {("c", 0): 0.5, ("c", 1): 0.0}, ["c"])
    monkeypatch.setattr("sys.argv", ["quality_table.py", str(suite), str(words), "--merge"])
    table.main()
    out = capsys.readouterr().out
    # h2o: task means 1.0, 0.0, 0.25 -> 0.42; paired: (0 + -1 + -0.25) / 3 = -0.42
    assert "| h2o @ 20% | 1.00 | 0.00 | 0.25 | 0.42 [" in out and "| -0.42 [" in out and "| 4 | 0.20 |" in out
    assert "| dynamic | 1.00 | 1.00 | 0.50 | 0.83 [" in out
    monkeypatch.setattr("sys.argv", ["quality_table.py", str(suite), str(suite / "h2o_0.2.json"), "--merge"])
    with pytest.raises(SystemExit, match="two records of h2o share a task"):
        table.main()


def test_compare_answers_counts_equal_answers_item_by_item(tmp_path):
    import subprocess
    import sys

    def record(answers):
        items = [{"task": "a", "length": 1024, "index": i, "answer": text} for i, text in enumerate(answers)]
        return json.dumps({"kind": "ruler", "items": items})

    (tmp_path / "x.json").write_text(record(["1", "2"]))
    (tmp_path / "y.json").write_text(record(["1", "3"]))
    script = str(ROOT / "scripts" / "compare_answers.py")
    same = subprocess.run([sys.executable, script, str(tmp_path / "x.json"), str(tmp_path / "x.json")],
                          capture_output=True, text=True)  # fmt: skip
    assert same.returncode == 0 and same.stdout.startswith("2/2 answers equal")
    differ = subprocess.run([sys.executable, script, str(tmp_path / "x.json"), str(tmp_path / "y.json")],
                            capture_output=True, text=True)  # fmt: skip
    assert differ.returncode == 1 and differ.stdout.startswith("1/2 answers equal") and "'2' | '3'" in differ.stdout
    log = tmp_path / "z.items.jsonl"  # an unfinished cell: its settings line, then the one item it ran
    log.write_text('{"settings": {}}\n' + json.dumps({"task": "a", "length": 1024, "index": 0, "answer": "1"}) + "\n")
    unpaired = subprocess.run(
        [sys.executable, script, str(tmp_path / "x.json"), str(log)], capture_output=True, text=True
    )
    assert unpaired.returncode == 1 and "1 items without a partner" in unpaired.stdout
    common = subprocess.run([sys.executable, script, str(tmp_path / "y.json"), str(log), "--common"],
                            capture_output=True, text=True)  # fmt: skip
    assert common.returncode == 0 and common.stdout.startswith("1/1 answers equal")


def test_a_dirty_record_is_trusted_when_a_commit_holds_its_sources():
    import subprocess

    board = load_leaderboard()
    first = subprocess.run(
        ["git", "-C", str(ROOT), "rev-list", "--max-parents=0", "HEAD"], capture_output=True, text=True
    )
    tree = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", f"{first.stdout.split()[0]}:src"], capture_output=True, text=True
    ).stdout.strip()
    copied = {"git": {"commit": "abc", "dirty": True, "src_tree": tree}}  # an older .git beside committed sources
    assert board.trusted(copied)
    assert not board.trusted({"git": {"commit": "abc", "dirty": True, "src_tree": "0" * 40}})
    assert not board.trusted({"git": {"commit": None, "dirty": False}})


def test_h2o_kv_settings_with_options_sort_before_the_presses():
    """A setting's options (``snapkv:kernel=21``) hold a colon too: only ``kvpress:`` names a press."""
    board = load_leaderboard()
    found = ["kvpress:kvzip @ 20%", "snapkv:kernel=21 @ 20%", "dynamic", "h2o @ 10%", "kvpress:kvzip @ 10%"]
    assert sorted(found, key=board.order) == [
        "dynamic",
        "h2o @ 10%",
        "kvpress:kvzip @ 10%",
        "snapkv:kernel=21 @ 20%",
        "kvpress:kvzip @ 20%",
    ]
