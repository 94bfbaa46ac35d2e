"""Summaries of bench results: medians over repeats, ratios against a baseline setting (``dynamic`` by default), a
markdown table, the plot, and the bytes-moved model of a decode step.

What each number is: a row's metrics are **medians over its repeats** (:func:`h2o_kv.harness.tables.median`); ``decode
tok/s`` is generated tokens over the summed step times (a **mean** over steps), ``p50``/``p99`` are percentiles of the
step times; the ``decode`` ratio is a ratio of those mean rates, ``decode p50`` the ratio of median step times.
"""

from __future__ import annotations

import json
import pathlib
import statistics
from collections import defaultdict

from ..harness.records import bounded
from ..harness.setting import PRESS_PREFIX
from ..harness.tables import markdown, median

MiB = 2**20
METRICS = (
    "prefill_s", "decode_tok_s", "step_ms_p50", "step_ms_p99", "e2e_tok_s", "prefill_peak_bytes",
    "prefill_peak_increase_bytes", "decode_peak_increase_bytes", "kv_bytes_end", "cache_bytes_end",
    "cache_bytes_peak", "decode_cpu_util",
)  # fmt: skip
BASELINE = "dynamic"


def load(path: str | pathlib.Path) -> dict:
    """A bench results file (``{"kind": "bench", "runs", "records"}``)."""
    data = json.loads(pathlib.Path(path).read_text())
    if data.get("kind") != "bench":
        raise ValueError(f"{path} is not an h2o-kv bench results file")
    return data


def summarise(records: list[dict], baseline: str = BASELINE) -> list[dict]:
    """One row per configuration key: the median of every metric over its repeats (probe runs left out), with
    ratios against ``baseline`` (an unbounded setting) at the same prompt length, batch and new tokens."""
    groups: dict[str, list[dict]] = defaultdict(list)
    for r in records:
        if r["config"].get("tag") != "probe":
            groups[r["key"]].append(r)
    rows = []
    for key, runs in groups.items():
        row = {"key": key, "config": runs[0]["config"], "repeats": len(runs)}
        for name in METRICS:
            values = [r[name] for r in runs if r.get(name) is not None]
            row[name] = median(values).value if values else None
        for name in ("fit_batch", "memory_limit_bytes", "fits", "footprint_per_seq_bytes", "weight_bytes",
                     "kept_after_prefill", "random_init", "model", "device", "dtype", "seq_length_end",
                     "code_sha1", "prompt_sha1"):  # fmt: skip
            if name in runs[0]:
                row[name] = runs[0][name]
        if "fits" in runs[0]:
            row["fits"] = all(r.get("fits", False) for r in runs)
        rows.append(row)
    _add_ratios(rows, baseline)
    return rows


def _add_ratios(rows: list[dict], baseline: str) -> None:
    """Ratios against ``baseline`` at the same prompt length, batch and new tokens (and for fitted runs, against
    ``baseline`` at the batch that defined the memory limit)."""
    base = {}
    for row in rows:
        c = row["config"]
        if c["policy"] == baseline and c.get("tag") != "fit" and c.get("kv_bits") is None:
            base[(c["context"], c["batch"], c["new_tokens"])] = row
    for row in rows:
        c = row["config"]
        ref = base.get((c["context"], c["batch"], c["new_tokens"]))
        if c.get("tag") == "fit":
            same_limit = [
                f for (ctx, _, new), f in base.items()
                if ctx == c["context"] and new == c["new_tokens"] and f["cache_bytes_peak"] == row["memory_limit_bytes"]
            ]  # fmt: skip
            ref = same_limit[0] if same_limit else None
        if ref is None or ref is row:
            continue
        row["vs"] = ref["key"]
        row["decode_speedup"] = _ratio(row["decode_tok_s"], ref["decode_tok_s"])
        row["decode_p50_speedup"] = _ratio(ref["step_ms_p50"], row["step_ms_p50"])
        row["e2e_speedup"] = _ratio(row["e2e_tok_s"], ref["e2e_tok_s"])
        row["kv_ratio"] = _ratio(row["kv_bytes_end"], ref["kv_bytes_end"])
        row["prefill_time_ratio"] = _ratio(row["prefill_s"], ref["prefill_s"])
        row["prefill_peak_ratio"] = _ratio(row["prefill_peak_increase_bytes"], ref["prefill_peak_increase_bytes"])
        row["prefill_peak_abs_ratio"] = _ratio(row["prefill_peak_bytes"], ref["prefill_peak_bytes"])


def _ratio(a, b):
    return a / b if a is not None and b else None


def _fmt(value, spec: str = ".2f", scale: float = 1.0, suffix: str = "") -> str:
    return "-" if value is None else format(value / scale, spec) + suffix


def markdown_table(rows: list[dict], baseline: str = BASELINE) -> str:
    """The results as a markdown table (sorted by prompt length, batch, setting), means and medians labelled."""
    header = [
        "setting", "prompt", "batch", "new", "prefill s", "decode tok/s (mean)", "step ms p50 / p99", "e2e tok/s",
        "prefill peak +MiB", "decode peak +MiB", "cache MiB", f"vs {baseline}: decode (mean)", "decode (p50)",
        "e2e", "KV", "prefill time", "prefill peak",
    ]  # fmt: skip
    lines = []
    for row in sorted(rows, key=_sort_key):
        c = row["config"]
        batch = f"{c['batch']}" + (f" (prefill {c['prefill_batch']}, repeated)" if c.get("prefill_batch") else "")
        lines.append([
            c["policy"] + (f" {c['kv_bits']}-bit KV" if c.get("kv_bits") else "")
            + (" (fit)" if c.get("tag") == "fit" else ""),
            str(c["context"]), batch, str(c["new_tokens"]),
            _fmt(row["prefill_s"], ".1f"), _fmt(row["decode_tok_s"]),
            f"{_fmt(row['step_ms_p50'], '.0f')} / {_fmt(row['step_ms_p99'], '.0f')}", _fmt(row["e2e_tok_s"]),
            _fmt(row["prefill_peak_increase_bytes"], ".0f", MiB), _fmt(row["decode_peak_increase_bytes"], ".0f", MiB),
            _fmt(row["cache_bytes_end"], ".0f", MiB), _fmt(row.get("decode_speedup"), suffix="x"),
            _fmt(row.get("decode_p50_speedup"), suffix="x"), _fmt(row.get("e2e_speedup"), suffix="x"),
            _fmt(row.get("kv_ratio"), ".3f"), _fmt(row.get("prefill_time_ratio")), _fmt(row.get("prefill_peak_ratio")),
        ])  # fmt: skip
    note = "Each row: the median over its repeats; decode tok/s is a mean over the decode steps."
    return "\n".join([note, "", *markdown(header, lines)]) + "\n"


def _sort_key(row):
    c = row["config"]
    bits = -(c.get("kv_bits") or 99)  # full precision first
    return (c["new_tokens"], c["context"], c.get("tag") == "fit", c["batch"], bounded(c), c["policy"], bits)


def bytes_model(rows: list[dict]) -> list[dict]:
    """Bytes moved per decode step, the baseline (the stock ``DynamicCache``) vs each other setting, and how close
    the measured speed-up comes.

    ``ideal``: weights + one read of the KV entries attended. ``stock``: the stock ``DynamicCache`` also copies its
    whole cache every step (``torch.cat``: one more read and one write), so it moves weights + 3 x KV.
    Entries are averaged over the decode: ``L + new/2`` for the baseline and for kvpress (its compressed cache grows
    again by one entry per step), ``kept + 1`` for a bounded h2o-kv cache. KV bytes per entry come from the baseline.
    """
    by_key = {r["key"]: r for r in rows}
    out = []
    for row in rows:
        c = row["config"]
        ref = by_key.get(row.get("vs"))
        if row.get("decode_speedup") is None or c.get("tag") == "fit" or ref is None or not row.get("weight_bytes"):
            continue
        per_entry = ref["kv_bytes_end"] / (c["batch"] * ref["seq_length_end"])
        weights = row["weight_bytes"]
        tokens_full = c["context"] + c["new_tokens"] / 2
        kept = row.get("kept_after_prefill") or c["context"]
        tokens_pol = kept + c["new_tokens"] / 2 if c["policy"].startswith(PRESS_PREFIX) else kept + 1
        kv_full, kv_pol = c["batch"] * tokens_full * per_entry, c["batch"] * tokens_pol * per_entry
        ideal = (weights + kv_full) / (weights + kv_pol)
        stock = (weights + 3 * kv_full) / (weights + kv_pol)
        p50 = ref["step_ms_p50"] / row["step_ms_p50"] if row.get("step_ms_p50") else None
        out.append({
            "key": row["key"], "policy": c["policy"], "context": c["context"], "batch": c["batch"],
            "bytes_full_ideal": weights + kv_full, "bytes_full_stock": weights + 3 * kv_full,
            "bytes_policy": weights + kv_pol, "ratio_ideal": ideal, "ratio_stock": stock,
            "measured": row["decode_speedup"], "measured_p50": p50, "fraction_of_ideal": row["decode_speedup"] / ideal,
        })  # fmt: skip
    return out


def plot(rows: list[dict], path: str | pathlib.Path, *, batch: int | None = None, title: str = "") -> pathlib.Path:
    """Decode tokens/s and memory (prefill peak increase, cache bytes) against prompt length, per policy.

    Tokens/s is drawn from the median step time (``batch / p50``): on a shared machine the mean is pulled by
    outlier steps of other processes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if r["config"].get("tag") not in ("fit", "probe") and not r["config"].get("prefill_batch")]
    if batch is None and rows:
        batch = statistics.mode(r["config"]["batch"] for r in rows)
    rows = [r for r in rows if r["config"]["batch"] == batch]
    for r in rows:
        r["decode_tok_s_p50"] = batch * 1000 / r["step_ms_p50"] if r.get("step_ms_p50") else None
    by_policy: dict[str, list[dict]] = defaultdict(list)
    for r in rows:
        by_policy[r["config"]["policy"]].append(r)
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    panels = (
        ("decode_tok_s_p50", 1.0, "decode tokens/s (median step)"),
        ("prefill_peak_increase_bytes", MiB, "peak RSS increase during prefill (MiB)"),
        ("cache_bytes_end", MiB, "KV cache at the end (MiB)"),
    )
    for ax, (metric, scale, label) in zip(axes, panels, strict=True):
        for policy, items in sorted(by_policy.items()):
            items = sorted((r for r in items if r.get(metric) is not None), key=lambda r: r["config"]["context"])
            if items:
                ax.plot([r["config"]["context"] for r in items], [r[metric] / scale for r in items], "o-", label=policy)
        ax.set_xlabel("prompt length (tokens)")
        ax.set_ylabel(label)
        ax.set_xscale("log", base=2)
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.suptitle(title or f"batch {batch}")
    fig.tight_layout()
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
