#!/usr/bin/env bash
# The RULER grid on one GPU (docs/quality.md, "2k and 4k on a GPU"): cells of scripts/quality_ruler.sh (the
# evaluation split, 100 items = 20 per task, float32), run side by side as WORKERS processes sharing the GPU and
# stopped after GRID_S seconds. A finished cell is a record; an unfinished one leaves its item log (it resumes).
#   MAIN_PATH=/tmp/site PEER_PATH=/tmp/peer scripts/gpu_quality.sh results/quality/h200
# Records land in OUT_DIR/<length>/<protocol>/ruler-eval/. MAIN_PATH: PYTHONPATH entries h2o-kv's own runs need on
# that machine (gguf); PEER_PATH: the kvpress peer's (kvpress 0.5.5 and transformers 5.2 installed with --target).
# CELLS: a file of cells, one "length protocol budget setting" per line (setting: a quality_ruler.sh policy or
# peer:<press>), by default the list below, in priority order. N (items per task, 20), WORKERS (12), GRID_S (480),
# DEVICE (cuda; cpu for a dry run). Prints each finished cell's suite mean.
set -uo pipefail
out=${1:?usage: gpu_quality.sh OUT_DIR}
root=$(cd "$(dirname "$0")/.." && pwd)
bin=$(mktemp -d)
for env in main peer; do
  path=MAIN_PATH; [[ $env == peer ]] && path=PEER_PATH
  printf '#!/usr/bin/env bash\nPYTHONPATH=%s:%s/src exec python3 -m h2o_kv "$@"\n' "${!path:-}" "$root" >"$bin/$env"
  chmod +x "$bin/$env"
done
winner="global_window_h2o:decode=grow,recent_share=0.1+recmax"
default_cells() {
  for length in 2048 4096; do
    for protocol in question_after question_in_prompt; do
      echo "$length $protocol 0.2 dynamic"
      for budget in 0.2 0.1 0.4; do echo "$length $protocol $budget $winner"; echo "$length $protocol $budget peer:kvzip"; done
    done
  done
  for length in 2048 4096; do
    for protocol in question_after question_in_prompt; do echo "$length $protocol 0.2 h2o"; done
  done
  echo "1024 question_after 0.2 dynamic"  # against the CPU records of the same items
  echo "1024 question_after 0.2 h2o"
  for press in snapkv streaming_llm keydiff tova; do echo "2048 question_after 0.2 peer:$press"; done
}
run_cell() {  # length protocol budget setting
  local length=$1 protocol=$2 budget=$3 setting=$4 policies=$4 peers="" h2o_kv=$bin/main
  if [[ $setting == peer:* ]]; then policies="" peers=${setting#peer:} h2o_kv=$bin/peer; fi
  local log=$out/logs/$length-$protocol-$budget-${setting//[:,=+]/_}.log
  LENGTHS=$length PROTOCOL=$protocol BUDGET=$budget POLICIES=$policies PEERS=$peers N=${N:-20} H2O_KV=$h2o_kv \
    DEVICE=${DEVICE:-cuda} DTYPE=float32 OMP_NUM_THREADS=1 OUT=$out/$length/$protocol \
    bash "$root/scripts/quality_ruler.sh" eval >"$log" 2>&1
  local rc=$?
  echo "$(date -u +%T) rc=$rc $length $protocol $budget $setting"
}
export -f run_cell
export bin out root
mkdir -p "$out/logs"
PYTHONPATH=${MAIN_PATH:-}:$root/src python3 -c 'from h2o_kv.models import model_dir; print(model_dir())' || exit 1
cells=${CELLS:-$bin/cells}
[[ -n ${CELLS:-} ]] || default_cells >"$cells"
timeout "${GRID_S:-480}" xargs -P "${WORKERS:-12}" -L 1 bash -c 'run_cell "$@"' _ <"$cells"
pkill -TERM -f "python3 -m h2o_kv eval ruler" && sleep 3  # the deadline: unfinished cells keep their item logs
for json in "$out"/*/*/ruler-eval/*.json; do
  [[ -f $json ]] && python3 -c 'import json, sys; r = json.load(open(sys.argv[1]))
print("%.3f %7.1fs %s" % (r["metrics"]["score"], r["time_s"], sys.argv[1]))' "$json"
done
