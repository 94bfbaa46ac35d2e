"""Where the Triton kernels run in these tests: on CUDA where a device is present, else under Triton's interpreter
on the CPU (fp32 and small shapes: it is slow). The interpreter must be on before Triton is imported (Triton's own
library functions are defined then), so this module sets ``TRITON_INTERPRET`` on import (``conftest.py`` imports it
first); where Triton was imported earlier still (some transformers versions import it with their model classes),
the tests skip and say to set the variable in the environment, as CI does."""

from __future__ import annotations

import os
import sys

import pytest
import torch

_LATE = not torch.cuda.is_available() and "TRITON_INTERPRET" not in os.environ and "triton" in sys.modules
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


def require_triton() -> None:
    """Skip the calling test module where Triton is missing, or was imported before the interpreter could be set."""
    pytest.importorskip("triton", reason="needs the gpu extra (Triton): pip install 'h2o-kv[gpu]'")
    if _LATE:
        pytest.skip(
            "Triton was imported before TRITON_INTERPRET could be set: run with TRITON_INTERPRET=1 in the environment",
            allow_module_level=True,
        )


def interpreted(kernel) -> bool:
    """Whether ``kernel`` was defined under the interpreter (it must match :data:`INTERPRET`)."""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(kernel, InterpretedFunction)
