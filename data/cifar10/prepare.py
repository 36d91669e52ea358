"""Encode CIFAR-10 (the python-pickle batches, 32x32) into latent shards, once.

    torchrun --nproc_per_node=2 data/cifar10/prepare.py --source data/cifar10/cifar-10-batches-py \
        --tokenizer cosmos_jit --checkpoint-dir checkpoints/Cosmos-0.1-Tokenizer-CI8x8

The training batches (data_batch_1..5) are encoded; each rank encodes its own shards; rerunning after an
interruption skips the finished shards. See docs/latent.md.
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root, when run as a script

from torchtitan.datasets.cifar10 import CIFAR10Dataset, find_cifar10_folder, load_cifar10_pickle  # noqa: E402
from torchtitan.datasets.prepare_latents import (  # noqa: E402
    add_prepare_args,
    check_prepare_args,
    exit_code_of,
    run_prepare,
)
from torchtitan.tools.logging import init_logger  # noqa: E402


def class_names(root: str) -> list[str]:
    """Label names from batches.meta when it is there."""
    meta = find_cifar10_folder(root) / "batches.meta"
    if not meta.is_file():
        return []
    with open(meta, "rb") as f:
        return [name.decode() for name in load_cifar10_pickle(f).get(b"label_names", [])]


def prepare(args: argparse.Namespace) -> int:
    check_prepare_args(args)
    source = CIFAR10Dataset(args.source, random_flip=False)
    return run_prepare(args, source, 32, source.num_classes, class_names(args.source),
                       f"CIFAR-10 {args.source}")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--source", required=True, help="folder with data_batch_1..5 (or its parent)")
    add_prepare_args(parser, default_out="data/cifar10/prepared")
    args = parser.parse_args(argv)
    init_logger()
    return exit_code_of(lambda: prepare(args))  # errors: one line naming the file or flag, exit code 2


if __name__ == "__main__":
    sys.exit(main())
