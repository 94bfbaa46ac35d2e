"""XSUM summarization and needle-in-a-haystack under a KV budget: input checks, ROUGE, needle placement, and small
real runs on the default model (resumable, with a heatmap)."""

from __future__ import annotations

import json

import pytest
from helpers import needs_data
from typer.testing import CliRunner

from h2o_kv.eval.needle import HAYSTACK_DIR, KEYWORDS, NEEDLE, NeedleJob, plot_heatmaps, run_needle, score_answer
from h2o_kv.eval.results import item_log_path
from h2o_kv.eval.runner import KVRunner
from h2o_kv.eval.xsum import XSUM_FILE, XsumJob, read_xsum, rouge_scores, run_xsum
from h2o_kv.harness.setting import KVSetting

pytest.importorskip("rouge_score", reason="h2o-kv eval xsum needs rouge-score: pip install 'h2o-kv[eval]'")
DYNAMIC = KVSetting("dynamic")


def _write(path, rows):
    path.write_text("".join((row if isinstance(row, str) else json.dumps(row)) + "\n" for row in rows))
    return path


ITEM = {"article": "###\nArticle: x\n\nSummarize the above article in 1 sentence.\n", "summary_gt": "y"}


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ("{oops", r"bad.jsonl:1 is not valid JSON"),
        ({"article": "a"}, "needs string fields 'article' and 'summary_gt'"),
        ({**ITEM, "max_tokens": 0}, "max_tokens must be a positive integer"),
        ({**ITEM, "stop": [""]}, "stop must be a list of non-empty strings"),
    ],
)
def test_bad_xsum_file(tmp_path, row, message):
    with pytest.raises(ValueError, match=message):
        read_xsum(_write(tmp_path / "bad.jsonl", [row]))


def test_xsum_options_fail_early(tmp_path):
    with pytest.raises(FileNotFoundError, match="missing.jsonl"):
        XsumJob.create(DYNAMIC, path=tmp_path / "missing.jsonl")
    with pytest.raises(ValueError, match="--limit must be an integer >= 1"):
        XsumJob.create(DYNAMIC, limit=0, path=_write(tmp_path / "ok.jsonl", [ITEM]))


@needs_data(XSUM_FILE)
def test_the_papers_xsum_file():
    items = read_xsum()
    assert len(items) == 1000 and all(i["max_tokens"] == 64 and i["stop"] == ["###"] for i in items)
    assert items[0]["summary"].startswith('There is a "chronic" need for more housing for prison leavers')


def test_rouge():
    assert rouge_scores("the cat sat on the mat", "the cat sat on the mat") == pytest.approx(
        {"rouge1": 1.0, "rouge2": 1.0, "rougeL": 1.0}
    )
    assert rouge_scores("dogs bark loudly", "the cat sat on the mat")["rouge1"] == 0.0
    scores = rouge_scores("the cats were sitting on a mat", "the cat sat on the mat")  # stemming: cats -> cat
    assert 0 < scores["rouge2"] < scores["rouge1"] < 1


@pytest.mark.slow
def test_xsum_run_and_resume(default_model, tmp_path, monkeypatch):
    model, tokenizer = default_model
    rows = [
        {
            "article": "###\nArticle: The city council of Springfield voted on Monday to build a new public library "
            "next to the central train station. Construction will start in May and cost 12 million dollars."
            "\n\nSummarize the above article in 1 sentence.\n",
            "summary_gt": "Springfield will build a new library next to its train station.",
            "max_tokens": 24,
            "stop": ["###", "\n"],
        },
        {**ITEM, "max_tokens": 6},
    ]
    job = XsumJob.create(KVSetting.of("h2o", budget=0.5), path=_write(tmp_path / "x.jsonl", rows))
    out = tmp_path / "xsum.json"
    record = run_xsum(job, model, tokenizer, out, model_name="SmolLM2-135M-Instruct", keep_item_log=True)
    saved = json.loads(out.read_text())
    assert (
        saved["kind"] == "xsum" and saved["policy"] == "h2o" and saved["n"] == 2 and saved["primary_metric"] == "rouge2"
    )
    assert len(saved["predictions"]) == 2 and all("\n" not in p for p in saved["predictions"])
    assert 0 < saved["metrics"]["rouge1"] <= 1 and saved["metrics"]["rouge2_stderr"] >= 0
    assert saved["metrics"]["rouge1"] == pytest.approx(sum(saved["items"]["rouge1"]) / 2)
    assert saved["kv_kept_ratio"] == pytest.approx(0.5, abs=0.03)
    monkeypatch.setattr(KVRunner, "prefill", lambda *a, **k: pytest.fail("resumed run recomputed an item"))
    again = run_xsum(job, model, tokenizer, out, model_name="SmolLM2-135M-Instruct")
    assert again["metrics"] == record["metrics"] and not item_log_path(out).exists()


def test_needle_score():
    assert score_answer("You should eat a sandwich and sit in Dolores Park.") == 1.0
    assert score_answer("Visit DOLORES   park") == 0.5
    assert score_answer("Go to the Golden Gate Bridge.") == 0.0
    assert len(KEYWORDS) == 2


@needs_data(HAYSTACK_DIR)
def test_needle_grid_checks_and_placement(default_model, tmp_path):
    _, tokenizer = default_model
    with pytest.raises(ValueError, match=r"--depths: 150 is out of range \[0, 100\]"):
        NeedleJob.create(DYNAMIC, "512", "0,150", tokenizer)
    with pytest.raises(ValueError, match="--lengths: 9000 is out of range"):
        NeedleJob.create(DYNAMIC, "512,9000", "0", tokenizer, max_length=8192)
    with pytest.raises(ValueError, match="--lengths must be comma-separated integers"):
        NeedleJob.create(DYNAMIC, "1k", "0", tokenizer)
    with pytest.raises(FileNotFoundError, match="holds no .txt essays"):
        NeedleJob.create(DYNAMIC, "512", "0", tokenizer, folder=tmp_path)
    job = NeedleJob.create(DYNAMIC, "300,600", "0,50,100", tokenizer)
    for length in (300, 600):
        start, _ = job.document(tokenizer, length, 0)
        assert start.startswith(" " + NEEDLE)
        end, _ = job.document(tokenizer, length, 100)
        assert end.endswith(NEEDLE)
        middle, at = job.document(tokenizer, length, 50)
        before = middle.split(NEEDLE)[0]
        assert before.rstrip().endswith(".") and 0.3 * length < at <= 0.5 * length
        assert abs(len(tokenizer.encode(middle, add_special_tokens=False)) - length) <= 4


@pytest.mark.slow
@needs_data(HAYSTACK_DIR)
def test_needle_run_dynamic_finds_it_and_local_loses_it(default_model, tmp_path):
    model, tokenizer = default_model
    job = NeedleJob.create(DYNAMIC, "400", "0,100", tokenizer)
    full = run_needle(job, model, tokenizer, tmp_path / "full.json", model_name="m")
    assert [c["score"] for c in full["cells"]] == [1.0, 1.0]  # the format the default model solves
    job = NeedleJob.create(KVSetting.of("local", budget=0.1), "400", "0", tokenizer)
    local = run_needle(job, model, tokenizer, tmp_path / "local.json", model_name="m", png=tmp_path / "n.png")
    assert local["cells"][0]["score"] < 1.0  # the needle at depth 0 is outside a 10% recent window
    assert local["kv_kept_ratio"] == pytest.approx(0.1, abs=0.02)
    assert (tmp_path / "n.png").read_bytes()[:4] == b"\x89PNG"
    plot_heatmaps([full, local], tmp_path / "both.png")
    assert (tmp_path / "both.png").stat().st_size > 1000


def test_needle_cli_rejects_bad_depths():
    from h2o_kv.eval.cli import app

    result = CliRunner().invoke(app, ["needle", "--policy", "h2o", "--budget", "0.2", "--depths", "0,101"])
    assert result.exit_code == 2 and "--depths: 101 is out of range" in result.output
