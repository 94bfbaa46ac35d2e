"""The ``h2o-kv`` command line: help and input errors without the model (fast), ``generate`` end to end."""

from __future__ import annotations

import json
import logging
import re
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from h2o_kv.budget import Budget
from h2o_kv.cli import DTYPE_NAMES, LAZY_GROUPS, POLICY_NAMES, Notes, app, budget_notes, lazy_group
from h2o_kv.registry import SERVER_POLICIES

runner = CliRunner()


def invoke(*args, columns: int = 200):
    return runner.invoke(app, list(args), env={"COLUMNS": str(columns)})  # wide help: no wrapped lines


def flat(text: str) -> str:
    """Help text as one line (wrapping undone)."""
    return " ".join(text.split())


def one_line_error(result) -> str:
    """The single ``error: ...`` line of a rejected command (exit status 2, nothing else printed)."""
    assert result.exit_code == 2, result.output
    assert result.stdout == "" and result.stderr.count("\n") == 1, result.output
    assert result.stderr.startswith("error: ") and "Traceback" not in result.stderr
    return result.stderr


# -- without the model ------------------------------------------------------------------------------------------


def test_option_names_match_the_library():
    from h2o_kv.models import _DTYPES
    from h2o_kv.policies import POLICIES

    assert POLICY_NAMES == tuple(POLICIES)
    assert set(DTYPE_NAMES) == set(_DTYPES)


@pytest.mark.parametrize(
    "args",
    [
        ["--help"], ["generate", "--help"], ["chat", "--help"], ["generate", "hi"], ["eval", "--help"],
        ["eval", "ppl", "--help"], ["eval", "sweep", "--help"], ["bench", "--help"], ["bench", "run", "--help"],
        ["bench", "kv-memory", "--help"], ["eval", "ppl", "--text", "x", "--tokens", "9", "--policy", "nope"],
        ["bench", "run", "--out", "x.json", "--policies", "a2sf:decay=2"],
    ],
)  # fmt: skip
def test_help_and_input_errors_import_neither_torch_nor_transformers(args):
    """What makes them answer in about a second (torch and transformers take 5-8 s to import on a small machine);
    the groups load only when named."""
    groups = {"h2o_kv.eval.cli", "h2o_kv.bench.cli"} - {f"h2o_kv.{args[0]}.cli"}
    script = (
        "import sys\nfrom h2o_kv.cli import app\ntry:\n    app(sys.argv[1:])\nexcept SystemExit as done:\n"
        f"    code = done.code\nheavy = {{'torch', 'transformers', *{sorted(groups)}}}\n"
        "assert not heavy & set(sys.modules), heavy & set(sys.modules)\nsys.exit(code)"
    )
    done = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=120)
    error = "--help" not in args
    assert done.returncode == (2 if error else 0), done.stderr
    assert (done.stderr if error else done.stdout).strip()


def test_the_cli_modules_import_no_torch():
    """The option modules read the policy registry, never the policies (which import torch)."""
    modules = ["h2o_kv.cli", "h2o_kv.eval.cli", "h2o_kv.eval.options", "h2o_kv.bench.cli", "h2o_kv.harness.setting",
               "h2o_kv.registry", "h2o_kv.vllm.config"]  # fmt: skip
    script = f"import importlib, sys\nfor m in {modules}: importlib.import_module(m)\n" + (
        "print(sorted({'torch', 'transformers', 'h2o_kv.policies'} & set(sys.modules)))"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "[]", done.stdout + done.stderr


def test_top_level_help_lists_every_command_and_the_groups_load_when_used():
    listed = invoke("--help")
    assert listed.exit_code == 0
    for name in ("generate", "chat", "serve", "eval", "bench"):
        assert re.search(rf"^  {name} ", listed.stdout, re.MULTILINE), listed.stdout
    for name, (_, help_line) in LAZY_GROUPS.items():
        assert help_line in flat(listed.stdout)
        assert lazy_group(name).help == help_line  # the stand-in says what the group says
        group_help = invoke(name, "--help")
        assert group_help.exit_code == 0 and "COMMAND" in group_help.stdout
    assert invoke("eval", "ppl", "--help").exit_code == 0


def test_generate_help_states_the_budget_rule_defaults_and_ranges():
    result = invoke("generate", "--help")
    assert result.exit_code == 0
    text = flat(result.stdout)
    assert "The KV budget is required (except with --policy full)" in text
    assert "ratio in (0, 1] of the prompt length" in text and "give --heavy/--recent for short prompts" in text
    assert "--max-new-tokens <int range> Tokens to generate. [default: 128; x>=1]" in text, text
    assert re.search(r"--heavy <int range> Heavy-hitter [^\[]*\[x>=0\]", text), text
    assert (
        "--max-prompt-tokens <int range> Keep only the first N tokens of the prompt. [default: (the whole prompt); "
        in text
    )
    policies = "--policy POLICY Eviction policy (full keeps every entry and takes no budget): " + ", ".join(
        POLICY_NAMES
    )
    assert policies + ". Options as name:option=value,... (e.g. a2sf:decay=0.95)" in text and "[default: h2o]" in text
    assert "decay=0.99 (a2sf)" in text and "sinks=4 (sink)" in text
    for default in ("SmolLM2-135M-Instruct", "float32 on CPU, bfloat16 on CUDA", "cuda when available, else cpu"):
        assert f"[default: ({default})]" in text
    assert 'h2o-kv generate "Explain the water cycle." --chat --heavy 32 --recent 32' in text


def test_chat_help_is_a_plain_command():
    result = invoke("chat", "--help")
    assert result.exit_code == 0
    assert (
        "chat [OPTIONS]" in result.stdout and "COMMAND" not in result.stdout and "[default: 256; x>=0]" in result.stdout
    )


@pytest.mark.parametrize(
    "args, pattern",
    [
        (["   ", "--heavy", "4", "--recent", "4"], "the prompt is empty"),
        (["hi", "--budget", "1.5"], r"--budget must be a ratio in \(0, 1\]"),
        (["hi", "--budget", "0"], r"--budget must be a ratio in \(0, 1\]"),
        (["hi", "--heavy", "-1", "--recent", "4"], r"^error: --heavy must be >= 0$"),
        (["hi", "--heavy", "x", "--recent", "4"], r"^error: --heavy must be an integer$"),
        (["hi", "--budget", "x"], r"^error: --budget must be a number$"),
        (["hi", "--heavy", "4", "--recent", "4", "--max-new-tokens", "0"], r"^error: --max-new-tokens must be >= 1$"),
        (["hi", "--heavy", "4", "--recent", "4", "--max-prompt-tokens", "0"], r"--max-prompt-tokens must be >= 1$"),
        (
            ["hi", "--heavy", "4", "--recent", "4", "--policy", "nope"],
            "^error: --policy must be one of " + ", ".join(POLICY_NAMES) + "; got 'nope'$",
        ),
        (
            ["hi", "--budget", "0.2", "--policy", "a2sf:decay=1.5"],
            r"^error: --policy a2sf: decay must be a number in \(0, 1\]; got '1.5'$",
        ),
        (
            ["hi", "--budget", "0.2", "--policy", "snapkv:kernel=4"],
            r"--policy snapkv: kernel must be an odd integer >= 1",
        ),
        (["hi", "--budget", "0.2", "--policy", "h2o:decay=0.5"], r"--policy h2o takes no options; got 'decay'"),
        (["hi", "--budget", "0.2", "--policy", "a2sf:window=4"], r"--policy a2sf takes decay; got 'window'"),
        (
            ["hi", "--heavy", "4", "--recent", "4", "--dtype", "int8"],
            r"^error: --dtype 'int8' is not one of .*'bfloat16'",
        ),
        (["--file", "/no/such/file.txt", "--budget", "0.2"], r"'--file'.*does not exist"),
        (["hi"], r"give --budget \(a ratio in \(0, 1\] of the prompt\) or --heavy and --recent"),
        (["hi", "--heavy", "4"], "--recent is required"),
        (["hi", "--budget", "0.2", "--heavy", "4"], "either --budget .* or --heavy/--recent"),
        (["hi", "--heavy", "0", "--recent", "0"], r"--heavy \+ --recent must be >= 1"),
        (["hi", "--policy", "full", "--budget", "0.2"], "--policy full keeps every entry"),
        (["hi", "--heavy", "4", "--recent", "4", "--model", "/no/such/model"], "^error: --model '/no/such/model' is "),
        (["hi", "--heavy", "4", "--recent", "4", "--device", "tpu"], "--device 'tpu'; expected one of cpu, cuda"),
        (["hi", "--bogus"], "No such option: --bogus"),
        (["hi", "--heavy", "4", "--recent", "4", "--temperature", "0"], r"--temperature must be > 0 .*; got 0.0"),
        (["hi", "--heavy", "4", "--recent", "4", "--top-p", "1.5"], r"--top-p must be in \(0, 1\]; got 1.5"),
        (["hi", "--heavy", "4", "--recent", "4", "--seed", "1"], "--seed .* give --temperature or --top-p"),
    ],
)
def test_generate_rejects_bad_input_in_one_line(args, pattern):
    assert re.search(pattern, one_line_error(invoke("generate", *args)))


def test_generate_needs_a_tokenizer(tiny_models):
    model = str(tiny_models["opt"])
    error = one_line_error(invoke("generate", "hi", "--heavy", "4", "--recent", "4", "--model", model))
    assert error == f"error: --model {model} has no tokenizer files; generate needs one\n"


def test_generate_rejects_a_prompt_and_a_file(tmp_path):
    text = tmp_path / "prompt.txt"
    text.write_text("hello")
    assert "not both" in one_line_error(invoke("generate", "hi", "--file", str(text), "--budget", "0.2"))


@pytest.mark.parametrize(
    "args, pattern",
    [
        (["--heavy", "0", "--recent", "0"], r"--heavy \+ --recent must be >= 1"),
        (["--policy", "full"], r"--policy must be one of h2o, local, sink, tova, .*; got 'full'$"),
        (["--policy", "sink:sinks=-1"], r"--policy sink: sinks must be an integer >= 0; got '-1'$"),
        (["--top-p", "0"], r"--top-p must be in \(0, 1\]"),
        (["--max-new-tokens", "0"], r"--max-new-tokens must be >= 1"),
        (["--model", "/no/such/model"], "--model '/no/such/model' is neither a local directory"),
    ],
)
def test_chat_rejects_bad_input_in_one_line(args, pattern):
    assert re.search(pattern, one_line_error(invoke("chat", *args)))


def test_notes_print_each_warning_once_on_one_line(capsys):
    import warnings

    with Notes() as note:
        for _ in range(2):
            warnings.warn("first line\n  continued", UserWarning, stacklevel=1)
        note("the command's own")
        note("the command's own")
    assert capsys.readouterr().err == "note: first line continued\nnote: the command's own\n"


@pytest.mark.parametrize(
    "rule, length, new, expected",
    [
        (Budget(ratio=0.2), 36, 128, "--budget 0.2 of this 36-token prompt keeps 3 heavy + 3 recent entries"),
        (Budget(ratio=0.2), 5, 128, "keeps 1 heavy + 1 recent entries"),
        (Budget(ratio=0.2), 2048, 128, None),  # the paper's setting: a long prompt
        (
            Budget(heavy=32, recent=32),
            36,
            128,
            "--heavy 32 --recent 32 keeps 64 entries per layer and KV head, the "
            "whole 36-token prompt: nothing is evicted until the sequence is longer than 64 tokens",
        ),  # fmt: skip
        (Budget(heavy=32, recent=32), 2048, 128, None),
    ],
)
def test_budget_notes(rule, length, new, expected):
    notes = []
    budget_notes(notes.append, rule, length, new)
    assert notes == [] if expected is None else len(notes) == 1 and expected in notes[0]
    if expected and rule.is_ratio:
        assert "give --heavy and --recent instead" in notes[0]


# -- one style for every command ----------------------------------------------------------------------------------

COMMANDS = [
    ["generate"], ["chat"], ["serve"], ["eval"], ["eval", "ppl"], ["eval", "tasks"], ["eval", "sweep"],
    ["eval", "ruler"], ["bench"], ["bench", "run"], ["bench", "kv-memory"], ["bench", "profile"], ["bench", "serve"],
]  # fmt: skip


@pytest.mark.parametrize("command", COMMANDS, ids=" ".join)
def test_help_at_80_columns_wraps_between_words(command):
    """The same words at 80 columns as at 200 (wrapping changes only whitespace: no word cut, nothing elided)."""
    narrow, wide = invoke(*command, "--help", columns=80), invoke(*command, "--help")
    assert narrow.exit_code == 0 and wide.exit_code == 0, narrow.output
    assert max(map(len, narrow.stdout.splitlines())) <= 80, narrow.stdout
    assert "…" not in narrow.stdout
    assert flat(narrow.stdout) == flat(wide.stdout)


@pytest.mark.parametrize("command", [["generate"], ["serve"], ["eval", "ppl"], ["eval", "tasks"], ["bench", "run"],
                                     ["bench", "kv-memory"]], ids=" ".join)  # fmt: skip
def test_budget_reads_the_same_in_every_command(command):
    text = flat(invoke(*command, "--help").stdout)
    assert "--budget RATIO " in text and "ratio in (0, 1]" in text.lower(), text
    assert "1e-06" not in text and "--budget <float" not in text


def test_each_command_lists_the_policies_it_accepts():
    serve = flat(invoke("serve", "--help").stdout)
    assert "vLLM's own cache): " + ", ".join(SERVER_POLICIES) + ". Options as" in serve
    assert "global_" not in serve and "ada_" not in serve and "alpha" not in serve
    chat = flat(invoke("chat", "--help").stdout)
    assert "Eviction policy: " + ", ".join(name for name in POLICY_NAMES if name != "full") + ". Options" in chat
    ppl = flat(invoke("eval", "ppl", "--help").stdout)
    assert "kvpress" not in ppl and "dynamic (the stock DynamicCache" in ppl and "global_window_h2o." in ppl
    assert "(required)" not in ppl and ppl.count("[required]") == 2  # --text and --tokens; not --strip-gutenberg


@pytest.mark.parametrize(
    "args, expected",
    [
        (["eval", "ppl", "--text", "x", "--tokens", "9", "--policy", "nope"],
         "--policy must be one of dynamic, " + ", ".join(POLICY_NAMES) + "; got 'nope'"),
        (["eval", "ppl", "--text", "x", "--tokens", "9", "--policy", "kvpress:snapkv"],
         "--policy must be one of dynamic, " + ", ".join(POLICY_NAMES) + "; got 'kvpress:snapkv'"),
        (["eval", "ppl", "--text", "x", "--tokens", "x"], "--tokens must be an integer"),
        (["eval", "tasks", "--budget", "3"], "--budget must be a ratio in (0, 1] of the prompt length, got 3.0"),
        (["eval", "tasks"], "h2o evicts: give --budget (a ratio in (0, 1] of the prompt) or --heavy and --recent"),
        (["eval", "xsum", "--policy", "a2sf:decay=0", "--budget", "0.2"],
         "--policy a2sf: decay must be a number in (0, 1]; got '0'"),
        (["eval", "sweep", "--kind", "ppl", "--out", "x", "--policies", "h2o,snapkv:window=0"],
         "--policies snapkv: window must be an integer >= 1; got '0'"),
        (["bench", "run", "--out", "x.json", "--budget", "1.5"],
         "--budget must be a ratio in (0, 1] of the prompt length, got 1.5"),
        (["bench", "run", "--out", "x.json", "--policies", "h2o,snapkv:window=16,kernel=4"],
         "--policies snapkv: kernel must be an odd integer >= 1; got '4'"),
        (["bench", "run", "--out", "x.json", "--contexts", "0"], "--contexts must be integers >= 1, got '0'"),
        (["bench", "kv-memory", "--json", "x.json", "--budget", "0"],
         "--budget must be a ratio in (0, 1] of the prompt length, got 0.0"),
        (["bench", "soak", "--out", "x.json", "--disconnect-fraction", "2"], "--disconnect-fraction must be <= 1"),
        (["serve", "--policy", "nope"], "--policy must be one of " + ", ".join(SERVER_POLICIES) + "; got 'nope'"),
        (["serve", "--policy", "a2sf:decay=2", "--budget", "0.2"],
         "--policy a2sf: decay must be a number in (0, 1]; got '2'"),
    ],
)  # fmt: skip
def test_errors_are_one_line_in_one_style(args, expected, tmp_path, monkeypatch):
    """``error: `` and the option's own words, exit status 2, no traceback, no pydantic wording, in every command."""
    monkeypatch.chdir(tmp_path)
    assert one_line_error(invoke(*args)) == f"error: {expected}\n"


def test_serve_refuses_what_the_server_cannot_run_saying_why():
    error = one_line_error(invoke("serve", "--policy", "global_h2o", "--budget", "0.2"))
    assert (
        error.startswith("error: --policy global_h2o shares one budget across all layers")
        and ", ".join(SERVER_POLICIES) in error
    )


def test_bench_serve_checks_the_vllm_arguments_it_passes_on(tmp_path):
    """``bench serve ... -- ARGS`` gives ARGS to every setting's server, refused as ``h2o-kv serve`` refuses them."""
    error = one_line_error(invoke("bench", "serve", "--policies", "h2o@0.2", "--out", str(tmp_path / "r.json"),
                                  "--", "--kv-transfer-config", "{}"))  # fmt: skip
    assert (
        error == "error: --kv-transfer-config: KV connectors (they would move compacted blocks) are not supported "
        "with --policy h2o\n"
    )


# -- with the default model -------------------------------------------------------------------------------------


@pytest.mark.slow
def test_readme_command_one_answers_on_topic_with_one_note(default_model):
    """The README's first command: a sensible answer, its summary, and one clean note (no warning, no traceback)."""
    result = invoke("generate", "Explain the water cycle.", "--chat", "--heavy", "32", "--recent", "32",
                    "--max-new-tokens", "128")  # fmt: skip
    assert result.exit_code == 0, result.output
    answer, summary = result.stdout.strip().rsplit("\n", 1)
    assert "evaporation" in answer and "condens" in answer, answer
    assert re.search(r"\[h2o\(heavy=32, recent=32\)\] KV entries 64 kept / \d+ seen", summary), summary
    assert result.stderr.startswith("note: --heavy 32 --recent 32 keeps 64 entries") and "nothing is evicted" in (
        result.stderr
    )
    assert result.stderr.count("\n") == 1, result.stderr


def test_ratio_of_a_short_prompt_runs_and_says_so(default_model):
    """The README's prompt without --chat and a ratio budget: 1 + 1 entries (the budget rule), one note, exit 0."""
    result = invoke("generate", "Explain the water cycle.", "--budget", "0.2", "--max-new-tokens", "8")
    assert result.exit_code == 0, result.output
    assert "KV entries 2 kept" in result.stdout
    assert result.stderr.count("\n") == 1 and "keeps 1 heavy + 1 recent" in result.stderr, result.stderr


def test_generate_runs_the_policy_options_and_records_them(default_model, tmp_path):
    path = tmp_path / "generate.json"
    result = invoke("generate", "Explain the water cycle.", "--chat", "--heavy", "8", "--recent", "8",
                    "--max-new-tokens", "4", "--quiet", "--policy", "a2sf:decay=0.5", "--json", str(path))  # fmt: skip
    assert result.exit_code == 0 and result.stderr == "", result.output
    assert result.stdout.startswith("[a2sf(heavy=8, recent=8, decay=0.5)] KV entries 16 kept"), result.stdout
    record = json.loads(path.read_text())
    assert record["policy"] == "a2sf:decay=0.5" and record["cache"]["policy"] == "a2sf(heavy=8, recent=8, decay=0.5)"


def test_generate_from_file_with_budget(default_model, tmp_path):
    text = "The quick brown fox jumps over the lazy dog. " * 40
    (tmp_path / "prompt.txt").write_text(text)
    length = len(default_model[1](text).input_ids)
    half = int(0.2 * length / 2)
    result = invoke("generate", "--file", str(tmp_path / "prompt.txt"), "--budget", "0.2", "--max-new-tokens", "4",
                    "--quiet")  # fmt: skip
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith(f"[h2o(heavy={half}, recent={half})] KV entries {2 * half} kept / {length + 3} ")


@pytest.fixture
def transformers_log():
    """Records what transformers logs (its loggers do not propagate to pytest's caplog)."""
    from transformers.utils import logging as hf_logging

    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    hf_logging.add_handler(handler)
    yield records
    hf_logging.remove_handler(handler)


def test_long_file_cut_by_max_prompt_tokens_prints_no_tokenizer_warning(default_model, tmp_path, transformers_log):
    text = "The quick brown fox jumps over the lazy dog. " * 1000  # ~10k tokens, more than the 8192 context
    path = tmp_path / "long.txt"
    path.write_text(text)
    tokenizer = type(default_model[1]).from_pretrained(default_model[1].name_or_path)  # a fresh one warns once
    tokenizer(text)
    assert any("indexing errors" in message for message in transformers_log)  # what the check below would see
    transformers_log.clear()
    cut = invoke("generate", "--file", str(path), "--max-prompt-tokens", "64", "--budget", "0.5", "--max-new-tokens",
                 "2", "--quiet")  # fmt: skip
    assert cut.exit_code == 0 and "prompt 64 tokens" in cut.stdout and cut.stderr == "", cut.output
    whole = invoke("generate", "--file", str(path), "--budget", "0.5", "--max-new-tokens", "2")
    assert "exceeds the model's context of 8192 tokens" in one_line_error(whole)
    assert not any("indexing errors" in message for message in transformers_log), transformers_log


def test_prompt_past_the_context_is_one_line(default_model):
    result = invoke("generate", "hi", "--heavy", "4", "--recent", "4", "--max-new-tokens", "9000")
    assert "exceeds the model's context of 8192 tokens" in one_line_error(result)


def test_generate_samples_reproducibly_with_a_seed(default_model):
    args = ["Name a colour.", "--chat", "--heavy", "8", "--recent", "8", "--max-new-tokens", "12"]

    def reply(*more):  # the text, without the summary line (it holds timings)
        result = invoke("generate", *args, *more)
        assert result.exit_code == 0, result.output
        return result.stdout.rsplit("\n[", 1)[0]

    sampled = reply("--temperature", "1.5", "--top-p", "0.9", "--seed", "7")
    assert sampled == reply("--temperature", "1.5", "--top-p", "0.9", "--seed", "7")  # the seed fixes the draw
    assert sampled != reply() and sampled.strip()  # not the greedy reply


@pytest.mark.parametrize("folder", ["/nonexistent/h2o-kv-data", ""])
def test_a_missing_data_folder_is_one_line(folder, tmp_path, monkeypatch):
    """Every command that reads the shared data (here ``bench kv-memory``'s PG-19 text): one line, exit status 2."""
    monkeypatch.setenv("H2O_KV_DATA", folder)
    monkeypatch.chdir(tmp_path)  # no ./shared/data or ../shared/data either
    done = subprocess.run([sys.executable, "-m", "h2o_kv", "bench", "kv-memory", "--tokens", "16",
                           "--settings", "dynamic", "--json", str(tmp_path / "m.json")],
                          capture_output=True, text=True)  # fmt: skip
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines()[-1].startswith("error: ") and "H2O_KV_DATA" in done.stderr
