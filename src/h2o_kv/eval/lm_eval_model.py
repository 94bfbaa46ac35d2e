"""lm-eval-harness's model interface for h2o-kv: :class:`H2OKVLM`, registered with lm-eval as ``"h2o-kv"``.

Protocol, for every (context, continuation) request lm-eval builds (:mod:`h2o_kv.eval.runner` does the work):

1. The few-shot context is the prompt: one prefill forward, after which the cache is compressed to the budget
   (:meth:`~h2o_kv.Budget.entries` of the context length). The first continuation token is scored from the
   prefill's last logits, as generation would see it.
2. The rest of the continuation is scored token by token with eviction after every token, exactly as decoding
   would see it (one batched forward, ``H2OCache.stepwise``). All choices of a context share its compressed cache
   (the cache is repeated along the batch and the choices run as one batch).
3. ``paper_protocol=True`` reproduces the H2O paper's lm-eval protocol (Zhang et al. 2023, arXiv:2306.14048,
   Sec. 5): every context token is also processed under eviction, stepwise from the first token.

Finished requests are appended to an item log (``item_log``), so an interrupted run resumes without recomputing them.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model

from ..harness.setting import KVSetting
from .options import kv_setting
from .prompts import generate_text
from .results import ItemLog
from .runner import KVRunner, score_continuations

LM_EVAL_MODEL_NAME = "h2o-kv"


def _key(*parts: Any) -> str:
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:32]


def _register(cls):
    try:
        return register_model(LM_EVAL_MODEL_NAME)(cls)
    except (AssertionError, ValueError):  # already registered (module reloaded)
        return cls


@_register
class H2OKVLM(TemplateLM):
    """An lm-eval model that scores and generates under a KV budget (see the module docstring for the protocol).

    Pass a loaded ``model``/``tokenizer`` (``h2o_kv.load_model()``), or ``pretrained`` (a name or directory for
    :func:`h2o_kv.load_model`) when lm-eval builds it from ``--model h2o-kv --model_args pretrained=..,policy=h2o,
    budget=0.2``. The KV setting is ``setting`` (a :class:`~h2o_kv.harness.setting.KVSetting`)
    or the options ``policy``,
    ``peer`` (a kvpress press), ``budget``/``heavy``/``recent`` as on the command line. ``item_log`` (a path) makes a
    run resumable.
    """

    backend = "causal"

    def __init__(
        self,
        pretrained: str | None = None,
        *,
        model=None,
        tokenizer=None,
        setting: KVSetting | None = None,
        policy: str | None = None,
        budget: float | None = None,
        heavy: int | None = None,
        recent: int | None = None,
        peer: str | None = None,
        paper_protocol: bool = False,
        dtype: str | None = None,
        device: str | None = None,
        item_log: str | Path | None = None,
        model_name: str | None = None,
        progress: Callable[[int], None] | None = None,
        **_lm_eval_options,  # batch_size, max_batch_size: choices are batched per context anyway
    ):
        super().__init__()
        if setting is None:
            setting = kv_setting(policy, budget, heavy, recent, peer)
        if model is None:
            from ..models import load_model

            model, loaded_tokenizer = load_model(pretrained, dtype=dtype, device=device)
            tokenizer = tokenizer or loaded_tokenizer
        if tokenizer is None:
            raise ValueError("H2OKVLM needs a tokenizer (the model directory has none; pass tokenizer=...)")
        self.model, self.tokenizer = model, tokenizer
        self.runner = KVRunner(model, setting, paper_protocol=bool(paper_protocol), tokenizer=tokenizer)
        self.setting = setting
        self.model_name = model_name or str(pretrained or getattr(model.config, "name_or_path", "model"))
        from ..models import model_context_length

        self.max_length = model_context_length(model)
        self.progress = progress
        self.log = None
        if item_log is not None:
            settings = {"model": self.model_name, **setting.fields(), "paper_protocol": bool(paper_protocol),
                        "max_length": self.max_length}  # fmt: skip
            self.log = ItemLog(item_log, settings)
        self.kept_fraction: list[float] = []  # KV entries kept / context tokens, per scored context

    # -- TemplateLM contract ------------------------------------------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def device(self):
        return self.model.device

    @property
    def tokenizer_name(self) -> str:
        return getattr(self.tokenizer, "name_or_path", "tokenizer").replace("/", "__")

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        return self.tokenizer.encode(string, add_special_tokens=bool(add_special_tokens))

    def tok_decode(self, tokens: Sequence[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=False)

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        """Score ``((context, continuation), context_ids, continuation_ids)`` requests, grouped by context."""
        from tqdm import tqdm

        results: list[tuple[float, bool] | None] = [None] * len(requests)
        groups: dict[tuple[int, ...], list[tuple[int, list[int], str]]] = {}
        for index, (_, context_ids, continuation_ids) in enumerate(requests):
            context_ids, continuation_ids = self._truncate(context_ids, continuation_ids)
            key = _key(context_ids, continuation_ids)
            if self.log is not None and key in self.log:
                row = self.log.done[key]
                results[index] = (row["logprob"], row["greedy"])
                continue
            groups.setdefault(tuple(context_ids), []).append((index, continuation_ids, key))
        bar = tqdm(groups.items(), total=len(groups), desc=f"{self.setting.name} loglikelihood", disable=disable_tqdm)
        for context_ids, items in bar:
            scores = self.score_continuations(list(context_ids), [cont for _, cont, _ in items])
            for (index, _, key), (logprob, greedy) in zip(items, scores, strict=True):
                results[index] = (logprob, greedy)
                if self.log is not None:
                    self.log.add(key, logprob=logprob, greedy=greedy)
                self.cache_hook.add_partial("loglikelihood", requests[index][0], (logprob, greedy))
            if self.progress is not None:
                self.progress(1)
        return results  # type: ignore[return-value]

    def _truncate(self, context_ids: list[int], continuation_ids: list[int]) -> tuple[list[int], list[int]]:
        """Keep the last tokens of the context so that context + continuation fit the model (as HFLM does)."""
        if not continuation_ids:
            raise ValueError("lm-eval produced an empty continuation")
        continuation_ids = continuation_ids[-self.max_length :]
        room = max(1, self.max_length - len(continuation_ids) + 1)
        return list(context_ids[-room:]), list(continuation_ids)

    def score_continuations(self, context_ids: list[int], continuations: list[list[int]]) -> list[tuple[float, bool]]:
        """Log-probability and greedy-match of each continuation after ``context_ids`` under the KV setting."""
        scores, session = score_continuations(self.runner, context_ids, continuations)
        self.kept_fraction.append(session.kept / session.context_length)
        return scores

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Rolling log-likelihood of whole texts (lm-eval's disjoint windows), each window under the KV setting."""
        from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

        flat, owners = [], []
        for number, (string,) in enumerate(req.args for req in requests):
            windows = get_rolling_token_windows(
                token_list=self.tok_encode(string), prefix_token=self.prefix_token_id,
                max_seq_len=self.max_length, context_len=1,
            )  # fmt: skip
            for context_ids, continuation_ids in map(make_disjoint_window, windows):
                flat.append(((None, None), context_ids, continuation_ids))
                owners.append(number)
        scores = self._loglikelihood_tokens(flat, disable_tqdm=disable_tqdm)
        totals = [0.0] * len(requests)
        for owner, (logprob, _) in zip(owners, scores, strict=True):
            totals[owner] += logprob
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Greedy generation under the KV setting, cut at the first ``until`` string."""
        from tqdm import tqdm

        outputs = []
        for request in tqdm(requests, desc=f"{self.setting.name} generate", disable=disable_tqdm):
            context, options = request.args
            options = dict(options or {})
            until = options.pop("until", None) or [self.tok_decode([self.eot_token_id])]
            until = [until] if isinstance(until, str) else list(until)
            max_new = int(options.pop("max_gen_toks", 256))
            key = _key("generate", context, until, max_new)
            if self.log is not None and key in self.log:
                outputs.append(self.log.done[key]["text"])
                continue
            context_ids = self.tok_encode(context)[-(self.max_length - max_new) :]
            text = self.generate_text(context_ids, max_new, until)
            if self.log is not None:
                self.log.add(key, text=text)
            self.cache_hook.add_partial("generate_until", (context, request.args[1]), text)
            outputs.append(text)
        return outputs

    def generate_text(self, context_ids: list[int], max_new_tokens: int, until: Sequence[str]) -> str:
        """Greedy continuation of ``context_ids``, cut before the first ``until`` string."""
        text, session = generate_text(
            self.runner, self.tokenizer, context_ids, max_new_tokens, until=until, eos_ids=[self.eot_token_id]
        )
        self.kept_fraction.append(session.kept / session.context_length)
        return text
