"""The ``h2o-kv`` command line."""

from __future__ import annotations

import sys
import time
import warnings
from pathlib import Path

import typer

from .policies import POLICIES

app = typer.Typer(help="H2O (Heavy-Hitter Oracle) KV-cache eviction for Hugging Face models.", no_args_is_help=True)


@app.callback()
def _root():
    """h2o-kv: bounded-memory generation and evaluation with H2O and baseline eviction policies."""
    from transformers.utils import logging

    logging.disable_progress_bar()


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


def build_cache(policy: str, budget: float | None, heavy: int | None, recent: int | None, **options):
    """The cache for the command-line options (a stock ``DynamicCache`` for ``--policy full`` without budget)."""
    from .hf.cache import H2OCache

    if budget is None and heavy is None and recent is None and policy != "full":
        raise typer.BadParameter("give --budget (a ratio in (0, 1]) or --heavy and --recent (token counts)")
    try:
        return H2OCache(heavy=heavy, recent=recent, budget=budget, policy=policy, **options)
    except ValueError as err:
        raise typer.BadParameter(str(err)) from err


@app.command()
def generate(
    prompt: str = typer.Argument(None, help="The prompt text (or use --file)."),
    file: Path = typer.Option(None, "--file", "-f", help="Read the prompt from this text file."),
    max_prompt_tokens: int = typer.Option(None, help="Keep only the first N tokens of the prompt."),
    budget: float = typer.Option(None, help="KV budget as a ratio in (0, 1] of the prompt length: H = R = B*L/2."),
    heavy: int = typer.Option(None, help="Heavy-hitter entries kept per layer and KV head."),
    recent: int = typer.Option(None, help="Most recent entries kept per layer and KV head."),
    policy: str = typer.Option("h2o", help=f"Eviction policy: {', '.join(POLICIES)}."),
    model: str = typer.Option(None, help="Local HF model directory or cached Hub id (default: SmolLM2-135M-Instruct)."),
    chat: bool = typer.Option(False, "--chat", help="Apply the model's chat template to the prompt."),
    max_new_tokens: int = typer.Option(128, min=1, help="Tokens to generate."),
    dtype: str = typer.Option(None, help="float32 / float16 / bfloat16 (default: float32 on CPU)."),
    device: str = typer.Option(None, help="cpu / cuda (default: cuda when available)."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="Print only the summary line."),
):
    """Generate text with a bounded KV cache and print one summary line (entries, memory, speed)."""
    import torch

    from .hf.compat import cache_kwargs
    from .models import load_model, model_context_length

    if file is not None:
        if prompt is not None:
            raise typer.BadParameter("give the prompt either as an argument or with --file, not both")
        if not file.is_file():
            raise typer.BadParameter(f"--file {file} does not exist")
        prompt = file.read_text(errors="replace")
    if prompt is None or not prompt.strip():
        raise typer.BadParameter("the prompt is empty: pass some text or --file")
    if policy not in POLICIES:
        raise typer.BadParameter(f"--policy must be one of {', '.join(POLICIES)}; got {policy!r}")
    if max_prompt_tokens is not None and max_prompt_tokens < 1:
        raise typer.BadParameter(f"--max-prompt-tokens must be >= 1, got {max_prompt_tokens}")
    cache = build_cache(policy, budget, heavy, recent)
    try:
        lm, tokenizer = load_model(model, dtype=dtype, device=device)
    except (ValueError, FileNotFoundError) as err:
        raise typer.BadParameter(str(err)) from err
    if tokenizer is None:
        raise typer.BadParameter(f"--model {model} has no tokenizer files; generate needs one")
    if chat:
        if not tokenizer.chat_template:
            raise typer.BadParameter(f"--chat: the model {model or 'default'} has no chat template")
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                             add_generation_prompt=True)  # fmt: skip
        inputs = tokenizer(text, return_tensors="pt", add_special_tokens=False)
    else:
        inputs = tokenizer(prompt, return_tensors="pt")
    if max_prompt_tokens is not None:
        inputs = {key: value[:, :max_prompt_tokens] for key, value in inputs.items()}
    length = inputs["input_ids"].shape[1]
    context = model_context_length(lm)
    if length + max_new_tokens > context:
        raise typer.BadParameter(
            f"prompt ({length} tokens) + --max-new-tokens ({max_new_tokens}) exceeds the model's context of "
            f"{context} tokens; shorten the prompt (--max-prompt-tokens) or generate fewer tokens"
        )
    inputs = {key: value.to(lm.device) for key, value in inputs.items()}
    streamer = _TimingStreamer(tokenizer, echo=not quiet)
    start = time.perf_counter()
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("always")
        output = lm.generate(**inputs, **cache_kwargs(cache), max_new_tokens=max_new_tokens, do_sample=False,
                             streamer=streamer, pad_token_id=tokenizer.pad_token_id)  # fmt: skip
    end = time.perf_counter()
    generated = output.shape[1] - length
    stats = cache.stats()
    first = streamer.times[0] if streamer.times else end
    decode_rate = (generated - 1) / (end - first) if generated > 1 and end > first else float("nan")
    summary = (
        f"[{stats['policy']}] KV entries {stats['kv_tokens']} kept / {stats['seen_tokens']} seen per layer and "
        f"head ({stats['evicted_tokens']} evicted) | KV memory {_mib(stats['kv_bytes'])} vs "
        f"{_mib(stats['full_kv_bytes'])} full ({stats['kv_ratio']:.2f}x) | prompt {length} tokens in "
        f"{first - start:.2f} s | {generated} new tokens, {generated / (end - start):.1f} tok/s end-to-end, "
        f"{decode_rate:.1f} tok/s decode"
    )
    print(("\n" if not quiet else "") + summary, file=sys.stdout)


def _mount() -> None:
    """Mount the command groups that live next to what they drive: eval, bench, chat."""
    from .bench.cli import app as bench_app
    from .chat import app as chat_app
    from .eval.cli import app as eval_app

    app.add_typer(eval_app, name="eval")
    app.add_typer(bench_app, name="bench")
    app.add_typer(chat_app, name="chat")


_mount()


def main():  # pragma: no cover - console entry point
    app()


if __name__ == "__main__":  # pragma: no cover
    app()
