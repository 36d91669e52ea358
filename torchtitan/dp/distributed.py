"""How gradients are summed over data-parallel ranks for each way a model can be wrapped.

- FSDP2 / HSDP (parameters are DTensors): a normal backward reduce-scatters and divides by
  FSDP's gradient divide factor; gradients the engine builds itself (book-keeping) are wrapped
  as Partial DTensors on the parameter's mesh and redistributed to its placements, which is a
  reduce-scatter (plus an all-reduce over the replicate dim of HSDP) of one layer at a time.
- DDP (composable `replicate` or the DistributedDataParallel class): a normal backward
  all-reduces and divides by the group size; gradients the engine builds are all-reduced here.
- A plain model on several ranks: the engine all-reduces every gradient itself.
"""

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Partial


def dp_groups(dp_mesh) -> list:
    """The process groups whose product is the data-parallel world (empty: one process)."""
    if dp_mesh is not None:
        return [dp_mesh.get_group(i) for i in range(dp_mesh.ndim)]
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return [dist.group.WORLD]
    return []


def all_reduce_sum(tensor: torch.Tensor, groups: list) -> torch.Tensor:
    """In-place sum over every group (their product is the data-parallel world)."""
    for group in groups:
        dist.all_reduce(tensor, group=group)
    return tensor


def all_reduce_grads(grads: list[torch.Tensor], groups: list) -> None:
    """Sums a list of tensors over the data-parallel world, one flat buffer per dtype."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for g in grads:
        by_dtype.setdefault(g.dtype, []).append(g)
    for same in by_dtype.values():
        flat = all_reduce_sum(torch.cat([g.reshape(-1) for g in same]), groups)
        for g, part in zip(same, flat.split([g.numel() for g in same])):
            g.copy_(part.view_as(g))


def is_ddp(model: nn.Module) -> bool:
    """True for a DistributedDataParallel module or one under composable `replicate`."""
    if isinstance(model, nn.parallel.DistributedDataParallel):
        return True
    from torch.distributed._composable.contract import _get_registry

    registry = _get_registry(model)
    return registry is not None and "replicate" in registry


def fsdp_divide_factor(model: nn.Module) -> float | None:
    """What FSDP2 divides reduced gradients by (None: no FSDP module with parameters).

    FSDP2 averages over the data-parallel mesh unless `set_gradient_divide_factor` (called
    `set_reduce_scatter_divide_factor` before torch 2.8) set a factor, stored on each parameter
    group as `gradient_divide_factor` on torch 2.8 through 2.14.
    """
    from torch.distributed.fsdp import FSDPModule

    factors = set()
    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        state = module._get_fsdp_state()
        groups = getattr(state, "_fsdp_param_groups", None)  # torch >= 2.12: several groups per module
        if groups is None:
            groups = [state._fsdp_param_group] if state._fsdp_param_group is not None else []
        for group in groups:
            factor = getattr(group, "gradient_divide_factor", None)
            factors.add(float(factor) if factor is not None else float(group.mesh_info.mesh.size()))
    if len(factors) > 1:
        raise NotImplementedError(f"DP-SGD needs one FSDP gradient divide factor for the model, got {factors}")
    return factors.pop() if factors else None


def reduce_to_param(grad: torch.Tensor, param: DTensor) -> DTensor:
    """Sums a full-shape local gradient over the param's mesh into the param's placements."""
    mesh = param.device_mesh
    partial = DTensor.from_local(grad, mesh, [Partial()] * mesh.ndim, run_check=False)
    return partial.redistribute(mesh, param.placements)
