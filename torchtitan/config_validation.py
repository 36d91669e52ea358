"""Every check of a config, in one place: `validate` (at parse time), `validate_layout` (with the world size and the
device, at the trainer's start) and `check_batch_sizes` (once "auto" is a number). Nothing else validates a config.

Every message names the key, the bad value and where that value came from (`JobConfig.source_of`: the TOML
file, "the command line" or "the defaults").
"""

import dataclasses
import math
import os

from torchtitan.config_validation_dit import check_alignment, check_dit_validation, check_flow_keys, check_sampler
from torchtitan.errors import ConfigError, at, keys_in, value_of

_CHOICES = {
    "diffusion.objective": ("ddpm", "rectified_flow"),
    "diffusion.timestep_sampling": ("uniform", "logit_normal"),
    "diffusion.noise_schedule": ("linear", "cosine"),
    "alignment.encoder": ("dinov2",),
    "alignment.features": ("auto", "stored", "encoder"),
    "diffusion.time_input": ("1000t", "t", "1-t"),
    "optimizer.name": ("AdamW", "SGD"),
    "optimizer.implementation": ("fused", "foreach", "for-loop"),
    "lr_scheduler.decay_type": ("linear", "cosine", "sqrt"),
    "training.mixed_precision_param": ("bfloat16", "float32"),
    "training.mixed_precision_reduce": ("float32", "bfloat16"),
    "parallelism.fsdp_reshard_after_forward": ("default", "always", "never"),
    "checkpoint.async_mode": ("disabled", "async"),
    "checkpoint.initial_load_format": ("dcp", "hf", "dit_pt", "repa_pt", "diffusers", "lightningdit_pt"),
    "checkpoint.export_dtype": ("float32", "bfloat16"),
    "activation_checkpoint.mode": ("none", "full", "selective"),
    "compile.mode": ("default", "max-autotune-no-cudagraphs"),
    "compile.scope": ("auto", "block", "model"),
    "quantize.linear.float8.recipe_name": ("tensorwise", "rowwise", "rowwise_with_gw_hp"),  # torchao's names
    "sampling.sampler": ("default", "ddim", "ddpm", "euler", "heun", "sde"),
    "sampling.sde_diffusion_form": ("sigma", "linear", "decreasing"),  # rectified_flow.SDE_DIFFUSION_FORMS
    "sampling.sde_last_step": ("mean", "tweedie", "euler"),
    "latent.tokenizer": ("", "cosmos_jit", "diffusers"),
    "dp.mode": ("vanilla", "ghost", "flash", "bookkeeping", "flash_bookkeeping"),
    "dp.accountant": ("rdp", "prv"),
    "dp.sampling": ("poisson", "shuffle"),
    "model.norm": (None, "layernorm", "rmsnorm"),
    "model.mlp": (None, "gelu", "swiglu"),
    "validation.fid_dims": (64, 192, 768, 2048),  # pytorch-fid's Inception blocks
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
    "diffusion.x_prediction_t_min": "in (0, 1)",
    "diffusion.class_dropout_prob": "in [0, 1)",
    "alignment.depth": "> 0",
    "alignment.projector_dim": "> 0",
    "alignment.coefficient": ">= 0",
    "alignment.stop_step": ">= 0",
    "diffusion.cosine_loss_weight": ">= 0",
    "optimizer.lr": "> 0",
    "optimizer.beta1": "in [0, 1)",
    "optimizer.beta2": "in [0, 1)",
    "optimizer.eps": "> 0",
    "optimizer.weight_decay": ">= 0",
    "optimizer.momentum": "in [0, 1)",
    "lr_scheduler.warmup_steps": ">= 0",
    "lr_scheduler.decay_ratio": "in [0, 1]",
    "lr_scheduler.min_lr_factor": "in [0, 1]",
    "training.image_size": ">= 0",
    "training.global_batch_size": "-1 or >= 1",
    "training.steps": "> 0",
    "training.max_norm": ">= 0",
    "training.ema_decay": "in [0, 1)",
    "training.gc_freq": ">= 0",
    "training.seq_len": "> 0",
    "validation.freq": "> 0",
    "validation.steps": "> 0",
    "validation.fid_num_samples": ">= 0",
    "validation.loss_num_samples": ">= 0",
    "validation.loss_freq": "> 0",
    "validation.fid_sampling_steps": "> 0",
    "validation.fid_batch_size": "> 0",
    "training.dataloader.num_workers": ">= 0",
    "training.dataloader.prefetch_factor": "> 0",
    "parallelism.data_parallel_replicate_degree": "-1 or >= 1",
    "parallelism.data_parallel_shard_degree": "-1 or >= 1",
    "parallelism.ddp_bucket_cap_mb": "> 0",
    "parallelism.fsdp_blocks_per_unit": ">= 0",
    "parallelism.fsdp_prefetch": ">= 0",
    "checkpoint.interval": "> 0",
    "checkpoint.keep_latest_k": ">= 0",
    "checkpoint.load_step": ">= -1",
    "sampling.freq": ">= 0",
    "sampling.num_samples": "> 0",
    "sampling.steps": "> 0",
    "sampling.guidance_channels": "-1 or >= 1",
    "sampling.guidance_low": "in [0, 1]",
    "sampling.guidance_high": "in [0, 1]",
    "sampling.timestep_shift": "> 0",
    "sampling.sde_diffusion_norm": ">= 0",
    "sampling.sde_last_step_size": "in (0, 1)",
    "latent.scale_factor": ">= 0",
    "dp.max_grad_norm": "> 0",
    "dp.noise_multiplier": ">= 0",
    "dp.target_epsilon": ">= 0",
    "dp.delta": "in (0, 1)",
    "dp.augmult": "> 0",
    "debug.seed": "in [0, 2**32)",  # numpy's seed range
}


def value_problem(key: str, value) -> str:
    """What the tables above say is wrong with `value` for `key` ('' if nothing): not finite, not one of its choices,
    or out of its range. For a command-line flag that stands for a key (sample.py's `--guidance-high`)."""
    if isinstance(value, float) and not math.isfinite(value):
        return "must be a finite number"
    if key in _CHOICES and value not in _CHOICES[key]:
        return f"must be one of {list(_CHOICES[key])}"
    if key in _BOUNDS and not _RULES[_BOUNDS[key]](value):
        return f"must be {_BOUNDS[key]}"
    return ""


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
    """Every check of a config that needs no world size or device (those run in `validate_layout`).

    Raises:
        ConfigError: naming each bad key, its value and its source (cfg.source_of(key)); all of them at once.
    """
    errors: list[str] = []
    for check in (_check_model, _check_choices, _check_numbers, _check_combinations, _check_converters, _check_dp,
                  check_alignment):  # fmt: skip
        check(cfg, errors)
    _raise(errors)


def _raise(errors: list[str]) -> None:
    if len(errors) == 1:
        raise ConfigError(errors[0])
    if errors:
        raise ConfigError(f"{len(errors)} problems in the config:\n  " + "\n  ".join(errors))


def _check_model(cfg, errors: list[str]) -> None:
    """The model is registered, the flavor known, and its args with the `[model]` overrides valid."""
    from torchtitan.train_spec import build_model_args, get_train_spec

    try:
        spec = get_train_spec(cfg.model.name)
    except ValueError as e:
        errors.append(f"{at(cfg, 'model.name')}: {e}")
        return
    if cfg.model.flavor not in spec.model_args:
        errors.append(f"{at(cfg, 'model.flavor')}: known flavors {sorted(spec.model_args)}")
        return
    try:
        args = build_model_args(spec, cfg)
    except ConfigError as e:  # about another key: a Hugging Face folder's config.json (checkpoint.initial_load_path)
        errors.append(str(e))
        return
    except ValueError as e:  # the model's own invariants (DiTArgs.validate), from these overrides
        errors.append(f"{at(cfg, 'model.flavor')} with the [model] overrides: {e}")
        return
    _check_family(cfg, spec, args, errors)
    if getattr(args, "learn_sigma", False) and cfg.diffusion.objective != "ddpm":
        errors.append(f"{at(cfg, 'diffusion.objective')}: a learned sigma (model.learn_sigma, the flavor's or in "
                      f"{cfg.source_of('model.learn_sigma')}) is DDPM's; set model.learn_sigma = false")  # fmt: skip
    latent_images = ("latents", "dummy")  # latents with their images (--store-images; the dummy's random ones)
    if getattr(args, "align_depth", 0) and args.in_channels not in (1, 3) and cfg.training.dataset not in latent_images:
        errors.append(f"{keys_in(cfg, 'alignment.enable', 'model.in_channels')}: the encoder sees images, and "
                      f"{at(cfg, 'training.dataset')} gives the model {args.in_channels}-channel inputs without "
                      "the images they stand for")  # fmt: skip
    if cfg.sampling.guidance_channels > getattr(args, "in_channels", cfg.sampling.guidance_channels):
        errors.append(f"{at(cfg, 'sampling.guidance_channels')}: the model has {args.in_channels} channels")


def _check_family(cfg, spec, args, errors: list[str]) -> None:
    """The keys that belong to one model family: its datasets, held-out split, image sampling, augmult, and DP on
    tied weights."""
    name = f"model.name {spec.name!r} (in {cfg.source_of('model.name')})"
    if cfg.training.dataset not in spec.datasets:
        errors.append(f"{at(cfg, 'training.dataset')}: {name} reads {list(spec.datasets)}")
    if cfg.validation.enable and spec.name == "dit":
        check_dit_validation(cfg, args, name, errors)
    elif cfg.validation.enable and not spec.has_validation_split:
        errors.append(f"{at(cfg, 'validation.enable')}: {name} trains on datasets without a held-out split")
    load_format = cfg.checkpoint.initial_load_format
    if load_format != "dcp" and load_format in _CHOICES["checkpoint.initial_load_format"]:  # else: _check_choices
        if load_format not in spec.weight_readers:
            errors.append(f"{at(cfg, 'checkpoint.initial_load_format')}: {name} has no {load_format!r} weights; it "
                          f"reads {['dcp', *spec.weight_readers]}")  # fmt: skip
        elif not cfg.checkpoint.initial_load_path:
            errors.append(f"{at(cfg, 'checkpoint.initial_load_format')}: {load_format!r} needs "
                          "checkpoint.initial_load_path (the file or folder to start from)")  # fmt: skip
    if spec.name == "dit":
        return
    if getattr(args, "num_labels", 0) > 0 and cfg.training.dataset != "synthetic_classification":
        # A classifier takes one label per sequence; packed text gives next-token labels only (it would fail at
        # step 1 on the labels' shape).
        errors.append(f"{at(cfg, 'model.num_classes')}: a sequence classifier needs labelled sequences, and "
                      f"{at(cfg, 'training.dataset')} is unlabelled text; set model.num_classes = 0 (the causal "
                      "LM) or train on 'synthetic_classification'")  # fmt: skip
    if cfg.sampling.freq > 0 and cfg.source_of("sampling.freq") != "the defaults":
        errors.append(f"{at(cfg, 'sampling.freq')}: image sample grids are the DiT's; {name} writes none (set 0)")
    if cfg.dp.enable and getattr(args, "tie_embeddings", False):
        # One weight in two layers: its per-sample gradient is the sum of both uses, which no layer rule sees whole.
        errors.append(f"{at(cfg, 'model.flavor')}: its LM head is tied to the token embedding, which DP-SGD cannot "
                      "clip per sample; train a classifier (model.num_classes > 0) or an untied flavor")  # fmt: skip
    if cfg.dp.enable and cfg.dp.augmult > 1:
        errors.append(f"{at(cfg, 'dp.augmult')}: augmult draws K diffusion timesteps and noises per image; {name} "
                      "has no per-sample randomness to multiply (set 1)")  # fmt: skip


def _check_choices(cfg, errors: list[str]) -> None:
    from torchtitan.models.dit.model import POS_EMBEDS

    choices = {**_CHOICES, "model.pos_embed": (None, *POS_EMBEDS)}
    if cfg.compile.mode in ("max-autotune", "reduce-overhead"):
        # Seen on an H100 (2026-11-25, DiT-XL/2, per-block compile): the first forward of a block raised in
        # Inductor's cudagraph trees (check_memory_pool), at batch 224 and at 64. On one H200 (2026-11-27) the whole
        # model's graph as a CUDA graph failed with the fused converters (their custom ops' tensors are not tracked
        # by the cudagraph pool) and without them equalled the plain graph at 32 images (489.7 against 488.4/s).
        errors.append(f"{at(cfg, 'compile.mode')}: CUDA graphs are not supported; use 'max-autotune-no-cudagraphs' "
                      "(autotuned Triton GEMMs without CUDA graphs) or 'default'")  # fmt: skip
        choices.pop("compile.mode")
    for key, allowed in choices.items():
        if value_of(cfg, key) not in allowed:
            errors.append(f"{at(cfg, key)}: must be one of {list(allowed)}")
    unknown = [b for b in cfg.model.sdpa_backends if b not in ("cudnn", "flash", "efficient", "math")]
    if unknown or not cfg.model.sdpa_backends:
        errors.append(f"{at(cfg, 'model.sdpa_backends')}: use 'cudnn', 'flash', 'efficient', 'math'")
    if any(c not in ("model", "loss") for c in cfg.compile.components):
        errors.append(f"{at(cfg, 'compile.components')}: list 'model' (the blocks or the whole model) and 'loss'")
    option = cfg.activation_checkpoint.selective_ac_option
    if option != "op" and not (option.isdigit() and int(option) > 0):
        errors.append(f"{at(cfg, 'activation_checkpoint.selective_ac_option')}: must be 'op' or a positive integer")


def _check_numbers(cfg, errors: list[str]) -> None:
    # No field accepts inf or nan (a field that did would say so in its docstring and be skipped here).
    not_finite = {key for key in _float_keys(cfg) if not math.isfinite(value_of(cfg, key))}
    errors += [f"{at(cfg, key)}: must be a finite number" for key in sorted(not_finite)]
    if cfg.training.local_batch_size != "auto" and cfg.training.local_batch_size <= 0:  # "auto": batch_size_finder
        errors.append(f"{at(cfg, 'training.local_batch_size')}: must be > 0 or 'auto'")
    for key, rule in _BOUNDS.items():
        if key not in not_finite and not _RULES[rule](value_of(cfg, key)):
            errors.append(f"{at(cfg, key)}: must be {rule}")


def _check_combinations(cfg, errors: list[str]) -> None:
    predictions = {"ddpm": ("epsilon",), "rectified_flow": ("velocity", "x")}.get(cfg.diffusion.objective)
    if predictions and cfg.diffusion.prediction not in predictions:  # named: its usual target, and where 'x' goes
        hint = "; x-prediction (JiT) is rectified_flow's" if cfg.diffusion.prediction == "x" else ""
        errors.append(f"{at(cfg, 'diffusion.prediction')}: diffusion.objective {cfg.diffusion.objective!r} "
                      f"(in {cfg.source_of('diffusion.objective')}) predicts {predictions[0]!r}{hint}")  # fmt: skip
    check_flow_keys(cfg, errors)
    check_sampler(cfg, errors)
    p = cfg.profiling
    if p.enable_profiling and p.profiler_active > p.profile_freq:
        freq = f"profiling.profile_freq = {p.profile_freq} (in {cfg.source_of('profiling.profile_freq')})"
        errors.append(f"{at(cfg, 'profiling.profiler_active')}: records more steps than {freq} has between traces")
    if cfg.training.dataset in ("imagefolder", "cifar10", "latents") and not cfg.training.dataset_path:
        errors.append(f"training.dataset_path is empty in {cfg.source_of('training.dataset_path')}: "
                      f"{at(cfg, 'training.dataset')} needs one")  # fmt: skip
    # A key of the other optimizer, set away from its default, would otherwise be ignored without a word (a run's
    # resolved config.toml holds every key, at its default where unused).
    from torchtitan.components.optimizer import foreign_fields

    for name in foreign_fields(cfg.optimizer.name) if cfg.optimizer.name in _CHOICES["optimizer.name"] else ():
        key = f"optimizer.{name}"
        if getattr(cfg.optimizer, name) != getattr(type(cfg.optimizer)(), name):
            errors.append(f"{at(cfg, key)}: optimizer.name {cfg.optimizer.name!r} (in "
                          f"{cfg.source_of('optimizer.name')}) has no such setting")  # fmt: skip
    if cfg.latent.stats_file and cfg.latent.scale_factor > 0:
        errors.append(f"{keys_in(cfg, 'latent.stats_file', 'latent.scale_factor')}: two normalizations; set one")
    if cfg.latent.stats_file and not os.path.isfile(cfg.latent.stats_file):
        errors.append(f"{at(cfg, 'latent.stats_file')}: no such file (LightningDiT's latents_stats.pt)")
    if cfg.checkpoint.create_seed_checkpoint and not cfg.checkpoint.enable:
        errors.append(f"{keys_in(cfg, 'checkpoint.create_seed_checkpoint', 'checkpoint.enable')}: "
                      "a seed checkpoint needs checkpoint.enable = true")  # fmt: skip


def _check_converters(cfg, errors: list[str]) -> None:
    """model.converters names known converters (torchtitan/kernels/converters.py), each once."""
    from torchtitan.kernels.converters import CONVERTERS

    names = cfg.model.converters
    for name in dict.fromkeys(names):
        if name not in CONVERTERS:
            errors.append(f"{at(cfg, 'model.converters')}: unknown converter {name!r}; known: {list(CONVERTERS)}")
        elif names.count(name) > 1:
            errors.append(f"{at(cfg, 'model.converters')}: {name!r} is named twice")
    if cfg.model.name != "dit" and cfg.source_of("model.converters") != "the defaults":
        # The default list names the DiT's kernels: another family takes float8 only, and says so when asked for more.
        for name in dict.fromkeys(n for n in names if n in CONVERTERS and n != "float8"):
            errors.append(f"{at(cfg, 'model.converters')}: {name!r} is a DiT kernel; model.name "
                          f"{cfg.model.name!r} takes ['float8']")  # fmt: skip


def _check_dp(cfg, errors: list[str]) -> None:
    """Combinations the DP engine does not support."""
    if not cfg.dp.enable:
        return
    if "float8" in cfg.model.converters:
        errors.append(f"{keys_in(cfg, 'dp.enable', 'model.converters')}: torchao's float8 Linear computes its weight "
                      "gradient inside its float8 matmul, where no per-sample gradient or norm can be had; DP-SGD "
                      "clips per sample, so leave 'float8' out of model.converters")  # fmt: skip
    ac = cfg.activation_checkpoint
    if cfg.dp.mode in ("ghost", "flash") and ac.mode == "selective" and ac.selective_ac_option == "op":
        errors.append(f"{keys_in(cfg, 'dp.mode', 'activation_checkpoint.selective_ac_option')}: ghost clipping "
                      "backpropagates twice, and per-op selective AC keeps its saved tensors for one backward only; "
                      "use a book-keeping mode (dp.mode = 'flash_bookkeeping'), full AC, or every k-th block "
                      "(selective_ac_option = '2')")  # fmt: skip


def validate_layout(cfg, world_size: int, device_type: str) -> None:
    """The checks that need the world size and the device: data-parallel degrees, what compile and float8 need of
    them, "auto" batch sizes, the seed checkpoint. Batch divisibility runs in check_batch_sizes, once "auto" is a
    number.

    Raises:
        ConfigError: naming each bad key, its value and its source; all of them at once.
    """
    errors: list[str] = []
    p = cfg.parallelism
    replicate, shard = p.data_parallel_replicate_degree, p.data_parallel_shard_degree
    degrees = keys_in(cfg, "parallelism.data_parallel_replicate_degree", "parallelism.data_parallel_shard_degree")
    if replicate == -1 and shard == -1:
        errors.append(f"{degrees}: only one of them may be -1 (take the rest of the world)")
    elif replicate == -1 and (shard < 1 or world_size % shard):
        errors.append(f"{at(cfg, 'parallelism.data_parallel_shard_degree')}: does not divide the world size "
                      f"{world_size}")  # fmt: skip
    elif replicate < -1 or replicate == 0:
        errors.append(f"{at(cfg, 'parallelism.data_parallel_replicate_degree')}: must be >= 1, or -1 (the rest)")
    elif replicate == -1:
        pass  # replicate takes the rest of the world, which shard divides
    elif shard == -1 and world_size % replicate:
        errors.append(f"{at(cfg, 'parallelism.data_parallel_replicate_degree')}: does not divide the world size "
                      f"{world_size}")  # fmt: skip
    elif shard != -1 and replicate * shard != world_size:
        errors.append(f"{degrees}: {replicate} x {shard} != world size {world_size}")
    sharded = shard > 1 or (shard == -1 and world_size // max(replicate, 1) > 1) or p.fsdp_single_device
    if cfg.compile.enable and cfg.compile.scope == "model" and sharded:
        errors.append(f"{at(cfg, 'compile.scope')}: one device or DDP only (this run is sharded, and FSDP's hooks "
                      "must stay outside compiled code); use compile.scope = 'block'")  # fmt: skip
    if cfg.training.local_batch_size == "auto" and device_type != "cuda":
        errors.append(f"{at(cfg, 'training.local_batch_size')}: needs a CUDA device to measure memory on; give a "
                      f"number on {device_type}")  # fmt: skip
    global_batch = cfg.training.global_batch_size
    if cfg.training.local_batch_size == "auto" and global_batch != -1 and global_batch % world_size:
        errors.append(f"{at(cfg, 'training.global_batch_size')}: not divisible by the data-parallel degree "
                      f"{world_size}, so no local batch size can split it")  # fmt: skip
    if cfg.checkpoint.create_seed_checkpoint and world_size != 1:
        errors.append(f"{at(cfg, 'checkpoint.create_seed_checkpoint')}: runs on one process (no torchrun)")
    if "float8" in cfg.model.converters and not cfg.quantize.linear.float8.emulate:
        import torch

        if device_type != "cuda" or torch.cuda.get_device_capability() < (8, 9):
            errors.append(f"{at(cfg, 'model.converters')}: float8 needs an SM89+ GPU (H100, L40S, ...); set "
                          "quantize.linear.float8.emulate = true to emulate it")  # fmt: skip
    _raise(errors)


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
    steps = global_ // per_micro
    if steps > 1 and cfg.dp.enable and cfg.dp.sampling == "poisson":
        raise ConfigError(f"{at(cfg, 'dp.sampling')} draws one batch per step: no gradient accumulation "
                          f"({at(cfg, 'training.global_batch_size')} makes {steps} micro-batches)")  # fmt: skip
    return steps
