"""tests/vllm: the vLLM backend, in its own virtual environment (vLLM pins its own torch and transformers).

Everything here skips where vLLM is not installed. Engines are shared per module (an engine starts in ~20 s) and run
with the engine core in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so tests read the scheduler's KV
manager directly; the model worker is still its own process (vLLM's CPU executor).

Each test module skips itself, with the reason, unless ``importlib.util.find_spec("vllm")`` has an origin (from
``tests/`` this folder itself would import as a namespace package ``vllm``; it is not imported).
"""
