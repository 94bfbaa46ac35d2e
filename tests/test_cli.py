"""`h2o-kv generate` end to end on the default model, and its input checks."""

from __future__ import annotations

import re

import pytest
from typer.testing import CliRunner

from h2o_kv.cli import app

runner = CliRunner()


def run(*args):
    result = runner.invoke(app, ["generate", *args])
    return result.exit_code, result.output + (result.stderr if result.stderr_bytes else "")


def test_generate_prints_text_and_summary(default_model):
    code, out = run("Explain the water cycle.", "--chat", "--heavy", "8", "--recent", "8", "--max-new-tokens", "12")
    assert code == 0, out
    summary = out.strip().splitlines()[-1]
    assert re.search(r"KV entries 16 kept / \d+ seen", summary), summary
    assert "vs" in summary and "full" in summary and "tok/s" in summary
    seen = int(re.search(r"/ (\d+) seen", summary).group(1))
    assert seen > 16


def test_generate_from_file_with_budget(default_model, tmp_path):
    text = tmp_path / "prompt.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 40)
    code, out = run("--file", str(text), "--budget", "0.2", "--max-new-tokens", "4", "--quiet")
    assert code == 0, out
    assert "h2o(heavy=" in out and "(0.2" in out or "(0.1" in out


@pytest.mark.parametrize(
    "args, message",
    [
        (["   "], "prompt is empty"),
        (["hi", "--budget", "1.5"], "budget must be a ratio in (0, 1]"),
        (["hi", "--heavy", "-1", "--recent", "4"], "heavy must be an integer >= 0"),
        (["hi", "--heavy", "4", "--recent", "4", "--policy", "nope"], "--policy must be one of"),
        (["hi", "--heavy", "4", "--recent", "4", "--model", "/no/such/model"], "name_or_path='/no/such/model'"),
        (["hi"], "give --budget"),
        (["hi", "--budget", "0.2", "--heavy", "4"], "either budget"),
        (["hi", "--heavy", "4", "--recent", "4", "--max-new-tokens", "9000"], "exceeds the model's context"),
        (["hi", "--file", "/no/such/file.txt"], "not both"),
        (["--file", "/no/such/file.txt", "--budget", "0.2"], "does not exist"),
    ],
)
def test_generate_rejects_bad_input(default_model, args, message):
    code, out = run(*args)
    assert code != 0
    assert message in " ".join(out.replace("│", " ").split()), out
