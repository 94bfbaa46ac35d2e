#!/usr/bin/env bash
# The GPU check of h2o-kv: one script for one CUDA GPU, sized for an H200 (under 8 minutes), with what such a
# machine has: PyTorch, Triton and transformers; no internet, no vLLM. h2o-kv runs from this checkout
# (PYTHONPATH=src); the pure-Python packages it needs beyond those (typer, rich, packaging, pytest, ...) can be
# carried as wheels and installed offline first with --wheels DIR.
#
#   scripts/gpu_check.sh [--wheels DIR] [--out-dir DIR]   # on the GPU (results/gpu)
#   scripts/gpu_check.sh --smoke                           # the same steps on a CPU: Triton's interpreter, random:tiny
#
# Steps, one JSON record each in OUT_DIR (h2o_kv.harness.records: command, git state, versions, machine with its GPU):
#   1. kernels.json  the Triton kernels against their torch references (tests/gpu_kernels, on CUDA: no interpreter)
#   2. cache.json    H2OCache on CUDA, decoding with the Triton kernels: the slow reference's tokens and logits
#                    (tests/reference.py) on a tiny random Llama in fp32; in bf16 against the fp32 reference within
#                    the tolerance stated in tests/gpu_kernels/test_triton_cache.py (mean |logit error| < 5% of the
#                    logits' spread, top-1 agreement >= 90%, teacher-forced)
#   3. bench.json    `h2o-kv bench run` on random:llama3.1-8b (Llama-3-8B's shapes with Llama-3.1's 128k context,
#                    RANDOM weights: speed and memory only) in bf16: prompts of 4k and 16k tokens, batch 8 and 32
#                    (batch 32 prefilled as 8 prompts repeated), dynamic vs h2o at a 20% budget: decode ms per step,
#                    peak GPU memory, cache bytes (a timeout stops it cleanly; rerunning resumes)
#   4. fit.json      per setting and prompt length, the largest batch whose KV cache fits 80 GiB, from the cache bytes
#                    per sequence that bench.json measured at its largest batch
# Prompts are PG-19 text from the shared data folder (H2O_KV_DATA, or shared/data next to the checkout).
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"
export PYTHONPATH="$ROOT/src${PYTHONPATH:+:$PYTHONPATH}"
PY="${PYTHON:-$(command -v python || command -v python3)}"
SMOKE=0
WHEELS=""
OUT_DIR=""
TOTAL_S="${TOTAL_S:-470}"  # the whole check; the bench gets what the tests leave
KV_LIMIT_GIB=80
while [[ $# -gt 0 ]]; do
  case "$1" in
    --smoke) SMOKE=1; shift ;;
    --wheels) WHEELS="$2"; shift 2 ;;
    --out-dir) OUT_DIR="$2"; shift 2 ;;
    -h|--help) sed -n 2,23p "$0"; exit 0 ;;
    *) echo "gpu_check.sh: unknown argument $1 (expected --smoke, --wheels DIR, --out-dir DIR)" >&2; exit 2 ;;
  esac
done
if [[ $SMOKE == 1 ]]; then
  OUT_DIR="${OUT_DIR:-$ROOT/results/tmp/gpu-smoke}"
  DEVICE=cpu; MODEL="random:tiny"; DTYPE=float32; CONTEXTS="64,128"; BATCHES="2,4"; NEW=8; PREFILL=2
  export TRITON_INTERPRET=1
else
  OUT_DIR="${OUT_DIR:-$ROOT/results/gpu}"
  DEVICE=cuda; MODEL="random:llama3.1-8b"; DTYPE=bfloat16; CONTEXTS="4096,16384"; BATCHES="8,32"; NEW=64; PREFILL=8
fi
mkdir -p "$OUT_DIR"
if [[ -n $WHEELS ]]; then
  "$PY" -m pip install --quiet --no-index --no-deps "$WHEELS"/*.whl
fi
"$PY" - "$DEVICE" <<'PYEOF' || exit 1
import importlib.util, sys
missing = [m for m in ("torch", "triton", "transformers", "typer", "rich", "packaging", "pytest")
           if importlib.util.find_spec(m) is None]
if missing:
    sys.exit(f"gpu_check.sh: missing Python packages {', '.join(missing)}: carry their wheels (--wheels DIR)")
import torch
if sys.argv[1] == "cuda" and not torch.cuda.is_available():
    sys.exit("gpu_check.sh: no CUDA device (run --smoke on a CPU)")
from h2o_kv.harness.data import has_data
if not has_data("pg19"):
    sys.exit("gpu_check.sh: the benchmark's PG-19 prompts are missing: set H2O_KV_DATA to the shared data folder")
name = torch.cuda.get_device_name(0) if sys.argv[1] == "cuda" else "CPU (Triton interpreter)"
print(f"device: {name}; torch {torch.__version__}")
PYEOF

# pytest_record NAME TEST...: run the tests, then write NAME.json from their JUnit report; fails when a test failed
pytest_record() {
  local name="$1"; shift
  local status=0
  timeout 150 "$PY" -m pytest -q -p no:cacheprovider --junit-xml="$OUT_DIR/$name.xml" "$@" || status=$?
  "$PY" - "$OUT_DIR/$name.xml" "$OUT_DIR/$name.json" "$name" "$status" "$*" <<'PYEOF'
import sys, xml.etree.ElementTree as ET
import torch
from h2o_kv.harness import records
report, out, name, status, tests = sys.argv[1:]
cases = []
for case in ET.parse(report).getroot().iter("testcase"):
    outcome = next((child.tag for child in case if child.tag in ("failure", "error", "skipped")), "passed")
    cases.append({"test": f"{case.get('classname')}::{case.get('name')}", "outcome": outcome,
                  "seconds": float(case.get("time", 0))})
counts = {o: sum(c["outcome"] == o for c in cases) for o in ("passed", "failure", "error", "skipped")}
device = "cuda" if torch.cuda.is_available() else "cpu"
records.write(out, "gpu-check", {"step": name, "tests": tests, "pytest_status": int(status), "counts": counts,
                                 "cases": cases}, device=device, h2o_cache=False)
print(f"{name}: {counts} -> {out}")
PYEOF
  rm -f "$OUT_DIR/$name.xml"
  return "$status"
}

START=$SECONDS
FAILED=0
echo "== 1. the Triton kernels against their torch references"
pytest_record kernels tests/gpu_kernels/test_triton_slots.py tests/gpu_kernels/test_triton_paged.py \
  tests/gpu_kernels/test_triton_prompt.py || FAILED=1
echo "== 2. H2OCache with the Triton kernels against the slow reference (fp32 exact, bf16 within tolerance)"
pytest_record cache tests/gpu_kernels/test_triton_cache.py || FAILED=1

echo "== 3. h2o-kv bench run: $MODEL, $DTYPE, prompts $CONTEXTS, batches $BATCHES, dynamic vs h2o 20%"
LEFT=$((TOTAL_S - (SECONDS - START)))
LEFT=$((LEFT > 60 ? LEFT : 60))
BENCH=0
timeout "$LEFT" "$PY" -m h2o_kv.bench.cli run --model "$MODEL" --device "$DEVICE" --dtype "$DTYPE" \
  --contexts "$CONTEXTS" --batches "$BATCHES" --policies dynamic,h2o --budget 0.2 --new-tokens "$NEW" \
  --prefill-batch "$PREFILL" --repeats 1 --isolate none --out "$OUT_DIR/bench.json" || BENCH=$?
[[ $BENCH == 124 ]] && echo "time budget reached: partial results in $OUT_DIR/bench.json (rerun to resume)" >&2

echo "== 4. the largest batch whose KV cache fits $KV_LIMIT_GIB GiB"
"$PY" - "$OUT_DIR/bench.json" "$OUT_DIR/fit.json" "$KV_LIMIT_GIB" "$DEVICE" <<'PYEOF' || FAILED=1
import json, math, sys
import torch
from h2o_kv import kernels
from h2o_kv.harness import records
bench, out, limit_gib, device = sys.argv[1], sys.argv[2], float(sys.argv[3]), sys.argv[4]
measured = json.load(open(bench))["records"]
largest = {}
for r in measured:  # per (setting, prompt): the run at the largest batch
    key = (r["config"]["policy"], r["config"]["context"])
    if key not in largest or r["config"]["batch"] > largest[key]["config"]["batch"]:
        largest[key] = r
rows = []
for (policy, context), r in sorted(largest.items(), key=lambda item: (item[0][1], item[0][0])):
    per_seq = r["cache_bytes_peak"] / r["config"]["batch"]
    rows.append({"policy": policy, "context": context, "new_tokens": r["config"]["new_tokens"],
                 "measured_batch": r["config"]["batch"], "cache_bytes_per_seq": per_seq,
                 "max_batch": math.floor(limit_gib * 2**30 / per_seq)})
    print(f"{policy:>8} {context:>6} tokens: {per_seq / 2**20:9.1f} MiB/sequence -> batch {rows[-1]['max_batch']}")
for r in sorted(measured, key=lambda r: (r["config"]["context"], r["config"]["batch"], r["config"]["policy"])):
    c = r["config"]
    print(f"{c['policy']:>8} {c['context']:>6} x {c['batch']:>3}: decode {r['step_ms_mean']:8.2f} ms/step, "
          f"peak {max(r['prefill_peak_bytes'] or 0, r['decode_peak_bytes'] or 0) / 2**30:6.2f} GiB")
probe = torch.zeros(1, device=device)
records.write(out, "gpu-check", {"step": "fit", "bench": bench, "kv_limit_gib": limit_gib, "fits": rows,
                                 "triton_decode_kernels": kernels.step_ops(probe) is not None and device == "cuda"},
              device=device)
PYEOF
echo "elapsed: $((SECONDS - START)) s; records in $OUT_DIR"
if [[ $FAILED != 0 ]]; then
  echo "gpu_check.sh: a step failed (see above)" >&2
  exit 1
fi
exit "$BENCH"
