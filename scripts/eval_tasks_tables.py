"""Markdown tables for docs/eval-tasks.md from the result JSONs in this folder (and the needle heatmap).

    python scripts/eval_tasks_tables.py > /tmp/tables.md    # also redraws needle_heatmaps.png

Every setting ran on the same items as ``dynamic`` (the stock DynamicCache), so a change in accuracy (or ROUGE) is
the mean of item-by-item differences with its standard error; "mean" averages the per-task numbers and combines
their standard errors (:mod:`h2o_kv.harness.tables`, through :mod:`h2o_kv.eval.report`).
"""

from __future__ import annotations

import sys
from pathlib import Path

from h2o_kv.eval.needle import plot_heatmaps
from h2o_kv.eval.report import load_records, needle_table, order, tasks_delta_table, tasks_table, xsum_table

HERE = Path(__file__).parent.parent / "results" / "eval-tasks"
BASELINE = "dynamic"


def load(pattern: str) -> tuple[list[dict], dict | None]:
    """The records of the files matching ``pattern``, and the baseline's among them."""
    found = load_records(sorted(HERE.glob(pattern)))
    return found, next((r for r in found if r["policy"] == BASELINE), None)


def main() -> None:
    out = []
    for title, pattern in (("prefill protocol", "tasks_[!p]*.json"), ("paper protocol", "tasks_paper_*.json")):
        found, base = load(pattern)
        if base is not None:
            out += [f"### lm-eval, {title}", "", *tasks_table(found, base), ""]
            out += [f"Paired change of acc vs {BASELINE} (points):", "", *tasks_delta_table(found, base), ""]
            out += [f"Paired change of acc_norm vs {BASELINE} (points):", ""]
            out += [*tasks_delta_table(found, base, "acc_norm"), ""]
    for title, pattern in (("XSUM", "xsum_*.json"), ("XSUM, 200 articles", "xsum200_*.json")):
        found, base = load(pattern)
        if base is not None:
            out += [f"### {title}", "", *xsum_table(found, base), ""]
    needles, _ = load("needle_*.json")
    if needles:
        out += ["### needle", "", *needle_table(needles), ""]
        plot_heatmaps(sorted(needles, key=order), HERE / "needle_heatmaps.png")
    sys.stdout.write("\n".join(out) + "\n")


if __name__ == "__main__":
    main()
