"""Streaming mode ("position rolling"): keys kept before RoPE and re-rotated at their place inside the cache.

The H2O paper's streaming variant (Zhang et al., arXiv:2306.14048, Sec. 5.3 / App. C) and StreamingLLM (Xiao et
al., "Efficient Streaming Language Models with Attention Sinks", arXiv:2309.17453, Sec. 3.2) run a model past its
trained context by giving positions *inside the cache* instead of positions in the text: with ``n`` entries kept,
the oldest kept entry sits at position 0 and the newest at ``n - 1``, so the model never sees a position beyond its
window however long the stream is.

Hugging Face attention modules rotate queries and keys at their absolute positions *before* calling
``cache.update``. RoPE is a rotation, so it can be undone exactly with the same ``cos``/``sin``, which
:func:`rope_at` recomputes with the model's rotary module from the ``position_ids`` passed to the attention function:

* the ``"h2o"`` attention function un-rotates the new keys (:func:`raw_keys`) and the cache stores them raw;
* it ranks the kept entries of every (sequence, KV head) by their column
  (:func:`in_cache_positions`), rotates each key to its rank and each query (un-rotated first) to the rank it
  will take itself (:class:`PositionRoller`).

Relative distances between a query and a key are then "number of kept entries in between", exactly as in
StreamingLLM. Partial rotary embeddings (GPT-NeoX ``rotary_pct``) are handled: only the first ``cos.shape[-1]``
dimensions are rotated. Models with learned absolute positions (OPT) have nothing to re-rotate and are rejected.
"""

from __future__ import annotations

import weakref

import torch

# attention module -> the model's rotary embedding module (or an error message); filled by attach_rotary(model)
_ROTARY: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
# rotary variants whose frequencies change with the sequence length: a table computed once would be wrong
_LENGTH_DEPENDENT_ROPE = ("dynamic", "longrope")
_NO_ROPE_MESSAGE = (
    "H2OCache(streaming=True) re-rotates keys with rotary position embeddings (RoPE), but this model {what}; "
    "models with learned absolute positions (e.g. OPT) cannot stream past their context. Use streaming=False "
    "and keep the text within config.max_position_embeddings."
)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE as Hugging Face applies it: the first ``cos.shape[-1]`` dims of ``x`` rotated, the rest passed through.

    ``cos``/``sin`` must broadcast against ``x[..., :rotary_dim]``.
    """
    r = cos.shape[-1]
    if r == x.shape[-1]:
        return x * cos + rotate_half(x) * sin
    x_rot, x_pass = x[..., :r], x[..., r:]
    return torch.cat((x_rot * cos + rotate_half(x_rot) * sin, x_pass), dim=-1)


def unrotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Exact inverse of :func:`rotate` with the same ``cos``/``sin``.

    Dividing by ``cos**2 + sin**2`` undoes a RoPE ``attention_scaling`` factor (YaRN) and the rounding of the
    float angle alike.
    """
    r = cos.shape[-1]
    norm = cos * cos + sin * sin
    if r == x.shape[-1]:
        return (x * cos - rotate_half(x) * sin) / norm
    x_rot, x_pass = x[..., :r], x[..., r:]
    return torch.cat(((x_rot * cos - rotate_half(x_rot) * sin) / norm, x_pass), dim=-1)


def find_rotary(model) -> torch.nn.Module | None:
    """The model's rotary embedding module (``model.model.rotary_emb`` for Llama), or None if it has none."""
    found = [m for m in model.modules() if hasattr(m, "inv_freq") and hasattr(m, "rope_type")]
    if len({id(m) for m in found}) > 1:
        return None  # several rotary tables (e.g. per-layer-type RoPE): not a layout this module knows
    return found[0] if found else None


def attach_rotary(model) -> None:
    """Remember the model's rotary embedding for each of its attention modules (called by ``enable_h2o``).

    Nothing is stored on the modules themselves (a weak map), so weights, ``state_dict`` and module listing are
    untouched.
    """
    rotary = find_rotary(model)
    if rotary is None:
        entry = _NO_ROPE_MESSAGE.format(what=f"(model_type {model.config.model_type!r}) has no single RoPE table")
    elif rotary.rope_type in _LENGTH_DEPENDENT_ROPE:
        entry = (
            f"H2OCache(streaming=True) does not support rope_type={rotary.rope_type!r}: its frequencies depend on the "
            "sequence length, so keys cannot be re-rotated from a fixed table"
        )
    else:
        entry = rotary
    for module in model.modules():
        if hasattr(module, "layer_idx"):
            _ROTARY[module] = entry


def rotary_for(module: torch.nn.Module) -> torch.nn.Module:
    """The rotary embedding registered for an attention module; a clear error if streaming cannot work."""
    entry = _ROTARY.get(module)
    if entry is None:
        raise RuntimeError(
            "H2OCache(streaming=True) needs the model prepared with h2o_kv.enable_h2o(model) (h2o_kv.load_model "
            "does it): that is where the model's rotary embedding is found"
        )
    if isinstance(entry, str):
        raise ValueError(entry)
    return entry


_PAIR_ORDERS: dict = {}


def pair_order(head_dim: int, rotary_dim: int, device=None) -> torch.Tensor:
    """Permutation of the head dimension that puts each RoPE pair ``(i, i + rotary_dim / 2)`` side by side.

    Stored raw keys (and queries, in the attention function) use this order, so that RoPE becomes one complex
    multiplication per entry (``torch.view_as_complex``). Dot products do not change under a common permutation.
    Dimensions past ``rotary_dim`` (partial rotary) follow unchanged.
    """
    key = (head_dim, rotary_dim, str(device))
    if key not in _PAIR_ORDERS:
        half = rotary_dim // 2
        first = torch.arange(half, device=device)
        pairs = torch.stack((first, first + half), dim=-1).flatten()
        _PAIR_ORDERS[key] = torch.cat((pairs, torch.arange(rotary_dim, head_dim, device=device)))
    return _PAIR_ORDERS[key]


# the last (position_ids, dtype) -> (cos, sin): every layer of a forward shares the same position_ids tensor
_LAST_ROPE: list = [None, None, None]


def rope_at(module: torch.nn.Module, position_ids: torch.Tensor | None, like: torch.Tensor):
    """The ``cos``/``sin`` ``[B, Q, r]`` the model rotated this forward's queries and keys with.

    The model's own rotary module is called on the ``position_ids`` the model passed on to its attention function
    (every transformers release does), in the dtype of ``like``, so the result equals what the model applied.
    """
    if position_ids is None:
        raise ValueError(_NO_ROPE_MESSAGE.format(what="passes no position_ids to its attention function"))
    memo = _LAST_ROPE
    if memo[0] is position_ids and memo[1] == like.dtype:
        return memo[2]
    rotary = rotary_for(module)
    with torch.no_grad():
        rope = rotary(like, position_ids.to(like.device))
    memo[:] = [position_ids, like.dtype, rope]
    return rope


_LAST_INVERSE: list = [None, None, None]


def inverse_factors(cos: torch.Tensor, sin: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Complex factors ``[B, Q, head_dim / 2]`` that undo the model's RoPE (``cos``/``sin`` ``[B, Q, r]``) on
    vectors in pair order: ``conj(cos + i sin) / (cos**2 + sin**2)`` (the division undoes a YaRN-style scaling
    and the rounding of the angle), 1 for the pairs past ``r``. Memoised for the tensors of the last call."""
    memo = _LAST_INVERSE
    if memo[0] is cos and memo[1] is sin and memo[2].shape[-1] == head_dim // 2:
        return memo[2]
    half = cos.shape[-1] // 2
    c, s = cos[..., :half], sin[..., :half]
    if c.dtype != torch.float64:
        c, s = c.float(), s.float()
    factors = torch.complex(c, -s) / (c * c + s * s)
    if half < head_dim // 2:
        factors = torch.cat((factors, factors.new_ones((*factors.shape[:-1], head_dim // 2 - half))), dim=-1)
    memo[:] = [cos, sin, factors]
    return factors


def raw_keys(keys: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Keys ``[B, H, Q, D]`` rotated by the model (``cos``/``sin`` ``[B, Q, r]``): un-rotated, in pair order."""
    head_dim = keys.shape[-1]
    paired = keys.index_select(-1, pair_order(head_dim, cos.shape[-1], keys.device))
    return _apply(paired, inverse_factors(cos, sin, head_dim).unsqueeze(1))


class RotaryTable:
    """The model's own RoPE at positions ``0 .. size - 1`` as complex factors ``[size, head_dim / 2]``.

    Pairs past the rotary dimensions (partial rotary) get the factor 1. The table is computed by the model's
    rotary module (so scaled variants such as linear, llama3 or YaRN match the model) and grown on demand.
    """

    def __init__(self, rotary: torch.nn.Module):
        self.rotary = rotary
        self.factors: torch.Tensor | None = None
        self.inverse: torch.Tensor | None = None
        self.unit = True

    def ensure(self, size: int, head_dim: int, like: torch.Tensor) -> torch.Tensor:
        """The table with at least ``size`` rows for keys like ``like`` (complex64 for 16/32-bit floats)."""
        cdtype = torch.complex128 if like.dtype == torch.float64 else torch.complex64
        f = self.factors
        stale = f is None or f.shape[1] != head_dim // 2 or f.dtype != cdtype or f.device != like.device
        if stale or f.shape[0] < size:
            size = max(size, 512 if stale else 2 * f.shape[0])
            real = like.new_empty(0, dtype=torch.float64 if cdtype == torch.complex128 else torch.float32)
            cos, sin = self.rotary(real, torch.arange(size, device=like.device).unsqueeze(0))
            half = cos.shape[-1] // 2  # HF tables are cat(freqs, freqs): the first half holds each pair once
            rot = torch.complex(cos[0, :, :half].to(real.dtype), sin[0, :, :half].to(real.dtype))
            ones = torch.ones(size, head_dim // 2 - half, dtype=cdtype, device=like.device)
            self.factors = torch.cat((rot.to(cdtype), ones), dim=-1)
            self.inverse = self.factors.conj().resolve_conj()  # rotation by minus the position
            self.unit = bool(torch.equal(self.factors[0], torch.ones_like(self.factors[0])))  # no RoPE scaling
        return self.factors


_TABLES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def table_for(module: torch.nn.Module) -> RotaryTable:
    rotary = rotary_for(module)
    table = _TABLES.get(rotary)
    if table is None:
        table = _TABLES[rotary] = RotaryTable(rotary)
    return table


def in_cache_positions(pos: torch.Tensor, valid: torch.Tensor, columns: torch.Tensor) -> torch.Tensor:
    """For each column in ``columns`` (``[B, H, C]``): the number of valid entries at an earlier column.

    That is the column's rank among the kept entries: an entry's in-cache position, and the in-cache position a
    query at that column takes (its own key, written or not, is the newest entry it sees).
    """
    big = torch.iinfo(pos.dtype).max
    ordered = pos.masked_fill(~valid, big).sort(dim=-1).values
    return torch.searchsorted(ordered, columns.contiguous())


def _apply(x: torch.Tensor, factors: torch.Tensor) -> torch.Tensor:
    """``x [..., D]`` (pair order) times complex ``factors [..., D/2]``; returns real ``[..., D]`` in ``x.dtype``."""
    compute = x if x.dtype in (torch.float32, torch.float64) else x.float()
    out = torch.view_as_real(torch.view_as_complex(compute.unflatten(-1, (-1, 2))) * factors).flatten(-2)
    return out if out.dtype == x.dtype else out.to(x.dtype)


class PositionRoller:
    """What the attention function needs for one call on a streaming cache layer.

    Queries are un-rotated once per call and put in pair order. A prompt chunk (:meth:`chunk`) rotates queries
    and candidate keys to their in-cache ranks. A decode step (:meth:`step`) keeps the query at in-cache position
    0 and rotates each key by minus its distance to the query (the number of kept entries between them): the same
    relative positions with one complex multiplication over the keys and one sort per step.
    """

    def __init__(self, module: torch.nn.Module, layer, query: torch.Tensor, rope, is_real: torch.Tensor | None = None):
        cos, sin = rope
        rows, head_dim = query.shape[2], query.shape[-1]
        self.group = query.shape[1] // layer.keys.shape[1]
        self.limit = getattr(getattr(module, "config", None), "max_position_embeddings", None)
        self.is_real = is_real
        self.capacity = layer.cache.policy.capacity
        slots = layer.slots if layer.is_initialized else 0
        size = int(min(layer.max_slots, 2 * (slots + rows) + 16)) + rows + 2
        table = table_for(module)
        self.table = table.ensure(size, head_dim, query)
        self.inverse, self.unit = table.inverse, table.unit
        self.raw_query = raw_keys(query, cos, sin)  # [B, Hq, Q, D], un-rotated, in pair order
        self._step_query = None

    def sliding_window(self, window: int | None) -> int | None:
        """A sliding-window model's window counts in-cache positions: with fewer kept entries it never binds."""
        if window is None or window > self.capacity:
            return None
        raise ValueError(
            f"H2OCache(streaming=True) on a sliding-window model needs heavy + recent < sliding_window={window} "
            f"(got {self.capacity}): in streaming mode distances are counted inside the cache"
        )

    def _lookup(self, positions: torch.Tensor, table: torch.Tensor | None = None) -> torch.Tensor:
        table = self.table if table is None else table
        return table.index_select(0, positions.flatten()).view(*positions.shape, -1)

    def chunk(self, keys, pos, valid, first_column: int):
        """Queries and candidate keys of a prompt chunk, rotated to their in-cache positions."""
        rows = self.raw_query.shape[2]
        batch, heads = pos.shape[:2]
        columns = torch.arange(first_column, first_column + rows, device=pos.device).expand(batch, heads, rows)
        qpos = in_cache_positions(pos, valid, columns)  # [B, Hkv, Q]
        top = int(qpos.max()) if qpos.numel() else 0
        if self.limit is not None and top >= self.limit:
            import warnings

            warnings.warn(
                f"streaming: a prompt chunk of {rows} tokens on top of the kept entries reaches in-cache position "
                f"{top} >= max_position_embeddings={self.limit}; feed long inputs in smaller chunks or with "
                "H2OCache(stepwise=True)",
                stacklevel=3,
            )
        query = _apply(self.raw_query, self._lookup(qpos.repeat_interleave(self.group, dim=1)))
        keys = _apply(keys, self._lookup(in_cache_positions(pos, valid, pos)))
        return query, keys

    def step(self, i: int, layer):
        """Query row ``i`` and the layer's slots after that row's key was written, at relative positions."""
        query, factors = self.step_factors(i, layer)
        return query, _apply(layer.keys, factors)

    def step_factors(self, i: int, layer):
        """Query row ``i`` and the complex factors ``[B, H, slots, D/2]`` that rotate each slot's raw key to its
        position relative to the query (applied per block to dequantized keys with ``kv_bits``)."""
        if self._step_query is None:  # every query at in-cache position 0 (only RoPE's scaling applies)
            self._step_query = self.raw_query if self.unit else _apply(self.raw_query, self.table[0])
        # distance of each kept entry to the query = number of valid entries newer than it, + 1 for a pad query
        newest_first = layer.pos.masked_fill(~layer.valid, -1).argsort(dim=-1, descending=True)
        ranks = torch.arange(newest_first.shape[-1], device=newest_first.device).expand_as(newest_first)
        distance = torch.empty_like(newest_first).scatter_(-1, newest_first, ranks)
        if self.is_real is not None:
            distance = distance + (~self.is_real[:, i]).long().view(-1, 1, 1)
        return self._step_query[:, :, i : i + 1], self._lookup(distance, self.inverse)
