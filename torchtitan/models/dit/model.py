"""Diffusion Transformer (DiT), after Peebles & Xie, "Scalable Diffusion Models with Transformers".

A plain nn.Module: no kernels, parallelism, DP, logging or config objects here. Fused kernels are converters
(torchtitan/kernels/) that parallelize_dit applies: they swap in modules with the same parameter names.
"""

import math
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

from torchtitan.models.dit.rope import apply_rope, build_rope_2d

_compiled_flex_attention = None  # built on first use: torch.compile at import would cost every process seconds


def windowed_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_mask) -> torch.Tensor:
    """FlexAttention over a block mask. It is a fused kernel only when compiled (its eager path materializes the
    (B, nh, T, T) scores), so eager blocks call a compiled copy, as TorchTitan does; compiled blocks trace it."""
    global _compiled_flex_attention
    if torch.compiler.is_compiling():
        return flex_attention(q, k, v, block_mask=block_mask)
    if _compiled_flex_attention is None:
        _compiled_flex_attention = torch.compile(flex_attention, dynamic=False)
    return _compiled_flex_attention(q, k, v, block_mask=block_mask)


# Position encodings, norms and MLPs a DiT can use (DiTArgs.pos_embed, .norm, .mlp).
# "sincos_rope2d": the fixed sin-cos table added to the tokens and 2D RoPE in attention, both (LightningDiT).
POS_EMBEDS = ("rope2d", "sincos", "learned", "sincos_rope2d")
NORMS = ("layernorm", "rmsnorm")
MLPS = ("gelu", "swiglu")
# Keys that DiTArgs once had and exported "model_args" metadata may still carry: the fused kernels' switches, now
# `model.converters` (torchtitan/kernels/converters.py). They never changed the parameters.
_LEGACY_ARGS = ("fused_norm", "fused_mlp", "fused_qkv")


@dataclass
class DiTArgs:
    """Architecture of one DiT; flavors in `dit_configs` fill these in."""

    input_size: int = 32  # spatial size of the model input (pixels or latent cells)
    in_channels: int = 4
    patch_size: int = 2
    dim: int = 1152
    depth: int = 28
    num_heads: int = 16
    mlp_ratio: float = 4.0
    num_classes: int = 1000  # 0: unconditional
    learn_sigma: bool = True  # output 2 * in_channels: epsilon and the variance interpolation
    pos_embed: str = "rope2d"  # "rope2d" | "sincos" | "learned" | "sincos_rope2d"
    norm: str = "layernorm"  # "layernorm" | "rmsnorm"
    mlp: str = "gelu"  # "gelu" | "swiglu"
    qk_norm: bool = False
    attn_window: int = 0  # > 0: each token attends its (2w+1) x (2w+1) token neighbourhood (FlexAttention)
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    multiple_of: int = 256  # SwiGLU hidden size rounding, as in Llama
    # Representation alignment (REPA, Yu et al. 2025): the tokens after block `align_depth` (1-based; 0: none) go
    # through one 3-layer SiLU MLP (width align_projector_dim) per frozen encoder, to its feature width align_dims[i].
    # Training only: exports that sample drop them (`for_sampling`).
    align_depth: int = 0
    align_dims: tuple[int, ...] = ()
    align_projector_dim: int = 2048

    @classmethod
    def from_dict(cls, values: dict) -> "DiTArgs":
        """DiTArgs from a dict such as an export's "model_args" metadata; keys of older releases that no longer
        shape the model (fused_norm, fused_mlp, fused_qkv) are dropped.

        Raises:
            TypeError: a key that is neither a field nor a legacy key, named.
        """
        values = {key: value for key, value in values.items() if key not in _LEGACY_ARGS}
        if "align_dims" in values:  # JSON holds a list
            values["align_dims"] = tuple(values["align_dims"])
        return cls(**values)

    def for_sampling(self) -> "DiTArgs":
        """These args without the alignment projectors, which only train: what exports that sample hold."""
        return replace(self, align_depth=0, align_dims=())

    @property
    def out_channels(self) -> int:
        return 2 * self.in_channels if self.learn_sigma else self.in_channels

    @property
    def num_tokens(self) -> int:
        return (self.input_size // self.patch_size) ** 2

    @property
    def head_dim(self) -> int:
        return self.dim // self.num_heads

    @property
    def uses_rope(self) -> bool:
        return self.pos_embed in ("rope2d", "sincos_rope2d")

    @property
    def mlp_hidden_dim(self) -> int:
        hidden = int(self.dim * self.mlp_ratio)
        if self.mlp == "swiglu":
            # Llama's 2/3 rule keeps SwiGLU's parameter count equal to a GELU MLP.
            hidden = int(2 * hidden / 3)
            hidden = self.multiple_of * ((hidden + self.multiple_of - 1) // self.multiple_of)
        return hidden

    def validate(self) -> None:
        if self.input_size % self.patch_size != 0:
            raise ValueError(f"input_size {self.input_size} is not divisible by patch_size {self.patch_size}")
        if self.dim % self.num_heads != 0:
            raise ValueError(f"dim {self.dim} is not divisible by num_heads {self.num_heads}")
        if self.align_depth and not (1 <= self.align_depth <= self.depth and self.align_dims):
            raise ValueError(f"align_depth {self.align_depth} needs a block in 1..{self.depth} and encoder widths "
                             f"(align_dims {self.align_dims})")  # fmt: skip
        if self.attn_window < 0:
            raise ValueError(f"attn_window must be >= 0, got {self.attn_window}")
        if self.uses_rope and self.head_dim % 4 != 0:
            raise ValueError(f"{self.pos_embed} needs head_dim divisible by 4, got {self.head_dim}")
        for name, value, allowed in (
            ("pos_embed", self.pos_embed, POS_EMBEDS),
            ("norm", self.norm, NORMS),
            ("mlp", self.mlp, MLPS),
        ):
            if value not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {value!r}")


def window_block_mask(grid: int, window: int, device: torch.device):
    """Token (r, c) attends tokens within `window` rows and columns: a FlexAttention block mask on GPU,
    a dense (T, T) boolean mask on CPU."""

    def neighbourhood(b, h, q, k):
        return ((q // grid - k // grid).abs() <= window) & ((q % grid - k % grid).abs() <= window)

    tokens = grid * grid
    if device.type == "cpu":
        index = torch.arange(tokens, device=device)
        return neighbourhood(None, None, index[:, None], index[None, :])
    return create_block_mask(neighbourhood, None, None, tokens, tokens, device=device, BLOCK_SIZE=min(128, tokens))


def build_norm(args: DiTArgs) -> nn.Module:
    """A block's norm: LayerNorm or RMSNorm without affine weights, since adaLN supplies scale and shift."""
    if args.norm == "rmsnorm":
        return nn.RMSNorm(args.dim, eps=args.norm_eps, elementwise_affine=False)
    return nn.LayerNorm(args.dim, eps=args.norm_eps, elementwise_affine=False)


def modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """adaLN's per-sample modulation of normalized tokens (DiT's `modulate`): x (B, T, D), shift and scale (B, D)."""
    return x * (1 + scale.unsqueeze(1)) + shift.unsqueeze(1)


def timestep_frequencies(t: torch.Tensor, dim: int, max_period: float = 10000.0) -> torch.Tensor:
    """Sinusoidal timestep features (B,) -> (B, dim), as in DiT/ADM."""
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(half, device=t.device, dtype=torch.float32) / half)
    args = t.float()[:, None] * freqs[None]
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


def sincos_pos_embed_2d(dim: int, grid: int) -> torch.Tensor:
    """Fixed 2D sin-cos position embedding (T, dim), as in MAE/DiT."""
    quarter = dim // 4
    omega = 1.0 / 10000 ** (torch.arange(quarter, dtype=torch.float64) / quarter)
    coords = torch.arange(grid, dtype=torch.float64)
    rr, cc = torch.meshgrid(coords, coords, indexing="ij")
    out = []
    for pos in (cc.reshape(-1), rr.reshape(-1)):
        angles = pos[:, None] * omega[None]
        out += [angles.sin(), angles.cos()]
    return torch.cat(out, dim=1).float()


class PatchEmbed(nn.Module):
    """(B, C, H, W) -> (B, T, D) by a strided convolution, one token per patch."""

    def __init__(self, in_channels: int, dim: int, patch_size: int):
        super().__init__()
        self.proj = nn.Conv2d(in_channels, dim, kernel_size=patch_size, stride=patch_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # A channels-last input makes the convolution write (B, H', W', D) memory, which is (B, T, D) as a view:
        # no transposing copy in forward or backward, and no layout conversions inside cuDNN. Contiguous (B, T, D)
        # matters: a transposed view would carry through every compiled block (Inductor keeps an input's stride
        # order), and each norm would read D with stride T.
        x = x.contiguous(memory_format=torch.channels_last)
        return self.proj(x).flatten(2).transpose(1, 2).contiguous()  # (B, T, D); a no-op copy


class LearnedPosEmbed(nn.Module):
    """A learned absolute position table added to the tokens."""

    def __init__(self, num_tokens: int, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(1, num_tokens, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.weight


class TimestepEmbedder(nn.Module):
    def __init__(self, dim: int, freq_dim: int = 256):
        super().__init__()
        self.freq_dim = freq_dim
        self.mlp = nn.Sequential(nn.Linear(freq_dim, dim), nn.SiLU(), nn.Linear(dim, dim))

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        freqs = timestep_frequencies(t, self.freq_dim).to(self.mlp[0].weight.dtype)
        return self.mlp(freqs)


class LabelEmbedder(nn.Module):
    """Class labels -> vectors; the extra row `num_classes` is CFG's null class."""

    def __init__(self, num_classes: int, dim: int):
        super().__init__()
        self.embedding_table = nn.Embedding(num_classes + 1, dim)

    def forward(self, y: torch.Tensor) -> torch.Tensor:
        return self.embedding_table(y)


class Attention(nn.Module):
    def __init__(self, args: DiTArgs):
        super().__init__()
        self.num_heads = args.num_heads
        self.qkv = nn.Linear(args.dim, 3 * args.dim)
        self.proj = nn.Linear(args.dim, args.dim)
        if args.qk_norm:
            self.q_norm = nn.RMSNorm(args.head_dim, eps=args.norm_eps)
            self.k_norm = nn.RMSNorm(args.head_dim, eps=args.norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def forward(self, x: torch.Tensor, rope: torch.Tensor | None, block_mask=None) -> torch.Tensor:
        B, T, D = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.num_heads, D // self.num_heads).unbind(2)  # each (B, T, nh, hd)
        return self.proj(self.attend(q, k, v, rope, block_mask))

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rope: torch.Tensor | None,
               block_mask=None) -> torch.Tensor:  # fmt: skip
        """Attention of q, k, v (B, T, nh, hd) -> (B, T, D), before the output projection."""
        B, T, nh, hd = q.shape
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if rope is not None:
            q, k = apply_rope(q, rope), apply_rope(k, rope)
        # Token-major storage seen as (B, nh, T, hd): cuDNN attention writes its output (and its gradients) in the
        # layout of its inputs, so the reshape to (B, T, D) below is a view, not a transposing copy.
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if isinstance(block_mask, torch.Tensor):  # CPU: FlexAttention has no CPU backward; same maths, dense mask
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=block_mask)
        elif block_mask is not None:
            out = windowed_attention(q, k, v, block_mask)  # only the 2D neighbourhood
        else:
            out = F.scaled_dot_product_attention(q, k, v)  # non-causal: every patch sees every patch
        return out.transpose(1, 2).reshape(B, T, nh * hd)


class FeedForward(nn.Module):
    def __init__(self, args: DiTArgs):
        super().__init__()
        self.kind = args.mlp
        hidden = args.mlp_hidden_dim
        self.fc1 = nn.Linear(args.dim, 2 * hidden if self.kind == "swiglu" else hidden)
        self.fc2 = nn.Linear(hidden, args.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x)
        if self.kind == "swiglu":  # Llama's gated MLP: silu(gate) * up
            gate, up = h.chunk(2, dim=-1)
            h = F.silu(gate) * up
        else:
            h = F.gelu(h, approximate="tanh")  # DiT's GELU
        return self.fc2(h)


class DiTBlock(nn.Module):
    """Transformer block with adaLN-Zero conditioning (DiT paper, Fig. 3)."""

    def __init__(self, args: DiTArgs):
        super().__init__()
        self.norm1 = build_norm(args)
        self.attn = Attention(args)
        self.norm2 = build_norm(args)
        self.mlp = FeedForward(args)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(args.dim, 6 * args.dim))

    def forward(self, x: torch.Tensor, c: torch.Tensor, rope: torch.Tensor | None, block_mask=None) -> torch.Tensor:
        """x (B, T, D), c (B, D) -> (B, T, D)."""
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.adaLN_modulation(c).chunk(6, dim=-1)
        x = x + gate_msa.unsqueeze(1) * self.attn(modulate(self.norm1(x), shift_msa, scale_msa), rope, block_mask)
        return x + gate_mlp.unsqueeze(1) * self.mlp(modulate(self.norm2(x), shift_mlp, scale_mlp))


class FinalLayer(nn.Module):
    def __init__(self, args: DiTArgs):
        super().__init__()
        self.norm_final = build_norm(args)
        self.linear = nn.Linear(args.dim, args.patch_size**2 * args.out_channels)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(args.dim, 2 * args.dim))

    def forward(self, x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        """x (B, T, D), c (B, D) -> (B, T, p*p*C_out)."""
        shift, scale = self.adaLN_modulation(c).chunk(2, dim=-1)
        return self.linear(modulate(self.norm_final(x), shift, scale))


def build_projector(dim: int, hidden: int, out: int) -> nn.Sequential:
    """REPA's projector: Linear -> SiLU -> Linear -> SiLU -> Linear, from the DiT's width to an encoder's."""
    return nn.Sequential(
        nn.Linear(dim, hidden), nn.SiLU(), nn.Linear(hidden, hidden), nn.SiLU(), nn.Linear(hidden, out)
    )


class DiT(nn.Module):
    """DiT: patchify -> blocks conditioned on (timestep, class) -> unpatchify."""

    def __init__(self, args: DiTArgs):
        super().__init__()
        args.validate()
        self.args = args
        self.x_embedder = PatchEmbed(args.in_channels, args.dim, args.patch_size)
        self.t_embedder = TimestepEmbedder(args.dim)
        self.y_embedder = LabelEmbedder(args.num_classes, args.dim) if args.num_classes > 0 else None
        grid = args.input_size // args.patch_size
        self.pos_embed = LearnedPosEmbed(args.num_tokens, args.dim) if args.pos_embed == "learned" else None
        # Buffers are recomputed by init_weights(), so they survive a meta-device build.
        self.register_buffer("sincos", torch.empty(args.num_tokens, args.dim), persistent=False)
        self.register_buffer("rope", torch.empty(args.num_tokens, args.head_dim // 2, 2), persistent=False)
        self.grid = grid
        self.block_mask = None  # FlexAttention mask of windowed attention, built by init_buffers()
        # A ModuleDict keyed by index, as TorchTitan does, so FQNs stay stable when blocks are wrapped.
        self.blocks = nn.ModuleDict({str(i): DiTBlock(args) for i in range(args.depth)})
        self.final_layer = FinalLayer(args)
        # REPA's names (projectors.i.0/2/4), so its checkpoints map one to one; Xavier-init by init_weights' loop.
        self.projectors = nn.ModuleList(build_projector(args.dim, args.align_projector_dim, out)
                                        for out in args.align_dims) if args.align_depth else None  # fmt: skip

    def init_weights(self) -> None:
        """Owns every initialization (DiT's initialize_weights), so a meta-built model can be materialized."""
        with torch.no_grad():
            # Xavier-uniform for every Linear, zero bias, as DiT.
            for module in self.modules():
                if isinstance(module, nn.Linear):
                    nn.init.xavier_uniform_(module.weight)
                    nn.init.zeros_(module.bias)
                elif isinstance(module, nn.RMSNorm | nn.LayerNorm) and module.weight is not None:
                    nn.init.ones_(module.weight)
                    if getattr(module, "bias", None) is not None:
                        nn.init.zeros_(module.bias)
            # Patch embedding like a Linear on flattened patches.
            w = self.x_embedder.proj.weight
            nn.init.xavier_uniform_(w.view(w.shape[0], -1))
            nn.init.zeros_(self.x_embedder.proj.bias)
            if self.y_embedder is not None:
                nn.init.normal_(self.y_embedder.embedding_table.weight, std=0.02)
            nn.init.normal_(self.t_embedder.mlp[0].weight, std=0.02)
            nn.init.normal_(self.t_embedder.mlp[2].weight, std=0.02)
            if self.pos_embed is not None:
                nn.init.normal_(self.pos_embed.weight, std=0.02)
            # Zero-out adaLN modulation: every block starts as the identity (adaLN-Zero).
            for block in self.blocks.values():
                nn.init.zeros_(block.adaLN_modulation[-1].weight)
                nn.init.zeros_(block.adaLN_modulation[-1].bias)
            # Zero-out the output layer: the model predicts 0 at init.
            nn.init.zeros_(self.final_layer.adaLN_modulation[-1].weight)
            nn.init.zeros_(self.final_layer.adaLN_modulation[-1].bias)
            nn.init.zeros_(self.final_layer.linear.weight)
            nn.init.zeros_(self.final_layer.linear.bias)
            self.init_buffers()

    def init_buffers(self) -> None:
        """(Re)computes the non-persistent position buffers on the model's device."""
        args = self.args
        device = self.sincos.device
        self.sincos = sincos_pos_embed_2d(args.dim, self.grid).to(device)
        self.rope = build_rope_2d(args.head_dim, self.grid, self.grid, args.rope_theta).to(device)
        self.block_mask = window_block_mask(self.grid, args.attn_window, device) if args.attn_window else None

    def unpatchify(self, x: torch.Tensor) -> torch.Tensor:
        """(B, T, p*p*C) -> (B, C, H, W)."""
        p, c, g = self.args.patch_size, self.args.out_channels, self.grid
        x = x.view(x.shape[0], g, g, p, p, c)
        x = torch.einsum("nhwpqc->nchpwq", x)
        return x.reshape(x.shape[0], c, g * p, g * p)

    def forward(self, x: torch.Tensor, t: torch.Tensor, y: torch.Tensor | None = None,
                aligned: bool = False) -> torch.Tensor | tuple[torch.Tensor, list[torch.Tensor]]:  # fmt: skip
        """x: (B, C, H, W), t: (B,) timesteps, y: (B,) labels (num_classes = null) -> (B, C_out, H, W).

        aligned: also return the tokens after block `align_depth` through each projector, [(B, T, align_dims[i])]
        (representation alignment's training; through forward so that FSDP's hooks see the projectors).
        """
        h = self.x_embedder(x)  # (B, T, D)
        if self.args.pos_embed in ("sincos", "sincos_rope2d"):
            h = h + self.sincos.to(h.dtype)
        elif self.pos_embed is not None:
            h = self.pos_embed(h)
        rope = self.rope if self.args.uses_rope else None
        c = self.t_embedder(t)  # (B, D)
        if self.y_embedder is not None:
            c = c + self.y_embedder(y)
        # h goes from block to block and on to the final layer as each returns it: a plain block returns a tensor,
        # a converted one may hand its residual stream on in parts (torchtitan/kernels/dit_modules.py).
        projected = []
        for i, block in enumerate(self.blocks.values()):
            h = block(h, c, rope, self.block_mask)
            if aligned and i + 1 == self.args.align_depth:  # this block finishes its residual (see converters)
                projected = [projector(h) for projector in self.projectors]  # each (B, T, align_dims[i])
        h = self.final_layer(h, c)  # (B, T, p*p*C_out)
        return (self.unpatchify(h), projected) if aligned else self.unpatchify(h)


def flops_per_image(args: DiTArgs) -> float:
    """Training FLOPs for one image: matmuls + attention, forward x 3 (forward + backward).

    Counts 2 FLOPs per multiply-add of every matmul in the blocks, the patch embedding and
    the final layer, plus attention's two T x T products; the per-image conditioning MLPs are
    counted once per image. Norms and pointwise ops are left out, as in PaLM's MFU.
    """
    D, T, L = args.dim, args.num_tokens, args.depth
    p2c_in = args.patch_size**2 * args.in_channels
    fc1_out = 2 * args.mlp_hidden_dim if args.mlp == "swiglu" else args.mlp_hidden_dim
    per_token_block = 3 * D * D + D * D + D * fc1_out + args.mlp_hidden_dim * D  # qkv, proj, fc1, fc2
    attention = 2 * T * T * D  # scores (Q K^T) and (P V), per block
    per_image_block = 6 * D * D  # adaLN modulation on the (B, D) conditioning
    fwd = L * (2 * T * per_token_block + 2 * attention + 2 * per_image_block)
    fwd += 2 * T * p2c_in * D  # patch embedding
    fwd += 2 * T * D * args.patch_size**2 * args.out_channels + 2 * 2 * D * D  # final linear + adaLN
    fwd += 2 * (256 * D + D * D)  # timestep MLP
    H = args.align_projector_dim
    fwd += sum(2 * T * (D * H + H * H + H * out) for out in args.align_dims) if args.align_depth else 0  # projectors
    return 3.0 * fwd
