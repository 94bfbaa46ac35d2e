#!/usr/bin/env bash
# Regenerates every result in results/eval-tasks/ (docs/eval-tasks.md). Each run takes the shared CPU lock and
# resumes from its item log when interrupted; a run whose result JSON exists is skipped. Every run is attempted;
# the script exits non-zero if any of them failed (and names them). `h2o-kv eval X` == `python -m h2o_kv.eval.cli X`.
#   bash scripts/eval_tasks_run.sh [all|tasks|xsum|needle|xsum200|paper]
# Environment: OUT (result folder), EVAL (the eval command), LOCK (flock file), LIMIT, PAPER_LIMIT, XSUM_LIMIT.
# kvpress rows need the peer's own environment (kvpress 0.5.5 pins transformers<5.3; docs/eval-tasks.md, "The kvpress
# peer"): e.g. EVAL="/path/to/peer-venv/bin/python -m h2o_kv.eval.cli" bash scripts/eval_tasks_run.sh tasks
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-results/eval-tasks}
EVAL=${EVAL:-python -m h2o_kv.eval.cli}
LOCK=${LOCK:-/tmp/h2o-cpu.lock}
FAILED=()
run() {  # skips a run whose result JSON exists (the last argument)
  if [[ -f "${@: -1}" ]]; then echo "== exists: ${@: -1}"; return; fi
  echo "== $*"
  # shellcheck disable=SC2086
  flock "$LOCK" $EVAL "$@" || { echo "FAILED: $*" >&2; FAILED+=("$*"); }
}
TASKS=piqa,openbookqa,rte,mathqa,hellaswag,lambada
LIMIT=${LIMIT:-100}
PAPER_LIMIT=${PAPER_LIMIT:-50}
XSUM_LIMIT=${XSUM_LIMIT:-50}
PRESSES="observed_attention snapkv tova streaming_llm knorm"
what=${1:-all}
case $what in all|tasks|xsum|needle|xsum200|paper) ;; *) echo "usage: $0 [all|tasks|xsum|needle|xsum200|paper]" >&2; exit 2 ;; esac

if [[ $what == all || $what == tasks ]]; then
  run tasks --tasks $TASKS --num-fewshot 5 --limit $LIMIT --policy dynamic --json $OUT/tasks_dynamic.json
  for p in h2o local sink tova snapkv; do
    run tasks --tasks $TASKS --num-fewshot 5 --limit $LIMIT --policy $p --budget 0.2 --json $OUT/tasks_${p}_b0.2.json
  done
  for press in $PRESSES; do
    run tasks --tasks $TASKS --num-fewshot 5 --limit $LIMIT --peer $press --budget 0.2 --json $OUT/tasks_kvpress_${press}_b0.2.json
  done
fi
if [[ $what == all || $what == xsum ]]; then
  run xsum --limit $XSUM_LIMIT --policy dynamic --json $OUT/xsum_dynamic.json
  for p in h2o local sink tova snapkv h2o_mean; do
    run xsum --limit $XSUM_LIMIT --policy $p --budget 0.2 --json $OUT/xsum_${p}_b0.2.json
  done
  for press in $PRESSES kvzip; do  # kvzip: the strongest press on RULER and the needle (docs/quality.md)
    run xsum --limit $XSUM_LIMIT --peer $press --budget 0.2 --json $OUT/xsum_kvpress_${press}_b0.2.json
  done
fi
if [[ $what == all || $what == needle ]]; then
  G="--lengths 1024,2048,4096 --depths 0,25,50,75,100"
  run needle $G --policy dynamic --json $OUT/needle_dynamic.json
  for p in h2o sink local tova snapkv; do
    run needle $G --policy $p --budget 0.2 --json $OUT/needle_${p}_b0.2.json
  done
  for press in $PRESSES; do
    run needle $G --peer $press --budget 0.2 --json $OUT/needle_kvpress_${press}_b0.2.json
  done
fi
if [[ $what == all || $what == xsum200 ]]; then  # the XSUM target row (h2o vs dynamic) on 200 articles
  run xsum --limit 200 --policy dynamic --json $OUT/xsum200_dynamic.json
  run xsum --limit 200 --policy h2o --budget 0.2 --json $OUT/xsum200_h2o_b0.2.json
fi
if [[ $what == all || $what == paper ]]; then
  for p in h2o local sink; do
    run tasks --tasks $TASKS --num-fewshot 5 --limit $PAPER_LIMIT --policy $p --budget 0.2 --paper-protocol \
      --json $OUT/tasks_paper_${p}_b0.2.json
  done
  run tasks --tasks $TASKS --num-fewshot 5 --limit $PAPER_LIMIT --policy dynamic --paper-protocol \
    --json $OUT/tasks_paper_dynamic.json
fi
if (( ${#FAILED[@]} )); then
  echo "${#FAILED[@]} run(s) failed:" >&2
  printf '  %s\n' "${FAILED[@]}" >&2
  exit 1
fi
