#!/usr/bin/env bash
# Issue 54 (4 H200s): DP's norms in the compiled graph (branch dp-in-graph, a copy in build/dpgraph) against main.
# Phase 1, side by side: GPU 0 main (no DP, DP), GPU 1 the branch (DP), at 32 then 64 a GPU. Phase 2: DDP-4 at 32,
# no DP and DP on main, DP on the branch. Rows to $OUT as each benchmark ends. Beside phase 1, on GPU 2: build/s19_val.sh.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PYTHONPATH || exit
export PYTHONUNBUFFERED=1 PYTHON=python3
git log --oneline -1; start=$(date +%s)
B() { echo "--training.local_batch_size $1 --training.global_batch_size $2"; }
DP="--dp.enable true --dp.mode flash_bookkeeping --dp.noise_multiplier 1.0"
BM="scripts/benchmark.py --config train_configs/dit_xl2_latent256.toml --warmup 5 --steps 12 --timeout 170"
( CUDA_VISIBLE_DEVICES=0 python3 $BM --case "main_32=$(B 32 32)" --case "main_32_dp=$(B 32 32) $DP" \
    --case "main_64_dp=$(B 64 64) $DP" > $OUT/one_main.txt 2>&1 ) &
( cd build/dpgraph && CUDA_VISIBLE_DEVICES=1 PYTHONPATH=$PWD:$PYTHONPATH python3 $BM --case "graph_32_dp=$(B 32 32) $DP" \
    --case "graph_32=$(B 32 32)" --case "graph_64_dp=$(B 64 64) $DP" > $OUT/one_graph.txt 2>&1 ) &
( VAL_GPU=2 bash build/s19_val.sh > $OUT/val_log.txt 2>&1 ) &   # issue 53's validation-loss cost, GPU 2 alone
wait; cat $OUT/valloss.txt; grep -hE "^\| (main|graph)" $OUT/one_main.txt $OUT/one_graph.txt; echo "one GPU $(( $(date +%s) - start ))s"
python3 $BM --nproc 4 --case "ddp4_32=$(B 32 128)" --case "ddp4_32_dp=$(B 32 128) $DP" > $OUT/ddp4_main.txt 2>&1
grep -hE "^\| ddp" $OUT/ddp4_main.txt
( cd build/dpgraph && PYTHONPATH=$PWD:$PYTHONPATH python3 $BM --nproc 4 --case "ddp4_32_dp_graph=$(B 32 128) $DP" > $OUT/ddp4_graph.txt 2>&1 )
grep -hE "^\| ddp" $OUT/ddp4_main.txt $OUT/ddp4_graph.txt; echo "total $(( $(date +%s) - start ))s"
