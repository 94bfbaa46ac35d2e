"""Markdown tables for docs/eval-tasks.md from the result JSONs in this folder.

    python results/eval-tasks/tables.py > /tmp/tables.md    # also redraws needle_heatmaps.png

Paired differences: every policy ran on the same items as ``full``, so the change in accuracy (or ROUGE) is the
mean of per-item differences, with the standard error of that mean (much tighter than comparing two unpaired
accuracies); "mean" averages the per-task numbers and combines their standard errors.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

HERE = Path(__file__).parent
TASKS = ("piqa", "openbookqa", "rte", "mathqa", "hellaswag", "lambada")


def load(pattern: str) -> list[dict]:
    return [json.loads(p.read_text()) | {"_file": p.name} for p in sorted(HERE.glob(pattern))]


def paired(values: list[float], base: list[float]) -> tuple[float, float]:
    diffs = [a - b for a, b in zip(values, base, strict=True)]
    mean = sum(diffs) / len(diffs)
    var = sum((d - mean) ** 2 for d in diffs) / (len(diffs) - 1) if len(diffs) > 1 else 0.0
    return mean, math.sqrt(var / len(diffs))


def name(record: dict) -> str:
    return record["policy"] + (" (kvpress)" if record.get("peer") else "")


def order(record: dict) -> tuple:
    return (record["policy"] != "full", bool(record.get("peer")), record["policy"])


def tasks_table(records: list[dict]) -> list[str]:
    full = next(r for r in records if r["policy"] == "full")
    lines = [
        "| setting | " + " | ".join(TASKS) + " | mean acc | Δ mean vs full (paired ± se) | KV kept |",
        "|---|" + "---:|" * (len(TASKS) + 3),
    ]
    for record in sorted(records, key=order):
        cells, deltas = [], []
        for task in TASKS:
            row = record["tasks"].get(task)
            if row is None:
                cells.append("")
                continue
            cells.append(f"{100 * row['acc']:.1f} ± {100 * row['acc_stderr']:.1f}")
            deltas.append(paired(record["items"][task]["acc"], full["items"][task]["acc"]))
        mean_delta = sum(d for d, _ in deltas) / len(deltas)
        mean_se = math.sqrt(sum(s * s for _, s in deltas)) / len(deltas)
        delta = "" if record is full else f"{100 * mean_delta:+.2f} ± {100 * mean_se:.2f}"
        lines.append(
            f"| {name(record)} | " + " | ".join(cells) + f" | {100 * record['metrics']['mean_acc']:.2f} | {delta} "
            f"| {100 * record['kv_kept_ratio']:.1f}% |"
        )
    return lines


def tasks_delta_table(records: list[dict], metric: str = "acc") -> list[str]:
    """Paired change vs full per task (points), for ``acc`` or ``acc_norm`` (tasks that have it)."""
    full = next(r for r in records if r["policy"] == "full")
    tasks = [t for t in TASKS if metric in full["items"].get(t, {})]
    lines = ["| setting | " + " | ".join(tasks) + " | mean |", "|---|" + "---:|" * (len(tasks) + 1)]
    for record in sorted(records, key=order):
        if record is full:
            continue
        deltas = [paired(record["items"][t][metric], full["items"][t][metric]) for t in tasks]
        cells = [f"{100 * d:+.1f} ± {100 * se:.1f}" for d, se in deltas]
        mean = sum(d for d, _ in deltas) / len(deltas)
        mean_se = math.sqrt(sum(se * se for _, se in deltas)) / len(deltas)
        lines.append(f"| {name(record)} | " + " | ".join(cells) + f" | {100 * mean:+.2f} ± {100 * mean_se:.2f} |")
    return lines


def xsum_table(records: list[dict]) -> list[str]:
    full = next(r for r in records if r["policy"] == "full")
    lines = [
        "| setting | ROUGE-1 | ROUGE-2 | ROUGE-L | ROUGE-2 / full | Δ ROUGE-2 vs full (paired ± se) | KV kept |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for record in sorted(records, key=order):
        m = record["metrics"]
        d, se = paired(record["items"]["rouge2"], full["items"]["rouge2"])
        delta = "" if record is full else f"{100 * d:+.2f} ± {100 * se:.2f}"
        lines.append(
            f"| {name(record)} | {100 * m['rouge1']:.2f} ± {100 * m['rouge1_stderr']:.2f} "
            f"| {100 * m['rouge2']:.2f} ± {100 * m['rouge2_stderr']:.2f} "
            f"| {100 * m['rougeL']:.2f} ± {100 * m['rougeL_stderr']:.2f} "
            f"| {m['rouge2'] / full['metrics']['rouge2']:.0%} | {delta} | {100 * record['kv_kept_ratio']:.1f}% |"
        )
    return lines


def needle_table(records: list[dict]) -> list[str]:
    lengths = records[0]["lengths"]
    lines = [
        "| setting | " + " | ".join(f"{n} tokens" for n in lengths) + " | all |",
        "|---|" + "---:|" * (len(lengths) + 1),
    ]
    for record in sorted(records, key=order):
        m = record["metrics"]
        lines.append(
            f"| {name(record)} | " + " | ".join(f"{m[f'score_{n}']:.2f}" for n in lengths) + f" | {m['score']:.2f} |"
        )
    return lines


def main() -> None:
    out = []
    for title, pattern in (("prefill protocol", "tasks_[!p]*.json"), ("paper protocol", "tasks_paper_*.json")):
        records = load(pattern)
        if records and any(r["policy"] == "full" for r in records):
            out += [f"### lm-eval, {title}", "", *tasks_table(records), ""]
            out += ["Paired change of acc vs full (points):", "", *tasks_delta_table(records), ""]
            out += ["Paired change of acc_norm vs full (points):", "", *tasks_delta_table(records, "acc_norm"), ""]
    for title, pattern, table in (
        ("XSUM", "xsum_*.json", xsum_table),
        ("XSUM, 200 articles", "xsum200_*.json", xsum_table),
        ("needle", "needle_*.json", needle_table),
    ):
        records = load(pattern)
        if records and (table is needle_table or any(r["policy"] == "full" for r in records)):
            out += [f"### {title}", "", *table(records), ""]
    needles = sorted(load("needle_*.json"), key=order)
    if needles:
        from h2o_kv.eval.needle import plot_heatmaps

        plot_heatmaps(needles, HERE / "needle_heatmaps.png")
    sys.stdout.write("\n".join(out) + "\n")


if __name__ == "__main__":
    main()
