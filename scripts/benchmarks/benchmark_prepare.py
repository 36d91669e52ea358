"""Encoding throughput of the latent preparation tool with an SD-VAE-sized AutoencoderKL (random weights).

    python scripts/benchmarks/benchmark_prepare.py --images 1024 --image-size 256 --batch-size 64

Builds a random-weight AutoencoderKL with Stable Diffusion's VAE layout (83.7M parameters), saves it with
save_pretrained, writes a class-folder dataset of random PNGs, then times data/imagenet/prepare.py on it
end to end (flipped copies included: two encodes per image). Prints images/s.
"""

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from PIL import Image

ROOT = Path(__file__).resolve().parents[2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--images", type=int, default=1024)
    parser.add_argument("--image-size", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=64)
    args = parser.parse_args()
    from diffusers import AutoencoderKL

    work = Path(tempfile.mkdtemp())
    vae = AutoencoderKL(
        block_out_channels=(128, 256, 512, 512),
        down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4,
        layers_per_block=2,
        latent_channels=4,
        sample_size=args.image_size,
    )
    vae.save_pretrained(work / "vae")
    parameters = sum(p.numel() for p in vae.parameters())
    rng = np.random.default_rng(0)
    for i in range(args.images):
        folder = work / "images" / f"class{i % 4}"
        folder.mkdir(parents=True, exist_ok=True)
        pixels = rng.integers(0, 255, (args.image_size, args.image_size, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(folder / f"{i}.png")
    cmd = [sys.executable, str(ROOT / "data/imagenet/prepare.py"), "--source", str(work / "images"), "--image-size",
           str(args.image_size), "--tokenizer", "diffusers", "--checkpoint-dir", str(work / "vae"), "--out",
           str(work / "out"), "--batch-size", str(args.batch_size), "--normalization", "scale"]  # fmt: skip
    start = time.perf_counter()
    subprocess.run(cmd, check=True, cwd=ROOT)
    elapsed = time.perf_counter() - start
    print("| images | size | VAE parameters | batch | seconds (end to end) | images/s |\n|---|---|---|---|---|---|")
    print(f"| {args.images} | {args.image_size} | {parameters / 1e6:.1f}M | {args.batch_size} | {elapsed:.1f} | "
          f"{args.images / elapsed:.1f} |")  # fmt: skip


if __name__ == "__main__":
    main()
