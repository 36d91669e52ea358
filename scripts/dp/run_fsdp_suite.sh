#!/usr/bin/env bash
# Suite (b): DP modes against non-private training under FSDP over NPROC GPUs. MODEL=dit (the default): DiT-L/8 at
# 1024, 2304 and 4096 tokens (256, 384 and 512 pixels a side), 16 images per GPU. MODEL=llama3 (or --model llama3):
# FLAVOR (Llama-3.1-8B) as a 2-label sequence classifier on synthetic tokens, seq 1024, 2048 and 4096, 2 sequences
# per GPU. Writes $OUTPUT_DIR/<mode>_t<tokens>_bs<B>.json, the memory, time and overhead plots and summary.txt
# (scripts/dp/run_fsdp_suite.py; docs/dp.md, "Experiment suites").
#   NPROC=2 TOKENS="1024 2304 4096" BATCH_SIZES=16 STEPS=20 bash scripts/dp/run_fsdp_suite.sh [--dry-run] [train.py flags...]
#   NPROC=8 MODEL=llama3 bash scripts/dp/run_fsdp_suite.sh [--flavor Llama-3.1-8B] [train.py flags...]
# A variable left unset takes run_fsdp_suite.py's default for the model (CONFIG, TOKENS, BATCH_SIZES, OUTPUT_DIR).
set -euo pipefail
cd "$(dirname "$0")/../.."
NPROC=${NPROC:-2}
MODES=${MODES:-"no_dp ghost flash flash_bookkeeping"}
STEPS=${STEPS:-20}
exec "${PYTHON:-python}" scripts/dp/run_fsdp_suite.py --nproc "$NPROC" --modes "$MODES" --steps "$STEPS" \
    ${MODEL:+--model "$MODEL"} ${FLAVOR:+--flavor "$FLAVOR"} ${CONFIG:+--config "$CONFIG"} ${TOKENS:+--tokens "$TOKENS"} \
    ${BATCH_SIZES:+--batch-sizes "$BATCH_SIZES"} ${OUTPUT_DIR:+--output-dir "$OUTPUT_DIR"} "$@"
