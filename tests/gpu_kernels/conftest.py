"""The Triton kernels' tests (:mod:`h2o_kv.kernels.triton`); see :mod:`.interpreter` for where they run."""

from __future__ import annotations

import pytest
import torch

from .interpreter import INTERPRET


@pytest.fixture(scope="session")
def device() -> torch.device:
    """CUDA for the real kernels, the CPU under the interpreter."""
    if INTERPRET:
        return torch.device("cpu")
    if not torch.cuda.is_available():
        pytest.skip("TRITON_INTERPRET=0 and no CUDA device: nothing can run the kernels")
    return torch.device("cuda")
