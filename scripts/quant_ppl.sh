#!/usr/bin/env bash
# Streaming perplexity at 20% on both PG-19 books (4,096 tokens), side by side in one run: h2o, h2o + 4-bit,
# h2o + 8-bit, full, and transformers' QuantizedCache 4-bit (quanto) as the peer. Finished cells are skipped
# (resume). Usage: bash scripts/quant_ppl.sh   (H2O_KV_DATA: the shared data folder; ONLY="a b" / SKIP="a b":
# run only / skip these cells, e.g. the slow one-token-per-forward peer in a second process: ONLY=dynamic-kv4)
set -euo pipefail
cd "$(dirname "$0")/.."
DATA=${H2O_KV_DATA:-/work/shared/data}
OUT=${OUT:-results/quant/ppl}
H2O=${H2O:-h2o-kv}
status=0
# the settings outermost: the quantized ones first on both books, then the peer, then the unquantized baselines
# (whose code path is unchanged by kv_bits: bit-for-bit the results of results/eval/ppl/)
for cell in "h2o-kv4:--policy h2o --budget 0.2 --kv-bits 4" "h2o-kv8:--policy h2o --budget 0.2 --kv-bits 8" \
            "dynamic-kv4:--policy dynamic --kv-bits 4" "h2o:--policy h2o --budget 0.2" "full:--policy full"; do
  for book in pg10146_reminiscences_of_pioneer_days_in_st_paul pg10321_dragons_blood; do
    dir="$OUT/${book%%_*}"
    mkdir -p "$dir"
    name=${cell%%:*}
    [ -f "$dir/$name.json" ] && continue
    # ONLY / SKIP: space-separated cell names, to split the grid over two processes
    if [ -n "${ONLY:-}" ] && [[ " $ONLY " != *" $name "* ]]; then continue; fi
    if [ -n "${SKIP:-}" ] && [[ " $SKIP " == *" $name "* ]]; then continue; fi
    # shellcheck disable=SC2086
    $H2O eval ppl --text "$DATA/pg19/$book.txt" --strip-gutenberg --tokens 4096 ${cell#*:} \
      --json "$dir/$name.json" || { echo "FAILED: $book $name" >&2; status=1; }
  done
done
exit $status
