#!/usr/bin/env bash
# Call 1 (2 H200s): DP under DDP-2 (the whole model compiled, the engine's buckets) against DDP-2; FSDP-2's units and
# prefetch against FSDP-2 as it was; DP under FSDP-2. Issue 54.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PYTHONPATH || exit
export PYTHONUNBUFFERED=1 PYTHON=python3
git log --oneline -1; nproc; nvidia-smi --query-gpu=name --format=csv,noheader; start=$(date +%s); mkdir -p /tmp/r
BM="python3 scripts/benchmark.py --config train_configs/dit_xl2_latent256.toml --warmup 5 --steps 15 --timeout 150 --nproc 2 --json-out /tmp/r/phaseA.json"
B() { echo "--training.local_batch_size $1 --training.global_batch_size $2"; }
F="--parallelism.data_parallel_replicate_degree 1 --parallelism.data_parallel_shard_degree 2"
DP="--dp.enable true --dp.mode flash_bookkeeping --dp.noise_multiplier 1.0"
$BM --case "ddp2_64=$(B 64 128)" --case "ddp2_64_dp=$(B 64 128) $DP" \
    --case "fsdp2_64=$(B 64 128) $F" --case "fsdp2_64_u4=$(B 64 128) $F --parallelism.fsdp_blocks_per_unit 4" \
    --case "fsdp2_64_p1=$(B 64 128) $F --parallelism.fsdp_prefetch 1" \
    --case "fsdp2_64_u4p1=$(B 64 128) $F --parallelism.fsdp_blocks_per_unit 4 --parallelism.fsdp_prefetch 1" \
    --case "fsdp2_64_dp=$(B 64 128) $F $DP" 2>&1 | tee /tmp/r/phaseA.txt | grep -E "^\||error|Error|elapsed"
echo "total $(( $(date +%s) - start ))s"
cd /tmp/r && tar czf $OUT/r.tgz . && cd - >/dev/null
