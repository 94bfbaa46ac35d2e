"""The quantized-KV quality tables from the result records of scripts/quant_ppl.sh and run_eval.sh.

Usage: python scripts/quant_table.py > results/quant/tables.md

Perplexity, per book: each setting, its change vs h2o (fp32 entries) and vs full, with the 95% interval paired
over the same tokens (batch means over 64-token blocks, h2o_kv.harness.tables.paired), and the peak KV entries.
A baseline
(h2o, full) not run here is taken from results/eval/ppl/<book>/ (the same code path: kv_bits=None is unchanged) and
marked "earlier run". lm-eval tasks and XSUM: the same items as results/eval-tasks/, each setting's paired change
vs h2o (fp32) and vs dynamic (the full cache); a baseline not rerun here comes from results/eval-tasks/ the same way.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

from h2o_kv.eval.report import tasks_table, xsum_table
from h2o_kv.harness.tables import Estimate, markdown, paired

EARLIER = {"h2o": "h2o_b0.2.json", "full": "full.json"}
ORDER = ("full", "dynamic-kv4", "h2o", "h2o-kv8", "h2o-kv4")
LABELS = {
    "full": "full (fp32)",
    "dynamic-kv4": "QuantizedCache 4-bit (quanto, peer)",
    "h2o": "h2o 20% (fp32)",
    "h2o-kv8": "h2o 20% + 8-bit",
    "h2o-kv4": "h2o 20% + 4-bit",
}


def change(record: dict, base: dict | None) -> str:
    """Perplexity change vs ``base`` in %, with the paired 95% interval."""
    if base is None or base is record:
        return ""
    diff = paired(record["block_nll"]["mean"], base["block_nll"]["mean"])
    centre = Estimate(record["nll"] - base["nll"], diff.se)
    value, low, high = (100 * (math.exp(x) - 1) for x in (centre.value, *centre.interval()))
    return f"{value:+.2f}% [{low:+.2f}, {high:+.2f}]"


def ppl_tables(root: Path) -> None:
    for book in sorted(p for p in root.iterdir() if p.is_dir()):
        found, earlier = {}, set()
        for name in ORDER:
            path = book / f"{name}.json"
            if not path.exists() and name in EARLIER:
                path = Path("results/eval/ppl") / book.name / EARLIER[name]
                earlier.add(name)
            if path.exists():
                found[name] = json.loads(path.read_text())
        if not set(found) - earlier:
            continue
        rows = []
        for name, record in found.items():
            label = LABELS[name] + (" (earlier run)" if name in earlier else "")
            rows.append([
                label, f"{record['ppl']:.3f}", change(record, found.get("h2o")), change(record, found.get("full")),
                str(record["cache"]["peak_kv_tokens"]), f"{record['time_s']:.0f}",
            ])  # fmt: skip
        header = ["setting", "ppl", "change vs h2o [95%]", "change vs full [95%]", "peak KV entries", "time s"]
        print(f"#### {book.name} ({next(iter(found.values()))['tokens']} tokens)\n")
        print("\n".join(markdown(header, rows)) + "\n")


EVAL_CELLS = ("dynamic", "dynamic-kv4", "h2o", "h2o-kv8", "h2o-kv4")
EVAL_EARLIER = {"dynamic": "{prefix}_dynamic.json", "h2o": "{prefix}_h2o_b0.2.json"}


def eval_tables(root: Path, prefix: str, title: str) -> None:
    """Tasks (``prefix`` ``tasks``) or XSUM (``xsum200``) vs h2o and vs dynamic, paired over the same items."""
    found, earlier = {}, []
    for name in EVAL_CELLS:
        path = root / f"{prefix}_{name}.json"
        if not path.exists() and name in EVAL_EARLIER:
            path = Path("results/eval-tasks") / EVAL_EARLIER[name].format(prefix=prefix)
            earlier.append(name)
        if path.exists():
            found[name] = json.loads(path.read_text())
    if not set(found) - set(earlier) or "h2o" not in found or "dynamic" not in found:
        return
    table = tasks_table if prefix == "tasks" else xsum_table
    records = list(found.values())
    note = f" ({', '.join(earlier)}: earlier run, results/eval-tasks/)" if earlier else ""
    for base in ("h2o", "dynamic"):
        print(f"#### {title}, paired vs {base}{note}\n")
        print("\n".join(table(records, found[base])) + "\n")


if __name__ == "__main__":
    here = Path(sys.argv[1] if len(sys.argv) > 1 else "results/quant")
    ppl_tables(here / "ppl")
    eval_tables(here, "tasks", "lm-eval tasks (5-shot, 100 items each)")
    eval_tables(here, "xsum200", "XSUM (200 articles)")
