"""Keys or values packed per (sequence, KV head): the memory of a head-adaptive or across-layers policy as kept.

Ada-KV (arXiv:2407.11550) and KVzip (arXiv:2505.23416) give each KV head its own count of entries. A slot buffer
``[batch, kv_heads, slots, head_dim]`` pads every head to the layer's largest count; :class:`PackedSlots` stores
each (sequence, KV head)'s ``sizes`` slots as one segment of a flat ``[sum(sizes), head_dim]`` buffer instead, so
the bytes allocated are the entries kept plus the one free slot a head needs for the next decode token, as vLLM's
paged layout would hold them. The slot metadata (``pos``, ``valid``, ``scores``: a few bytes per slot) stays padded,
and slot ``s`` of a head means the same entry in both layouts: ``s < sizes`` lies in the head's segment, a later
slot is never valid. Attention reads :meth:`read`, one layer's padded copy for the duration of one call (a GPU
kernel would read the segments in place).
"""

from __future__ import annotations

import torch


class PackedSlots:
    """One layer's keys (or values): segment ``[offsets[b, h], offsets[b, h] + sizes[b, h])`` of ``data`` holds slots
    ``0 .. sizes[b, h] - 1`` of sequence ``b``, KV head ``h``; :attr:`shape` is the padded view's."""

    def __init__(self, data: torch.Tensor, sizes: torch.Tensor, width: int):
        self.data, self.sizes, self.width = data, sizes, width  # [N, D], [B, H] (int64), slots of the padded view
        flat = sizes.flatten()
        self.offsets = (flat.cumsum(0) - flat).view_as(sizes)

    @classmethod
    def pack(cls, padded: torch.Tensor, sizes: torch.Tensor, *, checked: bool = True) -> PackedSlots:
        """The first ``sizes[b, h]`` slots of each head of ``padded`` ``[B, H, W, D]`` (``sizes <= W``; ``checked``
        false skips that check, a host synchronisation, where the caller guarantees it)."""
        width = padded.shape[2]
        if checked and bool((sizes > width).any()):
            raise ValueError(f"sizes must be at most the {width} slots of the padded buffer")
        return cls(padded[_in_segment(sizes, width)], sizes.clone(), width)

    @property
    def shape(self) -> torch.Size:
        batch, heads = self.sizes.shape
        return torch.Size((batch, heads, self.width, self.data.shape[-1]))

    @property
    def dtype(self) -> torch.dtype:
        return self.data.dtype

    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    def read(self) -> torch.Tensor:
        """The padded view ``[B, H, width, D]`` (zeros past each head's segment), a new tensor."""
        out = self.data.new_zeros(self.shape)
        out[_in_segment(self.sizes, self.width)] = self.data
        return out

    def write(self, slot: torch.Tensor, new: torch.Tensor, seen: int | None = None) -> None:
        """Write ``new`` ``[B, H, 1, D]`` into slot ``slot`` ``[B, H, 1]`` of each head (inside its segment)."""
        index = (self.offsets + slot[..., 0]).flatten()
        self.data.index_copy_(0, index, new.reshape(-1, new.shape[-1]).to(self.data.dtype))

    def resized(self, slots: int) -> PackedSlots:
        """The same segments under a padded view of ``slots`` slots (none may be cut)."""
        return type(self).pack(self.read()[:, :, :slots], self.sizes) if slots < self.width else self._with(slots)

    def grown(self, sizes: torch.Tensor, width: int) -> PackedSlots:
        """Segments of ``sizes`` (each at least the old size, at most ``width``), the old slots kept at their
        indices, under a padded view of ``max(width, self.width)`` slots."""
        return type(self).pack(self._padded_to(max(self.width, width)), sizes, checked=False)

    def index_select(self, dim: int, index: torch.Tensor) -> PackedSlots:
        """Sequences ``index`` (``dim`` 0, as transformers' beam search reorders a cache)."""
        return type(self).pack(self.read().index_select(dim, index), self.sizes.index_select(dim, index))

    def repeat_interleave(self, repeats: int, dim: int) -> PackedSlots:
        return type(self).pack(self.read().repeat_interleave(repeats, dim), self.sizes.repeat_interleave(repeats, dim))

    def _with(self, width: int) -> PackedSlots:
        return PackedSlots(self.data, self.sizes, width)

    def _padded_to(self, width: int) -> torch.Tensor:
        padded = self.read()
        return torch.nn.functional.pad(padded, (0, 0, 0, width - self.width)) if width > self.width else padded


def _in_segment(sizes: torch.Tensor, width: int) -> torch.Tensor:
    """``[B, H, width]``: slot ``s`` of head ``(b, h)`` lies in its segment."""
    return torch.arange(width, device=sizes.device) < sizes.unsqueeze(-1)


def padded(buffer) -> torch.Tensor:
    """``buffer`` as a padded ``[B, H, slots, D]`` tensor (a :class:`PackedSlots` read back, a tensor as it is)."""
    return buffer.read() if isinstance(buffer, PackedSlots) else buffer
