"""The scripts around the results: ``scripts/eval_tasks_run.sh`` reports a failed run in its exit status, and the
kvpress peer tests fail (instead of skipping) where CI requires the peer."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RUN_SH = ROOT / "scripts" / "eval_tasks_run.sh"


def run_sh(tmp_path, what: str, evaluate: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OUT": str(tmp_path), "EVAL": evaluate, "LOCK": str(tmp_path / "lock")}
    return subprocess.run(["bash", str(RUN_SH), what], env=env, capture_output=True, text=True)


def test_run_sh_fails_when_a_run_fails(tmp_path):
    failed = run_sh(tmp_path, "xsum200", "false")
    assert failed.returncode == 1
    assert "2 run(s) failed" in failed.stderr and "--policy dynamic" in failed.stderr
    assert run_sh(tmp_path, "xsum200", "true").returncode == 0
    (tmp_path / "xsum200_dynamic.json").write_text("{}")  # an existing result is skipped, not rerun
    partly = run_sh(tmp_path, "xsum200", "false")
    assert partly.returncode == 1 and "1 run(s) failed" in partly.stderr and "exists" in partly.stdout
    assert run_sh(tmp_path, "everything", "true").returncode == 2


@pytest.mark.skipif(importlib.util.find_spec("kvpress") is not None, reason="checks an environment without kvpress")
def test_peer_tests_fail_where_the_peer_is_required():
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "H2O_KV_REQUIRE_PEERS": "1"}
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(ROOT / "tests" / "test_peers.py")]
    required = subprocess.run(command, env=env, capture_output=True, text=True, cwd=ROOT / "tests")
    assert required.returncode != 0 and "H2O_KV_REQUIRE_PEERS=1 but kvpress is not installed" in required.stdout
    env.pop("H2O_KV_REQUIRE_PEERS")
    optional = subprocess.run(command, env=env, capture_output=True, text=True, cwd=ROOT / "tests")
    assert optional.returncode in (0, 5) and "1 skipped" in optional.stdout  # 5: pytest ran no test


def test_ci_requires_the_peer_in_its_kvpress_job():
    job = (ROOT / ".ci" / "run").read_text().split('job "2/4')[1].split('job "3/4')[0]
    assert "H2O_KV_REQUIRE_PEERS=1" in job and "tests/test_peers.py" in job


def test_quant_run_eval_reports_failures_and_skips_finished_cells(tmp_path):
    """``scripts/quant_eval.sh``: a failed cell fails the script (named), a finished one is not rerun."""
    script = ROOT / "scripts" / "quant_eval.sh"

    def run(what: str, evaluate: str, only: str = "") -> subprocess.CompletedProcess:
        env = {**os.environ, "OUT": str(tmp_path), "EVAL": evaluate, "ONLY": only}
        return subprocess.run(["bash", str(script), what], env=env, capture_output=True, text=True)

    failed = run("xsum", "false", "h2o-kv4 dynamic-kv4")
    assert failed.returncode == 1 and "FAILED: xsum200 h2o-kv4" in failed.stderr
    assert "FAILED: xsum200 dynamic-kv4" in failed.stderr and "h2o-kv8" not in failed.stderr
    (tmp_path / "xsum200_h2o-kv4.json").write_text("{}")
    partly = run("xsum", "false", "h2o-kv4")
    assert partly.returncode == 0 and "h2o-kv4" not in partly.stdout + partly.stderr
    assert run("all", "true").returncode == 0 and run("everything", "true").returncode == 2
