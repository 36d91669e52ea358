#!/usr/bin/env bash
# 0.5B DiT ablation grid (64x64x16 dummy latents): mixed precision x ddp/fsdp/hsdp x batch size
# x activation checkpointing x compile. Each run writes $OUTPUT_DIR/<name>/ with config.toml, metrics.jsonl,
# train.log and status.json; then: python scripts/optimization_analysis.py $OUTPUT_DIR
#   NGPU=8 STEPS=20 BATCH_SIZES="8 16 32 64" bash scripts/run_ablations_0.5B.sh [--dry-run] [train.py flags...]
set -euo pipefail
cd "$(dirname "$0")/.."
NGPU=${NGPU:-0}  # 0: every visible GPU
STEPS=${STEPS:-20}
BATCH_SIZES=${BATCH_SIZES:-"8 16 32 64"}
OUTPUT_DIR=${OUTPUT_DIR:-outputs}
PRECISIONS=${PRECISIONS:-"fp32 bf16"}
PARALLELISMS=${PARALLELISMS:-"ddp fsdp hsdp"}
AC_MODES=${AC_MODES:-"none selective full"}
COMPILE=${COMPILE:-"0 1"}
exec "${PYTHON:-python}" scripts/run_ablation.py --size 0.5B --ngpu "$NGPU" --steps "$STEPS" \
    --batch-sizes "$BATCH_SIZES" --output-dir "$OUTPUT_DIR" --precisions "$PRECISIONS" \
    --parallelisms "$PARALLELISMS" --ac "$AC_MODES" --compile "$COMPILE" "$@"
