#!/usr/bin/env bash
# 0.5B DiT ablation grid (64x64x16 dummy latents): mixed precision x ddp/fsdp/hsdp x batch size
# x activation checkpointing x compile. Each run writes $OUTPUT_DIR/<name>/ with config.toml, metrics.jsonl,
# train.log and status.json; then: python scripts/optimization_analysis.py $OUTPUT_DIR
# Variables and their defaults: scripts/lib/ablation_grid.sh (NGPU=0: every visible GPU, STEPS=20,
# BATCH_SIZES="8 16 32 64", OUTPUT_DIR=outputs, PRECISIONS, PARALLELISMS, AC_MODES, COMPILE).
#   NGPU=8 STEPS=20 BATCH_SIZES="8 16 32 64" bash scripts/run_ablations_0.5B.sh [--dry-run] [train.py flags...]
set -euo pipefail
SIZE=0.5B exec bash "$(dirname "$0")/lib/ablation_grid.sh" "$@"
