#!/bin/bash
# 1. split_fuse_probe: the o / down chains with XLA's dot, without split-K, and split written.
# 2. If XLA without split-K is faster over the two chains together: batch-1 / batch-4 decode with and
#    without split-K in the 16-row programs (xla_options.SPLIT_K_AT_DECODE_ROWS), fresh processes.
# Every engine run on an empty compilation cache. Full JSON under $OUT; short tables last.
set -u
cd "$(dirname "$0")/../.."
python -m lab.gpu_checks.split_fuse_probe --out $OUT 2>&1 | tail -9
run() { python lab/gpu_checks/engine_before_after.py --out $OUT --fresh-cache "$@" 2>&1 | grep -E "^\[|Error" | tail -6; }
if python -c "
import json,sys; c=json.load(open('$OUT/split_fuse.json'))['cases']
sys.exit(0 if sum(c[f'{k}_splitnosplitk']['us'] - c[f'{k}_split0']['us'] for k in ('o','down')) < 0 else 1)"; then
  for mode in true false; do
    run --label splitk_$mode --skip-throughput --decode-batches 1,4 --patch xla_options.SPLIT_K_AT_DECODE_ROWS=$mode
  done
fi
python lab/gpu_checks/engine_before_after.py --compare $OUT/*_*.json --md $OUT/engine.md 2>&1 | tail -8
