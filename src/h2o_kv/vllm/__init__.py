"""The serving backend: H2O eviction inside vLLM (a ``vllm.general_plugins`` plugin) and ``h2o-kv serve``.

Everything that imports vLLM lives in this package, so the core installs without it.
"""
