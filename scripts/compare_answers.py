"""How many answers two evaluation records share, item by item (e.g. the same items through `h2o-kv serve` and in
process): RULER records pair by (task, length, index), needle records by (length, depth).

    python scripts/compare_answers.py results/quality/n100/question_in_prompt/server/ruler-eval/h2o_0.2.json \\
        results/quality/n100/question_in_prompt/ruler-eval/h2o_0.2.json
    python scripts/compare_answers.py results/quality/cpu/2048/question_in_prompt/ruler-eval/kvpress_kvzip_0.2.json \\
        results/quality/h200/2048/question_in_prompt/ruler-eval/kvpress_kvzip_0.2.items.jsonl --common  # CPU vs GPU

A record is a result JSON or the item log of an unfinished cell (``*.items.jsonl``: a settings line, then one item
per line). Prints ``equal/paired`` and each differing pair; exits 1 when a pair differs or (without ``--common``,
which pairs only the items both ran) an item has no partner.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def load(path: Path) -> dict:
    if path.name.endswith(".items.jsonl"):
        return {"kind": "ruler", "items": [json.loads(line) for line in path.read_text().splitlines()[1:] if line]}
    return json.loads(path.read_text())


def answers(record: dict) -> dict[tuple, str]:
    if record["kind"] == "needle":
        return {(c["length"], c["depth"]): c["answer"] for c in record["cells"]}
    return {(i["task"], i["length"], i["index"]): i["answer"] for i in record["items"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("first", type=Path)
    parser.add_argument("second", type=Path)
    parser.add_argument("--common", action="store_true", help="pair only the items both ran")
    args = parser.parse_args()
    first, second = (answers(load(path)) for path in (args.first, args.second))
    if args.common:
        first, second = ({k: v for k, v in side.items() if k in first and k in second} for side in (first, second))
    differ = [key for key in first if key in second and first[key] != second[key]]
    unpaired = set(first) ^ set(second)
    print(f"{len(first) - len(differ) - len(set(first) - set(second))}/{len(set(first) & set(second))} answers equal")
    for key in differ:
        print(f"  {key}: {first[key]!r} | {second[key]!r}")
    if unpaired:
        print(f"  {len(unpaired)} items without a partner")
    raise SystemExit(1 if differ or unpaired else 0)


if __name__ == "__main__":
    main()
