"""One benchmark measurement: prefill a batch of real prompts, decode a fixed number of tokens greedily, and
record time, memory and cache size.

Every configuration runs the same greedy loop (the loop ``model.generate`` runs, without its logits processors):
one prefill forward, then ``new_tokens - 1`` single-token forwards, each feeding the argmax of the previous
logits. End-of-sequence tokens are ignored, so every configuration generates exactly ``batch * new_tokens``
tokens. Positions are passed explicitly, which keeps RoPE right for caches that are shorter than the text (the
kvpress presses compress a ``DynamicCache`` after prefill).

A configuration's cache is a :class:`~h2o_kv.harness.setting.KVSetting`:

* ``dynamic``: the stock stack, ``DynamicCache`` with SDPA attention (h2o-kv's attention function is not used);
* an h2o-kv policy (``h2o``, ``local``, ``sink``, ..., ``full``): :class:`~h2o_kv.H2OCache` with ``budget`` (the H2O
  paper's "20%": :meth:`~h2o_kv.Budget.split` of the prompt) or explicit ``heavy``/``recent``, and the ``"h2o"``
  attention; ``full`` (no eviction) measures h2o-kv's own frame;
* ``kvpress:<press>`` (``kvpress:observed_attention``, ``kvpress:snapkv``, ...): NVIDIA kvpress compressing the
  prompt's ``DynamicCache`` to the same number of entries, once, after prefill (:mod:`h2o_kv.harness.peers`).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import statistics
import time
from dataclasses import asdict, dataclass

import torch

from ..harness.setting import KVSetting, held_entries
from ..harness.tables import percentile
from ..hf.compat import cache_kwargs
from .memory import PeakMemory, cache_bytes
from .workload import LoadedModel, make_prompts

WARMUP_CONTEXT = 128
WARMUP_STEPS = 4


@dataclass(frozen=True)
class BenchConfig:
    """One point of the grid: the setting ``policy`` (its budget ``budget`` or ``heavy``/``recent`` when it evicts),
    the prompt length ``context``, the ``batch`` and the tokens generated per sequence ``new_tokens``.

    ``prefill_batch``: prefill only this many distinct prompts and repeat the prefilled cache along the batch to
    ``batch`` rows before decoding (``batch`` must be a multiple). The decode then does exactly the work of
    ``batch`` rows; prefill time and prefill memory refer to the ``prefill_batch`` rows (flagged in the result).
    Used to keep the cost of a large-batch decode measurement on a small CPU down.
    """

    policy: str
    context: int
    batch: int
    new_tokens: int
    budget: float | None = None
    heavy: int | None = None
    recent: int | None = None
    prefill_batch: int | None = None
    tag: str = ""
    kv_bits: int | None = None  # quantized KV storage (H2OCache(kv_bits=...); dynamic: transformers' QuantizedCache)

    def __post_init__(self):
        self.setting  # noqa: B018 - validates the setting name and its budget
        for name in ("context", "batch", "new_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.new_tokens < 2:
            raise ValueError(f"new_tokens must be >= 2 (one prefill token plus decode steps), got {self.new_tokens}")
        if self.prefill_batch is not None and (self.prefill_batch < 1 or self.batch % self.prefill_batch):
            raise ValueError(f"prefill_batch must divide batch={self.batch}, got {self.prefill_batch}")

    @property
    def setting(self) -> KVSetting:
        return KVSetting.of(self.policy, budget=self.budget, heavy=self.heavy, recent=self.recent, option="policy",
                            kv_bits=self.kv_bits)  # fmt: skip

    @property
    def key(self) -> str:
        budget = f"|b={self.budget}|h={self.heavy}|r={self.recent}" if self.setting.bounded else ""
        pre = f"|pre={self.prefill_batch}" if self.prefill_batch else ""
        tag = f"|{self.tag}" if self.tag else ""
        tag += f"|kv={self.kv_bits}" if self.kv_bits is not None else ""
        return f"{self.policy}|L={self.context}|B={self.batch}|new={self.new_tokens}{budget}{pre}{tag}"

    def to_dict(self) -> dict:
        return asdict(self)


def kept_entries(cfg: BenchConfig) -> int | None:
    """Entries per layer and KV head that an evicting setting keeps after prefill (None when nothing is evicted)."""
    setting = cfg.setting
    return setting.entries(cfg.context) if setting.bounded else None


class _Run:
    """The cache and attention set-up of one configuration."""

    def __init__(self, lm: LoadedModel, cfg: BenchConfig, context: int):
        self.lm, self.cfg, self.context = lm, cfg, context
        self.setting = cfg.setting
        self.model = lm.model

    @contextlib.contextmanager
    def prefill_context(self):
        press = self.setting.press
        if press is None:
            yield
            return
        from ..harness.peers import compression_ratio, press_context

        ratio = compression_ratio(self.context, self.setting.entries(self.context))
        with press_context(self.model, press, ratio, self.context):
            yield

    def make_cache(self):
        self.model.set_attn_implementation("h2o" if self.setting.uses_h2o_cache else "sdpa")
        return self.setting.make_cache(config=self.model.config)


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
        "kv_tokens_per_layer_head_end": held_entries(cache),
        "seq_length_end": seq_len,
        "decode_cpu_util": decode_cpu_s / (decode_s * threads) if device.type == "cpu" and decode_s else None,
        "threads": threads,
        "loadavg_1m_end": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,  # other processes running?
        "first_tokens": tokens[0, :8].tolist(),
        "prompt_sha1": hashlib.sha1(prompts.cpu().numpy().tobytes()).hexdigest()[:12],
    }
    return result
