"""Run one benchmark measurement in this (fresh) process and print its result as one JSON line.

``python -m h2o_kv.bench.worker '<json>'`` with keys ``model``, ``device``, ``dtype``, ``threads`` and ``config``
(a :class:`~h2o_kv.bench.harness.BenchConfig` as a dict). A fresh process per measurement makes the process's
peak RSS attributable to one configuration.
"""

from __future__ import annotations

import json
import sys

RESULT_PREFIX = "H2O_KV_BENCH_RESULT "


def run_request(request: dict) -> dict:
    import torch
    from transformers.utils import logging as hf_logging

    from .harness import BenchConfig, measure
    from .workload import load_bench_model

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    if request.get("threads"):
        torch.set_num_threads(int(request["threads"]))
    lm = load_bench_model(request.get("model"), device=request.get("device"), dtype=request.get("dtype"))
    result = measure(lm, BenchConfig(**request["config"]), warmup=request.get("warmup", True))
    result.update(model_info(lm))
    return result


def source_fingerprint() -> str:
    """SHA-1 (12 hex digits) of the h2o_kv package's Python sources: which code a measurement ran."""
    import hashlib
    import pathlib

    root = pathlib.Path(__file__).resolve().parents[1]
    digest = hashlib.sha1()
    for path in sorted(root.rglob("*.py")):
        digest.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:12]


def model_info(lm) -> dict:
    return {
        "code_sha1": source_fingerprint(),
        "model": lm.name,
        "random_init": lm.random_init,
        "device": str(lm.device),
        "dtype": str(lm.dtype).removeprefix("torch."),
        "weight_bytes": lm.weight_bytes(),
        "tokenizer": getattr(lm.tokenizer, "name", None) or type(lm.tokenizer).__name__,
    }


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m h2o_kv.bench.worker '<request json>'", file=sys.stderr)
        return 2
    result = run_request(json.loads(argv[0]))
    print(RESULT_PREFIX + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
