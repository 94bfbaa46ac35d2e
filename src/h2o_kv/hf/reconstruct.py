"""Scoring a prompt by context reconstruction, for any h2o-kv policy (KVzip: Kim et al. 2025, "KVzip:
Query-Agnostic KV Cache Compression with Context Reconstruction", arXiv:2505.23416).

KVzip ranks a context's entries by the attention they receive while the model is asked to repeat the context: a
signal that does not depend on a question still to come. Here the request is appended to the prompt in one
forward, ``prompt + "Repeat the previous context exactly." + end of turn + the prompt again``, run as an
:meth:`H2OCache.scoring_pass`: the request's rows are the observation window (``last``), their attention is also
H2O's accumulated ``mass``, and their entries are dropped afterwards, so the policy keeps its budget of the prompt's
own entries and decoding continues right after the prompt. The rows' attention reaches the policy as their sum
(H2O's statistic) or, as in KVzip, their maximum over rows and query heads. What differs from KVzip
(``kvpress:kvzip``): the softmax over every visible entry
(KVzip's is over the chunk being repeated and 4 sink tokens), one pass for the whole prompt (KVzip repeats it in
chunks of 2,048 tokens) and the policy's own budget rule (per head or head-adaptive per layer; KVzip one budget
over all heads of all layers). The pass costs about two prefills of the prompt and holds its entries twice,
transiently.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .cache import H2OCache
from .compat import cache_kwargs

REQUEST = "\n\nRepeat the previous context exactly."  # KVzip's request for its first (here: only) chunk
_DUMMY = "\x00h2o-kv-context\x00"


@dataclass(frozen=True)
class Reconstruction:
    """The token ids that turn a prompt into its reconstruction request (see the module docstring)."""

    request: list[int]  # REQUEST, the end of the user's turn and the assistant's header
    prefix: list[int]  # the chat template's opening, which a prompt starting with it does not repeat

    @classmethod
    def for_tokenizer(cls, tokenizer) -> Reconstruction:
        """KVzip's request in the tokenizer's chat template (``"\\n"`` after it without a template)."""
        prefix, suffix = "", "\n"
        if getattr(tokenizer, "chat_template", None):
            text = tokenizer.apply_chat_template(
                [{"role": "user", "content": _DUMMY}], add_generation_prompt=True, tokenize=False
            )
            prefix, suffix = text.split(_DUMMY)
        encode = lambda s: tokenizer.encode(s, add_special_tokens=False) if s else []  # noqa: E731
        return cls(encode(REQUEST + suffix), encode(prefix))

    def scoring_ids(self, prompt: list[int]) -> list[int]:
        """The rows that score ``prompt``: the request, then the prompt without the template's opening."""
        copy = prompt[len(self.prefix) :] if self.prefix and prompt[: len(self.prefix)] == self.prefix else prompt
        return self.request + copy


@torch.no_grad()
def prefill(
    model, cache: H2OCache, input_ids: torch.Tensor, reconstruction: Reconstruction, statistic: str = "sum"
) -> torch.Tensor:
    """Run the prompt ``input_ids`` (``[1, L]``) into ``cache``, its entries scored by the reconstruction request
    (``statistic``: ``sum`` or ``max`` of the request rows' attention, see :meth:`H2OCache.scoring_pass`); returns the
    logits after the prompt's last token ``[1, vocab]``, as a plain prefill would."""
    if input_ids.dim() != 2 or input_ids.shape[0] != 1:
        raise ValueError(f"input_ids must be one prompt [1, L]; got shape {tuple(input_ids.shape)}")
    length = input_ids.shape[1]
    rows = torch.tensor([reconstruction.scoring_ids(input_ids[0].tolist())], device=input_ids.device)
    with cache.scoring_pass(rows.shape[1], statistic):
        out = model(
            torch.cat([input_ids, rows], dim=1), **cache_kwargs(cache), use_cache=True,
            logits_to_keep=torch.tensor([length - 1], device=input_ids.device),
        )  # fmt: skip
    return out.logits[:, -1]
