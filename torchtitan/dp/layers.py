"""Per-layer DP rules: per-sample gradient norms and clipped gradient sums from what a layer saw.

A rule gives the module's forward with its parameters detached (`forward`: the engine runs it in place of the
module's own, so autograd computes no weight gradient, compiled or not) and turns one module call's input `x` and
output gradient `g` into
- `norm_sq`: the (B,) squared norms of the per-sample gradients of the module's trainable params;
- `grads`: sum_i c_i g_i for each trainable param, in the param's full (unsharded) shape.
Book-keeping calls both on the same step; `norm_sq` may leave small per-sample pieces (a bias's
per-sample sums) in the record's `state` dict, which `grads` then reads instead of re-reading `g`. Ghost
clipping's second pass calls `grads` alone, with `coef` None (the clipping is already in `g`).
With augmult (`group` K > 1) the call ran on B * K rows, K consecutive rows per sample, and a sample's
gradient is the sum over its K rows (the 1/K of the average is already in `g`): the rules fold the K
rows into the token dimension, since a per-sample gradient is a sum over tokens anyway.
Both only read activations and gradients, never the weights, so under FSDP they work after
the parameters are resharded.

Every rule is exact for its module type as PyTorch defines it; a module type with no rule
here cannot be clipped and the engine refuses it (register one with `register_layer_rule`).
"""

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from torchtitan.dp.flash_kernels import matmul_float32, matmul_grad_norm_sq, scale_samples

ForwardFn = Callable[..., torch.Tensor]
NormFn = Callable[[nn.Module, torch.Tensor, torch.Tensor, tuple[str, ...], bool, int, dict], torch.Tensor]
GradFn = Callable[
    [nn.Module, torch.Tensor, torch.Tensor, torch.Tensor, tuple[str, ...], int, dict], dict[str, torch.Tensor]
]


@dataclass(frozen=True)
class LayerRule:
    """How to clip the parameters of one module type.

    Attributes:
        param_names: the direct parameters the rule knows; any other trainable one is refused.
        forward: (module, *args, **kwargs) -> output: the module type's forward with every parameter detached.
        norm_sq: (module, x, g, trainable names, flash, group, state) -> (B,) float32 squared per-sample norms.
        grads: (module, x, g, coef, trainable names, group, state) -> {name: sum_i coef_i grad_i}, for coef the
            step's `Coefficients` or None.
            `group` is the augmult K: rows per sample (1 without augmult). `state` is a dict the rule owns
            for one step of one module: empty when norm_sq is called, and what norm_sq left in it when
            grads is (book-keeping calls grads after norm_sq on the same step). Two-pass modes call grads alone,
            with an empty state and coef None: every coefficient 1.
        check: raises if this module's configuration is outside what the rule covers.
        cast_input: under autocast, cast the input to the autocast dtype before the call (a
            forward pre-hook), so the kept input is the very tensor autograd saves: no extra copy.
        keep_input: whether the rules read the input at all.
    """

    param_names: tuple[str, ...]
    forward: ForwardFn
    norm_sq: NormFn
    grads: GradFn
    check: Callable[[nn.Module], None] = lambda module: None
    cast_input: bool = False
    keep_input: bool = True


_RULES: dict[type, LayerRule] = {}


def register_layer_rule(module_type: type, rule: LayerRule) -> None:
    """Teaches the engine a module type (subclasses inherit the rule)."""
    _RULES[module_type] = rule


def find_layer_rule(module: nn.Module) -> tuple[type, LayerRule] | None:
    """(class, rule) of the nearest class in the module's MRO with a rule (FSDP wraps classes by subclassing)."""
    for cls in type(module).__mro__:
        if cls in _RULES:
            return cls, _RULES[cls]
    return None


def detached(module: nn.Module, name: str) -> torch.Tensor | None:
    """The module's parameter `name` cut from autograd (None where the module has none)."""
    param = getattr(module, name)
    return None if param is None else param.detach()


class Coefficients:
    """One step's per-sample clipping coefficients, as every layer's `grads` takes them.

    Every layer of a step scales by the same coefficients, so their form for an operand dtype is prepared once
    per dtype (`for_operand`), not once per layer.

    Attributes:
        values: (B,) the coefficients, float32.
    """

    def __init__(self, values: torch.Tensor):
        self.values = values
        self._prepared: dict[torch.dtype, torch.Tensor] = {}

    def for_operand(self, dtype: torch.dtype) -> torch.Tensor:
        """The values as `scale_samples` takes them for a `dtype` operand: float32 values of `dtype`. In bf16/fp16
        each is shrunk by one rounding step first, so rounding never makes a clipped gradient longer than
        max_grad_norm (which would void the sensitivity bound)."""
        prepared = self._prepared.get(dtype)
        if prepared is None:
            shrink = 1 - torch.finfo(dtype).eps if dtype in (torch.bfloat16, torch.float16) else 1
            prepared = self._prepared[dtype] = (self.values * shrink).to(dtype).float()
        return prepared


def scale_per_sample(t: torch.Tensor, coef: Coefficients | None) -> torch.Tensor:
    """t * coef broadcast over the leading (batch) dim, in t's dtype (t itself for coef None)."""
    return t if coef is None else scale_samples(t, coef.for_operand(t.dtype))


def weighted_sum(coef: Coefficients | None, per_sample: torch.Tensor) -> torch.Tensor:
    """sum_i coef_i per_sample_i over the leading dim, in float32 (plain sum for coef None)."""
    return per_sample.sum(0) if coef is None else coef.values.float() @ per_sample


# Linear and Conv2d: a matmul per token, weight grad A^T G.


def group_rows(t: torch.Tensor, group: int) -> torch.Tensor:
    """(B * K, T, ...) -> (B, K * T, ...): a sample's K augmult rows become more tokens of one sample."""
    if group == 1:
        return t
    if t.shape[0] % group:
        raise ValueError(f"augmult: {t.shape[0]} rows are not a multiple of K = {group}")
    return t.reshape(t.shape[0] // group, group * t.shape[1], *t.shape[2:])


def linear_operands(
    module: nn.Module, x: torch.Tensor, g: torch.Tensor, group: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """(A, G): (B, T, d) inputs and (B, T, p) output grads of a Linear or Conv2d, in g's dtype.

    A Conv2d is a Linear on its unfolded patches; with kernel == stride (a patch embedding) the
    unfold is a reshape of the input. With augmult the K rows of a sample are folded into T.
    """
    B = x.shape[0]
    if isinstance(module, nn.Conv2d):
        padding = (0, 0) if module.padding == "valid" else module.padding
        a = F.unfold(x, module.kernel_size, module.dilation, padding, module.stride).transpose(1, 2)  # (B, L, C k k)
        g = g.flatten(2).transpose(1, 2)  # (B, L, out)
    else:
        a = x.reshape(B, -1, x.shape[-1])  # (B, T, d): (B, d) inputs are T = 1
        g = g.reshape(B, -1, g.shape[-1])  # (B, T, p)
    # Under autocast the layer ran in g's dtype: the input was cast on the way in.
    return group_rows(a.to(g.dtype), group), group_rows(g, group)


def _linear_norm_sq(module, x, g, names, flash, group, state):
    a, g = linear_operands(module, x, g, group)
    parts = []
    if "weight" in names:
        parts.append(matmul_grad_norm_sq(a, g, flash))
    if "bias" in names:
        # Per-sample bias grads, the sums over tokens: (B, p), kept so grads need not read g again.
        state["bias"] = g.sum(1, dtype=torch.float32)
        parts.append(state["bias"].square().sum(1))
    return parts[0] if len(parts) == 1 else parts[0] + parts[1]


def _linear_grads(module, x, g, coef, names, group, state):
    a, g = linear_operands(module, x, g, group)
    grads = {}
    if "weight" in names:
        # One matmul for the whole batch, A^T diag(c) G over all B*T rows; c scales the smaller operand.
        if a.shape[-1] <= g.shape[-1]:
            lhs, rhs = g, scale_per_sample(a, coef)
        else:
            lhs, rhs = scale_per_sample(g, coef), a
        grads["weight"] = matmul_float32(lhs.flatten(0, 1).T, rhs.flatten(0, 1)).view(module.weight.shape)  # (p, d)
    if "bias" in names:
        per_sample = state.pop("bias") if "bias" in state else g.sum(1, dtype=torch.float32)
        grads["bias"] = weighted_sum(coef, per_sample)  # (B,) @ (B, p) per-sample sums
    return grads


def _linear_forward(module, x):
    return F.linear(x, module.weight.detach(), detached(module, "bias"))


def _conv2d_forward(module, x):
    return module._conv_forward(x, module.weight.detach(), detached(module, "bias"))


def _check_conv2d(module: nn.Conv2d) -> None:
    if module.groups != 1 or module.padding_mode != "zeros" or module.padding == "same":
        raise NotImplementedError("DP rule for Conv2d needs groups=1, zero padding and no padding='same'")


# Embedding: a scatter of the output grads into the rows of the looked-up indices.


def _embedding_operands(module, idx, g, group):
    rows = idx.shape[0]
    idx = group_rows(idx.reshape(rows, -1), group)  # (B, K T)
    g = group_rows(g.reshape(rows, -1, g.shape[-1]), group)  # (B, K T, D)
    if module.padding_idx is not None:  # the padding row never receives a gradient
        g = g * (idx != module.padding_idx).unsqueeze(-1).to(g.dtype)
    return idx, g


def _embedding_norm_sq(module, idx, g, names, flash, group, state):
    idx, g = _embedding_operands(module, idx, g, group)
    g = g.float()
    if idx.shape[1] == 1:
        return g.square().sum((1, 2))
    # Tokens with the same index add up in one row: sum_{t,s} [i_t == i_s] <g_t, g_s>.
    same = (idx.unsqueeze(2) == idx.unsqueeze(1)).float()  # (B, T, T)
    return (torch.bmm(g, g.mT) * same).sum((1, 2))


def _embedding_grads(module, idx, g, coef, names, group, state):
    idx, g = _embedding_operands(module, idx, g, group)
    g = scale_per_sample(g, coef)
    grad = torch.zeros(module.num_embeddings, g.shape[-1], device=g.device, dtype=g.dtype)
    return {"weight": grad.index_add_(0, idx.flatten(), g.flatten(0, 1))}


def _embedding_forward(module, idx):
    return F.embedding(idx, module.weight.detach(), module.padding_idx, module.max_norm, module.norm_type,
                       module.scale_grad_by_freq, module.sparse)  # fmt: skip


def _check_embedding(module: nn.Embedding) -> None:
    if module.sparse or module.scale_grad_by_freq or module.max_norm is not None:
        # scale_grad_by_freq couples samples through the batch's index counts; max_norm rewrites the weight.
        raise NotImplementedError("DP rule for Embedding needs sparse=False, scale_grad_by_freq=False, max_norm=None")


# LayerNorm and RMSNorm with affine parameters: weight grad sum_t g * x_hat, bias grad sum_t g.


def _normalized_input(module, x):
    """(B, T, N) float32 normalized input, recomputed from x; N = prod(normalized_shape)."""
    shape = tuple(module.normalized_shape)
    if isinstance(module, nn.LayerNorm):
        x_hat = F.layer_norm(x.float(), shape, eps=module.eps)
    else:  # RMSNorm: its default eps is the machine epsilon of the input dtype
        eps = module.eps if module.eps is not None else torch.finfo(x.dtype).eps
        x_hat = F.rms_norm(x.float(), shape, eps=eps)
    return x_hat.reshape(x.shape[0], -1, math.prod(shape))


def _affine_norm_per_sample(module, x, g, group):
    x_hat = _normalized_input(module, x)  # (B K, T, N)
    g = g.reshape(x_hat.shape).float()
    return group_rows(x_hat, group), group_rows(g, group)  # (B, K T, N)


def _affine_norm_norm_sq(module, x, g, names, flash, group, state):
    x_hat, g = _affine_norm_per_sample(module, x, g, group)
    # The per-sample grads are (B, N): kept, so grads need not recompute x_hat.
    if "weight" in names:
        state["weight"] = (g * x_hat).sum(1)
    if "bias" in names:
        state["bias"] = g.sum(1)
    return sum(state[name].square().sum(1) for name in names)


def _affine_norm_grads(module, x, g, coef, names, group, state):
    if not state:  # two-pass modes: the per-sample pieces were not kept
        x_hat, g = _affine_norm_per_sample(module, x, g, group)
        state = {name: (g * x_hat if name == "weight" else g).sum(1) for name in names}
    shape = tuple(module.normalized_shape)
    return {name: weighted_sum(coef, state.pop(name)).view(shape) for name in names}


def _affine_norm_forward(module, x):
    shape = tuple(module.normalized_shape)
    if isinstance(module, nn.LayerNorm):
        return F.layer_norm(x, shape, detached(module, "weight"), detached(module, "bias"), module.eps)
    return F.rms_norm(x, shape, detached(module, "weight"), module.eps)


# A parameter added to the input (learned position table): per-sample grad = output grad summed to its shape.


def _additive_per_sample(module, g, group):
    weight_shape = module.weight.shape
    if weight_shape[0] != 1:
        raise ValueError(
            f"additive DP rule needs a parameter broadcast over the batch, got shape {tuple(weight_shape)}"
        )
    per_row = g.sum_to_size(g.shape[0], *weight_shape[1:])  # (B K, *weight_shape[1:])
    return per_row.unflatten(0, (-1, group)).sum(1)  # (B, *weight_shape[1:])


def _additive_norm_sq(module, x, g, names, flash, group, state):
    return _additive_per_sample(module, g, group).float().square().flatten(1).sum(1)


def _additive_forward(module, x):
    return x + module.weight.detach()


def _additive_grads(module, x, g, coef, names, group, state):
    per_sample = scale_per_sample(_additive_per_sample(module, g, group), coef)
    return {"weight": per_sample.sum(0, keepdim=True).view(module.weight.shape)}


register_layer_rule(
    nn.Linear, LayerRule(("weight", "bias"), _linear_forward, _linear_norm_sq, _linear_grads, cast_input=True)
)
register_layer_rule(
    nn.Conv2d,
    LayerRule(("weight", "bias"), _conv2d_forward, _linear_norm_sq, _linear_grads, _check_conv2d, cast_input=True),
)
register_layer_rule(
    nn.Embedding, LayerRule(("weight",), _embedding_forward, _embedding_norm_sq, _embedding_grads, _check_embedding)
)
_affine_rule = LayerRule(("weight", "bias"), _affine_norm_forward, _affine_norm_norm_sq, _affine_norm_grads)
register_layer_rule(nn.LayerNorm, _affine_rule)
register_layer_rule(nn.RMSNorm, _affine_rule)
ADDITIVE_RULE = LayerRule(("weight",), _additive_forward, _additive_norm_sq, _additive_grads, keep_input=False)


def _register_model_rules() -> None:
    # The DiT's learned position table is `x + weight`.
    from torchtitan.models.dit.model import LearnedPosEmbed

    register_layer_rule(LearnedPosEmbed, ADDITIVE_RULE)


_register_model_rules()
