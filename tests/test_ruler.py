"""The RULER-style suite: deterministic generation from the seed, items that hold their answers, the two protocols'
prompt split, scoring on hand cases, option checks, and a small resumable run."""

from __future__ import annotations

import json
import re

import pytest
from helpers import needs_data
from typer.testing import CliRunner

from h2o_kv.eval.kinds import KINDS
from h2o_kv.eval.needle import HAYSTACK_DIR
from h2o_kv.eval.results import item_log_path
from h2o_kv.eval.ruler import TASKS, RulerJob, prompt_segments, run_ruler, score_answer, summarize
from h2o_kv.harness.setting import KVSetting

DYNAMIC = KVSetting("dynamic")
haystack = needs_data(HAYSTACK_DIR)


@pytest.fixture(scope="module")
def tokenizer():
    from h2o_kv.models import load_tokenizer

    tok = load_tokenizer(None)
    if tok is None:
        pytest.skip("the default model's tokenizer is not installed")
    return tok


def test_score_by_hand():
    assert score_answer("The numbers are 1234567 and 7654321.", ["1234567"]) == 1.0
    assert score_answer("1234567, 2", ["1234567", "7654321"]) == 0.5
    assert score_answer("they are: abcde, FGHIJ", ["ABCDE", "fghij", "KLMNO"]) == pytest.approx(2 / 3)
    assert score_answer("", ["x"]) == 0.0
    rows = [{"task": "a", "length": 1, "score": s} for s in (1.0, 0.0)] + [{"task": "b", "length": 1, "score": 1.0}]
    metrics = summarize(rows, ["a", "b"], [1])
    assert metrics["score"] == pytest.approx(0.75) and metrics["score_a"] == 0.5 and metrics["score_1"] == 0.75


@pytest.mark.slow
@haystack
def test_generation_is_deterministic_and_seeded(tokenizer):
    items = [RulerJob.create(DYNAMIC, tokenizer, lengths="512", n=2, seed=seed).items() for seed in (0, 0, 1)]
    assert items[0] == items[1]
    assert all(a.context != b.context and a.answers != b.answers for a, b in zip(items[0], items[2], strict=True))
    assert [i.key for i in items[0]] == [f"{t}:512:{i}" for t in TASKS for i in range(2)]


@haystack
def test_items_hold_their_answers_at_the_asked_length(tokenizer):
    job = RulerJob.create(DYNAMIC, tokenizer, lengths="1024", n=2, seed=3)
    for item in job.items():
        compressed, after = prompt_segments(tokenizer, item, "question_after")
        assert abs(len(compressed) + len(after) - 1024) <= 0.05 * 1024, item.key
        if item.task.startswith("niah"):
            needles = re.findall(r"One of the special magic numbers for (\S+) is: (\d{7})\.", item.context)
            assert len(needles) == (1 if item.task == "niah_single" else 4)
            asked = {v for k, v in needles if k in item.question}
            assert set(item.answers) == asked and len(item.answers) == (4 if item.task != "niah_single" and
                                                                       item.task != "niah_multikey" else 1)  # fmt: skip
        elif item.task == "vt":
            value = re.search(r"the value (\d+)", item.question).group(1)
            assert f"VAR {item.answers[0]} = {value}." in item.context
            for a, b in zip(item.answers, item.answers[1:], strict=False):
                assert f"VAR {b} = VAR {a}." in item.context
        else:
            words = re.findall(r"^\d+\. (\w+)$", item.context, re.M) if item.task == "cwe" else \
                item.context.split("\n", 1)[1].split(" .... ")  # fmt: skip
            counts = {w: words.count(w) for w in set(words)}
            least_asked = min(counts[a] for a in item.answers)
            assert all(c < least_asked for w, c in counts.items() if w not in item.answers), item.key


@haystack
def test_protocols_split_the_prompt(tokenizer):
    item = RulerJob.create(DYNAMIC, tokenizer, lengths="512", tasks="niah_single", n=1).items()[0]
    compressed, after = prompt_segments(tokenizer, item, "question_after")
    whole, nothing = prompt_segments(tokenizer, item, "question_in_prompt")
    assert nothing == [] and item.question not in tokenizer.decode(compressed)
    assert tokenizer.decode(after).strip().startswith(item.question)
    assert tokenizer.decode(whole).endswith(item.answer_prefix)
    assert abs(len(whole) - len(compressed) - len(after)) <= 2


@haystack
def test_bad_options(tokenizer, tmp_path):
    with pytest.raises(ValueError, match="--tasks: 'qa' is not one of"):
        RulerJob.create(DYNAMIC, tokenizer, tasks="niah_single,qa")
    with pytest.raises(ValueError, match="--protocol must be one of question_after, question_in_prompt"):
        RulerJob.create(DYNAMIC, tokenizer, protocol="before")
    with pytest.raises(ValueError, match=r"--lengths: 100 is out of range"):
        RulerJob.create(DYNAMIC, tokenizer, lengths="100")
    with pytest.raises(ValueError, match="--n must be an integer >= 1"):
        RulerJob.create(DYNAMIC, tokenizer, n=0)
    with pytest.raises(ValueError, match="--kind ruler does not take --depths"):
        KINDS["ruler"].prepare({"depths": "1"}, None)
    from h2o_kv.eval.cli import app

    result = CliRunner().invoke(app, ["ruler", "--policy", "h2o", "--budget", "0.2", "--protocol", "x"])
    assert result.exit_code == 2 and "--protocol must be one of" in result.output


@pytest.mark.slow
@haystack
def test_run_resumes_and_records(default_model, tmp_path):
    model, tokenizer = default_model
    job = RulerJob.create(KVSetting.of("h2o", budget=0.2), tokenizer, lengths="512", tasks="niah_single", n=2)
    path = tmp_path / "r.json"
    log = item_log_path(path)
    first = run_ruler(job, model, tokenizer, path, model_name="m", keep_item_log=True)
    assert first["kind"] == "ruler" and first["n"] == 2 and log.exists()
    assert first["kv_kept_ratio"] == pytest.approx(0.2, abs=0.02)
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    rows[1]["answer"], rows[1]["score"] = "resumed", 0.5  # a finished item is not run again
    log.write_text("".join(json.dumps(r) + "\n" for r in rows))
    again = run_ruler(job, model, tokenizer, path, model_name="m")
    assert again["items"][0]["answer"] == "resumed" and not log.exists()
    assert again["metrics"]["score"] == pytest.approx((0.5 + first["items"][1]["score"]) / 2)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--protocol", "question_after"], "--protocol question_after: a server request compresses its whole prompt"),
        (["--reconstruct", "max"], "--reconstruct: the reconstruction pass cannot run in a server request"),
        (["--policy", "ada_h2o"], "gives each KV head its own budget (Ada-KV), which the serving backend"),
        (["--policy", "global_h2o"], "shares one budget across all layers, which the serving backend does not"),
        ([], "--server http://127.0.0.1:9: no OpenAI-compatible server answers there"),
    ],
)
def test_server_refusals_are_one_line_before_any_work(args, message):
    """``--server``: what a server request cannot run is refused, naming the option; so is a server that is not
    there (port 9: nothing listens). The items never start."""
    from h2o_kv.eval.cli import app

    base = ["ruler", "--server", "http://127.0.0.1:9", "--policy", "h2o", "--budget", "0.2",
            "--protocol", "question_in_prompt"]  # fmt: skip
    result = CliRunner().invoke(app, base + args)
    assert result.exit_code == 2 and message in result.output and len(result.output.strip().splitlines()) == 1
