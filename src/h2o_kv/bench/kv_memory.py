"""``h2o-kv bench kv-memory``: the KV memory needed to hold N tokens of context, from the byte counts of real caches.

For each context length ``N`` and setting, a cache is built by the model itself - a prefill of ``N`` tokens of
PG-19 text (batch 1) and one decode step - and its key/value storage is counted
(:func:`h2o_kv.bench.memory.cache_bytes`: codes, scales, zero points and full-precision rings or residuals
included; bookkeeping such as positions and scores is reported apart). Settings: the full cache (``dynamic``, fp32),
``h2o`` at the budget, ``h2o`` with 8-bit and 4-bit entries (``H2OCache(kv_bits=...)``), and transformers' own
``QuantizedCache`` (quanto, 4-bit) holding everything; that one needs the ``quant-peer`` extra, and where it is
missing its rows are skipped, with one line saying so, before any work.
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from ..harness.setting import KVSetting
from ..hf.compat import cache_kwargs
from .memory import cache_bytes
from .workload import load_bench_model, make_prompts

SETTINGS = ("dynamic", "h2o", "h2o-kv8", "h2o-kv4", "dynamic-kv4")


def missing_extras(labels) -> dict[str, str]:
    """label -> the extra it needs and this environment lacks (``dynamic-kvB``: transformers' quanto cache)."""
    missing = {label: setting_of(label, 0.2).missing_extra() for label in labels}
    return {label: extra for label, extra in missing.items() if extra is not None}


def setting_of(label: str, budget: float) -> KVSetting:
    name, _, bits = label.partition("-kv")
    return KVSetting.of(name, budget=budget if name != "dynamic" else None, kv_bits=int(bits) if bits else None)


@torch.no_grad()
def measure(lm, setting: KVSetting, tokens: int) -> dict[str, Any]:
    """Bytes of ``setting``'s cache after a ``tokens``-token prefill and one decode step."""
    ids = make_prompts(lm.tokenizer, 1, tokens, vocab_size=lm.model.config.vocab_size).to(lm.device)
    lm.model.set_attn_implementation("h2o" if setting.uses_h2o_cache else "sdpa")
    try:
        cache = setting.make_cache(prompt_length=tokens, config=lm.model.config)
        out = lm.model(input_ids=ids, **cache_kwargs(cache), use_cache=True, logits_to_keep=1)
        lm.model(input_ids=out.logits[:, -1:].argmax(-1), **cache_kwargs(cache), use_cache=True, logits_to_keep=1)
    finally:
        lm.model.set_attn_implementation("h2o")
    kv, total = cache_bytes(cache)
    held = cache.kept_entries() if hasattr(cache, "kept_entries") else cache.get_seq_length()
    return {"tokens": tokens + 1, "kv_bytes": kv, "bookkeeping_bytes": total - kv, "entries_held": held}


def run(tokens: list[int], budget: float, labels=SETTINGS, model=None, progress=print) -> dict[str, Any]:
    """Measure ``labels`` at each of ``tokens``; a setting whose extra is missing is skipped (said in one line)."""
    skipped = missing_extras(labels)
    for label, extra in skipped.items():
        print(f"skipping {label}: it needs the {extra} extra (pip install 'h2o-kv[{extra}]')", file=sys.stderr)
    labels = [label for label in labels if label not in skipped]
    lm = load_bench_model(model, device="cpu", dtype="float32")
    rows = []
    for n in tokens:
        for label in labels:
            row = {"setting": label, **setting_of(label, budget).fields(), **measure(lm, setting_of(label, budget), n)}
            rows.append(row)
            progress(f"{label} N={n}: {row['kv_bytes'] / 2**20:.2f} MiB")
    for row in rows:
        full = next(r for r in rows if r["setting"] == "dynamic" and r["tokens"] == row["tokens"])
        row["vs_full"] = row["kv_bytes"] / full["kv_bytes"]
    return {"budget": budget, "rows": rows, "model": lm.name, "skipped": skipped}


def markdown(result: dict[str, Any]) -> str:
    """Rows: settings; columns: context lengths (MiB of KV storage, and the ratio to the full fp32 cache)."""
    rows = result["rows"]
    lengths = sorted({r["tokens"] for r in rows})
    lines = ["| setting | " + " | ".join(f"N = {n:,}" for n in lengths) + " |", "|---" + "|---:" * len(lengths) + "|"]
    for label in dict.fromkeys(r["setting"] for r in rows):
        cells = []
        for n in lengths:
            r = next(r for r in rows if r["setting"] == label and r["tokens"] == n)
            cells.append(f"{r['kv_bytes'] / 2**20:.2f} MiB ({r['vs_full']:.3f}x)")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
