"""Where a decode step of an :class:`~h2o_kv.H2OCache` spends its time.

The step is split with wall-clock timers around the cache's entry points (the model is run unchanged):

* slot write: :meth:`H2OLayer.append` (free-slot search, key/value/position/score/validity writes);
* score update: the per-key mass reduction in the attention function (measured in a second pass as the difference
  between each attention call with and without ``need_mass`` on the same cache state, run back to back in
  alternating order);
* victim choice: :meth:`H2OLayer.evict` (the policy folds the mass into its scores and ranks; the lowest entry's slot
  is freed; H2O's fused CPU kernel does the score addition and the choice in one pass);
* attention: :func:`h2o_kv.hf.attention.attention_with_mass` without the mass reduction;
* the rest: projections, MLPs, norms, RoPE, the LM head and Python overhead.

Eviction bookkeeping = slot write + score update + victim choice. A ``torch.profiler`` table of the hottest
operators over the same steps is returned as well.
"""

from __future__ import annotations

import contextlib
import copy
import time
from collections import Counter

import torch

from ..hf.compat import cache_kwargs
from .harness import BenchConfig, _prefill, _Run
from .workload import LoadedModel, make_prompts


@contextlib.contextmanager
def _timers(totals: Counter, *, paired_mass: bool = False):
    from h2o_kv.hf import attention as hf_attention
    from h2o_kv.hf import cache as cache_mod

    originals = {
        (cache_mod.H2OLayer, "append"): cache_mod.H2OLayer.append,
        (cache_mod.H2OLayer, "evict"): cache_mod.H2OLayer.evict,
        (hf_attention, "attention_with_mass"): hf_attention.attention_with_mass,
    }

    def timed(label, fn):
        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            totals[label] += time.perf_counter() - t0
            return out

        return wrapper

    attention = originals[(hf_attention, "attention_with_mass")]

    calls = [0]

    def paired_attention_timed(*args, **kwargs):
        # the same call with and without the mass, in alternating order: their difference is the mass reduction,
        # free of the drift between separate passes on a shared machine; the cache evolves exactly as usual
        def without_mass():
            t0 = time.perf_counter()
            attention(*args, **{**kwargs, "need_mass": False})
            totals["attention_without_mass"] += time.perf_counter() - t0

        calls[0] += 1
        if calls[0] % 2:
            without_mass()
        t0 = time.perf_counter()
        out = attention(*args, **kwargs)
        totals["attention"] += time.perf_counter() - t0
        if not calls[0] % 2:
            without_mass()
        return out

    cache_mod.H2OLayer.append = timed("append", originals[(cache_mod.H2OLayer, "append")])
    cache_mod.H2OLayer.evict = timed("evict", originals[(cache_mod.H2OLayer, "evict")])
    hf_attention.attention_with_mass = paired_attention_timed if paired_mass else timed("attention", attention)
    try:
        yield
    finally:
        for (owner, name), fn in originals.items():
            setattr(owner, name, fn)


@torch.no_grad()
def _steps(lm: LoadedModel, cache, first, start: int, steps: int) -> float:
    ids, total = first, 0.0
    for i in range(steps):
        position = torch.full((ids.shape[0], 1), start + i, dtype=torch.long, device=lm.device)
        t0 = time.perf_counter()
        ids = lm.model(input_ids=ids, **cache_kwargs(cache), position_ids=position).logits[:, -1:].argmax(-1)
        if lm.device.type == "cuda":
            torch.cuda.synchronize(lm.device)
        total += time.perf_counter() - t0
    return total


def profile_decode(lm: LoadedModel, cfg: BenchConfig, steps: int = 24, warmup_steps: int = 4) -> dict:
    """Split the decode step of ``cfg`` (an h2o-kv policy) into attention, bookkeeping and the rest."""
    setting = cfg.setting
    if not (setting.uses_h2o_cache and setting.bounded):
        raise ValueError("profile splits the decode step of an evicting h2o-kv policy (h2o, local, sink, ...)")
    prompts = make_prompts(lm.tokenizer, cfg.batch, cfg.context, vocab_size=lm.model.config.vocab_size)
    cache, first = _prefill(_Run(lm, cfg, cfg.context), prompts.to(lm.device))
    _steps(lm, cache, first, cfg.context, warmup_steps)
    start = cfg.context + warmup_steps
    snapshot = copy.deepcopy(cache)

    plain = Counter()
    with _timers(plain):
        step_total = _steps(lm, cache, first, start, steps)
    paired = Counter()
    with _timers(paired, paired_mass=True):
        _steps(lm, copy.deepcopy(snapshot), first, start, steps)

    mass_reduction = max(0.0, paired["attention"] - paired["attention_without_mass"])
    parts = {
        "slot_write": plain["append"],
        "score_update": mass_reduction,  # the per-key mass; folding it into the scores is part of `evict`
        "victim_choice": plain["evict"],
        "attention_without_mass": plain["attention"] - mass_reduction,
    }
    parts["rest"] = step_total - sum(parts.values())
    per_step_ms = {k: 1000 * v / steps for k, v in parts.items()}
    bookkeeping = parts["slot_write"] + parts["score_update"] + parts["victim_choice"]

    from torch.profiler import ProfilerActivity, profile

    cache = copy.deepcopy(snapshot)  # outside the profiler: its copies are not part of a step
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        _steps(lm, cache, first, start, 4)
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20)
    return {
        "config": cfg.to_dict(),
        "budget_entries": setting.entries(cfg.context),
        "steps": steps,
        "step_ms": 1000 * step_total / steps,
        "split_ms": per_step_ms,
        "split_percent": {k: 100 * v / step_total for k, v in parts.items()},
        "bookkeeping_percent": 100 * bookkeeping / step_total,
        "profiler_table": table,
    }
