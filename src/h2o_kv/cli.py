"""The ``h2o-kv`` command line: ``generate``, ``chat``, ``serve``, and the ``eval`` and ``bench`` groups.

Parsing and checking the options imports neither torch nor transformers, so ``--help`` and input errors answer at
once; the library loads only for valid input, and the ``eval``/``bench`` groups are imported only when invoked. An
input error is one line on stderr (``error: ...``, exit status 2); a notice from the library is one ``note: ...``
line on stderr, shown once.
"""

from __future__ import annotations

import importlib
import math
import os
import re
import sys
import time
import warnings
from pathlib import Path
from typing import Literal

import typer
from typer.core import TyperGroup

from .budget import Budget
from .harness.data import MissingData
from .registry import BOUNDED_POLICIES, POLICY_NAMES, SERVER_POLICIES, PolicySpec, options_help, parse_policy

try:  # typer vendors click since 0.2x
    from typer._click import exceptions as click_errors
except ImportError:  # pragma: no cover - older typer
    from click import exceptions as click_errors

KV_BITS = (4, 8)  # h2o_kv.hf.quant.KV_BITS (importing it imports torch; a test keeps the two equal)
KV_BITS_HELP = "Store the kept KV entries quantized: 8 or 4 bits per number, group 64 (H2OCache(kv_bits=...))."
DTYPE_NAMES = ("float32", "float16", "bfloat16", "fp32", "fp16", "bf16")  # h2o_kv.models' dtypes (tested)
DtypeName = Literal[DTYPE_NAMES]

# name -> (module holding its typer `app`, the help line `h2o-kv --help` shows without importing the module)
LAZY_GROUPS = {
    "eval": ("h2o_kv.eval.cli", "Quality at a given KV setting, on real data."),
    "bench": ("h2o_kv.bench.cli", "Benchmark decode speed, end-to-end throughput and memory of KV settings."),
}


def lazy_group(name: str):
    """The click command of the group ``name`` of :data:`LAZY_GROUPS` (imports its module)."""
    command = typer.main.get_command(importlib.import_module(LAZY_GROUPS[name][0]).app)
    command.name = name
    return command


# typer's checks of an option's type and range (pydantic's wording) in the words of the command's own errors
_PLAIN = (
    (r"Invalid value for '(--[\w-]+)'(?: / '-\w')?: (?=Input should|Value error)", r"\1 "),
    (r"Value error, ", ""),
    (r"Input should be a valid integer, unable to parse string as an integer", "must be an integer"),
    (r"Input should be a valid number, unable to parse string as a number", "must be a number"),
    (r"Input should be (greater|less) than or equal to", lambda m: "must be " + "><"[m[1] == "less"] + "="),
    (r"Input should be (greater|less) than", lambda m: "must be " + "><"[m[1] == "less"]),
    (r"Input should be", "must be"),
)


def plain(message: str) -> str:
    """A click/typer error message as one line in the house style: ``--heavy must be >= 0``."""
    message = " ".join(str(message).split())
    for pattern, replacement in _PLAIN:
        message = re.sub(pattern, replacement, message)
    return message


class HelpGroup(TyperGroup):
    """A group whose command list shows each command's first sentence whole (click cuts it at about 45 columns)."""

    def format_commands(self, ctx, formatter):
        rows = [(name, command.get_short_help_str(limit=1000)) for name in self.list_commands(ctx)
                if (command := self.get_command(ctx, name)) is not None and not command.hidden]  # fmt: skip
        if rows:
            with formatter.section("Commands"):
                formatter.write_dl(rows)


class _Group(HelpGroup):
    """The top-level group: mounts :data:`LAZY_GROUPS` lazily and prints every usage error as one line."""

    def list_commands(self, ctx):
        return [*super().list_commands(ctx), *LAZY_GROUPS]

    def get_command(self, ctx, name):
        if name in LAZY_GROUPS:  # a stand-in for the command list of `--help`; resolve_command loads the group
            return TyperGroup(name=name, help=LAZY_GROUPS[name][1])
        return super().get_command(ctx, name)

    def resolve_command(self, ctx, args):
        name, command, rest = super().resolve_command(ctx, args)
        return name, lazy_group(name) if name in LAZY_GROUPS else command, rest

    def invoke(self, ctx):
        super().invoke(ctx)  # a command's return value is not an exit status (as in click's standalone mode)

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        try:
            status = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except click_errors.NoArgsIsHelpError as err:  # `h2o-kv` alone: the help
            err.show()
            sys.exit(err.exit_code)
        except click_errors.ClickException as err:
            typer.echo(f"error: {plain(err.format_message())}", err=True)
            sys.exit(err.exit_code)
        except typer.Abort:
            typer.echo("Aborted.", err=True)
            sys.exit(1)
        except MissingData as err:  # any command reading the shared data folder
            typer.echo(f"error: {plain(str(err))}", err=True)
            sys.exit(2)
        sys.exit(status or 0)


HELP_STYLE = {"rich_markup_mode": None}  # click's plain help: wrapped at word boundaries, no truncated table cells
app = typer.Typer(
    cls=_Group,
    help="H2O (Heavy-Hitter Oracle) KV-cache eviction for Hugging Face models.",
    no_args_is_help=True,
    pretty_exceptions_show_locals=False,
    **HELP_STYLE,
)


@app.callback()
def _root():
    """h2o-kv: bounded-memory generation and evaluation with H2O and baseline eviction policies."""
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # transformers' per-tensor loading bars


def fail(message: str):
    """An input error: ``error: message`` on stderr, exit status 2 (raise what this returns)."""
    return click_errors.UsageError(message)


def as_options(message: str, *names: str, assigned: bool = False) -> str:
    """A library message in command-line terms: the parameter ``heavy`` becomes the option ``--heavy`` (with
    ``assigned``: only in ``heavy=4``, which becomes ``--heavy 4``)."""
    pattern = rf"(?<![-\w])({'|'.join(names)})" + ("=" if assigned else r"\b")
    return re.sub(pattern, lambda m: f"--{m[1].replace('_', '-')}" + (" " if assigned else ""), message)


def policy_spec(text: str, choices: tuple[str, ...] = POLICY_NAMES) -> PolicySpec:
    """``--policy name[:option=value,...]`` parsed by :func:`h2o_kv.registry.parse_policy`, errors as input errors."""
    try:
        return parse_policy(text, choices)
    except ValueError as err:
        raise fail(as_options(str(err), "policy")) from None


def policy_help(lead: str, choices: tuple[str, ...]) -> str:
    """The ``--policy`` help of a command taking ``choices``: the names, then the options with their defaults."""
    return f"{lead}: {', '.join(choices)}. {options_help(choices)}"


BUDGET_METAVAR = "RATIO"  # every command's --budget reads the same; its range is checked by Budget


def check_kv_bits(kv_bits: int | None) -> None:
    if kv_bits is not None and kv_bits not in KV_BITS:
        raise fail(f"--kv-bits must be one of {', '.join(map(str, KV_BITS))}; got {kv_bits}")


def check_budget(policy: str, budget: float | None, heavy: int | None, recent: int | None) -> Budget | None:
    """The budget of the options (None for ``--policy full``), checked before anything heavy is imported."""
    if policy == "full":
        if budget is not None or heavy is not None or recent is not None:
            raise fail("--policy full keeps every entry: give no --budget, --heavy or --recent")
        return None
    try:
        return Budget.of(budget, heavy, recent)
    except ValueError as err:
        raise fail(as_options(str(err), "budget", "heavy", "recent")) from None


class Notes:
    """While active, every warning prints as one ``note: ...`` line on stderr, each text once; call it for a note of
    the command's own. (The command line has no user code for a warning to point at.)"""

    def __init__(self):
        self.shown: set[str] = set()
        self._catch = warnings.catch_warnings()

    def __call__(self, text: str) -> None:
        text = " ".join(str(text).split())
        if text not in self.shown:
            self.shown.add(text)
            print(f"note: {text}", file=sys.stderr, flush=True)

    def __enter__(self):
        self._catch.__enter__()  # Python's filters stay (library DeprecationWarnings stay hidden)
        warnings.showwarning = lambda message, *args, **kwargs: self(message)
        return self

    def __exit__(self, *exc):
        return self._catch.__exit__(*exc)


def load(model: str | None, dtype: str | None, device: str | None):
    """``h2o_kv.load_model`` with its input errors as command-line errors."""
    from .models import load_model

    try:
        return load_model(model, dtype=dtype, device=device)
    except (ValueError, FileNotFoundError) as err:
        raise fail(as_options(str(err), "model", "dtype", "device", assigned=True)) from None


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


class _TimingStreamer:
    """Prints new text as it is generated and records when each token arrived."""

    def __init__(self, tokenizer, echo: bool):
        from transformers import TextStreamer

        self.text = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True) if echo else None
        self.times: list[float] = []
        self._prompt_seen = False

    def put(self, value):
        if self._prompt_seen:
            self.times.append(time.perf_counter())
        self._prompt_seen = True
        if self.text is not None:
            self.text.put(value)

    def end(self):
        if self.text is not None:
            self.text.end()


MODEL_HELP = "Local HF model directory, or a Hub id already in the local HF cache (h2o-kv loads offline)."
GENERATE_EXAMPLES = """Examples:

  h2o-kv generate "Explain the water cycle." --chat --heavy 32 --recent 32

  h2o-kv generate --file book.txt --max-prompt-tokens 2048 --budget 0.2
"""


@app.command(
    help="Generate text with a bounded KV cache and print one summary line (entries, memory, speed).\n\n"
    "The KV budget is required (except with --policy full): either --budget B (a ratio of the prompt) or --heavy H "
    "and --recent R (H + R entries per layer and KV head).",
    epilog=GENERATE_EXAMPLES,
)
def generate(
    prompt: str = typer.Argument(None, help="The prompt text (or --file).", show_default=False),
    file: Path = typer.Option(
        None, "--file", "-f", exists=True, dir_okay=False, readable=True, help="Read the prompt from this text file."
    ),
    max_prompt_tokens: int = typer.Option(
        None, min=1, help="Keep only the first N tokens of the prompt.", show_default="the whole prompt"
    ),
    budget: float = typer.Option(
        None,
        metavar=BUDGET_METAVAR,
        help="KV budget as a ratio in (0, 1] of the prompt length L, as in the H2O paper (20% = 0.2): heavy = recent "
        "= floor(B*L/2), at least 1 each, fixed for the whole generation. A chat prompt is a few dozen tokens, so a "
        "ratio of it keeps only a handful of entries: give --heavy/--recent for short prompts.",
        show_default=False,
    ),
    heavy: int = typer.Option(None, min=0, help="Heavy-hitter entries kept per layer and KV head (with --recent)."),
    recent: int = typer.Option(None, min=0, help="Most recent entries kept per layer and KV head (with --heavy)."),
    policy: str = typer.Option(
        "h2o",
        metavar="POLICY",
        help=policy_help("Eviction policy (full keeps every entry and takes no budget)", POLICY_NAMES),
    ),
    kv_bits: int = typer.Option(None, "--kv-bits", help=KV_BITS_HELP, show_default="full precision"),
    model: str = typer.Option(None, help=MODEL_HELP, show_default="SmolLM2-135M-Instruct"),
    chat: bool = typer.Option(False, "--chat", help="Apply the model's chat template to the prompt."),
    max_new_tokens: int = typer.Option(128, min=1, help="Tokens to generate."),
    dtype: DtypeName = typer.Option(None, case_sensitive=False, show_default="float32 on CPU, bfloat16 on CUDA"),
    device: str = typer.Option(None, help="cpu, cuda, cuda:N or mps.", show_default="cuda when available, else cpu"),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="Print only the summary line."),
    json_path: Path = typer.Option(
        None,
        "--json",
        dir_okay=False,
        help="Also write the summary as a result record (commit, versions, command).",
        show_default="no file",
    ),
    temperature: float = typer.Option(None, help="Sample at this temperature (> 0).", show_default="greedy"),
    top_p: float = typer.Option(
        None,
        "--top-p",
        help="Sample from the smallest set of tokens of this total probability, in (0, 1] (nucleus sampling).",
        show_default="greedy",
    ),
    seed: int = typer.Option(None, min=0, help="Random seed of the sampling (with --temperature/--top-p)."),
):
    """Generate text with a bounded KV cache and print one summary line (the help text is above)."""
    if temperature is not None and not temperature > 0:
        raise fail(f"--temperature must be > 0 (leave it out for greedy decoding); got {temperature}")
    if top_p is not None and not 0 < top_p <= 1:
        raise fail(f"--top-p must be in (0, 1]; got {top_p}")
    sampling = {"do_sample": False}
    if temperature is not None or top_p is not None:
        sampling = {"do_sample": True, "temperature": temperature or 1.0, "top_p": top_p or 1.0, "top_k": None}
    elif seed is not None:
        raise fail("--seed sets the sampling's seed: give --temperature or --top-p with it")
    spec = policy_spec(policy)
    rule = check_budget(spec.name, budget, heavy, recent)
    check_kv_bits(kv_bits)
    if file is not None:
        if prompt is not None:
            raise fail("give the prompt either as an argument or with --file, not both")
        prompt = file.read_text(errors="replace")
    if prompt is None or not prompt.strip():
        raise fail("the prompt is empty: give some text or --file")
    with Notes() as note:
        import torch

        from .hf.cache import H2OBudgetWarning, H2OCache
        from .hf.compat import cache_kwargs
        from .models import model_context_length

        warnings.filterwarnings("ignore", category=H2OBudgetWarning)  # said below in terms of the options
        lm, tokenizer = load(model, dtype, device)
        if tokenizer is None:
            raise fail(f"--model {model} has no tokenizer files; generate needs one")
        if chat:
            if not tokenizer.chat_template:
                raise fail(f"--chat: the model {model or 'default'} has no chat template")
            prompt = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                                   add_generation_prompt=True)  # fmt: skip
        # verbose=False: a long --file is cut to --max-prompt-tokens below; the context is checked below
        inputs = tokenizer(prompt, return_tensors="pt", add_special_tokens=not chat, verbose=False)
        if max_prompt_tokens is not None:
            inputs = {key: value[:, :max_prompt_tokens] for key, value in inputs.items()}
        length = inputs["input_ids"].shape[1]
        context = model_context_length(lm)
        if length + max_new_tokens > context:
            raise fail(
                f"prompt ({length} tokens) + --max-new-tokens ({max_new_tokens}) exceeds the model's context of "
                f"{context} tokens; shorten the prompt (--max-prompt-tokens) or generate fewer tokens"
            )
        if rule is not None:
            budget_notes(note, rule, length, max_new_tokens)
        cache = H2OCache(heavy=heavy, recent=recent, budget=budget, policy=spec.name, kv_bits=kv_bits, **spec.options)
        inputs = {key: value.to(lm.device) for key, value in inputs.items()}
        streamer = _TimingStreamer(tokenizer, echo=not quiet)
        if seed is not None:
            torch.manual_seed(seed)
        start = time.perf_counter()
        with torch.no_grad():
            output = lm.generate(**inputs, **cache_kwargs(cache), max_new_tokens=max_new_tokens, **sampling,
                                 streamer=streamer, pad_token_id=tokenizer.pad_token_id)  # fmt: skip
    end = time.perf_counter()
    generated = output.shape[1] - length
    stats = cache.stats()
    first = streamer.times[0] if streamer.times else end
    decode_rate = (generated - 1) / (end - first) if generated > 1 and end > first else float("nan")
    precision = "" if kv_bits is None else f" {kv_bits}-bit KV"
    summary = (
        f"[{stats['policy']}{precision}] KV entries {stats['kv_tokens']} kept / {stats['seen_tokens']} seen per layer "
        f"and head ({stats['evicted_tokens']} evicted) | KV memory {_mib(stats['kv_bytes'])} vs "
        f"{_mib(stats['full_kv_bytes'])} full ({stats['kv_ratio']:.2f}x) | prompt {length} tokens in "
        f"{first - start:.2f} s | {generated} new tokens, {generated / (end - start):.1f} tok/s end-to-end, "
        f"{decode_rate:.1f} tok/s decode"
    )
    print(("\n" if not quiet else "") + summary, file=sys.stdout)
    if json_path is not None:
        from .harness import records

        fields = {
            "policy": spec.label, "budget": budget, "kv_bits": kv_bits, "model": model or "SmolLM2-135M-Instruct",
            "prompt_tokens": length, "new_tokens": generated, "prompt_seconds": first - start,
            "seconds": end - start, "end_to_end_tok_s": generated / (end - start),
            "decode_tok_s": None if math.isnan(decode_rate) else decode_rate,
            "cache": stats, "text": tokenizer.decode(output[0, length:], skip_special_tokens=True),
            "sampling": {**sampling, "seed": seed},
        }  # fmt: skip
        records.write(json_path, "generate", fields, device=lm.device)


def budget_notes(note, rule: Budget, length: int, max_new_tokens: int) -> None:
    """Say when the budget is unusual for this prompt: a ratio of a prompt shorter than the answer, or a budget that
    covers the whole prompt (nothing is evicted at first)."""
    heavy, recent = rule.split(length)
    kept = heavy + recent
    if rule.is_ratio and length < max_new_tokens:
        note(
            f"--budget {rule.ratio} of this {length}-token prompt keeps {heavy} heavy + {recent} recent entries per "
            f"layer and KV head for the {max_new_tokens} tokens to generate; for a short prompt (a chat) give "
            "--heavy and --recent instead, e.g. --heavy 32 --recent 32"
        )
    elif kept >= length:
        options = f"--budget {rule.ratio}" if rule.is_ratio else f"--heavy {heavy} --recent {recent}"
        note(
            f"{options} keeps {kept} entries per layer and KV head, the whole {length}-token prompt: nothing is "
            f"evicted until the sequence is longer than {kept} tokens"
        )


@app.command(
    help="Chat with the model in the terminal; the whole conversation lives in one bounded cache.\n\n"
    "Type a message and press Enter. /reset forgets the conversation, /stats shows the cache, /quit (or Ctrl-D) "
    "leaves; Ctrl-C stops the reply being written. Works with piped input: printf 'Hi\\n/stats\\n' | h2o-kv chat"
)
def chat(
    heavy: int = typer.Option(256, min=0, help="Heavy-hitter entries kept per layer and KV head."),
    recent: int = typer.Option(256, min=0, help="Most recent entries kept per layer and KV head."),
    policy: str = typer.Option("h2o", metavar="POLICY", help=policy_help("Eviction policy", BOUNDED_POLICIES)),
    kv_bits: int = typer.Option(None, "--kv-bits", help=KV_BITS_HELP, show_default="full precision"),
    streaming: bool = typer.Option(
        True, "--streaming/--no-streaming", help="Re-rotate keys inside the cache (never exceed the model's window)."
    ),
    system: str = typer.Option(None, help="System prompt.", show_default="the chat template's own"),
    max_new_tokens: int = typer.Option(256, min=1, help="Longest reply in tokens."),
    temperature: float = typer.Option(0.0, min=0.0, help="Sampling temperature; 0 = greedy."),
    top_p: float = typer.Option(0.9, help="Nucleus sampling mass in (0, 1] (with --temperature > 0)."),
    model: str = typer.Option(None, help=MODEL_HELP, show_default="SmolLM2-135M-Instruct"),
    dtype: DtypeName = typer.Option(None, case_sensitive=False, show_default="float32 on CPU, bfloat16 on CUDA"),
    device: str = typer.Option(None, help="cpu, cuda, cuda:N or mps.", show_default="cuda when available, else cpu"),
):
    """Chat in the terminal (the help text is above)."""
    spec = policy_spec(policy, BOUNDED_POLICIES)
    check_budget(spec.name, None, heavy, recent)
    check_kv_bits(kv_bits)
    if not 0 < top_p <= 1:
        raise fail(f"--top-p must be in (0, 1], got {top_p}")
    with Notes():
        from .chat import ChatSession
        from .chat_terminal import run_chat

        loaded, tokenizer = load(model, dtype, device)
        try:
            session = ChatSession(
                loaded, tokenizer, heavy=heavy, recent=recent, policy=spec.name, streaming=streaming, system=system,
                max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                **({} if kv_bits is None else {"kv_bits": kv_bits}), **spec.options,
            )  # fmt: skip
        except ValueError as err:
            raise fail(str(err)) from None
        if hasattr(sys.stdin, "reconfigure"):  # a line that is not UTF-8 becomes U+FFFD instead of an error
            sys.stdin.reconfigure(errors="replace")
        run_chat(session)


SERVE_EXAMPLES = """Examples:

  h2o-kv serve --policy h2o --heavy 256 --recent 256 --kv-cache-gb 1

  h2o-kv serve --policy full --port 8001 --api-key secret -- --max-num-seqs 64
"""


@app.command(
    context_settings={"allow_extra_args": True},
    help="Serve the model with vLLM's OpenAI-compatible server (vllm serve), H2O eviction inside the engine.\n\n"
    "The KV setting applies to every request (a request may override it with extra_body={'vllm_xargs': "
    "{'h2o_heavy': H, 'h2o_recent': R}}); --policy full is vLLM's own cache. Arguments after -- go to vllm serve "
    "as given. Needs the vllm extra: pip install 'h2o-kv[vllm]'.",
    epilog=SERVE_EXAMPLES,
)
def serve(
    ctx: typer.Context,
    model: str = typer.Option(None, help="Local HF model directory.", show_default="SmolLM2-135M-Instruct"),
    policy: str = typer.Option(
        "h2o",
        metavar="POLICY",
        help=policy_help("Eviction policy (full keeps every entry: vLLM's own cache)", SERVER_POLICIES),
    ),
    heavy: int = typer.Option(None, min=0, help="Heavy-hitter entries kept per request, layer and KV head."),
    recent: int = typer.Option(None, min=0, help="Most recent entries kept per request, layer and KV head."),
    budget: float = typer.Option(
        None,
        metavar=BUDGET_METAVAR,
        help="KV budget as a ratio in (0, 1] of each request's prompt length (instead of --heavy/--recent).",
        show_default=False,
    ),
    min_entries: int = typer.Option(
        None,
        min=0,
        help="With --budget: never keep fewer entries than this (a short request runs as the full cache); 0: none.",
        show_default="256",
    ),
    kv_cache_gb: float = typer.Option(
        None, help="KV-cache space in GiB (fractions allowed).", show_default="vLLM's default"
    ),
    host: str = typer.Option("127.0.0.1", help="Address to bind."),
    port: int = typer.Option(8000, help="Port to bind."),
    api_key: str = typer.Option(None, help="Require this bearer key on every request (401 without it)."),
    max_model_len: int = typer.Option(None, help="Longest prompt + output in tokens.", show_default="the model's"),
    dtype: str = typer.Option("float32", help="float32, bfloat16 or float16."),
):
    """Serve with vLLM (the help text is above)."""
    # a policy serve cannot run is refused by ServeConfig, saying why; a name that is no policy lists what serve runs
    spec = policy_spec(policy, POLICY_NAMES if policy.partition(":")[0].strip() in POLICY_NAMES else SERVER_POLICIES)
    check_budget(spec.name, budget, heavy, recent)
    from .vllm.config import ServeConfig
    from .vllm.serve import ServeOptions, exec_server

    if spec.name == "full" and min_entries is not None:
        raise fail("--policy full keeps every entry: give no --min-entries")
    try:
        config = ServeConfig(spec.label, heavy=heavy, recent=recent, budget=budget, min_entries=min_entries)
        options = ServeOptions(config, model=model, host=host, port=port, api_key=api_key, kv_cache_gb=kv_cache_gb,
                               max_model_len=max_model_len, dtype=dtype, extra=tuple(ctx.args))  # fmt: skip
    except ValueError as err:
        raise fail(as_options(str(err), "min_entries", "policy")) from None
    with Notes():
        try:
            exec_server(options)
        except (FileNotFoundError, ValueError) as err:  # the default model's package is missing; a refused model
            raise fail(str(err)) from None


def main():  # pragma: no cover - console entry point
    app()


if __name__ == "__main__":  # pragma: no cover
    app()
