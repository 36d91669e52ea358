#!/usr/bin/env bash
# 7B DiT ablation grid (64x64x16 dummy latents): mixed precision x fsdp/hsdp x batch size
# x activation checkpointing x compile. DDP is left out: a full 7B replica with AdamW does not fit one GPU.
# Each run writes $OUTPUT_DIR/<name>/ (config.toml, metrics.jsonl, train.log, status.json).
# Other variables: scripts/lib/ablation_grid.sh (NGPU=0: every visible GPU, OUTPUT_DIR=outputs, ...).
#   NGPU=8 STEPS=10 BATCH_SIZES="2 4 8 16" bash scripts/run_ablations_7B.sh [--dry-run] [train.py flags...]
set -euo pipefail
SIZE=7B STEPS=${STEPS:-10} BATCH_SIZES=${BATCH_SIZES:-"2 4 8 16"} PARALLELISMS=${PARALLELISMS:-"fsdp hsdp"} \
    exec bash "$(dirname "$0")/lib/ablation_grid.sh" "$@"
