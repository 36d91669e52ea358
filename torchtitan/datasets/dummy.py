"""Synthetic tensors of any shape, for benchmarks: no I/O, no decoding."""

import torch
from torch.utils.data import Dataset


class DummyDataset(Dataset):
    """Deterministic Gaussian 'images' (C, H, W) and labels, a fixed pool reused by index."""

    def __init__(self, channels: int, image_size: int, num_classes: int, length: int = 1 << 20, pool: int = 256):
        generator = torch.Generator().manual_seed(0)
        self.images = torch.randn(pool, channels, image_size, image_size, generator=generator)
        self.labels = torch.randint(0, max(num_classes, 1), (pool,), generator=generator)
        self.length = length
        self.num_classes = num_classes

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int):
        return self.images[index % len(self.images)], self.labels[index % len(self.labels)]
