"""Synthetic tensors of any shape, for benchmarks: no I/O, no decoding, and no loading cost at all.

A batch is one gather from a fixed pool (`gather`), which the loader does where the pool lives: on the GPU once
the device prefetcher has moved it there (`move_pool`), so a benchmark's step never waits for collation, pinning
or a host-to-device copy, whatever `training.dataloader.num_workers` says.
"""

import torch
from torch.utils.data import Dataset

from torchtitan.datasets.prefetch import LatentsAndFeatures, LatentsAndImages


class DummyDataset(Dataset):
    """Deterministic 'images' (C, H, W) and labels, a fixed pool reused by index.

    Three channels are RGB pixels: uint8 in [0, 255], as an image folder's travel (the device maps them to
    [-1, 1]); any other number of channels are latents: Gaussian float32. With `images`, latents come with uint8
    RGB images 8x their size (SD-VAE's downsample), as prepared latents with --store-images do, for an alignment
    encoder to see (prefetch.LatentsAndImages); with `features` (T, D), float16 Gaussian features in their place, as
    latents prepared with --store-features hold (prefetch.LatentsAndFeatures).
    """

    def __init__(self, channels: int, image_size: int, num_classes: int, length: int = 1 << 20, pool: int = 256,
                 images: bool = False, features: tuple[int, int] | None = None, seed: int = 0):  # fmt: skip
        generator = torch.Generator().manual_seed(seed)  # 1: the held-out pool of the fixed-timestep loss
        shape = (pool, channels, image_size, image_size)
        if channels == 3:
            self.images = torch.randint(0, 256, shape, generator=generator, dtype=torch.uint8)
        else:
            self.images = torch.randn(shape, generator=generator)
        self.clean = None  # what an alignment sees of the images latents stand for: the pixels, or their features
        self.with_clean = LatentsAndImages
        if features is not None and channels != 3:
            self.clean = torch.randn((pool, *features), generator=generator).to(torch.float16)
            self.with_clean = LatentsAndFeatures
        elif images and channels != 3:
            pixel_shape = (pool, 3, 8 * image_size, 8 * image_size)
            self.clean = torch.randint(0, 256, pixel_shape, generator=generator, dtype=torch.uint8)
        self.labels = torch.randint(0, max(num_classes, 1), (pool,), generator=generator)
        self.length = length
        self.num_classes = num_classes

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int):
        slot = index % len(self.images)
        x = self.images[slot] if self.clean is None else self.with_clean(self.images[slot], self.clean[slot])
        return x, self.labels[index % len(self.labels)]

    def gather(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The items at `indices` (B,) as one batch, (B, C, H, W) and (B,), equal to collating `self[i]` for each:
        one gather each, on the device the pool lives on."""
        slots = (indices % len(self.images)).to(self.images.device, non_blocking=True)
        x = self.images.index_select(0, slots)
        if self.clean is not None:
            x = self.with_clean(x, self.clean.index_select(0, slots))
        return x, self.labels.index_select(0, slots)

    def move_pool(self, device: torch.device) -> None:
        """Keeps the pool on `device` (on a GPU: 50 MiB of pixels at 256x256, or 64 MiB of 64x64x16 latents), where
        `gather` then builds each batch. Only for loaders that gather in this process: a forked loader worker
        cannot touch CUDA memory."""
        self.images, self.labels = self.images.to(device), self.labels.to(device)
        self.clean = self.clean.to(device) if self.clean is not None else None
