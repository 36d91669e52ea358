"""Synthetic tensors of any shape, for benchmarks: no I/O, no decoding."""

import torch
from torch.utils.data import Dataset


class DummyDataset(Dataset):
    """Deterministic 'images' (C, H, W) and labels, a fixed pool reused by index.

    Three channels are RGB pixels: uint8 in [0, 255], as an image folder's travel (the device maps them to
    [-1, 1]); any other number of channels are latents: Gaussian float32.
    """

    def __init__(self, channels: int, image_size: int, num_classes: int, length: int = 1 << 20, pool: int = 256):
        generator = torch.Generator().manual_seed(0)
        shape = (pool, channels, image_size, image_size)
        if channels == 3:
            self.images = torch.randint(0, 256, shape, generator=generator, dtype=torch.uint8)
        else:
            self.images = torch.randn(shape, generator=generator)
        self.labels = torch.randint(0, max(num_classes, 1), (pool,), generator=generator)
        self.length = length
        self.num_classes = num_classes

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int):
        return self.images[index % len(self.images)], self.labels[index % len(self.labels)]
