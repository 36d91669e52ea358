#!/usr/bin/env bash
# The attention lab: fp32 / bf16 / flash / windowed attention / activation checkpointing and combinations on
# one DiT (dummy latents), one run per variant under $OUTPUT_DIR/<variant>/, then a table of peak memory,
# step time, images/s, final loss (and the largest batch with MAX_BATCH=1) in $OUTPUT_DIR/attention_lab.md.
#   FLAVOR=DiT-B/2 BATCH=64 STEPS=20 bash scripts/run_attention_lab.sh [--variants "bf16 bf16_flash"] [train.py flags...]
set -euo pipefail
cd "$(dirname "$0")/.."
CONFIG=${CONFIG:-train_configs/dit_xl2_latent256.toml}
FLAVOR=${FLAVOR:-DiT-B/2}
BATCH=${BATCH:-64}
STEPS=${STEPS:-20}
WINDOWS=${WINDOWS:-"2 4 8"}
OUTPUT_DIR=${OUTPUT_DIR:-outputs/attention_lab}
MAX_BATCH=${MAX_BATCH:-0}  # 1: also find each variant's largest batch (fresh-process probes; costs minutes)
flags=()
if [[ "$MAX_BATCH" == 1 ]]; then flags+=(--max-batch); fi
exec "${PYTHON:-python}" scripts/run_attention_lab.py --config "$CONFIG" --flavor "$FLAVOR" --batch "$BATCH" \
    --steps "$STEPS" --windows "$WINDOWS" --output-dir "$OUTPUT_DIR" "${flags[@]}" "$@"
