#!/usr/bin/env bash
# Issue 54 (2 H200s): book-keeping's write pass compiled per block (working tree) against HEAD (build/dpold), side by
# side: GPU 0 HEAD, GPU 1 the change, at 32 and 64; then DDP-2 at 32 with DP, the change then HEAD.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PYTHONPATH || exit
export PYTHONUNBUFFERED=1 PYTHON=python3
start=$(date +%s)
B() { echo "--training.local_batch_size $1 --training.global_batch_size $2"; }
DP="--dp.enable true --dp.mode flash_bookkeeping --dp.noise_multiplier 1.0"
BM="scripts/benchmark.py --config train_configs/dit_xl2_latent256.toml --warmup 5 --steps 12 --timeout 150"
( cd build/dpold && CUDA_VISIBLE_DEVICES=0 PYTHONPATH=$PWD:$PYTHONPATH python3 $BM --case "old_32_dp=$(B 32 32) $DP" \
    --case "old_64_dp=$(B 64 64) $DP" --case "old_64=$(B 64 64)" > $OUT/one_old.txt 2>&1 ) &
( CUDA_VISIBLE_DEVICES=1 python3 $BM --case "new_32_dp=$(B 32 32) $DP" --case "new_64_dp=$(B 64 64) $DP" \
    --case "new_32=$(B 32 32)" > $OUT/one_new.txt 2>&1 ) &
wait; grep -hE "^\| (old|new)" $OUT/one_old.txt $OUT/one_new.txt; echo "one GPU $(( $(date +%s) - start ))s"
python3 $BM --nproc 2 --case "ddp2_32_dp_new=$(B 32 64) $DP" > $OUT/ddp2_new.txt 2>&1
grep -hE "^\| ddp" $OUT/ddp2_new.txt
( cd build/dpold && PYTHONPATH=$PWD:$PYTHONPATH python3 $BM --nproc 2 --case "ddp2_32_dp_old=$(B 32 64) $DP" > $OUT/ddp2_old.txt 2>&1 )
grep -hE "^\| (old|new|ddp)" $OUT/one_old.txt $OUT/one_new.txt $OUT/ddp2_new.txt $OUT/ddp2_old.txt; echo "total $(( $(date +%s) - start ))s"
