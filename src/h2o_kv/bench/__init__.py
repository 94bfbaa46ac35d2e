"""Speed and memory harness for h2o-kv (``h2o-kv bench``): prefill time, decode tokens/s, per-token latency,
end-to-end throughput (the H2O paper's metric), peak memory, KV bytes and the largest batch under a memory limit.
"""

from .harness import BenchConfig, greedy_decode, measure
from .report import markdown_table, summarise

__all__ = ["BenchConfig", "greedy_decode", "markdown_table", "measure", "summarise"]
