"""REPA checkpoints (sihyun-yu/REPA: SiT plus alignment projectors) -> TorchDiTan DiT weights.

Two formats, as REPA writes and publishes them: what its train.py saves, `{"model", "ema", "opt", "args", "steps"}`,
of which the EMA is read (what its generate.py samples from), and a plain state dict (the released `last.pt`). Both
are unpickled through the facebookresearch/DiT reader's allow-list (state_dict_adapter.py): tensors, their
containers and train.py's `argparse.Namespace`; a file naming other code is refused before anything runs.

REPA's SiT (models/sit.py) is facebookresearch/DiT's architecture under the same names (state_dict_adapter.py maps
and checks those), without a learned sigma and with its fixed sin-cos `pos_embed` in the state dict: the SiT-* flavors
(learn_sigma false, pos_embed "sincos"). Its time is ours, t = 0 the data, embedded as it is in [0, 1]: rectified
flow with diffusion.time_input = "t" (REPA_CONFIG_FLAGS; config validation asks it of 'repa_pt') is REPA's linear
path. Its projectors, `projectors.{i}.{0,2,4}`, are ours by name:
they load when the run aligns (`[alignment]` with the encoder of the same width) and are dropped when the model has
none (sampling). Early REPA checkpoints that split the blocks into `blocks` and `decoder_blocks` (its generate.py's
`--legacy`) are renumbered as its `load_legacy_checkpoints` does.

Given the same weights, inputs, noise and times, our losses and gradients equal REPA's SILoss (tests/test_repa.py,
on a checkpoint REPA's own code wrote: tests/data/repa_reference/).
"""

import re
from pathlib import Path

import torch

from torchtitan.models.dit.model import DiT, DiTArgs
from torchtitan.models.dit.state_dict_adapter import from_reference, is_repa_checkpoint, load_pt, weights_of
from torchtitan.tools import safe_pickle

# What a REPA file's config is (sample.py, convert_dit.py): its SiT's flow, time read in [0, 1], fixed positions.
REPA_CONFIG_FLAGS = ("--model.pos_embed", "sincos", "--diffusion.objective", "rectified_flow", "--diffusion.prediction",
                     "velocity", "--diffusion.time_input", "t")  # fmt: skip
# Strings only a REPA file's pickle holds: its train.py args' fields, or its projectors' and legacy blocks' keys.
_MARKERS = ("enc_type", "proj_coeff", "projectors.0.0.weight")


def is_repa_pt(path: str | Path) -> bool:
    """Whether a `.pt` file is REPA's, told from the strings of its pickle without unpickling it (no code runs, no
    tensor is read): its train.py args' encoder fields, or a projector's or legacy decoder block's key."""
    strings = safe_pickle.pickle_strings(path)
    return any(marker in strings for marker in _MARKERS) or any(s.startswith("decoder_blocks.") for s in strings)


def _renumber_legacy(state: dict) -> dict:
    """`decoder_blocks.j` -> `blocks.(j + encoder blocks)` (REPA's load_legacy_checkpoints)."""
    encoder_blocks = len({m.group(1) for key in state if (m := re.match(r"^blocks\.(\d+)\.", key))})
    out = {}
    for key, value in state.items():
        match = re.match(r"^decoder_blocks\.(\d+)\.(.*)$", key)
        out[f"blocks.{int(match.group(1)) + encoder_blocks}.{match.group(2)}" if match else key] = value
    return out


def _check_args(train_args, args: DiTArgs, source: str) -> None:
    """REPA train.py's args against the model: the path, QK-norm and the aligned depth."""
    if train_args is None:
        return
    path_type = getattr(train_args, "path_type", "linear")
    if path_type != "linear":
        raise ValueError(f"{source}: trained on REPA's {path_type!r} path; ours is its 'linear' one "
                         "(x_t = (1 - t) x + t eps)")  # fmt: skip
    if getattr(train_args, "qk_norm", False):
        raise ValueError(f"{source}: trained with qk_norm (timm's LayerNorm on q and k), which our DiT does not have")
    depth = getattr(train_args, "encoder_depth", None)
    if args.align_depth and depth is not None and depth != args.align_depth:
        raise ValueError(f"{source}: its projectors read block {depth} (its encoder_depth), the run's "
                         f"alignment.depth is {args.align_depth}")  # fmt: skip


def from_repa(state_dict: dict[str, torch.Tensor], args: DiTArgs, source: str = "the state dict",
              train_args=None) -> dict[str, torch.Tensor]:  # fmt: skip
    """A REPA SiT state dict -> ours for `DiT(args)`, every key and shape checked; projectors kept when the model
    has them, dropped when it has none.

    Raises:
        ValueError: the model's time or architecture is not the checkpoint's, or a projector does not fit the run's
            alignment; the source and the key named.
    """
    _check_args(train_args, args, source)
    state = _renumber_legacy(state_dict) if any(k.startswith("decoder_blocks.") for k in state_dict) else state_dict
    projectors = {key: value for key, value in state.items() if key.startswith("projectors.")}
    ours = from_reference({k: v for k, v in state.items() if k not in projectors}, args.for_sampling(), source)
    if not args.align_depth:
        return ours  # sampling, or a run without alignment: the projectors only train
    with torch.device("meta"):
        expected = {k: v for k, v in DiT(args).state_dict().items() if k.startswith("projectors.")}
    for key in sorted(set(expected) | set(projectors)):
        if key not in projectors or key not in expected:
            raise ValueError(f"{source}: it has projectors {sorted({k.split('.')[1] for k in projectors})}, the run "
                             f"one per encoder ({len(args.align_dims)}): {key} is "
                             f"{'missing' if key not in projectors else 'unexpected'}")  # fmt: skip
        if projectors[key].shape != expected[key].shape:
            raise ValueError(f"{source}: {key} has shape {tuple(projectors[key].shape)}, the run's "
                             f"{tuple(expected[key].shape)}: set alignment.projector_dim (hidden width) and an "
                             "alignment.encoder_path of the checkpoint's feature width")  # fmt: skip
    return {**ours, **projectors}


def read_repa_pt(path: str | Path, args: DiTArgs) -> dict[str, torch.Tensor]:
    """A REPA `.pt` file (train.py's checkpoint, whose EMA is read, or a plain state dict) as our full state dict for
    `DiT(args)` (loads with strict=True): `checkpoint.initial_load_format = "repa_pt"`.

    Raises:
        FileNotFoundError: no such file.
        ValueError: the file names code outside the allow-list (safe_pickle.UnsafePickleError), is not REPA's, or
            does not fit `args` (see from_repa); the file named.
    """
    path = Path(path)
    loaded = load_pt(path, "a REPA checkpoint")
    return convert_repa_pt(loaded, path, args)


def convert_repa_pt(loaded, path: Path, args: DiTArgs) -> dict[str, torch.Tensor]:
    """A loaded REPA `.pt` (see read_repa_pt) as our state dict."""
    if not is_repa_checkpoint(loaded):
        raise ValueError(f"{path}: no REPA checkpoint (no projectors, no REPA train.py args); a facebookresearch/DiT "
                         "file is checkpoint.initial_load_format 'dit_pt'")  # fmt: skip
    state = weights_of(loaded, path, "REPA's train.py checkpoint ({'model', 'ema', 'opt', 'args', 'steps'})")
    train_args = loaded.get("args") if isinstance(loaded.get("ema"), dict) else None
    return from_repa(state, args, str(path), train_args)
