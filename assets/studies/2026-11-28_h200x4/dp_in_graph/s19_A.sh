#!/usr/bin/env bash
# Issue 54 (4 H200s): the NCCL gradient test alone, every layout and the DP cases, on the branch dp-in-graph (a copy
# in build/dpgraph): its compiled DP cases run the norms in the graph (bmm on bf16/fp32 CUDA), against one GPU eager
# (the Triton kernels). Also checks main's FSDP units defaults (the same in both trees).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PYTHONPATH || exit
export PYTHONUNBUFFERED=1 PYTHON=python3
start=$(date +%s); cd build/dpgraph && export PYTHONPATH=$PWD:$PYTHONPATH
timeout 560 python3 -m pytest -q -s -n 0 -p no:cacheprovider tests/test_parallelisms.py -k nccl > $OUT/nccl.txt 2>&1
grep -E "e-0|passed|failed|Error" $OUT/nccl.txt | tail -24; echo "total $(( $(date +%s) - start ))s"
