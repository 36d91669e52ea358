"""Images out of samplers: [-1, 1] tensors -> PNG grids, or uint8 arrays in ADM's layout."""

import math
from pathlib import Path

import numpy as np
import torch
from PIL import Image


def to_uint8_nhwc(images: torch.Tensor) -> np.ndarray:
    """(N, C, H, W) in [-1, 1] -> (N, H, W, 3) uint8, grey repeated to RGB: ADM's `arr_0`, as `sample.py --npz`
    writes it and the FID's Inception network reads it."""
    # On the images' device: a GPU's batch crosses to the host as uint8, a quarter of its float32 bytes, and the host
    # does no arithmetic (each op rounds as IEEE says on any device: the same bytes).
    images = ((images.float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)
    if images.shape[1] == 1:
        images = images.repeat(1, 3, 1, 1)
    return images.permute(0, 2, 3, 1).contiguous().cpu().numpy()


def save_image_grid(images: torch.Tensor, path: Path, nrow: int = 0) -> Path:
    """Writes (N, C, H, W) images in [-1, 1] (C = 1 or 3) as one PNG grid with 2-pixel gaps.

    Images smaller than 64 px are enlarged by an integer factor (nearest) so a grid is viewable.
    """
    images = ((images.detach().float().cpu().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)
    scale = max(1, 64 // images.shape[-1])
    images = images.repeat_interleave(scale, dim=-2).repeat_interleave(scale, dim=-1)
    n, c, h, w = images.shape
    if c not in (1, 3):
        raise ValueError(f"cannot save {c}-channel images as PNG; decode latents first")
    nrow = nrow or math.ceil(math.sqrt(n))
    ncol = math.ceil(n / nrow)
    pad = 2
    grid = torch.zeros(c, ncol * (h + pad) + pad, nrow * (w + pad) + pad, dtype=torch.uint8)
    for i in range(n):
        r, col = divmod(i, nrow)
        top, left = pad + r * (h + pad), pad + col * (w + pad)
        grid[:, top : top + h, left : left + w] = images[i]
    array = grid.permute(1, 2, 0).numpy()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(array[..., 0] if c == 1 else np.ascontiguousarray(array)).save(path)
    return path
