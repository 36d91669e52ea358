#!/usr/bin/env bash
# Issue 53 (one H200): the fixed-t validation loss's cost through train.py, the command of docs/diffusion.md.
[ -d /tmp/site ] || { python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit; }; export PYTHONPATH=/tmp/site:$PYTHONPATH
export PYTHONUNBUFFERED=1 PYTHON=python3
start=$(date +%s)
CUDA_VISIBLE_DEVICES=${VAL_GPU:-0} timeout 400 python3 train.py --job.config_file train_configs/imagenet256_latent_dit_xl2.toml --job.dump_folder /tmp/valloss --training.dataset dummy --training.steps 300 --sampling.freq 0 --checkpoint.enable false --metrics.log_freq 10 --validation.enable true --validation.fid_num_samples 0 --validation.loss_freq 100 > $OUT/valloss_train.txt 2>&1
cp /tmp/valloss/metrics.jsonl $OUT/valloss_metrics.jsonl
python3 -c "import json,statistics as s;r=[json.loads(l) for l in open('/tmp/valloss/metrics.jsonl')];v=[x for x in r if 'loss/val' in x][-1];t=s.median(x['step_time_s'] for x in r if 'loss' in x);print(f\"{v['validation/loss_seconds']:.2f} s an evaluation, {t*1e3:.0f} ms a step: {100*v['validation/loss_seconds']/(5000*t):.3f}% of training at loss_freq 5000\")" | tee $OUT/valloss.txt
echo "val $(( $(date +%s) - start ))s"
