"""LightningDiT's latent statistics (`latents_stats.pt`) as a per-channel normalization (`latent.stats_file`).

LightningDiT's ImgLatentDataset normalizes each VA-VAE latent channel by the mean and standard deviation it measured
over 10,000 training latents and saved with `torch.save({"mean": ..., "std": ...})`, each (1, C, 1, 1); its
inference.py undoes it before decoding. Reading that file lets a run train on, and sample.py decode with, exactly its
statistics instead of those prepare.py measured (docs/latent.md, "Reaching FID 2 sooner").
"""

from pathlib import Path

import torch

from torchtitan.tools import safe_pickle


def read_latent_stats(path: str | Path) -> tuple[list[float], list[float]]:
    """LightningDiT's `latents_stats.pt` ({"mean", "std"}, each (1, C, 1, 1): its ImgLatentDataset's per-channel
    statistics of 10,000 latents) as the (mean, std) lists of the per-channel normalization (z - mean) / std it trains
    with (latents.normalization_for makes them a LatentNormalization); read through an allow-list of tensor globals
    (torchtitan/tools/safe_pickle.py): a file naming code is refused before it runs.

    Raises:
        FileNotFoundError: no such file.
        ValueError: not such a file (unreadable, other keys or shapes, a std <= 0 or not finite), naming it.
    """
    path = Path(path)
    where = f"latent.stats_file = {str(path)!r}"
    stats = safe_pickle.torch_load_file(path, safe_pickle.TORCH_TENSOR_GLOBALS, "a latent statistics file", where)
    tensors = [stats.get(key) if isinstance(stats, dict) else None for key in ("mean", "std")]
    if not all(isinstance(t, torch.Tensor) for t in tensors) or tensors[0].numel() != tensors[1].numel():
        raise ValueError(f"{where}: expected {{'mean', 'std'}} tensors of one shape (1, C, 1, 1), as LightningDiT's "
                         "latents_stats.pt")  # fmt: skip
    mean, std = (t.double().reshape(-1) for t in tensors)
    if not (torch.isfinite(mean).all() and torch.isfinite(std).all() and (std > 0).all()):
        raise ValueError(f"{where}: its mean and std must be finite and its std > 0")
    return mean.tolist(), std.tolist()
