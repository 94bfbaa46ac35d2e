"""``h2o-kv eval``: quality at a given KV setting. Each command is a thin wrapper around its module; the shared
options are declared once in :mod:`h2o_kv.eval.options`, and every input is validated before the model loads."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import typer

from ..cli import HELP_STYLE, HelpGroup, as_options
from ..registry import split_specs
from .options import (
    API_KEY,
    BUDGET,
    DEVICE,
    DTYPE,
    HEAVY,
    JSON,
    KV_BITS,
    MODEL,
    PEER,
    POLICY,
    RECENT,
    RECONSTRUCT,
    SERVER,
    kv_setting,
)

app = typer.Typer(
    help="Quality at a given KV setting, on real data.",
    cls=HelpGroup,
    no_args_is_help=True,
    add_completion=False,
    **HELP_STYLE,
)


def fail(message: str) -> None:
    """A one-line input error, ``error: message`` on stderr, exit status 2, before any long work (as every command)."""
    typer.echo(f"error: {' '.join(str(message).split())}", err=True)
    raise typer.Exit(2)


def _setting(*args, **kwargs):
    """:func:`~h2o_kv.eval.options.kv_setting`, checked first (a bad name fails before torch is imported)."""
    try:
        return kv_setting(*args, **kwargs)
    except (ValueError, ImportError) as err:  # the library's parameter names as the options
        fail(as_options(str(err), "budget", "heavy", "recent", "kv_bits", "reconstruct"))


def _prepare(make: Callable[[], Any], handle, *, load: bool = True):
    """Validate (``make()``), then load the model (unless not ``load``: the items run on a ``--server``): every
    bad input fails here, before the long work."""
    try:
        job = make()
        from transformers.utils import logging as transformers_logging

        transformers_logging.disable_progress_bar()
        return job, handle.model() if load else None
    except (ValueError, FileNotFoundError, ImportError) as err:
        fail(str(err))


def _server_runner(server: str | None, api_key: str | None, setting, handle, protocol: str = "question_in_prompt"):
    """The :class:`~h2o_kv.eval.server.ServerRunner` of ``--server`` (None without it): the setting is one a server
    runs, the protocol one a request can express, the server answers and serves the ``--model`` (its tokenizer)."""
    if server is None:
        return None
    from .server import ServerRunner, check_protocol

    check_protocol(protocol)
    runner = ServerRunner(server, setting, api_key=api_key)
    if Path(handle.label).name != runner.model:
        raise ValueError(f"--server {server} serves {runner.model}, not --model {handle.label} (whose tokenizer "
                         "makes the prompts)")  # fmt: skip
    return runner


def _wrote(*paths: Path | None) -> None:
    for path in paths:
        if path is not None:
            typer.echo(f"wrote {path}")


def _bar(total: int, description: str):
    """A progress bar and its ``advance(n)`` callback."""
    from rich.progress import Progress

    bar = Progress()
    task = bar.add_task(description, total=total)
    return bar, lambda n: bar.advance(task, n)


@app.command()
def ppl(
    text: Path = typer.Option(..., "--text", help="UTF-8 text file (e.g. a PG-19 book or WikiText-2)."),
    strip_gutenberg: bool = typer.Option(
        False,
        "--strip-gutenberg",
        help="Keep only the book between its '*** START/END OF ...' markers (which the text must have).",
    ),
    tokens: int = typer.Option(..., "--tokens", help="Evaluate the first N tokens of the text (a budget is of N)."),
    policy: str = POLICY,
    budget: float = BUDGET,
    heavy: int = HEAVY,
    recent: int = RECENT,
    kv_bits: int = KV_BITS,
    streaming: bool = typer.Option(False, "--streaming", help="Position rolling: H2OCache(streaming=True)."),
    window: int = typer.Option(None, "--window", help="Also report perplexity per window of this many tokens."),
    chunk: int = typer.Option(512, "--chunk", help="Tokens per forward pass (memory bound; results do not change)."),
    token_by_token: bool = typer.Option(
        False, "--token-by-token", help="One forward per token (slow; the definition the fast path is tested against)."
    ),
    json_path: Path = JSON,
    model: str = MODEL,
    dtype: str = DTYPE,
    device: str = DEVICE,
):
    """Streaming perplexity: every token a decode step with eviction (one causal forward per chunk if unbounded)."""
    setting = _setting(policy, budget, heavy, recent, kv_bits=kv_bits)
    from .ppl import PPLJob, run_ppl
    from .runner import ModelHandle

    handle = ModelHandle(model, dtype, device)

    def make():
        job = PPLJob.create(
            text, tokens, setting, gutenberg=strip_gutenberg,
            streaming=streaming, window=window, chunk=chunk, token_by_token=token_by_token,
        )  # fmt: skip
        job.token_ids(handle.tokenizer())
        return job

    job, loaded = _prepare(make, handle)
    heavy_, recent_ = job.heavy_recent
    bar, advance = _bar(job.tokens, f"ppl {job.setting.label} H={heavy_} R={recent_}")
    with bar:
        record = run_ppl(job, loaded, handle.tokenizer(), json_path, model_name=handle.label, progress=advance)
    typer.echo(
        f"ppl {record['ppl']:.4f}  nll {record['nll']:.4f}  ({record['predicted']} predicted tokens, "
        f"{record['policy']}, heavy {record['heavy']}, recent {record['recent']}, {record['time_s']:.1f} s)"
    )
    _wrote(json_path)


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def sweep(
    ctx: typer.Context,
    kind: str = typer.Option(..., "--kind", help="Kind of evaluation (ppl, tasks, xsum, needle); its options follow."),
    policies: str = typer.Option(
        "full,h2o,local,sink,tova,snapkv,random",
        "--policies",
        help="KV settings, comma-separated: as --policy (a2sf:decay=0.95 included) or kvpress:<press>; unbounded "
        "ones run once.",
    ),
    budgets: str = typer.Option("0.05,0.1,0.2,0.4,1.0", "--budgets", help="Ratios in (0, 1]."),
    out: Path = typer.Option(..., "--out", help="Folder for one result JSON per cell (resumable)."),
    model: str = MODEL,
    dtype: str = DTYPE,
    device: str = DEVICE,
):
    """Run a settings x budgets grid of one kind; cells whose JSON exists are skipped (resume)."""
    from .runner import ModelHandle
    from .sweep import parse_list, parse_options, run_sweep

    try:
        options = parse_options(ctx.args)
        names = split_specs(policies)
        if not names:
            raise ValueError("--policies is empty")
        budget_list = parse_list(budgets, "budgets", float)
        paths = run_sweep(kind, names, budget_list, out, options, ModelHandle(model, dtype, device))
    except (ValueError, FileNotFoundError, ImportError) as err:
        fail(str(err))
    typer.echo(f"{len(paths)} results in {out}")


@app.command()
def report(
    paths: list[Path] = typer.Argument(..., help="Result JSON files or folders (searched recursively)."),
    out: Path = typer.Option(..., "--out", help="Markdown file; plots go next to it."),
    plots: bool = typer.Option(True, "--plots/--no-plots"),
    baselines: str = typer.Option(
        "full", "--baselines", help="Perplexity: paired change vs these settings (same budget), comma-separated."
    ),
):
    """Markdown tables (rows setting, columns budget, per metric) and quality-vs-budget plots."""
    from .report import build_report
    from .sweep import parse_list

    try:
        build_report(paths, out, plots=plots, baselines=tuple(parse_list(baselines, "baselines")))
    except (ValueError, FileNotFoundError) as err:
        fail(str(err))
    _wrote(out)


@app.command()
def tasks(
    task_names: str = typer.Option(
        "piqa,openbookqa,rte,mathqa,hellaswag,lambada", "--tasks", help="Comma-separated lm-eval task names."
    ),
    include_path: list[Path] = typer.Option(None, "--include-path", help="Folder of extra lm-eval task YAMLs."),
    num_fewshot: int = typer.Option(5, "--num-fewshot"),
    limit: int = typer.Option(None, "--limit", help="Evaluate the first N items of each task."),
    policy: str = POLICY,
    budget: float = BUDGET,
    heavy: int = HEAVY,
    recent: int = RECENT,
    paper_protocol: bool = typer.Option(
        False, "--paper-protocol", help="Also process every context token under eviction (the H2O paper's protocol)."
    ),
    peer: str = PEER,
    kv_bits: int = KV_BITS,
    reconstruct: str = RECONSTRUCT,
    json_path: Path = JSON,
    model: str = MODEL,
    dtype: str = DTYPE,
    device: str = DEVICE,
):
    """lm-eval tasks (acc, acc_norm, stderr) with the few-shot context compressed to the budget."""
    setting = _setting(policy, budget, heavy, recent, peer, kv_bits, reconstruct)
    from .runner import ModelHandle
    from .tasks import TasksJob, run_tasks, summary_lines

    handle = ModelHandle(model, dtype, device)
    job, loaded = _prepare(
        lambda: TasksJob.create(
            task_names, setting,
            paper_protocol=paper_protocol, num_fewshot=num_fewshot, limit=limit, include_path=include_path or None,
        ),
        handle,
    )  # fmt: skip
    record = run_tasks(job, loaded, handle.tokenizer(), json_path, model_name=handle.label)
    typer.echo("\n".join(summary_lines(record)))
    _wrote(json_path)


@app.command()
def xsum(
    limit: int = typer.Option(None, "--limit", help="Summarize the first N articles."),
    policy: str = POLICY,
    budget: float = BUDGET,
    heavy: int = HEAVY,
    recent: int = RECENT,
    peer: str = PEER,
    kv_bits: int = KV_BITS,
    reconstruct: str = RECONSTRUCT,
    raw_prompt: bool = typer.Option(False, "--raw-prompt", help="Feed the file's prompt as is (no chat template)."),
    data: Path = typer.Option(None, "--data", help="Another XSUM 0-shot JSONL (default: the shared data file)."),
    json_path: Path = JSON,
    model: str = MODEL,
    dtype: str = DTYPE,
    device: str = DEVICE,
):
    """0-shot XSUM summarization, ROUGE-1/2/L, with the article's cache compressed to the budget."""
    setting = _setting(policy, budget, heavy, recent, peer, kv_bits, reconstruct)
    from .runner import ModelHandle
    from .xsum import XsumJob, run_xsum

    handle = ModelHandle(model, dtype, device)
    job, loaded = _prepare(
        lambda: XsumJob.create(
            setting,
            limit=limit,
            raw_prompt=raw_prompt,
            path=data,
        ),
        handle,
    )
    bar, advance = _bar(len(job.items), f"xsum {job.setting.name}")
    with bar:
        record = run_xsum(job, loaded, handle.tokenizer(), json_path, model_name=handle.label, progress=advance)
    metrics = record["metrics"]
    typer.echo(
        "  ".join(f"{k} {metrics[k]:.4f} ± {metrics[k + '_stderr']:.4f}" for k in ("rouge1", "rouge2", "rougeL"))
        + f"  ({record['n']} items, {record['policy']})"
    )
    _wrote(json_path)


@app.command()
def needle(
    lengths: str = typer.Option("1024,2048,4096", "--lengths", help="Document lengths in tokens."),
    depths: str = typer.Option("0,25,50,75,100", "--depths", help="Needle depths in % of the document."),
    policy: str = POLICY,
    budget: float = BUDGET,
    heavy: int = HEAVY,
    recent: int = RECENT,
    peer: str = PEER,
    kv_bits: int = KV_BITS,
    reconstruct: str = RECONSTRUCT,
    png: Path = typer.Option(None, "--png", help="Write the heatmap (depth x length) here."),
    compare: list[Path] = typer.Option(None, "--compare", help="Other needle result JSONs drawn next to this one."),
    json_path: Path = JSON,
    server: str = SERVER,
    api_key: str = API_KEY,
    model: str = MODEL,
    dtype: str = DTYPE,
    device: str = DEVICE,
):
    """Needle in a haystack (Paul Graham essays): retrieval score per length and depth under the budget."""
    import json

    setting = _setting(policy, budget, heavy, recent, peer, kv_bits, reconstruct)
    from .needle import NeedleJob, parse_ints, run_needle
    from .runner import ModelHandle

    handle = ModelHandle(model, dtype, device)
    runner = None

    def make():
        nonlocal runner
        runner = _server_runner(server, api_key, setting, handle)
        others = []
        for path in compare or []:
            if not path.is_file():
                raise FileNotFoundError(f"--compare {path} does not exist")
            others.append(json.loads(path.read_text()))
        parse_ints(lengths, "lengths", 1), parse_ints(depths, "depths", 0, 100)  # before the model loads
        from ..models import model_context_length

        context = runner.max_model_len if runner else model_context_length(handle.model())
        job = NeedleJob.create(setting, lengths, depths, handle.tokenizer(), max_length=context)
        return job, others

    (job, others), loaded = _prepare(make, handle, load=server is None)
    bar, advance = _bar(len(job.lengths) * len(job.depths), f"needle {job.setting.name}")
    with bar:
        record = run_needle(
            job, loaded, handle.tokenizer(), json_path, model_name=handle.label, png=png, compare=others,
            progress=advance, runner=runner,
        )  # fmt: skip
    for key, value in record["metrics"].items():
        typer.echo(f"{key} {value:.3f}")
    _wrote(json_path, png)


@app.command()
def ruler(
    lengths: str = typer.Option("1024,2048,4096", "--lengths", help="Prompt lengths in tokens."),
    tasks: str = typer.Option(
        "niah_single,niah_multikey,niah_multivalue,niah_multiquery,vt,cwe,fwe", "--tasks", help="RULER tasks."
    ),
    n: int = typer.Option(10, "--n", help="Items per task and length."),
    seed: int = typer.Option(0, "--seed", help="Generation seed (0: the evaluation split; 1: the tuning split)."),
    protocol: str = typer.Option(
        "question_after", "--protocol", help="question_after (not seen while compressing) or question_in_prompt."
    ),
    policy: str = POLICY,
    budget: float = BUDGET,
    heavy: int = HEAVY,
    recent: int = RECENT,
    peer: str = PEER,
    reconstruct: str = RECONSTRUCT,
    json_path: Path = JSON,
    server: str = SERVER,
    api_key: str = API_KEY,
    model: str = MODEL,
    dtype: str = DTYPE,
    device: str = DEVICE,
):
    """RULER-style synthetic suite (needles, variable tracking, common/frequent words), generated from a seed."""
    setting = _setting(policy, budget, heavy, recent, peer, reconstruct=reconstruct)
    from .needle import parse_ints
    from .ruler import RulerJob, run_ruler
    from .runner import ModelHandle, check_protocol

    handle = ModelHandle(model, dtype, device)
    runner = None

    def make():
        nonlocal runner
        runner = _server_runner(server, api_key, setting, handle, protocol)
        if runner is None:
            check_protocol(setting, False)
        from ..models import model_context_length

        # every option is checked (and the haystack tokenized, once) before the model loads; then the context
        job = RulerJob.create(
            setting, handle.tokenizer(), lengths=lengths, tasks=tasks, n=n, seed=seed, protocol=protocol
        )  # fmt: skip
        context = runner.max_model_len if runner else model_context_length(handle.model())
        parse_ints(job.lengths, "lengths", 256, None if context is None else context - 128)
        return job

    job, loaded = _prepare(make, handle, load=server is None)
    bar, advance = _bar(len(job.lengths) * len(job.tasks) * job.n, f"ruler {job.setting.name}")
    with bar:
        record = run_ruler(job, loaded, handle.tokenizer(), json_path, model_name=handle.label, progress=advance,
                           runner=runner)  # fmt: skip
    metrics = record["metrics"]
    for key in [k for k in metrics if not k.endswith("_stderr")]:
        typer.echo(f"{key} {metrics[key]:.3f} ± {metrics[key + '_stderr'] or 0:.3f}")
    _wrote(json_path)


if __name__ == "__main__":
    app()
