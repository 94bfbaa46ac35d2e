#!/usr/bin/env bash
# lm-eval tasks (5-shot, 100 items each, prefill protocol) and XSUM (200 articles) at 20% for the quantized cache,
# on exactly the items of results/eval-tasks/: h2o + 4-bit, h2o + 8-bit, and transformers' QuantizedCache 4-bit
# (quanto, full cache) as the peer; then the fp32 baselines again (h2o, dynamic) in this same code state. A result
# whose JSON exists is skipped, and a run interrupted resumes from its item log.
# Usage: bash scripts/quant_eval.sh [tasks|xsum|all]   (ONLY="a b": run only these cell names)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-results/quant}
EVAL=${EVAL:-h2o-kv eval}
what=${1:-all}
case $what in all|tasks|xsum) ;; *) echo "usage: $0 [tasks|xsum|all]" >&2; exit 2 ;; esac
TASKS="tasks --tasks piqa,openbookqa,rte,mathqa,hellaswag,lambada --num-fewshot 5 --limit 100"
XSUM="xsum --limit 200"
status=0
for kind in tasks xsum; do
  [[ $what == all || $what == "$kind" ]] || continue
  args=$TASKS prefix=tasks
  [[ $kind == xsum ]] && args=$XSUM prefix=xsum200
  for cell in "h2o-kv4:--policy h2o --budget 0.2 --kv-bits 4" "h2o-kv8:--policy h2o --budget 0.2 --kv-bits 8" \
              "dynamic-kv4:--policy dynamic --kv-bits 4" "h2o:--policy h2o --budget 0.2" "dynamic:--policy dynamic"; do
    name=${cell%%:*}
    out="$OUT/${prefix}_$name.json"
    [ -f "$out" ] && continue
    if [ -n "${ONLY:-}" ] && [[ " $ONLY " != *" $name "* ]]; then continue; fi
    echo "== $prefix $name"
    # shellcheck disable=SC2086
    $EVAL $args ${cell#*:} --json "$out" || { echo "FAILED: $prefix $name" >&2; status=1; }
  done
done
exit $status
