"""Small helpers shared by the test modules (the fixtures are in conftest.py)."""

from __future__ import annotations

import warnings

import torch

from h2o_kv.hf.cache import H2OBudgetWarning
from h2o_kv.hf.compat import cache_kwargs


def random_prompt(length: int, seed: int = 1, batch: int = 1) -> torch.Tensor:
    """``[batch, length]`` random token ids in ``[3, 500)``, reproducible from ``seed``."""
    return torch.randint(3, 500, (batch, length), generator=torch.Generator().manual_seed(seed))


def greedy_generate(model, ids, cache, new_tokens, attention_mask=None, pad_token_id: int | None = 0):
    """Exactly ``new_tokens`` greedy tokens after ``ids`` with ``cache``.

    Returns (new tokens [batch, new_tokens], logits [batch, new_tokens, vocab]). ``attention_mask`` defaults to all
    ones; ``pad_token_id=None`` leaves the model's own generation config.
    """
    pad = {} if pad_token_id is None else {"pad_token_id": pad_token_id}
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids) if attention_mask is None else attention_mask,
        **cache_kwargs(cache),
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
        **pad,
    )
    return out.sequences[:, ids.shape[1] :], torch.stack(out.logits, dim=1)


def quiet_generate(model, ids, cache, new_tokens, **kwargs):
    """Exactly ``new_tokens`` greedy tokens (pad id 0); returns what ``generate`` returns. The cache's "budget >=
    prompt length" notice is silenced (expected with the small prompts of the tests)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=H2OBudgetWarning)
        return model.generate(
            ids, attention_mask=torch.ones_like(ids), **cache_kwargs(cache), max_new_tokens=new_tokens,
            min_new_tokens=new_tokens, do_sample=False, pad_token_id=0, **kwargs,
        )  # fmt: skip


def needs_data(*relative: str):
    """Mark a test ``data`` and skip it, naming ``$H2O_KV_DATA``, when the shared data folder lacks ``relative``."""
    import pytest

    from h2o_kv.harness.data import has_data

    missing = [path for path in relative if not has_data(path)]
    reason = (
        f"needs {', '.join(missing)} from the shared data folder: set H2O_KV_DATA to the folder holding MANIFEST.md "
        "(or run from a directory with ./shared/data or ../shared/data)"
    )

    def mark(test):
        return pytest.mark.data(pytest.mark.skipif(bool(missing), reason=reason)(test))

    return mark
