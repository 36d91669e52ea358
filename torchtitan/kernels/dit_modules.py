"""The DiT's modules with the fused kernels: what the converters fused_norm, fused_mlp and fused_qkv swap in.

Each fused module takes over the plain module's children, so parameter names, the state dict, meta-device builds,
FSDP and `DiT.init_weights()` are as they were; only forward changes. Where a kernel cannot run (no Triton, CPU
tensors outside the interpreter, a Linear hooked by DP-SGD or swapped by float8), a module computes the same maths
in torch.

The trick fused_norm needs lives here, not in the plain model: a converted block hands its residual stream on in
parts, `ResidualStream(x, branch, gate)` with the stream being x + gate * branch, and the next norm adds it up
inside its Triton kernel (adaln_norm.py), so the gated residual add that ends each block is never a pass of its own
(+0.9 to 1.5% a step on DiT-XL/2, docs/benchmark_log.md). `DiT.forward` hands whatever a block returns to the next
block and to the final layer; the first block gets a plain tensor.
"""

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from torchtitan.kernels.adaln_norm import modulated_norm
from torchtitan.kernels.mlp import bias_activation, gelu_mlp, gelu_mlp_applies
from torchtitan.kernels.qkv import qkv_linear
from torchtitan.kernels.triton_support import kernel_path_applies
from torchtitan.models.dit.model import Attention, DiTBlock, FeedForward, FinalLayer


class ResidualStream(NamedTuple):
    """A block's output handed on in parts: the stream is x + gate * branch, for x and branch (B, T, D), gate (B, D).

    A NamedTuple, a pytree that dynamo, FSDP and checkpoint_wrapper all handle. The block makes x and the gate tensors
    of their own, not views (FSDP hooks a block's outputs for backward, and a hook on a view is lost if the view is
    changed in place); the branch is the MLP's output as the MLP returns it.
    """

    x: Tensor
    branch: Tensor
    gate: Tensor


class ModulatedNorm(nn.Module):
    """adaLN's norm after an optional gated residual add: forward(x, shift, scale, branch, gate) returns (x', h) with
    x' = x + gate * branch (x without a branch) and h = norm(x') * (1 + scale) + shift, by one Triton kernel each way.

    `save_output`: the kernels keep x', not x, for backward (see adaln_norm.modulated_norm).
    """

    def __init__(self, norm: nn.Module, save_output: bool = False):
        super().__init__()
        if not isinstance(norm, nn.LayerNorm | nn.RMSNorm) or norm.weight is not None:
            raise TypeError(f"ModulatedNorm stands in for a LayerNorm or RMSNorm without affine weights, got {norm}")
        self.kind = "rmsnorm" if isinstance(norm, nn.RMSNorm) else "layernorm"
        self.eps, self.save_output = norm.eps, save_output

    def forward(self, x, shift, scale, branch=None, gate=None) -> tuple[Tensor, Tensor]:
        return modulated_norm(x, shift, scale, branch, gate, kind=self.kind, eps=self.eps, save_output=self.save_output)


def _parts(x: Tensor | ResidualStream) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """(x, branch, gate) of a block's input: a plain tensor has no branch."""
    return (x, None, None) if isinstance(x, Tensor) else x


class FusedNormDiTBlock(DiTBlock):
    """DiTBlock whose norms run the adaLN kernels and which hands its residual stream on in parts.

    With `finish_residual` it adds its MLP branch itself and returns a plain tensor: fused_norm sets it on each block
    activation checkpointing wraps, and on the block before each, since a checkpointed block keeps its inputs for
    backward (one tensor is cheaper to keep than two) and its MLP output would be kept by the next norm.
    """

    def __init__(self, block: DiTBlock, finish_residual: bool):
        nn.Module.__init__(self)  # the plain block's children, registered in its order: the same parameter names
        # norm1 keeps its output x' (which norm2 keeps as its input) rather than its input, which nothing else keeps.
        self.norm1 = ModulatedNorm(block.norm1, save_output=True)
        self.attn = block.attn
        self.norm2 = ModulatedNorm(block.norm2)
        self.mlp = block.mlp
        self.adaLN_modulation = block.adaLN_modulation
        self.finish_residual = finish_residual

    def forward(self, x: Tensor | ResidualStream, c: Tensor, rope: Tensor | None,
                block_mask=None) -> Tensor | ResidualStream:  # fmt: skip
        """The previous block's output (the first block's: the tokens) and c (B, D) -> this block's."""
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.adaLN_modulation(c).chunk(6, dim=-1)
        x, branch, gate = _parts(x)
        x, h = self.norm1(x, shift_msa, scale_msa, branch, gate)  # x + gate * branch, then norm1
        attn_out = self.attn(h, rope, block_mask)
        x, h = self.norm2(x, shift_mlp, scale_mlp, attn_out, gate_msa)  # x + gate_msa * attn_out, then norm2
        mlp_out = self.mlp(h)
        if self.finish_residual:
            return x + gate_mlp.unsqueeze(1) * mlp_out
        # The gate leaves as a tensor of its own, not a view into the modulation (see ResidualStream).
        return ResidualStream(x, mlp_out, gate_mlp.clone())


class FusedNormFinalLayer(FinalLayer):
    """FinalLayer whose norm runs the adaLN kernel, adding up the last block's residual stream if handed in parts."""

    def __init__(self, layer: FinalLayer):
        nn.Module.__init__(self)
        self.norm_final = ModulatedNorm(layer.norm_final, save_output=True)
        self.linear = layer.linear
        self.adaLN_modulation = layer.adaLN_modulation

    def forward(self, x: Tensor | ResidualStream, c: Tensor) -> Tensor:
        """The last block's output and c (B, D) -> (B, T, p*p*C_out)."""
        shift, scale = self.adaLN_modulation(c).chunk(2, dim=-1)
        x, branch, gate = _parts(x)
        return self.linear(self.norm_final(x, shift, scale, branch, gate)[1])


class FusedQKVAttention(Attention):
    """Attention whose qkv Linear is an autograd function that gets q, k and v's gradients apart, assembling its
    output gradient and summing its bias gradient in one Triton kernel (qkv.py)."""

    def __init__(self, attn: Attention):
        nn.Module.__init__(self)
        self.num_heads = attn.num_heads
        self.qkv, self.proj, self.q_norm, self.k_norm = attn.qkv, attn.proj, attn.q_norm, attn.k_norm

    def forward(self, x: Tensor, rope: Tensor | None, block_mask=None) -> Tensor:
        if not kernel_path_applies(x, self.qkv):
            return super().forward(x, rope, block_mask)
        q, k, v = qkv_linear(x, self.qkv.weight, self.qkv.bias, self.num_heads)  # each (B, T, nh, hd)
        return self.proj(self.attend(q, k, v, rope, block_mask))


class FusedFeedForward(FeedForward):
    """The MLP with fc1's bias and activation in one Triton kernel each way (its backward also sums fc1's bias
    gradient), or, for GELU in bf16/fp16 on CUDA, as one op of cuBLASLt GEMMs with GELU in their epilogues (mlp.py)."""

    def __init__(self, mlp: FeedForward):
        nn.Module.__init__(self)
        self.kind, self.fc1, self.fc2 = mlp.kind, mlp.fc1, mlp.fc2

    def forward(self, x: Tensor) -> Tensor:
        if not kernel_path_applies(x, self.fc1):
            return super().forward(x)
        if gelu_mlp_applies(x, self.kind) and kernel_path_applies(x, self.fc2):  # GELU inside the GEMMs
            return gelu_mlp(x, self.fc1.weight, self.fc1.bias, self.fc2.weight, self.fc2.bias)
        # fc1 without its bias; the bias, the activation and (in backward) the bias gradient in one kernel
        return self.fc2(bias_activation(F.linear(x, self.fc1.weight), self.fc1.bias, self.kind))


def residual_finished(checkpointed: list[bool]) -> list[bool]:
    """Which blocks finish their own residual (return a plain tensor) under fused_norm, given which blocks activation
    checkpointing wraps (parallelisms.utils.checkpointed_blocks): each checkpointed block and the block before it."""
    return [wrapped or (i + 1 < len(checkpointed) and checkpointed[i + 1]) for i, wrapped in enumerate(checkpointed)]


def _blocks(model: nn.Module) -> dict[str, nn.Module]:
    """The model's blocks, refused by name where a converter would not see plain DiT modules (applied after
    activation checkpointing or compile, which wrap them)."""
    blocks = dict(model.blocks.items())
    for name, block in blocks.items():
        if not isinstance(block, DiTBlock):
            raise TypeError(f"converters apply to plain DiT blocks, before activation checkpointing and compile: "
                            f"blocks.{name} is a {type(block).__name__}")  # fmt: skip
    return blocks


def apply_fused_norm(model: nn.Module, finish_residual: list[bool]) -> None:
    """The converter fused_norm: each block and the final layer run the adaLN kernels, and blocks hand their residual
    stream on in parts, except those `finish_residual` names (see residual_finished)."""
    blocks = _blocks(model)
    if len(finish_residual) != len(blocks):
        raise ValueError(
            f"fused_norm: finish_residual names {len(finish_residual)} blocks, the model has {len(blocks)}"
        )
    for (name, block), finish in zip(blocks.items(), finish_residual, strict=True):
        model.blocks[name] = FusedNormDiTBlock(block, finish)
    model.final_layer = FusedNormFinalLayer(model.final_layer)


def apply_fused_mlp(model: nn.Module) -> frozenset:
    """The converter fused_mlp. Returns the ops per-op selective AC must keep: the GELU MLP, which holds two GEMMs."""
    for block in _blocks(model).values():
        block.mlp = FusedFeedForward(block.mlp)
    return frozenset({torch.ops.torchditan.gelu_mlp.default})


def apply_fused_qkv(model: nn.Module, keep_plain: list[bool] | None = None) -> None:
    """The converter fused_qkv, on every block but those `keep_plain` names (see `qkv_keeps_plain`)."""
    blocks = _blocks(model)
    keep_plain = keep_plain or [False] * len(blocks)
    if len(keep_plain) != len(blocks):
        raise ValueError(f"fused_qkv: keep_plain names {len(keep_plain)} blocks, the model has {len(blocks)}")
    for block, plain in zip(blocks.values(), keep_plain, strict=True):
        if not plain:
            block.attn = FusedQKVAttention(block.attn)


def qkv_keeps_plain(checkpointed: list[bool], compiled: bool) -> list[bool]:
    """Which blocks fused_qkv leaves plain: those activation checkpointing wraps, when they are compiled.

    torch.compile (2.11 at least) does not tag the ops inside an autograd function's forward for recomputation, so
    in a compiled checkpointed block the partitioner saves them (pytorch/pytorch#177396): q, k, v and the cast input,
    4 (B, T, D) tensors a block, the most memory AC was to save (DiT-L/8 at batch 512 with full AC: out of memory
    at 76 GiB, 51.9 GiB plain). Eager checkpointing recomputes them. The kernel gains 0.5% a step; AC costs 30%.
    """
    return [wrapped and compiled for wrapped in checkpointed]
