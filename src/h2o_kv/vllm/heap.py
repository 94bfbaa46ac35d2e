"""The served processes' memory under a varied load: bounded oneDNN caching and the worker's heap trimmed.

vLLM's CPU worker runs each linear layer through a oneDNN GEMM primitive made for the step's token count (vLLM keeps
the last 32 per weight shape). oneDNN's own primitive cache keeps up to 1,024 more, so under a load whose token
counts keep changing (continuous batching: decode rows plus prompt chunks) the worker's resident memory climbed about
0.7 MB/s for the whole of a 64-client soak (+7% in 300 s; vLLM without the plugin as well). With that cache off
(:data:`ENV`; vLLM's 32 per shape still cached) the worker stayed flat, as it did with oneDNN replaced by torch's
linear. glibc also keeps what the worker frees in fragmented arenas: :func:`after_step` (called by the plugin after
each step) returns it to the OS every few seconds. Measured: docs/serving.md, "Load and faults".
"""

from __future__ import annotations

import time

ENV = {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "0"}  # given to the vllm serve process (a value already set is kept)
INTERVAL_S = 5.0  # a trim costs milliseconds; a step of this server takes 50-500 ms
_last_trim = time.monotonic()


def after_step() -> bool:
    """Trim the heap when :data:`INTERVAL_S` has passed since the last trim; whether it trimmed."""
    global _last_trim
    if time.monotonic() - _last_trim < INTERVAL_S:
        return False
    from ..bench.memory import trim_heap  # imports torch: not at import time (h2o-kv serve checks options first)

    trim_heap()
    _last_trim = time.monotonic()
    return True
