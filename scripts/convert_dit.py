"""DiT weights between formats: facebookresearch/DiT, REPA and LightningDiT `.pt`, diffusers folders, our runs and
`.safetensors` files.

    python scripts/convert_dit.py SRC DST [--to safetensors|diffusers] [--flavor F] [--model.KEY V ...]

SRC is one of:
- a facebookresearch/DiT `.pt` (a released plain state dict, or its train.py's checkpoint, whose EMA is taken):
  `--flavor` names its shapes and `--model.KEY V` overrides them (torchtitan/models/dit/state_dict_adapter.py);
- a REPA `.pt` (sihyun-yu/REPA's SiT with projectors, told apart by itself), with a SiT-* `--flavor`: written
  without the projectors, which only train (torchtitan/models/dit/repa_adapter.py);
- a hustvl/LightningDiT `.pt` (told apart by its keys; train.py's checkpoint, whose EMA is taken, or a state dict):
  `--flavor LightningDiT-XL/1` or another LightningDiT-* (torchtitan/models/dit/lightningdit_adapter.py);
- a diffusers `DiTTransformer2DModel` folder, or a DiTPipeline folder holding one in transformer/
  (torchtitan/models/dit/diffusers_adapter.py);
- one of our runs: its folder (ema.safetensors, else the EMA of its newest checkpoint), a DCP step folder, or a
  `.safetensors` export beside its config.toml (read as sample.py reads them: torchtitan/models/dit/weights.py).
DST, with `--to safetensors` (the default): one file in our parameter names, which loads with
`load_state_dict(strict=True)` into `DiT(DiTArgs(...))` of the flavor; its metadata holds the DiTArgs as JSON
("model_args"), as the trainer's ema.safetensors export does, and, from a `.pt`, the flow it samples with
("diffusion": objective, prediction, time_input; a LightningDiT file's is its transport's, time_input '1-t', which
the config.toml that samples from the file must repeat). With `--to diffusers`: a DiTPipeline folder
(transformer/, scheduler/ with the run's DDPM schedule, model_index.json; no VAE) for diffusers' `DiTPipeline`,
whose outputs differ slightly from ours (docs/checkpoint.md says why).

DST must not exist: nothing is overwritten. Weights with a NaN or inf are not written. An error is one `error:` line
(exit status 2).
"""

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from torchtitan.tools.logging import init_logger, logger  # noqa: E402


def is_diffusers_folder(path: Path) -> bool:
    """A diffusers model folder (config.json without our config.toml) or a pipeline folder with transformer/."""
    if not path.is_dir():
        return False
    return (path / "transformer" / "config.json").is_file() or (
        (path / "config.json").is_file() and not (path / "config.toml").is_file()
    )


def read_source(src: Path, flavor: str, overrides: list[str]) -> tuple[dict, object, object]:
    """(our state dict, its DiTArgs, the run's JobConfig or None) of SRC."""
    if not src.exists():
        raise FileNotFoundError(f"SRC: {src} does not exist")
    if is_diffusers_folder(src):
        if flavor or overrides:
            raise ValueError(f"--flavor and --model overrides are for .pt files: the diffusers folder {src} holds "
                             "its config")  # fmt: skip
        from torchtitan.models.dit.diffusers_adapter import read_diffusers_folder

        state, args = read_diffusers_folder(src)
        return state, args, None
    from torchtitan.models.dit.weights import load_model, resolve_checkpoint

    cfg, weights = resolve_checkpoint(src, "", flavor, overrides)
    model, args = load_model(cfg, weights, torch.device("cpu"))
    return {name: tensor.detach() for name, tensor in model.state_dict().items()}, args, cfg


def write_safetensors(state: dict, args, dst: Path, diffusion: dict | None = None) -> None:
    from safetensors.torch import save_file

    tmp = dst.with_name(dst.name + ".tmp")
    metadata = {"model_args": json.dumps(args.__dict__)}
    if diffusion:
        metadata["diffusion"] = json.dumps(diffusion)
    save_file({k: v.contiguous() for k, v in state.items()}, str(tmp), metadata=metadata)
    tmp.replace(dst)  # whole or absent


def convert(src: Path, dst: Path, to: str, flavor: str = "", overrides: list[str] | None = None) -> Path:
    """Reads SRC and writes DST in the format `to` ("safetensors" or "diffusers"); returns DST.

    Raises:
        FileNotFoundError, ValueError: SRC is missing or not DiT weights, DST exists, the weights or the model
            options do not fit the target format (each message names the file, key or option).
    """
    from torchtitan.components.checkpoint import nonfinite_entries

    if dst.exists():
        raise ValueError(f"DST: {dst} exists; nothing is overwritten")
    state, args, cfg = read_source(src, flavor, overrides or [])
    bad = nonfinite_entries(state)
    if bad:
        raise ValueError(f"SRC: {src} holds non-finite values in {bad[:5]}: not converted")
    if to == "diffusers":
        from torchtitan.models.dit.diffusers_adapter import save_diffusers_folder

        schedule = {}
        if cfg is not None:
            diffusion = cfg.diffusion
            schedule = {"objective": diffusion.objective, "noise_schedule": diffusion.noise_schedule,
                        "num_timesteps": diffusion.num_timesteps}  # fmt: skip
        save_diffusers_folder(state, args, dst, **schedule)
    else:
        flow = None
        if cfg is not None and src.suffix == ".pt":  # a .pt has no config.toml: say how its weights sample
            flow = {key: getattr(cfg.diffusion, key) for key in ("objective", "prediction", "time_input")}
        write_safetensors(state, args, dst, flow)
    logger.info(f"wrote {dst} ({to}) from {src}")
    return dst


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("src", type=Path, help="a DiT, REPA or LightningDiT .pt, a diffusers folder, a run folder, a "
                        "step folder or export")  # fmt: skip
    parser.add_argument("dst", type=Path, help="the .safetensors file or diffusers folder to write (must not exist)")
    parser.add_argument("--to", choices=["safetensors", "diffusers"], default="safetensors")
    parser.add_argument("--flavor", default="", help="a .pt's shapes, e.g. DiT-XL/2 or LightningDiT-XL/1")
    args, overrides = parser.parse_known_args(argv)
    unknown = [arg for arg in overrides if arg.startswith("-") and not arg.startswith("--model.")]
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)} (a .pt's model options are --model.KEY V)")
    args.overrides = overrides
    return args


def main(argv: list[str] | None = None) -> int:
    init_logger()
    args = parse(argv)
    try:
        convert(args.src, args.dst, args.to, args.flavor, args.overrides)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
