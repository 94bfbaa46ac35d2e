"""Turn result JSONs into a markdown report: tables (rows policy, columns budget, one table per metric) and plots
(quality vs budget, one line per policy; external peers such as kvpress presses dashed).

Conventions read from each result (:func:`h2o_kv.eval.results.write_result`):

* ``metrics``: numeric values; ``<m>_stderr`` (a standard error) or ``<m>_ci`` (``[low, high]``) next to a
  metric ``<m>`` are shown with it; ``primary_metric`` names the plotted one, ``lower_is_better`` its direction.
* results are grouped by ``(kind, label, model)``; ``peer: true`` marks an external implementation.
* ``cache.peak_kv_tokens``: the most KV entries a layer held, shown in its own table;
* ``block_nll`` (perplexity runs): block means of the per-token NLL; with a ``full`` run of the same text the
  report adds the paired change in perplexity vs full (and vs any other ``baselines`` policy at the same
  budget) with a 95% batch-means confidence interval.
"""

from __future__ import annotations

import json
import math
import re
import textwrap
from collections import defaultdict
from pathlib import Path
from typing import Any

SKIP_SUFFIXES = ("_stderr", "_ci")


def load_records(paths: list[str | Path]) -> list[dict[str, Any]]:
    """Result records from files and folders (searched recursively); ``sweep.json`` manifests are skipped."""
    records = []
    for root in map(Path, paths):
        if not root.exists():
            raise FileNotFoundError(f"{root} does not exist")
        files = sorted(root.rglob("*.json")) if root.is_dir() else [root]
        for path in files:
            if path.name == "sweep.json":
                continue
            try:
                record = json.loads(path.read_text())
            except json.JSONDecodeError as err:
                raise ValueError(f"{path} is not valid JSON: {err}") from None
            if isinstance(record, dict) and "kind" in record and isinstance(record.get("metrics"), dict):
                records.append({**record, "_path": str(path)})
    return records


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _budget_key(record: dict[str, Any]) -> tuple[float, str]:
    """(sort key, column label) of a result's budget."""
    budget = record.get("budget")
    if _number(budget):
        return float(budget), f"{100 * budget:g}%"
    heavy, recent = record.get("heavy"), record.get("recent")
    total = (heavy or 0) + (recent or 0)
    return float("inf") if not total else 1e6 + total, f"H{heavy}+R{recent}"


def _row_name(record: dict[str, Any]) -> str:
    return str(record.get("policy")) + (" (peer)" if record.get("peer") and "peer" not in str(record["policy"]) else "")


def _fmt(value: float) -> str:
    if value == 0 or 0.01 <= abs(value) < 1e4:
        return f"{value:.3f}" if abs(value) < 100 else f"{value:.1f}"
    return f"{value:.3g}"


def _cell(metrics: dict[str, Any], name: str) -> str:
    value = metrics[name]
    text = _fmt(value)
    ci, stderr = metrics.get(f"{name}_ci"), metrics.get(f"{name}_stderr")
    if isinstance(ci, (list, tuple)) and len(ci) == 2 and all(map(_number, ci)):
        text += f" [{_fmt(ci[0])}, {_fmt(ci[1])}]"
    elif _number(stderr):
        text += f" ± {_fmt(stderr)}"
    return text


def group_records(records: list[dict[str, Any]]) -> dict[tuple[str, str, str], list[dict[str, Any]]]:
    groups: dict[tuple[str, str, str], list[dict[str, Any]]] = defaultdict(list)
    for record in records:
        key = (record["kind"], str(record.get("label") or record["kind"]), str(record.get("model", "")))
        groups[key].append(record)
    return dict(groups)


def paired_change(
    records: list[dict[str, Any]], baseline: str = "full"
) -> dict[tuple[str, str], tuple[float, float, float]]:
    """(row, column) -> (change of perplexity vs ``baseline`` in %, 95% CI low, high), paired over the same tokens.

    Each record is compared with the ``baseline`` policy's record at the same budget (the ``full`` record serves
    every budget). The point estimate is the exact perplexity ratio; its standard error is the batch-means error
    of the per-block NLL differences (blocks of ``block_nll.size`` tokens)."""
    bases = {
        (None if r.get("policy") == "full" else _budget_key(r)[1]): r
        for r in records
        if r.get("policy") == baseline and not r.get("peer") and isinstance(r.get("block_nll"), dict)
    }
    out = {}
    for record in records:
        base = bases.get(None) or bases.get(_budget_key(record)[1])
        blocks = record.get("block_nll")
        if base is None or record is base or record.get("policy") == "full" or not isinstance(blocks, dict):
            continue
        base_blocks = base["block_nll"]
        if blocks.get("size") != base_blocks.get("size") or len(blocks["mean"]) != len(base_blocks["mean"]):
            continue
        if len(blocks["mean"]) < 2:
            continue
        diffs = [a - b for a, b in zip(blocks["mean"], base_blocks["mean"], strict=True)]
        block_mean = sum(diffs) / len(diffs)
        se = math.sqrt(sum((d - block_mean) ** 2 for d in diffs) / (len(diffs) - 1) / len(diffs))
        exact = record.get("nll", math.nan) - base.get("nll", math.nan)
        mean = exact if _number(exact) else block_mean
        out[(_row_name(record), _budget_key(record)[1])] = tuple(
            100 * (math.exp(x) - 1) for x in (mean, mean - 1.96 * se, mean + 1.96 * se)
        )
    return out


def _table(rows: list[str], columns: list[str], cells: dict[tuple[str, str], str]) -> list[str]:
    lines = ["| policy | " + " | ".join(columns) + " |", "|---|" + "---:|" * len(columns)]
    for row in rows:
        lines.append(f"| {row} | " + " | ".join(cells.get((row, c), "") for c in columns) + " |")
    return lines


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "_", text).strip("_").lower()


def plot_group(records: list[dict[str, Any]], metric: str, title: str, path: Path, lower_is_better: bool) -> None:
    """Quality vs budget: one line per policy (peers dashed), the full cache as a horizontal line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    lines: dict[str, list[tuple[float, float]]] = defaultdict(list)
    peers: set[str] = set()
    for record in records:
        if metric not in record["metrics"] or not _number(record["metrics"][metric]):
            continue
        budget = record.get("budget")
        if record.get("policy") == "full":
            ax.axhline(record["metrics"][metric], color="black", linewidth=1, label="full")
            continue
        if not _number(budget):
            continue
        name = _row_name(record)
        lines[name].append((100 * budget, record["metrics"][metric]))
        if record.get("peer"):
            peers.add(name)
    for name in sorted(lines):
        points = sorted(lines[name])
        style = "--" if name in peers else "-"
        ax.plot([p[0] for p in points], [p[1] for p in points], style, marker="o", markersize=4, label=name)
    ax.set_xscale("log")
    ticks = sorted({x for pts in lines.values() for x, _ in pts})
    if ticks:
        ax.set_xticks(ticks, [f"{t:g}%" for t in ticks])
        ax.minorticks_off()
    ax.set_xlabel("KV budget (% of the evaluated tokens)")
    ax.set_ylabel(metric + (" (lower is better)" if lower_is_better else " (higher is better)"))
    values = [v for pts in lines.values() for _, v in pts]
    if lower_is_better and values and max(values) > 4 * min(values):
        ax.set_yscale("log")
    ax.set_title(textwrap.fill(title, 80), fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def build_report(
    paths: list[str | Path], out: str | Path, *, plots: bool = True, baselines: tuple[str, ...] = ("full",)
) -> str:
    """Write the markdown report (and one PNG per group next to it); returns the markdown.

    ``baselines``: policies that perplexity results are compared with, paired over the same tokens."""
    records = load_records(paths)
    if not records:
        raise ValueError(f"no result JSONs found in {', '.join(map(str, paths))}")
    out = Path(out)
    lines = ["# Evaluation report", "", f"{len(records)} results from {', '.join(map(str, paths))}.", ""]
    for (kind, label, model), group in sorted(group_records(records).items()):
        group.sort(key=lambda r: (r.get("policy") != "full", bool(r.get("peer")), str(r.get("policy"))))
        rows = list(dict.fromkeys(_row_name(r) for r in group))
        budgets = sorted({_budget_key(r) for r in group})
        columns = [label_ for _, label_ in budgets]
        metric_names = list(
            dict.fromkeys(
                m for r in group for m, v in r["metrics"].items() if _number(v) and not m.endswith(SKIP_SUFFIXES)
            )
        )
        primary = group[0].get("primary_metric") or (metric_names[0] if metric_names else None)
        lower = bool(group[0].get("lower_is_better", False))
        lines += [f"## {label}", "", f"Kind `{kind}`, model `{model}`."]
        data = {(d.get("name"), d.get("sha256")) for r in group if isinstance(d := r.get("data"), dict)}
        for name, digest in sorted(data, key=str):
            lines.append(f"Data `{name}` (sha256 `{digest}`).")
        lines.append("")
        for metric in [primary] + [m for m in metric_names if m != primary]:
            cells = {
                (_row_name(r), _budget_key(r)[1]): _cell(r["metrics"], metric) for r in group if metric in r["metrics"]
            }
            if not cells:
                continue
            direction = " (lower is better)" if metric == primary and lower else ""
            lines += [f"**{metric}**{direction}", "", *_table(rows, columns, cells), ""]
        peaks = {
            (_row_name(r), _budget_key(r)[1]): str(r["cache"]["peak_kv_tokens"])
            for r in group
            if isinstance(r.get("cache"), dict) and _number(r["cache"].get("peak_kv_tokens"))
        }
        if peaks:
            lines += ["**peak KV entries per layer and head**", "", *_table(rows, columns, peaks), ""]
        for baseline in baselines:
            paired = paired_change(group, baseline)
            if not paired:
                continue
            cells = {key: f"{v:+.2f}% [{lo:+.2f}, {hi:+.2f}]" for key, (v, lo, hi) in paired.items()}
            size = next(r["block_nll"]["size"] for r in group if isinstance(r.get("block_nll"), dict))
            lines += [
                f"**perplexity change vs {baseline}** (paired over the same tokens; 95% CI from {size}-token "
                "block means)",
                "",
                *_table([r for r in rows if r not in ("full", baseline)], columns, cells),
                "",
            ]
        if plots and primary:
            png = out.parent / f"{_slug(label)}_{_slug(model)}_{primary}.png"
            plot_group(group, primary, f"{label} - {model}", png, lower)
            lines += [f"![{label}]({png.name})", ""]
        commands = sorted({r["command"] for r in group if r.get("command")})
        if commands:
            lines += ["Regenerate:", "", "```", *commands, "```", ""]
        timing = [r for r in group if _number(r.get("time_s"))]
        if timing:
            total = sum(r["time_s"] for r in timing)
            lines += [f"Run time: {total:.0f} s over {len(timing)} runs.", ""]
    text = "\n".join(lines)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    return text
