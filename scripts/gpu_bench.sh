#!/usr/bin/env bash
# A representative GPU grid for h2o-kv's benchmark, sized for one H200 in under 8 minutes.
#
#   scripts/gpu_bench.sh                 # CUDA (picked automatically), Llama-3-8B shapes, bf16
#   scripts/gpu_bench.sh --device cuda:1 # force a device
#   scripts/gpu_bench.sh --smoke         # the same code path on a CPU with a tiny random model: one prompt length,
#                                        # 4 policies + 3 fitted batches (about 40 s on a free 2-core CPU)
#
# The model is RANDOMLY INITIALISED with Llama-3-8B's shapes (32 layers, 32 query / 8 KV heads, head_dim 128,
# vocab 128256), in bf16: speed and memory do not depend on the weights' values, and no checkpoint is needed.
# Prompts are real PG-19 text (set H2O_KV_DATA if shared/data is not next to the checkout). Every result
# record says random_init=true. Results are written after each measurement; rerunning resumes.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
export PYTHONPATH="$ROOT/src${PYTHONPATH:+:$PYTHONPATH}"
PY="${PYTHON:-python}"
DEVICE="auto"
SMOKE=0
OUT_DIR="${OUT_DIR:-$ROOT/results/bench/gpu}"
BUDGET_S="${BUDGET_S:-460}"   # stop cleanly before 8 minutes (the grid resumes on a rerun)
while [[ $# -gt 0 ]]; do
  case "$1" in
    --device) DEVICE="$2"; shift 2 ;;
    --smoke) SMOKE=1; shift ;;
    --out-dir) OUT_DIR="$2"; shift 2 ;;
    -h|--help) sed -n 2,12p "$0"; exit 0 ;;
    *) echo "unknown argument: $1 (expected --device DEV, --smoke, --out-dir DIR)" >&2; exit 2 ;;
  esac
done
if [[ $SMOKE == 1 ]]; then
  MODEL="random:tiny"; DEVICE="cpu"; DTYPE="float32"; CONTEXTS="64"; BATCHES="2"; NEW=8; LIMIT="dynamic@2"
  OUT_DIR="${OUT_DIR%/}-smoke"
else
  MODEL="random:llama3-8b"; DTYPE="bfloat16"; CONTEXTS="4096"; BATCHES="8,32"; NEW=128; LIMIT="dynamic@8"
fi
POLICIES="dynamic,h2o,local,sink"
if "$PY" -c "import kvpress" 2>/dev/null; then
  POLICIES="$POLICIES,kvpress:snapkv"   # ObservedAttention needs eager attention: [B, 32, L, L] per layer, left out
fi
"$PY" - "$DEVICE" "$MODEL" <<'PYEOF' || { echo "gpu_bench.sh: needs h2o-kv's dependencies importable by $PY" >&2; exit 1; }
import sys, torch
from h2o_kv.bench.workload import resolve_device
device = resolve_device(sys.argv[1])
name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
print(f"device: {device} ({name}); model: {sys.argv[2]} with RANDOM weights (real shapes; speed/memory only)")
PYEOF
mkdir -p "$OUT_DIR"
START=$(date +%s)
set +e
timeout "$BUDGET_S" "$PY" -m h2o_kv.bench.cli run --model "$MODEL" --device "$DEVICE" --dtype "$DTYPE" \
  --contexts "$CONTEXTS" --batches "$BATCHES" --policies "$POLICIES" --new-tokens "$NEW" --repeats 1 \
  --memory-limit "$LIMIT" --isolate none --out "$OUT_DIR/bench.json" --plot "$OUT_DIR/bench.png"
STATUS=$?
set -e
echo "elapsed: $(( $(date +%s) - START )) s"
if [[ $STATUS == 124 ]]; then
  echo "time budget ($BUDGET_S s) reached: partial results in $OUT_DIR/bench.json; rerun to resume" >&2
fi
if [[ -f "$OUT_DIR/bench.json" ]]; then
  "$PY" -m h2o_kv.bench.cli report "$OUT_DIR/bench.json" --plot "$OUT_DIR/bench.png" > "$OUT_DIR/table.md" || true
  cat "$OUT_DIR/table.md"
fi
exit $STATUS
