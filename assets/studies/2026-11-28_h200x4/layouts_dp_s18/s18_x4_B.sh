#!/usr/bin/env bash
# Issue 54 on 4 H200s, call B: 32 a GPU as call A, then the NCCL gradient test (every layout, DP compiled included).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PYTHONPATH || exit
export PYTHONUNBUFFERED=1 PYTHON=python3
start=$(date +%s)
BM="python3 scripts/benchmark.py --config train_configs/dit_xl2_latent256.toml --warmup 5 --steps 12 --timeout 150"
B() { echo "--training.local_batch_size $1 --training.global_batch_size $2"; }
F="--parallelism.data_parallel_replicate_degree 1 --parallelism.data_parallel_shard_degree 4"
DP="--dp.enable true --dp.mode flash_bookkeeping --dp.noise_multiplier 1.0"
CUDA_VISIBLE_DEVICES=0 $BM --json-out $OUT/one32.json --case "one_32=$(B 32 32)" --case "one_32_dp=$(B 32 32) $DP" > $OUT/one32.txt 2>&1
$BM --nproc 4 --json-out $OUT/four32.json --case "ddp4_32=$(B 32 128)" --case "fsdp4_32=$(B 32 128) $F" \
    --case "ddp4_32_dp=$(B 32 128) $DP" --case "fsdp4_32_dp=$(B 32 128) $F $DP" > $OUT/four32.txt 2>&1
echo "benchmarks $(( $(date +%s) - start ))s"
timeout $(( 570 - ($(date +%s) - start) )) python3 -m pytest -q -s -n 0 -p no:cacheprovider tests/test_parallelisms.py -k nccl > $OUT/nccl.txt 2>&1
grep -hE "^\|" $OUT/one32.txt $OUT/four32.txt; grep -E "e-0|passed|failed" $OUT/nccl.txt | tail -20; echo "total $(( $(date +%s) - start ))s"
