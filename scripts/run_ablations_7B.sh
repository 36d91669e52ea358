#!/usr/bin/env bash
# 7B DiT ablation grid (64x64x16 dummy latents): mixed precision x fsdp/hsdp x batch size
# x activation checkpointing x compile. DDP is left out: a full 7B replica with AdamW does not fit one GPU.
# Each run writes $OUTPUT_DIR/<name>/ (config.toml, metrics.jsonl, train.log, status.json).
#   NGPU=8 STEPS=10 BATCH_SIZES="2 4 8 16" bash scripts/run_ablations_7B.sh [--dry-run] [train.py flags...]
set -euo pipefail
cd "$(dirname "$0")/.."
NGPU=${NGPU:-0}  # 0: every visible GPU
STEPS=${STEPS:-10}
BATCH_SIZES=${BATCH_SIZES:-"2 4 8 16"}
OUTPUT_DIR=${OUTPUT_DIR:-outputs}
PRECISIONS=${PRECISIONS:-"fp32 bf16"}
PARALLELISMS=${PARALLELISMS:-"fsdp hsdp"}
AC_MODES=${AC_MODES:-"none selective full"}
COMPILE=${COMPILE:-"0 1"}
exec "${PYTHON:-python}" scripts/run_ablation.py --size 7B --ngpu "$NGPU" --steps "$STEPS" \
    --batch-sizes "$BATCH_SIZES" --output-dir "$OUTPUT_DIR" --precisions "$PRECISIONS" \
    --parallelisms "$PARALLELISMS" --ac "$AC_MODES" --compile "$COMPILE" "$@"
