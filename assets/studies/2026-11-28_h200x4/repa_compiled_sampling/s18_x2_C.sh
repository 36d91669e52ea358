#!/usr/bin/env bash
# Issues 52 and 53 on 2 H200s (one call, < 10 minutes): REPA's train.py step compiled (GPU 1) beside our aligned
# SiT-XL/2 at 64 and SiT-B/2 with the encoder against stored features (GPU 0); then our sampler against REPA's
# generate.py. Rows go to $OUT as each part ends. Needs the timm, diffusers, huggingface_hub wheels in .whl.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PYTHONPATH || exit
export PYTHONUNBUFFERED=1 PYTHON=python3 HF_HUB_OFFLINE=1
git log --oneline -1; start=$(date +%s); mkdir -p /tmp/d
python3 - <<'PY'
import torch
from torchtitan.alignment.vit import VisionTransformer, ViTArgs
torch.manual_seed(0)
m = VisionTransformer(ViTArgs(dim=768, depth=12, num_heads=12, grid=37))
state = {k: 0.02 * torch.randn_like(v) for k, v in m.state_dict().items()}
state["mask_token"] = torch.zeros(1, 768)
torch.save(state, "/tmp/d/dinov2_vitb14_random.pth")
PY
E="--alignment.encoder_path /tmp/d/dinov2_vitb14_random.pth"
B() { echo "--training.local_batch_size $1 --training.global_batch_size $1"; }
(
  export CUDA_VISIBLE_DEVICES=0
  python3 scripts/benchmark.py --config train_configs/sit_xl2_repa.toml --warmup 5 --steps 15 --timeout 170 \
    --json-out $OUT/ours.json --case "on64=$(B 64) $E" --case "b2_encoder=$(B 256) --model.flavor SiT-B/2 $E" \
    --case "b2_stored=$(B 256) --model.flavor SiT-B/2 $E --alignment.features stored" > $OUT/ours.txt 2>&1
) &
(
  export CUDA_VISIBLE_DEVICES=1
  timeout 240 python3 scripts/benchmarks/benchmark_reference_repa.py --reference-repa build/ref_repa --warmup 5 \
    --steps 15 --batch 64 --compile --name repa64_compiled > $OUT/repa64c.txt 2>&1
) &
wait; grep -hE "^\|" $OUT/ours.txt $OUT/repa64c.txt; echo "training part $(( $(date +%s) - start ))s"
timeout $(( 570 - ($(date +%s) - start) )) python3 scripts/benchmarks/benchmark_sampling.py --reference-repa build/ref_repa \
  --gpus 0,1 --num-samples 256 --batch 64 --ours-extra=--compile --json-out $OUT/sampling.json > $OUT/sampling.txt 2>&1
grep -E "^\|" $OUT/sampling.txt; echo "total $(( $(date +%s) - start ))s"
