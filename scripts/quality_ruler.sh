#!/usr/bin/env bash
# The RULER runs of docs/quality.md, resumable (a finished item is never rerun; a finished cell is skipped).
#   scripts/quality_ruler.sh dev    # the tuning split (seed 1): the candidates for the winner, 1k, 20%
#   scripts/quality_ruler.sh eval   # the evaluation split (seed 0): baselines and the winner, 1k, 20%
# Env: LENGTHS (default 1024), N (items per task and length, default 2), TASKS, BUDGET (default 0.2), OUT
# (results/quality), PROTOCOL (question_after, kvpress' protocol, or question_in_prompt, how a server is used: the
# question ends the prompt that is compressed), POLICIES (a name, or <policy>+rec / <policy>+recmax: scored by a context-reconstruction pass,
# --reconstruct sum / max),
# PEERS (kvpress presses, run after the policies; they need the peer environment of docs/eval-tasks.md:
# H2O_KV=.venv-peer/bin/h2o-kv POLICIES= PEERS="snapkv kvzip" scripts/quality_ruler.sh eval).
# DEVICE / DTYPE (passed as --device / --dtype: DEVICE=cuda DTYPE=float32 on a GPU, as scripts/gpu_quality.sh does).
# SERVER (a running `h2o-kv serve` URL: the items go through its OpenAI API, each setting as the request's
# vllm_xargs; question_in_prompt only: SERVER=http://127.0.0.1:8311 PROTOCOL=question_in_prompt ... eval).
# The defaults are what a shared 2-core machine finished in one session; a run with more N or LENGTHS reuses the
# finished items (delete the result JSON first: a finished cell is skipped).
set -euo pipefail
lane=${1:?usage: quality_ruler.sh dev|eval}
out=${OUT:-results/quality}
lengths=${LENGTHS:-1024}
h2o_kv=${H2O_KV:-h2o-kv}
budget_ratio=${BUDGET:-0.2}
protocol=${PROTOCOL:-question_after}
if [[ $lane == dev ]]; then
  seed=1 n=${N:-2} tasks=${TASKS:-niah_single,niah_multikey,niah_multivalue,niah_multiquery,vt}
  policies=${POLICIES-dynamic global_window_h2o+rec global_window_h2o+recmax global_snapkv+rec global_h2o+rec}
else
  seed=0 n=${N:-2} tasks=${TASKS:-niah_single,niah_multikey,niah_multivalue,niah_multiquery,vt}
  policies=${POLICIES-dynamic h2o snapkv}
fi
cells=()
for policy in $policies; do  # <policy>+rec / <policy>+recmax: scored by a reconstruction pass (sum / max)
  case $policy in
    *+recmax) cells+=("--policy ${policy%+recmax} --reconstruct max") ;;
    *+rec) cells+=("--policy ${policy%+rec} --reconstruct sum") ;;
    *) cells+=("--policy $policy") ;;
  esac
done
for press in ${PEERS:-}; do cells+=("--peer $press"); done
for cell in "${cells[@]}"; do
  setting=${cell#* } setting=${setting%% *} budget=(--budget "$budget_ratio") name=${setting}_$budget_ratio
  [[ $cell == *"--reconstruct sum" ]] && name=${setting}+rec_$budget_ratio
  [[ $cell == *"--reconstruct max" ]] && name=${setting}+recmax_$budget_ratio
  [[ $cell == --peer* ]] && name=kvpress_${setting}_$budget_ratio
  if [[ $setting == dynamic || $setting == full ]]; then budget=() name=$setting; fi
  json=$out/ruler-$lane/$name.json
  if [[ -f $json ]]; then echo "done: $json"; continue; fi
  echo "=== $(date -u +%T) $cell -> $json"
  # shellcheck disable=SC2086
  "$h2o_kv" eval ruler $cell "${budget[@]}" --lengths "$lengths" --tasks "$tasks" --n "$n" \
    --seed "$seed" --protocol "$protocol" --json "$json" ${SERVER:+--server "$SERVER"} \
    ${DEVICE:+--device "$DEVICE"} ${DTYPE:+--dtype "$DTYPE"}
done
