"""parallelize_llama3: float8 -> activation checkpointing -> compile -> FSDP/HSDP or DDP, in that order.

The same order and helpers as parallelize_dit (see there for why); the DiT's fused kernels do not apply here, so
the only converter is float8. Under DP-SGD each layer is compiled before AC, for the same reason as the DiT's.
"""

from torch import nn

from torchtitan.parallelisms.parallel_dims import ParallelDims
from torchtitan.parallelisms.utils import apply_ac, apply_compile, apply_data_parallel, compile_scope, full_graph


def parallelize_llama3(model: nn.Module, parallel_dims: ParallelDims, job_config) -> nn.Module:
    """Applies float8 (when `model.converters` names it), AC, compile and data parallelism to a Llama 3 in place."""
    model.float8_fsdp_all_gather = False  # read by the trainer after each step
    if "float8" in job_config.model.converters:
        from torchtitan.kernels.converters import apply_float8

        model.float8_fsdp_all_gather = apply_float8(model, job_config.quantize.linear.float8,
                                                    parallel_dims.fsdp_enabled)  # fmt: skip
    ac, compile_config = job_config.activation_checkpoint, job_config.compile
    compiled = compile_config.enable and "model" in compile_config.components
    if ac.mode != "none":
        apply_ac(model.layers, ac.mode, ac.selective_ac_option)
    if compiled:
        scope = compile_scope(compile_config, parallel_dims)
        replicated = parallel_dims.ddp_enabled
        apply_compile(model, compile_config.mode, scope, fullgraph=full_graph(job_config, scope, replicated),
                      blocks=model.layers, replicated=replicated)  # fmt: skip
    apply_data_parallel(model, list(model.layers.values()), parallel_dims, job_config, compiled)
    return model
