"""RULER-style synthetic long-context tasks under a KV budget (Hsieh et al. 2024, "RULER: What's the Real Context
Size of Your Long-Context Language Models?", arXiv:2404.06654), generated locally from a seed: nothing is
downloaded, and the same seed gives the same items, token for token.

Tasks (RULER's definitions, scaled to a 135M model's 1k-4k context):

* ``niah_single`` - one needle "One of the special magic numbers for {key} is: {value}." in the haystack;
  ``niah_multikey`` - four needles with distinct keys, one asked; ``niah_multivalue`` - four values for one key,
  all asked; ``niah_multiquery`` - four keys, all asked. Keys are two haystack words, values 7-digit numbers.
* ``vt`` (variable tracking) - a chain ``VAR A = 12345``, ``VAR B = VAR A``, ... (4 hops) spread over the
  haystack; every variable of the chain is asked.
* ``cwe`` (common words) - a numbered word list where 10 words appear far more often than the others; the 10 are
  asked. ``fwe`` (frequent words) - a coded text of made-up words drawn from a Zipf law (exponent 2); the three
  most frequent are asked.

The haystack is the Paul Graham essays of the needle test (:mod:`h2o_kv.eval.needle`), from a random offset per
item; the word pool is the haystack's distinct lower-case words. Each item's prompt is about ``length`` tokens.

Two protocols (as kvpress reports them): ``question_after`` - the context is prefilled and compressed to the
budget without the question, which then follows as decode steps (a policy that evicts while decoding keeps
evicting); ``question_in_prompt`` - context and question are one prompt, compressed at once. The budget is a ratio
of the tokens compressed. The answer starts with RULER's answer prefix (after the chat template's generation
prompt); decoding is greedy and stops at EOS, at the task's token limit, or as soon as the answer holds every
expected string (the score cannot change after that: it only counts what is present). Score (RULER's
``string_match_all``): the fraction of the expected strings found in the answer, case-insensitive; a task's score
is the mean over its items, the suite's the mean over tasks.
"""

from __future__ import annotations

import hashlib
import random
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..harness.data import sha256
from ..harness.setting import KVSetting
from ..harness.tables import average, mean
from .needle import HAYSTACK_DIR, haystack_files, parse_ints
from .options import check_options, option_int
from .prompts import has_chat_template
from .results import ItemLog, finish_result, item_log_path
from .runner import KVRunner
from .server import ServerRunner, server_field

TASKS = ("niah_single", "niah_multikey", "niah_multivalue", "niah_multiquery", "vt", "cwe", "fwe")
PROTOCOLS = ("question_after", "question_in_prompt")
MAX_NEW_TOKENS = {"niah_single": 16, "niah_multikey": 16, "niah_multivalue": 40, "niah_multiquery": 40, "vt": 32,
                  "cwe": 48, "fwe": 24}  # fmt: skip
NEEDLES = 4  # needles of the multi-key/value/query tasks
HOPS = 4  # variable tracking: assignments after the first
COMMON = 10  # common words extraction: words asked
ZIPF = 2.0  # frequent words extraction: exponent

NIAH_INTRO = (
    "Some special magic numbers are hidden within the following text. Make sure to memorize it. "
    "I will quiz you about the numbers afterwards.\n"
)
NIAH_NEEDLE = "One of the special magic numbers for {key} is: {value}."
VT_INTRO = "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n"
CWE_INTRO = (
    "Below is a numbered list of words. In these words, some appear more often than others. "
    "Memorize the ones that appear most often.\n"
)
FWE_INTRO = "Read the following coded text and track the frequency of each coded word. Find the three most " \
    "frequently appeared coded words.\n"  # fmt: skip


@dataclass(frozen=True)
class RulerItem:
    """One generated item: the context (compressed first under ``question_after``), the question, RULER's answer
    prefix and the strings a correct answer holds."""

    task: str
    length: int
    index: int
    context: str
    question: str
    answer_prefix: str
    answers: tuple[str, ...]

    @property
    def key(self) -> str:
        return f"{self.task}:{self.length}:{self.index}"


def score_answer(answer: str, expected: Sequence[str]) -> float:
    """RULER's ``string_match_all``: the fraction of ``expected`` strings in ``answer`` (case-insensitive)."""
    text = answer.lower()
    return sum(e.lower() in text for e in expected) / len(expected)


class Generator:
    """Makes the items of one seed from a haystack text, measuring lengths with ``tokenizer``."""

    def __init__(self, tokenizer, haystack: str, seed: int):
        self.tokenizer, self.seed = tokenizer, seed
        # the haystack is longer than the context on purpose (prompts are cut from it): no length warning
        self.haystack_ids = tokenizer.encode(haystack, add_special_tokens=False, verbose=False)
        self.words = sorted({w for w in re.findall(r"\b[a-z]{4,10}\b", haystack)})

    def tokens(self, text: str) -> int:
        return len(self.tokenizer.encode(text, add_special_tokens=False))

    def item(self, task: str, length: int, index: int) -> RulerItem:
        if task not in TASKS:
            raise ValueError(f"task must be one of {', '.join(TASKS)}; got {task!r}")
        rng = random.Random(f"{self.seed}:{task}:{length}:{index}")  # a str seed: the same stream on every run
        return getattr(self, "_" + task.split("_")[0])(rng, task, length, index)

    # -- pieces -------------------------------------------------------------------------------------------------
    def _key(self, rng: random.Random, taken: set[str]) -> str:
        while True:
            key = f"{rng.choice(self.words)}-{rng.choice(self.words)}"
            if key not in taken:
                taken.add(key)
                return key

    @staticmethod
    def _number(rng: random.Random, taken: set[str]) -> str:
        while True:
            value = str(rng.randint(1_000_000, 9_999_999))
            if value not in taken:
                taken.add(value)
                return value

    def _haystack(self, rng: random.Random, insert: Sequence[str], budget: int) -> str:
        """``budget`` tokens of haystack from a random offset, the ``insert`` sentences at random sentence ends
        in their order."""
        budget = max(budget, 16)
        start = rng.randrange(0, len(self.haystack_ids) - budget)
        text = self.tokenizer.decode(self.haystack_ids[start : start + budget])
        ends = [m.end() for m in re.finditer(r"[.!?]\s", text)] or [len(text)]
        at = sorted(rng.choice(ends) for _ in insert)
        pieces, last = [], 0
        for where, sentence in zip(at, insert, strict=True):
            pieces += [text[last:where], sentence + " "]
            last = where
        return "".join([*pieces, text[last:]]).strip()

    def _fit(self, make: Callable[[int], tuple[str, str, str]], length: int) -> tuple[str, str, str]:
        """``make(filler)`` for the filler size whose prompt is closest to ``length`` tokens (two corrections)."""
        filler = length
        for _ in range(3):
            parts = make(filler)
            total = sum(self.tokens(p) for p in parts) + 40  # chat template and separators
            filler = max(16, filler - (total - length))
        return make(filler)

    # -- tasks --------------------------------------------------------------------------------------------------
    def _niah(self, rng: random.Random, task: str, length: int, index: int) -> RulerItem:
        keys: set[str] = set()
        values: set[str] = set()
        count = 1 if task == "niah_single" else NEEDLES
        if task == "niah_multivalue":
            key = self._key(rng, keys)
            needles = [(key, self._number(rng, values)) for _ in range(count)]
        else:
            needles = [(self._key(rng, keys), self._number(rng, values)) for _ in range(count)]
        rng.shuffle(needles)
        asked = [k for k, _ in needles] if task == "niah_multiquery" else [needles[0][0]]
        answers = tuple(v for k, v in needles if k in asked)
        sentences = [NIAH_NEEDLE.format(key=k, value=v) for k, v in needles]
        query = asked[0] if len(asked) == 1 else ", ".join(asked[:-1]) + " and " + asked[-1]
        question = f"What are all the special magic numbers for {query} mentioned in the provided text?"
        prefix = f"The special magic numbers for {query} mentioned in the provided text are"
        state = rng.getstate()

        def make(filler: int):
            rng.setstate(state)
            return NIAH_INTRO + self._haystack(rng, sentences, filler), question, prefix

        context, question, prefix = self._fit(make, length)
        return RulerItem(task, length, index, context, question, prefix, answers)

    def _vt(self, rng: random.Random, task: str, length: int, index: int) -> RulerItem:
        names: set[str] = set()
        while len(names) < HOPS + 1:
            names.add("".join(rng.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZ") for _ in range(5)))
        chain = rng.sample(sorted(names), HOPS + 1)
        value = str(rng.randint(10_000, 99_999))
        sentences = [f"VAR {chain[0]} = {value}."] + [f"VAR {chain[i + 1]} = VAR {chain[i]}." for i in range(HOPS)]
        question = f"Question: Find all variables that are assigned the value {value} in the text above."
        prefix = (
            f"Answer: According to the chain(s) of variable assignment in the text above, {HOPS + 1} variables are "
            f"assigned the value {value}, they are:"
        )
        state = rng.getstate()

        def make(filler: int):
            rng.setstate(state)
            return VT_INTRO + self._haystack(rng, sentences, filler), question, prefix

        context, question, prefix = self._fit(make, length)
        return RulerItem(task, length, index, context, question, prefix, tuple(chain))

    def _cwe(self, rng: random.Random, task: str, length: int, index: int) -> RulerItem:
        question = f"Question: What are the {COMMON} most common words in the above list?"
        prefix = f"Answer: The top {COMMON} words that appear most often in the list are:"
        state = rng.getstate()
        chosen: list[str] = []

        def make(filler: int):
            rng.setstate(state)
            entries = max(4 * COMMON, filler // 5)  # about 5 tokens per "12. word\n"
            common_freq = max(3, entries // 25)
            pool = rng.sample(self.words, COMMON + entries)
            common, uncommon = pool[:COMMON], pool[COMMON:]
            rest = max(0, entries - COMMON * common_freq)
            rare_freq = max(1, min(common_freq - 2, 3))
            words = common * common_freq + [w for w in uncommon[: -(-rest // rare_freq)] for _ in range(rare_freq)]
            rng.shuffle(words)
            chosen[:] = common
            listing = "\n".join(f"{i}. {w}" for i, w in enumerate(words, 1))
            return CWE_INTRO + listing, question, prefix

        context, question, prefix = self._fit(make, length)
        return RulerItem(task, length, index, context, question, prefix, tuple(chosen))

    def _fwe(self, rng: random.Random, task: str, length: int, index: int) -> RulerItem:
        question = (
            "Question: Do not provide any explanation. Please ignore the dots '....'. What are the three most "
            "frequently appeared words in the above coded text?"
        )
        prefix = "Answer: According to the coded text above, the three most frequently appeared words are:"
        state = rng.getstate()
        top: list[str] = []

        def make(filler: int):
            rng.setstate(state)
            count = max(30, filler // 3)  # about 3 tokens per " word ...."
            vocab: list[str] = []
            while len(vocab) < 100:
                word = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(3, 6)))
                if word not in vocab:
                    vocab.append(word)
            weights = [1 / (rank + 1) ** ZIPF for rank in range(len(vocab))]
            while True:  # the top three must be unambiguous
                words = rng.choices(vocab, weights, k=count)
                counts = sorted(((words.count(w), w) for w in vocab), reverse=True)
                if counts[2][0] > counts[3][0]:
                    break
            top[:] = [w for _, w in counts[:3]]
            return FWE_INTRO + " .... ".join(words), question, prefix

        context, question, prefix = self._fit(make, length)
        return RulerItem(task, length, index, context, question, prefix, tuple(top))


def prompt_segments(tokenizer, item: RulerItem, protocol: str) -> tuple[list[int], list[int]]:
    """``(compressed, after)`` token ids: under ``question_after`` the context, then the question with the chat
    template's end of turn, generation prompt and answer prefix; under ``question_in_prompt`` all of it, then ``[]``."""
    content = f"{item.context}\n\n{item.question}"
    if has_chat_template(tokenizer):
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
        )
    else:
        text = content + "\nAnswer:"
    text += " " + item.answer_prefix if not text.endswith("\n") else item.answer_prefix
    cut = text.index(content) + len(item.context)
    if protocol == "question_in_prompt":
        return tokenizer.encode(text, add_special_tokens=False), []
    return (tokenizer.encode(text[:cut], add_special_tokens=False),
            tokenizer.encode(text[cut:], add_special_tokens=False))  # fmt: skip


@dataclass
class RulerJob:
    """A validated RULER run (see :meth:`create`)."""

    setting: KVSetting
    lengths: list[int]
    tasks: list[str]
    n: int
    seed: int
    protocol: str
    files: list[Path] = field(repr=False)
    generator: Generator = field(repr=False)

    @classmethod
    def create(
        cls,
        setting: KVSetting,
        tokenizer,
        *,
        lengths: str | Sequence[int] = "1024,2048,4096",
        tasks: str | Sequence[str] = TASKS,
        n: int = 10,
        seed: int = 0,
        protocol: str = "question_after",
        max_length: int | None = None,
        folder: str | Path | None = None,
    ) -> RulerJob:
        lengths = parse_ints(lengths, "lengths", 256, None if max_length is None else max_length - 128)
        tasks = list(dict.fromkeys(parse_tasks(tasks)))
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"--n must be an integer >= 1 (items per task and length), got {n!r}")
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise ValueError(f"--seed must be an integer >= 0, got {seed!r}")
        if protocol not in PROTOCOLS:
            raise ValueError(f"--protocol must be one of {', '.join(PROTOCOLS)}; got {protocol!r}")
        files = haystack_files(folder)
        text = "".join(path.read_text(encoding="utf-8") for path in files)
        generator = Generator(tokenizer, text, seed)
        if 2 * max(lengths) > len(generator.haystack_ids):
            haystack = len(generator.haystack_ids)
            raise ValueError(f"--lengths: {max(lengths)} tokens is too long for the {haystack}-token haystack")
        return cls(setting, sorted(lengths), tasks, n, seed, protocol, files, generator)

    def items(self) -> list[RulerItem]:
        return [self.generator.item(t, length, i) for length in self.lengths for t in self.tasks for i in range(self.n)]

    def data(self) -> dict[str, Any]:
        digest = hashlib.sha256("".join(sha256(p) for p in self.files).encode()).hexdigest()
        return {"name": HAYSTACK_DIR, "sha256": digest, "files": len(self.files), "generated_from_seed": self.seed}


def parse_tasks(value: str | Sequence[str]) -> list[str]:
    names = [v.strip() for v in value.split(",") if v.strip()] if isinstance(value, str) else list(value)
    if not names:
        raise ValueError("--tasks is empty")
    for name in names:
        if name not in TASKS:
            raise ValueError(f"--tasks: {name!r} is not one of {', '.join(TASKS)}")
    return names


def summarize(rows: Sequence[dict[str, Any]], tasks: Sequence[str], lengths: Sequence[int]) -> dict[str, Any]:
    """Per-task and per-length means with standard errors, and the suite score (mean over tasks)."""
    metrics: dict[str, Any] = {}
    by_task = {t: mean([r["score"] for r in rows if r["task"] == t]) for t in tasks}
    suite = average(list(by_task.values()))
    metrics["score"], metrics["score_stderr"] = suite.value, suite.se
    for t, est in by_task.items():
        metrics[f"score_{t}"], metrics[f"score_{t}_stderr"] = est.value, est.se
    for length in lengths:
        est = average([mean([r["score"] for r in rows if r["task"] == t and r["length"] == length]) for t in tasks])
        metrics[f"score_{length}"], metrics[f"score_{length}_stderr"] = est.value, est.se
    return metrics


def run_ruler(
    job: RulerJob,
    model,
    tokenizer,
    json_path: str | Path | None = None,
    *,
    model_name: str,
    progress: Callable[[int], None] | None = None,
    keep_item_log: bool = False,
    runner=None,
) -> dict[str, Any]:
    """Run every item (resumable through the item log) and write the result record. ``runner``: where the items
    run instead of ``model`` (a :class:`~h2o_kv.eval.server.ServerRunner`: a server's OpenAI API)."""
    runner = runner or KVRunner(model, job.setting, tokenizer=tokenizer)
    # what an item's answer depends on (not which items run: a run with more items or lengths reuses finished ones)
    settings = {"model": model_name, **job.setting.fields(), "seed": job.seed, "protocol": job.protocol,
                "max_new_tokens": MAX_NEW_TOKENS}  # fmt: skip
    if isinstance(runner, ServerRunner):  # a server's items are not the transformers backend's: another log
        settings["server"] = runner.xargs
    log = ItemLog(item_log_path(json_path), settings) if json_path is not None else None
    eos = [] if tokenizer.eos_token_id is None else [tokenizer.eos_token_id]
    start = time.time()
    rows = []
    for item in job.items():
        if log is not None and item.key in log:
            rows.append(log.done[item.key])
        else:
            compressed, after = prompt_segments(tokenizer, item, job.protocol)

            def complete(tokens: list[int], answers=item.answers) -> bool:  # the score can only stay at 1.0 now
                return score_answer(tokenizer.decode(tokens, skip_special_tokens=True), answers) == 1.0

            tokens, session = runner.generate(
                compressed, MAX_NEW_TOKENS[item.task], eos_ids=eos, stop=complete, then=after
            )
            answer = tokenizer.decode(tokens, skip_special_tokens=True).strip()
            row = {"key": item.key, "task": item.task, "length": item.length, "index": item.index,
                   "prompt_tokens": len(compressed) + len(after), "compressed_tokens": len(compressed),
                   "kept": session.kept, "answers": list(item.answers), "answer": answer,
                   "score": score_answer(answer, item.answers)}  # fmt: skip
            if log is not None:
                log.add(item.key, **{k: v for k, v in row.items() if k != "key"})
            rows.append(row)
        if progress is not None:
            progress(1)
    fields = {
        "label": f"RULER ({job.protocol}, lengths {','.join(map(str, job.lengths))}, {job.n} items per task)",
        "model": model_name,
        "primary_metric": "score",
        "protocol": job.protocol,
        "lengths": job.lengths,
        "tasks": job.tasks,
        "n": len(rows),
        "items": [{k: v for k, v in r.items() if k != "key"} for r in rows],
        "kv_kept_ratio": sum(r["kept"] / r["compressed_tokens"] for r in rows) / len(rows),
        "settings": {
            "seed": job.seed,
            "items_per_task_and_length": job.n,
            "max_new_tokens": MAX_NEW_TOKENS,
            "decoding": "greedy",
            "score": "string_match_all (fraction of expected strings found)",
            "budget_of": "the compressed tokens (heavy = recent = max(1, floor(budget * L / 2)))",
        },
        "data": job.data(),
        "time_s": round(time.time() - start, 1),
        **server_field(runner),
    }
    metrics = summarize(rows, job.tasks, job.lengths)
    return finish_result(json_path, "ruler", metrics, fields, setting=job.setting, device=runner.device,
                         keep_item_log=keep_item_log)  # fmt: skip


# -- `h2o-kv eval sweep --kind ruler` (registered in h2o_kv.eval.kinds) ---------------------------------------

OPTIONS = {"lengths", "tasks", "n", "seed", "protocol"}


def sweep_prepare(options: dict[str, Any], models) -> dict[str, Any]:
    check_options("ruler", options, OPTIONS)
    settings = {
        "lengths": str(options.get("lengths", "1024,2048,4096")),
        "tasks": str(options.get("tasks", ",".join(TASKS))),
        "n": option_int(options, "n", 10),
        "seed": option_int(options, "seed", 0),
        "protocol": str(options.get("protocol", "question_after")),
    }
    RulerJob.create(KVSetting("dynamic"), models.tokenizer(), **settings)  # every option checked before a cell runs
    return settings


def sweep_run(settings, setting: KVSetting, path: Path, models, progress) -> dict[str, Any]:
    from ..models import model_context_length

    model = models.model()
    job = RulerJob.create(setting, models.tokenizer(), max_length=model_context_length(model), **settings)
    return run_ruler(job, model, models.tokenizer(), path, model_name=models.label, progress=progress)
