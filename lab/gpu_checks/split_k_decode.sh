#!/bin/bash
# Batch-1 decode with and without XLA's split-K in the 16-row programs (xla_options.SPLIT_K_AT_DECODE_ROWS),
# after the two kernel probes it depends on. Fresh processes, each on an empty compilation cache,
# alternating; a short table last. Full JSON under $OUT.
set -u
cd "$(dirname "$0")/../.."
python lab/gpu_checks/prefill_grid_probe.py --out $OUT/prefill_grid.json 2>&1 | tail -8
python -m lab.gpu_checks.split_fuse_probe --out $OUT 2>&1 | tail -9
for r in 1 2; do
  for mode in on off; do
    python lab/gpu_checks/engine_before_after.py --label splitk_${mode}_$r --out $OUT --skip-throughput \
      --fresh-cache --decode-batches 1,4 --patch xla_options.SPLIT_K_AT_DECODE_ROWS=$([ $mode = on ] && echo true || echo false) \
      2>&1 | grep -E "^\[|Error|error" | tail -6
  done
done
python lab/gpu_checks/engine_before_after.py --compare $OUT/splitk_*.json --md $OUT/splitk.md
