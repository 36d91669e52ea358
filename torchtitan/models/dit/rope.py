"""2D rotary position embedding for image tokens.

Half of each head's rotary pairs encode the token's row, the other half its
column, as in 2D RoPE variants used by FiT/Lumina-style DiTs. Attention scores
then depend only on the relative offset between two tokens.
"""

import torch


def build_rope_2d(
    head_dim: int, grid_h: int, grid_w: int, theta: float = 10000.0, offset: tuple[int, int] = (0, 0)
) -> torch.Tensor:
    """Returns (T, head_dim // 2, 2) cos/sin table for a grid_h x grid_w token grid.

    Args:
        head_dim: attention head size; must be divisible by 4 (two axes, pairs).
        grid_h: number of token rows.
        grid_w: number of token columns.
        theta: RoPE base frequency.
        offset: (row, col) added to every position; used by the relative-position test.
    """
    if head_dim % 4 != 0:
        raise ValueError(f"2D RoPE needs head_dim divisible by 4, got {head_dim}")
    quarter = head_dim // 4
    freqs = 1.0 / (theta ** (torch.arange(quarter, dtype=torch.float64) / quarter))  # (hd/4,)
    rows = torch.arange(grid_h, dtype=torch.float64) + offset[0]
    cols = torch.arange(grid_w, dtype=torch.float64) + offset[1]
    rr, cc = torch.meshgrid(rows, cols, indexing="ij")  # (H, W)
    angle_r = rr.reshape(-1, 1) * freqs  # (T, hd/4)
    angle_c = cc.reshape(-1, 1) * freqs  # (T, hd/4)
    angles = torch.cat([angle_r, angle_c], dim=-1)  # (T, hd/2)
    return torch.stack([angles.cos(), angles.sin()], dim=-1).float()  # (T, hd/2, 2)


def apply_rope(x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """Rotates pairs (x[i], x[i + hd/2]) of x's last dim ("rotate half", as GPT-NeoX).

    x: (B, T, nh, hd), token-major as the qkv projection writes it; rope: (T, hd/2, 2). Contiguous halves
    rather than interleaved pairs keep the fused kernel's loads and stores contiguous; the rotation is
    linear, so backward keeps no activations.
    """
    cos, sin = rope[:, None, :, 0].to(x.dtype), rope[:, None, :, 1].to(x.dtype)  # (T, 1, hd/2)
    x1, x2 = x.chunk(2, dim=-1)  # each (B, T, nh, hd/2)
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)
