"""The quality leaderboard of the README (issue 12): KV settings x benchmarks at one budget, from the result records.

    python scripts/leaderboard.py --benchmarks "(10),needle,XSUM,lm-eval" --plot results/quality/leaderboard.png \
        > results/quality/leaderboard.md                                                          # the first board
    python scripts/leaderboard.py --benchmarks "(100,(40" --plot results/quality/n100/leaderboard.png  # 100 items

Each cell is the setting's score and its paired change against the full cache (``dynamic``) over the same items,
with the 95% interval; an empty cell was not run. Benchmarks and their records:

* RULER 1k, 100 items (20 per task), both protocols (``results/quality/n100/question_after``,
  ``.../question_in_prompt``) and the question-in-prompt items sent through ``h2o-kv serve``'s OpenAI API
  (``.../question_in_prompt/server``, its own full cache as the baseline); ``cwe``/``fwe`` at 1k, 40 items
  (``results/quality/words``); 2k and 4k on an H200 (``results/quality/h200``, finished cells only); 2k, both
  protocols, and 4k on 40 items (8 per task; 20% in both protocols, 10% in the prompt), on this CPU
  (``results/quality/cpu``); and the first 10-item runs, 1k and 2k (``results/quality/ruler-eval``,
  ``results/quality/2k/ruler-eval``): suite mean over tasks of ``string_match_all``; the change is the mean over
  tasks of item-by-item differences;
* needle, question in the prompt, 1k tokens (``results/eval-tasks/needle_*``, ``results/quality/needle``): the
  five depth cells at 1,024 tokens;
* XSUM, 50 articles (``results/eval-tasks/xsum_*``, ``results/quality/eval/xsum_*``): ROUGE-2 (x100);
* lm-eval tasks, 5-shot, 100 items each (``results/eval-tasks/tasks_*``, prefill protocol;
  ``results/quality/eval/tasks_*``): mean accuracy (x100), the change averaged over tasks.

Rows are ``setting @ budget``, every budget found (``--budgets 0.1,0.2`` selects). A RULER column's header ends with
its items per setting; a cell whose record (or its baseline's) names no commit, or a dirty tree whose sources no commit
holds, is marked ``†``.

Reads only the JSON records (each holds its command, commit and versions); prints markdown, draws the plot.
"""

from __future__ import annotations

import argparse
import json
import subprocess
from collections.abc import Callable
from functools import lru_cache
from pathlib import Path

from h2o_kv.eval.report import row_name
from h2o_kv.harness.tables import Estimate, average, markdown, mean, over_groups, paired

BASELINE = "dynamic"


def _records(*patterns: str) -> list[dict]:
    paths = sorted(p for pattern in patterns for p in Path().glob(pattern))
    return [json.loads(p.read_text()) for p in paths]


def ruler(record: dict, base: dict) -> tuple[Estimate, Estimate]:
    tasks = record["tasks"]
    key = lambda i: (i["task"], i["length"], i["index"])  # noqa: E731
    base_score = {key(i): i["score"] for i in base["items"]}
    by_task = {t: [i for i in record["items"] if i["task"] == t] for t in tasks}
    value = over_groups([[i["score"] for i in by_task[t]] for t in tasks])
    change = over_groups([[i["score"] - base_score[key(i)] for i in by_task[t]] for t in tasks], "paired difference")
    return value, change


def needle(record: dict, base: dict) -> tuple[Estimate, Estimate]:
    cells = lambda r: {(c["length"], c["depth"]): c["score"] for c in r["cells"] if c["length"] == 1024}  # noqa: E731
    mine, theirs = cells(record), cells(base)
    order = sorted(mine)
    return mean([mine[k] for k in order]), paired([mine[k] for k in order], [theirs[k] for k in order])


def xsum(record: dict, base: dict) -> tuple[Estimate, Estimate]:
    scores = [100 * x for x in record["items"]["rouge2"]]
    return mean(scores), paired(scores, [100 * x for x in base["items"]["rouge2"]])


def tasks(record: dict, base: dict) -> tuple[Estimate, Estimate]:
    names = [t for t in base["tasks"] if t in record["tasks"]]
    acc = lambda r, t: [100 * x for x in r["items"][t]["acc"]]  # noqa: E731
    value = average([mean(acc(record, t)) for t in names])
    return value, average([paired(acc(record, t), acc(base, t)) for t in names])


N100 = "results/quality/n100"
H200 = "results/quality/h200"  # scripts/gpu_quality.sh on one H200 (docs/quality.md, fifth step)
BENCHMARKS: dict[str, tuple[tuple[str, ...], Callable]] = {
    "RULER 1k, question after (100)": ((f"{N100}/question_after/ruler-eval/*.json",), ruler),
    "RULER 1k, question in prompt (100)": ((f"{N100}/question_in_prompt/ruler-eval/*.json",), ruler),
    "same, through h2o-kv serve (100)": ((f"{N100}/question_in_prompt/server/ruler-eval/*.json",), ruler),
    "RULER 1k cwe+fwe, question after (40)": (("results/quality/words/question_after/ruler-eval/*.json",), ruler),
    "RULER 1k cwe+fwe, question in prompt (40)": (
        ("results/quality/words/question_in_prompt/ruler-eval/*.json",),
        ruler,
    ),
    "RULER 2k, question after (100, H200)": ((f"{H200}/2048/question_after/ruler-eval/*.json",), ruler),
    "RULER 2k, question in prompt (100, H200)": ((f"{H200}/2048/question_in_prompt/ruler-eval/*.json",), ruler),
    "RULER 2k, question after (100, CPU)": (("results/quality/cpu/2048/question_after/ruler-eval/*.json",), ruler),
    "RULER 2k, question in prompt (100, CPU)": (
        ("results/quality/cpu/2048/question_in_prompt/ruler-eval/*.json",),
        ruler,
    ),
    "RULER 4k, question after (100, H200)": ((f"{H200}/4096/question_after/ruler-eval/*.json",), ruler),
    "RULER 4k, question after (40, CPU)": (("results/quality/cpu/4096/question_after/ruler-eval/*.json",), ruler),
    "RULER 4k, question in prompt (40, CPU)": (
        ("results/quality/cpu/4096/question_in_prompt/ruler-eval/*.json",),
        ruler,
    ),
    "RULER 1k, question after (10)": (("results/quality/ruler-eval/*.json",), ruler),
    "RULER 2k, question after (10)": (("results/quality/2k/ruler-eval/*.json",), ruler),
    "needle 1k": (("results/eval-tasks/needle_*.json", "results/quality/needle/*.json"), needle),
    "XSUM-50 ROUGE-2": (("results/eval-tasks/xsum_*.json", "results/quality/eval/xsum_*.json"), xsum),
    "lm-eval tasks mean acc": (("results/eval-tasks/tasks_[!p]*.json", "results/quality/eval/tasks_*.json"), tasks),
}


def trusted(record: dict) -> bool:
    """Whether the record names the commit that ran it from a clean tree, or sources (``src_tree``) that a commit of
    this history holds (a copied tree with an older ``.git``, as on the GPU machine); else it is marked."""
    git = record.get("git") or {}
    if git.get("commit") is None:
        return False
    return git.get("dirty") is False or git.get("src_tree") in committed_src_trees()


@lru_cache(maxsize=1)
def committed_src_trees() -> frozenset[str]:
    """The tree ids of ``src/`` at every commit reachable from HEAD."""
    git = ["git", "-C", str(Path(__file__).resolve().parents[1])]
    commits = subprocess.run([*git, "rev-list", "HEAD"], capture_output=True, text=True).stdout.split()
    trees = subprocess.run(
        [*git, "cat-file", "--batch-check=%(objectname)"],
        input="".join(f"{commit}:src\n" for commit in commits),
        capture_output=True,
        text=True,
    ).stdout.split()
    return frozenset(tree for tree in trees if len(tree) == 40)


Cell = tuple[Estimate, Estimate | None, bool]  # score, paired change vs the full cache, trusted record(s)


def collect(budgets: list[float] | None = None) -> dict[str, dict[str, Cell]]:
    """{benchmark: {"setting @ B%": (score, paired change vs the full cache, trusted)}} for the records at
    ``budgets`` (all budgets when ``None``)."""
    table: dict[str, dict[str, Cell]] = {}
    for bench, (patterns, score) in BENCHMARKS.items():
        found = sorted((r for r in _records(*patterns) if r.get("kind") != "sweep"), key=trusted)  # trusted last
        base = next((r for r in reversed(found) if r["policy"] == BASELINE and not r.get("kv_bits")), None)
        if base is None:
            continue
        cells = {BASELINE: (score(base, base)[0], None, trusted(base))}
        for record in found:  # a setting measured twice: the trusted record replaces a legacy one
            if record["policy"] != BASELINE and (budgets is None or record.get("budget") in budgets):
                setting = f"{row_name(record)} @ {100 * record['budget']:g}%"
                cells[setting] = (*score(record, base), trusted(record) and trusted(base))
        table[bench] = cells
    return table


def is_press(setting: str) -> bool:
    """A kvpress press (``kvpress:kvzip``); h2o-kv's settings may hold a colon too (``snapkv:kernel=21``)."""
    return setting.startswith("kvpress:")


def order(setting: str) -> tuple:
    """The baseline first, then by budget, h2o-kv's settings before the presses, by name."""
    if setting == BASELINE:
        return (0,)
    name, budget = setting.rsplit(" @ ", 1)
    return (1, float(budget.rstrip("%")), is_press(name), name)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budgets", default=None, help="comma-separated ratios (default: every budget found)")
    parser.add_argument("--settings", default=None, help="comma-separated setting names (default: every one found)")
    parser.add_argument("--benchmarks", default=None, help="comma-separated: only benchmarks whose name holds one")
    parser.add_argument("--plot", type=Path, default=None)
    args = parser.parse_args()
    table = collect(None if args.budgets is None else [float(b) for b in args.budgets.split(",")])
    wanted = None if args.benchmarks is None else args.benchmarks.split(",")
    table = {bench: cells for bench, cells in table.items() if wanted is None or any(w in bench for w in wanted)}
    settings = sorted({s for cells in table.values() for s in cells}, key=order)
    if args.settings is not None:
        wanted = {BASELINE, *args.settings.split(",")}
        settings = [s for s in settings if s.rsplit(" @ ", 1)[0] in wanted]
    rows = []
    for setting in settings:
        row = [setting]
        for cells in table.values():
            if setting not in cells:
                row.append("")
                continue
            value, change, clean = cells[setting]
            row.append(
                f"{value.value:.2f}"
                + ("" if change is None else f" ({change.format(digits=2, sign=True, interval=True)})")
                + ("" if clean else " †")
            )
        rows.append(row)
    print("\n".join(markdown(["setting", *table], rows)))
    print("\n(N): items per setting. †: a record (or its baseline's) from a dirty tree or without a commit (legacy).")
    if args.plot is not None:
        plot(table, settings, args.plot)


def plot(table, settings, path: Path) -> None:
    """One panel per benchmark with a bounded setting: each one's paired change vs the full cache, 95% interval."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bounded = [s for s in settings if s != BASELINE]
    table = {bench: cells for bench, cells in table.items() if len(cells) > 1}  # a column with only the full cache
    fig, axes = plt.subplots(
        1, len(table), figsize=(4 * len(table), 0.28 * len(bounded) + 1.5), sharey=True, squeeze=False
    )
    axes = axes[0]
    for ax, (bench, cells) in zip(axes, table.items(), strict=True):
        for y, setting in enumerate(bounded):
            if setting not in cells:
                continue
            change = cells[setting][1]
            low, high = change.interval() or (change.value, change.value)
            peer = is_press(setting)
            ax.errorbar(change.value, y, xerr=[[change.value - low], [high - change.value]], fmt="s" if peer else "o",
                        color="tab:gray" if peer else "tab:blue", capsize=2, markersize=4)  # fmt: skip
        ax.axvline(0, color="black", linewidth=0.8)
        ax.set_title(bench, fontsize=9)
        ax.set_xlabel(f"change vs {BASELINE} (full cache)")
    axes[0].set_yticks(range(len(bounded)), bounded, fontsize=7)
    axes[0].invert_yaxis()
    fig.suptitle("paired change vs the full cache, 95% intervals (kvpress presses gray squares)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
