#!/usr/bin/env bash
# The RULER runs of docs/quality.md, resumable (a finished item is never rerun; a finished cell is skipped).
#   scripts/quality_ruler.sh dev    # the tuning split (seed 1): the candidates for the winner, 1k, 20%
#   scripts/quality_ruler.sh eval   # the evaluation split (seed 0): baselines and the winner, 1k, 20%
# Env: LENGTHS (default 1024), N (items per task and length, default 2), TASKS, POLICIES, OUT (results/quality),
# PEERS (kvpress presses, run after the policies; they need the peer environment of docs/eval-tasks.md:
# H2O_KV=.venv-peer/bin/h2o-kv POLICIES= PEERS="snapkv kvzip" scripts/quality_ruler.sh eval).
# The defaults are what a shared 2-core machine finished in one session; a run with more N or LENGTHS reuses the
# finished items (delete the result JSON first: a finished cell is skipped).
set -euo pipefail
lane=${1:?usage: quality_ruler.sh dev|eval}
out=${OUT:-results/quality}
lengths=${LENGTHS:-1024}
h2o_kv=${H2O_KV:-h2o-kv}
if [[ $lane == dev ]]; then
  seed=1 n=${N:-2} tasks=${TASKS:-niah_multikey,niah_multiquery}
  policies=${POLICIES:-h2o snapkv window_h2o ada_snapkv ada_window_h2o}
else
  seed=0 n=${N:-2} tasks=${TASKS:-niah_single,niah_multikey,niah_multivalue,niah_multiquery,vt}
  policies=${POLICIES:-dynamic h2o snapkv}
fi
cells=()
for policy in $policies; do cells+=("--policy $policy"); done
for press in ${PEERS:-}; do cells+=("--peer $press"); done
for cell in "${cells[@]}"; do
  setting=${cell#* } budget=(--budget 0.2) name=${setting}_0.2
  [[ $cell == --peer* ]] && name=kvpress_${setting}_0.2
  if [[ $setting == dynamic || $setting == full ]]; then budget=() name=$setting; fi
  json=$out/ruler-$lane/$name.json
  if [[ -f $json ]]; then echo "done: $json"; continue; fi
  echo "=== $(date -u +%T) $cell -> $json"
  # shellcheck disable=SC2086
  "$h2o_kv" eval ruler $cell "${budget[@]}" --lengths "$lengths" --tasks "$tasks" --n "$n" \
    --seed "$seed" --protocol question_after --json "$json"
done
