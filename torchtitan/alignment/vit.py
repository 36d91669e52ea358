"""The DINOv2 vision transformer (Oquab et al. 2023) as a plain module, for the frozen encoder of representation
alignment: no xformers, no masking, no stochastic depth; inference only.

Parameter names are those of facebookresearch/dinov2's `DinoVisionTransformer` as its hub `.pth` files hold them
(block_chunks = 0), so an official state dict loads as it is (dinov2_weights.py also maps a Hugging Face
`Dinov2Model` folder onto them). The position table is the one for the grid the encoder runs at: the reader resamples
the published 37 x 37 table once, as REPA does, instead of interpolating it in every forward.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class ViTArgs:
    """One DINOv2 architecture. The published ones: ViT-S/14 (384, 12 blocks), B/14 (768, 12), L/14 (1024, 24) with
    GELU MLPs, g/14 (1536, 40) with SwiGLU; 64-wide heads; LayerScale; 0 or 4 register tokens."""

    dim: int
    depth: int
    num_heads: int
    patch_size: int = 14
    grid: int = 16  # tokens per side of the input this instance runs at (REPA: 16 at 256 px, 32 at 512 px)
    mlp: str = "gelu"  # "gelu" (fc1, fc2) | "swiglu" (w12, w3)
    mlp_ratio: float = 4.0
    num_register_tokens: int = 0
    layerscale: bool = True
    norm_eps: float = 1e-6
    in_channels: int = 3

    @property
    def hidden_dim(self) -> int:
        hidden = int(self.dim * self.mlp_ratio)
        if self.mlp == "swiglu":  # two thirds, rounded up to a multiple of 8 (DINOv2's SwiGLUFFNFused)
            hidden = (int(hidden * 2 / 3) + 7) // 8 * 8
        return hidden

    @property
    def image_size(self) -> int:
        return self.grid * self.patch_size

    def forward_flops(self) -> float:
        """Forward FLOPs of one image (matmuls and attention, 2 per multiply-add)."""
        tokens = self.grid**2 + 1 + self.num_register_tokens
        fc1 = 2 * self.hidden_dim if self.mlp == "swiglu" else self.hidden_dim
        per_token = 4 * self.dim * self.dim + self.dim * fc1 + self.hidden_dim * self.dim
        attention = 2 * tokens * tokens * self.dim
        patch = self.grid**2 * self.in_channels * self.patch_size**2 * self.dim
        return 2.0 * (self.depth * (tokens * per_token + attention) + patch)


class LayerScale(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.gamma = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gamma


class Attention(nn.Module):
    def __init__(self, args: ViTArgs):
        super().__init__()
        self.num_heads = args.num_heads
        self.qkv = nn.Linear(args.dim, 3 * args.dim)
        self.proj = nn.Linear(args.dim, args.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, N, D = x.shape
        q, k, v = self.qkv(x).view(B, N, 3, self.num_heads, D // self.num_heads).unbind(2)  # each (B, N, nh, hd)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        return self.proj(out.transpose(1, 2).reshape(B, N, D))


class Mlp(nn.Module):
    def __init__(self, args: ViTArgs):
        super().__init__()
        self.fc1 = nn.Linear(args.dim, args.hidden_dim)
        self.fc2 = nn.Linear(args.hidden_dim, args.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))  # the exact GELU, as DINOv2's nn.GELU


class SwiGLU(nn.Module):
    def __init__(self, args: ViTArgs):
        super().__init__()
        self.w12 = nn.Linear(args.dim, 2 * args.hidden_dim)
        self.w3 = nn.Linear(args.hidden_dim, args.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w12(x).chunk(2, dim=-1)
        return self.w3(F.silu(gate) * up)


class Block(nn.Module):
    def __init__(self, args: ViTArgs):
        super().__init__()
        self.norm1 = nn.LayerNorm(args.dim, eps=args.norm_eps)
        self.attn = Attention(args)
        self.ls1 = LayerScale(args.dim) if args.layerscale else nn.Identity()
        self.norm2 = nn.LayerNorm(args.dim, eps=args.norm_eps)
        self.mlp = SwiGLU(args) if args.mlp == "swiglu" else Mlp(args)
        self.ls2 = LayerScale(args.dim) if args.layerscale else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.ls1(self.attn(self.norm1(x)))
        return x + self.ls2(self.mlp(self.norm2(x)))


class PatchEmbed(nn.Module):
    def __init__(self, args: ViTArgs):
        super().__init__()
        self.proj = nn.Conv2d(args.in_channels, args.dim, kernel_size=args.patch_size, stride=args.patch_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x).flatten(2).transpose(1, 2)  # (B, N, D)


class VisionTransformer(nn.Module):
    """DINOv2's ViT at one input size, `args.image_size` square."""

    def __init__(self, args: ViTArgs):
        super().__init__()
        self.args = args
        self.patch_embed = PatchEmbed(args)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, args.dim))
        self.pos_embed = nn.Parameter(torch.zeros(1, 1 + args.grid**2, args.dim))
        registers = args.num_register_tokens
        self.register_tokens = nn.Parameter(torch.zeros(1, registers, args.dim)) if registers else None
        self.blocks = nn.ModuleList(Block(args) for _ in range(args.depth))
        self.norm = nn.LayerNorm(args.dim, eps=args.norm_eps)

    def forward_features(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        """(B, 3, S, S) normalized images, S = args.image_size -> the normalized tokens, as DINOv2's
        forward_features names them: x_norm_clstoken (B, D), x_norm_regtokens (B, R, D), x_norm_patchtokens
        (B, grid^2, D)."""
        if x.shape[-2:] != (self.args.image_size, self.args.image_size):
            raise ValueError(f"the encoder runs at {self.args.image_size} px (its position table's {self.args.grid}^2"
                             f" patches), got {tuple(x.shape[-2:])}")  # fmt: skip
        h = self.patch_embed(x)  # (B, N, D)
        h = torch.cat([self.cls_token.expand(h.shape[0], -1, -1), h], dim=1) + self.pos_embed
        if self.register_tokens is not None:  # after the positions: registers have none
            h = torch.cat([h[:, :1], self.register_tokens.expand(h.shape[0], -1, -1), h[:, 1:]], dim=1)
        for block in self.blocks:
            h = block(h)
        h = self.norm(h)
        first_patch = 1 + self.args.num_register_tokens
        return {"x_norm_clstoken": h[:, 0], "x_norm_regtokens": h[:, 1:first_patch],
                "x_norm_patchtokens": h[:, first_patch:]}  # fmt: skip
