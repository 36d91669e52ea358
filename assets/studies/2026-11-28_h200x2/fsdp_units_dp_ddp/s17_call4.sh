#!/usr/bin/env bash
# Call 4 (2 H200s): FSDP-2 as shipped now (units auto, prefetch 1) beside DDP-2 at 64 a GPU. Issue 54.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PYTHONPATH || exit
export PYTHONUNBUFFERED=1 PYTHON=python3
B() { echo "--training.local_batch_size $1 --training.global_batch_size $2"; }
F="--parallelism.data_parallel_replicate_degree 1 --parallelism.data_parallel_shard_degree 2"
python3 scripts/benchmark.py --config train_configs/dit_xl2_latent256.toml --warmup 5 --steps 12 --timeout 120 --nproc 2 \
  --json-out $OUT/four.json --case "fsdp2_64=$(B 64 128) $F" --case "ddp2_64=$(B 64 128)" > $OUT/four.txt 2>&1
grep -E "^\||FSDP units" $OUT/four.txt | sort -u
