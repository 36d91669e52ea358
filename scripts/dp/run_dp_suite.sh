#!/usr/bin/env bash
# Suite (a): the five DP modes against non-private training, DiT-L/8 on 256x256 pixels (1024 tokens), one GPU,
# each run in its own process. Writes $OUTPUT_DIR/<mode>_bs<B>.json, the plots and summary.txt
# (scripts/dp/run_dp_suite.py; docs/dp.md, "Experiment suites").
#   BATCH_SIZES="2 16" STEPS=8 bash scripts/dp/run_dp_suite.sh [--find-max-batch] [--dry-run] [train.py flags...]
set -euo pipefail
cd "$(dirname "$0")/../.."
CONFIG=${CONFIG:-train_configs/dit_l8_pixel_dp.toml}
MODES=${MODES:-"vanilla ghost flash bookkeeping flash_bookkeeping"}
BATCH_SIZES=${BATCH_SIZES:-"2 16"}
STEPS=${STEPS:-8}
OUTPUT_DIR=${OUTPUT_DIR:-outputs/dp_suite}
exec "${PYTHON:-python}" scripts/dp/run_dp_suite.py --config "$CONFIG" --modes "$MODES" \
    --batch-sizes "$BATCH_SIZES" --steps "$STEPS" --output-dir "$OUTPUT_DIR" "$@"
