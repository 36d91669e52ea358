"""facebookresearch/DiT `.pt` checkpoints -> TorchDiTan DiT weights.

Two formats: a plain state dict (the released `DiT-XL-2-256x256.pt`, `DiT-XL-2-512x512.pt`) and what the
reference's train.py saves, `{"model", "ema", "opt", "args"}`, of which the EMA weights are read (the ones the
reference samples from). The file is unpickled through an allow-list (torchtitan/tools/safe_pickle.py): tensors,
their containers and train.py's `argparse.Namespace`; a file naming any other code is refused before anything
it names runs.

The reference's modules (timm's PatchEmbed, Attention and Mlp, models.py's blocks) have our parameter names, so
the table below is one-to-one; it exists so that a key of another model is refused by name. The reference also keeps
its fixed sin-cos `pos_embed` (1, T, D) in the state dict, which ours computes (a non-persistent buffer): it is
compared against ours and dropped, so the model must use `pos_embed = "sincos"`. Given the same weights, our forward
equals the reference's (tests/test_dit_weights.py checks it on a checkpoint the reference's own code wrote).

SiT (willisma/SiT) has the same architecture and names but runs time the other way (t = 1 is noise in DiT, data in
SiT), so its weights would sample nonsense here. A train.py checkpoint of SiT is recognized by its args (fields only
SiT's train.py has) and a file named "SiT*" by its name; both are refused. A plain SiT state dict under another
name cannot be told apart from a DiT one, and loads.
"""

import re
from pathlib import Path

import torch

from torchtitan.models.dit.model import DiT, DiTArgs, sincos_pos_embed_2d
from torchtitan.tools import safe_pickle

# The reference's name -> ours; "{}" is the block index. The same names on both sides, listed so that a key of
# another model is refused by name rather than loaded by accident.
_TOP_LEVEL = {
    name: name
    for name in (
        "x_embedder.proj.weight",
        "x_embedder.proj.bias",
        "t_embedder.mlp.0.weight",
        "t_embedder.mlp.0.bias",
        "t_embedder.mlp.2.weight",
        "t_embedder.mlp.2.bias",
        "y_embedder.embedding_table.weight",
        "final_layer.linear.weight",
        "final_layer.linear.bias",
        "final_layer.adaLN_modulation.1.weight",
        "final_layer.adaLN_modulation.1.bias",
    )
}
_PER_BLOCK = {
    name: name
    for name in (
        "attn.qkv.weight",
        "attn.qkv.bias",
        "attn.proj.weight",
        "attn.proj.bias",
        "mlp.fc1.weight",
        "mlp.fc1.bias",
        "mlp.fc2.weight",
        "mlp.fc2.bias",
        "adaLN_modulation.1.weight",
        "adaLN_modulation.1.bias",
    )
}
_REFERENCE_TO_OURS = {**_TOP_LEVEL, **{f"blocks.{{}}.{ref}": f"blocks.{{}}.{ours}" for ref, ours in _PER_BLOCK.items()}}
_POS_EMBED = "pos_embed"  # the reference's fixed sin-cos table (1, T, D): checked against ours, then dropped
_BLOCK_INDEX = re.compile(r"^blocks\.(\d+)\.")  # not t_embedder.mlp.0: the Sequential's index stays
POS_EMBED_TOLERANCE = 1e-6  # the reference builds the table in numpy float64, then casts it to float32

# The globals a DiT `.pt` file may name: tensors (their rebuild function and storage types), the state dict's
# OrderedDict, and train.py's args. Anything else could run code.
DIT_PT_PICKLE_GLOBALS = safe_pickle.TORCH_TENSOR_GLOBALS | {("argparse", "Namespace")}
# Fields of SiT's train.py args (willisma/SiT transport options) that DiT's train.py does not have.
_SIT_ARGS = ("path_type", "prediction", "loss_weight", "sample_eps", "train_eps")
_OVERRIDES = "model.flavor, or the [model] overrides learn_sigma, num_classes, input_size, in_channels, patch_size"


def _rename(key: str, table: dict[str, str]) -> str | None:
    """Maps one key through `table`, whose keys may hold "{}" for the block index; None when it has no match."""
    match = _BLOCK_INDEX.search(key)
    if match is None:
        return table.get(key)
    template = table.get("blocks.{}." + key[match.end() :])
    return None if template is None else template.format(match.group(1))


# Fields only REPA's train.py args have (its encoder and projection loss).
_REPA_ARGS = ("enc_type", "proj_coeff", "encoder_depth")


def _state_of(loaded) -> dict | None:
    """The state dict inside a loaded file: train.py's "ema" (else "model"), or the file itself."""
    if not isinstance(loaded, dict):
        return None
    for entry in ("ema", "model"):
        if isinstance(loaded.get(entry), dict):
            return loaded[entry]
    return loaded


def is_repa_checkpoint(loaded) -> bool:
    """Whether a loaded `.pt` is REPA's: train.py's args name its encoder, or its weights hold projectors. Here,
    beside the SiT refusal, since read_dit_pt sends such a file to its own format (repa_adapter.py reads it)."""
    args = loaded.get("args") if isinstance(loaded, dict) else None
    if args is not None and any(hasattr(args, field) for field in _REPA_ARGS):
        return True
    state = _state_of(loaded)
    return state is not None and any(str(key).startswith(("projectors.", "decoder_blocks.")) for key in state)


def _sit_refusal(path: Path) -> str:
    return (f"{path}: SiT weights (willisma/SiT) are not supported: SiT's time runs the other way (t = 1 is data, "
            "DiT's t = 1 noise), so they would sample nonsense here")  # fmt: skip


def _weights_in(loaded, path: Path) -> dict[str, torch.Tensor]:
    """The state dict of a loaded `.pt`: the file itself when it is one, else train.py's "ema" (or "model")."""
    if not isinstance(loaded, dict):
        raise ValueError(f"{path}: holds a {type(loaded).__name__}, not a DiT state dict or train.py checkpoint")
    args = loaded.get("args")
    if args is not None and any(hasattr(args, field) for field in _SIT_ARGS):
        raise ValueError(_sit_refusal(path) + f" (its args have {[f for f in _SIT_ARGS if hasattr(args, f)]})")
    return weights_of(loaded, path, "a facebookresearch/DiT train.py checkpoint ({'model', 'ema', 'opt', 'args'})")


def weights_of(loaded: dict, path, checkpoint: str) -> dict[str, torch.Tensor]:
    """The weights in a loaded training `.pt` (the DiT family's train.py files: facebookresearch/DiT, SiT, REPA,
    LightningDiT): its "ema" entry (what their samplers use), else its "model", else the file itself as a state
    dict.

    Raises:
        ValueError: what is left holds something other than tensors; `path` and `checkpoint` (what such a file
            holds) named.
    """
    for entry in ("ema", "model"):
        if isinstance(loaded.get(entry), dict):
            loaded = loaded[entry]
            break
    others = [key for key, value in loaded.items() if not isinstance(value, torch.Tensor)]
    if others:
        raise ValueError(f"{path}: {others[:5]} are no tensors: not a state dict nor {checkpoint}")
    return dict(loaded)


def from_reference(state_dict: dict[str, torch.Tensor], args: DiTArgs, source: str = "the state dict") -> dict:
    """A facebookresearch/DiT state dict -> ours for a DiT of `args`, every key and shape checked against that model
    (built on the meta device: nothing allocated); the reference's fixed `pos_embed` is checked and dropped.

    Raises:
        ValueError: args.pos_embed is not "sincos", the stored position table differs from ours, or a key is
            unexpected, missing or of another shape; the source and key named (a shape: both shapes and the keys
            that set them).
    """
    if args.pos_embed != "sincos":
        raise ValueError(f"{source}: facebookresearch/DiT weights need model.pos_embed = 'sincos' (its fixed "
                         f"sin-cos table), the model has {args.pos_embed!r}")  # fmt: skip
    with torch.device("meta"):
        expected = DiT(args).state_dict()
    ours = {}
    for key, tensor in state_dict.items():
        if key == _POS_EMBED:
            _check_pos_embed(tensor, args, source)
            continue
        name = _rename(key, _REFERENCE_TO_OURS)
        if name is None or name not in expected:
            raise ValueError(f"{source}: unexpected key {key!r}: no parameter of this DiT (depth {args.depth}) maps "
                             f"to it; set {_OVERRIDES}")  # fmt: skip
        if tensor.shape != expected[name].shape:
            raise ValueError(f"{source}: {key} has shape {tuple(tensor.shape)}, the model "
                             f"{tuple(expected[name].shape)}; set {_OVERRIDES} to the checkpoint's")  # fmt: skip
        ours[name] = tensor
    missing = sorted(set(expected) - set(ours))
    if missing:
        raise ValueError(f"{source}: no weights for {missing[:5]}{' ...' if len(missing) > 5 else ''}; set "
                         f"{_OVERRIDES} to the checkpoint's")  # fmt: skip
    return ours


def _check_pos_embed(stored: torch.Tensor, args: DiTArgs, source: str) -> None:
    """Raises ValueError naming the key unless the stored table is ours (1, T, D) within POS_EMBED_TOLERANCE."""
    grid = args.input_size // args.patch_size
    table = sincos_pos_embed_2d(args.dim, grid).unsqueeze(0)  # (1, T, D)
    if stored.shape != table.shape:
        raise ValueError(f"{source}: {_POS_EMBED} has shape {tuple(stored.shape)}, the model {tuple(table.shape)}; "
                         f"set {_OVERRIDES} to the checkpoint's")  # fmt: skip
    error = (stored.double() - table.double()).abs().max().item()
    if not error <= POS_EMBED_TOLERANCE:  # NaN too
        raise ValueError(f"{source}: {_POS_EMBED} differs from the fixed 2D sin-cos table by {error:.3g} "
                         f"(> {POS_EMBED_TOLERANCE:g}): not the facebookresearch/DiT table ours computes")  # fmt: skip


def load_pt(path: str | Path, holder: str = "a DiT checkpoint"):
    """A `.pt` file unpickled through DIT_PT_PICKLE_GLOBALS (tensors, their containers, train.py's args).

    Raises:
        FileNotFoundError: no such file.
        ValueError: unreadable, or naming code outside the allow-list (safe_pickle.UnsafePickleError); file named.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist")
    return safe_pickle.torch_load_file(path, DIT_PT_PICKLE_GLOBALS, holder)


def convert_dit_pt(loaded, path: Path, args: DiTArgs) -> dict[str, torch.Tensor]:
    """A loaded facebookresearch/DiT `.pt` (see read_dit_pt) as our state dict; SiT files refused."""
    if path.name.startswith("SiT"):  # the released SiT-XL-2-256.pt
        raise ValueError(_sit_refusal(path))
    return from_reference(_weights_in(loaded, path), args, str(path))


def read_dit_pt(path: str | Path, args: DiTArgs) -> dict[str, torch.Tensor]:
    """A facebookresearch/DiT `.pt` file as our full state dict for `DiT(args)` (loads with strict=True): a plain
    state dict, or train.py's checkpoint, whose EMA weights are taken.

    SiT files are refused when recognizable (train.py's args, a name starting with "SiT"); a plain SiT state dict
    under another name cannot be told apart from a DiT one (the same names and shapes) and loads. A REPA checkpoint
    is sent to its own format ('repa_pt', repa_adapter.py).

    Raises:
        FileNotFoundError: no such file.
        ValueError: the file names code outside the allow-list (safe_pickle.UnsafePickleError), is no DiT state
            dict, is SiT's or REPA's, or does not fit `args` (see from_reference); the file named.
    """
    path = Path(path)
    loaded = load_pt(path)
    if is_repa_checkpoint(loaded):
        raise ValueError(f"{path}: a REPA checkpoint (SiT with alignment projectors): read it with "
                         "checkpoint.initial_load_format = 'repa_pt' and a SiT-* model.flavor")  # fmt: skip
    return convert_dit_pt(loaded, path, args)
