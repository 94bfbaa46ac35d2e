"""Quantized storage of an :class:`~h2o_kv.hf.cache.H2OCache` layer's kept entries (``H2OCache(kv_bits=4|8)``).

The H2O paper (Zhang et al., arXiv:2306.14048, Sec. 5.3, Table 6) shows that eviction composes with KV
quantization: H2O keeps 20% of the entries, 4-bit storage shrinks each kept entry about 7x, together about 30x.

**Format** (per entry, i.e. per (sequence, KV head, slot), keys and values alike): the ``head_dim`` numbers are cut
into groups of ``group`` (64 by default, as transformers' ``QuantizedCache``); each group stores an asymmetric
(min/max) ``bits``-bit code per number plus one ``scale`` and one zero point ``zero`` (the group minimum), both in
the model's dtype: ``x ~ code * scale + zero``, ``code = round((x - zero) / scale)`` clamped to
``[0, 2**bits - 1]``. 8-bit codes take one byte, 4-bit codes two per byte (low nibble first).

**What stays in full precision** (the documented choice, tested in ``tests/test_quant.py``): every entry is stored
quantized in its slot, and the newest ``residual`` columns (default 64) are *also* held in full precision in a ring
(``ring[column % residual]``), which attention reads instead of their codes, as transformers' ``QuantizedCache``
keeps its newest ``residual_length`` tokens unquantized. The ring is never smaller than one entry, so a decode step
always sees its own key and value exactly; a prompt chunk attends to its own new entries in full precision (they
are quantized as they are stored). So an entry is read dequantized once it is older than the newest
``max(residual, 1)`` columns.

**Attention** over quantized slots (:func:`attend_step`, a decode step) runs the fused CPU kernel
(``kernels/cpu/quant_attend.cpp``: dot products with the codes in place, nothing dequantized into memory) for fp32 on
a CPU, and otherwise (another device or dtype, streaming mode, a sliding window, ``H2O_KV_FUSED=0``) dequantizes
``block`` slots at a time: never more than one block of one layer exists in full precision. A prompt chunk's candidates
(the kept entries followed by the chunk) hold the kept entries dequantized, one layer at a time
(:meth:`QuantizedSlots.read`). Eviction uses the probability mass of this attention: the scores come from the
attention actually run.
"""

from __future__ import annotations

import torch

KV_BITS = (4, 8)
DEFAULT_GROUP = 64
DEFAULT_RESIDUAL = 64
BLOCK = 256  # slots dequantized at a time in a decode step


def check_bits(kv_bits) -> int | None:
    """``kv_bits`` if it is None, 4 or 8; else a one-line ``ValueError`` naming it and the allowed values."""
    if kv_bits is None or (isinstance(kv_bits, int) and not isinstance(kv_bits, bool) and kv_bits in KV_BITS):
        return kv_bits
    allowed = ", ".join(map(str, KV_BITS))
    raise ValueError(f"kv_bits must be one of {allowed} (or None: no quantization); got {kv_bits!r}")


def check_group(group, head_dim: int | None = None) -> int:
    """A group size that is a positive even integer (dividing ``head_dim`` when given)."""
    if not isinstance(group, int) or isinstance(group, bool) or group < 2 or group % 2:
        raise ValueError(f"kv_group_size must be an even integer >= 2; got {group!r}")
    if head_dim is not None and head_dim % group:
        raise ValueError(f"kv_group_size must divide the model's head_dim={head_dim}; got {group}")
    return group


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 codes ``[..., n]`` -> stored bytes: themselves (8-bit) or two per byte, low nibble first (4-bit)."""
    if bits == 8:
        return codes
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack(data: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of :func:`pack`: uint8 codes ``[..., n]``."""
    if bits == 8:
        return data
    return torch.stack((data & 15, data >> 4), dim=-1).flatten(-2)


def quantize(x: torch.Tensor, bits: int, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``x [..., D]`` -> ``(data uint8 [..., D * bits / 8], scale [..., D / group], zero [..., D / group])``.

    ``scale`` and ``zero`` are in ``x.dtype``; the codes are computed in float32 from the stored (rounded) scale and
    zero, so :func:`dequantize` reproduces exactly what they encode.
    """
    groups = x.unflatten(-1, (-1, group))
    zero = groups.amin(-1)
    scale = (groups.amax(-1) - zero) / (2**bits - 1)
    s, z = scale.float().unsqueeze(-1), zero.float().unsqueeze(-1)
    codes = ((groups.float() - z) / s.clamp_min(torch.finfo(torch.float32).tiny)).round_().clamp_(0, 2**bits - 1)
    return pack(codes.to(torch.uint8).flatten(-2), bits), scale, zero


def dequantize(data: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int) -> torch.Tensor:
    """``code * scale + zero`` in the dtype of ``scale``: ``[..., D]``."""
    codes = unpack(data, bits).unflatten(-1, (scale.shape[-1], -1)).to(scale.dtype)
    return (codes * scale.unsqueeze(-1) + zero.unsqueeze(-1)).flatten(-2)


class QuantizedSlots:
    """Keys or values of one layer, ``[batch, kv_heads, slots, head_dim]``, stored as codes + scale + zero, plus a
    full-precision ring ``[batch, kv_heads, max(residual, 1), head_dim]`` of the newest columns.

    It answers the few tensor operations :class:`~h2o_kv.hf.cache.H2OLayer` applies to its key and value buffers
    (``shape``, resizing, batch selection, gathering candidates), so the layer's slot logic is the same with or
    without quantization; :meth:`read` is where entries are dequantized.
    """

    def __init__(self, bits: int, group: int, residual: int, parts, ring: torch.Tensor):
        self.bits, self.group, self.residual = bits, group, residual
        self.data, self.scale, self.zero = parts
        self.ring = ring

    @classmethod
    def empty(cls, like: torch.Tensor, bits: int, group: int, residual: int) -> QuantizedSlots:
        batch, heads, _, dim = like.shape
        check_group(group, dim)
        parts = quantize(like[:, :, :0], bits, group)
        return cls(bits, group, residual, parts, like.new_zeros((batch, heads, max(residual, 1), dim)))

    @property
    def parts(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.data, self.scale, self.zero

    def _with(self, parts, ring=None) -> QuantizedSlots:
        return QuantizedSlots(self.bits, self.group, self.residual, parts, self.ring if ring is None else ring)

    @property
    def shape(self) -> torch.Size:
        return torch.Size((*self.scale.shape[:3], self.ring.shape[-1]))

    @property
    def dtype(self) -> torch.dtype:
        return self.ring.dtype

    def nbytes(self) -> int:
        """Bytes held: codes, scales, zero points and the full-precision ring."""
        return sum(t.numel() * t.element_size() for t in (*self.parts, self.ring))

    # -- the layer's buffer operations ----------------------------------------------------------------------------
    def resized(self, slots: int) -> QuantizedSlots:
        """``slots`` slots, the first ``min(old, new)`` kept, new ones zero."""
        keep = min(slots, self.shape[2])

        def resized(t: torch.Tensor) -> torch.Tensor:
            out = t.new_zeros((*t.shape[:2], slots, t.shape[3]))
            out[:, :, :keep] = t[:, :, :keep]
            return out

        return self._with([resized(t) for t in self.parts])

    def index_select(self, dim: int, index: torch.Tensor) -> QuantizedSlots:
        assert dim == 0
        return self._with([t.index_select(0, index) for t in self.parts], self.ring.index_select(0, index))

    def repeat_interleave(self, repeats: int, dim: int) -> QuantizedSlots:
        assert dim == 0
        parts = [t.repeat_interleave(repeats, dim=0) for t in self.parts]
        return self._with(parts, self.ring.repeat_interleave(repeats, dim=0))

    def with_chunk(self, new: torch.Tensor) -> QuantizedSlots:
        """The slots followed by a chunk of new entries ``[B, H, c, D]``, quantized (a prompt chunk's candidates)."""
        new_parts = quantize(new, self.bits, self.group)
        return self._with([torch.cat((t, n), dim=2) for t, n in zip(self.parts, new_parts, strict=True)])

    def gathered(self, index: torch.Tensor) -> QuantizedSlots:
        """The entries at slot ``index [B, H, k]``, in that order."""
        return self._with([t.gather(2, index.unsqueeze(-1).expand(-1, -1, -1, t.shape[-1])) for t in self.parts])

    def assign(self, other: QuantizedSlots, count: int) -> None:
        """Slots ``[:count]`` take ``other``'s entries (codes, scales and zeros as they are: nothing re-quantized)."""
        for mine, theirs in zip(self.parts, other.parts, strict=True):
            mine[:, :, :count] = theirs

    def write(self, free: torch.Tensor, new: torch.Tensor, column: int) -> None:
        """One token per (sequence, head) ``[B, H, 1, D]`` into slot ``free [B, H, 1]``, quantized, and the ring
        (one fused pass on a CPU in fp32: ``quant_write``, the same codes as :func:`quantize`)."""
        from .. import kernels

        if new.dtype == torch.float32 and self.scale.dtype == torch.float32:
            new, free = new.contiguous(), free.contiguous()
            ops = kernels.quant_ops(new, free, *self.parts, self.ring)
            if ops is not None:
                ops.quant_write(*self.parts, self.ring, free, new, column, self.bits)
                return
        for mine, part in zip(self.parts, quantize(new, self.bits, self.group), strict=True):
            mine.scatter_(2, free.unsqueeze(-1).expand(-1, -1, -1, mine.shape[-1]), part)
        self.ring[:, :, column % self.ring.shape[2]] = new[:, :, 0]

    def remember(self, new: torch.Tensor, first_column: int) -> None:
        """Put the newest entries of a chunk ``[B, H, c, D]`` starting at ``first_column`` into the ring."""
        size = self.ring.shape[2]
        tail = min(size, new.shape[2])
        columns = torch.arange(first_column + new.shape[2] - tail, first_column + new.shape[2], device=new.device)
        self.ring[:, :, columns % size] = new[:, :, -tail:]

    def read(self, pos: torch.Tensor, seen: int, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """Slots ``[start:stop]`` in full precision ``[B, H, n, D]``: dequantized, or from the ring for the entries
        among the newest ``max(residual, 1)`` columns (``pos``: the slots' columns; ``seen``: one past the newest)."""
        stop = self.shape[2] if stop is None else stop
        out = dequantize(*(t[:, :, start:stop] for t in self.parts), self.bits)
        size = self.ring.shape[2]
        columns = pos[:, :, start:stop]
        in_ring = columns >= seen - size
        if bool(in_ring.any()):
            index = columns.remainder(size).unsqueeze(-1).expand(-1, -1, -1, out.shape[-1])
            out = torch.where(in_ring.unsqueeze(-1), self.ring.gather(2, index), out)
        return out


def attend_step(
    query: torch.Tensor,
    keys: QuantizedSlots,
    values: QuantizedSlots,
    key_pos: torch.Tensor,
    key_valid: torch.Tensor | None,
    column: int,
    scaling: float,
    *,
    sliding_window: int | None = None,
    need_mass: bool = True,
    key_factors: torch.Tensor | None = None,
    block: int = BLOCK,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """One decode step's attention over quantized slots, dequantizing ``block`` slots at a time.

    The same contract as :func:`h2o_kv.hf.attention.attention_with_mass` for one query row at ``column``
    (``query [B, Hq, 1, D]``): returns ``(output [B, 1, Hq, Dv], mass [B, Hkv, N], last)``, ``last`` being
    ``mass`` (one row). ``key_factors [B, Hkv, N, D/2]`` (streaming mode): complex factors each block of
    dequantized raw keys is rotated by (:func:`h2o_kv.hf.rotary._apply`) before the dot products.
    """
    from .. import kernels
    from .rotary import _apply

    batch, q_heads, _, dim = query.shape
    kv_heads, entries = key_pos.shape[1], key_pos.shape[2]
    group = q_heads // kv_heads
    grouped = query.reshape(batch, kv_heads, group, dim) * scaling
    if key_factors is None and sliding_window is None and query.dtype == keys.dtype == values.dtype == torch.float32:
        valid = torch.ones_like(key_pos, dtype=torch.bool) if key_valid is None else key_valid
        ops = kernels.quant_ops(grouped, *keys.parts, keys.ring, *values.parts, values.ring, key_pos, valid)
        if ops is not None:  # the codes read in place (kernels/cpu/quant_attend.cpp)
            output, mass = ops.quant_attend(grouped, *keys.parts, keys.ring, *values.parts, values.ring, key_pos,
                                            valid, column, keys.bits)  # fmt: skip
            mass = mass if need_mass else None
            return output.reshape(batch, 1, q_heads, -1), mass, mass
    logits = query.new_empty((batch, kv_heads, group, entries))
    seen = column + 1
    for s0 in range(0, entries, block):
        s1 = min(entries, s0 + block)
        k = keys.read(key_pos, seen, s0, s1)
        if key_factors is not None:
            k = _apply(k, key_factors[:, :, s0:s1])
        logits[..., s0:s1] = torch.matmul(grouped, k.transpose(2, 3))
    if key_valid is not None or sliding_window is not None:
        visible = torch.ones_like(key_pos, dtype=torch.bool) if key_valid is None else key_valid
        visible = (visible & (key_pos <= column)) | (key_pos == column)
        if sliding_window is not None:
            visible &= key_pos > column - sliding_window
        logits.masked_fill_(~visible.unsqueeze(2), float("-inf"))
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    output = None
    for s0 in range(0, entries, block):
        s1 = min(entries, s0 + block)
        part = torch.matmul(probs[..., s0:s1].to(values.dtype), values.read(key_pos, seen, s0, s1))
        output = part if output is None else output.add_(part)
    mass = probs.sum(2) if need_mass else None
    return output.reshape(batch, 1, q_heads, -1), mass, mass


def stored_bytes(t) -> int:
    """Bytes a cache buffer holds: a tensor, :class:`QuantizedSlots`, or a quanto ``QTensor`` of transformers'
    ``QuantizedCache`` (its codes, scales and shifts, found through ``__tensor_flatten__``); 0 for anything else."""
    if isinstance(t, QuantizedSlots):
        return t.nbytes()
    if hasattr(t, "__tensor_flatten__"):
        names, _ = t.__tensor_flatten__()
        return sum(stored_bytes(getattr(t, name)) for name in names)
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0
