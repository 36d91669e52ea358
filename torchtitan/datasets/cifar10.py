"""CIFAR-10 from the standard python-pickle batches in a local folder (no download)."""

import pickle
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

TRAIN_BATCHES = [f"data_batch_{i}" for i in range(1, 6)]


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
                batch = pickle.load(f, encoding="bytes")
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
