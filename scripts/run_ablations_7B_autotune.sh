#!/usr/bin/env bash
# 7B DiT, one run per setting at the largest local batch that fits: scripts/find_max_batch_size.py probes
# each setting (fresh processes, from the memory estimate, then bisection), then the run is recorded as in
# run_ablations_7B.sh. The finder's answers are kept in $OUTPUT_DIR/autotune/.
#   NGPU=8 STEPS=10 bash scripts/run_ablations_7B_autotune.sh [--dry-run] [train.py flags...]
set -euo pipefail
cd "$(dirname "$0")/.."
NGPU=${NGPU:-0}  # 0: every visible GPU
STEPS=${STEPS:-10}
OUTPUT_DIR=${OUTPUT_DIR:-outputs}
PRECISIONS=${PRECISIONS:-"bf16"}
PARALLELISMS=${PARALLELISMS:-"fsdp hsdp"}
AC_MODES=${AC_MODES:-"none selective full"}
COMPILE=${COMPILE:-"1"}
PROBE_STEPS=${PROBE_STEPS:-3}
exec "${PYTHON:-python}" scripts/run_ablation.py --size 7B --autotune --ngpu "$NGPU" --steps "$STEPS" \
    --probe-steps "$PROBE_STEPS" --output-dir "$OUTPUT_DIR" --precisions "$PRECISIONS" \
    --parallelisms "$PARALLELISMS" --ac "$AC_MODES" --compile "$COMPILE" "$@"
