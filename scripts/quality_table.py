"""The RULER tables of docs/quality.md and the README leaderboard, from the result records of one folder.

    python scripts/quality_table.py results/quality/ruler-eval [--baseline dynamic] [--budget 0.2]
    python scripts/quality_table.py results/quality/ruler-dev-split results/quality/ruler-dev/dynamic.json
    python scripts/quality_table.py results/quality/h200/2048/question_in_prompt/ruler-eval --partial \
        --tasks niah_single,niah_multikey --baseline kvpress:kvzip   # unfinished cells, on their finished tasks
    python scripts/quality_table.py results/quality/n100/question_after/ruler-eval \
        results/quality/words/question_after/ruler-eval --merge   # the 5-task suite and cwe/fwe: one 7-task mean

Paths are folders (their ``*.json``) or record files.

Rows: one KV setting; columns: each task's mean score (items scored by string_match_all), the suite mean (mean over
tasks) with its 95% interval, and the paired difference with the baseline over the same items (mean over tasks of
the item-by-item differences over the items both ran, 95% interval). Reads only the JSON records (with
``--partial`` also the item logs of unfinished cells, ``*.items.jsonl``: rows marked "partial"); prints markdown.
``--merge`` joins a setting's records of different tasks (one run of the five retrieval tasks, another of
``cwe``/``fwe``) into one row over all their tasks; a row missing a task is left out, named on stderr.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from h2o_kv.eval.report import row_name
from h2o_kv.harness.tables import markdown, mean, over_groups


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("paths", type=Path, nargs="+")
    parser.add_argument("--baseline", default="dynamic")
    parser.add_argument("--budget", type=float, default=None, help="only the bounded settings at this budget")
    parser.add_argument("--partial", action="store_true", help="also the item logs of unfinished cells")
    parser.add_argument("--tasks", default=None, help="only these tasks (comma-separated)")
    parser.add_argument("--merge", action="store_true", help="one row per setting over the tasks of its records")
    parser.add_argument("--digits", type=int, default=2, help="decimals of the paired change and its interval")
    args = parser.parse_args()
    if not 0 <= args.digits <= 6:
        parser.error(f"--digits must be an integer in [0, 6], got {args.digits}")
    files = [file for path in args.paths for file in (sorted(path.glob("*.json")) if path.is_dir() else [path])]
    records = [json.loads(p.read_text()) for p in files]
    records = [r for r in records if r.get("kind") == "ruler"]
    if args.partial:
        logs = [log for path in args.paths if path.is_dir() for log in sorted(path.glob("*.items.jsonl"))]
        records += [
            unfinished(log) for log in logs if not log.with_name(log.name[: -len(".items.jsonl")] + ".json").exists()
        ]
    if args.tasks:
        chosen = args.tasks.split(",")
        records = [dict(r, tasks=chosen, items=[i for i in r["items"] if i["task"] in chosen]) for r in records]
    records = [r for r in records if args.budget is None or not r["bounded"] or r["budget"] == args.budget]
    if not records:
        raise SystemExit(f"Error: no ruler records in {' '.join(map(str, args.paths))}")
    if args.merge:
        records = merged(records)
    tasks = max((r["tasks"] for r in records), key=len) if args.merge else records[0]["tasks"]
    base = next((r for r in records if r["policy"] == args.baseline), None)
    header = ["setting", *tasks, "mean [95% CI]", f"vs {args.baseline} (paired) [95% CI]", "items", "kept"]
    rows = []
    for r in sorted(records, key=lambda r: (r["bounded"], row_name(r))):
        by_task = {t: [i for i in r["items"] if i["task"] == t] for t in tasks}
        if not all(by_task.values()):
            print(f"skipped {row_name(r)}: no items of {[t for t in tasks if not by_task[t]]}", file=sys.stderr)
            continue
        suite = over_groups([[i["score"] for i in by_task[t]] for t in tasks])
        delta = ""
        if base is not None and r is not base:
            base_score = {(i["task"], i["length"], i["index"]): i["score"] for i in base["items"]}
            key = lambda i: (i["task"], i["length"], i["index"])  # noqa: E731
            diffs = [[i["score"] - base_score[key(i)] for i in by_task[t] if key(i) in base_score] for t in tasks]
            delta = over_groups(diffs, "paired difference").format(digits=args.digits, sign=True, interval=True)
        setting = row_name(r)
        if r["bounded"]:
            setting += f" @ {100 * r['budget']:g}%" if r.get("budget") is not None else f" @ {r['heavy']}+{r['recent']}"
        rows.append([
            setting, *(f"{mean([i['score'] for i in by_task[t]]).value:.2f}" for t in tasks),
            suite.format(digits=2, interval=True), delta, str(len(r["items"])),
            "partial" if r.get("partial") else f"{r['kv_kept_ratio']:.2f}",
        ])  # fmt: skip
    print("\n".join(markdown(header, rows)))


def merged(records: list[dict]) -> list[dict]:
    """One record per setting (name, budget, protocol), its records' items and tasks joined; two records of one
    setting sharing a task are an error (which one would count?)."""
    groups: dict[tuple, list[dict]] = {}
    for r in records:
        key = (row_name(r), r["bounded"], r.get("budget"), r.get("heavy"), r.get("recent"), r.get("protocol"))
        groups.setdefault(key, []).append(r)
    joined = []
    for group in groups.values():
        tasks = list(dict.fromkeys(t for r in group for t in r["tasks"]))
        if len(tasks) < sum(len(r["tasks"]) for r in group):
            raise SystemExit(f"Error: --merge: two records of {row_name(group[0])} share a task")
        items = [i for r in group for i in r["items"]]
        kept = sum(r.get("kv_kept_ratio", 0) * len(r["items"]) for r in group) / max(1, len(items))
        partial = any(r.get("partial") for r in group)
        joined.append(dict(group[0], tasks=tasks, items=items, kv_kept_ratio=kept, partial=partial))
    return joined


def unfinished(log: Path) -> dict:
    """The record-like view of an unfinished cell's item log: its settings line, then one item per line."""
    lines = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    settings, items = lines[0]["settings"], [line for line in lines[1:] if "score" in line]
    tasks = list(dict.fromkeys(i["task"] for i in items))
    return {"kind": "ruler", **settings, "tasks": tasks, "items": items, "partial": True}


if __name__ == "__main__":
    main()
