"""The only place that knows which transformers release is installed (supported: 5.2 to the newest 5.x).

What moved between 5.2 and 5.24, and how h2o-kv copes:

* the models' forward takes the cache as ``cache=`` (``past_key_values=`` before 5.18; still accepted, deprecated) and
  ``generate`` no longer takes ``cache_position``: :data:`CACHE_KWARG`, :func:`continuation_kwargs`;
* ``Cache.get_mask_sizes`` takes the query length (an ``int``) instead of ``cache_position``:
  :func:`query_length`;
* the layer method ``get_max_cache_shape`` became ``get_max_length``: :class:`LayerNames` offers both;
* attention modules stopped passing RoPE's ``cos``/``sin`` to ``cache.update``: streaming mode recomputes them
  from ``position_ids``, which every release passes on to the attention function (:mod:`h2o_kv.hf.rotary`).

The attention function, the mask function and the cache otherwise use public transformers API only.
"""

from __future__ import annotations

import inspect

import torch
import transformers
from packaging.version import Version
from transformers import LlamaModel

VERSION = Version(transformers.__version__)
MINIMUM = Version("5.2")
if VERSION < MINIMUM:
    raise ImportError(f"h2o-kv needs transformers >= {MINIMUM} (found {VERSION}): pip install -U transformers")

# the keyword a model's forward takes its cache under (both work where "cache" exists, the old one deprecated)
CACHE_KWARG = "cache" if "cache" in inspect.signature(LlamaModel.forward).parameters else "past_key_values"
_GENERATE_TAKES_CACHE_POSITION = "cache_position" in inspect.signature(LlamaModel.forward).parameters


def query_length(query: int | torch.Tensor) -> int:
    """``Cache.get_mask_sizes``'s first argument as a length: an ``int`` now, ``cache_position`` up to 5.17."""
    return query if isinstance(query, int) else int(query.shape[0])


def cache_kwargs(cache) -> dict:
    """``{CACHE_KWARG: cache}``: pass a cache to a model's forward under this release's name."""
    return {CACHE_KWARG: cache}


def continuation_kwargs(seen: int, new: int, device) -> dict:
    """What ``generate`` (besides an attention mask over the whole history) or a plain forward needs to take ``new``
    tokens after a cache that has ``seen`` (positions ``seen + i``): ``cache_position`` up to 5.17; nothing later."""
    if _GENERATE_TAKES_CACHE_POSITION:
        return {"cache_position": torch.arange(seen, seen + new, device=device)}
    return {}


class LayerNames:
    """Both names of the renamed cache-layer methods; a layer defines ``get_max_length``."""

    def get_max_cache_shape(self) -> int:  # transformers < 5.18
        return self.get_max_length()
