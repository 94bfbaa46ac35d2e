#!/usr/bin/env bash
# The runs of docs/quality.md beyond RULER for the chosen H2O-family setting (and its reference rows): the needle
# at 1k, XSUM-50 and the lm-eval tasks, at 20%, with the same items as results/eval-tasks/. Resumable: a run whose
# result JSON exists is skipped; every run is attempted and the script exits non-zero naming the failed ones.
#   scripts/quality_winner.sh [needle|xsum|tasks|all]
# Env: WINNER (default "global_window_h2o --reconstruct max"), NAME (its file label), EVAL (the eval command),
# OUT (results/quality).
set -u
cd "$(dirname "$0")/.."
WINNER=${WINNER:-global_window_h2o --reconstruct max}
NAME=${NAME:-global_window_h2o+recmax}
EVAL=${EVAL:-h2o-kv eval}
OUT=${OUT:-results/quality}
FAILED=()
run() {  # the last argument is the result JSON
  if [[ -f "${@: -1}" ]]; then echo "== exists: ${@: -1}"; return; fi
  echo "== $(date -u +%T) $*"
  # shellcheck disable=SC2086
  $EVAL "$@" || { echo "FAILED: $*" >&2; FAILED+=("$*"); }
}
what=${1:-all}
case $what in all|needle|xsum|tasks) ;; *) echo "usage: $0 [needle|xsum|tasks|all]" >&2; exit 2 ;; esac
# shellcheck disable=SC2086
{
  [[ $what == all || $what == needle ]] && run needle --lengths 1024 --depths 0,25,50,75,100 --policy $WINNER \
    --budget 0.2 --json "$OUT/needle/needle_${NAME}_b0.2.json"
  [[ $what == all || $what == xsum ]] && run xsum --limit 50 --policy $WINNER --budget 0.2 \
    --json "$OUT/eval/xsum_${NAME}_b0.2.json"
  [[ $what == all || $what == tasks ]] && run tasks --tasks piqa,openbookqa,rte,mathqa,hellaswag,lambada \
    --num-fewshot 5 --limit 100 --policy $WINNER --budget 0.2 --json "$OUT/eval/tasks_${NAME}_b0.2.json"
}
if ((${#FAILED[@]})); then
  printf 'failed: %s\n' "${FAILED[@]}" >&2
  exit 1
fi
