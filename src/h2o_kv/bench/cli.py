"""``h2o-kv bench``: speed and memory of h2o-kv's caches against the stock full cache and kvpress.

Run directly with ``python -m h2o_kv.bench.cli`` until the command group is mounted in the main CLI.
"""

from __future__ import annotations

import json
import pathlib
import shlex
import sys

import typer
from rich.console import Console

from .harness import BenchConfig, check_policy

app = typer.Typer(help="Benchmark decode speed, end-to-end throughput and memory of KV-cache policies.",
                  no_args_is_help=True, add_completion=False)  # fmt: skip
console = Console(stderr=True)


def _int_list(text: str, name: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise typer.BadParameter(f"expected comma-separated integers, got {text!r}", param_hint=name) from None
    if not values or any(v < 1 for v in values):
        raise typer.BadParameter(f"expected integers >= 1, got {text!r}", param_hint=name)
    return values


def _model_positions(model: str | None) -> int | None:
    """The model's maximum context, without loading weights (None when it cannot be read cheaply)."""
    from .workload import RANDOM_SHAPES

    if model and model.startswith("random:"):
        shape = RANDOM_SHAPES.get(model.split(":", 1)[1])
        if shape is None:
            raise typer.BadParameter(f"shape must be one of {', '.join(RANDOM_SHAPES)}", param_hint="--model")
        return shape["max_position_embeddings"]
    try:
        from transformers import AutoConfig

        from h2o_kv.models import DEFAULT_MODEL, default_model_dir

        path = default_model_dir() if model in (None, DEFAULT_MODEL) else model
        return int(AutoConfig.from_pretrained(path, local_files_only=True).max_position_embeddings)
    except (OSError, ValueError):
        return None


def build_grid(contexts, batches, policies, new_tokens, budget, prefill_batch) -> list[BenchConfig]:
    """Every (prompt length, batch, policy) configuration, policies alternating innermost."""
    grid = []
    for context in contexts:
        for batch in batches:
            pre = prefill_batch if prefill_batch and batch > prefill_batch and batch % prefill_batch == 0 else None
            for policy in policies:
                grid.append(BenchConfig(policy=policy, context=context, batch=batch, new_tokens=new_tokens,
                                        budget=None if policy == "full" else budget, prefill_batch=pre))  # fmt: skip
    return grid


@app.command("run")
def run_cmd(
    contexts: str = typer.Option("1024,4096", help="Prompt lengths in tokens, comma-separated."),
    batches: str = typer.Option("1,4", help="Batch sizes, comma-separated."),
    policies: str = typer.Option(
        "full,h2o,local,sink",
        help="full (stock DynamicCache + SDPA), h2o-kv policies (h2o, local, sink, ...), kvpress:observed_attention, "
        "kvpress:snapkv.",
    ),
    budget: float = typer.Option(0.2, min=1e-6, max=1.0, help="Cache budget as a ratio of the prompt length."),
    new_tokens: int = typer.Option(256, min=2, help="Tokens generated per sequence (greedy, EOS ignored)."),
    repeats: int = typer.Option(1, min=1, help="Measurements per configuration (alternating order)."),
    memory_limit: str = typer.Option(
        None,
        help="Also find and run, per policy, the largest batch whose cache fits this limit: a size (377MB, "
        "1.5GiB) or full@B (what the full cache needs at batch B for the same workload).",
    ),
    fit_only: bool = typer.Option(False, help="With --memory-limit: run non-full policies only at their fitted batch."),
    prefill_batch: int = typer.Option(
        None,
        min=1,
        help="For batches that are multiples of it: prefill this many distinct prompts and repeat the "
        "cache along the batch (decode work unchanged; prefill and end-to-end numbers then not reported).",
    ),
    model: str = typer.Option(None, help="Model dir/id, or random:<shape> (random weights; e.g. random:llama3-8b)."),
    device: str = typer.Option("auto", help="auto (CUDA if available), cpu, cuda, cuda:N."),
    dtype: str = typer.Option(None, help="float32/bfloat16/float16 (default: float32 on CPU, bfloat16 on CUDA)."),
    threads: int = typer.Option(None, min=1, help="torch CPU threads (default: torch's choice)."),
    isolate: str = typer.Option("auto", help="process (fresh process per measurement), none, or auto (CPU: process)."),
    lock: str = typer.Option(None, help="Hold an exclusive flock on this file during each measurement."),
    out: pathlib.Path = typer.Option(pathlib.Path("results/bench/bench.json"), help="Results JSON (resumed)."),
    plot: pathlib.Path = typer.Option(None, help="Write the tokens/s and memory plot here."),
):
    """Measure the grid contexts x batches x policies; results are written after every measurement."""
    from .report import markdown_table, summarise
    from .runner import ResultStore, RunSettings, fit_runs, new_meta, parse_limit, run_measurements

    context_list, batch_list = _int_list(contexts, "--contexts"), _int_list(batches, "--batches")
    policy_list = [p.strip() for p in policies.split(",") if p.strip()]
    try:
        for p in policy_list:
            check_policy(p)
        if memory_limit:
            parse_limit(memory_limit)
        elif fit_only:
            raise ValueError("--fit-only needs --memory-limit")
        from .workload import resolve_device

        resolve_device(device)
    except (ValueError, ImportError) as err:
        raise typer.BadParameter(str(err)) from None
    limit = _model_positions(model)
    if limit is not None and max(context_list) + new_tokens > limit:
        raise typer.BadParameter(
            f"prompt {max(context_list)} + {new_tokens} new tokens exceeds the model's {limit} positions",
            param_hint="--contexts/--new-tokens",
        )
    grid = build_grid(context_list, batch_list, policy_list, new_tokens, budget, prefill_batch)
    if fit_only and memory_limit:
        grid = [c for c in grid if c.policy == "full"]
    command = shlex.join(["h2o-kv", "bench", *sys.argv[1:]])
    settings = RunSettings(model=model, device=device, dtype=dtype, threads=threads, repeats=repeats,
                           isolate=isolate, lock=lock, command=command)  # fmt: skip
    store = ResultStore(out, new_meta(settings))
    store.save()
    say = console.print
    run_measurements(grid, store, settings, progress=say)
    if memory_limit:
        full_grid = build_grid(context_list, batch_list, policy_list, new_tokens, budget, None)
        fit_runs(full_grid, memory_limit, store, settings, progress=say)
    rows = summarise(store.records)
    print(markdown_table(rows))
    if plot:
        from .report import plot as make_plot

        console.print(f"plot: {make_plot(rows, plot, title=_title(store.data['meta']))}")
    console.print(f"results: {out}")


def _title(meta: dict) -> str:
    machine = meta.get("machine", {})
    device = machine.get("cuda_device") or f"{machine.get('cpu_count')}-core CPU"
    return f"{meta.get('model')} on {device}"


@app.command("report")
def report_cmd(
    results: list[pathlib.Path] = typer.Argument(..., exists=True, dir_okay=False, help="Results JSON file(s)."),
    plot: pathlib.Path = typer.Option(None, help="Write the plot here."),
    batch: int = typer.Option(None, help="Batch size to plot (default: the most common one)."),
):
    """Print the markdown table and the bytes-moved model of result files (merged); optionally plot them."""
    from .report import bytes_model, load, markdown_table, summarise
    from .report import plot as make_plot

    files = [load(path) for path in results]
    data = {"meta": files[0]["meta"], "records": [r for f in files for r in f["records"]]}
    rows = summarise(data["records"])
    print(markdown_table(rows))
    model_rows = bytes_model(rows)
    if model_rows:
        print(
            "\n| policy | prompt | batch | MB/step full (ideal / stock) | MB/step policy | bound (ideal / stock) "
            "| measured (mean / p50) | of ideal bound |\n|---|---:|---:|---:|---:|---:|---:|---:|"
        )
        for m in model_rows:
            full_mb = f"{m['bytes_full_ideal'] / 1e6:.0f} / {m['bytes_full_stock'] / 1e6:.0f}"
            bound = f"{m['ratio_ideal']:.2f}x / {m['ratio_stock']:.2f}x"
            print(
                f"| {m['policy']} | {m['context']} | {m['batch']} | {full_mb} | {m['bytes_policy'] / 1e6:.0f} "
                f"| {bound} | {m['measured']:.2f}x / {m['measured_p50']:.2f}x | {100 * m['fraction_of_ideal']:.0f}% |"
            )
    if plot:
        console.print(f"plot: {make_plot(rows, plot, batch=batch, title=_title(data['meta']))}")


@app.command("profile")
def profile_cmd(
    context: int = typer.Option(2048, min=2, help="Prompt length."),
    batch: int = typer.Option(4, min=1),
    heavy: int = typer.Option(512, min=0, help="Heavy-hitter entries (budget = heavy + recent)."),
    recent: int = typer.Option(512, min=0),
    policy: str = typer.Option("h2o"),
    steps: int = typer.Option(24, min=2, help="Decode steps timed."),
    model: str = typer.Option(None),
    device: str = typer.Option("auto"),
    dtype: str = typer.Option(None),
    threads: int = typer.Option(None, min=1),
    lock: str = typer.Option(None, help="Hold an exclusive flock on this file while profiling."),
    out: pathlib.Path = typer.Option(None, help="Write the split (and the profiler table) as JSON here."),
):
    """Split an h2o-kv decode step: slot write, score update, victim choice, attention, rest."""
    import torch
    from transformers.utils import logging as hf_logging

    from .. import kernels
    from .profile import profile_decode
    from .runner import cpu_lock
    from .workload import load_bench_model

    try:
        cfg = BenchConfig(policy=policy, context=context, batch=batch, new_tokens=steps + 8, budget=None,
                          heavy=heavy, recent=recent)  # fmt: skip
        if policy == "full" or policy.startswith("kvpress:"):
            raise ValueError("profile needs an h2o-kv policy (h2o, local, sink, ...)")
        if heavy + recent < 1:
            raise ValueError("heavy + recent must be >= 1")
    except ValueError as err:
        raise typer.BadParameter(str(err)) from None
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    if threads:
        torch.set_num_threads(threads)
    with cpu_lock(lock):
        lm = load_bench_model(model, device=device, dtype=dtype)
        result = profile_decode(lm, cfg, steps=steps)
    result["model"], result["device"], result["threads"] = lm.name, str(lm.device), torch.get_num_threads()
    result["fused_cpu_kernels"] = lm.device.type == "cpu" and kernels.available()
    split = result["split_ms"]
    print(f"decode step {result['step_ms']:.1f} ms (policy {policy}, budget {heavy}+{recent}, batch {batch}, "
          f"prompt {context}, fused CPU kernels: {'on' if result['fused_cpu_kernels'] else 'off'})")  # fmt: skip
    for name, ms in split.items():
        print(f"  {name:24s} {ms:7.2f} ms  {result['split_percent'][name]:5.1f}%")
    print(f"  eviction bookkeeping     {result['bookkeeping_percent']:.1f}% of the step")
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    app()
