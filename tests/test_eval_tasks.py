"""lm-eval tasks under a KV budget: the batched scoring equals token-by-token decoding, the local task YAMLs read
the shared data correctly, bad input fails early, and a real lm-eval run writes a resumable result."""

from __future__ import annotations

import json
import math
import re

import pytest
import torch
from helpers import needs_data
from reference import reference_logits
from typer.testing import CliRunner

from h2o_kv import H2OCache, load_model
from h2o_kv.eval.options import kv_setting
from h2o_kv.eval.results import item_log_path
from h2o_kv.eval.runner import KVRunner, score_continuations
from h2o_kv.eval.tasks import DEFAULT_TASKS, TasksJob, run_tasks
from h2o_kv.harness.setting import KVSetting
from h2o_kv.hf.compat import cache_kwargs

pytest.importorskip("lm_eval", reason="h2o-kv eval tasks needs lm-eval: pip install 'h2o-kv[eval]'")
pytestmark = pytest.mark.filterwarnings("ignore:H2OCache")
TASK_DATA = ("rte/val.jsonl", "lambada/lambada_test.jsonl", "piqa/dev.jsonl")
DYNAMIC = KVSetting("dynamic")


@pytest.fixture(scope="module")
def tiny_llama(tiny_models):
    return load_model(tiny_models["llama"], device="cpu")[0]


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(3, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@torch.no_grad()
def token_by_token(model, context, continuation, policy, heavy, recent, paper) -> float:
    """log p(continuation | context): a fresh cache, the context as one prefill (or one token per forward with
    ``paper``), then every continuation token as its own decode step - the slow, obvious way."""
    cache = H2OCache(heavy=heavy, recent=recent, policy=policy)
    if paper:
        for token in context:
            logits = model(torch.tensor([[token]]), **cache_kwargs(cache)).logits[0, -1]
    else:
        logits = model(torch.tensor([context]), **cache_kwargs(cache)).logits[0, -1]
    total = 0.0
    for i, token in enumerate(continuation):
        total += float(torch.log_softmax(logits.float(), -1)[token])
        if i + 1 < len(continuation):
            logits = model(torch.tensor([[token]]), **cache_kwargs(cache)).logits[0, -1]
    return total


@pytest.mark.parametrize("paper", [False, True], ids=["prefill", "paper"])
@pytest.mark.parametrize("policy", ["h2o", "local", "sink", "tova"])
def test_batched_scores_equal_token_by_token(tiny_llama, policy, paper):
    context = _ids(48, 1)
    continuations = [_ids(1, 2), _ids(6, 3), _ids(11, 4)]
    runner = KVRunner(tiny_llama, KVSetting.of(policy, heavy=6, recent=6), paper_protocol=paper)
    scores, session = score_continuations(runner, context, continuations)
    assert session.kept == 12 and session.context_length == 48
    for continuation, (logprob, _) in zip(continuations, scores, strict=True):
        expected = token_by_token(tiny_llama, context, continuation, policy, 6, 6, paper)
        assert logprob == pytest.approx(expected, abs=2e-4)


def test_paper_protocol_matches_slow_reference(tiny_llama):
    """Every token under eviction from the first one == the independent slow reference (tests/reference.py)."""
    context, continuation = _ids(40, 5), _ids(9, 6)
    for policy in ("h2o", "local"):
        runner = KVRunner(tiny_llama, KVSetting.of(policy, heavy=5, recent=5), paper_protocol=True)
        [(logprob, greedy)], _ = score_continuations(runner, context, [continuation])
        logits = reference_logits(tiny_llama, torch.tensor([context + continuation]), 5, 5, policy)
        logp = torch.log_softmax(logits[len(context) - 1 : -1].float(), -1)
        targets = torch.tensor(continuation)
        assert logprob == pytest.approx(float(logp.gather(-1, targets[:, None]).sum()), abs=2e-4)
        assert greedy == bool((logp.argmax(-1) == targets).all())


@torch.no_grad()
@pytest.mark.parametrize("paper", [False, True], ids=["prefill", "paper"])
def test_eviction_changes_scores_and_unbounded_settings_are_the_plain_model(tiny_llama, paper):
    context, continuation = _ids(60, 7), _ids(8, 8)
    plain = torch.log_softmax(tiny_llama(torch.tensor([context + continuation])).logits[0].float(), -1)
    expected = float(plain[len(context) - 1 : -1].gather(-1, torch.tensor(continuation)[:, None]).sum())
    for name in ("dynamic", "full"):  # two different caches, the same numbers (nothing is evicted)
        runner = KVRunner(tiny_llama, KVSetting(name), paper_protocol=paper)
        [(logprob, _)], session = score_continuations(runner, context, [continuation])
        assert logprob == pytest.approx(expected, abs=2e-4) and session.kept == 60
        assert type(session.cache).__name__ == ("DynamicCache" if name == "dynamic" else "H2OCache")
        assert session.cache.get_seq_length() == 60 + 7  # every continuation token kept too
    local = KVRunner(tiny_llama, KVSetting.of("local", heavy=2, recent=2), paper_protocol=paper)
    [(logprob, _)], _ = score_continuations(local, context, [continuation])
    assert abs(logprob - expected) > 1e-3  # a 4-entry window really changes what the model sees


def test_budget_is_a_ratio_of_the_context(tiny_llama):
    runner = KVRunner(tiny_llama, KVSetting.of("h2o", budget=0.2))
    session = runner.prefill(_ids(100, 9))
    assert session.kept == 20  # heavy = recent = floor(0.2 * 100 / 2)
    assert runner.prefill(_ids(4, 9)).kept == 2  # clamped to one heavy and one recent entry (Budget.split)


def test_generate_equals_model_generate(tiny_llama):
    prompt = _ids(40, 10)
    tokens, _ = KVRunner(tiny_llama, KVSetting.of("h2o", heavy=6, recent=6)).generate(prompt, 12)
    out = tiny_llama.generate(
        torch.tensor([prompt]), attention_mask=torch.ones(1, 40, dtype=torch.long), max_new_tokens=12,
        min_new_tokens=12, do_sample=False, **cache_kwargs(H2OCache(heavy=6, recent=6)), pad_token_id=0,
    )  # fmt: skip
    assert tokens == out[0, 40:].tolist()


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (dict(policy="h2o"), "h2o evicts: give budget"),
        (dict(policy="h2o", budget=0.0), "budget must be a ratio in (0, 1]"),
        (dict(policy="h2o", budget=1.5), "budget must be a ratio in (0, 1]"),
        (dict(policy="h2o", budget=0.2, heavy=4, recent=4), "not both"),
        (dict(policy="h2o", heavy=-1, recent=4), "heavy must be an integer >= 0"),
        (dict(policy="h2o", heavy=4), "recent is required"),
        (dict(policy="nope", budget=0.2), "--policy must be one of dynamic, h2o"),
        (dict(policy="full", budget=0.2), "full keeps every entry"),
        (dict(policy="dynamic", heavy=1, recent=1), "dynamic keeps every entry"),
        (dict(policy="h2o", budget=0.2, peer="snapkv"), "replaces --policy"),
        (dict(peer="bogus", budget=0.2), "--peer must be one of"),
    ],
)
def test_bad_kv_settings(options, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        kv_setting(**options)


def test_settings_and_their_record_fields():
    assert kv_setting(budget=0.2).name == "h2o"
    assert kv_setting(peer="tova", budget=0.2).name == "kvpress:tova"
    fields = {name: KVSetting(name).fields() for name in ("dynamic", "full")}
    assert all(f["bounded"] is False and f["budget"] == 1.0 and f["heavy"] is None for f in fields.values())
    assert KVSetting.of("sink", heavy=3, recent=5).fields() == {
        "policy": "sink", "bounded": True, "budget": None, "heavy": 3, "recent": 5, "peer": False,
    }  # fmt: skip
    assert KVSetting.of("kvpress:knorm", budget=0.5).fields()["peer"] is True
    assert KVSetting.of("kvpress:knorm", budget=0.5).entries(9) == 4  # Budget.entries: 2 * floor(0.5 * 9 / 2)


def test_paper_protocol_needs_an_h2o_kv_cache():
    with pytest.raises(ValueError, match="--paper-protocol needs an h2o-kv policy"):
        TasksJob.create("rte", KVSetting.of("kvpress:tova", budget=0.2), paper_protocol=True)


@pytest.mark.slow
@needs_data(*TASK_DATA, "openbookqa/test.tsv", "mathqa/math_qa.jsonl", "hellaswag/hellaswag_val_subset1000.jsonl")
def test_local_task_yamls_read_the_shared_data():
    job = TasksJob.create(",".join(DEFAULT_TASKS), DYNAMIC)
    tasks = job.manager.load(list(DEFAULT_TASKS))["tasks"]
    sizes = {name: len(task.eval_docs) for name, task in tasks.items()}
    assert sizes == {"piqa": 1838, "openbookqa": 500, "rte": 277, "mathqa": 2983, "hellaswag": 1000, "lambada": 5153}

    def first(name):
        task = tasks[name]
        doc = task.eval_docs[0]
        choices = task.doc_to_choice(doc) if task.OUTPUT_TYPE == "multiple_choice" else None
        return task.doc_to_text(doc), task.doc_to_target(doc), choices

    text, target, choices = first("piqa")
    assert text.startswith("Question: How do I ready a guinea pig cage") and target == 0 and len(choices) == 2
    text, target, choices = first("openbookqa")
    assert choices[target] == "quit eating lunch out"  # answer key B of the first test question
    text, target, choices = first("rte")
    assert text.endswith("True or False?\nAnswer:") and choices[target] == "False"  # not_entailment
    text, target, choices = first("mathqa")
    assert text.startswith("Question: a shopkeeper sold") and choices == [
        "30",
        "data inadequate",
        "none of these",
        "38",
    ]
    assert target == 3
    text, target, choices = first("hellaswag")
    assert text.startswith("Pole vault: ") and target == 3 and len(choices) == 4
    text, target, _ = first("lambada")
    assert target == " signs" and not text.endswith(" ")
    data = job.data()
    assert data["files"]["rte/val.jsonl"] == "ab990507bf5f35dc176cba7770a72bfa2c50a88ed72b8cc95cfbf9db95ab1af1"


@needs_data(*TASK_DATA)
def test_bad_task_options_fail_before_any_model_work(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="unknown task.*nope.*available: hellaswag"):
        TasksJob.create("piqa,nope", DYNAMIC)
    with pytest.raises(ValueError, match="--limit must be an integer >= 1"):
        TasksJob.create("rte", DYNAMIC, limit=0)
    with pytest.raises(ValueError, match="--num-fewshot"):
        TasksJob.create("rte", DYNAMIC, num_fewshot=-1)
    with pytest.raises(FileNotFoundError, match="--include-path"):
        TasksJob.create("rte", DYNAMIC, include_path=tmp_path / "missing")
    monkeypatch.setenv("H2O_KV_DATA", str(tmp_path))  # an empty data folder: the file is named
    with pytest.raises(FileNotFoundError, match="rte/val.jsonl"):
        TasksJob.create("rte", DYNAMIC)
    (tmp_path / "rte").mkdir()
    (tmp_path / "rte" / "val.jsonl").write_text('{"premise": "a", "hypothesis": "b", "label": "entailment"}\n{oops\n')
    with pytest.raises(ValueError, match=r"rte/val.jsonl:2 is not valid JSON"):
        TasksJob.create("rte", DYNAMIC)


@pytest.mark.slow
@needs_data(*TASK_DATA)
def test_lm_eval_run_writes_result_and_resumes(default_model, tmp_path, monkeypatch):
    model, tokenizer = default_model
    job = TasksJob.create("rte,lambada", KVSetting.of("h2o", budget=0.2), num_fewshot=1, limit=3)
    out = tmp_path / "h2o.json"
    record = run_tasks(job, model, tokenizer, out, model_name="SmolLM2-135M-Instruct", keep_item_log=True)
    saved = json.loads(out.read_text())
    assert saved["kind"] == "tasks" and saved["policy"] == "h2o" and saved["budget"] == 0.2
    assert saved["num_fewshot"] == 1 and saved["limit"] == 3 and saved["peer"] is False and saved["bounded"] is True
    assert saved["schema"] == 1 and saved["fused_cpu_kernels"] in (True, False) and "lm-eval" in saved["versions"]
    for name in ("rte", "lambada"):
        row = saved["tasks"][name]
        assert row["n"] == 3 and 0 <= row["acc"] <= 1 and row["acc_stderr"] >= 0
        assert saved["metrics"][f"{name}_acc"] == row["acc"] and len(saved["items"][name]["acc"]) == 3
        assert sum(saved["items"][name]["acc"]) / 3 == pytest.approx(row["acc"])
    assert saved["metrics"]["lambada_perplexity"] > 1
    assert saved["kv_kept_ratio"] == pytest.approx(0.2, abs=0.02)
    assert len(item_log_path(out).read_text().splitlines()) == 1 + 3 * 2 + 3  # settings, rte choices, lambada
    # A rerun finds every request in the item log: the model is not run again and the numbers are identical.
    monkeypatch.setattr(KVRunner, "prefill", lambda *a, **k: pytest.fail("resumed run recomputed a request"))
    again = run_tasks(job, model, tokenizer, out, model_name="SmolLM2-135M-Instruct")
    assert again["metrics"] == record["metrics"] and not item_log_path(out).exists()


@needs_data(*TASK_DATA)
def test_user_task_yaml_via_include_path_and_cli(default_model, tmp_path):
    data = tmp_path / "capitals.jsonl"
    rows = [("France", "Paris", "Rome"), ("Italy", "Rome", "Paris"), ("Japan", "Tokyo", "Berlin")]
    data.write_text("".join(json.dumps({"country": c, "right": r, "wrong": w}) + "\n" for c, r, w in rows))
    folder = tmp_path / "tasks"
    folder.mkdir()
    (folder / "capitals.yaml").write_text(
        "task: capitals\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
        f"    test: {data}\noutput_type: multiple_choice\ntest_split: test\n"
        'doc_to_text: "The capital of {{country}} is"\ndoc_to_target: 0\n'
        'doc_to_choice: "{{[right, wrong]}}"\nmetric_list:\n  - metric: acc\n'
    )
    from h2o_kv.eval.cli import app

    out = tmp_path / "capitals.json"
    args = ["tasks", "--tasks", "capitals", "--include-path", str(folder), "--num-fewshot", "0"]
    result = CliRunner().invoke(app, [*args, "--policy", "local", "--budget", "0.5", "--json", str(out)])
    assert result.exit_code == 0, result.output
    saved = json.loads(out.read_text())
    assert saved["tasks"]["capitals"]["n"] == 3 and saved["policy"] == "local"
    command = re.sub(r"^(\w+=\S* )*", "", saved["command"])  # after any VAR=value the record names first
    assert command.startswith("python -m pytest") or command.startswith("python ")  # this process
    assert str(folder / "capitals.yaml") in saved["data"]["files"]
    assert "capitals" in result.output and math.isfinite(saved["metrics"]["mean_acc"])
    bad = CliRunner().invoke(app, ["tasks", "--tasks", "capitals", "--budget", "2"])
    assert bad.exit_code == 2 and "budget must be a ratio in (0, 1]" in bad.output and "Traceback" not in bad.output


@pytest.mark.slow
@needs_data(*TASK_DATA)
def test_sweep_kind_tasks(tmp_path):
    from h2o_kv.eval.kinds import KINDS
    from h2o_kv.eval.runner import ModelHandle
    from h2o_kv.eval.sweep import run_sweep

    assert {"tasks", "xsum", "needle"} <= set(KINDS)
    options = {"tasks": "rte", "limit": "2", "num_fewshot": "0"}
    with pytest.raises(ValueError, match="--kind tasks does not take --bogus"):
        run_sweep("tasks", ["h2o"], [0.5], tmp_path / "bad", {**options, "bogus": "1"}, ModelHandle())
    with pytest.raises(ValueError, match="--limit must be an integer"):
        run_sweep("tasks", ["h2o"], [0.5], tmp_path / "bad", {**options, "limit": "x"}, ModelHandle())
    paths = run_sweep("tasks", ["dynamic", "local"], [0.5], tmp_path / "grid", options, ModelHandle())
    saved = [json.loads(p.read_text()) for p in paths]
    assert [(r["policy"], r["budget"], r["bounded"]) for r in saved] == [("dynamic", 1.0, False), ("local", 0.5, True)]
    assert all(r["tasks"]["rte"]["n"] == 2 for r in saved)
