"""Triton kernels of h2o-kv's GPU path (the optional extra ``gpu``: ``pip install 'h2o-kv[gpu]'``).

* :mod:`.slots`: the decode step over the transformers backend's slot buffer (write, attention, mass, H2O's score
  update and victim); ``H2OCache`` on CUDA uses its write and victim parts (:func:`h2o_kv.kernels.step_ops`).
* :mod:`.paged`: the same decode step over vLLM's GPU paged cache (``docs/vllm-gpu.md``).
* :mod:`.prompt`: a prompt's per-key probability mass from the attention's log-sum-exp, blockwise.
* :mod:`.reference`: their torch references (the tests compare each kernel with its reference).

Importing this package does not import Triton; :func:`slot_ops` does, once.
"""

from __future__ import annotations

import warnings

_slots = None
_missing = False


def slot_ops(tensors):
    """The module :mod:`.slots` when its kernels apply to ``tensors`` (one device, contiguous) and Triton imports,
    else ``None`` (the callers then run the equivalent torch ops)."""
    global _slots, _missing
    if not all(t.is_contiguous() and t.device == tensors[0].device for t in tensors):
        return None
    if _slots is None and not _missing:
        try:
            from . import slots as _slots
        except ImportError as error:
            _missing = True
            warnings.warn(
                f"h2o-kv: Triton is not importable ({error}); the CUDA decode bookkeeping runs as torch ops (same "
                "results, slower). Install the gpu extra (pip install 'h2o-kv[gpu]') or set H2O_KV_FUSED=0.",
                stacklevel=3,
            )
    return _slots
