"""DiT flavors (keys are the paper's names) and their TrainSpec (TRAIN_SPEC, listed in torchtitan/models)."""

from dataclasses import replace
from pathlib import Path

from torchtitan.models.dit.diffusers_adapter import read_diffusers_weights
from torchtitan.models.dit.lightningdit_adapter import read_lightningdit_pt
from torchtitan.models.dit.model import DiT, DiTArgs, flops_per_image
from torchtitan.models.dit.parallelize import parallelize_dit
from torchtitan.models.dit.repa_adapter import read_repa_pt
from torchtitan.models.dit.state_dict_adapter import read_dit_pt
from torchtitan.protocols import TrainSpec

__all__ = ["DiT", "DiTArgs", "dit_configs", "flops_per_image", "parallelize_dit"]

# Widths and depths from the DiT paper (Table 1); latent 32x32x4 inputs, 1000 classes, learned sigma.
_paper_sizes = {"S": (384, 12, 6), "B": (768, 12, 12), "L": (1024, 24, 16), "XL": (1152, 28, 16)}

dit_configs: dict[str, DiTArgs] = {
    # Tiny and CPU-friendly: the embedded 16x16 digits, 10 classes.
    "debug": DiTArgs(
        input_size=16, in_channels=1, patch_size=2, dim=128, depth=4, num_heads=4, num_classes=10, learn_sigma=False
    ),
}
for _size, (_dim, _depth, _heads) in _paper_sizes.items():
    for _patch in (2, 4, 8):
        dit_configs[f"DiT-{_size}/{_patch}"] = DiTArgs(dim=_dim, depth=_depth, num_heads=_heads, patch_size=_patch)

# Llama-style widths (RMSNorm + SwiGLU, QK-norm) on 64x64x16 latents with patch 2: 1024 tokens.
_llama_style = dict(
    input_size=64, in_channels=16, patch_size=2, norm="rmsnorm", mlp="swiglu", qk_norm=True, learn_sigma=False
)
# SiT as REPA (sihyun-yu/REPA, models/sit.py) trains it: DiT's sizes predicting the velocity (no learned sigma) and
# fixed sin-cos positions; its time in [0, 1] (t = 0 the data) is diffusion.time_input = "t".
for _size, (_dim, _depth, _heads) in _paper_sizes.items():
    for _patch in (2, 4, 8):
        dit_configs[f"SiT-{_size}/{_patch}"] = DiTArgs(dim=_dim, depth=_depth, num_heads=_heads, patch_size=_patch,
                                                      learn_sigma=False, pos_embed="sincos")  # fmt: skip

dit_configs["0.5B"] = DiTArgs(dim=1280, depth=16, num_heads=20, **_llama_style)
dit_configs["7B"] = DiTArgs(dim=4096, depth=24, num_heads=32, **_llama_style)

# LightningDiT (hustvl/LightningDiT, its models/lightningdit.py sizes) as its recipe trains them: VA-VAE latents
# 16x16x32, RMSNorm, SwiGLU of hidden size int(2/3 * 4 * dim) (multiple_of 1: unrounded), the fixed sin-cos table
# plus 2D RoPE, no QK-norm, no learned sigma. Their RMSNorm weights are folded into adaLN when their weights are read
# (lightningdit_adapter.py); ours carry none.
_lightningdit_sizes = {"B": (768, 12, 12), "L": (1024, 24, 16), "XL": (1152, 28, 16), "1p0B": (1536, 24, 24),
                       "1p6B": (1792, 28, 28)}  # fmt: skip
_lightningdit_style = dict(input_size=16, in_channels=32, pos_embed="sincos_rope2d", norm="rmsnorm", mlp="swiglu",
                           qk_norm=False, learn_sigma=False, multiple_of=1)  # fmt: skip
for _size, _patch in (("B", 1), ("B", 2), ("L", 2), ("XL", 1), ("XL", 2), ("1p0B", 1), ("1p0B", 2), ("1p6B", 1),
                      ("1p6B", 2)):  # fmt: skip
    _dim, _depth, _heads = _lightningdit_sizes[_size]
    dit_configs[f"LightningDiT-{_size}/{_patch}"] = DiTArgs(dim=_dim, depth=_depth, num_heads=_heads, patch_size=_patch,
                                                            **_lightningdit_style)  # fmt: skip


def get_flavor(flavor: str) -> DiTArgs:
    """A fresh copy of a flavor's args, so overrides never leak into the registry."""
    return replace(dit_configs[flavor])


def build_dit_args(args: DiTArgs, job_config) -> DiTArgs:
    """The flavor's args with the `[model]` overrides applied (0, -1 and None keep the flavor's value)."""
    model_config = job_config.model
    for name in ("input_size", "in_channels", "patch_size"):
        if getattr(model_config, name) > 0:
            setattr(args, name, getattr(model_config, name))
    if model_config.num_classes >= 0:
        args.num_classes = model_config.num_classes
    if model_config.attn_window >= 0:
        args.attn_window = model_config.attn_window
    for name in ("pos_embed", "norm", "mlp", "qk_norm", "learn_sigma"):
        if getattr(model_config, name) is not None:  # False overrides a flavor's True
            setattr(args, name, getattr(model_config, name))
    if job_config.alignment.enable:
        _add_alignment(args, job_config)
    args.validate()
    return args


def _add_alignment(args: DiTArgs, job_config) -> None:
    """The projectors of `[alignment]`: their depth and width, and the encoder's feature width read from its file.

    Raises:
        ConfigError: naming alignment.depth or alignment.encoder_path.
    """
    from torchtitan.alignment import encoder_architecture
    from torchtitan.errors import ConfigError, at

    align = job_config.alignment
    if not 1 <= align.depth <= args.depth:
        raise ConfigError(f"{at(job_config, 'alignment.depth')}: the model has blocks 1..{args.depth}")
    if not align.encoder_path:
        raise ConfigError(f"{at(job_config, 'alignment.encoder_path')}: alignment.enable needs the encoder's local "
                          "weights (the official DINOv2 .pth or a Hugging Face Dinov2Model folder)")  # fmt: skip
    try:
        encoder = encoder_architecture(align, args.input_size // args.patch_size)
    except (FileNotFoundError, ValueError) as e:
        raise ConfigError(f"{at(job_config, 'alignment.encoder_path')}: {e}") from e
    args.align_depth, args.align_dims, args.align_projector_dim = align.depth, (encoder.dim,), align.projector_dim
    reads_stored_features(job_config, args)  # stored features of another encoder or grid are refused with the config


def reads_stored_features(job_config, args: DiTArgs) -> bool:
    """Whether an aligning run reads the encoder's features stored with its latents (prepare.py --store-features)
    instead of running the encoder: alignment.features 'stored', or 'auto' on a prepared folder that holds them.

    Raises:
        ConfigError: the folder's features are another encoder's (alignment.encoder_path) or of another token grid
            (model.patch_size), or 'stored' finds none (alignment.features); naming the key and the meta.json.
    """
    from torchtitan.alignment.features import features_mismatch
    from torchtitan.datasets.latents import META_FILE, read_meta
    from torchtitan.errors import ConfigError, at

    align, training = job_config.alignment, job_config.training
    if not args.align_depth or align.features == "encoder":
        return False
    meta_file = Path(training.dataset_path) / META_FILE
    if training.dataset != "latents" or not meta_file.is_file():
        return align.features == "stored"  # dummy data makes random ones; a missing folder is the dataset's to name
    try:
        meta = read_meta(meta_file.parent)
    except ValueError as e:
        raise ConfigError(f"{at(job_config, 'training.dataset_path')}: {e}") from e
    if "features" not in meta:
        if align.features == "stored":
            raise ConfigError(f"{at(job_config, 'alignment.features')}: {meta_file} records no encoder features: "
                              f"prepare the latents with --store-features {align.encoder_path}")  # fmt: skip
        return False
    mismatch = features_mismatch(meta["features"], align.encoder_path, args.input_size // args.patch_size)
    if mismatch is not None:
        key, why = mismatch
        instead = "; or set alignment.features = 'encoder' to encode its stored images" if meta.get("images") else ""
        raise ConfigError(f"{at(job_config, key)}: {meta_file} holds encoder features this run cannot align to: "
                          f"{why}. Prepare the latents again with --store-features {align.encoder_path} "
                          f"--features-patch-size {args.patch_size}{instead}")  # fmt: skip
    return True


def dit_flops_per_sample(args: DiTArgs, job_config) -> float:
    """Training FLOPs of one image: the DiT's (its projectors included), and the frozen encoder's forward."""
    flops = flops_per_image(args)
    if args.align_depth and job_config.alignment.enable and not reads_stored_features(job_config, args):
        from torchtitan.alignment import encoder_architecture

        flops += encoder_architecture(job_config.alignment, args.input_size // args.patch_size).forward_flops()
    return flops


def sampling_export(args: DiTArgs, names: list[str]) -> tuple[DiTArgs, list[str]]:
    """What an export that only samples keeps of a DiT: its args and parameter names without the alignment
    projectors (they only train)."""
    return args.for_sampling(), [name for name in names if not name.startswith("projectors.")]


def _build_objective(job_config, model_args: DiTArgs, layout):
    from torchtitan.diffusion.objective import DiffusionObjective

    alignment = None
    if model_args.align_depth:
        from torchtitan.alignment import build_alignment

        alignment = build_alignment(
            job_config, model_args, layout.device, reads_stored_features(job_config, model_args)
        )
    return DiffusionObjective(job_config.diffusion, model_args, layout, alignment)


def _build_dataloader(job_config, model_args: DiTArgs, dp_rank: int, dp_world: int, poisson_steps: int, split: str):
    from torchtitan.datasets import build_dataloader

    # The fixed-timestep loss reads its held-out data itself (torchtitan/components/validation_loss.py).
    assert split == "train", "a DiT's held-out data is build_held_out_dataset's"
    # An aligning latent model's encoder needs the images its latents encode (a pixel model's inputs are them), or
    # its features of them, stored.
    features = None
    if reads_stored_features(job_config, model_args):
        features = ((model_args.input_size // model_args.patch_size) ** 2, model_args.align_dims[0])  # (T, D)
    images = bool(model_args.align_depth) and model_args.in_channels not in (1, 3) and features is None
    v = job_config.validation
    hold_out = v.enable and v.loss_num_samples > 0
    return build_dataloader(job_config.training, model_args, dp_rank, dp_world, job_config.debug.seed, poisson_steps,
                            job_config.latent, images, features, hold_out)  # fmt: skip


TRAIN_SPEC = TrainSpec(
    name="dit",
    model_cls=DiT,
    model_args=dit_configs,
    build_model_args_fn=build_dit_args,
    parallelize_fn=parallelize_dit,
    build_objective_fn=_build_objective,
    build_dataloader_fn=_build_dataloader,
    flops_per_sample_fn=dit_flops_per_sample,
    datasets=("digits", "dummy", "imagefolder", "cifar10", "latents"),
    measure_overrides=("--training.dataset", "dummy", "--sampling.freq", "0"),  # no data to read, no grids
    # facebookresearch/DiT .pt files; REPA's SiT (+ projectors) .pt files; diffusers DiTTransformer2DModel folders;
    # hustvl/LightningDiT .pt files
    weight_readers={
        "dit_pt": read_dit_pt,
        "repa_pt": read_repa_pt,
        "diffusers": read_diffusers_weights,
        "lightningdit_pt": read_lightningdit_pt,
    },
    arg_keys={
        "align_depth": "alignment.depth",
        "align_dims": "alignment.encoder_path",
        "align_projector_dim": "alignment.projector_dim",
    },
    sampling_export_fn=sampling_export,
)
