"""h2o-kv: H2O (Heavy-Hitter Oracle) KV-cache eviction with real memory savings for Hugging Face models."""

from .cache import H2OCache
from .policies import POLICIES, Policy
from .scoring import ATTENTION_NAME, register_attention

__all__ = ["ATTENTION_NAME", "POLICIES", "H2OCache", "Policy", "enable_h2o", "load_model", "register_attention"]
__version__ = "0.1.0"


def __getattr__(name):
    # models.py imports transformers' model classes; load it on first use only
    if name in ("load_model", "enable_h2o"):
        from . import models

        return getattr(models, name)
    raise AttributeError(name)
