"""User-facing notices: a warning attributed to the user's own line of code, not to a frame inside torch."""

from __future__ import annotations

import sys
import warnings

_INTERNAL = ("h2o_kv", "torch", "transformers", "contextlib", "typer", "click")


def notice(message: str, category: type[Warning] = UserWarning) -> None:
    """``warnings.warn(message, category)`` pointing at the first caller outside h2o-kv, torch and transformers
    (Python shows each such notice once per calling line)."""
    frame, level = sys._getframe(1), 2
    while frame is not None and frame.f_globals.get("__name__", "").split(".")[0] in _INTERNAL:
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level)
