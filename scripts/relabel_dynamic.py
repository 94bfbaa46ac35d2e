"""One-off migration of the result files written before the KV-setting change (run once; idempotent).

Before it, ``full`` named two different baselines: the stock ``DynamicCache`` (``eval tasks|xsum|needle`` and
``bench``) and ``H2OCache(policy="full")`` (``eval ppl`` and the streaming runs). The stock cache is now ``dynamic``.
This script relabels the files that meant the stock cache, and changes nothing else - every number stays as it was:

* ``results/eval-tasks/*_full.json`` -> ``*_dynamic.json``: ``policy`` ``dynamic``, ``bounded: false``, and the
  recorded command rewritten to the one that reruns it now (``--policy dynamic``, the new file name);
* ``results/bench/*.json`` with a legacy ``meta``: the layout of a bench record (``runs`` + ``records``; the old
  ``meta`` becomes ``runs[0]``, the command of the last invocation that wrote the file), ``full`` -> ``dynamic`` in
  settings, keys, memory limits and the command, and the recorded ``h2o-kv bench bench run`` (a bug: it does not run)
  -> ``h2o-kv bench run``;
* ``results/eval/ppl/*/sweep.json`` -> ``sweep-legacy.json`` in the layout of a ``sweep`` record.

Each migrated record says so in ``migrated``. ``eval ppl`` and streaming results keep ``full``: they ran
``H2OCache(policy="full")``.

    python scripts/relabel_dynamic.py
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

HERE = Path(__file__).parent.parent / "results"
NOTE = "relabelled by scripts/relabel_dynamic.py: 'full' meant the stock DynamicCache, now 'dynamic'; numbers untouched"


def save(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=1) + "\n")


def command(text: str) -> str:
    text = text.replace("h2o-kv bench bench ", "h2o-kv bench ")
    text = re.sub(r"--policy full\b", "--policy dynamic", text)
    text = re.sub(r"(--policies \S*?)\bfull\b", r"\1dynamic", text)
    text = re.sub(r"--memory-limit full@", "--memory-limit dynamic@", text)
    return re.sub(r"_full\.json\b", "_dynamic.json", text)


def eval_tasks() -> None:
    for path in sorted((HERE / "eval-tasks").glob("*_full.json")):
        data = json.loads(path.read_text())
        assert data["policy"] == "full" and data["kind"] in ("tasks", "xsum", "needle"), path
        data.update(policy="dynamic", bounded=False, command=command(data["command"]), migrated=NOTE)
        target = path.with_name(path.name.replace("_full.json", "_dynamic.json"))
        subprocess.run(["git", "mv", str(path), str(target)], check=True)
        save(target, data)


def bench() -> None:
    for path in sorted((HERE / "bench").glob("*.json")):
        data = json.loads(path.read_text())
        if "meta" not in data:
            continue
        meta = data["meta"]
        machine = meta.pop("machine")
        run = {
            "command": command(meta.pop("command")),
            "fused_cpu_kernels": machine.pop("fused_cpu_kernels", None),
            "versions": {k: machine.pop(k) for k in ("python", "torch", "transformers", "kvpress") if k in machine},
            "machine": machine,
            **meta,
            "migrated": NOTE + "; the legacy file kept only the command of the last invocation that wrote into it",
        }
        for record in data["records"]:
            if record["config"]["policy"] == "full":
                record["config"]["policy"] = "dynamic"
                record["key"] = "dynamic" + record["key"][len("full") :]
            if str(record.get("memory_limit", "")).startswith("full@"):
                record["memory_limit"] = "dynamic@" + record["memory_limit"][len("full@") :]
            record["run"] = 0
        save(path, {"schema": 1, "kind": "bench", "runs": [run], "records": data["records"]})


def sweeps() -> None:
    for path in sorted((HERE / "eval" / "ppl").glob("*/sweep.json")):
        data = json.loads(path.read_text())
        manifest = {
            "schema": 1, "kind": "sweep", "evaluation": data["kind"], "model": data["model"],
            "options": data["options"], "settings": data["policies"], "budgets": data["budgets"],
            "migrated": "the legacy sweep.json (the last sweep into this folder), renamed by "
            "scripts/relabel_dynamic.py",
        }  # fmt: skip
        target = path.with_name("sweep-legacy.json")
        subprocess.run(["git", "mv", str(path), str(target)], check=True)
        save(target, manifest)


if __name__ == "__main__":
    eval_tasks()
    bench()
    sweeps()
