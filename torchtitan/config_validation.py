"""Checks of a resolved JobConfig that need no world size (validate) and one that does (check_batch_sizes).

Every message names the key, the bad value and where that value came from (`JobConfig.source_of`: the TOML
file, "the command line" or "the defaults").
"""

import dataclasses
import math


class ConfigError(ValueError):
    """A bad config value; the message names the key, the value and its source."""


def _value(cfg, key: str):
    obj = cfg
    for part in key.split("."):
        obj = getattr(obj, part)
    return obj


def at(cfg, key: str) -> str:
    """'key = value in source': how a message about one key starts."""
    return f"{key} = {_value(cfg, key)!r} in {cfg.source_of(key)}"


def keys_in(cfg, *keys: str) -> str:
    """'a with b in X' when one source set them all, else 'a in X with b in Y': a message about a combination."""
    sources = [cfg.source_of(key) for key in keys]
    if len(set(sources)) == 1:
        return f"{' with '.join(keys)} in {sources[0]}"
    return " with ".join(f"{key} in {source}" for key, source in zip(keys, sources))


_CHOICES = {
    "diffusion.objective": ("ddpm", "rectified_flow"),
    "diffusion.timestep_sampling": ("uniform", "logit_normal"),
    "diffusion.noise_schedule": ("linear", "cosine"),
    "optimizer.name": ("AdamW",),
    "optimizer.implementation": ("fused", "foreach", "for-loop"),
    "lr_scheduler.decay_type": ("linear", "cosine", "sqrt"),
    "training.dataset": ("digits", "dummy", "imagefolder", "cifar10", "latents"),
    "training.mixed_precision_param": ("bfloat16", "float32"),
    "training.mixed_precision_reduce": ("float32", "bfloat16"),
    "parallelism.fsdp_reshard_after_forward": ("default", "always", "never"),
    "checkpoint.async_mode": ("disabled", "async"),
    "checkpoint.export_dtype": ("float32", "bfloat16"),
    "activation_checkpoint.mode": ("none", "full", "selective"),
    "compile.mode": ("default", "max-autotune-no-cudagraphs"),
    "compile.scope": ("block", "model"),
    "quantize.linear.float8.recipe_name": ("tensorwise", "rowwise", "rowwise_with_gw_hp"),  # torchao's names
    "sampling.sampler": ("default", "ddim", "euler", "heun"),
    "latent.tokenizer": ("", "cosmos_jit", "diffusers"),
    "dp.mode": ("vanilla", "ghost", "flash", "bookkeeping", "flash_bookkeeping"),
    "dp.accountant": ("rdp", "prv"),
    "dp.sampling": ("poisson", "shuffle"),
    "model.norm": (None, "layernorm", "rmsnorm"),
    "model.mlp": (None, "gelu", "swiglu"),
}

_RULES = {
    "> 0": lambda v: v > 0,
    ">= 0": lambda v: v >= 0,
    ">= -1": lambda v: v >= -1,
    "-1 or >= 1": lambda v: v == -1 or v >= 1,
    "in [0, 1)": lambda v: 0 <= v < 1,
    "in [0, 1]": lambda v: 0 <= v <= 1,
    "in (0, 1)": lambda v: 0 < v < 1,
    "in [0, 2**32)": lambda v: 0 <= v < 2**32,
}

# The range of every number with one. Where 0 or -1 means "off", "all", "newest" or "the flavor's" (the
# field's docstring says which), the rule admits it. Floats are also checked to be finite, before these.
_BOUNDS = {
    "profiling.profile_freq": "> 0",
    "profiling.profiler_active": "> 0",
    "profiling.profiler_warmup": ">= 0",
    "profiling.memory_breakdown_steps": ">= 0",
    "metrics.log_freq": "> 0",
    "model.input_size": ">= 0",
    "model.in_channels": ">= 0",
    "model.patch_size": ">= 0",
    "model.num_classes": ">= -1",
    "model.attn_window": ">= -1",
    "diffusion.num_timesteps": "> 0",
    "diffusion.logit_normal_std": "> 0",
    "diffusion.class_dropout_prob": "in [0, 1)",
    "optimizer.lr": "> 0",
    "optimizer.beta1": "in [0, 1)",
    "optimizer.beta2": "in [0, 1)",
    "optimizer.eps": "> 0",
    "optimizer.weight_decay": ">= 0",
    "lr_scheduler.warmup_steps": ">= 0",
    "lr_scheduler.decay_ratio": "in [0, 1]",
    "lr_scheduler.min_lr_factor": "in [0, 1]",
    "training.image_size": ">= 0",
    "training.global_batch_size": "-1 or >= 1",
    "training.steps": "> 0",
    "training.max_norm": ">= 0",
    "training.ema_decay": "in [0, 1)",
    "training.gc_freq": ">= 0",
    "training.dataloader.num_workers": ">= 0",
    "training.dataloader.prefetch_factor": "> 0",
    "parallelism.data_parallel_replicate_degree": "-1 or >= 1",
    "parallelism.data_parallel_shard_degree": "-1 or >= 1",
    "checkpoint.interval": "> 0",
    "checkpoint.keep_latest_k": ">= 0",
    "checkpoint.load_step": ">= -1",
    "sampling.freq": ">= 0",
    "sampling.num_samples": "> 0",
    "sampling.steps": "> 0",
    "latent.scale_factor": ">= 0",
    "dp.max_grad_norm": "> 0",
    "dp.noise_multiplier": ">= 0",
    "dp.target_epsilon": ">= 0",
    "dp.delta": "in (0, 1)",
    "dp.augmult": "> 0",
    "debug.seed": "in [0, 2**32)",  # numpy's seed range
}


def _float_keys(obj, prefix: str = ""):
    """Dotted keys of every float value under a config (private fields such as JobConfig._sources skipped)."""
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if f.name.startswith("_"):
            continue
        if dataclasses.is_dataclass(value):
            yield from _float_keys(value, f"{prefix}{f.name}.")
        elif isinstance(value, float):
            yield f"{prefix}{f.name}"


def validate(cfg) -> None:
    """Checks values that need no world size; data-parallel checks run in check_batch_sizes().

    Raises:
        ConfigError: naming the key, its value and its source (cfg.source_of(key)).
    """
    from torchtitan.models.dit.model import POS_EMBEDS
    from torchtitan.train_spec import get_train_spec

    try:
        spec = get_train_spec(cfg.model.name)
    except ValueError as e:
        raise ConfigError(f"{at(cfg, 'model.name')}: {e}") from e
    if cfg.model.flavor not in spec.model_args:
        raise ConfigError(f"{at(cfg, 'model.flavor')}: known flavors {sorted(spec.model_args)}")
    if cfg.compile.mode in ("max-autotune", "reduce-overhead"):
        # Seen on an H100 (2026-11-25, DiT-XL/2, per-block compile): the first forward of a block raised in
        # Inductor's cudagraph trees (check_memory_pool), at batch 224 and at 64. Not looked into further.
        raise ConfigError(
            f"{at(cfg, 'compile.mode')}: CUDA graphs are not supported; "
            "use 'max-autotune-no-cudagraphs' (autotuned Triton GEMMs without CUDA graphs) or 'default'"
        )
    for key, allowed in {**_CHOICES, "model.pos_embed": (None, *POS_EMBEDS)}.items():
        if _value(cfg, key) not in allowed:
            raise ConfigError(f"{at(cfg, key)}: must be one of {list(allowed)}")
    prediction = {"ddpm": "epsilon", "rectified_flow": "velocity"}[cfg.diffusion.objective]
    if cfg.diffusion.prediction != prediction:
        raise ConfigError(
            f"{at(cfg, 'diffusion.prediction')}: diffusion.objective {cfg.diffusion.objective!r} "
            f"(in {cfg.source_of('diffusion.objective')}) predicts {prediction!r}"
        )
    samplers = {"ddpm": ("default", "ddim"), "rectified_flow": ("default", "euler", "heun")}[cfg.diffusion.objective]
    if cfg.sampling.sampler not in samplers:  # else the first sample grid, steps into the run, would fail
        raise ConfigError(
            f"{at(cfg, 'sampling.sampler')}: diffusion.objective {cfg.diffusion.objective!r} (in "
            f"{cfg.source_of('diffusion.objective')}) samples with {list(samplers)}"
        )
    # No field accepts inf or nan (a field that did would say so in its docstring and be skipped here).
    for key in _float_keys(cfg):
        if not math.isfinite(_value(cfg, key)):
            raise ConfigError(f"{at(cfg, key)}: must be a finite number")
    if cfg.training.local_batch_size != "auto" and cfg.training.local_batch_size <= 0:  # "auto": batch_size_finder
        raise ConfigError(f"{at(cfg, 'training.local_batch_size')}: must be > 0 or 'auto'")
    for key, rule in _BOUNDS.items():
        if not _RULES[rule](_value(cfg, key)):
            raise ConfigError(f"{at(cfg, key)}: must be {rule}")
    p = cfg.profiling
    if p.enable_profiling and p.profiler_active > p.profile_freq:
        raise ConfigError(
            f"{at(cfg, 'profiling.profiler_active')}: records more steps than profiling.profile_freq = "
            f"{p.profile_freq} (in {cfg.source_of('profiling.profile_freq')}) has between traces"
        )
    if cfg.training.dataset in ("imagefolder", "cifar10", "latents") and not cfg.training.dataset_path:
        raise ConfigError(
            f"training.dataset_path is empty in {cfg.source_of('training.dataset_path')}: "
            f"{at(cfg, 'training.dataset')} needs one"
        )
    if any(c != "model" for c in cfg.compile.components):
        raise ConfigError(f"{at(cfg, 'compile.components')}: only 'model' is compiled")
    unknown = [b for b in cfg.model.sdpa_backends if b not in ("cudnn", "flash", "efficient", "math")]
    if unknown or not cfg.model.sdpa_backends:
        raise ConfigError(f"{at(cfg, 'model.sdpa_backends')}: use 'cudnn', 'flash', 'efficient', 'math'")
    option = cfg.activation_checkpoint.selective_ac_option
    if option != "op" and not (option.isdigit() and int(option) > 0):
        raise ConfigError(f"{at(cfg, 'activation_checkpoint.selective_ac_option')}: must be 'op' or a positive integer")
    if cfg.checkpoint.create_seed_checkpoint and not cfg.checkpoint.enable:
        raise ConfigError(f"{keys_in(cfg, 'checkpoint.create_seed_checkpoint', 'checkpoint.enable')}: "
                          "a seed checkpoint needs checkpoint.enable = true")  # fmt: skip


def check_batch_sizes(cfg, dp_degree: int) -> int:
    """Returns the gradient accumulation steps; raises if the global batch cannot be split.

    Args:
        cfg: the job config.
        dp_degree: number of data-parallel ranks (replicate x shard).
    """
    local, global_ = cfg.training.local_batch_size, cfg.training.global_batch_size
    if global_ == -1:
        return 1
    per_micro = local * dp_degree
    if global_ <= 0 or global_ % per_micro != 0:
        raise ConfigError(
            f"{at(cfg, 'training.global_batch_size')} is not divisible by training.local_batch_size "
            f"(in {cfg.source_of('training.local_batch_size')}) x data-parallel degree = "
            f"{local} x {dp_degree} = {per_micro}"
        )
    return global_ // per_micro
