"""Turn result records into markdown: tables (rows setting, columns budget, one table per metric), paired comparisons
with a baseline setting, and plots (quality vs budget, one line per setting; external peers such as kvpress dashed).

Conventions read from each record (:mod:`h2o_kv.harness.records`):

* ``metrics``: numeric values; ``<m>_stderr`` (a standard error) or ``<m>_ci`` (``[low, high]``) next to a metric
  ``<m>`` are shown with it; ``primary_metric`` names the plotted one, ``lower_is_better`` its direction.
* records are grouped by ``(kind, label, model)``; ``peer: true`` marks an external implementation; an unbounded
  setting (``dynamic``, ``full``; ``bounded: false``) is the baseline of every budget.
* ``cache.peak_kv_tokens``: the most KV entries a layer held, shown in its own table;
* paired comparisons (:mod:`h2o_kv.harness.tables`): perplexity from ``block_nll`` (block means of the per-token NLL,
  change in perplexity with a 95% batch-means interval); lm-eval tasks from ``items[task][acc|acc_norm]``; XSUM
  from ``items[rouge*]`` (mean of item-by-item differences ± its standard error).
"""

from __future__ import annotations

import json
import math
import re
import textwrap
from collections import defaultdict
from pathlib import Path
from typing import Any

from ..harness import records as rec
from ..harness.tables import Estimate, average, markdown, paired

SKIP_SUFFIXES = ("_stderr", "_ci")


def load_records(paths: list[str | Path]) -> list[dict[str, Any]]:
    """Result records (those with ``metrics``) from files and folders, searched recursively."""
    found = []
    for root in map(Path, paths):
        if not root.exists():
            raise FileNotFoundError(f"{root} does not exist")
        for path in sorted(root.rglob("*.json")) if root.is_dir() else [root]:
            try:
                data = json.loads(path.read_text())
            except json.JSONDecodeError as err:
                raise ValueError(f"{path} is not valid JSON: {err}") from None
            if isinstance(data, dict) and "kind" in data and isinstance(data.get("metrics"), dict):
                found.append({**data, "_path": str(path)})
    return found


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def budget_column(record: dict[str, Any]) -> tuple[float, str]:
    """(sort key, column label) of a record's budget; an unbounded setting is the ``100%`` column."""
    budget = record.get("budget")
    if _number(budget):
        return float(budget), f"{100 * budget:g}%"
    heavy, recent = record.get("heavy"), record.get("recent")
    return 1e6 + (heavy or 0) + (recent or 0), f"H{heavy}+R{recent}"


def row_name(record: dict[str, Any]) -> str:
    """The record's setting name, with its KV bits when quantized (``h2o + 4-bit``; ``dynamic`` quantized is
    transformers' ``QuantizedCache``, a peer); an external peer whose name does not say so (``kvpress:...`` does)
    gets "(peer)"."""
    name = str(record.get("policy"))
    if record.get("kv_bits") and name == "dynamic":
        return f"QuantizedCache {record['kv_bits']}-bit (quanto, peer)"
    if record.get("kv_bits"):
        name += f" + {record['kv_bits']}-bit"
    name += {None: "", "sum": "+rec", "max": "+recmax"}[record.get("reconstruct")]  # KVSetting.label's suffixes
    return name + (" (peer)" if record.get("peer") and ":" not in name else "")


def _fmt(value: float) -> str:
    if value == 0 or 0.01 <= abs(value) < 1e4:
        return f"{value:.3f}" if abs(value) < 100 else f"{value:.1f}"
    return f"{value:.3g}"


def _cell(metrics: dict[str, Any], name: str) -> str:
    text = _fmt(metrics[name])
    ci, stderr = metrics.get(f"{name}_ci"), metrics.get(f"{name}_stderr")
    if isinstance(ci, (list, tuple)) and len(ci) == 2 and all(map(_number, ci)):
        text += f" [{_fmt(ci[0])}, {_fmt(ci[1])}]"
    elif _number(stderr):
        text += f" ± {_fmt(stderr)}"
    return text


def group_records(found: list[dict[str, Any]]) -> dict[tuple[str, str, str], list[dict[str, Any]]]:
    groups: dict[tuple[str, str, str], list[dict[str, Any]]] = defaultdict(list)
    for record in found:
        groups[(record["kind"], str(record.get("label") or record["kind"]), str(record.get("model", "")))].append(
            record
        )
    return dict(groups)


def order(record: dict[str, Any]) -> tuple:
    """Unbounded baselines first, then h2o-kv settings, then peers, each by name."""
    return (rec.bounded(record), bool(record.get("peer")), str(record.get("policy")))


def baseline_of(group: list[dict[str, Any]], baseline: str, record: dict[str, Any]) -> dict[str, Any] | None:
    """The ``baseline`` setting's record that ``record`` is compared with: the unbounded one, else the same budget."""
    for base in group:
        if base.get("policy") == baseline and not base.get("peer") and base is not record:
            if not rec.bounded(base) or budget_column(base)[1] == budget_column(record)[1]:
                return base
    return None


def paired_change(group: list[dict[str, Any]], baseline: str = "full") -> dict[tuple[str, str], tuple[float, ...]]:
    """(row, column) -> (change of perplexity vs ``baseline`` in %, 95% interval low, high), paired over the same
    tokens. The point estimate is the exact perplexity ratio; the interval comes from the batch-means error of the
    per-block NLL differences (blocks of ``block_nll.size`` tokens), mapped through ``exp``."""
    out = {}
    for record in group:
        base = baseline_of(group, baseline, record)
        blocks = record.get("block_nll")
        if base is None or not rec.bounded(record) or not isinstance(blocks, dict):
            continue
        base_blocks = base.get("block_nll") or {}
        if blocks.get("size") != base_blocks.get("size") or len(blocks["mean"]) != len(base_blocks["mean"]):
            continue
        if len(blocks["mean"]) < 2:
            continue
        diff = paired(blocks["mean"], base_blocks["mean"])
        exact = record.get("nll", math.nan) - base.get("nll", math.nan)
        centre = Estimate(exact if _number(exact) else diff.value, diff.se)
        out[(row_name(record), budget_column(record)[1])] = tuple(
            100 * (math.exp(x) - 1) for x in (centre.value, *centre.interval())
        )
    return out


def plot_group(found: list[dict[str, Any]], metric: str, title: str, path: Path, lower_is_better: bool) -> None:
    """Quality vs budget: one line per setting (peers dashed), unbounded settings as horizontal lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    lines: dict[str, list[tuple[float, float]]] = defaultdict(list)
    peers: set[str] = set()
    for record in found:
        if metric not in record["metrics"] or not _number(record["metrics"][metric]):
            continue
        budget = record.get("budget")
        if not rec.bounded(record):
            ax.axhline(record["metrics"][metric], color="black", linewidth=1, label=row_name(record))
            continue
        if not _number(budget):
            continue
        name = row_name(record)
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


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "_", text).strip("_").lower()


def _grid(rows: list[str], columns: list[str], cells: dict[tuple[str, str], str]) -> list[str]:
    return markdown(["policy", *columns], [[row, *(cells.get((row, c), "") for c in columns)] for row in rows])


def build_report(
    paths: list[str | Path], out: str | Path, *, plots: bool = True, baselines: tuple[str, ...] = ("full",)
) -> str:
    """Write the markdown report (and one PNG per group next to it); returns the markdown.

    ``baselines``: settings that the other records are compared with, paired over the same tokens or items."""
    found = load_records(paths)
    if not found:
        raise ValueError(f"no result JSONs found in {', '.join(map(str, paths))}")
    out = Path(out)
    lines = ["# Evaluation report", "", f"{len(found)} results from {', '.join(map(str, paths))}.", ""]
    for (kind, label, model), group in sorted(group_records(found).items()):
        group.sort(key=order)
        rows = list(dict.fromkeys(row_name(r) for r in group))
        columns = [name for _, name in sorted({budget_column(r) for r in group})]
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
                (row_name(r), budget_column(r)[1]): _cell(r["metrics"], metric) for r in group if metric in r["metrics"]
            }
            if cells:
                direction = " (lower is better)" if metric == primary and lower else ""
                lines += [f"**{metric}**{direction}", "", *_grid(rows, columns, cells), ""]
        peaks = {
            (row_name(r), budget_column(r)[1]): str(r["cache"]["peak_kv_tokens"])
            for r in group
            if isinstance(r.get("cache"), dict) and _number(r["cache"].get("peak_kv_tokens"))
        }
        if peaks:
            lines += ["**peak KV entries per layer and head**", "", *_grid(rows, columns, peaks), ""]
        for baseline in baselines:
            lines += _paired_section(kind, group, baseline, rows, columns)
        if plots and primary:
            png = out.parent / f"{_slug(label)}_{_slug(model)}_{primary}.png"
            plot_group(group, primary, f"{label} - {model}", png, lower)
            lines += [f"![{label}]({png.name})", ""]
        commands = sorted({r["command"] for r in group if r.get("command")})
        if commands:
            lines += ["Regenerate:", "", "```", *commands, "```", ""]
        revisions = sorted({f"{g['commit'][:12]}{' (dirty)' if g.get('dirty') else ''}" for r in group
                            if isinstance(g := r.get("git"), dict) and g.get("commit")})  # fmt: skip
        if revisions:
            lines += [f"Code: {', '.join(revisions)}.", ""]
        timing = [r for r in group if _number(r.get("time_s"))]
        if timing:
            lines += [f"Run time: {sum(r['time_s'] for r in timing):.0f} s over {len(timing)} runs.", ""]
    text = "\n".join(lines)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    return text


def _paired_section(kind, group, baseline, rows, columns) -> list[str]:
    """The paired comparison of a group with ``baseline``, in the form its kind allows (none if no baseline)."""
    if kind == "ppl":
        paired_ppl = paired_change(group, baseline)
        if not paired_ppl:
            return []
        cells = {key: f"{v:+.2f}% [{lo:+.2f}, {hi:+.2f}]" for key, (v, lo, hi) in paired_ppl.items()}
        size = next(r["block_nll"]["size"] for r in group if isinstance(r.get("block_nll"), dict))
        kept = [r for r in rows if any((r, c) in cells for c in columns)]
        return [
            f"**perplexity change vs {baseline}** (paired over the same tokens; 95% interval from {size}-token "
            "block means)",
            "",
            *_grid(kept, columns, cells),
            "",
        ]
    base = next((r for r in group if r.get("policy") == baseline and not rec.bounded(r)), None)
    if base is None or kind not in ("tasks", "xsum"):
        return []
    table = tasks_delta_table(group, base) if kind == "tasks" else xsum_table(group, base)
    return [f"**paired change vs {baseline}** (item by item, mean ± standard error)", "", *table, ""]


# -- tables of per-item results (lm-eval tasks, XSUM, needle), paired with a baseline run on the same items ---------


def _tasks(records: list[dict[str, Any]]) -> list[str]:
    return list(dict.fromkeys(task for r in records for task in r.get("tasks", {})))


def tasks_table(records: list[dict[str, Any]], base: dict[str, Any]) -> list[str]:
    """Per-task acc ± se, the mean acc, its paired change vs ``base`` (mean over tasks of item-by-item changes, ±
    se) and the KV kept."""
    tasks = _tasks(records)
    rows = []
    for record in sorted(records, key=order):
        cells, deltas = [], []
        for task in tasks:
            row = record["tasks"].get(task)
            if row is None:
                cells.append("")
                continue
            cells.append(Estimate(row["acc"], row["acc_stderr"]).format(100, 1))
            deltas.append(paired(record["items"][task]["acc"], base["items"][task]["acc"]))
        delta = "" if record is base else average(deltas).format(100, 2, sign=True)
        rows.append([row_name(record), *cells, f"{100 * record['metrics']['mean_acc']:.2f}", delta,
                     f"{100 * record['kv_kept_ratio']:.1f}%"])  # fmt: skip
    header = ["setting", *tasks, "mean acc", f"Δ mean vs {base['policy']} (paired ± se)", "KV kept"]
    return markdown(header, rows)


def tasks_delta_table(records: list[dict[str, Any]], base: dict[str, Any], metric: str = "acc") -> list[str]:
    """Paired change vs ``base`` per task (points), for ``acc`` or ``acc_norm`` (tasks that have it)."""
    tasks = [t for t in _tasks(records) if metric in base["items"].get(t, {})]
    rows = []
    for record in sorted(records, key=order):
        if record is base:
            continue
        deltas = [paired(record["items"][t][metric], base["items"][t][metric]) for t in tasks]
        cells = [d.format(100, 1, sign=True) for d in deltas]
        rows.append([row_name(record), *cells, average(deltas).format(100, 2, sign=True)])
    return markdown(["setting", *tasks, "mean"], rows)


def xsum_table(records: list[dict[str, Any]], base: dict[str, Any]) -> list[str]:
    """ROUGE-1/2/L ± se, ROUGE-2 as a share of ``base``'s, its paired change, the KV kept."""
    rows = []
    for record in sorted(records, key=order):
        m = record["metrics"]
        cells = [Estimate(m[k], m[k + "_stderr"]).format(100, 2) for k in ("rouge1", "rouge2", "rougeL")]
        share = f"{m['rouge2'] / base['metrics']['rouge2']:.0%}"
        delta = (
            ""
            if record is base
            else paired(record["items"]["rouge2"], base["items"]["rouge2"]).format(100, 2, sign=True)
        )
        rows.append([row_name(record), *cells, share, delta, f"{100 * record['kv_kept_ratio']:.1f}%"])
    name = base["policy"]
    header = ["setting", "ROUGE-1", "ROUGE-2", "ROUGE-L", f"ROUGE-2 / {name}", f"Δ ROUGE-2 vs {name} (paired ± se)",
              "KV kept"]  # fmt: skip
    return markdown(header, rows)


def needle_table(records: list[dict[str, Any]]) -> list[str]:
    """Score per document length (mean over depths) and over all cells."""
    lengths = records[0]["lengths"]
    rows = []
    for record in sorted(records, key=order):
        m = record["metrics"]
        rows.append([row_name(record), *(f"{m[f'score_{n}']:.2f}" for n in lengths), f"{m['score']:.2f}"])
    return markdown(["setting", *(f"{n} tokens" for n in lengths), "all"], rows)
