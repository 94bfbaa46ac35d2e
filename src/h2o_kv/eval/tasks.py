"""lm-eval-harness tasks under a KV budget: h2o-kv registered as an lm-eval model (``"h2o-kv"``).

Protocol (:class:`H2OKVLM`), for every (context, continuation) request lm-eval builds:

1. The few-shot context is the prompt: one prefill forward, after which the cache is compressed to the budget
   (``heavy = recent = floor(budget * L / 2)`` of the ``L`` context tokens, at least 1 each). The first
   continuation token is scored from the prefill's last logits, as generation would see it.
2. The rest of the continuation is scored token by token with eviction after every token, exactly as decoding
   would see it: one batched forward with ``H2OCache.stepwise = True``. All choices of a context share its
   compressed cache (the cache is repeated along the batch and the choices run as one batch).
3. ``paper_protocol=True`` reproduces the H2O paper's lm-eval protocol (Zhang et al. 2023, arXiv:2306.14048,
   Sec. 5): every context token is also processed under eviction, stepwise from the first token.

The full cache is a plain ``DynamicCache`` (the model exactly as shipped). A kvpress press (:mod:`h2o_kv.peers`)
replaces step 1's compression; kvpress never evicts after the prefill, so its continuation runs uncompressed.

The task YAMLs in ``task_configs/`` read the local files of the shared data folder (PIQA, OpenBookQA, RTE,
MathQA, HellaSwag, LAMBADA) with lm-eval's original prompts and metrics; any folder of user task YAMLs can be
added with ``include_path``. Finished requests are appended to an item log next to the result JSON, so an
interrupted run resumes without recomputing them.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..hf.compat import cache_kwargs
from ..peers import check_press, press_expand, press_extend, press_prefill, require_kvpress
from ..policies import POLICIES
from .prompts import generate_text
from .results import ItemLog, data_path, finish_result, item_log_path, sha256

TASK_CONFIG_DIR = Path(__file__).parent / "task_configs"
DEFAULT_TASKS = ("piqa", "openbookqa", "rte", "mathqa", "hellaswag", "lambada")
LM_EVAL_MODEL_NAME = "h2o-kv"


# -- the KV setting shared by tasks, xsum and needle ------------------------------------------------------------


@dataclass(frozen=True)
class KVSpec:
    """Which cache a run uses: an h2o-kv ``policy`` at a ``budget`` (or ``heavy``/``recent`` counts), or a kvpress
    ``peer`` press at the same budget. ``policy="full"`` is the uncompressed model and ignores the budget.

    Budgets are ratios of the prompt (context) length: ``heavy = recent = max(1, floor(budget * L / 2))``.
    """

    policy: str | None = "h2o"
    budget: float | None = None
    heavy: int | None = None
    recent: int | None = None
    paper_protocol: bool = False
    peer: str | None = None

    def __post_init__(self):
        if self.peer is not None:
            check_press(self.peer)
            if self.policy is not None:
                raise ValueError(f"--peer {self.peer} replaces --policy; give one of them (got --policy {self.policy})")
            if self.paper_protocol:
                raise ValueError("--paper-protocol needs an h2o-kv policy: kvpress presses compress once, at prefill")
            require_kvpress()
        elif self.policy not in POLICIES:
            raise ValueError(f"--policy must be one of {', '.join(POLICIES)}; got {self.policy!r}")
        if self.policy == "full":
            return
        counts = self.heavy is not None or self.recent is not None
        if self.budget is not None and counts:
            raise ValueError("give either --budget (a ratio) or --heavy/--recent (token counts), not both")
        if self.budget is not None:
            if isinstance(self.budget, bool) or not isinstance(self.budget, (int, float)) or not 0 < self.budget <= 1:
                raise ValueError(f"--budget must be a ratio in (0, 1] of the prompt length, got {self.budget!r}")
        elif counts:
            for label, value in (("--heavy", self.heavy), ("--recent", self.recent)):
                if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                    raise ValueError(f"{label} must be an integer >= 0 (give both --heavy and --recent), got {value!r}")
            if self.heavy + self.recent == 0:
                raise ValueError("--heavy + --recent must be >= 1: a cache that keeps nothing cannot generate")
        else:
            raise ValueError(f"{self.label} needs --budget (a ratio in (0, 1]) or --heavy and --recent")

    @property
    def label(self) -> str:
        """Row name in reports: the policy, or ``kvpress:<press>`` for a peer."""
        return f"kvpress:{self.peer}" if self.peer else str(self.policy)

    @property
    def protocol(self) -> str:
        return "paper" if self.paper_protocol else "prefill"

    def split(self, length: int) -> tuple[int, int]:
        """(heavy, recent) for an ``length``-token prompt."""
        if self.budget is not None:
            half = max(1, math.floor(self.budget * length / 2))
            return half, half
        return self.heavy, self.recent

    def fields(self) -> dict[str, Any]:
        """The result-file fields describing this setting (``policy``, ``budget``, ``heavy``, ``recent``, ``peer``)."""
        full = self.policy == "full"
        return {
            "policy": self.label,
            "budget": 1.0 if full else self.budget,
            "heavy": None if full else self.heavy,
            "recent": None if full else self.recent,
            "peer": self.peer is not None,
            "protocol": self.protocol,
        }


def make_spec(
    policy: str | None = None,
    budget: float | None = None,
    heavy: int | None = None,
    recent: int | None = None,
    *,
    paper_protocol: bool = False,
    peer: str | None = None,
) -> KVSpec:
    """A :class:`KVSpec` from command-line options: ``--policy`` defaults to ``h2o`` unless ``--peer`` is given."""
    if policy is None and peer is None:
        policy = "h2o"
    return KVSpec(policy, budget, heavy, recent, paper_protocol, peer)


@dataclass
class Session:
    """One prompt prefilled under a :class:`KVSpec`: its cache and the logits after its last token."""

    cache: Any
    logits: torch.Tensor = field(repr=False)  # [batch, vocab]
    context_length: int
    kept: int  # KV entries per layer and head after the prefill
    press_state: Any = None


class KVRunner:
    """Prefill a prompt, extend it, generate greedily - under one :class:`KVSpec` (h2o-kv policy, full, or press).

    ``extend`` processes a chunk exactly as token-by-token decoding would (``H2OCache.stepwise``), in one forward.
    """

    def __init__(self, model, spec: KVSpec):
        self.model = model
        self.spec = spec

    @property
    def device(self) -> torch.device:
        return self.model.device

    def _tensor(self, ids: Sequence[int] | torch.Tensor) -> torch.Tensor:
        ids = torch.as_tensor(ids, dtype=torch.long, device=self.device)
        return ids.view(1, -1) if ids.dim() == 1 else ids

    @torch.no_grad()
    def prefill(self, ids: Sequence[int] | torch.Tensor) -> Session:
        """Run the prompt ``ids`` (batch 1) and compress its cache to the budget."""
        from transformers import DynamicCache

        from ..hf.cache import H2OCache

        input_ids = self._tensor(ids)
        length = input_ids.shape[1]
        spec = self.spec
        if spec.peer is not None:
            state = press_prefill(
                self.model, input_ids, spec.peer, budget=spec.budget, heavy=spec.heavy, recent=spec.recent
            )
            return Session(state.cache, state.logits, length, state.kept, press_state=state)
        if spec.policy == "full":
            cache = DynamicCache()
            out = self.model(input_ids, **cache_kwargs(cache), use_cache=True, logits_to_keep=1)
            return Session(cache, out.logits[:, -1], length, length)
        heavy, recent = spec.split(length)
        cache = H2OCache(heavy=heavy, recent=recent, policy=spec.policy, stepwise=spec.paper_protocol)
        with warnings.catch_warnings():  # "budget >= prompt length": expected for short prompts, nothing to evict
            warnings.filterwarnings("ignore", message="H2OCache budget", category=UserWarning)
            out = self.model(input_ids, **cache_kwargs(cache), use_cache=True, logits_to_keep=1)
        cache.stepwise = True  # from here on every token is a decode step with eviction
        kept = int(cache.layers[0].entry_count().max()) if cache.layers else 0
        return Session(cache, out.logits[:, -1], length, kept)

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
            press_expand(session.press_state, copies)
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
    ) -> tuple[list[int], Session]:
        """Greedy decoding of up to ``max_new_tokens`` tokens; stops after an EOS id or when ``stop(tokens)``."""
        session = self.prefill(ids)
        logits = session.logits
        tokens: list[int] = []
        for step in range(max_new_tokens):
            token = int(logits[0].argmax())
            tokens.append(token)
            if token in eos_ids or (stop is not None and stop(tokens)) or step == max_new_tokens - 1:
                break
            logits = self.extend(session, torch.tensor([[token]], device=self.device))[:, -1]
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


# -- the lm-eval model --------------------------------------------------------------------------------------------


def _key(*parts: Any) -> str:
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:32]


def _register(cls):
    try:
        from lm_eval.api.registry import register_model
    except ImportError:  # lm-eval not installed: the class still works as a plain object
        return cls
    try:
        return register_model(LM_EVAL_MODEL_NAME)(cls)
    except (AssertionError, ValueError):  # already registered (module reloaded)
        return cls


def _template_lm():
    try:
        from lm_eval.api.model import TemplateLM
    except ImportError as err:
        raise ImportError("h2o-kv eval tasks needs lm-eval: pip install 'h2o-kv[eval]'") from err
    return TemplateLM


try:
    _Base = _template_lm()
except ImportError:  # keep the module importable (KVSpec/KVRunner are used by xsum and needle)
    _Base = object


@_register
class H2OKVLM(_Base):
    """An lm-eval model that scores and generates under a KV budget (see the module docstring for the protocol).

    Pass a loaded ``model``/``tokenizer`` (``h2o_kv.load_model()``), or ``pretrained`` (a name or directory for
    :func:`h2o_kv.load_model`) when lm-eval builds it from ``--model h2o-kv --model_args pretrained=..,policy=h2o,
    budget=0.2``. ``item_log`` (a path) makes a run resumable.
    """

    backend = "causal"

    def __init__(
        self,
        pretrained: str | None = None,
        *,
        model=None,
        tokenizer=None,
        policy: str | None = "h2o",
        budget: float | None = None,
        heavy: int | None = None,
        recent: int | None = None,
        paper_protocol: bool = False,
        peer: str | None = None,
        dtype: str | None = None,
        device: str | None = None,
        item_log: str | Path | None = None,
        model_name: str | None = None,
        progress: Callable[[int], None] | None = None,
        **_lm_eval_options,  # batch_size, max_batch_size: choices are batched per context anyway
    ):
        if _Base is object:
            _template_lm()
        super().__init__()
        self.spec = KVSpec(
            policy=None if peer else policy, budget=budget, heavy=heavy, recent=recent,
            paper_protocol=bool(paper_protocol), peer=peer,
        )  # fmt: skip
        if model is None:
            from ..models import load_model

            model, loaded_tokenizer = load_model(pretrained, dtype=dtype, device=device)
            tokenizer = tokenizer or loaded_tokenizer
        if tokenizer is None:
            raise ValueError("H2OKVLM needs a tokenizer (the model directory has none; pass tokenizer=...)")
        self.model, self.tokenizer = model, tokenizer
        self.runner = KVRunner(model, self.spec)
        self.model_name = model_name or str(pretrained or getattr(model.config, "name_or_path", "model"))
        from ..models import model_context_length

        self.max_length = model_context_length(model)
        self.progress = progress
        self.log = None
        if item_log is not None:
            settings = {"model": self.model_name, **asdict(self.spec), "max_length": self.max_length}
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
        bar = tqdm(groups.items(), total=len(groups), desc=f"{self.spec.label} loglikelihood", disable=disable_tqdm)
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
        for request in tqdm(requests, desc=f"{self.spec.label} generate", disable=disable_tqdm):
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


# -- tasks: resolution, checks and the run ------------------------------------------------------------------------


def task_manager(include_path: Sequence[str | Path] | str | Path | None = None):
    """lm-eval's TaskManager over h2o-kv's local task YAMLs plus the user's ``include_path`` folders.

    lm-eval's built-in tasks are not indexed: they download their data from the Hugging Face Hub.
    """
    from lm_eval.tasks import TaskManager

    paths = [TASK_CONFIG_DIR]
    if include_path:
        extra = [include_path] if isinstance(include_path, (str, Path)) else list(include_path)
        for path in map(Path, extra):
            if not path.is_dir():
                raise FileNotFoundError(f"--include-path {path} is not a folder of task YAMLs")
        paths += [Path(p) for p in extra]
    return TaskManager(include_path=[str(p) for p in paths], include_defaults=False)


def parse_tasks(tasks: str | Sequence[str]) -> list[str]:
    names = [t.strip() for t in (tasks.split(",") if isinstance(tasks, str) else tasks) if t.strip()]
    if not names:
        raise ValueError("--tasks is empty; give a comma-separated list, e.g. piqa,openbookqa")
    return list(dict.fromkeys(names))


def _task_files(name: str, manager) -> list[str]:
    """Shared data files read by one of h2o-kv's own task YAMLs (none for a user task)."""
    entry = manager.task_index.get(name)
    if entry is None or entry.yaml_path is None or Path(entry.yaml_path).parent.resolve() != TASK_CONFIG_DIR.resolve():
        return []
    return list(TASK_FILES.get(name, []))


TASK_FILES = {
    "piqa": ["piqa/dev.jsonl", "piqa/dev-labels.lst"],
    "openbookqa": ["openbookqa/test.tsv"],
    "rte": ["rte/val.jsonl"],
    "mathqa": ["mathqa/math_qa.jsonl"],
    "hellaswag": ["hellaswag/hellaswag_val_subset1000.jsonl"],
    "lambada": ["lambada/lambada_test.jsonl"],
}


def _quiet() -> None:
    """Silence lm-eval's and datasets' per-task chatter (warnings about custom datasets, map progress bars)."""
    for name in ("lm_eval", "lm-eval", "datasets"):
        logging.getLogger(name).setLevel(logging.ERROR)
    import datasets

    datasets.disable_progress_bars()


def check_tasks(names: Sequence[str], manager) -> dict[str, Any]:
    """Load every task (this reads its data files) so that a bad name or file fails before the model runs."""
    unknown = [name for name in names if name not in manager.all_tasks]
    if unknown:
        raise ValueError(
            f"unknown task(s) {', '.join(unknown)}; available: {', '.join(manager.all_tasks)} "
            "(add a folder of task YAMLs with --include-path)"
        )
    _quiet()
    try:
        return manager.load(list(names))["tasks"]
    except (FileNotFoundError, ValueError):
        raise
    except Exception as err:  # lm-eval wraps YAML and loader errors in assorted types
        raise ValueError(f"cannot load task(s) {', '.join(names)}: {type(err).__name__}: {err}") from err


@dataclass
class TasksJob:
    """Everything ``h2o-kv eval tasks`` needs, validated by :meth:`create` before the model is loaded."""

    tasks: list[str]
    spec: KVSpec
    num_fewshot: int
    limit: int | None
    include_path: list[Path]
    seed: int = 1234
    manager: Any = field(default=None, repr=False)

    @classmethod
    def create(
        cls,
        tasks: str | Sequence[str],
        spec: KVSpec,
        *,
        num_fewshot: int = 5,
        limit: int | None = None,
        include_path: Sequence[str | Path] | str | Path | None = None,
        seed: int = 1234,
    ) -> TasksJob:
        """Check the options, the task names and their data files (raises ``ValueError``/``FileNotFoundError``)."""
        if isinstance(num_fewshot, bool) or not isinstance(num_fewshot, int) or num_fewshot < 0:
            raise ValueError(f"--num-fewshot must be an integer >= 0, got {num_fewshot!r}")
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
            raise ValueError(f"--limit must be an integer >= 1, got {limit!r}")
        names = parse_tasks(tasks)
        if include_path is None:
            extra = []
        else:
            extra = [include_path] if isinstance(include_path, (str, Path)) else list(include_path)
        manager = task_manager(extra)
        check_tasks(names, manager)
        return cls(names, spec, num_fewshot, limit, [Path(p) for p in extra], seed, manager)

    @property
    def label(self) -> str:
        """Report group: results that share it form one table (rows policy, columns budget)."""
        tasks = "" if tuple(self.tasks) == DEFAULT_TASKS else f" {','.join(self.tasks)}"
        limit = "" if self.limit is None else f", limit {self.limit}"
        return f"lm-eval{tasks} {self.num_fewshot}-shot, {self.spec.protocol} protocol{limit}"

    def data(self) -> dict[str, Any]:
        """Checksums of the data files behind the tasks (user tasks: their YAML files)."""
        files: dict[str, str] = {}
        for name in self.tasks:
            relative = _task_files(name, self.manager)
            for item in relative:
                files[item] = sha256(data_path(item))
            entry = self.manager.task_index.get(name)
            if not relative and entry is not None and entry.yaml_path is not None:
                files[str(entry.yaml_path)] = sha256(entry.yaml_path)
        combined = hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest()
        return {"name": ",".join(self.tasks), "sha256": combined, "files": files}


def _metric(values: dict[str, Any], name: str) -> float | None:
    value = values.get(f"{name},none")
    return float(value) if isinstance(value, (int, float)) and math.isfinite(value) else None


def run_tasks(
    job: TasksJob,
    model,
    tokenizer,
    json_path: str | Path | None = None,
    *,
    model_name: str,
    extra: dict[str, Any] | None = None,
    progress: Callable[[int], None] | None = None,
    keep_item_log: bool = False,
) -> dict[str, Any]:
    """Run the tasks through lm-eval's ``simple_evaluate`` with :class:`H2OKVLM`; write and return the record.

    ``metrics`` holds ``<task>_acc``, ``<task>_acc_stderr``, ``<task>_acc_norm`` (where lm-eval defines them),
    LAMBADA's ``perplexity``, and ``mean_acc`` over the tasks; ``items`` the per-item accuracies (for paired
    comparisons between policies on the same items). Interrupted runs resume from ``<json>.items.jsonl``.
    """
    import time

    from lm_eval import simple_evaluate

    _quiet()
    log_path = item_log_path(json_path) if json_path is not None else None
    spec = job.spec
    lm = H2OKVLM(
        model=model, tokenizer=tokenizer, policy=spec.policy, budget=spec.budget, heavy=spec.heavy,
        recent=spec.recent, paper_protocol=spec.paper_protocol, peer=spec.peer, item_log=log_path,
        model_name=model_name, progress=progress,
    )  # fmt: skip
    start = time.time()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = simple_evaluate(
            model=lm, tasks=list(job.tasks), num_fewshot=job.num_fewshot, limit=job.limit,
            task_manager=job.manager, bootstrap_iters=1000, log_samples=True, fewshot_random_seed=job.seed,
            random_seed=job.seed, numpy_random_seed=job.seed, torch_random_seed=job.seed,
        )  # fmt: skip
    elapsed = time.time() - start
    metrics: dict[str, Any] = {}
    per_task: dict[str, Any] = {}
    items: dict[str, Any] = {}
    for name in job.tasks:
        values = out["results"][name]
        row = {"n": int(out["n-samples"][name]["effective"])}
        for metric in ("acc", "acc_norm", "perplexity"):
            value = _metric(values, metric)
            if value is None:
                continue
            row[metric] = value
            stderr = _metric(values, f"{metric}_stderr")
            if stderr is not None:
                row[f"{metric}_stderr"] = stderr
        per_task[name] = row
        metrics.update({f"{name}_{key}": value for key, value in row.items() if key != "n"})
        samples = sorted(out["samples"][name], key=lambda s: s["doc_id"])
        items[name] = {
            metric: [float(s[metric]) for s in samples]
            for metric in ("acc", "acc_norm")
            if samples and metric in samples[0]
        }
    accs = [row["acc"] for row in per_task.values() if "acc" in row]
    if accs:
        metrics["mean_acc"] = sum(accs) / len(accs)
        errors = [row.get("acc_stderr") for row in per_task.values() if "acc" in row]
        if all(e is not None for e in errors):
            metrics["mean_acc_stderr"] = math.sqrt(sum(e * e for e in errors)) / len(errors)
    fields = {
        **spec.fields(),
        "label": job.label,
        "model": model_name,
        "primary_metric": "mean_acc",
        "tasks": per_task,
        "num_fewshot": job.num_fewshot,
        "limit": job.limit,
        "kv_kept_ratio": sum(lm.kept_fraction) / len(lm.kept_fraction) if lm.kept_fraction else None,
        "settings": {
            "tasks": job.tasks,
            "num_fewshot": job.num_fewshot,
            "limit": job.limit,
            "include_path": [str(p) for p in job.include_path],
            "fewshot_seed": job.seed,
            "protocol": spec.protocol,
            "budget_of": "context length (heavy = recent = max(1, floor(budget * L / 2)))",
        },
        "data": job.data(),
        "items": items,
        "time_s": round(elapsed, 1),
        **(extra or {}),
    }
    return finish_result(json_path, "tasks", metrics, fields, keep_item_log=keep_item_log)


def summary_lines(record: dict[str, Any]) -> list[str]:
    """Per-task lines for the terminal: acc (and acc_norm, perplexity) with standard errors."""
    lines = []
    for name, row in record["tasks"].items():
        parts = [f"{name:<12} n={row['n']:<5}"]
        for metric in ("acc", "acc_norm", "perplexity"):
            if metric in row:
                parts.append(f"{metric} {row[metric]:.4f} ± {row.get(metric + '_stderr', float('nan')):.4f}")
        lines.append("  ".join(parts))
    if "mean_acc" in record["metrics"]:
        lines.append(f"mean acc {record['metrics']['mean_acc']:.4f}  ({record['policy']}, budget {record['budget']})")
    return lines


# -- `h2o-kv eval sweep --kind tasks|xsum|needle`: options arrive as strings from the command line -------------


def option_int(options: dict[str, Any], name: str, default: int | None = None) -> int | None:
    value = options.get(name, default)
    if value is None or (isinstance(value, int) and not isinstance(value, bool)):
        return value
    try:
        return int(value)
    except (TypeError, ValueError):
        raise ValueError(f"--{name.replace('_', '-')} must be an integer, got {value!r}") from None


def check_options(kind: str, options: dict[str, Any], allowed: set[str]) -> None:
    unknown = sorted(set(options) - allowed)
    if unknown:
        names = ", ".join("--" + u.replace("_", "-") for u in unknown)
        raise ValueError(f"--kind {kind} does not take {names}; it takes {', '.join(sorted(allowed))}")


def cell_spec(policy: str, budget: float, paper_protocol: bool = False) -> KVSpec:
    """The KV setting of one sweep cell (``full`` ignores the budget)."""
    return KVSpec(policy, None if policy == "full" else budget, paper_protocol=paper_protocol)


_TASK_OPTIONS = {"tasks", "include_path", "num_fewshot", "limit", "paper_protocol"}


def _sweep_prepare(options: dict[str, Any], models) -> dict[str, Any]:
    check_options("tasks", options, _TASK_OPTIONS)
    include = options.get("include_path")
    settings = {
        "tasks": options.get("tasks", ",".join(DEFAULT_TASKS)),
        "num_fewshot": option_int(options, "num_fewshot", 5),
        "limit": option_int(options, "limit"),
        "include_path": None if include in (None, True) else include,
        "paper_protocol": bool(options.get("paper_protocol", False)),
    }
    TasksJob.create(settings["tasks"], KVSpec("full"), **{k: settings[k] for k in ("num_fewshot", "limit")},
                    include_path=settings["include_path"])  # fmt: skip
    return settings


def _sweep_job(settings: dict[str, Any], policy: str, budget: float) -> TasksJob:
    spec = cell_spec(policy, budget, settings["paper_protocol"])
    return TasksJob.create(
        settings["tasks"], spec, num_fewshot=settings["num_fewshot"], limit=settings["limit"],
        include_path=settings["include_path"],
    )  # fmt: skip


def _sweep_run(settings, policy, budget, path, models, progress):
    job = _sweep_job(settings, policy, budget)
    return run_tasks(job, models.model(), models.tokenizer(), path, model_name=models.label, progress=progress)


def _register_sweep_kind() -> None:
    from .sweep import SweepKind, register_kind

    check = lambda settings, policy, budget: cell_spec(policy, budget, settings["paper_protocol"])  # noqa: E731
    register_kind(SweepKind("tasks", _sweep_prepare, _sweep_run, check, "lm-eval tasks (h2o-kv eval tasks)"))


_register_sweep_kind()
