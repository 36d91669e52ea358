"""apply_* helpers shared by every model's parallelize function; each changes a module in place."""

import contextlib
import functools

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
# everything else (norms, modulation, activations, RoPE) is cheap pointwise work, recomputed. Converters add the
# custom ops of theirs that hold a GEMM (apply_ac's `save_ops`).
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


def op_policy(save_ops: frozenset = frozenset()):
    """Per-op selective AC's policy: keep the outputs of _SAVE_LIST's ops and of `save_ops`, recompute the rest."""

    def policy(ctx, op, *args, **kwargs):
        saved = op in _SAVE_LIST or op in save_ops
        return CheckpointPolicy.MUST_SAVE if saved else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def checkpointed_blocks(depth: int, mode: str, selective_option: str) -> list[bool]:
    """Which of `depth` blocks activation checkpointing wraps (`[activation_checkpoint]` mode and
    selective_ac_option): none ('none'), all ('full', or 'selective' with 'op'), or blocks 0, k, 2k, ...
    ('selective' with k). The one rule apply_ac, the fused_norm converter and the memory estimate share."""
    if mode == "none":
        return [False] * depth
    every_k = int(selective_option) if mode == "selective" and selective_option != "op" else 1
    return [index % every_k == 0 for index in range(depth)]


def apply_ac(blocks: nn.ModuleDict, mode: str, selective_option: str, save_ops: frozenset = frozenset()) -> None:
    """Wraps blocks in activation checkpointing, those `checkpointed_blocks` names: whole blocks ('full', or
    'selective' with k), or each under the per-op policy ('selective', 'op'), which also keeps the outputs of
    `save_ops` (custom ops that hold a GEMM, which converters declare)."""
    per_op = mode == "selective" and selective_option == "op"
    context_fn = functools.partial(create_selective_checkpoint_contexts, op_policy(frozenset(save_ops)))
    wrapped = checkpointed_blocks(len(blocks), mode, selective_option)
    for (name, block), wrap in zip(list(blocks.items()), wrapped, strict=True):
        if wrap and per_op:
            blocks[name] = checkpoint_wrapper(block, context_fn=context_fn, preserve_rng_state=False)
        elif wrap:
            blocks[name] = checkpoint_wrapper(block, preserve_rng_state=False)
    logger.info(f"activation checkpointing: {mode} ({selective_option if mode == 'selective' else 'all'}), "
                f"{sum(wrapped)}/{len(blocks)} blocks")  # fmt: skip


def apply_compile(model: nn.Module, mode: str = "default", scope: str = "block", fullgraph: bool = True,
                  blocks: nn.ModuleDict | None = None, replicated: bool = False) -> None:  # fmt: skip
    """torch.compile in place each of the model's blocks (`blocks`, by default `model.blocks`), or the whole model
    with scope 'model'.

    fullgraph: a graph break is a bug, not a slowdown (see `full_graph`).
    replicated: the model is about to get DDP (apply_ddp). A whole model then compiles its `forward`, not its call:
    DDP's root pre-forward hook runs first, outside the graph, and marks its module active, so dynamo's
    DDPOptimizer splits the graph at DDP's bucket boundaries and each bucket's all-reduce overlaps the rest of the
    backward, as with torch.compile over DistributedDataParallel. Compiling the call would trace that hook into
    one graph whose gradients all arrive at its end, every all-reduce after the backward.
    `Module.compile` and the compiled `forward` keep the parameter names.
    """
    blocks = model.blocks if blocks is None else blocks
    modules = list(blocks.values()) if scope == "block" else [model]
    compile_mode = None if mode == "default" else mode
    for module in modules:
        if scope == "model" and replicated:
            module.forward = torch.compile(module.forward, fullgraph=fullgraph, mode=compile_mode)
        else:
            module.compile(fullgraph=fullgraph, mode=compile_mode)
    what = f"{len(modules)} blocks" if scope == "block" else "the whole model"
    logger.info(f"compiled {what} with torch.compile(fullgraph={fullgraph}, mode={mode!r})")


def compile_scope(compile_config, parallel_dims) -> str:
    """compile.scope with "auto" resolved: on CUDA the whole model on one device or under DDP, DP-SGD included, where
    it was measured faster (DiT-XL/2 on one H200 at 32, 64 and 224 images a step, Llama-3.2-1B equal; DDP over 4
    H200s at 32 images a GPU 1.12x each block's graph; DP-SGD's flash book-keeping step on one H200 1.17x the
    non-private one against 1.69x with each block's graph: docs/benchmark_log.md, 2026-11-27 and 2026-11-27 (c)), and
    each block otherwise: FSDP's hooks stay outside compiled code, and on the CPU one block's graph, compiled once for
    all blocks, keeps start-up short."""
    if compile_config.scope != "auto":
        return compile_config.scope
    whole = not parallel_dims.fsdp_enabled
    return "model" if whole and torch.cuda.is_available() else "block"


def full_graph(job_config, scope: str, replicated: bool = False) -> bool:
    """fullgraph for apply_compile of `scope`: True, except for a whole compiled model under DP-SGD on one device,
    whose root pre-hook (it makes the per-row token the engine backpropagates to, outside any graph) is one graph
    break at its start. Under DDP (`replicated`) the model's `forward` is compiled, and the hook runs before it."""
    return not (job_config.dp.enable and scope == "model" and not replicated)


def reshards_after_forward(mode: str, num_units: int) -> tuple[list[bool], bool]:
    """`parallelism.fsdp_reshard_after_forward` as fully_shard's flag for each unit of blocks and for the root:
    "always" frees every gathered parameter after forward, "never" keeps them all for backward, "default" frees all
    but the last unit's (backward needs those right away) and the root's."""
    if mode == "default":
        return [index < num_units - 1 for index in range(num_units)], False
    return [mode == "always"] * num_units, mode == "always"


# The gathered parameters (in the compute dtype) of one FSDP unit that `parallelism.fsdp_blocks_per_unit = 0` sizes
# units to: DiT-XL/2's 28 blocks (46 MiB each in bf16) go in 2 units, the 7B flavor's (about 580 MiB) one a unit.
UNIT_BYTES = 1 << 30


def blocks_per_unit(setting: int, block_bytes: int, num_blocks: int) -> int:
    """`parallelism.fsdp_blocks_per_unit` resolved: the setting when above 0; 0 (auto) as many blocks as gather in
    UNIT_BYTES, and at most half of them (two units or more, so that one unit's all-gather runs beside the other's
    compute), one at least. DiT-XL/2 on 2 H200s at 64 images a GPU: 505, 759, 910 and 1030 images/s with units of
    1, 4, 7 and 14 blocks, for 22.3 to 23.6 GiB a GPU (docs/benchmark_log.md, 2026-11-28 (n))."""
    if setting > 0:
        return min(setting, num_blocks)
    return max(1, min(UNIT_BYTES // max(block_bytes, 1), num_blocks // 2))


def fsdp_units(num_blocks: int, blocks_per_unit: int) -> list[range]:
    """The blocks of each FSDP unit (`parallelism.fsdp_blocks_per_unit` consecutive blocks, the last unit the
    rest): each unit's parameters are gathered by one all-gather and its gradients reduced by one reduce-scatter."""
    return [range(start, min(start + blocks_per_unit, num_blocks)) for start in range(0, num_blocks, blocks_per_unit)]


def apply_fsdp(model: nn.Module, blocks: list[nn.Module], mesh: DeviceMesh, param_dtype: torch.dtype,
               reduce_dtype: torch.dtype, reshard_after_forward: str, units_of: int = 0,
               prefetch: int = 1) -> None:  # fmt: skip
    """FSDP2 fully_shard per unit of blocks (`units_of` blocks, 0: `blocks_per_unit`'s auto), then the root (HSDP
    when the mesh is 2D).

    prefetch: units whose all-gather each unit issues as it starts, forward and backward (the next ones in the
    order they run); 0 leaves it to FSDP2, which all-gathers a unit when the host reaches it.
    """
    mp_policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    block_bytes = sum(p.numel() for p in blocks[0].parameters()) * param_dtype.itemsize if blocks else 0
    per_unit = blocks_per_unit(units_of, block_bytes, len(blocks)) if blocks else 1
    units = [[blocks[i] for i in unit] for unit in fsdp_units(len(blocks), per_unit)]
    logger.info(f"FSDP units: {len(units)} of up to {per_unit} blocks, prefetch {prefetch}")
    unit_flags, root_flag = reshards_after_forward(reshard_after_forward, len(units))
    for unit, reshard in zip(units, unit_flags, strict=True):
        fully_shard(unit if len(unit) > 1 else unit[0], mesh=mesh, mp_policy=mp_policy, reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh, mp_policy=mp_policy, reshard_after_forward=root_flag)
    if prefetch:
        heads = [unit[0] for unit in units]
        for index, head in enumerate(heads):
            head.set_modules_to_forward_prefetch(heads[index + 1 : index + 1 + prefetch])
            head.set_modules_to_backward_prefetch(heads[max(0, index - prefetch) : index][::-1])


def apply_ddp(model: nn.Module, mesh: DeviceMesh, compiled: bool, bucket_cap_mb: int = 100,
              reduces: bool = True) -> None:  # fmt: skip
    """Composable DDP (replicate) over the replicate mesh, its gradients all-reduced in buckets of `bucket_cap_mb`.

    The gradients are views of the buckets (`gradient_as_bucket_view`): the same all-reduce, without a copy of
    each bucket back into its gradients after it, nor the bucket's memory on top of the gradients': 5% more
    images/s for DiT-XL/2 at 32 a GPU on 4 H200s with one bucket (docs/benchmark_log.md, 2026-11-27 (g)).

    reduces: False when no gradient reaches DDP's reducer (DP-SGD's private modes, whose engine computes and
    all-reduces the gradients itself): a compiled model is then one graph, not split at buckets nobody reduces.
    """
    from torch.distributed._composable.replicate import replicate

    if compiled:
        torch._dynamo.config.optimize_ddp = "ddp_optimizer" if reduces else False
    replicate(model, device_mesh=mesh, bucket_cap_mb=bucket_cap_mb, gradient_as_bucket_view=True)


def apply_data_parallel(model: nn.Module, blocks: list[nn.Module], parallel_dims, job_config, compiled: bool) -> None:
    """The last step of every parallelize function: FSDP/HSDP (each of `blocks`, then the root) when the layout
    shards, else DDP when it replicates, with the config's mixed precision and resharding."""
    if parallel_dims.fsdp_enabled:
        apply_fsdp(
            model,
            blocks=blocks,
            mesh=parallel_dims.fsdp_mesh(),
            param_dtype=torch_dtype(job_config.training.mixed_precision_param),
            reduce_dtype=torch_dtype(job_config.training.mixed_precision_reduce),
            reshard_after_forward=job_config.parallelism.fsdp_reshard_after_forward,
            units_of=job_config.parallelism.fsdp_blocks_per_unit,
            prefetch=job_config.parallelism.fsdp_prefetch,
        )
        logger.info(f"applied {parallel_dims.mode.upper()} to the model")
    elif parallel_dims.ddp_enabled:
        private = job_config.dp.enable and job_config.dp.mode != "vanilla"
        apply_ddp(model, parallel_dims.mesh["dp_replicate"], compiled, job_config.parallelism.ddp_bucket_cap_mb,
                  reduces=not private)  # fmt: skip
        logger.info("applied DDP (replicate) to the model")
