"""``h2o-kv eval``: quality at a given KV budget. Each command is a thin wrapper around its module."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

import typer

app = typer.Typer(help="Quality at a given KV budget, on real data.", no_args_is_help=True)


def fail(message: str) -> None:
    """Print a clear error and exit with status 2 (bad input), before any long work."""
    typer.secho(f"Error: {message}", err=True, fg="red")
    raise typer.Exit(2)


def command_line(subcommand: str) -> str:
    """The command as typed, normalised to ``h2o-kv eval <subcommand> ...`` (stored in result files)."""
    args = sys.argv[1:]
    tail = args[args.index(subcommand) + 1 :] if subcommand in args else args
    return shlex.join(["h2o-kv", "eval", subcommand, *tail])


MODEL = typer.Option(None, "--model", help="Model name or local directory (default: SmolLM2-135M-Instruct).")
DTYPE = typer.Option(None, "--dtype", help="float32 (CPU default), bfloat16, float16.")
DEVICE = typer.Option(None, "--device", help="cpu, cuda, cuda:N, mps (default: CUDA when available).")


@app.command()
def ppl(
    text: Path = typer.Option(..., "--text", help="UTF-8 text file (e.g. a PG-19 book or WikiText-2)."),
    strip_gutenberg: bool = typer.Option(
        False, "--strip-gutenberg", help="Keep only the book between the '*** START/END OF ...' markers."
    ),
    tokens: int = typer.Option(..., "--tokens", help="Evaluate the first N tokens of the text."),
    policy: str = typer.Option("h2o", "--policy", help="Eviction policy (h2o, local, sink, tova, snapkv, ...)."),
    heavy: int = typer.Option(None, "--heavy", help="Heavy-hitter entries kept (with --recent)."),
    recent: int = typer.Option(None, "--recent", help="Recent entries kept (with --heavy)."),
    budget: float = typer.Option(
        None, "--budget", help="Ratio in (0, 1]: heavy = recent = floor(budget * N / 2) of the N evaluated tokens."
    ),
    streaming: bool = typer.Option(False, "--streaming", help="Position rolling: H2OCache(streaming=True)."),
    window: int = typer.Option(None, "--window", help="Also report perplexity per window of this many tokens."),
    chunk: int = typer.Option(512, "--chunk", help="Tokens per forward pass (memory bound; results do not change)."),
    token_by_token: bool = typer.Option(
        False, "--token-by-token", help="One forward per token (slow; the definition the fast path is tested against)."
    ),
    json_path: Path = typer.Option(None, "--json", help="Write the result JSON here."),
    model: str = MODEL,
    dtype: str = DTYPE,
    device: str = DEVICE,
):
    """Streaming perplexity: every token is a decode step with eviction after each step."""
    from rich.progress import Progress

    from .ppl import PPLJob, run_ppl
    from .sweep import ModelHandle

    handle = ModelHandle(model, dtype, device)
    try:
        job = PPLJob.create(
            text, tokens, policy, heavy=heavy, recent=recent, budget=budget, gutenberg=strip_gutenberg,
            streaming=streaming, window=window, chunk=chunk, token_by_token=token_by_token,
        )  # fmt: skip
        job.token_ids(handle.tokenizer())
        loaded = handle.model()
    except (ValueError, FileNotFoundError) as err:
        fail(str(err))
    with Progress() as bar:
        task = bar.add_task(f"ppl {policy} H={job.heavy} R={job.recent}", total=job.tokens)
        record = run_ppl(
            job, loaded, handle.tokenizer(), json_path, model_name=handle.label,
            progress=lambda n: bar.advance(task, n), extra={"command": command_line("ppl")},
        )  # fmt: skip
    typer.echo(
        f"ppl {record['ppl']:.4f}  nll {record['nll']:.4f}  ({record['predicted']} predicted tokens, "
        f"policy {record['policy']}, heavy {record['heavy']}, recent {record['recent']}, {record['time_s']:.1f} s)"
    )
    if json_path is not None:
        typer.echo(f"wrote {json_path}")


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def sweep(
    ctx: typer.Context,
    kind: str = typer.Option(..., "--kind", help="Kind of evaluation (ppl, ...); its own options follow."),
    policies: str = typer.Option("full,h2o,local,sink,tova,snapkv,random", "--policies"),
    budgets: str = typer.Option("0.05,0.1,0.2,0.4,1.0", "--budgets", help="Ratios in (0, 1]."),
    out: Path = typer.Option(..., "--out", help="Folder for one result JSON per cell (resumable)."),
    model: str = MODEL,
    dtype: str = DTYPE,
    device: str = DEVICE,
):
    """Run a policies x budgets grid of one kind; cells whose JSON exists are skipped (resume)."""
    from .sweep import KINDS, ModelHandle, parse_list, parse_options, run_sweep

    try:
        if kind not in KINDS:
            raise ValueError(f"--kind must be one of {', '.join(KINDS)}; got {kind!r}")
        options = parse_options(ctx.args)
        options_cmd = command_line("sweep")
        policy_list = parse_list(policies, "policies")
        budget_list = parse_list(budgets, "budgets", float)
        handle = ModelHandle(model, dtype, device)
        paths = run_sweep(kind, policy_list, budget_list, out, options, handle, command=options_cmd)
    except (ValueError, FileNotFoundError) as err:
        fail(str(err))
    typer.echo(f"{len(paths)} results in {out}")


@app.command()
def report(
    paths: list[Path] = typer.Argument(..., help="Result JSON files or folders (searched recursively)."),
    out: Path = typer.Option(Path("results/eval/report.md"), "--out", help="Markdown file; plots go next to it."),
    plots: bool = typer.Option(True, "--plots/--no-plots"),
    baselines: str = typer.Option(
        "full", "--baselines", help="Perplexity: paired change vs these policies (same budget), comma-separated."
    ),
):
    """Markdown tables (rows policy, columns budget, per metric) and quality-vs-budget plots."""
    from .report import build_report
    from .sweep import parse_list

    try:
        build_report(paths, out, plots=plots, baselines=tuple(parse_list(baselines, "baselines")))
    except (ValueError, FileNotFoundError) as err:
        fail(str(err))
    typer.echo(f"wrote {out}")


# -- lm-eval tasks, XSUM and needle-in-a-haystack (modules tasks.py, xsum.py, needle.py) ---------------------------

KV_POLICY = typer.Option(None, "--policy", help="h2o-kv policy (h2o, local, sink, tova, snapkv, random, full).")
KV_BUDGET = typer.Option(None, "--budget", help="Ratio in (0, 1] of the prompt: heavy = recent = floor(B * L / 2).")
KV_HEAVY = typer.Option(None, "--heavy", help="Heavy-hitter entries kept (with --recent), instead of --budget.")
KV_RECENT = typer.Option(None, "--recent", help="Recent entries kept (with --heavy).")
KV_PEER = typer.Option(
    None,
    "--peer",
    help="Run a kvpress press instead of a policy: observed_attention, snapkv, tova, streaming_llm, knorm.",
)


def _load(handle, make):
    """Validate (``make()``), then load the model: every bad input fails here, before the long work."""
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()
    try:
        job = make()
        return job, handle.model(), handle.tokenizer()
    except (ValueError, FileNotFoundError, ImportError) as err:
        fail(str(err))


@app.command()
def tasks(
    task_names: str = typer.Option(
        "piqa,openbookqa,rte,mathqa,hellaswag,lambada", "--tasks", help="Comma-separated lm-eval task names."
    ),
    include_path: list[Path] = typer.Option(None, "--include-path", help="Folder of extra lm-eval task YAMLs."),
    num_fewshot: int = typer.Option(5, "--num-fewshot"),
    limit: int = typer.Option(None, "--limit", help="Evaluate the first N items of each task."),
    policy: str = KV_POLICY,
    budget: float = KV_BUDGET,
    heavy: int = KV_HEAVY,
    recent: int = KV_RECENT,
    paper_protocol: bool = typer.Option(
        False, "--paper-protocol", help="Also process every context token under eviction (the H2O paper's protocol)."
    ),
    peer: str = KV_PEER,
    json_path: Path = typer.Option(None, "--json", help="Write the result JSON here (resumable)."),
    model: str = MODEL,
    dtype: str = DTYPE,
    device: str = DEVICE,
):
    """lm-eval tasks (acc, acc_norm, stderr) with the few-shot context compressed to the budget."""
    from .sweep import ModelHandle
    from .tasks import TasksJob, make_spec, run_tasks, summary_lines

    handle = ModelHandle(model, dtype, device)
    job, loaded, tokenizer = _load(
        handle,
        lambda: TasksJob.create(
            task_names, make_spec(policy, budget, heavy, recent, paper_protocol=paper_protocol, peer=peer),
            num_fewshot=num_fewshot, limit=limit, include_path=include_path or None,
        ),
    )  # fmt: skip
    record = run_tasks(
        job, loaded, tokenizer, json_path, model_name=handle.label, extra={"command": command_line("tasks")}
    )
    typer.echo("\n".join(summary_lines(record)))
    if json_path is not None:
        typer.echo(f"wrote {json_path}")


@app.command()
def xsum(
    limit: int = typer.Option(None, "--limit", help="Summarize the first N articles."),
    policy: str = KV_POLICY,
    budget: float = KV_BUDGET,
    heavy: int = KV_HEAVY,
    recent: int = KV_RECENT,
    peer: str = KV_PEER,
    raw_prompt: bool = typer.Option(False, "--raw-prompt", help="Feed the file's prompt as is (no chat template)."),
    data: Path = typer.Option(None, "--data", help="Another XSUM 0-shot JSONL (default: the shared data file)."),
    json_path: Path = typer.Option(None, "--json", help="Write the result JSON here (resumable)."),
    model: str = MODEL,
    dtype: str = DTYPE,
    device: str = DEVICE,
):
    """0-shot XSUM summarization, ROUGE-1/2/L, with the article's cache compressed to the budget."""
    from rich.progress import Progress

    from .sweep import ModelHandle
    from .tasks import make_spec
    from .xsum import XsumJob, run_xsum

    handle = ModelHandle(model, dtype, device)
    job, loaded, tokenizer = _load(
        handle,
        lambda: XsumJob.create(
            make_spec(policy, budget, heavy, recent, peer=peer), limit=limit, raw_prompt=raw_prompt, path=data
        ),
    )
    with Progress() as bar:
        task = bar.add_task(f"xsum {job.spec.label}", total=len(job.items))
        record = run_xsum(
            job, loaded, tokenizer, json_path, model_name=handle.label, extra={"command": command_line("xsum")},
            progress=lambda n: bar.advance(task, n),
        )  # fmt: skip
    metrics = record["metrics"]
    typer.echo(
        "  ".join(f"{k} {metrics[k]:.4f} ± {metrics[k + '_stderr']:.4f}" for k in ("rouge1", "rouge2", "rougeL"))
        + f"  ({record['n']} items, {record['policy']})"
    )
    if json_path is not None:
        typer.echo(f"wrote {json_path}")


@app.command()
def needle(
    lengths: str = typer.Option("1024,2048,4096", "--lengths", help="Document lengths in tokens."),
    depths: str = typer.Option("0,25,50,75,100", "--depths", help="Needle depths in % of the document."),
    policy: str = KV_POLICY,
    budget: float = KV_BUDGET,
    heavy: int = KV_HEAVY,
    recent: int = KV_RECENT,
    peer: str = KV_PEER,
    png: Path = typer.Option(None, "--png", help="Write the heatmap (depth x length) here."),
    compare: list[Path] = typer.Option(None, "--compare", help="Other needle result JSONs drawn next to this one."),
    json_path: Path = typer.Option(None, "--json", help="Write the result JSON here (resumable)."),
    model: str = MODEL,
    dtype: str = DTYPE,
    device: str = DEVICE,
):
    """Needle in a haystack (Paul Graham essays): retrieval score per length and depth under the budget."""
    import json

    from rich.progress import Progress

    from .needle import NeedleJob, parse_ints, run_needle
    from .sweep import ModelHandle
    from .tasks import make_spec

    handle = ModelHandle(model, dtype, device)

    def make():
        others = []
        for path in compare or []:
            if not path.is_file():
                raise FileNotFoundError(f"--compare {path} does not exist")
            others.append(json.loads(path.read_text()))
        spec = make_spec(policy, budget, heavy, recent, peer=peer)
        parse_ints(lengths, "lengths", 1), parse_ints(depths, "depths", 0, 100)  # before the model loads
        from ..models import model_context_length

        return NeedleJob.create(
            spec, lengths, depths, handle.tokenizer(), max_length=model_context_length(handle.model())
        ), others

    (job, others), loaded, tokenizer = _load(handle, make)
    with Progress() as bar:
        task = bar.add_task(f"needle {job.spec.label}", total=len(job.lengths) * len(job.depths))
        record = run_needle(
            job, loaded, tokenizer, json_path, model_name=handle.label, png=png, compare=others,
            extra={"command": command_line("needle")}, progress=lambda n: bar.advance(task, n),
        )  # fmt: skip
    for key, value in record["metrics"].items():
        typer.echo(f"{key} {value:.3f}")
    for path in (json_path, png):
        if path is not None:
            typer.echo(f"wrote {path}")


if __name__ == "__main__":
    app()
