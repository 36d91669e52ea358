"""Poisson sampling, the batch sampling that DP-SGD's accountants assume.

Each step, every example joins the global batch independently with probability q, so the
batch size varies (mean q N). The global batch is a pure function of (seed, step): every rank
draws the same one and keeps its share, and a resumed run draws what it would have drawn.
Average the clipped sum by the expected batch size q N (DPEngine's global_batch_size), not
the drawn one, as the privacy analysis of the sampled Gaussian mechanism does.
"""

import torch
from torch.utils.data import Sampler

from torchtitan.dp.noise import block_seed


class PoissonBatchSampler(Sampler[list[int]]):
    """Yields this rank's indices of each step's Poisson-sampled global batch.

    Args:
        num_samples: dataset size N.
        sample_rate: q; the expected global batch is q N.
        num_steps: number of batches to yield.
        seed: sampling seed (same on every rank).
        rank: this data-parallel rank; it keeps indices rank, rank + world_size, ... of the batch.
        world_size: data-parallel size.
    """

    def __init__(
        self, num_samples: int, sample_rate: float, num_steps: int, seed: int = 0, rank: int = 0, world_size: int = 1
    ):
        if not 0 < sample_rate <= 1:
            raise ValueError(f"sample_rate must be in (0, 1], got {sample_rate}")
        self.num_samples, self.sample_rate, self.num_steps = num_samples, sample_rate, num_steps
        self.seed, self.rank, self.world_size = seed, rank, world_size
        self.step = 0  # the next step to draw: restored on resume

    def batch(self, step: int) -> list[int]:
        """This rank's indices of step `step`'s batch."""
        generator = torch.Generator().manual_seed(block_seed(self.seed, step, "poisson", 0))
        chosen = (torch.rand(self.num_samples, generator=generator) < self.sample_rate).nonzero().flatten()
        return chosen[self.rank :: self.world_size].tolist()

    def __iter__(self):
        while self.step < self.num_steps:
            indices = self.batch(self.step)
            self.step += 1
            yield indices

    def __len__(self) -> int:
        return self.num_steps

    def state_dict(self) -> dict:
        return {"step": self.step}

    def load_state_dict(self, state: dict) -> None:
        self.step = int(state["step"])


def pad_batch(indices: list[int], size: int, pad_index: int = 0) -> tuple[list[int], torch.Tensor]:
    """Pads a variable Poisson batch to a fixed size for static shapes.

    Returns the padded indices and a (size,) bool mask for DPEngine.backward (False: padding).
    Never truncates: dropping drawn examples would break the accountant's assumption.
    """
    if len(indices) > size:
        raise ValueError(f"Poisson batch of {len(indices)} does not fit in {size}; raise the padded size")
    mask = torch.zeros(size, dtype=torch.bool)
    mask[: len(indices)] = True
    return indices + [pad_index] * (size - len(indices)), mask
