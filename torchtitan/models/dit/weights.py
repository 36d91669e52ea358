"""DiT weights into a plain model, from wherever they are: a run folder, a DCP step folder, a `.safetensors` export,
a facebookresearch/DiT `.pt` (a recognizable SiT file is refused: state_dict_adapter.py), a REPA `.pt`
(repa_adapter.py) or a LightningDiT `.pt` (lightningdit_adapter.py); each adapter tells its own files apart. The
model is built without the alignment projectors, which only train. Used by `sample.py` and
`scripts/convert_dit.py`.

`resolve_checkpoint` finds the config and the weights: a run folder gives its `config.toml` and the weights of
`ema.safetensors` when the run exported them, else the newest complete DCP checkpoint under its checkpoint folder; a
step folder or an export gives the config.toml of its run (up to three folders above); a `.pt` file has none, so a
flavor names its shapes (state_dict_adapter.py reads it). `load_model` builds the model on the meta device and loads
them: a DCP checkpoint's EMA entries when it has them, else the live model's, read through the checkpoint allow-list
(torchtitan/components/checkpoint_reader.py) without a process group. A diffusers folder has its own reader
(diffusers_adapter.py), which needs no config.

Error messages name sample.py's flags (`--checkpoint`, `--config`, `--flavor`): the CLIs print them as their one
`error:` line.
"""

import tomllib
import warnings
from pathlib import Path

import torch

from torchtitan.config_manager import JobConfig, parse_args
from torchtitan.tools.logging import logger
from torchtitan.train_spec import build_model_args, get_train_spec

# Sampling needs no encoder: the model is built without the alignment projectors, which only train.
SAMPLING_ONLY = ["--alignment.enable", "false"]

__all__ = ["check_is_dit_run", "dit_pt_config", "find_config", "load_dcp_weights", "load_model", "resolve_checkpoint"]


def find_config(start: Path) -> Path:
    """The run's config.toml: in `start` or up to three folders above it (a step folder's run)."""
    for folder in [start, *list(start.parents)[:3]]:
        if (folder / "config.toml").is_file():
            return folder / "config.toml"
    raise FileNotFoundError(f"--checkpoint: no config.toml in {start} or the folders above it; pass --config")


def check_is_dit_run(config_file: Path) -> None:
    """Raises ValueError unless the run's model is a DiT: images come from DiTs (read before the config is checked,
    whose complaints about another model's keys would point elsewhere)."""
    with open(config_file, "rb") as f:
        name = tomllib.load(f).get("model", {}).get("name", "dit")
    if name != "dit":
        raise ValueError(f"{config_file} is a {name!r} run (model.name): sample.py samples images from DiT runs "
                         "(model.name = 'dit')")  # fmt: skip


def dit_pt_config(flavor: str, config: str, overrides: list[str], path: Path | None = None) -> JobConfig:
    """The config of a `.pt` file: a DiT of `flavor`, then the `--config` TOML and the `--section.key value`
    overrides. A facebookresearch/DiT file brings its fixed sin-cos positions; a REPA file (`path` tells) its SiT's
    flow (repa_adapter.py) and a LightningDiT file its transport's (lightningdit_adapter.py), its flavor the rest."""
    if not flavor and not any(arg.partition("=")[0] == "--model.flavor" for arg in overrides):
        raise ValueError("--flavor: a .pt checkpoint has no run config; name its shapes' flavor, e.g. DiT-XL/2, "
                         "SiT-XL/2 (REPA's) or LightningDiT-XL/1")  # fmt: skip
    from torchtitan.models.dit.lightningdit_adapter import LIGHTNINGDIT_CONFIG_FLAGS, is_lightningdit_pt
    from torchtitan.models.dit.repa_adapter import REPA_CONFIG_FLAGS, is_repa_pt

    implied = ["--model.pos_embed", "sincos"]
    if path and is_lightningdit_pt(path):
        implied = list(LIGHTNINGDIT_CONFIG_FLAGS)
    elif path and is_repa_pt(path):
        implied = list(REPA_CONFIG_FLAGS)
    argv = ["--job.config_file", config] if config else []
    argv += ["--model.name", "dit", *implied] + (["--model.flavor", flavor] if flavor else [])
    return parse_args(argv + overrides + SAMPLING_ONLY)


def resolve_checkpoint(path: Path, config: str = "", flavor: str = "",
                       overrides: list[str] | None = None) -> tuple[JobConfig, Path]:  # fmt: skip
    """(the run's config, the weights: a .safetensors file, a DCP step folder or a facebookresearch/DiT or LightningDiT
    .pt)."""
    if not path.exists():
        raise FileNotFoundError(f"--checkpoint: {path} does not exist")
    if path.suffix == ".pt":
        return dit_pt_config(flavor, config, overrides or [], path), path
    if flavor or overrides:
        raise ValueError(f"--flavor and --section.key overrides are for .pt checkpoints: {path} is a run's, whose "
                         "config.toml gives the model")  # fmt: skip
    config_file = Path(config) if config else find_config(path if path.is_dir() else path.parent)
    check_is_dit_run(config_file)
    cfg = parse_args(["--job.config_file", str(config_file), *SAMPLING_ONLY])
    if path.is_file() or (path / ".metadata").is_file():
        return cfg, path
    if (path / "ema.safetensors").is_file():
        return cfg, path / "ema.safetensors"
    from torchtitan.components.checkpoint_reader import complete_checkpoints

    found = complete_checkpoints(path / cfg.checkpoint.folder)
    if not found:
        raise FileNotFoundError(f"--checkpoint: {path} has neither ema.safetensors nor a complete checkpoint "
                                f"in {path / cfg.checkpoint.folder}")  # fmt: skip
    return cfg, found[0][1]


def load_dcp_weights(model: torch.nn.Module, step_dir: Path) -> str:
    """Loads the 'ema' entries of a DCP checkpoint (else 'model') into a plain model; returns which. The checkpoint
    is read through an allow-list (torchtitan/components/checkpoint_reader.py): a crafted one is refused by name."""
    from torchtitan.components.checkpoint_reader import load_checkpoint, read_checkpoint_metadata

    keys = read_checkpoint_metadata(step_dir).state_dict_metadata
    prefix = "ema" if any(k.startswith("ema.") and k != "ema.num_updates" for k in keys) else "model"
    params = {name: p.detach() for name, p in model.named_parameters()}  # DCP fills these in place
    if prefix == "model":
        params = dict(model.state_dict())
    missing = [name for name in params if f"{prefix}.{name}" not in keys]
    if missing:
        raise ValueError(f"checkpoint {step_dir} has no '{prefix}' entries for {missing[:5]}: not this model's")
    state = {prefix: params}
    with warnings.catch_warnings():
        # Without a process group DCP reads every shard in this one process, as intended here.
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        load_checkpoint(state, step_dir)
    return prefix


def load_model(cfg: JobConfig, weights: Path, device: torch.device):
    """A plain model (eval mode) with the weights of `weights`; also returns its args."""
    spec = get_train_spec(cfg.model.name)
    model_args = build_model_args(spec, cfg)
    with torch.device("meta"):
        model = spec.model_cls(model_args)
    model.to_empty(device=device)
    model.init_weights()  # also computes the non-persistent buffers (positions) the weights file lacks
    if weights.suffix == ".pt":
        from torchtitan.models.dit.lightningdit_adapter import is_lightningdit_pt, read_lightningdit_pt
        from torchtitan.models.dit.repa_adapter import is_repa_pt, read_repa_pt
        from torchtitan.models.dit.state_dict_adapter import read_dit_pt

        reference, read = "facebookresearch/DiT", read_dit_pt
        if is_lightningdit_pt(weights):
            reference, read = "LightningDiT", read_lightningdit_pt
        elif is_repa_pt(weights):
            reference, read = "REPA", read_repa_pt  # its projectors left out: the model has none
        model.load_state_dict(read(weights, model_args), strict=True)
        which = f"{reference} weights of {weights}"
    elif weights.is_file():
        from safetensors.torch import load_file

        model.load_state_dict(load_file(str(weights), device=str(device)), strict=True)
        which = f"{weights}"
    else:
        which = f"'{load_dcp_weights(model, weights)}' weights of {weights}"
    logger.info(f"loaded {which}")
    return model.eval(), model_args
