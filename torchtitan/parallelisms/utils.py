"""apply_* helpers shared by every model's parallelize function; each changes a module in place."""

import contextlib
from collections import defaultdict

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from torchtitan.tools.logging import logger

# Ops whose outputs selective AC keeps: the matmuls and attention (expensive to recompute);
# everything else (norms, modulation, activations, RoPE) is cheap pointwise work, recomputed.
_SAVE_LIST = {
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten.convolution.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_cudnn_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
    torch.ops.aten._scaled_mm.default,
}
# Custom ops that hold a GEMM, by name (they register when their model module is imported): the GELU MLP.
_SAVE_CUSTOM = {"torchditan::gelu_mlp"}


# In-place random fills: the only init ops whose result depends on how a tensor is split across ranks.
_RANDOM_FILLS = {
    torch.ops.aten.uniform_,
    torch.ops.aten.normal_,
    torch.ops.aten.random_,
    torch.ops.aten.bernoulli_,
    torch.ops.aten.exponential_,
    torch.ops.aten.geometric_,
    torch.ops.aten.cauchy_,
    torch.ops.aten.log_normal_,
}


class _FullTensorRandomFills(TorchDispatchMode):
    """Each random fill of a sharded (DTensor) tensor draws the whole tensor, as one process would, and keeps this
    rank's part. A dispatch mode, so fills reached through any wrapper (nn.init.xavier_uniform_, trunc_normal_, a
    view of a parameter) are caught; it runs before DTensor's own dispatch."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.overloadpacket not in _RANDOM_FILLS or not isinstance(args[0], DTensor):
            return func(*args, **kwargs)
        target = args[0]
        local = target.to_local()
        full = torch.empty(target.shape, dtype=target.dtype, device=local.device)
        func(full, *args[1:], **kwargs)  # the same draws, from the same generator, as an unsharded init
        local.copy_(distribute_tensor(full, target.device_mesh, target.placements, src_data_rank=None).to_local())
        return target


@contextlib.contextmanager
def full_tensor_random_init():
    """Makes a model's `init_weights()` give the same weights in every layout: one process, DDP, FSDP and HSDP.

    Random fills of sharded parameters (xavier_uniform_, normal_, ...) otherwise draw each shard apart: on CPU
    every shard repeats the same stream, and on CUDA DTensor's offset-based RNG gives the right distribution but
    other numbers than one process draws. Here every rank draws each whole parameter from the global generator,
    in the model's order, and keeps its shard: one unsharded parameter at a time is the only extra memory.
    """
    with _FullTensorRandomFills():
        yield


def torch_dtype(name: str) -> torch.dtype:
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[name]


def _op_policy(ctx, op, *args, **kwargs):
    saved = op in _SAVE_LIST or op.name() in _SAVE_CUSTOM
    return CheckpointPolicy.MUST_SAVE if saved else CheckpointPolicy.PREFER_RECOMPUTE


def _selective_op_context():
    return create_selective_checkpoint_contexts(_op_policy)


def apply_ac(blocks: nn.ModuleDict, mode: str, selective_option: str) -> list[int]:
    """Wraps blocks in activation checkpointing: all ('full'), per-op policy ('selective', 'op'),
    or every k-th block ('selective', k). Returns the indices of the wrapped blocks."""
    every_k = int(selective_option) if mode == "selective" and selective_option != "op" else 1
    wrapped = []
    for index, (name, block) in enumerate(list(blocks.items())):
        if index % every_k != 0:
            continue
        if mode == "selective" and selective_option == "op":
            blocks[name] = checkpoint_wrapper(block, context_fn=_selective_op_context, preserve_rng_state=False)
        else:
            blocks[name] = checkpoint_wrapper(block, preserve_rng_state=False)
        wrapped.append(index)
    logger.info(f"activation checkpointing: {mode} ({selective_option if mode == 'selective' else 'all'}), "
                f"{len(wrapped)}/{len(blocks)} blocks")  # fmt: skip
    return wrapped


def apply_compile(model: nn.Module, mode: str = "default", scope: str = "block") -> None:
    """torch.compile in place each of `model.blocks`, or the whole model with scope 'model'.

    fullgraph: a graph break is a bug, not a slowdown. `Module.compile` keeps the parameter names.
    """
    modules = list(model.blocks.values()) if scope == "block" else [model]
    for module in modules:
        module.compile(fullgraph=True, mode=None if mode == "default" else mode)
    what = f"{len(modules)} blocks" if scope == "block" else "the whole model"
    logger.info(f"compiled {what} with torch.compile(fullgraph=True, mode={mode!r})")


def reshards_after_forward(mode: str, num_blocks: int) -> tuple[list[bool], bool]:
    """`parallelism.fsdp_reshard_after_forward` as fully_shard's flag for each block and for the root: "always"
    frees every gathered parameter after forward, "never" keeps them all for backward, "default" frees all but the
    last block's (backward needs those right away) and the root's."""
    if mode == "default":
        return [index < num_blocks - 1 for index in range(num_blocks)], False
    return [mode == "always"] * num_blocks, mode == "always"


def apply_fsdp(model: nn.Module, blocks: list[nn.Module], mesh: DeviceMesh, param_dtype: torch.dtype,
               reduce_dtype: torch.dtype, reshard_after_forward: str) -> None:  # fmt: skip
    """FSDP2 fully_shard per block, then the root (HSDP when the mesh is 2D)."""
    mp_policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    block_flags, root_flag = reshards_after_forward(reshard_after_forward, len(blocks))
    for block, reshard in zip(blocks, block_flags, strict=True):
        fully_shard(block, mesh=mesh, mp_policy=mp_policy, reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh, mp_policy=mp_policy, reshard_after_forward=root_flag)


def apply_ddp(model: nn.Module, mesh: DeviceMesh, compiled: bool) -> None:
    """Composable DDP (replicate) over the replicate mesh."""
    from torch.distributed._composable.replicate import replicate

    if compiled:
        torch._dynamo.config.optimize_ddp = "ddp_optimizer"
    replicate(model, device_mesh=mesh, bucket_cap_mb=100)


def apply_float8(model: nn.Module, float8_config, fsdp_enabled: bool) -> bool:
    """Swaps Linear layers for torchao float8 training layers, skipping filtered and small ones.

    Returns whether FSDP all-gathers float8 weights (tensorwise recipe under FSDP), in which case the
    trainer precomputes the scales after each optimizer step.
    """
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError as e:
        raise ImportError("quantize.linear.float8.enable needs torchao: pip install torchao") from e
    if not float8_config.emulate and not (torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)):
        raise ValueError("quantize.linear.float8.enable needs an SM89+ GPU; set quantize.linear.float8.emulate = true")
    fp8_all_gather = fsdp_enabled and float8_config.recipe_name == "tensorwise"
    if float8_config.recipe_name == "tensorwise":
        config = Float8LinearConfig(emulate=float8_config.emulate, enable_fsdp_float8_all_gather=fp8_all_gather)
    else:
        config = Float8LinearConfig.from_recipe_name(float8_config.recipe_name)
        config = type(config)(**{**config.__dict__, "emulate": float8_config.emulate})
    skipped = defaultdict(int)

    def module_filter(module: nn.Module, fqn: str) -> bool:
        if any(name in fqn for name in float8_config.filter_fqns):
            skipped["filtered"] += 1
            return False
        # float8 matmuls only pay off on large dims, and need multiples of 16.
        if not isinstance(module, nn.Linear) or module.in_features % 16 or module.out_features % 16:
            skipped["shape"] += 1
            return False
        return True

    convert_to_float8_training(model, config=config, module_filter_fn=module_filter)
    logger.info(f"float8 training ({float8_config.recipe_name}) on Linear layers; skipped {dict(skipped)}; "
                f"float8 all-gather {'on' if fp8_all_gather else 'off'}")  # fmt: skip
    return fp8_all_gather
