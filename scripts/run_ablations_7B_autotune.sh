#!/usr/bin/env bash
# 7B DiT, one run per setting at the largest local batch that fits: the package's batch-size finder probes
# each setting (short runs of it in fresh processes, from the memory estimate, then bisection), then the run
# is recorded as in run_ablations_7B.sh. The finder's answers are kept in $OUTPUT_DIR/autotune/.
# Other variables: scripts/lib/ablation_grid.sh (NGPU=0: every visible GPU, OUTPUT_DIR=outputs, ...).
#   NGPU=8 STEPS=10 PROBE_STEPS=3 bash scripts/run_ablations_7B_autotune.sh [--dry-run] [train.py flags...]
set -euo pipefail
SIZE=7B AUTOTUNE=1 STEPS=${STEPS:-10} PRECISIONS=${PRECISIONS:-bf16} PARALLELISMS=${PARALLELISMS:-"fsdp hsdp"} \
    COMPILE=${COMPILE:-1} exec bash "$(dirname "$0")/lib/ablation_grid.sh" "$@"
