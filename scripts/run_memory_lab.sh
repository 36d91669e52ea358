#!/usr/bin/env bash
# The memory lab: fp32 (TF32) / bf16 / fused attention / sliding-window attention (FlexAttention) / full activation
# checkpointing and combinations on one small Llama 3 (train_configs/llama3_lab.toml, the embedded stdlib text), one
# run per variant under $OUTPUT_DIR/<variant>/, then forward / backward / peak memory, step and epoch time and
# validation perplexity on the same token budget in $OUTPUT_DIR/memory_lab.md, .json and PNGs.
#   BATCH=32 SEQ_LEN=1024 STEPS=200 bash scripts/run_memory_lab.sh [--max-batch] [--variants "fp32 bf16"] [train.py flags...]
set -euo pipefail
cd "$(dirname "$0")/.."
CONFIG=${CONFIG:-train_configs/llama3_lab.toml}
FLAVOR=${FLAVOR:-lab}
BATCH=${BATCH:-32}
SEQ_LEN=${SEQ_LEN:-1024}
STEPS=${STEPS:-200}
WINDOWS=${WINDOWS:-"512 256"}
OUTPUT_DIR=${OUTPUT_DIR:-outputs/memory_lab}
exec "${PYTHON:-python}" scripts/run_memory_lab.py --config "$CONFIG" --flavor "$FLAVOR" --batch "$BATCH" \
    --seq-len "$SEQ_LEN" --steps "$STEPS" --windows "$WINDOWS" --output-dir "$OUTPUT_DIR" "$@"
