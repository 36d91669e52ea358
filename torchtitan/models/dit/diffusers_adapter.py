"""Our DiT <-> diffusers' `DiTTransformer2DModel` (a `save_pretrained` folder), with DiTPipeline's scheduler.

diffusers' DiT is not facebookresearch/DiT's (nor ours) to the bit, in two ways no weight can fix:
- its timestep features divide the frequencies by half - 1 (`Timesteps(downscale_freq_shift=1)`), where DiT and
  we divide by half; `use_reference_timestep_frequencies` sets the shift to 0 on a loaded model, which then
  computes ours;
- the LayerNorm before each MLP (`norm3`) takes the config's `norm_eps` (diffusers' default 1e-5), the other norms
  a fixed 1e-6. The export writes `norm_eps = 1e-6`, so an exported model matches; an imported 1e-5 is read as DiT's
  1e-6, with a warning.
Each diffusers block also holds its own copy of the timestep and label embedders (AdaLayerNormZero's `emb`), where
DiT and we hold one: the export copies ours into every block, the import refuses blocks whose copies differ.

Parameter mapping (ours -> diffusers; block i):
    x_embedder.proj                       -> pos_embed.proj (the sin-cos table is a buffer diffusers computes
                                             itself, equal to ours for `sample_size = input_size`)
    t_embedder.mlp.0 / .mlp.2             -> transformer_blocks.i.norm1.emb.timestep_embedder.linear_1 / linear_2
    y_embedder.embedding_table            -> transformer_blocks.i.norm1.emb.class_embedder.embedding_table
                                             (num_classes + 1 rows in both: the last is CFG's null class)
    blocks.i.adaLN_modulation.1           -> transformer_blocks.i.norm1.linear (both chunk shift_msa, scale_msa,
                                             gate_msa, shift_mlp, scale_mlp, gate_mlp: rows as they are)
    blocks.i.attn.qkv                     -> transformer_blocks.i.attn1.to_q / to_k / to_v (rows in thirds)
    blocks.i.attn.proj                    -> transformer_blocks.i.attn1.to_out.0
    blocks.i.mlp.fc1 / fc2                -> transformer_blocks.i.ff.net.0.proj / ff.net.2 (GELU, tanh)
    final_layer.adaLN_modulation.1        -> proj_out_1 (both chunk shift, scale)
    final_layer.linear                    -> proj_out_2 (p * p * out_channels rows, (p, q, c) order in both;
                                             learned sigma: out_channels = 2 * in_channels)

diffusers is not imported here: the folder is written in its format (config.json and safetensors).
"""

import json
import warnings
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from torchtitan.models.dit.model import DiT, DiTArgs

__all__ = [
    "args_from_config",
    "diffusers_config",
    "diffusers_weight_files",
    "from_diffusers",
    "load_weight_files",
    "read_diffusers_folder",
    "save_diffusers_folder",
    "scheduler_config",
    "to_diffusers",
    "use_reference_timestep_frequencies",
]

DIFFUSERS_VERSION = "0.42.1"  # written as `_diffusers_version`: the release this mapping was checked against
WEIGHTS_NAME = "diffusion_pytorch_model.safetensors"
DIT_NORM_EPS = 1e-6  # diffusers' AdaLayerNormZero and norm_out: fixed at DiT's 1e-6
# The embedders every diffusers block holds a copy of, as (ours, diffusers' suffix under norm1.emb.).
_EMBEDDERS = (
    ("t_embedder.mlp.0.weight", "timestep_embedder.linear_1.weight"),
    ("t_embedder.mlp.0.bias", "timestep_embedder.linear_1.bias"),
    ("t_embedder.mlp.2.weight", "timestep_embedder.linear_2.weight"),
    ("t_embedder.mlp.2.bias", "timestep_embedder.linear_2.bias"),
    ("y_embedder.embedding_table.weight", "class_embedder.embedding_table.weight"),
)
# One-to-one renames: (ours, diffusers'), "{i}" for the block index.
_RENAMES = (
    ("x_embedder.proj", "pos_embed.proj"),
    ("blocks.{i}.adaLN_modulation.1", "transformer_blocks.{i}.norm1.linear"),
    ("blocks.{i}.attn.proj", "transformer_blocks.{i}.attn1.to_out.0"),
    ("blocks.{i}.mlp.fc1", "transformer_blocks.{i}.ff.net.0.proj"),
    ("blocks.{i}.mlp.fc2", "transformer_blocks.{i}.ff.net.2"),
    ("final_layer.adaLN_modulation.1", "proj_out_1"),
    ("final_layer.linear", "proj_out_2"),
)
_QKV = ("to_q", "to_k", "to_v")


def _unsupported(args: DiTArgs) -> list[str]:
    """The DiTArgs fields (as `field=value (why)`) that diffusers' DiTTransformer2DModel cannot express."""
    problems = []
    if args.pos_embed != "sincos":
        problems.append(f"pos_embed={args.pos_embed!r} (diffusers' DiT adds only the fixed 2D sin-cos table)")
    if args.norm != "layernorm":
        problems.append(f"norm={args.norm!r} (diffusers' DiT normalizes with LayerNorm)")
    if args.mlp != "gelu":
        problems.append(f"mlp={args.mlp!r} (diffusers' DiT has a GELU MLP)")
    if args.qk_norm:
        problems.append("qk_norm=True (diffusers' DiT has no query/key norm)")
    if args.attn_window:
        problems.append(f"attn_window={args.attn_window} (diffusers' DiT attends globally)")
    if args.num_classes <= 0:
        problems.append(f"num_classes={args.num_classes} (diffusers' DiT is class-conditional)")
    if int(args.dim * args.mlp_ratio) != 4 * args.dim:
        problems.append(f"mlp_ratio={args.mlp_ratio} (diffusers' DiT MLP is 4 x dim wide)")
    if args.norm_eps != DIT_NORM_EPS:
        problems.append(f"norm_eps={args.norm_eps} (diffusers' DiT fixes its adaLN norms' eps at {DIT_NORM_EPS})")
    return problems


def diffusers_config(args: DiTArgs) -> dict:
    """DiTTransformer2DModel's config for `args`.

    Raises:
        ValueError: naming every DiTArgs field (and its value) that diffusers' DiT cannot express.
    """
    args.validate()
    problems = _unsupported(args)
    if problems:
        raise ValueError("cannot export to diffusers' DiTTransformer2DModel: " + "; ".join(problems))
    return {
        "_class_name": "DiTTransformer2DModel",
        "_diffusers_version": DIFFUSERS_VERSION,
        "num_attention_heads": args.num_heads,
        "attention_head_dim": args.head_dim,
        "in_channels": args.in_channels,
        "out_channels": args.out_channels,
        "num_layers": args.depth,
        "dropout": 0.0,
        "norm_num_groups": 32,  # unused by DiTTransformer2DModel
        "attention_bias": True,
        "sample_size": args.input_size,
        "patch_size": args.patch_size,
        "activation_fn": "gelu-approximate",
        "num_embeds_ada_norm": args.num_classes,
        "upcast_attention": False,
        "norm_type": "ada_norm_zero",
        "norm_elementwise_affine": False,
        "norm_eps": args.norm_eps,  # norm3 before each MLP; diffusers' default 1e-5 would differ from ours
    }


def _check_keys(have, expected: set[str], what: str) -> None:
    missing, unexpected = sorted(expected - set(have)), sorted(set(have) - expected)
    if missing or unexpected:
        raise KeyError(f"{what}: missing {missing[:8]}{' ...' if len(missing) > 8 else ''}, "
                       f"unexpected {unexpected[:8]}{' ...' if len(unexpected) > 8 else ''}")  # fmt: skip


def _check_shapes(state_dict: dict[str, torch.Tensor], args: DiTArgs, what: str) -> None:
    """Every tensor has its shape in DiT(args) (built on the meta device: no memory)."""
    with torch.device("meta"):
        reference = DiT(args).state_dict()
    for key, value in state_dict.items():
        if tuple(value.shape) != tuple(reference[key].shape):
            raise ValueError(f"{what}: {key} has shape {tuple(value.shape)}, DiT(args) {tuple(reference[key].shape)}")


def _our_keys(args: DiTArgs) -> set[str]:
    keys = {ours for ours, _ in _EMBEDDERS}
    keys |= {"blocks.{i}.attn.qkv.weight", "blocks.{i}.attn.qkv.bias"}
    for ours, _ in _RENAMES:
        keys |= {f"{ours}.weight", f"{ours}.bias"}
    return {key.format(i=i) for key in keys for i in range(args.depth)}


def _diffusers_keys(args: DiTArgs) -> set[str]:
    keys = {f"transformer_blocks.{{i}}.norm1.emb.{theirs}" for _, theirs in _EMBEDDERS}
    keys |= {f"transformer_blocks.{{i}}.attn1.{name}.{suffix}" for name in _QKV for suffix in ("weight", "bias")}
    for _, theirs in _RENAMES:
        keys |= {f"{theirs}.weight", f"{theirs}.bias"}
    return {key.format(i=i) for key in keys for i in range(args.depth)}


def to_diffusers(state_dict: dict[str, torch.Tensor], args: DiTArgs) -> tuple[dict[str, torch.Tensor], dict]:
    """Our DiT state dict (our names: pass the EMA weights to export those) -> diffusers' state dict and config.

    Every block gets its own copy of the shared timestep and label embedders (diffusers' AdaLayerNormZero holds
    one each); dtypes are kept.

    Raises:
        ValueError: a DiTArgs field diffusers' DiT cannot express, named with its value; a tensor whose shape is
            not DiT(args)'s, named.
        KeyError: the state dict's keys are not those of DiT(args), naming the missing and unexpected.
    """
    config = diffusers_config(args)
    _check_keys(state_dict, _our_keys(args), "state dict of DiT(args)")
    _check_shapes(state_dict, args, "state dict of DiT(args)")
    D = args.dim
    out = {}
    for i in range(args.depth):
        for ours, theirs in _EMBEDDERS:
            # A copy per block: safetensors refuses tensors that share memory.
            out[f"transformer_blocks.{i}.norm1.emb.{theirs}"] = state_dict[ours].clone()
        for suffix in ("weight", "bias"):
            qkv = state_dict[f"blocks.{i}.attn.qkv.{suffix}"]  # rows (3 D): q, k, v, each heads-major, as ours views
            for name, part in zip(_QKV, qkv.split(D, dim=0)):
                out[f"transformer_blocks.{i}.attn1.{name}.{suffix}"] = part.clone()
    for ours, theirs in _RENAMES:
        for i in range(args.depth) if "{i}" in ours else (0,):
            for suffix in ("weight", "bias"):
                out[f"{theirs.format(i=i)}.{suffix}"] = state_dict[f"{ours.format(i=i)}.{suffix}"]
    return out, config


def args_from_config(config: dict) -> DiTArgs:
    """DiTArgs of a DiTTransformer2DModel config (defaults as diffusers' for keys it leaves out).

    Raises:
        ValueError: a config value our DiT cannot express, named with its value.
    """
    get = config.get
    problems = []
    for key, default, want in (
        ("norm_type", "ada_norm_zero", "ada_norm_zero"),
        ("activation_fn", "gelu-approximate", "gelu-approximate"),
        ("attention_bias", True, True),
        ("norm_elementwise_affine", False, False),
    ):
        if get(key, default) != want:
            problems.append(f"{key}={get(key, default)!r} (ours is {want!r})")
    in_channels = get("in_channels", 4)
    out_channels = get("out_channels", None) or in_channels
    if out_channels not in (in_channels, 2 * in_channels):
        problems.append(f"out_channels={out_channels} (ours is in_channels or, with learned sigma, twice it)")
    num_classes = get("num_embeds_ada_norm", 1000)
    if not num_classes or num_classes <= 0:
        problems.append(f"num_embeds_ada_norm={num_classes} (ours needs the class count)")
    if problems:
        raise ValueError("cannot read diffusers' DiTTransformer2DModel config: " + "; ".join(problems))
    norm_eps = get("norm_eps", 1e-5)
    if norm_eps != DIT_NORM_EPS:
        warnings.warn(
            f"diffusers config norm_eps={norm_eps} applies only to the LayerNorm before each MLP (its other norms "
            f"use {DIT_NORM_EPS}); read as DiT's {DIT_NORM_EPS} throughout",
            stacklevel=3,
        )
    heads = get("num_attention_heads", 16)
    args = DiTArgs(
        input_size=get("sample_size", 32),
        in_channels=in_channels,
        patch_size=get("patch_size", 2),
        dim=heads * get("attention_head_dim", 72),
        depth=get("num_layers", 28),
        num_heads=heads,
        mlp_ratio=4.0,
        num_classes=num_classes,
        learn_sigma=out_channels == 2 * in_channels,
        pos_embed="sincos",
        norm="layernorm",
        mlp="gelu",
        qk_norm=False,
        attn_window=0,
        norm_eps=DIT_NORM_EPS,
    )
    args.validate()
    return args


def from_diffusers(diffusers_state_dict: dict[str, torch.Tensor], config: dict) -> tuple[dict, DiTArgs]:
    """diffusers' DiTTransformer2DModel state dict and config -> our DiT state dict and DiTArgs.

    Raises:
        ValueError: a config value we cannot express; a block whose embedder copy differs from block 0's
            (naming the block and the key); a tensor whose shape is not the config's, named.
        KeyError: the state dict's keys are not those of the config's model.
    """
    args = args_from_config(config)
    _check_keys(diffusers_state_dict, _diffusers_keys(args), "diffusers DiTTransformer2DModel state dict")
    sd = diffusers_state_dict
    out = {}
    for ours, theirs in _EMBEDDERS:
        first = sd[f"transformer_blocks.0.norm1.emb.{theirs}"]
        for i in range(1, args.depth):
            key = f"transformer_blocks.{i}.norm1.emb.{theirs}"
            if sd[key].shape != first.shape or not torch.equal(sd[key], first):
                raise ValueError(f"block {i} of the diffusers DiT holds its own embedder: {key} differs from "
                                 f"block 0's; our DiT shares one timestep and one label embedder")  # fmt: skip
        out[ours] = first
    for i in range(args.depth):
        for suffix in ("weight", "bias"):
            parts = [sd[f"transformer_blocks.{i}.attn1.{name}.{suffix}"] for name in _QKV]
            out[f"blocks.{i}.attn.qkv.{suffix}"] = torch.cat(parts, dim=0)
    for ours, theirs in _RENAMES:
        for i in range(args.depth) if "{i}" in ours else (0,):
            for suffix in ("weight", "bias"):
                out[f"{ours.format(i=i)}.{suffix}"] = sd[f"{theirs.format(i=i)}.{suffix}"]
    _check_shapes(out, args, "diffusers DiTTransformer2DModel state dict, in our names,")
    return out, args


def scheduler_config(scheduler: str = "ddpm", objective: str = "ddpm", noise_schedule: str = "linear",
                     num_timesteps: int = 1000) -> dict:  # fmt: skip
    """DiTPipeline's scheduler config with the betas of our DDPM objective (torchtitan/diffusion/ddpm.py).

    Args:
        scheduler: "ddpm" (DDPMScheduler: ancestral, on our DDIM sampler's timesteps) or "ddim" (DDIMScheduler:
            eta 0, as our sampler, on diffusers' evenly strided "trailing" timesteps, which are ours only for
            1 and T steps).
        objective, noise_schedule, num_timesteps: the run's `[diffusion]` keys.

    The variance is "fixed_small" (DDPM's posterior variance) even for a learned sigma: DiTPipeline hands the
    scheduler the epsilon channels only, and a "learned_range" scheduler needs the others.

    Raises:
        ValueError: an objective, schedule or scheduler with no diffusers equivalent here, named.
    """
    if objective != "ddpm":
        raise ValueError(f"objective={objective!r}: DiTPipeline's schedulers predict epsilon (a DDPM objective)")
    if noise_schedule == "linear":
        scale = 1000 / num_timesteps  # as _betas: the endpoints scale with the step count
        betas = {"beta_schedule": "linear", "beta_start": scale * 1e-4, "beta_end": scale * 0.02}
    elif noise_schedule == "cosine":  # iDDPM's cosine, betas capped at 0.999: diffusers' squaredcos_cap_v2
        betas = {"beta_schedule": "squaredcos_cap_v2", "beta_start": 1e-4, "beta_end": 0.02}
    else:
        raise ValueError(f"noise_schedule={noise_schedule!r} has no diffusers beta_schedule here")
    common = {
        "_diffusers_version": DIFFUSERS_VERSION,
        "num_train_timesteps": num_timesteps,
        **betas,
        "trained_betas": None,
        "clip_sample": False,  # our samplers do not clip by default
        "prediction_type": "epsilon",
        "steps_offset": 0,
    }
    if scheduler == "ddpm":
        # DDPMScheduler steps along its own timesteps, so "linspace" gives our sampler's: round(linspace(T - 1, 0, n)).
        return {
            "_class_name": "DDPMScheduler",
            **common,
            "variance_type": "fixed_small",
            "timestep_spacing": "linspace",
        }
    if scheduler == "ddim":
        # DDIMScheduler steps t -> t - T // n whatever its timesteps, so only "trailing" (T - 1, T - 1 - T / n, ...)
        # is consistent; it starts at T - 1 as ours does, and ends at alpha_bar 1 as ours does.
        return {"_class_name": "DDIMScheduler", **common, "timestep_spacing": "trailing", "set_alpha_to_one": True}
    raise ValueError(f"scheduler={scheduler!r}: 'ddpm' or 'ddim'")


def save_diffusers_folder(
    state_dict: dict[str, torch.Tensor],
    args: DiTArgs,
    folder,
    scheduler: str = "ddpm",
    objective: str = "ddpm",
    noise_schedule: str = "linear",
    num_timesteps: int = 1000,
) -> Path:
    """Writes a DiTPipeline-style folder: transformer/ (config.json, diffusion_pytorch_model.safetensors),
    scheduler/scheduler_config.json and model_index.json.

    The folder has no VAE: pass one to `DiTPipeline.from_pretrained(folder, vae=...)`. Pass the EMA weights in
    our names to export those (as DiT's released checkpoints are). Everything is checked before anything is
    written.

    Returns:
        The folder.
    """
    weights, config = to_diffusers(state_dict, args)
    schedule = scheduler_config(scheduler, objective, noise_schedule, num_timesteps)
    folder = Path(folder)
    (folder / "transformer").mkdir(parents=True, exist_ok=True)
    (folder / "scheduler").mkdir(parents=True, exist_ok=True)
    weights = {key: value.detach().cpu().contiguous() for key, value in weights.items()}
    save_file(weights, str(folder / "transformer" / WEIGHTS_NAME), metadata={"format": "pt"})
    _write_json(folder / "transformer" / "config.json", config)
    _write_json(folder / "scheduler" / "scheduler_config.json", schedule)
    index = {
        "_class_name": "DiTPipeline",
        "_diffusers_version": DIFFUSERS_VERSION,
        "transformer": ["diffusers", "DiTTransformer2DModel"],
        "scheduler": ["diffusers", schedule["_class_name"]],
        "vae": ["diffusers", "AutoencoderKL"],
    }
    _write_json(folder / "model_index.json", index)
    return folder


def _write_json(path: Path, value: dict) -> None:
    path.write_text(json.dumps(value, indent=2, sort_keys=True) + "\n")


def read_diffusers_folder(folder) -> tuple[dict[str, torch.Tensor], DiTArgs]:
    """Our DiT state dict and DiTArgs from a DiTTransformer2DModel folder: a pipeline folder (its transformer/) or
    the model's own; one safetensors file, a sharded one (its .index.json), or a legacy .bin."""
    folder = Path(folder)
    if (folder / "transformer" / "config.json").exists():
        folder = folder / "transformer"
    config = json.loads((folder / "config.json").read_text())
    if config.get("_class_name", "DiTTransformer2DModel") not in ("DiTTransformer2DModel", "Transformer2DModel"):
        raise ValueError(f"{folder / 'config.json'}: _class_name={config['_class_name']!r}, not a DiT")
    files = diffusers_weight_files(folder)
    if not files:
        raise FileNotFoundError(f"{folder}: no {WEIGHTS_NAME} (nor its index, nor a .bin)")
    return from_diffusers(load_weight_files(files), config)


def diffusers_weight_files(folder) -> list[Path]:
    """The weight files `from_pretrained` reads from a diffusers model folder (no variant): its safetensors file,
    the shards its .index.json lists, or a legacy .bin; [] when there are none."""
    folder = Path(folder)
    index = folder / f"{WEIGHTS_NAME}.index.json"
    if (folder / WEIGHTS_NAME).exists():
        return [folder / WEIGHTS_NAME]
    if index.exists():
        return [folder / shard for shard in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
    legacy = folder / "diffusion_pytorch_model.bin"
    return [legacy] if legacy.exists() else []


def load_weight_files(files: list[Path]) -> dict[str, torch.Tensor]:
    """One state dict from `diffusers_weight_files` (a .bin through torch.load's weights_only: it runs no code)."""
    state_dict = {}
    for path in files:
        if path.suffix == ".bin":
            state_dict.update(torch.load(path, map_location="cpu", weights_only=True))
        else:
            state_dict.update(load_file(str(path)))
    return state_dict


# The DiTArgs a diffusers DiT determines: a model that starts from its weights must have the same.
_DETERMINED_FIELDS = ("input_size", "in_channels", "patch_size", "dim", "depth", "num_heads", "mlp_ratio",
                      "num_classes", "learn_sigma", "pos_embed", "norm", "mlp", "qk_norm", "attn_window")  # fmt: skip


def read_diffusers_weights(folder, args: DiTArgs) -> dict[str, torch.Tensor]:
    """`checkpoint.initial_load_format = "diffusers"`: the folder's weights in our names, for a model of `args`.

    Raises:
        ValueError: the folder's DiT differs from the model in a field (each named, with both values), or is no DiT.
        FileNotFoundError: the folder has no weights.
    """
    state_dict, theirs = read_diffusers_folder(folder)
    differ = [f"model.{name} = {getattr(args, name)!r} (the folder's: {getattr(theirs, name)!r})"
              for name in _DETERMINED_FIELDS if getattr(args, name) != getattr(theirs, name)]  # fmt: skip
    if differ:
        raise ValueError(f"{folder}: its DiT is not this model: {'; '.join(differ)}; set model.flavor and the "
                         "model overrides to the folder's")  # fmt: skip
    return state_dict


def use_reference_timestep_frequencies(transformer) -> int:
    """Sets `downscale_freq_shift = 0` on a loaded DiTTransformer2DModel's timestep projections, so it computes
    DiT's (and our) frequencies, exp(-ln(10^4) k / half), instead of diffusers' k / (half - 1).

    Returns:
        How many Timesteps modules were changed (one per block).
    """
    changed = 0
    for module in transformer.modules():
        if type(module).__name__ == "Timesteps" and hasattr(module, "downscale_freq_shift"):
            module.downscale_freq_shift = 0
            changed += 1
    return changed
