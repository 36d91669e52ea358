"""DINOv2 weights from a local file, as `alignment.encoder_path` names it: nothing is downloaded.

Two formats:
- the official `.pth` state dict that facebookresearch/dinov2 publishes and `torch.hub.load` reads (REPA's route),
  e.g. dinov2_vitb14_pretrain.pth or dinov2_vitb14_reg4_pretrain.pth; unpickled through an allow-list of tensors
  (torchtitan/tools/safe_pickle.py), so a file naming code is refused before anything runs. Its architecture comes
  from its shapes (DINOv2's heads are 64 wide);
- a Hugging Face `Dinov2Model` (or `Dinov2WithRegistersModel`) folder: config.json and *.safetensors, its keys mapped
  onto the official names (transformers is not needed).

The position table is resampled once to the grid the encoder runs at, as REPA does with timm's
`resample_abs_pos_embed`: bicubic with antialiasing, in float32, the class token's row kept.
"""

import functools
import hashlib
import json
import re
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn.functional as F

from torchtitan.alignment.vit import ViTArgs
from torchtitan.tools import safe_pickle

HEAD_DIM = 64  # every published DINOv2 (S/B/L/g: 6, 12, 16, 24 heads)
_UNUSED = ("mask_token",)  # DINOv2's masked-image-modelling token: never used to encode an image

# A Hugging Face Dinov2Model's names on disk -> the official ones; "{}" is the block index. transformers 5 keeps
# its files in these names; its in-memory q_proj/k_proj/v_proj/o_proj and gate/up/down names are accepted too.
_HF_TOP = {
    "embeddings.cls_token": "cls_token",
    "embeddings.position_embeddings": "pos_embed",
    "embeddings.register_tokens": "register_tokens",
    "embeddings.mask_token": "mask_token",
    "embeddings.patch_embeddings.projection.weight": "patch_embed.proj.weight",
    "embeddings.patch_embeddings.projection.bias": "patch_embed.proj.bias",
    "layernorm.weight": "norm.weight",
    "layernorm.bias": "norm.bias",
}
_HF_BLOCK = {
    "norm1": "norm1",
    "norm2": "norm2",
    "attention.output.dense": "attn.proj",
    "attention.o_proj": "attn.proj",
    "layer_scale1.lambda1": "ls1.gamma",
    "layer_scale2.lambda1": "ls2.gamma",
    "mlp.fc1": "mlp.fc1",
    "mlp.fc2": "mlp.fc2",
    "mlp.weights_in": "mlp.w12",
    "mlp.weights_out": "mlp.w3",
    "mlp.down_proj": "mlp.w3",
}
# Pieces concatenated into one official tensor: q, k, v into qkv; SwiGLU's gate and up into w12 (gate first).
_HF_FUSED = {
    "attn.qkv": (("attention.attention.query", "attention.attention.key", "attention.attention.value"),
                 ("attention.q_proj", "attention.k_proj", "attention.v_proj")),
    "mlp.w12": (("mlp.gate_proj", "mlp.up_proj"),),
}  # fmt: skip
_HF_LAYER = re.compile(r"^encoder\.layer\.(\d+)\.(.+)\.(weight|bias|lambda1)$")


def _read_pth(path: Path) -> dict[str, torch.Tensor]:
    state = safe_pickle.torch_load_file(path, safe_pickle.TORCH_TENSOR_GLOBALS, "a DINOv2 state dict")
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ValueError(f"{path}: not a state dict of tensors (the official DINOv2 .pth is one)")
    if "cls_token" not in state or "patch_embed.proj.weight" not in state:
        raise ValueError(f"{path}: no cls_token / patch_embed.proj.weight: not a DINOv2 state dict")
    return dict(state)


def _hf_config(folder: Path) -> dict:
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"{folder}: no config.json (a Hugging Face Dinov2Model folder has one)")
    config = json.loads(config_file.read_text())
    if config.get("model_type") not in ("dinov2", "dinov2_with_registers"):
        raise ValueError(f"{config_file}: model_type {config.get('model_type')!r}, not a DINOv2 ('dinov2')")
    if config.get("hidden_act", "gelu") != "gelu" or not config.get("qkv_bias", True):
        raise ValueError(f"{config_file}: hidden_act {config.get('hidden_act')!r} / qkv_bias "
                         f"{config.get('qkv_bias')!r}: DINOv2's are 'gelu' and true")  # fmt: skip
    return config


def _hf_files(folder: Path) -> list[Path]:
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{folder}: no *.safetensors weights")
    return files


def _from_hf(tensors: dict[str, torch.Tensor], source: str) -> dict[str, torch.Tensor]:
    """A Hugging Face DINOv2 state dict (its on-disk names; a "dinov2." prefix dropped) -> the official names."""
    tensors = {key.removeprefix("dinov2."): value for key, value in tensors.items()}
    ours, pieces = {}, {}
    for key, value in tensors.items():
        if key in _HF_TOP:
            ours[_HF_TOP[key]] = value
            continue
        match = _HF_LAYER.match(key)
        if match is None:
            raise ValueError(f"{source}: unexpected key {key!r}: not a Dinov2Model parameter")
        index, name, leaf = match.groups()
        if name + "." + leaf in _HF_BLOCK:  # layer_scale1.lambda1
            ours[f"blocks.{index}.{_HF_BLOCK[name + '.' + leaf]}"] = value
        elif name in _HF_BLOCK:
            ours[f"blocks.{index}.{_HF_BLOCK[name]}.{leaf}"] = value
        else:
            pieces[(index, name, leaf)] = value
    for target, spellings in _HF_FUSED.items():
        for index, leaf in sorted({(i, lf) for (i, n, lf) in pieces if any(n in s for s in spellings)}):
            for names in spellings:
                if all((index, n, leaf) in pieces for n in names):
                    ours[f"blocks.{index}.{target}.{leaf}"] = torch.cat([pieces.pop((index, n, leaf)) for n in names])
                    break
    if pieces:
        index, name, leaf = next(iter(pieces))
        raise ValueError(f"{source}: unexpected or incomplete key encoder.layer.{index}.{name}.{leaf}")
    return ours


def _block_keys(state: dict) -> int:
    indices = {int(m.group(1)) for key in state if (m := re.match(r"^blocks\.(\d+)\.", key))}
    if indices != set(range(len(indices))):
        raise ValueError(f"blocks {sorted(indices)} are not 0..{len(indices) - 1} (chunked blocks are not read)")
    return len(indices)


def _args_from_state(state: dict, grid: int, source: str, config: dict | None = None) -> ViTArgs:
    """The architecture of an official-named state dict (shapes; config.json's where one came with it)."""
    dim = state["cls_token"].shape[-1]
    heads = config["num_attention_heads"] if config else dim // HEAD_DIM
    if dim % HEAD_DIM and not config:
        raise ValueError(f"{source}: width {dim} is not a multiple of DINOv2's {HEAD_DIM}-wide heads")
    try:
        depth = _block_keys(state)
    except ValueError as e:
        raise ValueError(f"{source}: {e}") from e
    hidden = state["blocks.0.mlp.fc1.weight"].shape[0] if "blocks.0.mlp.fc1.weight" in state else None
    return ViTArgs(
        dim=dim,
        depth=depth,
        num_heads=heads,
        patch_size=state["patch_embed.proj.weight"].shape[-1],
        grid=grid,
        mlp="swiglu" if "blocks.0.mlp.w12.weight" in state else "gelu",
        mlp_ratio=config.get("mlp_ratio", 4.0) if config else (hidden / dim if hidden else 4.0),
        num_register_tokens=state["register_tokens"].shape[1] if "register_tokens" in state else 0,
        layerscale="blocks.0.ls1.gamma" in state,
        norm_eps=config.get("layer_norm_eps", 1e-6) if config else 1e-6,
        in_channels=state["patch_embed.proj.weight"].shape[1],
    )


def resample_positions(pos_embed: torch.Tensor, grid: int) -> torch.Tensor:
    """A (1, 1 + g*g, D) position table resampled to (1, 1 + grid*grid, D): the class token's row kept, the patch
    rows bicubic with antialiasing in float32 (what REPA applies to DINOv2 through timm's resample_abs_pos_embed)."""
    old = round((pos_embed.shape[1] - 1) ** 0.5)
    if old == grid:
        return pos_embed
    dim = pos_embed.shape[-1]
    patches = pos_embed[:, 1:].float().reshape(1, old, old, dim).permute(0, 3, 1, 2)
    patches = F.interpolate(patches, size=(grid, grid), mode="bicubic", antialias=True)
    patches = patches.permute(0, 2, 3, 1).reshape(1, grid * grid, dim).to(pos_embed.dtype)
    return torch.cat([pos_embed[:, :1], patches], dim=1)


def read_dinov2(path: str | Path, grid: int) -> tuple[ViTArgs, dict[str, torch.Tensor]]:
    """The encoder's architecture at `grid` x `grid` patches and its state dict (VisionTransformer's names, the
    position table resampled to the grid, the unused mask token dropped).

    Raises:
        FileNotFoundError: no such file or folder, or a folder without config.json or weights.
        ValueError: not DINOv2 weights (UnsafePickleError for a file naming code); the file and key named.
    """
    path = Path(path)
    config, state = _read_state(path)
    args = _args_from_state(state, grid, str(path), config)
    state["pos_embed"] = resample_positions(state["pos_embed"], grid)
    return args, state


def _read_state(path: Path) -> tuple[dict | None, dict[str, torch.Tensor]]:
    """(config.json of a Hugging Face folder or None, the state dict in the official names without the unused mask
    token, its position table as published)."""
    if path.is_dir():
        from safetensors.torch import load_file

        config = _hf_config(path)
        tensors = {}
        for file in _hf_files(path):
            tensors.update(load_file(str(file)))
        state = _from_hf(tensors, str(path))
    elif path.is_file():
        config, state = None, _read_pth(path)
    else:
        raise FileNotFoundError(f"{path} does not exist")
    return config, {key: value for key, value in state.items() if key not in _UNUSED}


def _stamp(path: Path) -> tuple:
    """What a cached read is keyed by: the file's (or the folder's files') sizes and modification times."""
    files = sorted(path.iterdir()) if path.is_dir() else [path]
    return tuple((f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in files if f.is_file())


@functools.lru_cache(maxsize=8)
def _weights_sha256(path: str, stamp: tuple) -> str:
    config, state = _read_state(Path(path))
    args = _args_from_state(state, 1, path, config)
    # What the tensors' shapes do not say (heads, norm epsilon), as the same network reads from either format.
    digest = hashlib.sha256(f"{args.num_heads} {float(args.norm_eps)!r} {args.mlp} {args.layerscale};".encode())
    for name in sorted(state):
        tensor = state[name].contiguous()
        digest.update(f"{name} {tensor.dtype} {tuple(tensor.shape)};".encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy())
    return digest.hexdigest()


def dinov2_sha256(path: str | Path) -> str:
    """sha256 of the encoder's weights, tensor by tensor in the official names (name, dtype, shape, values; the
    unused mask token left out): the same network gives the same hash from a file or folder of any name, and
    features stored by prepare.py are told apart by it. Cached by the files' sizes and modification times.

    Raises:
        FileNotFoundError, ValueError: as read_dinov2.
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist")
    return _weights_sha256(str(path.resolve()), _stamp(path))


@functools.lru_cache(maxsize=8)
def _architecture(path: str, stamp: tuple) -> ViTArgs:
    source = Path(path)
    if source.is_dir():
        from safetensors import safe_open

        config, shapes = _hf_config(source), {}
        for file in _hf_files(source):
            with safe_open(str(file), "pt") as f:
                shapes.update({key: torch.empty(f.get_slice(key).get_shape(), device="meta") for key in f.keys()})
        return _args_from_state(_from_hf(shapes, path), 1, path, config)
    return _args_from_state(_read_pth(source), 1, path)


def dinov2_architecture(path: str | Path, grid: int) -> ViTArgs:
    """The encoder's architecture at `grid` x `grid` patches, from its file's shapes (and config.json), without
    keeping its weights; cached by the file's size and modification time (validation and the trainer both ask).

    Raises:
        FileNotFoundError, ValueError: as read_dinov2.
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist")
    stat = path.stat()
    return replace(_architecture(str(path.resolve()), (stat.st_size, stat.st_mtime_ns)), grid=grid)
