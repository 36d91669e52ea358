"""parallelize_dit: converters -> activation checkpointing -> compile -> FSDP/HSDP or DDP, in that order.

The order matters: converters swap plain modules for fused ones (and float8 Linears) that AC and compile then see;
AC wraps the converted block, compile then traces the wrapped block (so the recomputation is compiled too), and
FSDP shards last so its hooks sit outside the compiled code. Under DP-SGD compile comes before AC (see below).
"""

import torch
from torch import nn

from torchtitan.parallelisms.parallel_dims import ParallelDims
from torchtitan.parallelisms.utils import (
    apply_ac,
    apply_compile,
    apply_data_parallel,
    checkpointed_blocks,
    compile_scope,
    full_graph,
)
from torchtitan.tools.logging import logger


def converters_for_batch(job_config, args) -> list[str]:
    """`model.converters` without the fused ones on CUDA when a micro-batch is below `model.converters_min_tokens`
    tokens, where their host time per call costs more than their kernels save (see that key)."""
    from torchtitan.kernels.converters import HOST_BOUND_CONVERTERS

    names = list(job_config.model.converters)
    tokens = job_config.training.local_batch_size * (args.input_size // args.patch_size) ** 2
    if not torch.cuda.is_available() or tokens >= job_config.model.converters_min_tokens:
        return names
    dropped = [name for name in names if name in HOST_BOUND_CONVERTERS]
    if dropped:
        logger.info(f"model converters {dropped} stand aside: {tokens:,} tokens a micro-batch, below "
                    f"model.converters_min_tokens = {job_config.model.converters_min_tokens:,}")  # fmt: skip
    return [name for name in names if name not in HOST_BOUND_CONVERTERS]


def parallelize_dit(model: nn.Module, parallel_dims: ParallelDims, job_config) -> nn.Module:
    """Applies the config's converters, training optimizations and data parallelism to a DiT in place."""
    # Imported here: the converters' modules subclass the DiT's, so kernels/ imports this package.
    from torchtitan.kernels.converters import apply_converters

    ac = job_config.activation_checkpoint
    # One rule says which blocks AC wraps: the fused_norm converter needs it too (those blocks and the block
    # before each finish their own residual).
    checkpointed = checkpointed_blocks(len(model.blocks), ac.mode, ac.selective_ac_option)
    compile_config = job_config.compile
    compiled = compile_config.enable and "model" in compile_config.components
    names = converters_for_batch(job_config, model.args)
    conversion = apply_converters(model, names, checkpointed, job_config.quantize.linear.float8,
                                  parallel_dims.fsdp_enabled, compiled)  # fmt: skip
    model.float8_fsdp_all_gather = conversion.float8_fsdp_all_gather  # read by the trainer after each step
    if ac.mode != "none":
        apply_ac(model.blocks, ac.mode, ac.selective_ac_option, save_ops=conversion.save_ops)
    if compiled:
        scope = compile_scope(compile_config, parallel_dims)
        replicated = parallel_dims.ddp_enabled
        apply_compile(model, compile_config.mode, scope, fullgraph=full_graph(job_config, scope, replicated),
                      replicated=replicated)  # fmt: skip
    apply_data_parallel(model, list(model.blocks.values()), parallel_dims, job_config, job_config.compile.enable)
    return model
