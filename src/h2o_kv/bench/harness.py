"""One benchmark measurement: prefill a batch of real prompts, decode a fixed number of tokens greedily, and
record time, memory and cache size.

Every configuration runs the same greedy loop (the loop ``model.generate`` runs, without its logits processors):
one prefill forward, then ``new_tokens - 1`` single-token forwards, each feeding the argmax of the previous
logits. End-of-sequence tokens are ignored, so every configuration generates exactly ``batch * new_tokens``
tokens. Positions are passed explicitly, which keeps RoPE right for caches that are shorter than the text (the
kvpress presses compress a ``DynamicCache`` after prefill).

Policies:

* ``full``: the stock stack, ``DynamicCache`` with SDPA attention (h2o-kv's attention function is not used).
* any h2o-kv policy (``h2o``, ``local``, ``sink``, ...): :class:`~h2o_kv.H2OCache` with ``budget`` (the H2O paper's
  "20%": ``heavy = recent = floor(0.2 * L / 2)``) or explicit ``heavy``/``recent``, and the ``"h2o"`` attention.
* ``kvpress:<press>`` (``kvpress:observed_attention``, ``kvpress:snapkv``): NVIDIA kvpress compressing the
  prompt's ``DynamicCache`` to the same number of entries, once, after prefill (:mod:`h2o_kv.peers`).
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import os
import statistics
import time
from dataclasses import asdict, dataclass

import torch

from ..hf.compat import cache_kwargs
from .memory import PeakMemory, cache_bytes
from .workload import LoadedModel, make_prompts

KVPRESS_PREFIX = "kvpress:"
WARMUP_CONTEXT = 128
WARMUP_STEPS = 4


@dataclass(frozen=True)
class BenchConfig:
    """One point of the grid.

    ``prefill_batch``: prefill only this many distinct prompts and repeat the prefilled cache along the batch to
    ``batch`` rows before decoding (``batch`` must be a multiple). The decode then does exactly the work of
    ``batch`` rows; prefill time and prefill memory refer to the ``prefill_batch`` rows (flagged in the result).
    Used to keep the cost of a large-batch decode measurement on a small CPU down.
    """

    policy: str
    context: int
    batch: int
    new_tokens: int
    budget: float | None = 0.2
    heavy: int | None = None
    recent: int | None = None
    prefill_batch: int | None = None
    tag: str = ""

    def __post_init__(self):
        check_policy(self.policy)
        for name in ("context", "batch", "new_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.new_tokens < 2:
            raise ValueError(f"new_tokens must be >= 2 (one prefill token plus decode steps), got {self.new_tokens}")
        if self.policy != "full" and self.budget is None and (self.heavy is None or self.recent is None):
            raise ValueError("give a budget ratio or heavy and recent counts")
        if self.budget is not None and not 0 < self.budget <= 1:
            raise ValueError(f"budget must be a ratio in (0, 1], got {self.budget}")
        if self.prefill_batch is not None and (self.prefill_batch < 1 or self.batch % self.prefill_batch):
            raise ValueError(f"prefill_batch must divide batch={self.batch}, got {self.prefill_batch}")

    @property
    def key(self) -> str:
        budget = "" if self.policy == "full" else f"|b={self.budget}|h={self.heavy}|r={self.recent}"
        pre = f"|pre={self.prefill_batch}" if self.prefill_batch else ""
        tag = f"|{self.tag}" if self.tag else ""
        return f"{self.policy}|L={self.context}|B={self.batch}|new={self.new_tokens}{budget}{pre}{tag}"

    def to_dict(self) -> dict:
        return asdict(self)


def check_policy(policy: str) -> str:
    """Validate a policy name: ``full``, a registered h2o-kv policy, or ``kvpress:<press>``."""
    from h2o_kv.policies import POLICIES

    if policy == "full" or (policy in POLICIES and policy != "full"):
        return policy
    if policy.startswith(KVPRESS_PREFIX):
        from h2o_kv.peers import check_press

        check_press(policy[len(KVPRESS_PREFIX) :])
        return policy
    allowed = ["full", *(p for p in POLICIES if p != "full"), "kvpress:observed_attention", "kvpress:snapkv"]
    raise ValueError(f"policy must be one of {', '.join(allowed)}; got {policy!r}")


def kept_entries(cfg: BenchConfig) -> int | None:
    """Entries per layer and KV head that an evicting policy keeps after prefill (None for ``full``)."""
    if cfg.policy == "full":
        return None
    if cfg.budget is not None:
        return min(cfg.context, 2 * math.floor(cfg.budget * cfg.context / 2))
    return min(cfg.context, cfg.heavy + cfg.recent)


class _Run:
    """The cache and attention set-up of one configuration."""

    def __init__(self, lm: LoadedModel, cfg: BenchConfig, context: int):
        self.lm, self.cfg, self.context = lm, cfg, context
        self.model = lm.model
        self._press = None

    @contextlib.contextmanager
    def prefill_context(self):
        cfg = self.cfg
        if cfg.policy.startswith(KVPRESS_PREFIX):
            from h2o_kv.peers import compression_ratio, press_context

            keep = kept_entries(BenchConfig(**{**cfg.to_dict(), "context": self.context}))
            ratio = compression_ratio(self.context, max(1, keep))
            with press_context(self.model, cfg.policy[len(KVPRESS_PREFIX) :], ratio, self.context) as press:
                self._press = press
                yield
        else:
            yield

    def make_cache(self):
        from transformers import DynamicCache

        from h2o_kv import H2OCache

        cfg = self.cfg
        if cfg.policy == "full" or cfg.policy.startswith(KVPRESS_PREFIX):
            self.model.set_attn_implementation("sdpa")
            return DynamicCache(config=self.model.config)
        self.model.set_attn_implementation("h2o")
        if cfg.heavy is not None:
            return H2OCache(heavy=cfg.heavy, recent=cfg.recent, policy=cfg.policy)
        return H2OCache(budget=cfg.budget, policy=cfg.policy)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def greedy_decode(model, cache, first_ids: torch.Tensor, start: int, steps: int, device, on_step=None):
    """Run ``steps`` single-token forwards from ``first_ids`` ([B, 1]) at absolute column ``start``.

    Returns ``(tokens [B, steps + 1], step_seconds)``; ``on_step(i)`` runs after each timed step, outside the timer.
    """
    ids = first_ids
    tokens, times = [first_ids], []
    batch = first_ids.shape[0]
    for i in range(steps):
        position = torch.full((batch, 1), start + i, dtype=torch.long, device=device)
        t0 = time.perf_counter()
        out = model(input_ids=ids, **cache_kwargs(cache), position_ids=position, use_cache=True)
        ids = out.logits[:, -1:].argmax(-1)
        _sync(device)
        times.append(time.perf_counter() - t0)
        tokens.append(ids)
        if on_step is not None:
            on_step(i)
    return torch.cat(tokens, dim=1), times


@torch.no_grad()
def _prefill(run: _Run, ids: torch.Tensor):
    cache = run.make_cache()
    with run.prefill_context():
        out = run.model(input_ids=ids, **cache_kwargs(cache), use_cache=True, logits_to_keep=1)
    return cache, out.logits[:, -1:].argmax(-1)


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile ``q`` in [0, 100] of ``values``."""
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    k = (len(ordered) - 1) * q / 100
    lo, hi = math.floor(k), math.ceil(k)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def measure(lm: LoadedModel, cfg: BenchConfig, *, warmup: bool = True) -> dict:
    """Run one configuration and return its measurements (times in seconds, memory in bytes)."""
    device = lm.device
    vocab = lm.model.config.vocab_size
    rows = cfg.prefill_batch or cfg.batch
    prompts = make_prompts(lm.tokenizer, rows, cfg.context, vocab_size=vocab).to(device)
    if warmup:  # same policy and batch on a short prompt: kernels, thread pools and allocator warm
        length = min(cfg.context, WARMUP_CONTEXT)
        run = _Run(lm, cfg, length)
        warm_cache, warm_first = _prefill(run, prompts[:, :length])
        greedy_decode(lm.model, warm_cache, warm_first, length, WARMUP_STEPS, device)
        del warm_cache, warm_first, run
    run = _Run(lm, cfg, cfg.context)
    threads = torch.get_num_threads()
    with PeakMemory(device) as prefill_mem:
        _sync(device)
        t0 = time.perf_counter()
        cache, first = _prefill(run, prompts)
        _sync(device)
        prefill_s = time.perf_counter() - t0
    prefill_cache_kv, prefill_cache_total = cache_bytes(cache)
    if cfg.prefill_batch and cfg.batch != rows:
        cache.batch_repeat_interleave(cfg.batch // rows)
        first = first.repeat_interleave(cfg.batch // rows, dim=0)
    peak_cache = [cache_bytes(cache)[1]]

    def on_step(_):
        peak_cache[0] = max(peak_cache[0], cache_bytes(cache)[1])

    with PeakMemory(device) as decode_mem:
        cpu0 = time.process_time()
        tokens, step_s = greedy_decode(lm.model, cache, first, cfg.context, cfg.new_tokens - 1, device, on_step)
        decode_cpu_s = time.process_time() - cpu0
    decode_s = sum(step_s)
    kv_end, total_end = cache_bytes(cache)
    seq_len = cache.get_seq_length()
    steps = len(step_s)
    result = {
        "key": cfg.key,
        "config": cfg.to_dict(),
        "kept_after_prefill": kept_entries(cfg),
        "prefill_rows": rows,
        "prefill_s": prefill_s,
        "prefill_tok_s": rows * cfg.context / prefill_s,
        "decode_s": decode_s,
        "decode_steps": steps,
        "decode_tok_s": cfg.batch * steps / decode_s,
        "step_ms_p50": 1000 * percentile(step_s, 50),
        "step_ms_p99": 1000 * percentile(step_s, 99),
        "step_ms_mean": 1000 * statistics.fmean(step_s),
        "step_ms": [round(1000 * t, 2) for t in step_s],
        # a replicated prefill did not prefill `batch` rows: no end-to-end number for it
        "e2e_tok_s": cfg.batch * cfg.new_tokens / (prefill_s + decode_s) if rows == cfg.batch else None,
        "generated_tokens": cfg.batch * cfg.new_tokens,
        "prefill_peak_bytes": prefill_mem.peak,
        "prefill_peak_increase_bytes": prefill_mem.increase,
        "decode_peak_bytes": decode_mem.peak,
        "decode_peak_increase_bytes": decode_mem.increase,
        "memory_method": prefill_mem.method,
        "kv_bytes_after_prefill": prefill_cache_kv,
        "cache_bytes_after_prefill": prefill_cache_total,
        "kv_bytes_end": kv_end,
        "cache_bytes_end": total_end,
        "cache_bytes_peak": peak_cache[0],
        "cache_bytes_per_seq_end": total_end / cfg.batch,
        "kv_tokens_per_layer_head_end": _entries(cache),
        "seq_length_end": seq_len,
        "decode_cpu_util": decode_cpu_s / (decode_s * threads) if device.type == "cpu" and decode_s else None,
        "threads": threads,
        "loadavg_1m_end": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,  # other processes running?
        "first_tokens": tokens[0, :8].tolist(),
        "prompt_sha1": hashlib.sha1(prompts.cpu().numpy().tobytes()).hexdigest()[:12],
    }
    return result


def _entries(cache) -> int:
    """Entries held per layer and KV head at the end (max over layers, sequences and heads)."""
    layer = cache.layers[0] if getattr(cache, "layers", None) else None
    if layer is None:
        return 0
    if hasattr(layer, "entry_count"):
        return int(max(int(lay.entry_count().max()) for lay in cache.layers if lay.is_initialized))
    return int(layer.keys.shape[2])
