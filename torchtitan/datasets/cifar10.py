"""CIFAR-10 from the standard python-pickle batches in a local folder (no download)."""

from pathlib import Path
from typing import BinaryIO

import numpy as np
import torch
from torch.utils.data import Dataset

from torchtitan.tools import safe_pickle

TRAIN_BATCHES = [f"data_batch_{i}" for i in range(1, 6)]
TEST_BATCHES = ["test_batch"]  # 10,000 images: the held-out split of a DiT's fixed-timestep loss

# A CIFAR-10 python batch is a dict of bytes keys holding lists, bytes and a uint8 array: numpy's array
# rebuilders are the only globals it names.
CIFAR10_PICKLE_GLOBALS = safe_pickle.NUMPY_ARRAY_GLOBALS


def load_cifar10_pickle(file: BinaryIO) -> dict:
    """Reads a CIFAR-10 python pickle (a data batch or batches.meta) from an open binary file, safely.

    Raises:
        UnsafePickleError: the file names a global other than numpy's array rebuilders (which could run code); the
            message names the file and the global.
    """
    source = str(getattr(file, "name", "<stream>"))
    # encoding="bytes": the batches were written by Python 2, whose str is bytes.
    return safe_pickle.load(file, CIFAR10_PICKLE_GLOBALS, source, "a CIFAR-10 python batch", encoding="bytes")


def find_cifar10_folder(root: str, batches: list[str] = TRAIN_BATCHES) -> Path:
    """The folder holding the batches (data_batch_1..5; or test_batch): `root` itself or its cifar-10-batches-py
    child."""
    path = Path(root)
    for candidate in (path, path / "cifar-10-batches-py"):
        if (candidate / batches[0]).is_file():
            return candidate
    what = "python batches (data_batch_1..5)" if batches == TRAIN_BATCHES else f"batch {batches[0]}"
    raise FileNotFoundError(f"training.dataset_path: {root} holds no CIFAR-10 {what}; unpack "
                            "cifar-10-python.tar.gz there")  # fmt: skip


class CIFAR10Dataset(Dataset):
    """3 x 32 x 32 images in [-1, 1], labels 0..9, random horizontal flips; the training batches, or `batches`
    (TEST_BATCHES: the test split)."""

    num_classes = 10

    def __init__(self, root: str, random_flip: bool = True, batches: list[str] = TRAIN_BATCHES):
        folder = find_cifar10_folder(root, batches)
        images, labels = [], []
        for name in batches:
            file = folder / name
            if not file.is_file():
                raise FileNotFoundError(f"training.dataset_path: CIFAR-10 batch {file} is missing")
            with open(file, "rb") as f:
                batch = load_cifar10_pickle(f)
            images.append(np.asarray(batch[b"data"], dtype=np.uint8).reshape(-1, 3, 32, 32))
            labels.extend(batch[b"labels"])
        self.images = torch.from_numpy(np.concatenate(images))
        self.labels = torch.tensor(labels, dtype=torch.long)
        self.random_flip = random_flip

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int):
        image = self.images[index].float() / 127.5 - 1.0
        if self.random_flip and torch.rand(()) < 0.5:
            image = image.flip(-1)
        return image, self.labels[index]
