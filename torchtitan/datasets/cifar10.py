"""CIFAR-10 from the standard python-pickle batches in a local folder (no download)."""

import pickle
from pathlib import Path
from typing import BinaryIO

import numpy as np
import torch
from torch.utils.data import Dataset

TRAIN_BATCHES = [f"data_batch_{i}" for i in range(1, 6)]

# The only globals a CIFAR-10 python batch names: a dict of bytes keys holding lists, bytes and a uint8
# array, which numpy rebuilds with _reconstruct(ndarray, ...) and a dtype. numpy 2 spells numpy.core as
# numpy._core, and its protocol-5 pickles (Python 3.14's default) rebuild arrays with _frombuffer instead.
CIFAR10_PICKLE_GLOBALS = frozenset(
    {
        ("numpy.core.multiarray", "_reconstruct"),
        ("numpy._core.multiarray", "_reconstruct"),
        ("numpy.core.numeric", "_frombuffer"),
        ("numpy._core.numeric", "_frombuffer"),
        ("numpy", "ndarray"),
        ("numpy", "dtype"),
    }
)


class CIFAR10Unpickler(pickle.Unpickler):
    """An unpickler that admits only CIFAR10_PICKLE_GLOBALS.

    A plain pickle.load calls whatever a file names (os.system, builtins.eval): a crafted "batch" would run
    code. Every callable a pickle can invoke comes through find_class, so refusing there refuses them all.
    """

    def __init__(self, file: BinaryIO, source: str | Path):
        super().__init__(file, encoding="bytes")  # the batches were written by Python 2: str is bytes
        self.source = source

    def find_class(self, module: str, name: str):
        if (module, name) not in CIFAR10_PICKLE_GLOBALS:
            raise pickle.UnpicklingError(
                f"{self.source}: refused the global {module}.{name}: a CIFAR-10 python batch holds only dicts, "
                "lists, bytes and numpy arrays, and loading other globals can run code"
            )
        return super().find_class(module, name)


def load_cifar10_pickle(file: BinaryIO) -> dict:
    """Reads a CIFAR-10 python pickle (a data batch or batches.meta) from an open binary file, safely.

    Raises:
        pickle.UnpicklingError: the file names a global other than numpy's array rebuilders; the message
            names the file and the global.
    """
    return CIFAR10Unpickler(file, getattr(file, "name", "<stream>")).load()


def find_cifar10_folder(root: str) -> Path:
    """The folder holding data_batch_1..5: `root` itself or its cifar-10-batches-py child."""
    path = Path(root)
    for candidate in (path, path / "cifar-10-batches-py"):
        if (candidate / "data_batch_1").is_file():
            return candidate
    raise FileNotFoundError(
        f"training.dataset_path: {root} holds no CIFAR-10 python batches (data_batch_1..5); "
        "unpack cifar-10-python.tar.gz there"
    )


class CIFAR10Dataset(Dataset):
    """3 x 32 x 32 images in [-1, 1], labels 0..9, random horizontal flips."""

    num_classes = 10

    def __init__(self, root: str, random_flip: bool = True):
        folder = find_cifar10_folder(root)
        images, labels = [], []
        for name in TRAIN_BATCHES:
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
