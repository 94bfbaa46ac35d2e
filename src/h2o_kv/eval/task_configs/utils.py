"""Loaders for the h2o-kv lm-eval task YAMLs: read the local copies in the shared data folder (no download).

Each ``load_*`` function is a task's ``custom_dataset``: it returns a ``DatasetDict`` with one ``test`` split
holding the local file's items in file order, with the fields lm-eval's original task YAML expects. The few-shot
examples are drawn from the same split (``fewshot_split: test``); lm-eval then leaves the evaluated item out of
its own context. The folder is ``$H2O_KV_DATA`` or ``./shared/data``, ``../shared/data``
(:func:`h2o_kv.harness.data.data_path`); a missing or malformed file raises an error naming it.
"""

from __future__ import annotations

import json
import re

import datasets

from h2o_kv.harness.data import data_path


class DataFormatError(ValueError):
    """A local data file exists but does not have the expected format."""


def _jsonl(relative: str, fields: tuple[str, ...]) -> list[dict]:
    path = data_path(relative)
    rows = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise DataFormatError(f"{path}:{number} is not valid JSON ({err.msg})") from None
        missing = [f for f in fields if f not in row]
        if missing:
            raise DataFormatError(f"{path}:{number} lacks field(s) {', '.join(missing)}")
        rows.append(row)
    if not rows:
        raise DataFormatError(f"{path} holds no items")
    return rows


def _dataset(rows: list[dict]) -> datasets.DatasetDict:
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})


def load_piqa(**_) -> datasets.DatasetDict:
    """PIQA validation (``goal, sol1, sol2``) with the labels of ``dev-labels.lst`` (0 = sol1, 1 = sol2)."""
    rows = _jsonl("piqa/dev.jsonl", ("goal", "sol1", "sol2"))
    labels_path = data_path("piqa/dev-labels.lst")
    labels = [line.strip() for line in labels_path.read_text().splitlines() if line.strip()]
    if len(labels) != len(rows) or set(labels) - {"0", "1"}:
        raise DataFormatError(f"{labels_path}: expected {len(rows)} labels 0/1, one per line of piqa/dev.jsonl")
    return _dataset([{**row, "label": int(label)} for row, label in zip(rows, labels, strict=True)])


_OBQA_CHOICE = re.compile(r"\(([A-D])\) (.*?)(?= \([A-D]\) |$)")


def load_openbookqa(**_) -> datasets.DatasetDict:
    """OpenBookQA main test TSV -> lm-eval's ``question_stem``, ``choices {text, label}``, ``answerKey``."""
    path = data_path("openbookqa/test.tsv")
    lines = path.read_text(encoding="utf-8").splitlines()
    header = lines[0].split("\t") if lines else []
    if header[:3] != ["ID", "Question Stem", "Choices"] or "Answer Key" not in header:
        raise DataFormatError(f"{path}: expected a header 'ID, Question Stem, Choices, ..., Answer Key'")
    key_column = header.index("Answer Key")
    rows = []
    for number, line in enumerate(lines[1:], 2):
        cells = line.split("\t")
        if len(cells) != len(header):
            raise DataFormatError(f"{path}:{number} has {len(cells)} columns, expected {len(header)}")
        choices = _OBQA_CHOICE.findall(cells[2].strip())
        answer = cells[key_column].strip()
        if [label for label, _ in choices] != ["A", "B", "C", "D"] or answer not in "ABCD":
            raise DataFormatError(f"{path}:{number}: cannot read the choices '(A) .. (D) ..' and answer key")
        rows.append(
            {
                "id": cells[0],
                "question_stem": cells[1],
                "choices": {"text": [text for _, text in choices], "label": [label for label, _ in choices]},
                "answerKey": answer,
            }
        )
    return _dataset(rows)


def load_rte(**_) -> datasets.DatasetDict:
    """SuperGLUE RTE validation; ``label`` 0 = entailment, 1 = not_entailment (as in the HF dataset)."""
    rows = _jsonl("rte/val.jsonl", ("premise", "hypothesis", "label"))
    names = {"entailment": 0, "not_entailment": 1}
    for row in rows:
        if row["label"] not in names:
            raise DataFormatError(f"rte/val.jsonl: label {row['label']!r} is not entailment/not_entailment")
        row["label"] = names[row["label"]]
    return _dataset(rows)


_MATHQA = re.compile(r"^Question: (?P<problem>.*?)\n(?P<options>(?:[A-E]\. .*\n)+)Answer: ?$", re.S)


def load_mathqa(**_) -> datasets.DatasetDict:
    """MathQA test in llm-foundry's format -> ``Problem``, ``options`` (the option texts) and ``gold``.

    The lettered options are unpacked so that the task scores the option text itself, like lm-eval's original
    ``mathqa`` task (``Question: {{Problem}}\\nAnswer:`` followed by an option). This conversion shows 4 options
    per problem (the original has 5), so chance is 25%.
    """
    rows = []
    for number, row in enumerate(_jsonl("mathqa/math_qa.jsonl", ("query", "choices", "gold")), 1):
        match = _MATHQA.match(row["query"])
        if match is None:
            raise DataFormatError(f"mathqa/math_qa.jsonl:{number}: query is not 'Question: ..\\nA. ..\\nAnswer: '")
        options = [line[3:].strip() for line in match["options"].splitlines()]
        if len(options) != len(row["choices"]) or not 0 <= row["gold"] < len(options):
            raise DataFormatError(f"mathqa/math_qa.jsonl:{number}: options and gold do not match")
        rows.append({"Problem": match["problem"].strip(), "options": options, "gold": row["gold"]})
    return _dataset(rows)


def load_hellaswag(**_) -> datasets.DatasetDict:
    """The 1000-item HellaSwag validation subset (original fields; lm-eval's ``process_docs`` builds the query)."""
    fields = ("activity_label", "ctx_a", "ctx_b", "endings", "label")
    return _dataset(_jsonl("hellaswag/hellaswag_val_subset1000.jsonl", fields))


def load_lambada(**_) -> datasets.DatasetDict:
    """LAMBADA test, OpenAI's detokenized version (``text``: the passage, its last word is the target)."""
    return _dataset(_jsonl("lambada/lambada_test.jsonl", ("text",)))


# -- lm-eval's own helpers, unchanged ----------------------------------------------------------------------------


def _hellaswag_preprocess(text: str) -> str:
    text = text.strip()
    # NOTE: Brackets are artifacts of the WikiHow dataset portion of HellaSwag.
    text = text.replace(" [title]", ". ")
    text = re.sub("\\[.*?\\]", "", text)
    text = text.replace("  ", " ")
    return text


def hellaswag_process_docs(dataset: datasets.Dataset) -> datasets.Dataset:
    """lm-eval's ``hellaswag/utils.py:process_docs``."""

    def _process_doc(doc):
        ctx = doc["ctx_a"] + " " + doc["ctx_b"].capitalize()
        return {
            "query": _hellaswag_preprocess(doc["activity_label"] + ": " + ctx),
            "choices": [_hellaswag_preprocess(ending) for ending in doc["endings"]],
            "gold": int(doc["label"]),
        }

    return dataset.map(_process_doc)
