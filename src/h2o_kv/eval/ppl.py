"""Streaming perplexity under a KV setting (the H2O paper's streaming protocol, arXiv:2306.14048).

With a bounded setting every token of the text is its own decode step: it attends to the entries kept so far plus
itself, its attention is added to the policy's scores, and the cache evicts down to ``heavy + recent`` before the
next token. The NLL of token ``t + 1`` is read from the logits at step ``t``, so the numbers are exactly what
generation would see. The fast path is :class:`~h2o_kv.H2OCache` with ``stepwise=True``: the text goes through the
model in a few large chunks that share one cache (projections and MLPs run batched; only the per-token attention and
slot bookkeeping are sequential), which is token-for-token identical to feeding one token per forward
(``tests/test_eval_ppl.py`` checks it against both that and the plain reference in ``tests/reference.py``).

An unbounded setting (``full``: H2OCache without eviction; ``dynamic``: the stock DynamicCache) evicts nothing, so
every token sees every earlier one: one causal forward per chunk is exact and needs no step-by-step path.

A budget ratio ``B`` means ``heavy = recent = max(1, floor(B * N / 2))`` of the ``N`` evaluated tokens
(:meth:`~h2o_kv.Budget.split`).
"""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..harness.data import sha256, strip_gutenberg
from ..harness.setting import KVSetting
from ..harness.tables import mean
from ..hf.compat import cache_kwargs
from ..policies import make_policy
from .options import check_options, option_int
from .results import finish_result

BLOCK = 64  # tokens per block of the block-mean NLLs stored in every result (batch-means standard errors)


class PPLInputError(ValueError):
    """Bad input to a perplexity run, detected before the model is loaded."""


def read_text(path: str | Path, gutenberg: bool = False) -> str:
    """Read a UTF-8 text file with universal newlines (CRLF -> LF), optionally
    :func:`~h2o_kv.harness.data.strip_gutenberg`."""
    path = Path(path)
    if not path.is_file():
        raise PPLInputError(f"--text: file {path} does not exist")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise PPLInputError(f"--text: {path} is not UTF-8 text ({err})") from None
    if gutenberg:
        try:
            text = strip_gutenberg(text)
        except ValueError as err:
            raise PPLInputError(f"--strip-gutenberg: {err} in {path}") from None
    if not text.strip():
        raise PPLInputError(f"--text: {path} holds no text" + (" between the Gutenberg markers" if gutenberg else ""))
    return text


@dataclass
class PPLJob:
    """A validated perplexity run (everything checked before any model is loaded)."""

    text_path: Path
    tokens: int
    setting: KVSetting
    gutenberg: bool = False
    streaming: bool = False
    window: int | None = None
    chunk: int = 512
    token_by_token: bool = False
    policy_options: dict[str, Any] = field(default_factory=dict)
    text: str = field(default="", repr=False)

    @classmethod
    def create(
        cls,
        text: str | Path,
        tokens: int,
        setting: KVSetting,
        *,
        gutenberg: bool = False,
        streaming: bool = False,
        window: int | None = None,
        chunk: int = 512,
        token_by_token: bool = False,
        policy_options: dict[str, Any] | None = None,
    ) -> PPLJob:
        if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 2:
            raise PPLInputError(f"--tokens must be an integer >= 2, got {tokens!r}")
        if setting.press is not None:
            raise PPLInputError(
                f"--policy {setting.name}: perplexity runs h2o-kv policies, full or dynamic (a kvpress press "
                "compresses a prompt once; the streaming protocol evicts at every token)"
            )
        options = dict(policy_options or {})
        if options:
            try:
                make_policy(setting.name, 1, 1, **options)
            except (TypeError, ValueError) as err:
                raise PPLInputError(f"policy options {options}: {err}") from None
        if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
            raise PPLInputError(f"--window must be an integer >= 1, got {window!r}")
        if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
            raise PPLInputError(f"--chunk must be an integer >= 1, got {chunk!r}")
        if streaming and not setting.bounded:
            raise PPLInputError(f"--streaming needs a bounded policy (h2o, sink, local, ...), not {setting.name!r}")
        content = read_text(text, gutenberg)
        if len(content.encode("utf-8")) < tokens:  # a byte-level BPE token covers >= 1 byte
            raise PPLInputError(f"--tokens {tokens} is larger than the text ({len(content.encode())} bytes)")
        return cls(Path(text), tokens, setting, gutenberg, streaming, window, chunk, token_by_token, options, content)

    @property
    def heavy_recent(self) -> tuple[int | None, int | None]:
        """``(heavy, recent)`` of the ``tokens``-token run (``None`` for an unbounded setting)."""
        budget = self.setting.budget
        return (None, None) if budget is None else budget.split(self.tokens)

    @property
    def path(self) -> str:
        """How the NLLs are computed (all three give the same numbers)."""
        if self.token_by_token or self.per_token:
            return "one forward per token"
        return "stepwise chunks (fast, exact)" if self.setting.bounded else "causal chunks (nothing evicted: exact)"

    def token_ids(self, tokenizer) -> torch.Tensor:
        """The first ``tokens`` token ids of the text, ``[1, tokens]`` (no special tokens added)."""
        ids = tokenizer(self.text, add_special_tokens=False, return_tensors="pt", verbose=False).input_ids
        if ids.shape[1] < self.tokens:
            raise PPLInputError(f"--tokens {self.tokens} is larger than the text ({ids.shape[1]} tokens)")
        return ids[:, : self.tokens]

    @property
    def per_token(self) -> bool:
        """transformers' QuantizedCache (``dynamic`` with ``kv_bits``) is fed one token per forward: a causal chunk
        would attend to its own tokens unquantized, which is not the protocol."""
        return self.setting.kv_bits is not None and not self.setting.uses_h2o_cache

    def make_cache(self, config=None):
        """The run's cache: stepwise for a bounded setting (every token a decode step), plain otherwise."""
        extra = {"streaming": True} if self.streaming else {}
        return self.setting.make_cache(
            prompt_length=self.tokens, stepwise=self.setting.bounded and not self.token_by_token, config=config,
            **extra, **self.policy_options,
        )  # fmt: skip

    def settings(self) -> dict[str, Any]:
        heavy, recent = self.heavy_recent
        budget = self.setting.budget
        return {
            "text_path": str(self.text_path), "tokens": self.tokens, "policy": self.setting.name, "heavy": heavy,
            "recent": recent, "budget": None if budget is None else budget.ratio, "gutenberg": self.gutenberg,
            "streaming": self.streaming, "window": self.window, "chunk": self.chunk,
            "token_by_token": self.token_by_token, "policy_options": self.policy_options,
            "protocol": "streaming: every token is a decode step with eviction", "special_tokens": False,
            "path": self.path,
        }  # fmt: skip


@torch.no_grad()
def streaming_nll(
    model, ids: torch.Tensor, cache, chunk: int = 512, progress: Callable[[int], None] | None = None
) -> torch.Tensor:
    """Per-token NLL (float64, ``[N - 1]``) of ``ids [1, N]``: entry ``t`` is ``-log p(ids[t + 1] | ids[: t + 1])``.

    The ids go through the model in chunks of ``chunk`` tokens that share ``cache``; with a ``stepwise`` cache
    every token is its own decode step, whatever the chunking; with a cache that evicts nothing each chunk is one
    causal forward. ``progress(n)`` is called after each chunk.
    """
    if ids.dim() != 2 or ids.shape[0] != 1:
        raise ValueError(f"ids must have shape [1, N], got {tuple(ids.shape)}")
    ids = ids.to(model.device)
    total = ids.shape[1]
    out = []
    with warnings.catch_warnings():
        # the budget is checked against the first chunk's length; a chunk shorter than the budget is expected
        warnings.filterwarnings("ignore", message="H2OCache")
        for start in range(0, total, chunk):
            end = min(total, start + chunk)
            logits = model(ids[:, start:end], **cache_kwargs(cache), use_cache=True).logits[0]
            targets = ids[0, start + 1 : end + 1]
            nll = torch.nn.functional.cross_entropy(logits[: targets.shape[0]].float(), targets, reduction="none")
            out.append(nll.double().cpu())
            if progress is not None:
                progress(end - start)
    return torch.cat(out)


@torch.no_grad()
def token_by_token_nll(model, ids: torch.Tensor, cache, progress: Callable[[int], None] | None = None) -> torch.Tensor:
    """The slow definition of :func:`streaming_nll`: one forward pass per token (for timing and checks)."""
    ids = ids.to(model.device)
    out = []
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="H2OCache")
        for t in range(ids.shape[1] - 1):
            logits = model(ids[:, t : t + 1], **cache_kwargs(cache), use_cache=True).logits[0, -1]
            out.append(torch.nn.functional.cross_entropy(logits.float(), ids[0, t + 1]).double().cpu())
            if progress is not None:
                progress(1)
    if progress is not None:
        progress(1)
    return torch.stack(out)


def summarize(nll: torch.Tensor, window: int | None = None) -> dict[str, Any]:
    """Mean NLL, perplexity, a batch-means standard error of the mean NLL (``BLOCK``-token blocks), the block
    means themselves (for paired comparisons between settings) and optional per-``window`` perplexities."""
    value = float(nll.mean())
    blocks = [float(b.mean()) for b in nll.split(BLOCK) if b.numel() == BLOCK]
    stderr = mean(blocks).se if len(blocks) > 1 else None
    out: dict[str, Any] = {"nll": value, "ppl": math.exp(value), "nll_stderr": stderr, "block_nll": blocks}
    if window:
        out["windows"] = [
            {"start": s + 1, "end": s + 1 + part.numel(), "nll": float(part.mean()), "ppl": math.exp(part.mean())}
            for s, part in zip(range(0, nll.numel(), window), nll.split(window), strict=True)
        ]
    return out


def cache_summary(cache, setting: KVSetting) -> dict[str, Any]:
    """Entries seen, kept, at peak and evicted per layer and KV head (a ``DynamicCache`` keeps every one)."""
    if setting.uses_h2o_cache:
        stats = cache.stats()
        return {k: stats[k] for k in ("policy", "seen_tokens", "kv_tokens", "peak_kv_tokens", "evicted_tokens")}
    seen = cache.get_seq_length()
    return {"policy": setting.name, "seen_tokens": seen, "kv_tokens": seen, "peak_kv_tokens": seen, "evicted_tokens": 0}


def run_ppl(
    job: PPLJob,
    model,
    tokenizer,
    json_path: str | Path | None = None,
    *,
    model_name: str | None = None,
    progress: Callable[[int], None] | None = None,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Run ``job`` on a loaded model; returns the result record (also written to ``json_path`` when given)."""
    ids = job.token_ids(tokenizer)
    cache = job.make_cache(model.config) if job.per_token else job.make_cache()  # QuantizedCache needs the config
    started = time.perf_counter()
    if job.token_by_token or job.per_token:
        nll = token_by_token_nll(model, ids, cache, progress)
    else:
        nll = streaming_nll(model, ids, cache, job.chunk, progress)
    elapsed = time.perf_counter() - started
    summary = summarize(nll, job.window)
    name = model_name or getattr(model.config, "name_or_path", None) or type(model).__name__
    metrics = {"ppl": summary["ppl"], "nll": summary["nll"], "nll_stderr": summary["nll_stderr"]}
    heavy, recent = job.heavy_recent
    fields = dict(
        label=f"ppl {job.text_path.stem} {job.tokens} tokens" + (" streaming" if job.streaming else ""),
        primary_metric="ppl",
        lower_is_better=True,
        heavy=heavy,
        recent=recent,
        tokens=job.tokens,
        predicted=int(nll.numel()),
        ppl=summary["ppl"],
        nll=summary["nll"],
        time_s=round(elapsed, 3),
        tokens_per_s=round(job.tokens / elapsed, 2),
        model=name,
        dtype=str(next(model.parameters()).dtype).removeprefix("torch."),
        device=str(model.device),
        torch_threads=torch.get_num_threads(),
        data={"path": str(job.text_path), "name": job.text_path.name, "sha256": sha256(job.text_path)},
        settings=job.settings(),
        cache=cache_summary(cache, job.setting),
        block_nll={"size": BLOCK, "mean": summary["block_nll"]},
        **({"windows": summary["windows"]} if "windows" in summary else {}),
        **(extra or {}),
    )
    return finish_result(json_path, "ppl", metrics, fields, setting=job.setting, device=model.device)


# -- `h2o-kv eval sweep --kind ppl` (registered in h2o_kv.eval.kinds) ------------------------------------------


def sweep_prepare(options: dict[str, Any], models) -> dict[str, Any]:
    check_options("ppl", options, {"text", "tokens", "strip_gutenberg", "streaming", "window", "chunk"})
    if "text" not in options or options["text"] is True:
        raise ValueError("--kind ppl needs --text FILE")
    if "tokens" not in options:
        raise ValueError("--kind ppl needs --tokens N")
    settings = dict(
        text=options["text"],
        tokens=option_int(options, "tokens"),
        gutenberg=bool(options.get("strip_gutenberg", False)),
        streaming=bool(options.get("streaming", False)),
        window=option_int(options, "window"),
        chunk=option_int(options, "chunk", 512),
    )
    job = PPLJob.create(setting=KVSetting.of("local", heavy=0, recent=1), **settings)  # the cells: sweep_check
    job.token_ids(models.tokenizer())  # --tokens larger than the text fails here, before the model loads
    return settings


def sweep_check(settings: dict[str, Any], setting: KVSetting) -> None:
    PPLJob.create(setting=setting, **settings)


def sweep_run(settings: dict[str, Any], setting: KVSetting, path: Path, models, progress) -> dict[str, Any]:
    job = PPLJob.create(setting=setting, **settings)
    return run_ppl(job, models.model(), models.tokenizer(), path, model_name=models.label, progress=progress)
