#!/usr/bin/env bash
# The serving workload table (README "Serving", docs/serving.md): every workload with vLLM's own cache and H2O at 20%
# in one invocation each (same KV space), then the transformers backend at the same shapes. Resumable: a setting
# whose JSON exists is kept (delete it to measure again). Run on a quiet machine, from a clean tree (records say).
#   bash scripts/serve_workloads.sh [vllm|transformers|all]     (VLLM_ENV: the vLLM venv, MAIN_ENV: the main venv)
# Cost on the 2-core CPU: 42 min for the vLLM rows; the transformers rows about 40 min (4 x 4,096: 5 min; decode-heavy:
# 13 + 7 min, prompt-heavy: 10 + 7 min; one thread).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-results/serve}
VLLM=${VLLM_ENV:-.venv-vllm}/bin/h2o-kv
MAIN=${MAIN_ENV:-.venv}/bin/h2o-kv
SPACE=0.3570556640625  # GiB: 65 blocks of 128 tokens = 4 decode-heavy requests at full length (docs/serving.md)
what=${1:-all}
if [[ $what != vllm && $what != transformers && $what != all ]]; then
  echo "error: argument must be vllm, transformers or all, got $what" >&2
  exit 2
fi
mkdir -p "$OUT"

if [[ $what == vllm || $what == all ]]; then
  "$VLLM" bench serve --policies full,h2o@0.2 --workload prompt-heavy --requests 16 --concurrency 16 \
    --kv-cache-gb "$SPACE" --out "$OUT/prompt_heavy.json"
  "$VLLM" bench serve --policies full,h2o@0.2,h2o@8192+8192 --workload decode-step --requests 4 --concurrency 4 \
    --kv-cache-gb auto --out "$OUT/decode_step_4x4096.json"
  "$VLLM" bench serve --policies full,h2o@0.2 --workload decode-heavy --requests 16 --concurrency 16 \
    --kv-cache-gb auto --out "$OUT/decode_heavy.json"
  "$VLLM" bench serve --policies full,h2o@0.2 --workload chat --requests 16 --concurrency 16 \
    --kv-cache-gb "$SPACE" --out "$OUT/chat.json"
fi
if [[ $what == transformers || $what == all ]]; then
  # one thread, as vLLM's CPU worker; the batch at once (no continuous batching), EOS ignored
  "$MAIN" bench run --contexts 4096 --batches 4 --policies dynamic,h2o --budget 0.2 --new-tokens 32 --threads 1 \
    --out "$OUT/transformers_4x4096.json"
  "$MAIN" bench run --contexts 1024 --batches 16 --policies dynamic,h2o --budget 0.2 --new-tokens 1024 --threads 1 \
    --out "$OUT/transformers_decode_heavy.json"
  "$MAIN" bench run --contexts 3072 --batches 16 --policies dynamic,h2o --budget 0.2 --new-tokens 64 --threads 1 \
    --out "$OUT/transformers_prompt_heavy.json"
fi
