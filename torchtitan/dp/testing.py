"""Reference DP-SGD gradients from torch.func, to check the engine (and any new layer rule) against."""

import copy

import torch
from torch import nn
from torch.func import functional_call, grad, vmap


def per_sample_grads(
    model: nn.Module, loss_fn, *batch: torch.Tensor, dtype: torch.dtype | None = torch.float64
) -> dict[str, torch.Tensor]:
    """{name: (B, *param.shape)} gradients of each sample's loss, by vmap over torch.func.grad.

    `loss_fn(output, *batch)` must return the (B,) per-sample losses of `model(*batch)`. By default
    the reference runs on a float64 copy of the model and inputs, so that comparisons against an
    fp32 engine measure the engine's rounding alone; the result is in the model's dtype.
    """
    out_dtype = next(model.parameters()).dtype
    if dtype is not None:
        model = copy.deepcopy(model).to(dtype)
        batch = tuple(b.to(dtype) if b.is_floating_point() else b for b in batch)
    params = {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}
    buffers = {n: b.detach() for n, b in model.named_buffers()}

    def one_loss(params, *sample):
        batch1 = tuple(s.unsqueeze(0) for s in sample)
        return loss_fn(functional_call(model, (params, buffers), batch1), *batch1)[0]

    grads = vmap(grad(one_loss), in_dims=(None, *([0] * len(batch))))(params, *batch)
    return {n: g.to(out_dtype) for n, g in grads.items()}


def clipped_mean(grads: dict[str, torch.Tensor], max_grad_norm: float, batch_size: int | None = None):
    """(sum_i c_i g_i / B per param, (B,) per-sample norms) with c_i = min(1, C / (||g_i|| + 1e-6))."""
    norms = torch.cat([g.flatten(1) for g in grads.values()], dim=1).norm(dim=1)
    coef = (max_grad_norm / (norms + 1e-6)).clamp(max=1.0)
    batch_size = batch_size or norms.shape[0]
    return {n: torch.einsum("b...,b->...", g, coef) / batch_size for n, g in grads.items()}, norms
