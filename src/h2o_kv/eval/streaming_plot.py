"""Perplexity and memory over a stream far longer than the model's context (issue 5).

The stream joins the two PG-19 test books (Gutenberg header/footer stripped) and WikiText-2 (raw test split)
from the shared data folder, ``--part-tokens`` tokens of each, so that it crosses two document boundaries. Every
token is a decode step with eviction (:func:`h2o_kv.eval.ppl.streaming_nll`, stepwise cache), exactly what
``h2o-kv eval ppl --streaming --window 1000`` computes; this module also records the KV-cache bytes after every
chunk and plots both against the position in the stream:

* ``h2o`` and ``sink`` (StreamingLLM) in streaming mode (position rolling, :mod:`h2o_kv.hf.rotary`) at the same
  cache sizes - their memory is flat and they never leave the model's trained positions;
* ``full`` up to the model's context (``max_position_embeddings``), where it runs out of positions;
* optionally (``--plain``) ``h2o``/``sink`` *without* streaming, whose absolute positions pass the context.

Commands (``python -m h2o_kv.eval.streaming_plot ...``): ``run`` (resumable: one JSON per configuration under
``results/streaming/``) and ``plot`` (PNG + markdown table from those JSONs).
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

import typer

from ..harness.data import data_path, sha256, strip_gutenberg
from ..harness.records import bounded

BOOKS = ("pg19/pg10146_reminiscences_of_pioneer_days_in_st_paul.txt", "pg19/pg10321_dragons_blood.txt")
WIKITEXT = "wikitext2/wiki.test.raw.crlf_noblank.txt"
OUT = Path("results/streaming")

app = typer.Typer(help="Windowed perplexity and KV memory over a stream longer than the context.", add_completion=False)


def build_stream(tokenizer, part_tokens: int, cache_dir: Path, skip_tokens: int = 0) -> tuple[Path, dict[str, Any]]:
    """Write the joined stream text to ``cache_dir`` (outside the repository) and describe it.

    Each source contributes ``part_tokens`` tokens after its first ``skip_tokens`` (decoded back to text), joined by
    a blank line: ``skip_tokens >= part_tokens`` gives a tuning stream disjoint from the evaluation stream (0).
    Returns the path and ``{"sources": [...], "boundaries": [token offsets where a new source starts]}``.
    """
    parts, sources = [], []
    for relative in (*BOOKS, WIKITEXT):
        path = data_path(relative)
        text = path.read_text(encoding="utf-8", errors="replace").replace("\r\n", "\n")
        if relative in BOOKS:
            text = strip_gutenberg(text)
        ids = tokenizer(text, add_special_tokens=False, verbose=False).input_ids
        if len(ids) < skip_tokens + part_tokens:
            raise ValueError(f"{relative} has only {len(ids)} tokens; --skip-tokens + --part-tokens must be <= that")
        parts.append(tokenizer.decode(ids[skip_tokens : skip_tokens + part_tokens]).strip())
        sources.append(
            {"path": str(path), "name": relative, "sha256": sha256(path), "skip": skip_tokens, "tokens": part_tokens}
        )
    joined = "\n\n".join(parts) + "\n"
    boundaries, prefix = [], ""
    for part in parts[:-1]:
        prefix += part + "\n\n"
        boundaries.append(len(tokenizer(prefix, add_special_tokens=False, verbose=False).input_ids))
    cache_dir.mkdir(parents=True, exist_ok=True)
    target = cache_dir / f"pg19x2+wikitext2_{part_tokens}{f'_skip{skip_tokens}' if skip_tokens else ''}.txt"
    target.write_text(joined, encoding="utf-8")
    return target, {"sources": sources, "boundaries": boundaries, "sha256": sha256(target)}


def configurations(
    sizes: list[int], policies: list[str], full: bool, plain: bool, context: int, tokens: int, recent_share: float = 0.5
):
    """``(label, policy, size or None, streaming, tokens)`` for every run, most informative first."""
    runs = []
    share = "" if recent_share == 0.5 else f"-recent{recent_share:g}"
    for size in sizes:
        for policy in policies:
            runs.append((f"{policy}-{size}{share}-streaming", policy, size, True, tokens))
    if full:
        runs.append(("full", "full", None, False, min(tokens, context)))
    if plain:
        for policy in policies:
            runs.append((f"{policy}-{min(sizes)}{share}-plain", policy, min(sizes), False, tokens))
    return runs


def run_one(
    model, tokenizer, text: Path, label, policy, size, streaming, tokens, window, chunk, meta, out: Path, share=0.5
):
    """One perplexity run with a KV-memory trace; writes ``out/<label>.json`` and returns the record.

    ``share`` of each cache size is the recent window (``round(share * size)``, at least 1), the rest heavy hitters.
    """
    from rich.progress import Progress

    from ..harness.setting import KVSetting
    from .ppl import PPLJob, run_ppl

    recent = None if size is None else max(1, min(size - 1, round(share * size)))
    setting = KVSetting.of(policy, heavy=None if size is None else size - recent, recent=recent)
    job = PPLJob.create(text, tokens, setting, streaming=streaming, window=window, chunk=chunk)
    made: dict[str, Any] = {}
    make_cache = job.make_cache

    def traced_cache():
        made["cache"] = make_cache()
        return made["cache"]

    job.make_cache = traced_cache  # keep a handle on the cache to read its memory after every chunk
    trace: list[dict[str, int]] = []
    with Progress() as bar:
        task = bar.add_task(f"{label} ({tokens} tokens)", total=tokens)

        def progress(n: int) -> None:
            stats = made["cache"].stats()
            keys = ("seen_tokens", "kv_tokens", "slots", "kv_bytes", "full_kv_bytes")
            trace.append({k: stats[k] for k in keys})
            bar.advance(task, n)

        return run_ppl(
            job, model, tokenizer, out / f"{label}.json", progress=progress,
            extra={"run": label, "streaming": streaming, "size": size, "recent_share": share, "memory": trace,
                   "stream": meta},
        )  # fmt: skip


@app.command()
def run(
    tokens: int = typer.Option(24000, help="Tokens of the stream to evaluate (>= 2)."),
    part_tokens: int = typer.Option(8000, help="Tokens taken from each of the three sources."),
    skip_tokens: int = typer.Option(
        0, help="Tokens skipped at the start of each source (>= --part-tokens: a tuning stream, disjoint from 0's)."
    ),
    sizes: str = typer.Option("256,1024", help="Cache sizes (heavy + recent entries), comma-separated."),
    policies: str = typer.Option("h2o,sink", help="Streaming policies to compare, comma-separated."),
    recent_share: float = typer.Option(0.5, help="Share of each size that is the recent window (0 < x < 1)."),
    full: bool = typer.Option(True, "--full/--no-full", help="Also run the full cache up to the model context."),
    plain: bool = typer.Option(False, "--plain", help="Also run the policies without streaming (smallest size)."),
    window: int = typer.Option(1000, help="Tokens per perplexity window."),
    chunk: int = typer.Option(1000, help="Tokens per forward pass (also the memory-trace interval)."),
    out: Path = typer.Option(OUT, help="Folder for the result JSONs."),
    cache_dir: Path = typer.Option(Path("~/.cache/h2o-kv/streaming"), help="Where the joined text is written."),
    redo: bool = typer.Option(False, help="Rerun configurations whose JSON already exists."),
    only: str = typer.Option(None, help="Run only these labels (comma-separated, e.g. h2o-256-streaming,full)."),
    model: str = typer.Option(None, help="Model name or local directory (default: SmolLM2-135M-Instruct)."),
):
    """Run every configuration that has no result yet (resumable: one JSON per configuration)."""
    try:
        size_list = [int(s) for s in sizes.split(",") if s.strip()]
        policy_list = [p.strip() for p in policies.split(",") if p.strip()]
        if not size_list or min(size_list) < 2:
            raise ValueError(f"--sizes must be integers >= 2, got {sizes!r}")
        from ..harness.setting import KVSetting

        for policy in policy_list:
            if not KVSetting.of(policy, heavy=1, recent=1, option="--policies").bounded:
                raise ValueError("--policies are streaming (bounded) policies; the full cache is --full")
        if tokens < 2 or part_tokens < 1 or window < 1 or chunk < 1 or skip_tokens < 0:
            raise ValueError("--tokens must be >= 2, --part-tokens, --window, --chunk >= 1 and --skip-tokens >= 0")
        if not 0 < recent_share < 1:
            raise ValueError(f"--recent-share must be in (0, 1), got {recent_share}")
        if tokens > 3 * part_tokens:
            raise ValueError(f"--tokens {tokens} is more than the stream (3 x --part-tokens = {3 * part_tokens})")
    except ValueError as err:
        typer.secho(f"Error: {err}", err=True, fg="red")
        raise typer.Exit(2) from err
    from transformers.utils import logging

    from ..models import load_model, model_context_length

    logging.disable_progress_bar()
    loaded, tokenizer = load_model(model)
    text, meta = build_stream(tokenizer, part_tokens, cache_dir.expanduser(), skip_tokens)
    context = model_context_length(loaded)
    wanted = None if only is None else {label.strip() for label in only.split(",")}
    for label, policy, size, streaming, n in configurations(
        size_list, policy_list, full, plain, context, tokens, recent_share
    ):
        if wanted is not None and label not in wanted:
            continue
        target = out / f"{label}.json"
        if target.exists() and not redo:
            typer.echo(f"{label}: done ({target})")
            continue
        record = run_one(
            loaded, tokenizer, text, label, policy, size, streaming, n, window, chunk, meta, out, recent_share
        )
        typer.echo(f"{label}: ppl {record['ppl']:.3f} over {n} tokens, {record['tokens_per_s']:.1f} tokens/s")


def load_results(folder: Path) -> list[dict[str, Any]]:
    records = [json.loads(p.read_text()) for p in sorted(folder.glob("*.json"))]
    return [r for r in records if r.get("kind") == "ppl" and "memory" in r]


STYLE = {"h2o": ("tab:blue", "-"), "sink": ("tab:orange", "-"), "local": ("tab:green", "-"), "full": ("black", "-")}


def plot_results(records: list[dict[str, Any]], path: Path, context: int | None = None) -> None:
    """Two panels against the position in the stream: perplexity per window (log scale), KV-cache MiB."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 7.5), sharex=True, height_ratios=(3, 2))
    sizes = sorted({r["size"] for r in records if r["size"]})
    for r in sorted(records, key=lambda r: (bounded(r), r["size"] or 0, r["policy"], not r["streaming"])):
        color, _ = STYLE.get(r["policy"], ("tab:gray", "-"))
        style = "-" if r["streaming"] or not bounded(r) else ":"
        width = 1.0 if r["size"] and r["size"] == min(sizes) and bounded(r) else 2.0
        label = (
            f"{r['policy']} cache"
            if not bounded(r)
            else f"{r['policy']} {r['size']}" + (" streaming" if r["streaming"] else " (no streaming)")
        )
        windows = r["windows"]
        middle = [(w["start"] + w["end"]) / 2 for w in windows]
        top.plot(middle, [w["ppl"] for w in windows], style, color=color, lw=width, marker=".", label=label)
        mem = r["memory"]
        bottom.plot([m["seen_tokens"] for m in mem], [m["kv_bytes"] / 2**20 for m in mem], style, color=color, lw=width)
    longest = max(r["tokens"] for r in records)
    for b in records[0]["stream"]["boundaries"]:
        if b < longest:
            for ax in (top, bottom):
                ax.axvline(b, color="gray", lw=0.6, ls="--")
    if context and context < longest:
        for ax in (top, bottom):
            ax.axvline(context, color="red", lw=0.8, ls="-.")
        top.text(context, top.get_ylim()[1], " model context", color="red", va="top", fontsize=8)
    top.set_yscale("log")
    size = records[0]["windows"][0]["end"] - records[0]["windows"][0]["start"]
    top.set_ylabel(f"perplexity per {size:,}-token window")
    bottom.set_xlim(0, longest)
    top.legend(fontsize=8, ncol=2)
    top.set_title("SmolLM2-135M-Instruct, PG-19 x2 + WikiText-2 (dashed: document boundaries)", fontsize=10)
    bottom.set_ylabel("KV cache (MiB)")
    bottom.set_xlabel("position in the stream (tokens)")
    bottom.set_yscale("log")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def summary_table(records: list[dict[str, Any]]) -> str:
    """Markdown: perplexity over each source of the stream (windows assigned by their middle), KV memory, speed."""
    meta = records[0]["stream"]
    names = [Path(source["name"]).stem.split("_")[0] for source in meta["sources"]]
    edges = [0, *meta["boundaries"], max(r["tokens"] for r in records)]
    header = " | ".join(f"{name} (tokens {a:,}-{b:,})" for name, a, b in zip(names, edges, edges[1:], strict=False))
    rows = [
        f"| run | tokens | ppl (all) | {header} | KV cache at end | tokens/s |",
        "|---|---:|---:|" + "---:|" * (len(edges) - 1) + "---:|---:|",
    ]

    def segment_ppl(windows, a, b):
        inside = [w for w in windows if a <= (w["start"] + w["end"]) / 2 < b]
        count = sum(w["end"] - w["start"] for w in inside)
        total = sum(w["nll"] * (w["end"] - w["start"]) for w in inside)
        return f"{math.exp(total / count):.2f}" if count else "-"

    for r in sorted(records, key=lambda r: (not bounded(r), not r["streaming"], r["size"] or 0, r["policy"])):
        cells = " | ".join(segment_ppl(r["windows"], a, b) for a, b in zip(edges, edges[1:], strict=False))
        end_mib = r["memory"][-1]["kv_bytes"] / 2**20
        rows.append(
            f"| {r['run']} | {r['tokens']:,} | {r['ppl']:.2f} | {cells} | {end_mib:.1f} MiB | {r['tokens_per_s']:.1f} |"
        )
    return "\n".join(rows)


def versus_table(records: list[dict[str, Any]], versus: str) -> str:
    """Markdown: each streaming run's perplexity change against ``versus`` at the same size, over each source.

    Paired over the same 64-token blocks of the stream (``block_nll``, :func:`h2o_kv.harness.tables.paired`,
    percentile bootstrap): ``exp(mean block NLL difference) - 1`` in %, with its 95% interval; negative is better.
    """
    from ..harness.tables import paired

    meta = records[0]["stream"]
    names = [Path(source["name"]).stem.split("_")[0] for source in meta["sources"]]
    rows = [f"| run (vs {versus}, same size) | " + " | ".join(names) + " |", "|---|" + "---:|" * len(names)]
    for r in sorted(records, key=lambda r: (r["size"] or 0, r["run"])):
        base = next(
            (
                b
                for b in records
                if b["policy"] == versus
                and (b["size"], b["streaming"], b["tokens"]) == (r["size"], r["streaming"], r["tokens"])
            ),
            None,
        )
        if base is None or base is r or not r["streaming"]:
            continue
        size, mine, theirs = r["block_nll"]["size"], r["block_nll"]["mean"], base["block_nll"]["mean"]
        edges = [0, *meta["boundaries"], r["tokens"]]
        cells = []
        for a, b in zip(edges, edges[1:], strict=False):
            inside = [i for i in range(len(mine)) if a <= i * size < b]
            diff = paired([mine[i] for i in inside], [theirs[i] for i in inside])
            value, low, high = (100 * (math.exp(x) - 1) for x in (diff.value, *diff.interval()))
            cells.append(f"{value:+.2f}% [{low:+.2f}, {high:+.2f}]")
        rows.append(f"| {r['run']} | " + " | ".join(cells) + " |")
    return "\n".join(rows) if len(rows) > 2 else ""


@app.command()
def plot(
    folder: Path = typer.Option(OUT, help="Folder with the result JSONs of `run`."),
    png: Path = typer.Option(OUT / "streaming_ppl.png", help="Output figure."),
    context: int = typer.Option(8192, help="The model's context length (a marker on the plot)."),
    versus: str = typer.Option("sink", help="The policy every streaming run is compared with, at the same size."),
):
    """Plot windowed perplexity and KV memory vs position, and print a markdown table."""
    records = load_results(folder)
    if not records:
        typer.secho(f"Error: no streaming results in {folder}; run `run` first", err=True, fg="red")
        raise typer.Exit(2)
    plot_results(records, png, context)
    table = summary_table(records)
    changes = versus_table(records, versus)
    table += (
        f"\n\nPerplexity change against {versus}, paired over 64-token blocks [95%]:\n\n{changes}" if changes else ""
    )
    (folder / "summary.md").write_text(table + "\n")
    typer.echo(table)
    typer.echo(f"wrote {png} and {folder / 'summary.md'} ({time.strftime('%Y-%m-%d %H:%M')})")


if __name__ == "__main__":
    app()
