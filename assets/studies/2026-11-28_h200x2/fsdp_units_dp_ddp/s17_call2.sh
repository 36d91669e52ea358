#!/usr/bin/env bash
# Call 2 (2 H200s): FSDP-2's unit size and prefetch depth at 64, FSDP-2 against DDP-2 at 32, DP under FSDP-2 with
# units; then DP under DDP-2 profiled. Issue 54.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PYTHONPATH || exit
export PYTHONUNBUFFERED=1 PYTHON=python3
start=$(date +%s); mkdir -p /tmp/r
BM="python3 scripts/benchmark.py --config train_configs/dit_xl2_latent256.toml --warmup 5 --steps 15 --timeout 150 --nproc 2"
B() { echo "--training.local_batch_size $1 --training.global_batch_size $2"; }
F="--parallelism.data_parallel_replicate_degree 1 --parallelism.data_parallel_shard_degree 2"
U() { echo "--parallelism.fsdp_blocks_per_unit $1 --parallelism.fsdp_prefetch $2"; }
DP="--dp.enable true --dp.mode flash_bookkeeping --dp.noise_multiplier 1.0"
$BM --json-out /tmp/r/phaseB.json --case "fsdp2_64_u4p1=$(B 64 128) $F $(U 4 1)" --case "fsdp2_64_u7p1=$(B 64 128) $F $(U 7 1)" \
    --case "fsdp2_64_u14p1=$(B 64 128) $F $(U 14 1)" --case "fsdp2_64_u4p2=$(B 64 128) $F $(U 4 2)" \
    --case "fsdp2_64_u4p1_never=$(B 64 128) $F $(U 4 1) --parallelism.fsdp_reshard_after_forward never" \
    --case "ddp2_32=$(B 32 64)" --case "fsdp2_32=$(B 32 64) $F" --case "fsdp2_32_u4p1=$(B 32 64) $F $(U 4 1)" \
    --case "fsdp2_64_u4p1_dp=$(B 64 128) $F $(U 4 1) $DP" 2>&1 | tee /tmp/r/phaseB.txt | grep -E "^\||rror"
echo "phase B $(( $(date +%s) - start ))s"
timeout $(( 560 - ($(date +%s) - start) )) $BM --json-out /tmp/r/phaseC.json --profile-dir /tmp/r/prof --case "ddp2_64_dp=$(B 64 128) $DP" 2>&1 | tee /tmp/r/phaseC.txt | grep -E "^\||rror"
echo "total $(( $(date +%s) - start ))s"
cd /tmp/r && find prof -name "*.json*" -size +20M -delete; tar czf $OUT/r.tgz . && cd - >/dev/null
