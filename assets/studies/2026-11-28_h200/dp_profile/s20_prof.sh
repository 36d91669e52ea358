#!/usr/bin/env bash
# Issue 54 (one H200): the merged tree (DP's norms in the compiled graph), one GPU at 32: DP and no DP, profiled.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PYTHONPATH || exit
export PYTHONUNBUFFERED=1 PYTHON=python3
git log --oneline -1; start=$(date +%s)
B() { echo "--training.local_batch_size $1 --training.global_batch_size $2"; }
DP="--dp.enable true --dp.mode flash_bookkeeping --dp.noise_multiplier 1.0"
BM="scripts/benchmark.py --config train_configs/dit_xl2_latent256.toml --warmup 5 --steps 12 --timeout 200"
python3 $BM --profile-dir $OUT/prof --case "one_32_dp=$(B 32 32) $DP" --case "one_32=$(B 32 32)" > $OUT/prof.txt 2>&1
grep -hE "^\| one" $OUT/prof.txt; echo "total $(( $(date +%s) - start ))s"
