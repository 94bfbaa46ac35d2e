"""h2o-kv: H2O (Heavy-Hitter Oracle) KV-cache eviction with real memory savings for Hugging Face models."""

from .budget import Budget

__all__ = [
    "ATTENTION_NAME",
    "POLICIES",
    "Budget",
    "H2OCache",
    "Policy",
    "enable_h2o",
    "load_model",
    "register_attention",
]
__version__ = "0.2.0"

_LAZY = {  # (module, name): importing torch and transformers takes seconds, so they load on first use (the CLI's
    # --help and input checks import neither)
    "POLICIES": ("h2o_kv.policies", "POLICIES"),
    "Policy": ("h2o_kv.policies", "Policy"),
    "H2OCache": ("h2o_kv.hf.cache", "H2OCache"),
    "ATTENTION_NAME": ("h2o_kv.hf.attention", "ATTENTION_NAME"),
    "register_attention": ("h2o_kv.hf.attention", "register_attention"),
    "load_model": ("h2o_kv.models", "load_model"),
    "enable_h2o": ("h2o_kv.models", "enable_h2o"),
}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        module, attribute = _LAZY[name]
        return getattr(importlib.import_module(module), attribute)
    raise AttributeError(f"module 'h2o_kv' has no attribute {name!r}")
