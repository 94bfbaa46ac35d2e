"""The quantized-KV perplexity table from the result records of results/quant/run_ppl.sh.

Usage: python results/quant/table.py [results/quant/ppl] > results/quant/ppl-table.md

Per book: perplexity of each setting, its change vs h2o (fp32 entries) and vs full, with the 95% interval paired
over the same tokens (batch means over 64-token blocks, h2o_kv.tables.paired), and the peak KV entries. A baseline
(h2o, full) not run here is taken from results/eval/ppl/<book>/ (the same code path: kv_bits=None is unchanged) and
marked "earlier run".
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

from h2o_kv.tables import Estimate, markdown, paired

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


def main(root: Path) -> None:
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


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "results/quant/ppl"))
