"""Streaming perplexity under a bounded KV cache (the H2O paper's streaming protocol, arXiv:2306.14048).

Every token of the text is fed as its own decode step: it attends to the entries kept so far plus itself, its
attention is added to the policy's scores, and the cache evicts down to ``heavy + recent`` before the next token.
The NLL of token ``t + 1`` is read from the logits at step ``t``, so the numbers are exactly what generation would
see. The fast path is :class:`~h2o_kv.H2OCache` with ``stepwise=True``: the text goes through the model in a few
large chunks that share one cache (projections and MLPs run batched; only the per-token attention and slot
bookkeeping are sequential), which is token-for-token identical to feeding one token per forward
(``tests/test_eval_ppl.py`` checks it against both that and the plain reference in ``tests/reference.py``).

Budget as a ratio ``B`` means ``heavy = recent = floor(B * N / 2)`` of the ``N`` evaluated tokens.
"""

from __future__ import annotations

import inspect
import math
import re
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..hf.cache import H2OCache
from ..hf.compat import cache_kwargs
from ..policies import POLICIES, make_policy
from .results import sha256, write_result

_START = re.compile(r"\*\*\*\s*START OF (?:THE|THIS) PROJECT GUTENBERG E-?BOOK.*?\*\*\*", re.IGNORECASE | re.DOTALL)
_END = re.compile(r"\*\*\*\s*END OF (?:THE|THIS) PROJECT GUTENBERG E-?BOOK", re.IGNORECASE)
BLOCK = 64  # tokens per block of the block-mean NLLs stored in every result (batch-means standard errors)


class PPLInputError(ValueError):
    """Bad input to a perplexity run, detected before the model is loaded."""


def strip_gutenberg(text: str) -> str:
    """The book between the ``*** START OF THE/THIS PROJECT GUTENBERG EBOOK ... ***`` and ``*** END OF ...``
    markers (header, footer and license removed), without leading/trailing blank lines."""
    start = _START.search(text)
    if start is None:
        raise PPLInputError("--strip-gutenberg: no '*** START OF THE/THIS PROJECT GUTENBERG EBOOK ***' marker found")
    end = _END.search(text, start.end())
    if end is None:
        raise PPLInputError("--strip-gutenberg: no '*** END OF THE/THIS PROJECT GUTENBERG EBOOK' marker found")
    return text[start.end() : end.start()].strip("\r\n")


def read_text(path: str | Path, gutenberg: bool = False) -> str:
    """Read a UTF-8 text file with universal newlines (CRLF -> LF), optionally :func:`strip_gutenberg`."""
    path = Path(path)
    if not path.is_file():
        raise PPLInputError(f"--text: file {path} does not exist")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise PPLInputError(f"--text: {path} is not UTF-8 text ({err})") from None
    if gutenberg:
        text = strip_gutenberg(text)
    if not text.strip():
        raise PPLInputError(f"--text: {path} holds no text" + (" between the Gutenberg markers" if gutenberg else ""))
    return text


def budget_split(policy: str, tokens: int, heavy: int | None, recent: int | None, budget: float | None):
    """``(heavy, recent, budget)`` for a run over ``tokens`` tokens; a ratio gives ``floor(budget * tokens / 2)``
    each. Raises :class:`PPLInputError` naming the bad parameter."""
    if policy not in POLICIES:
        raise PPLInputError(f"--policy must be one of {', '.join(POLICIES)}; got {policy!r}")
    if policy == "full":
        if heavy is not None or recent is not None or budget not in (None, 1.0):
            raise PPLInputError("--policy full keeps every token: give no --heavy/--recent/--budget (or --budget 1)")
        return 0, 0, 1.0
    if budget is not None:
        if heavy is not None or recent is not None:
            raise PPLInputError("give either --budget (a ratio) or --heavy and --recent (token counts), not both")
        if isinstance(budget, bool) or not isinstance(budget, (int, float)) or not 0 < budget <= 1:
            raise PPLInputError(f"--budget must be a ratio in (0, 1] of --tokens, got {budget!r}")
        half = math.floor(budget * tokens / 2)
        if half == 0:
            raise PPLInputError(
                f"--budget {budget} of {tokens} tokens keeps no entry (heavy = recent = floor(budget * tokens / 2) "
                "= 0); use a larger --budget or --tokens"
            )
        return half, half, float(budget)
    for name, value in (("--heavy", heavy), ("--recent", recent)):
        if value is None:
            raise PPLInputError(f"{name} is required: give --heavy and --recent (token counts) or --budget (a ratio)")
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise PPLInputError(f"{name} must be an integer >= 0, got {value!r}")
    if heavy + recent == 0:
        raise PPLInputError("--heavy + --recent must be >= 1")
    return heavy, recent, None


def streaming_supported() -> bool:
    """Whether this h2o_kv's :class:`H2OCache` accepts ``streaming=True`` (position rolling, issue 5)."""
    return "streaming" in inspect.signature(H2OCache.__init__).parameters


@dataclass
class PPLJob:
    """A validated perplexity run (everything checked before any model is loaded)."""

    text_path: Path
    tokens: int
    policy: str
    heavy: int
    recent: int
    budget: float | None
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
        policy: str,
        *,
        heavy: int | None = None,
        recent: int | None = None,
        budget: float | None = None,
        gutenberg: bool = False,
        streaming: bool = False,
        window: int | None = None,
        chunk: int = 512,
        token_by_token: bool = False,
        policy_options: dict[str, Any] | None = None,
    ) -> PPLJob:
        if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 2:
            raise PPLInputError(f"--tokens must be an integer >= 2, got {tokens!r}")
        heavy, recent, budget = budget_split(policy, tokens, heavy, recent, budget)
        options = dict(policy_options or {})
        try:
            make_policy(policy, heavy, recent, **options)
        except (TypeError, ValueError) as err:
            raise PPLInputError(f"policy options {options}: {err}") from None
        if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
            raise PPLInputError(f"--window must be an integer >= 1, got {window!r}")
        if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
            raise PPLInputError(f"--chunk must be an integer >= 1, got {chunk!r}")
        if streaming:
            if not streaming_supported():
                raise PPLInputError(
                    "--streaming needs H2OCache(streaming=True) (position rolling), which this h2o_kv does not "
                    "provide yet"
                )
            if policy == "full":
                raise PPLInputError("--streaming needs a bounded policy, not 'full'")
        content = read_text(text, gutenberg)
        if len(content.encode("utf-8")) < tokens:  # a byte-level BPE token covers >= 1 byte
            raise PPLInputError(f"--tokens {tokens} is larger than the text ({len(content.encode())} bytes)")
        return cls(
            Path(text), tokens, policy, heavy, recent, budget, gutenberg, streaming, window, chunk, token_by_token,
            options, content,
        )  # fmt: skip

    def token_ids(self, tokenizer) -> torch.Tensor:
        """The first ``tokens`` token ids of the text, ``[1, tokens]`` (no special tokens added)."""
        ids = tokenizer(self.text, add_special_tokens=False, return_tensors="pt", verbose=False).input_ids
        if ids.shape[1] < self.tokens:
            raise PPLInputError(f"--tokens {self.tokens} is larger than the text ({ids.shape[1]} tokens)")
        return ids[:, : self.tokens]

    def make_cache(self) -> H2OCache:
        extra = {"streaming": True} if self.streaming else {}
        if self.policy == "full":
            return H2OCache(policy="full", stepwise=True, **extra)
        return H2OCache(self.heavy, self.recent, policy=self.policy, stepwise=True, **extra, **self.policy_options)

    def settings(self) -> dict[str, Any]:
        out = {k: v for k, v in asdict(self).items() if k != "text"}
        out["text_path"] = str(self.text_path)
        out.update(protocol="streaming: every token is a decode step with eviction", special_tokens=False)
        out["path"] = "one forward per token" if self.token_by_token else "stepwise chunks (fast, exact)"
        return out


@torch.no_grad()
def streaming_nll(
    model, ids: torch.Tensor, cache: H2OCache, chunk: int = 512, progress: Callable[[int], None] | None = None
) -> torch.Tensor:
    """Per-token NLL (float64, ``[N - 1]``) of ``ids [1, N]``: entry ``t`` is ``-log p(ids[t + 1] | ids[: t + 1])``.

    The ids go through the model in chunks of ``chunk`` tokens that share ``cache``; with a ``stepwise`` cache
    every token is its own decode step, whatever the chunking. ``progress(n)`` is called after each chunk.
    """
    if ids.dim() != 2 or ids.shape[0] != 1:
        raise ValueError(f"ids must have shape [1, N], got {tuple(ids.shape)}")
    ids = ids.to(model.device)
    total = ids.shape[1]
    out = []
    with warnings.catch_warnings():
        # the budget is checked against the first chunk's length; a chunk shorter than the budget is expected
        warnings.filterwarnings("ignore", message="H2OCache budget heavy \\+ recent")
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
def token_by_token_nll(
    model, ids: torch.Tensor, cache: H2OCache, progress: Callable[[int], None] | None = None
) -> torch.Tensor:
    """The slow definition of :func:`streaming_nll`: one forward pass per token (for timing and checks)."""
    ids = ids.to(model.device)
    out = []
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="H2OCache budget heavy \\+ recent")
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
    means themselves (for paired comparisons between policies) and optional per-``window`` perplexities."""
    mean = float(nll.mean())
    blocks = [float(b.mean()) for b in nll.split(BLOCK) if b.numel() == BLOCK]
    stderr = float(torch.tensor(blocks).std() / math.sqrt(len(blocks))) if len(blocks) > 1 else None
    out: dict[str, Any] = {"nll": mean, "ppl": math.exp(mean), "nll_stderr": stderr, "block_nll": blocks}
    if window:
        out["windows"] = [
            {"start": s + 1, "end": s + 1 + part.numel(), "nll": float(part.mean()), "ppl": math.exp(part.mean())}
            for s, part in zip(range(0, nll.numel(), window), nll.split(window), strict=True)
        ]
    return out


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
    cache = job.make_cache()
    started = time.perf_counter()
    if job.token_by_token:
        nll = token_by_token_nll(model, ids, cache, progress)
    else:
        nll = streaming_nll(model, ids, cache, job.chunk, progress)
    elapsed = time.perf_counter() - started
    summary = summarize(nll, job.window)
    stats = cache.stats()
    name = model_name or getattr(model.config, "name_or_path", None) or type(model).__name__
    metrics = {"ppl": summary["ppl"], "nll": summary["nll"], "nll_stderr": summary["nll_stderr"]}
    record_fields = dict(
        label=f"ppl {job.text_path.stem} {job.tokens} tokens" + (" streaming" if job.streaming else ""),
        primary_metric="ppl",
        lower_is_better=True,
        policy=job.policy,
        heavy=job.heavy,
        recent=job.recent,
        budget=job.budget,
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
        cache={k: stats[k] for k in ("policy", "seen_tokens", "kv_tokens", "peak_kv_tokens", "evicted_tokens")},
        block_nll={"size": BLOCK, "mean": summary["block_nll"]},
        **({"windows": summary["windows"]} if "windows" in summary else {}),
        **(extra or {}),
    )
    if json_path is None:
        return {"kind": "ppl", **record_fields, "metrics": metrics}
    return write_result(json_path, "ppl", metrics, **record_fields)
