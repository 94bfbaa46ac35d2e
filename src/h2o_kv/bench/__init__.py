"""Speed and memory harness for h2o-kv (``h2o-kv bench``): prefill time, decode tokens/s, per-token latency,
end-to-end throughput (the H2O paper's metric), peak memory, KV bytes and the largest batch under a memory limit.

Modules: :mod:`.harness` (one measurement), :mod:`.runner` (grids, repeats, isolation, memory limits),
:mod:`.report` (tables, ratios, plot), :mod:`.profile` (where a decode step's time goes), :mod:`.workload` (prompts
and models). Imported lazily so that ``h2o-kv bench --help`` stays fast.
"""
