"""The evaluation runner: a model under one :class:`~h2o_kv.harness.setting.KVSetting` - prefill a prompt, extend it
stepwise, generate greedily. Shared by the lm-eval tasks, XSUM and the needle test.

* A bounded h2o-kv policy compresses the prompt to its budget after the prefill (the budget is a ratio of the prompt
  length, :meth:`~h2o_kv.Budget.entries`); every later token is a decode step with eviction, run as one batched
  forward per chunk (``H2OCache.stepwise``), exactly as feeding the tokens one at a time would. With
  ``paper_protocol`` (the H2O paper's lm-eval setting) the prompt too is read under eviction, stepwise.
* An unbounded setting (``dynamic``, ``full``) evicts nothing, so one causal forward per chunk is exact.
* With ``reconstruct`` the prompt's entries are scored by KVzip's context-reconstruction request
  (:mod:`h2o_kv.hf.reconstruct`), in the same prefill forward; the policy then works as above.
* A kvpress press compresses the prompt once (:mod:`h2o_kv.harness.peers`) and never evicts afterwards.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import QuantizedCache

from ..harness.peers import press_close, press_expand, press_extend, press_prefill, require_kvpress
from ..harness.setting import KVSetting, mean_entries
from ..hf.compat import cache_kwargs


class ModelHandle:
    """Loads the model (and its tokenizer) once, on first use; the tokenizer alone is cheap to get."""

    def __init__(self, name: str | None = None, dtype: str | None = None, device: str | None = None):
        self.name, self.dtype, self.device = name, dtype, device
        self._model = self._tokenizer = None

    @property
    def label(self) -> str:
        from ..models import DEFAULT_MODEL

        return self.name or DEFAULT_MODEL

    def tokenizer(self):
        if self._tokenizer is None:
            if self._model is not None:
                raise RuntimeError(f"model {self.label} has no tokenizer")
            from ..models import load_tokenizer

            self._tokenizer = load_tokenizer(self.name)
            if self._tokenizer is None:
                raise ValueError(f"--model {self.label}: the model directory holds no tokenizer files")
        return self._tokenizer

    def model(self):
        if self._model is None:
            from ..models import load_model

            self._model, tokenizer = load_model(self.name, dtype=self.dtype, device=self.device)
            self._tokenizer = self._tokenizer or tokenizer
        return self._model


def check_protocol(setting: KVSetting, paper_protocol: bool) -> None:
    """``paper_protocol`` reads the prompt under eviction: it needs an h2o-kv cache, not a press."""
    if paper_protocol and setting.press is not None:
        raise ValueError("--paper-protocol needs an h2o-kv policy: kvpress presses compress once, at prefill")
    if setting.press is not None:
        require_kvpress()


@dataclass
class Session:
    """One prompt prefilled under a setting: its cache and the logits after its last token."""

    cache: Any
    logits: torch.Tensor = field(repr=False)  # [batch, vocab]
    context_length: int
    kept: int  # KV entries per layer and KV head after the prefill, averaged over them
    press_state: Any = None


class KVRunner:
    """Prefill a prompt, extend it, generate greedily - under one :class:`~h2o_kv.harness.setting.KVSetting`."""

    def __init__(self, model, setting: KVSetting, *, paper_protocol: bool = False, tokenizer=None):
        check_protocol(setting, paper_protocol)
        if setting.reconstruct and (paper_protocol or tokenizer is None):
            raise ValueError("reconstruct: the reconstruction request needs the tokenizer and a prefill at once "
                             "(not --paper-protocol)")  # fmt: skip
        self.model = model
        self.setting = setting
        self.paper_protocol = paper_protocol
        self.reconstruction = None
        if setting.reconstruct:
            from ..hf.reconstruct import Reconstruction

            self.reconstruction = Reconstruction.for_tokenizer(tokenizer)

    @property
    def device(self) -> torch.device:
        return self.model.device

    def _tensor(self, ids: Sequence[int] | torch.Tensor) -> torch.Tensor:
        ids = torch.as_tensor(ids, dtype=torch.long, device=self.device)
        return ids.view(1, -1) if ids.dim() == 1 else ids

    @torch.no_grad()
    def prefill(self, ids: Sequence[int] | torch.Tensor) -> Session:
        """Run the prompt ``ids`` (batch 1) and compress its cache to the budget."""
        input_ids = self._tensor(ids)
        length = input_ids.shape[1]
        setting = self.setting
        if setting.press is not None:
            state = press_prefill(self.model, input_ids, setting.press, setting.entries(length))
            return Session(state.cache, state.logits, length, state.kept, press_state=state)
        stepwise = self.paper_protocol and setting.bounded  # nothing to evict: one causal forward is exact
        cache = setting.make_cache(stepwise=stepwise, config=self.model.config if setting.kv_bits else None)
        with warnings.catch_warnings():  # "budget >= prompt length": expected for short prompts, nothing to evict
            warnings.filterwarnings("ignore", message="H2OCache", category=UserWarning)
            if self.reconstruction is not None:
                from ..hf.reconstruct import prefill

                logits = prefill(self.model, cache, input_ids, self.reconstruction, setting.reconstruct)
            else:
                logits = self.model(input_ids, **cache_kwargs(cache), use_cache=True, logits_to_keep=1).logits[:, -1]
        if setting.bounded:
            cache.select_across_layers()  # an across-layers policy's selection, now that every layer has scored
            cache.stepwise = True  # from here on every token is a decode step with eviction
        return Session(cache, logits, length, mean_entries(cache))

    @torch.no_grad()
    def extend(self, session: Session, ids: torch.Tensor) -> torch.Tensor:
        """Feed ``ids`` ([batch, T]) after the session's tokens; returns logits [batch, T, vocab]."""
        ids = self._tensor(ids)
        if session.press_state is not None:
            return press_extend(self.model, session.press_state, ids)
        return self.model(ids, **cache_kwargs(session.cache), use_cache=True).logits

    def expand(self, session: Session, copies: int) -> None:
        """Repeat a batch-1 session ``copies`` times along the batch (e.g. one row per answer choice)."""
        if copies <= 1:
            return
        if session.press_state is not None:
            press_expand(self.model, session.press_state, copies)
        elif isinstance(session.cache, QuantizedCache):  # its codes cannot be repeated: a beam reorder of row 0 is
            session.cache.reorder_cache(torch.zeros(copies, dtype=torch.long))  # applied to the dequantized states
        else:
            session.cache.batch_repeat_interleave(copies)
        session.logits = session.logits.repeat_interleave(copies, dim=0)

    @torch.no_grad()
    def generate(
        self,
        ids: Sequence[int] | torch.Tensor,
        max_new_tokens: int,
        *,
        eos_ids: Sequence[int] = (),
        stop: Callable[[list[int]], bool] | None = None,
        then: Sequence[int] = (),
    ) -> tuple[list[int], Session]:
        """Greedy decoding of up to ``max_new_tokens`` tokens; stops after an EOS id or when ``stop(tokens)``.

        ``then``: tokens fed after the prompt is compressed and before decoding (a question not seen while
        compressing: decode steps, with eviction for a policy that evicts while decoding)."""
        session = self.prefill(ids)
        try:
            logits = session.logits if not len(then) else self.extend(session, torch.tensor([list(then)]))[:, -1]
            tokens: list[int] = []
            for step in range(max_new_tokens):
                token = int(logits[0].argmax())
                tokens.append(token)
                if token in eos_ids or (stop is not None and stop(tokens)) or step == max_new_tokens - 1:
                    break
                logits = self.extend(session, torch.tensor([[token]], device=self.device))[:, -1]
        finally:
            if session.press_state is not None:
                press_close(session.press_state)  # a decoding press compresses this session only
        return tokens, session


@torch.no_grad()
def score_continuations(
    runner: KVRunner, context_ids: Sequence[int], continuations: Sequence[Sequence[int]]
) -> tuple[list[tuple[float, bool]], Session]:
    """``(log p(continuation | context), is_greedy)`` for each continuation, all sharing the context's cache.

    The context is prefilled (and compressed) once; its last logits score every continuation's first token.
    The other tokens run as one batch (one row per continuation, right-padded) with eviction after every token,
    which is exactly what feeding them one at a time as decode steps would give.
    """
    if not continuations or any(len(c) == 0 for c in continuations):
        raise ValueError("every continuation needs at least one token")
    session = runner.prefill(list(context_ids))
    first = torch.log_softmax(session.logits[0].float(), dim=-1)
    logprobs = [float(first[cont[0]]) for cont in continuations]
    greedy = [int(first.argmax()) == cont[0] for cont in continuations]
    longer = [i for i, cont in enumerate(continuations) if len(cont) > 1]
    if longer:
        steps = max(len(continuations[i]) - 1 for i in longer)
        # Right padding: a pad token only follows the real tokens, so it cannot change their logits.
        batch = [
            list(continuations[i][:-1]) + [continuations[i][-1]] * (steps + 1 - len(continuations[i])) for i in longer
        ]
        runner.expand(session, len(longer))
        logp = torch.log_softmax(runner.extend(session, torch.tensor(batch, device=runner.device)).float(), dim=-1)
        for row, i in enumerate(longer):
            targets = torch.tensor(continuations[i][1:], device=runner.device)
            picked = logp[row, : len(targets)]
            logprobs[i] += float(picked.gather(-1, targets[:, None]).sum())
            greedy[i] = greedy[i] and bool((picked.argmax(-1) == targets).all())
    return list(zip(logprobs, greedy, strict=True)), session
