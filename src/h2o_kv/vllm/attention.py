"""H2O inside vLLM's CPU attention backend (registered over ``CPU_ATTN`` by the plugin).

For a request with an evicting setting the backend keeps, per layer, what h2o-kv's transformers backend keeps per
layer (:mod:`h2o_kv.hf.cache`): per KV head a set of slots with the absolute position (``pos``), a validity flag and
the policy's running score of each entry. The slots are the request's first physical cache slots (its first blocks);
each KV head orders its own entries, which attention allows since keys are cached after RoPE. The cache length the
kernel sees (``seq_lens``) is the slot count; positions keep counting.

* Prompt chunks (chunked prefill included) are written where vLLM puts them, all prompt blocks are held, and each
  layer accumulates the probability mass every prompt query pays each key, and separately the mass the prompt's
  last :attr:`~h2o_kv.policies.Policy.observation_window` queries pay (whichever chunks they fall in): the policy's
  ``mass`` and ``last``. After the last chunk the policy keeps its best ``capacity`` entries, gathered into the
  first slots; the scheduler (:mod:`h2o_kv.vllm.patches`) then frees the other blocks.
* A decode step writes the new token into the first free slot of each head (vLLM's write skips the row's token,
  :meth:`H2OAttentionImpl.do_kv_cache_update`), attends over the slots, folds the mass into the scores and frees
  the lowest-ranked slot when more than ``capacity`` entries are kept - the transformers backend's
  :meth:`~h2o_kv.hf.cache.H2OLayer.append` and :meth:`~h2o_kv.hf.cache.H2OLayer.evict`, slot for slot.

A decode step of every bounded row of a layer is one call of the fused kernel ``paged_decode``
(:func:`h2o_kv.kernels.paged_ops`): write, attention over the row's paged slots, mass and, for H2O, the score update
and the victim, in one pass (vLLM's kernel is handed a length of one slot for these rows and its output replaced).
Other policies get the mass from the kernel and rank in Python; without a compiler the same step runs as torch ops
(:func:`decode_torch`, the kernel's reference in the tests). The prompt chunks of every bounded row of a layer are
one call of ``paged_prefill`` (:func:`h2o_kv.kernels.prefill_ops`): output and mass in one pass over the rows'
paged blocks, read in place; vLLM's kernel runs over the other rows only (:func:`prefill_torch`, the transformers
backend's :func:`~h2o_kv.hf.attention.attention_with_mass` over the gathered keys, is its reference and fallback).
The policies are :mod:`h2o_kv.policies`' objects (one implementation, two backends).
Only the fp32 cache layout (the ``vec`` ISA) is supported.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from dataclasses import dataclass, field, replace

import torch
from vllm.forward_context import get_forward_context
from vllm.v1.attention.backend import AttentionType
from vllm.v1.attention.backends.cpu_attn import (
    CPUAttentionBackend,
    CPUAttentionBackendImpl,
    CPUAttentionMetadata,
    CPUAttentionMetadataBuilder,
)

from .. import kernels
from ..hf.attention import attention_with_mass
from ..policies import EntryView, Policy
from .config import ServeConfig, request_config


@dataclass
class LayerEntries:
    """One layer's slots of one request: ``pos``/``scores``/``valid`` ``[kv_heads, width]``, allocated once at the
    request's largest slot count (slots past the ones in use are invalid)."""

    pos: torch.Tensor
    scores: torch.Tensor
    valid: torch.Tensor
    prompt_mass: torch.Tensor | None = None  # while prefilling, [kv_heads, prompt]: mass of every prompt query
    window_mass: torch.Tensor | None = None  # the same of the observation window's queries (the policy's `last`)


@dataclass
class RequestEntries:
    """A bounded request's state in the worker."""

    policy: Policy
    prompt: int
    new_tokens: int  # the request's max_tokens
    slots: int = 0  # physical slots in use after the last step (the same in every layer and head)
    layers: dict[str, LayerEntries] = field(default_factory=dict)

    @property
    def fused(self) -> bool:
        """Whether the decode kernel ranks this request's entries itself (exactly H2O's ranking)."""
        return self.policy.fused_h2o_ranking


@dataclass(frozen=True)
class Row:
    """What one batch row of a bounded request does in this step (shared by every layer)."""

    entries: RequestEntries
    start: int  # first query token of the row in the flattened batch
    queries: int
    column: int  # absolute position of the row's first query
    slots: int  # physical slots attended (the kernel's seq_len)
    blocks: torch.Tensor  # the request's block ids covering `slots`
    prompt: bool  # a prompt chunk (else a decode step)
    last_chunk: bool  # the chunk that completes the prompt: compress after it
    window_from: int = 0  # a prompt chunk's first row in the observation window (the prompt's last queries)
    after: int = 0  # the request's slots in use once the step ran (RequestEntries.slots, set by advance())


@dataclass(frozen=True)
class PrefillBatch:
    """The bounded prompt chunks of a step, as the kernel takes them (shared by every layer)."""

    rows: tuple[Row, ...]
    block_table: torch.Tensor  # int32 [rows, blocks]
    meta: torch.Tensor  # int64 [rows, 4]: first token, queries, column, window_from


@dataclass(frozen=True)
class DecodeBatch:
    """The bounded decode rows of a step, as the kernel takes them (shared by every layer)."""

    rows: tuple[Row, ...]
    block_table: torch.Tensor  # int32 [rows, blocks]
    meta: torch.Tensor  # int64 [rows, 5]: token, slots, column, evicts, first protected column (H2O's recent window)


_REQUESTS: dict[str, RequestEntries | None] = {}  # None: a request the plugin leaves to vLLM
_PLANNED: list[Row] = []  # the bounded rows of the step in flight (the builder's plan; advance() commits it)
_STEP = threading.local()  # the model runner of the step in flight in this thread


@contextmanager
def step(runner, done):
    """A model runner's step (entered by :mod:`h2o_kv.vllm.patches`' ``execute_model``): the state of the ``done``
    requests (finished or preempted) is dropped first, the builder plans with ``runner`` while the step runs, and
    the plan is committed once it ran."""
    forget(done)
    _STEP.runner = runner
    try:
        yield
        advance()
    finally:
        _STEP.runner = None


def current_runner():
    """The model runner whose step is being executed in this thread (None outside a real step, e.g. warm-up)."""
    return getattr(_STEP, "runner", None)


def forget(request_ids) -> None:
    """Drop the state of finished (or preempted) requests."""
    for request_id in request_ids:
        _REQUESTS.pop(request_id, None)


def advance() -> None:
    """After a step ran: each bounded request holds the slots the step left it (the builder only plans them)."""
    for row in _PLANNED:
        row.entries.slots = row.after
    _PLANNED.clear()


def _entries_for(request_id: str, request_state) -> RequestEntries | None:
    if request_id not in _REQUESTS:
        params = request_state.sampling_params
        config = request_config(params.extra_args if params is not None else None)
        policy = config.make_policy(request_state.num_prompt_tokens) if config is not None else None
        new_tokens = (params.max_tokens or 0) if params is not None else 0
        bounded = policy is not None and policy.capacity < request_state.num_prompt_tokens + new_tokens
        # else nothing to evict: vLLM's kernel as it is
        _REQUESTS[request_id] = RequestEntries(policy, request_state.num_prompt_tokens, new_tokens) if bounded else None
    return _REQUESTS[request_id]


@dataclass
class H2OAttentionMetadata(CPUAttentionMetadata):
    h2o_prefill: PrefillBatch | None = None  # prompt chunks of bounded requests
    h2o_decode: DecodeBatch | None = None
    vllm_part: CPUAttentionMetadata | None = None  # with h2o_prefill: vLLM's kernel over the other rows (None: none)
    vllm_tokens: torch.Tensor | None = None  # the batch tokens of those rows


class H2OAttentionMetadataBuilder(CPUAttentionMetadataBuilder):
    """Turns bounded requests' logical lengths into physical slot counts, redirects their decode writes, and leaves
    their prompt chunks out of vLLM's kernel. It changes no request state: :func:`advance` commits a step's plan once
    the step ran (a second build of the same step plans the same rows)."""

    def build(self, common_prefix_len, common_attn_metadata, fast_build: bool = False):
        runner = current_runner()
        rows = self._plan(runner, common_attn_metadata) if runner is not None else []
        _PLANNED[:] = [row for _, row in rows]
        if rows:
            seq_lens = common_attn_metadata.seq_lens.clone()
            for index, row in rows:  # vLLM's kernel attends one slot of a decode row (its output is replaced)
                seq_lens[index] = row.slots if row.prompt else 1
            common_attn_metadata = replace(common_attn_metadata, seq_lens=seq_lens)
        metadata = super().build(common_prefix_len, common_attn_metadata, fast_build)
        if not rows:
            return metadata
        fields = {name: getattr(metadata, name) for name in CPUAttentionMetadata.__dataclass_fields__}
        prompt = [index for index, row in rows if row.prompt]
        part, tokens = self._without(common_prefix_len, common_attn_metadata, prompt, fast_build)
        return H2OAttentionMetadata(
            **fields, h2o_prefill=_prefill_batch(tuple(row for _, row in rows if row.prompt)),
            h2o_decode=_decode_batch(tuple(row for _, row in rows if not row.prompt)), vllm_part=part,
            vllm_tokens=tokens,
        )  # fmt: skip

    def _without(self, common_prefix_len, common, excluded: list[int], fast_build: bool):
        """vLLM's metadata for the batch without the rows ``excluded`` and the batch tokens of the rows left
        (``(None, None)`` when none is left)."""
        kept = sorted(set(range(common.num_reqs)) - set(excluded))
        if not excluded or not kept:
            return None, None
        starts = common.query_start_loc_cpu[: common.num_reqs + 1]
        tokens = torch.cat([torch.arange(int(starts[i]), int(starts[i + 1])) for i in kept])
        lengths = (starts[1:] - starts[:-1])[kept]
        query_start = torch.zeros(len(kept) + 1, dtype=starts.dtype)
        torch.cumsum(lengths, 0, out=query_start[1:])
        seq_lens = common.seq_lens[kept]
        part = replace(
            common, query_start_loc=query_start, query_start_loc_cpu=query_start, seq_lens=seq_lens,
            num_reqs=len(kept), num_actual_tokens=len(tokens), max_query_len=int(lengths.max()),
            max_seq_len=int(seq_lens.max()), block_table_tensor=common.block_table_tensor[kept],
            slot_mapping=common.slot_mapping[tokens], positions=None,
        )  # fmt: skip
        return super().build(common_prefix_len, part, fast_build), tokens

    def _plan(self, runner, common) -> list[tuple[int, Row]]:
        if self.isa != "vec":
            raise RuntimeError(f"h2o-kv's vLLM backend supports the fp32 KV cache only (the 'vec' ISA), not {self.isa}")
        if len(runner.kv_cache_config.kv_cache_groups) != 1:
            raise RuntimeError("h2o-kv's vLLM backend supports models with one (full-attention) KV cache group only")
        starts = common.query_start_loc_cpu.tolist()
        lengths = common.seq_lens.tolist()
        rows = []
        for index, request_id in enumerate(runner.input_batch.req_ids[: common.num_reqs]):
            if request_id is None:
                continue
            entries = _entries_for(request_id, runner.requests[request_id])
            if entries is None:
                continue
            start, queries = starts[index], starts[index + 1] - starts[index]
            end = lengths[index]  # logical: tokens computed after this step
            column = end - queries
            if column < entries.prompt:  # a prompt chunk: physical slots are the logical ones
                if end > entries.prompt:
                    raise RuntimeError("h2o-kv: a bounded request was recomputed past its prompt (preempted?)")
                slots, last = end, end == entries.prompt
                after = min(end, int(entries.policy.capacity)) if last else end
            else:
                if queries != 1:
                    raise RuntimeError("h2o-kv: a decode step of several tokens (speculative decoding) is unsupported")
                grows = entries.slots <= entries.policy.capacity or not entries.policy.evicts_during_decode
                slots = after = entries.slots + 1 if grows else entries.slots
                last = False
            blocks = common.block_table_tensor[index, : -(-slots // self.block_size)].long()
            window_from = max(0, entries.prompt - entries.policy.observation_window - column)
            prompt = column < entries.prompt
            row = Row(entries, start, queries, column, slots, blocks, prompt, last, window_from, after)
            rows.append((index, row))
        return rows


def _prefill_batch(rows: tuple[Row, ...]) -> PrefillBatch | None:
    if not rows:
        return None
    table = torch.zeros((len(rows), max(len(row.blocks) for row in rows)), dtype=torch.int32)
    for i, row in enumerate(rows):
        table[i, : len(row.blocks)] = row.blocks
    meta = torch.tensor([[row.start, row.queries, row.column, row.window_from] for row in rows], dtype=torch.long)
    return PrefillBatch(rows, table, meta)


def _decode_batch(rows: tuple[Row, ...]) -> DecodeBatch | None:
    if not rows:
        return None
    table = torch.zeros((len(rows), max(len(row.blocks) for row in rows)), dtype=torch.int32)
    meta = torch.empty((len(rows), 5), dtype=torch.long)
    for i, row in enumerate(rows):
        policy = row.entries.policy
        table[i, : len(row.blocks)] = row.blocks
        evicts = policy.evicts_during_decode and row.slots > policy.capacity
        meta[i] = torch.tensor([row.start, row.slots, row.column, evicts, row.column + 1 - policy.recent])
    return DecodeBatch(rows, table, meta)


def check_layer(impl) -> None:
    """Refuse (at model load, in the worker) a layer whose attention the H2O backend does not implement: what vLLM
    hands the attention implementation, so every model is covered (``impl`` is a ``CPUAttentionBackendImpl``)."""
    features = {
        "ALiBi position biases": impl.alibi_slopes is not None,
        "sliding-window attention": impl.sliding_window not in (None, -1),
        "logit soft-capping": bool(impl.logits_soft_cap),
        "attention sinks": impl.sinks is not None,
        f"{getattr(impl.attn_type, 'value', impl.attn_type)} attention (decoder self-attention only)": (
            impl.attn_type != AttentionType.DECODER
        ),
        "KV sharing across layers": impl.kv_sharing_target_layer_name is not None,
    }
    found = [name for name, present in features.items() if present]
    server = ServeConfig.from_env()
    if found and server is not None and server.evicts:
        raise ValueError(f"h2o-kv: an evicting policy does not support {', '.join(found)}; serve with --policy full")


class H2OAttentionImpl(CPUAttentionBackendImpl):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        check_layer(self)  # sliding windows, soft-capping, ALiBi, sinks...: refused at model load
        kernels.paged_ops()  # built (once per machine, ~40 s) or loaded while the model loads, not in a request
        kernels.prefill_ops()

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs):
        prefill, decode = getattr(attn_metadata, "h2o_prefill", None), getattr(attn_metadata, "h2o_decode", None)
        if prefill is None:
            output = super().forward(layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs)
        elif attn_metadata.vllm_part is not None:  # vLLM's kernel over the rows h2o-kv does not prefill
            tokens = attn_metadata.vllm_tokens
            part = output.new_empty((len(tokens), *output.shape[1:]))
            super().forward(layer, query[tokens], key, value, kv_cache, attn_metadata.vllm_part, part, *args, **kwargs)
            output[tokens] = part
        if prefill is not None or decode is not None:
            cache = PagedCache(kv_cache)
            if prefill is not None:
                self._prefill(layer.layer_name, prefill, query, kv_cache, cache, output)
            if decode is not None:
                self._decode(layer.layer_name, decode, query, key, value, kv_cache, cache, output)
        return output

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
        """vLLM's write of the step's keys and values, but of bounded decode rows (written by :meth:`_decode`)."""
        metadata = get_forward_context().attn_metadata
        metadata = metadata.get(layer.layer_name) if isinstance(metadata, dict) else metadata
        decode = getattr(metadata, "h2o_decode", None)
        if decode is not None:  # the attention writes these tokens into each head's free slot
            slot_mapping = slot_mapping.clone()
            slot_mapping[decode.meta[:, 0]] = -1
        super().do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)

    def _prefill(self, name, batch: PrefillBatch, query, kv_cache, cache, output) -> None:
        """The prompt chunks of every bounded row: attend with mass, accumulate it; after a prompt's last chunk keep
        the policy's best entries."""
        layers = []
        for row in batch.rows:
            if row.column == 0:  # the prompt's first chunk: its mass accumulates from zero
                shape = (self.num_kv_heads, row.entries.prompt)
                row.entries.layers[name] = LayerEntries(None, None, None, torch.zeros(shape), torch.zeros(shape))
            layers.append(row.entries.layers[name])
        ops = kernels.prefill_ops() if query.dtype == torch.float32 else None
        if ops is None:
            for row, layer in zip(batch.rows, layers, strict=True):
                prefill_torch(row, layer, query, cache, output, self.scale)
        else:
            scored = any(row.entries.policy.needs_attention for row in batch.rows)
            ops.paged_prefill(
                query, kv_cache, output.view(output.shape[0], self.num_heads, -1), batch.block_table, batch.meta,
                [layer.prompt_mass for layer in layers] if scored else [],
                [layer.window_mass for layer in layers] if scored else [], self.scale,
            )  # fmt: skip
        for row, layer in zip(batch.rows, layers, strict=True):
            if row.last_chunk:
                self._compress(row, layer, cache)

    def _decode(self, name, batch: DecodeBatch, query, key, value, kv_cache, cache, output) -> None:
        """One decode step of every bounded row: write, attend, score, evict (see the module docstring)."""
        layers = [row.entries.layers[name] for row in batch.rows]
        ops = kernels.paged_ops() if query.dtype == torch.float32 else None
        if ops is None:
            for row, layer in zip(batch.rows, layers, strict=True):
                decode_torch(row, layer, query, key, value, cache, output, self.scale)
            return
        out = output.view(output.shape[0], self.num_heads, -1)
        fused = [i for i, row in enumerate(batch.rows) if row.entries.fused]
        ranked = [i for i, row in enumerate(batch.rows) if not row.entries.fused]
        for part, fuse in ((fused, True), (ranked, False)):
            if not part:
                continue
            whole = len(part) == len(batch.rows)
            table = batch.block_table if whole else batch.block_table[part]
            meta = batch.meta if whole else batch.meta[part]
            mass = None if fuse else torch.empty((len(part), self.num_kv_heads, int(meta[:, 1].max())))
            ops.paged_decode(
                query, key, value, kv_cache, out, table, meta, [layers[i].pos for i in part],
                [layers[i].scores for i in part], [layers[i].valid for i in part], mass, self.scale,
            )  # fmt: skip
            if not fuse:
                for j, i in enumerate(part):
                    row = batch.rows[i]
                    rank(row, layers[i], mass[j : j + 1, :, : row.slots], cache)

    def _compress(self, row: Row, layer: LayerEntries, cache: PagedCache) -> None:
        """After a prompt's last chunk: keep the policy's best ``capacity`` entries, in the first slots."""
        entries, policy = row.entries, row.entries.policy
        kv_heads, total = layer.prompt_mass.shape[0], row.slots
        mass, last = (layer.prompt_mass[None], layer.window_mass[None]) if policy.needs_attention else (None, None)
        scores = policy.accumulate(torch.zeros((1, kv_heads, total)), mass, last)
        pos = torch.arange(total).expand(1, kv_heads, total)
        keep = int(min(policy.capacity, total))
        if keep < total:
            valid = torch.ones_like(pos, dtype=torch.bool)
            keys = cache.read(row.blocks, total)[0][None] if policy.needs_keys else None  # once per prompt (keydiff)
            view = EntryView(pos, valid, scores, total, torch.zeros(1, dtype=torch.long), keys)
            index = policy.keep_score(view).topk(keep, dim=-1).indices[0]  # [kv_heads, keep]
            cache.write_slots(row.blocks, *cache.gather(row.blocks, index))
        else:
            index = pos[0]
        # the most slots the request will use: capacity + 1 while it evicts, else everything it generates
        width = keep + entries.new_tokens
        if policy.evicts_during_decode:
            width = min(width, int(policy.capacity) + 1)
        layer.pos = torch.full((kv_heads, width), -1, dtype=torch.long)
        layer.scores = torch.zeros((kv_heads, width))
        layer.valid = torch.zeros((kv_heads, width), dtype=torch.bool)
        layer.pos[:, :keep] = index
        layer.scores[:, :keep] = scores[0].gather(1, index)
        layer.valid[:, :keep] = True
        layer.prompt_mass = layer.window_mass = None


def rank(row: Row, layer: LayerEntries, mass: torch.Tensor, cache: PagedCache) -> None:
    """Fold a decode step's ``mass`` ``[1, kv_heads, slots]`` into the policy's scores; free the lowest-ranked slot
    where over ``capacity`` (the transformers backend's :meth:`~h2o_kv.hf.cache.H2OLayer.evict`)."""
    policy, n = row.entries.policy, row.slots
    keys = cache.read(row.blocks, n)[0][None] if policy.needs_keys else None
    scores = layer.scores[None, :, :n]
    view = EntryView(layer.pos[None, :, :n], layer.valid[None, :, :n], scores, row.column + 1,
                     torch.zeros(1, dtype=torch.long), keys)  # fmt: skip
    if not policy.evicts_during_decode or n <= policy.capacity:
        layer.scores[:, :n] = policy.accumulate(scores, mass, mass)[0]  # one query: `last` is the step's mass
        return
    scores, victim = Policy.decode_victim(policy, view, mass, mass)  # the composition the fused H2O path equals
    layer.scores[:, :n] = scores[0]
    layer.valid[:, :n].scatter_(1, victim[0], False)


def prefill_torch(row: Row, layer: LayerEntries, query, cache: PagedCache, output, scale: float) -> None:
    """A bounded row's prompt chunk as torch ops over its gathered keys (a copy of them): what the kernel
    ``paged_prefill`` does (its reference and fallback). Adds the chunk's mass to ``layer.prompt_mass`` and that of
    its rows from ``row.window_from`` on to ``layer.window_mass``."""
    keys, values = cache.read(row.blocks, row.slots)  # [kv_heads, slots, head_dim]
    span, policy = slice(row.start, row.start + row.queries), row.entries.policy
    pos = torch.arange(row.slots).expand(keys.shape[0], -1)
    out, mass, last = attention_with_mass(
        query[span].transpose(0, 1).unsqueeze(0), keys[None], values[None], pos[None], None, row.column, scale,
        need_mass=policy.needs_attention, window=max(0, row.queries - row.window_from), chunk_start=row.column,
    )  # fmt: skip
    output[span] = out[0].reshape(output[span].shape)
    if mass is not None:
        layer.prompt_mass[:, : row.slots] += mass[0]
    if last is not None:
        layer.window_mass[:, : row.slots] += last[0]


def decode_torch(row: Row, layer: LayerEntries, query, key, value, cache: PagedCache, output, scale: float) -> None:
    """A bounded row's decode step as torch ops: what the kernel ``paged_decode`` does (its reference and fallback)."""
    n, heads = row.slots, torch.arange(layer.pos.shape[0])
    free = layer.valid[:, :n].byte().argmin(-1)  # [kv_heads]: each head's first free slot
    cache.write(row.blocks, free, key[row.start], value[row.start])
    layer.pos[heads, free] = row.column
    layer.scores[heads, free] = 0.0
    layer.valid[heads, free] = True
    keys, values = cache.read(row.blocks, n)  # [kv_heads, slots, head_dim]
    step = slice(row.start, row.start + 1)
    out, mass, _ = attention_with_mass(
        query[step].transpose(0, 1).unsqueeze(0), keys[None], values[None], layer.pos[None, :, :n],
        layer.valid[None, :, :n], row.column, scale,
    )  # fmt: skip
    output[step] = out[0].reshape(output[step].shape)
    rank(row, layer, mass, cache)


class PagedCache:
    """One layer's paged fp32 cache: keys dimension-major ``[head_dim, block_size]`` per (block, head), values
    token-major ``[block_size, head_dim]`` (vLLM's ``vec`` layout)."""

    def __init__(self, kv_cache: torch.Tensor):
        blocks, heads, block_size, _ = kv_cache.shape
        key_cache, self.values = kv_cache.view(blocks, heads, 2 * block_size, -1).chunk(2, dim=2)
        self.keys = key_cache.view(blocks, heads, -1, block_size)  # [blocks, heads, head_dim, block_size]
        self.block_size = block_size

    def read(self, blocks: torch.Tensor, slots: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of the first ``slots`` slots, ``[heads, slots, head_dim]`` each (copies)."""
        keys = self.keys[blocks].permute(1, 0, 3, 2).flatten(1, 2)[:, :slots]
        values = self.values[blocks].transpose(0, 1).flatten(1, 2)[:, :slots]
        return keys.contiguous(), values.contiguous()

    def write(self, blocks: torch.Tensor, slot: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        """Head ``h``'s ``key[h]``/``value[h]`` (``[heads, head_dim]``) into its slot ``slot[h]``."""
        heads = torch.arange(key.shape[0])
        block, offset = blocks[slot // self.block_size], slot % self.block_size
        self.keys[block, heads, :, offset] = key
        self.values[block, heads, offset, :] = value

    def gather(self, blocks: torch.Tensor, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of head ``h``'s slots ``index[h]`` (``[heads, n]``), ``[heads, n, head_dim]`` each."""
        block, offset = blocks[index // self.block_size], index % self.block_size
        heads = torch.arange(index.shape[0])[:, None]
        return self.keys[block, heads, :, offset], self.values[block, heads, offset, :]

    def write_slots(self, blocks: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """``keys``/``values`` ``[heads, n, head_dim]`` into every head's first ``n`` slots."""
        n = keys.shape[1]
        for first in range(0, n, self.block_size):
            block, count = int(blocks[first // self.block_size]), min(self.block_size, n - first)
            self.keys[block, :, :, :count] = keys[:, first : first + count].transpose(1, 2)
            self.values[block, :, :count, :] = values[:, first : first + count]


class H2OAttentionBackend(CPUAttentionBackend):
    @staticmethod
    def get_impl_cls():
        return H2OAttentionImpl

    @classmethod
    def customize_spec(cls, spec):
        """A full-attention layer's spec becomes :class:`~h2o_kv.vllm.blocks.H2OAttentionSpec`: the same layout,
        blocks managed by reservation (vLLM's KV-cache spec registry). Others are left to vLLM (and refused)."""
        from vllm.v1.kv_cache_interface import FullAttentionSpec

        from .blocks import H2OAttentionSpec

        spec = super().customize_spec(spec)
        return H2OAttentionSpec.of(spec) if type(spec) is FullAttentionSpec else spec

    @staticmethod
    def get_builder_cls():
        return H2OAttentionMetadataBuilder


__all__ = ["H2OAttentionBackend", "step"]
