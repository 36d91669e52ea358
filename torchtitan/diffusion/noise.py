"""The noise of a sampling run, a function of each sample's index in the run alone.

Sample i of a run seeded s draws its starting noise, then any step noise of a stochastic sampler, from a CPU
generator of its own seeded s * SEED_STRIDE + i. Which batch, rank or process samples it, and how large its batch
is, changes nothing: 1, 2 or 4 GPUs, any batch size, and a run resumed from its shards give the same images
(`sample.py --npz`, the FID while training).
"""

from collections.abc import Sequence

import torch

SEED_STRIDE = 1_000_003  # sample i of a run seeded s draws from seed s * SEED_STRIDE + i: runs of 1M samples apart


class IndexedNoise:
    """One CPU generator per sample of a batch; `normal` draws each row from its sample's own generator.

    Samplers take it where they take a `torch.Generator` (`normal_like`), so a stochastic sampler's step noise is
    the sample's too, not the batch's.
    """

    def __init__(self, seed: int, indices: Sequence[int], stride: int = SEED_STRIDE):
        # stride: seeds a run of `stride` samples apart (the fixed-timestep validation loss draws another stream)
        self.generators = [torch.Generator().manual_seed(seed * stride + int(i)) for i in indices]

    def normal(self, shape: Sequence[int]) -> torch.Tensor:
        """(B, ...) standard normal on the CPU, row b from generator b (B = the batch's samples)."""
        if shape[0] != len(self.generators):
            raise ValueError(f"noise for {shape[0]} rows from {len(self.generators)} samples' generators")
        return torch.stack([torch.randn(tuple(shape[1:]), generator=g) for g in self.generators])


def sample_noise(
    seed: int, indices: Sequence[int], channels: int, image_size: int
) -> tuple[torch.Tensor, IndexedNoise]:
    """The starting noise (B, C, H, W) of the samples `indices` of a run seeded `seed`, on the CPU, and their
    generators, which go on to draw a stochastic sampler's step noise (`sample_images(generator=...)`)."""
    noise = IndexedNoise(seed, indices)
    return noise.normal((len(indices), channels, image_size, image_size)), noise


def normal_like(x: torch.Tensor, generator: torch.Generator | IndexedNoise | None = None) -> torch.Tensor:
    """Standard normal noise shaped as x, on x's device: from the global RNG (None), a torch generator (drawn on
    its device), or each sample's own generator (`IndexedNoise`)."""
    if generator is None:
        return torch.randn_like(x)
    if isinstance(generator, IndexedNoise):
        return generator.normal(x.shape).to(x.device, x.dtype)
    return torch.randn(x.shape, generator=generator, device=generator.device).to(x.device, x.dtype)
