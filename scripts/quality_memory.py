"""KV entries kept and KV memory allocated after compressing RULER prompts (docs/quality.md), per h2o-kv setting.

    python scripts/quality_memory.py global_window_h2o+recmax h2o ada_window_h2o+recmax \\
        --budget 0.2 --json results/quality/memory_0.2.json

For the first item of each evaluation-split task (seed 0, 1k tokens, question after): the valid entries over all
layers and KV heads, the key/value bytes allocated (``H2OCache.stats()``: head-adaptive and across-layers policies
store each head's entries packed, plus one free slot per head for the next token) and the bytes a buffer padded to
each layer's largest head would allocate (the layout before packing, ``H2OCache(packed=False)``), each as a fraction
of a full cache of the compressed tokens (the model-wide mean), and each layer's largest head (a fraction of the
prompt).
"""

from __future__ import annotations

import argparse

from h2o_kv.eval.ruler import TASKS, RulerJob, prompt_segments
from h2o_kv.eval.runner import KVRunner
from h2o_kv.harness import records
from h2o_kv.harness.setting import KVSetting
from h2o_kv.harness.tables import mean
from h2o_kv.models import load_model

SUFFIXES = {"+recmax": "max", "+rec": "sum"}


def setting_of(label: str, budget: float) -> KVSetting:
    """``name``, ``name+rec`` or ``name+recmax`` (KVSetting.label's suffixes) at ``budget``."""
    for suffix, statistic in SUFFIXES.items():
        if label.endswith(suffix):
            return KVSetting.of(label[: -len(suffix)], budget=budget, reconstruct=statistic)
    return KVSetting.of(label, budget=budget)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("settings", nargs="+")
    parser.add_argument("--budget", type=float, default=0.2)
    parser.add_argument("--json", required=True)
    args = parser.parse_args()
    model, tokenizer = load_model()
    job = RulerJob.create(KVSetting("dynamic"), tokenizer, lengths="1024", tasks=",".join(TASKS[:5]), n=1, seed=0)
    rows = {}
    for label in args.settings:
        runner = KVRunner(model, setting_of(label, args.budget), tokenizer=tokenizer)
        kept, allocated, padded, largest = [], [], [], []
        for item in job.items():
            compressed, _ = prompt_segments(tokenizer, item, job.protocol)
            cache = runner.prefill(compressed).cache
            layers = cache.layers
            full = sum(layer.keys.shape[1] for layer in layers) * len(compressed)
            kept.append(sum(int(layer.valid.sum()) for layer in layers) / full)
            allocated.append(cache.stats()["kv_ratio"])
            padded.append(sum(layer.slots * layer.keys.shape[1] for layer in layers) / full)
            largest.append([int(layer.entry_count().max()) / len(compressed) for layer in layers])
        row = rows[label] = {
            "kept": mean(kept).value,
            "allocated": mean(allocated).value,
            "allocated_padded": mean(padded).value,
            "largest_head_by_layer": [round(sum(column) / len(column), 3) for column in zip(*largest, strict=True)],
            "items": len(kept),
        }
        print(
            f"{label} @ {100 * args.budget:g}%: kept {row['kept']:.3f}, allocated {row['allocated']:.3f} "
            f"(padded to the largest head: {row['allocated_padded']:.3f})"
        )
    records.write(args.json, "kv-memory-after-prefill", {"budget": args.budget, "tasks": job.tasks, "settings": rows})


if __name__ == "__main__":
    main()
