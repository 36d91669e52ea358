#!/usr/bin/env bash
# CS336's memory profiling (assignment 2) through the trainer: peak memory of the Llama 3 CS336 sizes at contexts
# 128, 256 and 512, forward only against the full training step, fp32 against bf16, each run in its own process; a
# CUDA memory snapshot per run on a GPU (pytorch.org/memory_viz). Writes $OUTPUT_DIR/profile_memory.md and .json:
# the peak table, the activations against memory_estimate's derivation, the largest allocations with their stacks
# (scripts/profile_memory.py).
#   SIZES="small medium" CONTEXTS="128 256 512" BATCH=4 bash scripts/profile_memory.sh [--dry-run] [train.py flags...]
set -euo pipefail
cd "$(dirname "$0")/.."
SIZES=${SIZES:-"small medium large xl 2.7B"}
CONTEXTS=${CONTEXTS:-"128 256 512"}
BATCH=${BATCH:-4}
PASSES=${PASSES:-"forward train"}
PRECISIONS=${PRECISIONS:-"fp32 bf16"}
STEPS=${STEPS:-2}
OUTPUT_DIR=${OUTPUT_DIR:-outputs/profile_memory}
exec "${PYTHON:-python}" scripts/profile_memory.py --sizes "$SIZES" --contexts "$CONTEXTS" --batch "$BATCH" \
    --passes "$PASSES" --precisions "$PRECISIONS" --steps "$STEPS" --output-dir "$OUTPUT_DIR" "$@"
