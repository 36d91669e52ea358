#!/usr/bin/env bash
# Issue 54 on 4 H200s, call A: 64 a GPU. One GPU without and with DP (sequential, GPU 0), then DDP-4 and FSDP-4 as
# shipped, without and with DP. Each benchmark writes its rows to $OUT as it ends (nothing lost to the call's limit).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PYTHONPATH || exit
export PYTHONUNBUFFERED=1 PYTHON=python3
git log --oneline -1; nproc; start=$(date +%s)
BM="python3 scripts/benchmark.py --config train_configs/dit_xl2_latent256.toml --warmup 5 --steps 12 --timeout 150"
B() { echo "--training.local_batch_size $1 --training.global_batch_size $2"; }
F="--parallelism.data_parallel_replicate_degree 1 --parallelism.data_parallel_shard_degree 4"
DP="--dp.enable true --dp.mode flash_bookkeeping --dp.noise_multiplier 1.0"
CUDA_VISIBLE_DEVICES=0 $BM --json-out $OUT/one64.json --case "one_64=$(B 64 64)" --case "one_64_dp=$(B 64 64) $DP" > $OUT/one64.txt 2>&1
grep -E "^\| one" $OUT/one64.txt; echo "one GPU $(( $(date +%s) - start ))s"
$BM --nproc 4 --json-out $OUT/four64.json --case "ddp4_64=$(B 64 256)" --case "fsdp4_64=$(B 64 256) $F" \
    --case "ddp4_64_dp=$(B 64 256) $DP" --case "fsdp4_64_dp=$(B 64 256) $F $DP" > $OUT/four64.txt 2>&1
grep -E "^\|" $OUT/four64.txt; echo "total $(( $(date +%s) - start ))s"
