#!/usr/bin/env bash
# Streaming perplexity at 20% on both PG-19 books (4,096 tokens), side by side in one run: h2o, h2o + 4-bit,
# h2o + 8-bit, full, and transformers' QuantizedCache 4-bit (quanto) as the peer. Finished cells are skipped
# (resume). Usage: bash results/quant/run_ppl.sh   (H2O_KV_DATA: the shared data folder)
set -euo pipefail
cd "$(dirname "$0")/../.."
DATA=${H2O_KV_DATA:-/work/shared/data}
OUT=${OUT:-results/quant/ppl}
H2O=${H2O:-h2o-kv}
status=0
# the settings outermost, so that the comparison that matters (h2o vs h2o + 4-bit) is finished on both books first
for cell in "h2o-kv4:--policy h2o --budget 0.2 --kv-bits 4" "h2o:--policy h2o --budget 0.2" \
            "h2o-kv8:--policy h2o --budget 0.2 --kv-bits 8" "full:--policy full" \
            "dynamic-kv4:--policy dynamic --kv-bits 4"; do
  for book in pg10146_reminiscences_of_pioneer_days_in_st_paul pg10321_dragons_blood; do
    dir="$OUT/${book%%_*}"
    mkdir -p "$dir"
    name=${cell%%:*}
    [ -f "$dir/$name.json" ] && continue
    # shellcheck disable=SC2086
    $H2O eval ppl --text "$DATA/pg19/$book.txt" --strip-gutenberg --tokens 4096 ${cell#*:} \
      --json "$dir/$name.json" || { echo "FAILED: $book $name" >&2; status=1; }
  done
done
exit $status
