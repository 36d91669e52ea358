#!/usr/bin/env bash
# One ablation grid of scripts/run_ablation.py from the variables its wrappers (scripts/run_ablations_*.sh) set,
# with the defaults they share; any variable may also come from the caller's environment:
#   SIZE (required), NGPU (0: every visible GPU), STEPS, BATCH_SIZES, OUTPUT_DIR, PRECISIONS, PARALLELISMS,
#   AC_MODES, COMPILE, AUTOTUNE (1: one run per setting at the largest batch), PROBE_STEPS, PYTHON.
# Extra arguments ("$@": --dry-run, train.py flags ...) come last, so they win.
set -euo pipefail
cd "$(dirname "$0")/../.."
flags=()
if [[ "${AUTOTUNE:-0}" == 1 ]]; then flags+=(--autotune --probe-steps "${PROBE_STEPS:-3}"); fi
exec "${PYTHON:-python}" scripts/run_ablation.py --size "$SIZE" --ngpu "${NGPU:-0}" --steps "${STEPS:-20}" \
    --batch-sizes "${BATCH_SIZES:-8 16 32 64}" --output-dir "${OUTPUT_DIR:-outputs}" \
    --precisions "${PRECISIONS:-fp32 bf16}" --parallelisms "${PARALLELISMS:-ddp fsdp hsdp}" \
    --ac "${AC_MODES:-none selective full}" --compile "${COMPILE:-0 1}" "${flags[@]}" "$@"
