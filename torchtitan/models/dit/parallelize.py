"""parallelize_dit: activation checkpointing -> compile -> FSDP/HSDP or DDP, in that order.

The order matters: AC wraps the plain block, compile then traces the wrapped block (so the
recomputation is compiled too), and FSDP shards last so its hooks sit outside the compiled code.
"""

from torch import nn

from torchtitan.config_validation import ConfigError
from torchtitan.parallelisms.parallel_dims import ParallelDims
from torchtitan.parallelisms.utils import (
    apply_ac,
    apply_compile,
    apply_ddp,
    apply_float8,
    apply_fsdp,
    torch_dtype,
)
from torchtitan.tools.logging import logger


def apply_dit_ac(model: nn.Module, mode: str, selective_option: str) -> None:
    """apply_ac on the DiT's blocks; each checkpointed block, and the block before it, then finish their residual.

    A checkpointed block keeps its inputs for backward and would keep nothing of its own outputs: it gets the
    residual stream summed (one tensor) from the block before it, and sums its own, instead of handing them on
    apart (see DiTBlock).
    """
    blocks = list(model.blocks.values())  # the plain blocks, before apply_ac wraps some of them
    for index in apply_ac(model.blocks, mode, selective_option):
        for block in blocks[max(0, index - 1) : index + 1]:
            block.finish_residual = True


def parallelize_dit(model: nn.Module, parallel_dims: ParallelDims, job_config) -> nn.Module:
    """Applies the config's training optimizations and data parallelism to a DiT in place."""
    if job_config.quantize.linear.float8.enable:
        model.float8_fsdp_all_gather = apply_float8(
            model, job_config.quantize.linear.float8, parallel_dims.fsdp_enabled
        )
    ac = job_config.activation_checkpoint
    if ac.mode != "none":
        apply_dit_ac(model, ac.mode, ac.selective_ac_option)
    compile_config = job_config.compile
    if compile_config.enable and "model" in compile_config.components:
        if compile_config.scope == "model" and parallel_dims.mode != "single":
            raise ConfigError(
                f"compile.scope = 'model' in {job_config.source_of('compile.scope')}: one device only "
                f"(this run is {parallel_dims.mode.upper()}, whose hooks must stay outside compiled code); "
                "use compile.scope = 'block'"
            )
        apply_compile(model, compile_config.mode, compile_config.scope)
    if parallel_dims.fsdp_enabled:
        apply_fsdp(
            model,
            blocks=list(model.blocks.values()),
            mesh=parallel_dims.fsdp_mesh(),
            param_dtype=torch_dtype(job_config.training.mixed_precision_param),
            reduce_dtype=torch_dtype(job_config.training.mixed_precision_reduce),
            reshard_after_forward=job_config.parallelism.fsdp_reshard_after_forward,
        )
        logger.info(f"applied {parallel_dims.mode.upper()} to the model")
    elif parallel_dims.ddp_enabled:
        apply_ddp(model, parallel_dims.mesh["dp_replicate"], compiled=job_config.compile.enable)
        logger.info("applied DDP (replicate) to the model")
    return model
