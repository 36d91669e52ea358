#!/usr/bin/env bash
# Call 3 (2 H200s): as shipped after the change (FSDP units auto, prefetch 1; DP under DDP the whole model compiled):
# one GPU with and without DP side by side, then DDP-2 and FSDP-2 at 64 and 32, with and without DP. Issue 54.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PYTHONPATH || exit
export PYTHONUNBUFFERED=1 PYTHON=python3
git log --oneline -1; start=$(date +%s); mkdir -p /tmp/r
BM="python3 scripts/benchmark.py --config train_configs/dit_xl2_latent256.toml --warmup 5 --steps 12 --timeout 150"
B() { echo "--training.local_batch_size $1 --training.global_batch_size $2"; }
F="--parallelism.data_parallel_replicate_degree 1 --parallelism.data_parallel_shard_degree 2"
DP="--dp.enable true --dp.mode flash_bookkeeping --dp.noise_multiplier 1.0"
CUDA_VISIBLE_DEVICES=0 $BM --json-out /tmp/r/one.json --case "one_64=$(B 64 64)" --case "one_32=$(B 32 32)" > /tmp/r/one.txt 2>&1 &
CUDA_VISIBLE_DEVICES=1 $BM --json-out /tmp/r/one_dp.json --case "one_64_dp=$(B 64 64) $DP" --case "one_32_dp=$(B 32 32) $DP" > /tmp/r/one_dp.txt 2>&1 &
wait; grep -hE "^\| one" /tmp/r/one.txt /tmp/r/one_dp.txt; echo "one GPU $(( $(date +%s) - start ))s"
$BM --nproc 2 --json-out /tmp/r/two.json --case "ddp2_64=$(B 64 128)" --case "fsdp2_64=$(B 64 128) $F" \
    --case "ddp2_32=$(B 32 64)" --case "fsdp2_32=$(B 32 64) $F" \
    --case "ddp2_64_dp=$(B 64 128) $DP" --case "fsdp2_64_dp=$(B 64 128) $F $DP" \
    --case "ddp2_32_dp=$(B 32 64) $DP" --case "fsdp2_32_dp=$(B 32 64) $F $DP" 2>&1 | tee /tmp/r/two.txt | grep -E "^\||rror"
echo "total $(( $(date +%s) - start ))s"
grep -h "FSDP units\|compiled " /tmp/r/*.txt | sort | uniq -c | head
cd /tmp/r && tar czf $OUT/r.tgz . && cd - >/dev/null
