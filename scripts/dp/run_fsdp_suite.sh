#!/usr/bin/env bash
# Suite (b): DP modes against non-private training under FSDP over NPROC GPUs, DiT-L/8 at 1024, 2304 and 4096
# tokens (256, 384 and 512 pixels a side). Writes $OUTPUT_DIR/<mode>_t<tokens>_bs<B>.json, the memory, time
# and overhead plots and summary.txt (scripts/dp/run_fsdp_suite.py; docs/dp.md, "Experiment suites").
#   NPROC=2 TOKENS="1024 2304 4096" BATCH_SIZES=16 STEPS=20 bash scripts/dp/run_fsdp_suite.sh [--dry-run] [train.py flags...]
set -euo pipefail
cd "$(dirname "$0")/../.."
CONFIG=${CONFIG:-train_configs/dit_l8_pixel_dp.toml}
NPROC=${NPROC:-2}
MODES=${MODES:-"no_dp ghost flash flash_bookkeeping"}
TOKENS=${TOKENS:-"1024 2304 4096"}
BATCH_SIZES=${BATCH_SIZES:-16}
STEPS=${STEPS:-20}
OUTPUT_DIR=${OUTPUT_DIR:-outputs/dp_fsdp_suite}
exec "${PYTHON:-python}" scripts/dp/run_fsdp_suite.py --config "$CONFIG" --nproc "$NPROC" --modes "$MODES" \
    --tokens "$TOKENS" --batch-sizes "$BATCH_SIZES" --steps "$STEPS" --output-dir "$OUTPUT_DIR" "$@"
