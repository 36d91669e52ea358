"""Encode an ImageNet-style image folder (one subfolder per class) into latent shards, once.

    torchrun --nproc_per_node=8 data/imagenet/prepare.py --source /datasets/imagenet/train \
        --image-size 256 --tokenizer cosmos_jit --checkpoint-dir checkpoints/Cosmos-0.1-Tokenizer-CI8x8

Works for any folder with class subfolders. Images get ADM's center crop (ImageFolderDataset's); each
rank encodes its own shards; rerunning after an interruption skips the finished shards. See docs/latent.md.
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root, when run as a script

from torchtitan.datasets.imagefolder import ImageFolderDataset  # noqa: E402
from torchtitan.datasets.prepare_latents import (  # noqa: E402
    add_prepare_args,
    check_prepare_args,
    exit_code_of,
    run_prepare,
)
from torchtitan.tools.logging import init_logger  # noqa: E402


def prepare(args: argparse.Namespace) -> int:
    check_prepare_args(args)
    if args.image_size <= 0:
        raise ValueError(f"--image-size {args.image_size}: must be > 0")
    source = ImageFolderDataset(args.source, args.image_size, random_flip=False)
    return run_prepare(args, source, args.image_size, source.num_classes, source.classes,
                       f"image folder {args.source} at {args.image_size}px")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--source", required=True, help="image folder with one subfolder per class")
    parser.add_argument("--image-size", type=int, default=256, help="center-crop size in pixels")
    add_prepare_args(parser, default_out="data/imagenet/prepared")
    args = parser.parse_args(argv)
    init_logger()
    return exit_code_of(lambda: prepare(args))  # errors: one line naming the file or flag, exit code 2


if __name__ == "__main__":
    sys.exit(main())
