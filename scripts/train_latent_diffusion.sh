#!/usr/bin/env bash
# Latent diffusion: DiT-XL/2 on ImageNet 256x256 encoded by the Cosmos CI8x8 tokenizer (32x32x16 latents).
# Prepare the latents first (docs/latent.md). Override NGPU / CONFIG_FILE from the environment; extra
# arguments go to train.py, e.g.:
#   NGPU=4 bash scripts/train_latent_diffusion.sh --training.steps 1000
set -euo pipefail
NGPU=${NGPU:-8}
CONFIG_FILE=${CONFIG_FILE:-train_configs/imagenet256_latent_dit_xl2.toml}
cd "$(dirname "$0")/.."
torchrun --nproc_per_node="$NGPU" train.py --job.config_file "$CONFIG_FILE" "$@"
