"""Synthetic tensors of any shape, for benchmarks: no I/O, no decoding, and no loading cost at all.

A batch is one gather from a fixed pool (`gather`), which the loader does where the pool lives: on the GPU once
the device prefetcher has moved it there (`move_pool`), so a benchmark's step never waits for collation, pinning
or a host-to-device copy, whatever `training.dataloader.num_workers` says.
"""

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

    def gather(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The items at `indices` (B,) as one batch, (B, C, H, W) and (B,), equal to collating `self[i]` for each:
        one gather each, on the device the pool lives on."""
        slots = (indices % len(self.images)).to(self.images.device, non_blocking=True)
        return self.images.index_select(0, slots), self.labels.index_select(0, slots)

    def move_pool(self, device: torch.device) -> None:
        """Keeps the pool on `device` (on a GPU: 50 MiB of pixels at 256x256, or 64 MiB of 64x64x16 latents), where
        `gather` then builds each batch. Only for loaders that gather in this process: a forked loader worker
        cannot touch CUDA memory."""
        self.images, self.labels = self.images.to(device), self.labels.to(device)
