#!/usr/bin/env bash
# Regenerates every result in results/eval-tasks/ (docs/eval-tasks.md). Each run takes the shared CPU lock and
# resumes from its item log when interrupted. `h2o-kv eval X` == `python -m h2o_kv.eval.cli X`.
set -u
cd "$(dirname "$0")/../.."
OUT=results/eval-tasks
EVAL="python -m h2o_kv.eval.cli"
run() {  # skips a run whose result JSON exists (the last argument)
  if [[ -f "${@: -1}" ]]; then echo "== exists: ${@: -1}"; return; fi
  echo "== $*"; flock /tmp/h2o-cpu.lock $EVAL "$@" || echo "FAILED: $*"
}
TASKS=piqa,openbookqa,rte,mathqa,hellaswag,lambada
LIMIT=${LIMIT:-100}
PAPER_LIMIT=${PAPER_LIMIT:-50}
XSUM_LIMIT=${XSUM_LIMIT:-50}
PRESSES="observed_attention snapkv tova streaming_llm knorm"
what=${1:-all}

if [[ $what == all || $what == tasks ]]; then
  run tasks --tasks $TASKS --num-fewshot 5 --limit $LIMIT --policy full --json $OUT/tasks_full.json
  for p in h2o local sink tova snapkv; do
    run tasks --tasks $TASKS --num-fewshot 5 --limit $LIMIT --policy $p --budget 0.2 --json $OUT/tasks_${p}_b0.2.json
  done
  for press in $PRESSES; do
    run tasks --tasks $TASKS --num-fewshot 5 --limit $LIMIT --peer $press --budget 0.2 --json $OUT/tasks_kvpress_${press}_b0.2.json
  done
fi
if [[ $what == all || $what == xsum ]]; then
  run xsum --limit $XSUM_LIMIT --policy full --json $OUT/xsum_full.json
  for p in h2o local sink tova snapkv h2o_mean; do
    run xsum --limit $XSUM_LIMIT --policy $p --budget 0.2 --json $OUT/xsum_${p}_b0.2.json
  done
  for press in $PRESSES; do
    run xsum --limit $XSUM_LIMIT --peer $press --budget 0.2 --json $OUT/xsum_kvpress_${press}_b0.2.json
  done
fi
if [[ $what == all || $what == needle ]]; then
  G="--lengths 1024,2048,4096 --depths 0,25,50,75,100"
  run needle $G --policy full --json $OUT/needle_full.json
  for p in h2o sink local tova snapkv; do
    run needle $G --policy $p --budget 0.2 --json $OUT/needle_${p}_b0.2.json
  done
  for press in $PRESSES; do
    run needle $G --peer $press --budget 0.2 --json $OUT/needle_kvpress_${press}_b0.2.json
  done
fi
if [[ $what == all || $what == xsum200 ]]; then  # the XSUM target row (h2o vs full) on 200 articles
  run xsum --limit 200 --policy full --json $OUT/xsum200_full.json
  run xsum --limit 200 --policy h2o --budget 0.2 --json $OUT/xsum200_h2o_b0.2.json
fi
if [[ $what == all || $what == paper ]]; then
  for p in h2o local sink; do
    run tasks --tasks $TASKS --num-fewshot 5 --limit $PAPER_LIMIT --policy $p --budget 0.2 --paper-protocol \
      --json $OUT/tasks_paper_${p}_b0.2.json
  done
  run tasks --tasks $TASKS --num-fewshot 5 --limit $PAPER_LIMIT --policy full --paper-protocol \
    --json $OUT/tasks_paper_full.json
fi
