"""Model converters: what `[model] converters` names, applied by parallelize_dit before activation checkpointing
and compile, as TorchTitan applies its `model.converters` and torchao its float8 conversion.

    [model]
    converters = ["fused_norm", "fused_mlp", "fused_qkv"]   # the default; [] trains the plain model

A converter swaps modules of the plain model for ones with the same parameter names, so checkpoints, exports, FSDP
and `init_weights()` see the model they know; whatever trick a kernel needs lives in its module (dit_modules.py).
"""

from collections import defaultdict
from dataclasses import dataclass

from torch import nn

from torchtitan.kernels.dit_modules import (
    apply_fused_mlp,
    apply_fused_norm,
    apply_fused_qkv,
    qkv_keeps_plain,
    residual_finished,
)
from torchtitan.tools.logging import logger

# Each converter's name and what it does (config errors list them; `[model] converters` defaults to the first three).
CONVERTERS = {
    "fused_norm": "each adaLN norm, with the gated residual add before it, as one Triton kernel each way",
    "fused_mlp": "fc1's bias and the activation as one Triton kernel each way (GELU in bf16/fp16: cuBLASLt epilogues)",
    "fused_qkv": "qkv's output gradient assembled and its bias gradient summed in one Triton kernel",
    "float8": "torchao float8 training of the Linear layers ([quantize.linear.float8] holds its options)",
}

# The converters whose kernels are Python custom ops: each call costs the host about 0.3 ms of dispatch, which
# `model.converters_min_tokens` weighs against what the kernels save (models/dit/parallelize.converters_for_batch).
HOST_BOUND_CONVERTERS = ("fused_norm", "fused_mlp", "fused_qkv")


@dataclass
class Conversion:
    """What converters tell the rest of parallelize_dit.

    Attributes:
        save_ops: custom ops whose outputs per-op selective activation checkpointing must keep (they hold GEMMs).
        float8_fsdp_all_gather: FSDP all-gathers float8 weights; the trainer then precomputes their scales after
            each optimizer step.
    """

    save_ops: frozenset = frozenset()
    float8_fsdp_all_gather: bool = False


def apply_converters(model: nn.Module, names: list[str], checkpointed: list[bool], float8_config,
                     fsdp_enabled: bool, compiled: bool = False) -> Conversion:  # fmt: skip
    """Applies the named converters to a plain DiT in place, in the order given.

    Args:
        model: the DiT, before activation checkpointing, compile and data parallelism.
        names: `model.converters`.
        checkpointed: which blocks activation checkpointing will wrap (parallelisms.utils.checkpointed_blocks): under
            fused_norm those, and the block before each, finish their own residual.
        float8_config: the `[quantize.linear.float8]` section (recipe_name, filter_fqns, emulate).
        fsdp_enabled: whether FSDP will shard the model (float8's all-gather).
        compiled: whether torch.compile will trace the blocks: fused_qkv then leaves checkpointed blocks plain
            (dit_modules.qkv_keeps_plain).

    Raises:
        ValueError: an unknown converter name (config validation names the key and its source first).
    """
    conversion = Conversion()
    for name in names:
        if name == "fused_norm":
            finish = residual_finished(checkpointed)
            align_depth = getattr(getattr(model, "args", None), "align_depth", 0)
            if align_depth:  # REPA's projectors read the output of that block whole
                finish[align_depth - 1] = True
            apply_fused_norm(model, finish)
        elif name == "fused_mlp":
            conversion.save_ops |= apply_fused_mlp(model)
        elif name == "fused_qkv":
            keep_plain = qkv_keeps_plain(checkpointed, compiled)
            apply_fused_qkv(model, keep_plain)
            if any(keep_plain):
                logger.info(f"fused_qkv: {sum(keep_plain)} compiled, checkpointed blocks keep the plain attention "
                            "(compile would keep the fused op's tensors: dit_modules.qkv_keeps_plain)")  # fmt: skip
        elif name == "float8":
            conversion.float8_fsdp_all_gather = apply_float8(model, float8_config, fsdp_enabled)
        else:
            raise ValueError(f"model.converters: unknown converter {name!r}; known: {list(CONVERTERS)}")
    logger.info(f"model converters: {names or 'none'}")
    return conversion


def apply_float8(model: nn.Module, float8_config, fsdp_enabled: bool) -> bool:
    """The converter float8: swaps Linear layers for torchao float8 training layers, skipping filtered and small ones.

    Returns whether FSDP all-gathers float8 weights (tensorwise recipe under FSDP), in which case the
    trainer precomputes the scales after each optimizer step.
    """
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError as e:
        raise ImportError("model.converters 'float8' needs torchao: pip install torchao") from e
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
