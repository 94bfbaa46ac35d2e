"""``h2o-kv bench``: speed and memory of KV settings - h2o-kv's caches, the stock ``DynamicCache`` and kvpress."""

from __future__ import annotations

import pathlib

import typer
from rich.console import Console

from ..budget import Budget
from ..cli import BUDGET_METAVAR, HELP_STYLE, HelpGroup, as_options, fail
from ..harness.setting import check_name, is_bounded
from ..registry import split_specs

app = typer.Typer(help="Benchmark decode speed, end-to-end throughput and memory of KV settings.",
                  cls=HelpGroup, no_args_is_help=True, add_completion=False, **HELP_STYLE)  # fmt: skip
console = Console(stderr=True)


def _int_list(text: str, name: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise fail(f"{name} must be comma-separated integers, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise fail(f"{name} must be integers >= 1, got {text!r}")
    return values


def _ratio(budget: float) -> float:
    """``--budget`` checked by :class:`~h2o_kv.Budget` (one message for every command)."""
    try:
        return Budget.of(budget).ratio
    except ValueError as err:
        raise fail(as_options(str(err), "budget")) from None


def _kv_bits_list(text: str) -> list[int | None]:
    """``none,8,4`` -> ``[None, 8, 4]``; a one-line error naming ``--kv-bits`` otherwise."""
    out = []
    for item in (part.strip().lower() for part in text.split(",")):
        if item not in ("none", "8", "4"):
            raise ValueError(f"--kv-bits takes none, 8 or 4 (comma-separated); got {item!r}")
        out.append(None if item == "none" else int(item))
    return out


def _model_positions(model: str | None) -> int | None:
    """The model's maximum context, without loading weights (None when it cannot be read cheaply)."""
    from .workload import RANDOM_SHAPES

    if model and model.startswith("random:"):
        shape = RANDOM_SHAPES.get(model.split(":", 1)[1])
        if shape is None:
            raise fail(f"--model random:<shape>: the shape must be one of {', '.join(RANDOM_SHAPES)}")
        return shape["max_position_embeddings"]
    try:
        from transformers import AutoConfig

        from ..models import model_dir

        return int(AutoConfig.from_pretrained(model_dir(model), local_files_only=True).max_position_embeddings)
    except (OSError, ValueError):
        return None


def build_grid(contexts, batches, names, new_tokens, budget, prefill_batch, kv_bits=(None,)) -> list:
    """Every (prompt length, batch, setting, KV precision) configuration, settings alternating innermost; ``budget``
    applies to the settings that evict; ``kv_bits``: each setting at each of these precisions (None: full)."""
    from .harness import BenchConfig

    grid = []
    for context in contexts:
        for batch in batches:
            pre = prefill_batch if prefill_batch and batch > prefill_batch and batch % prefill_batch == 0 else None
            for name in names:
                for bits in kv_bits:
                    grid.append(BenchConfig(policy=name, context=context, batch=batch, new_tokens=new_tokens,
                                            budget=budget if is_bounded(name) else None, prefill_batch=pre,
                                            kv_bits=bits))  # fmt: skip
    return grid


@app.command("run")
def run_cmd(
    contexts: str = typer.Option("1024,4096", help="Prompt lengths in tokens, comma-separated."),
    batches: str = typer.Option("1,4", help="Batch sizes, comma-separated."),
    policies: str = typer.Option(
        "dynamic,h2o,local,sink",
        help="KV settings, comma-separated: dynamic (the stock DynamicCache + SDPA), h2o-kv policies with their "
        "options (h2o, local, sink, a2sf:decay=0.95, ..., full: H2OCache without eviction), kvpress:<press> "
        "(kvpress:observed_attention, kvpress:snapkv, ...).",
    ),
    budget: float = typer.Option(
        0.2, metavar=BUDGET_METAVAR, help="Budget of the evicting settings, a ratio in (0, 1] of the prompt length."
    ),
    new_tokens: int = typer.Option(256, min=2, help="Tokens generated per sequence (greedy, EOS ignored)."),
    repeats: int = typer.Option(1, min=1, help="Measurements per configuration (alternating order)."),
    memory_limit: str = typer.Option(
        None,
        help="Also find and run, per evicting setting, the largest batch whose cache fits this limit: a size (377MB, "
        "1.5GiB) or SETTING@B, e.g. dynamic@4 (what that unbounded setting needs at batch B for the same workload).",
    ),
    fit_only: bool = typer.Option(False, help="With --memory-limit: run evicting settings only at their fitted batch."),
    prefill_batch: int = typer.Option(
        None,
        min=1,
        help="For batches that are multiples of it: prefill this many distinct prompts and repeat the "
        "cache along the batch (decode work unchanged; prefill and end-to-end numbers then not reported).",
    ),
    kv_bits: str = typer.Option(
        "none",
        "--kv-bits",
        help="KV precisions, comma-separated: none (full), 8, 4 (H2OCache(kv_bits=...); dynamic with 4: transformers' "
        "QuantizedCache). Each setting runs at each, alternating: --kv-bits none,4.",
    ),
    model: str = typer.Option(None, help="Model dir/id, or random:<shape> (random weights; e.g. random:llama3-8b)."),
    device: str = typer.Option("auto", help="auto (CUDA if available), cpu, cuda, cuda:N."),
    dtype: str = typer.Option(None, help="float32/bfloat16/float16 (default: float32 on CPU, bfloat16 on CUDA)."),
    threads: int = typer.Option(None, min=1, help="torch CPU threads (default: torch's choice)."),
    isolate: str = typer.Option("auto", help="process (fresh process per measurement), none, or auto (CPU: process)."),
    lock: str = typer.Option(None, help="Hold an exclusive flock on this file during each measurement."),
    out: pathlib.Path = typer.Option(..., help="Results JSON (created, or resumed and appended to)."),
    plot: pathlib.Path = typer.Option(None, help="Write the tokens/s and memory plot here."),
):
    """Measure the grid contexts x batches x settings; results are written after every measurement."""
    context_list, batch_list = _int_list(contexts, "--contexts"), _int_list(batches, "--batches")
    budget = _ratio(budget)
    try:
        policy_list = [check_name(name, "--policies") for name in split_specs(policies)]
        if not policy_list:
            raise ValueError("--policies is empty")
        bits_list = _kv_bits_list(kv_bits)
    except ValueError as err:  # before the imports of torch (seconds)
        raise fail(str(err)) from None
    from .report import markdown_table, summarise
    from .runner import ResultStore, RunSettings, fit_runs, parse_limit, run_info, run_measurements

    try:
        if memory_limit:
            parse_limit(memory_limit)
        elif fit_only:
            raise ValueError("--fit-only needs --memory-limit")
        from .workload import resolve_device

        resolve_device(device)
    except (ValueError, ImportError) as err:
        raise fail(str(err)) from None
    limit = _model_positions(model)
    if limit is not None and max(context_list) + new_tokens > limit:
        raise fail(f"--contexts/--new-tokens: prompt {max(context_list)} + {new_tokens} new tokens exceeds the model's "
                   f"{limit} positions")  # fmt: skip
    grid = build_grid(context_list, batch_list, policy_list, new_tokens, budget, prefill_batch, bits_list)
    try:
        for config in grid:  # an extra a setting needs is missing: say so before the first measurement
            config.setting.require_extras("--policies/--kv-bits")
    except ValueError as err:
        raise fail(str(err)) from None
    settings = RunSettings(model=model, device=device, dtype=dtype, threads=threads, repeats=repeats,
                           isolate=isolate, lock=lock)  # fmt: skip
    try:
        store = ResultStore(out, run_info(settings, grid))
    except ValueError as err:
        raise fail(str(err)) from None
    if fit_only and memory_limit:
        grid = [c for c in grid if not c.setting.bounded]
    store.save()
    say = console.print
    run_measurements(grid, store, settings, progress=say)
    if memory_limit:
        full_grid = build_grid(context_list, batch_list, policy_list, new_tokens, budget, None)
        fit_runs(full_grid, memory_limit, store, settings, progress=say)
    baseline = next((name for name in policy_list if not is_bounded(name)), None)
    rows = summarise(store.records, baseline or "dynamic")
    print(markdown_table(rows, baseline or "dynamic"))
    if plot:
        from .report import plot as make_plot

        console.print(f"plot: {make_plot(rows, plot, title=_title(store.data['runs'][-1]))}")
    console.print(f"results: {out}")


def _title(run: dict) -> str:
    machine = run.get("machine", {})
    device = machine.get("cuda_device") or f"{machine.get('cpu_count')}-core CPU"
    return f"{run.get('model')} on {device}"


@app.command("report")
def report_cmd(
    results: list[pathlib.Path] = typer.Argument(..., exists=True, dir_okay=False, help="Results JSON file(s)."),
    plot: pathlib.Path = typer.Option(None, help="Write the plot here."),
    batch: int = typer.Option(None, help="Batch size to plot (default: the most common one)."),
    baseline: str = typer.Option("dynamic", help="The unbounded setting the ratios are taken against."),
):
    """Print the markdown table and the bytes-moved model of result files (merged); optionally plot them."""
    from ..harness.tables import markdown
    from .report import bytes_model, load, markdown_table, summarise
    from .report import plot as make_plot

    try:
        files = [load(path) for path in results]
    except ValueError as err:
        raise fail(str(err)) from None
    rows = summarise([r for f in files for r in f["records"]], baseline)
    print(markdown_table(rows, baseline))
    model_rows = bytes_model(rows)
    if model_rows:
        header = ["setting", "prompt", "batch", f"MB/step {baseline} (ideal / stock)", "MB/step setting",
                  "bound (ideal / stock)", "measured (mean / p50)", "of ideal bound"]  # fmt: skip
        table = [
            [m["policy"], str(m["context"]), str(m["batch"]),
             f"{m['bytes_full_ideal'] / 1e6:.0f} / {m['bytes_full_stock'] / 1e6:.0f}", f"{m['bytes_policy'] / 1e6:.0f}",
             f"{m['ratio_ideal']:.2f}x / {m['ratio_stock']:.2f}x", f"{m['measured']:.2f}x / {m['measured_p50']:.2f}x",
             f"{100 * m['fraction_of_ideal']:.0f}%"]
            for m in model_rows
        ]  # fmt: skip
        print("\n" + "\n".join(markdown(header, table)))
    if plot:
        console.print(f"plot: {make_plot(rows, plot, batch=batch, title=_title(files[0]['runs'][-1]))}")


@app.command("kv-memory")
def kv_memory_cmd(
    tokens: str = typer.Option("1024,2048,4096", help="Context lengths N, comma-separated."),
    budget: float = typer.Option(
        0.2, metavar=BUDGET_METAVAR, help="Budget of the h2o settings, a ratio in (0, 1] of N."
    ),
    settings: str = typer.Option(
        "dynamic,h2o,h2o-kv8,h2o-kv4,dynamic-kv4", help="Settings (dynamic = the full fp32 cache; -kvB: B-bit KV)."
    ),
    model: str = typer.Option(None, help="Model dir/id (default: the embedded default model)."),
    json_path: pathlib.Path = typer.Option(..., "--json", help="Write the result record here."),
):
    """The KV memory to hold N tokens of context: full, h2o, h2o + 8/4-bit, transformers' QuantizedCache 4-bit,
    counted from caches the model builds (fp32, CPU, batch 1)."""
    from ..harness import records
    from .kv_memory import SETTINGS, markdown, run

    length_list, budget = _int_list(tokens, "--tokens"), _ratio(budget)
    labels = [label.strip() for label in settings.split(",") if label.strip()]
    unknown = sorted(set(labels) - set(SETTINGS))
    if unknown or "dynamic" not in labels:
        raise fail(f"--settings: choose among {', '.join(SETTINGS)}, dynamic included; got {settings!r}")
    result = run(length_list, budget, labels, model=model, progress=console.print)
    table = markdown(result)
    print(table)
    records.write(json_path, "kv-memory", {**result, "table": table}, device="cpu")
    console.print(f"results: {json_path}")


@app.command("profile")
def profile_cmd(
    context: int = typer.Option(2048, min=2, help="Prompt length."),
    batch: int = typer.Option(4, min=1),
    heavy: int = typer.Option(512, min=0, help="Heavy-hitter entries (budget = heavy + recent)."),
    recent: int = typer.Option(512, min=0),
    policy: str = typer.Option(
        "h2o", metavar="POLICY", help="An evicting h2o-kv policy, with options (a2sf:decay=0.95)."
    ),
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

    from ..harness import records
    from .harness import BenchConfig
    from .profile import profile_decode
    from .runner import cpu_lock
    from .workload import load_bench_model

    try:
        cfg = BenchConfig(policy, context, batch, new_tokens=steps + 8, heavy=heavy, recent=recent)
        if not (cfg.setting.uses_h2o_cache and cfg.setting.bounded):
            raise ValueError("profile needs an evicting h2o-kv policy (h2o, local, sink, ...)")
    except ValueError as err:
        raise fail(as_options(str(err), "policy", "heavy", "recent")) from None
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    if threads:
        torch.set_num_threads(threads)
    with cpu_lock(lock):
        lm = load_bench_model(model, device=device, dtype=dtype)
        result = profile_decode(lm, cfg, steps=steps)
    result["model"], result["device"], result["threads"] = lm.name, str(lm.device), torch.get_num_threads()
    kernels_on = records.fused_cpu_kernels(lm.device)
    split = result["split_ms"]
    print(f"decode step {result['step_ms']:.1f} ms (policy {policy}, budget {heavy}+{recent}, batch {batch}, "
          f"prompt {context}, fused CPU kernels: {'on' if kernels_on else 'off'})")  # fmt: skip
    for name, ms in split.items():
        print(f"  {name:24s} {ms:7.2f} ms  {result['split_percent'][name]:5.1f}%")
    print(f"  eviction bookkeeping     {result['bookkeeping_percent']:.1f}% of the step")
    if out:
        records.write(out, "profile", result, device=lm.device)


SERVE_HELP = """Serving throughput of KV settings through vLLM (h2o-kv serve + vllm bench serve), one fresh server per
setting, at a fixed KV space; one JSON per setting (OUT_<setting>.json), a markdown table (OUT.md) and a plot (OUT.png).
Arguments after -- go to every setting's vllm serve as given (-- --data-parallel-size 2).
"""


@app.command("serve", help=SERVE_HELP, context_settings={"allow_extra_args": True})
def serve_cmd(
    ctx: typer.Context,
    policies: str = typer.Option(
        "full,h2o",
        help="Settings, comma-separated: full, POLICY (with --budget), POLICY@RATIO, POLICY@HEAVY+RECENT; POLICY "
        "with its options as for h2o-kv serve (a2sf:decay=0.95@0.2).",
    ),
    budget: float = typer.Option(0.2, help="Budget of a POLICY given without one (a ratio of each prompt)."),
    workload: str = typer.Option("decode-heavy", help="decode-heavy, prompt-heavy, chat, decode-step or xsum."),
    requests: int = typer.Option(16, min=1, help="Requests (xsum: the first N articles)."),
    concurrency: int = typer.Option(16, min=1, help="Requests in flight at once (the load generator's limit)."),
    kv_cache_gb: str = typer.Option(
        "auto",
        help="KV space in GiB, or auto: exactly --kv-fit full-length requests of the workload (+ vLLM's null block).",
    ),
    kv_fit: int = typer.Option(4, min=1, help="With --kv-cache-gb auto: full-length requests the KV space holds."),
    port: int = typer.Option(8200, min=1, max=65535, help="Server port (on 127.0.0.1)."),
    seed: int = typer.Option(0, help="Seed of the prompts' order and of the load generator."),
    transformers: pathlib.Path = typer.Option(
        None, exists=True, dir_okay=False, help="Also tabulate this h2o-kv bench run results file (transformers)."
    ),
    out: pathlib.Path = typer.Option(..., help="Results: OUT_<setting>.json per setting, OUT.md, OUT.png."),
):
    """Measure serving throughput (the help text is above)."""
    from .serve import WORKLOADS, ServeBench, Setting
    from .serve_report import comparison_table, plot, transformers_rows

    try:
        if workload not in WORKLOADS:
            raise ValueError(f"--workload must be one of {', '.join(WORKLOADS)}, got {workload!r}")
        settings = [Setting.parse(text, budget) for text in split_specs(policies)]
        if not settings:
            raise ValueError("--policies is empty")
        if kv_cache_gb == "auto":
            kv_bytes = None
        else:
            gb = float(kv_cache_gb)
            if not gb > 0:
                raise ValueError(f"--kv-cache-gb must be auto or a number of GiB > 0, got {kv_cache_gb!r}")
            kv_bytes = int(gb * 2**30)
        from ..vllm.serve import ServeOptions

        for setting in settings:
            ServeOptions(setting.config, port=port, extra=tuple(ctx.args))  # vLLM, the plugin, the args after --
    except ValueError as err:
        raise fail(str(err)) from None
    bench = ServeBench(settings, WORKLOADS[workload], requests, concurrency, kv_bytes, out, fit=kv_fit, port=port,
                       seed=seed, vllm_args=tuple(ctx.args), progress=console.print)  # fmt: skip
    results = bench.run()
    extra = transformers_rows(transformers) if transformers else []
    table = comparison_table(results, extra)
    print(table)
    out.with_suffix(".md").write_text(table + "\n")
    if workload != "xsum":
        title = f"{workload}: {requests} requests, concurrency {concurrency}, KV {bench.kv_cache_bytes / 2**30:.3f} GiB"
        console.print(f"plot: {plot(results, out.with_suffix('.png'), title)}")
    console.print(f"table: {out.with_suffix('.md')}")


@app.command("soak")
def soak_cmd(
    clients: int = typer.Option(64, min=1, help="Concurrent streaming clients."),
    duration: float = typer.Option(300.0, min=1.0, help="Seconds of load."),
    disconnect_fraction: float = typer.Option(0.2, min=0.0, max=1.0, help="Clients that leave streams early."),
    policy: str = typer.Option("full", help="The server's setting: full, POLICY@RATIO or POLICY@HEAVY+RECENT."),
    kv_cache_gb: float = typer.Option(1.0, min=0.01, help="KV space of the server in GiB."),
    max_model_len: int = typer.Option(2048, min=64, help="The server's context (bad-request checks exceed it)."),
    port: int = typer.Option(8210, min=1, max=65535, help="Server port (on 127.0.0.1)."),
    seed: int = typer.Option(0),
    out: pathlib.Path = typer.Option(..., help="Result JSON."),
):
    """Load and faults against a local h2o-kv serve: streaming clients, disconnects, bad requests, API key."""
    import secrets
    import tempfile

    from ..harness import records
    from ..vllm.serve import ServeOptions, ServerProcess, describe, plugin_installed
    from .serve import Setting, vllm_versions
    from .soak import SoakConfig, run_soak

    try:
        cfg = SoakConfig(clients=clients, duration_s=duration, disconnect_fraction=disconnect_fraction, seed=seed)
        setting = Setting.parse(policy)
        key = secrets.token_hex(8)
        options = ServeOptions(setting.config, port=port, api_key=key, kv_cache_gb=kv_cache_gb,
                               max_model_len=max_model_len)  # fmt: skip
    except ValueError as err:
        raise fail(str(err)) from None
    log = pathlib.Path(tempfile.mkdtemp(prefix="h2o-kv-soak-")) / "server.log"
    console.print(f"soak: starting the server (log {log})")
    with ServerProcess(options, log=log) as server:
        active = plugin_installed() and setting.config.evicts
        result = run_soak(server, cfg, api_key=key, context=max_model_len, h2o_active=active,
                          progress=console.print)  # fmt: skip
        command = describe(server.argv, server.env)
    result.update(setting=setting.label, policy=setting.config.policy, kv_cache_gb=kv_cache_gb,
                  max_model_len=max_model_len, server_command=command, server_log=str(log))  # fmt: skip
    data = records.record("serve_soak", result, h2o_cache=False)
    data["versions"].update(vllm_versions())
    records.save(out, data)
    for name, value in result["checks"].items():
        console.print(f"  {name:28s} {'pass' if value else ('n/a' if value is None else 'FAIL')}")
    console.print(f"soak {'passed' if result['passed'] else 'FAILED'}: {out}")
    if not result["passed"]:
        raise typer.Exit(1)


if __name__ == "__main__":
    app()
