"""LightningDiT's VA-VAE (or any LDM-style AutoencoderKL checkpoint) -> a diffusers `AutoencoderKL` folder.

    python scripts/convert_vavae.py vavae-imagenet256-f16d32-dinov2.pt vavae_diffusers
    python data/imagenet/prepare.py --tokenizer diffusers --checkpoint-dir vavae_diffusers ...

VA-VAE (hustvl/LightningDiT, tokenizer/vavae.py with tokenizer/configs/vavae_f16d32.yaml) is the autoencoder of
latent diffusion's `ldm.models.autoencoder.AutoencoderKL` (taming's Encoder/Decoder): f16 (channel multipliers
1, 1, 2, 2, 4), 32 latent channels, attention in the lowest-resolution level of both halves and in their middle. Its
checkpoint is a PyTorch Lightning file whose `state_dict` also holds the training losses (`loss.*`: LPIPS, the
discriminator) and the frozen vision foundation model of its alignment loss (`foundation_model.*`, with its
projection); only `encoder.*`, `decoder.*`, `quant_conv.*` and `post_quant_conv.*` make the autoencoder, as
LightningDiT's own loader keeps them (the rest is dropped and counted).

The diffusers config is read off the weights (channels per level, blocks per level, which levels attend, latent
channels), so any such checkpoint converts; GroupNorm has 32 groups (LDM's, fixed). The names map one to one
(LDM's `down.i.block.j` is diffusers' `down_blocks.i.resnets.j`, `up.i` is `up_blocks.(n - 1 - i)`, an attention's
1x1 convolutions its linear layers). `scaling_factor` is written as 1.0: TorchDiTan normalizes latents itself
(per channel, prepare.py's meta.json or latent.stats_file). tests/test_convert_vavae.py compares the folder's
encode and decode with the reference's own module.

The file is unpickled through an allow-list (torchtitan/tools/safe_pickle.py): tensors, numpy scalars and plain
containers; a file naming any other code is refused before anything it names runs. DST must not exist. An error is
one `error:` line (exit status 2).
"""

import argparse
import json
import re
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from torchtitan.tools import safe_pickle  # noqa: E402
from torchtitan.tools.logging import init_logger, logger  # noqa: E402

VAE_PICKLE_GLOBALS = safe_pickle.TORCH_TENSOR_GLOBALS | safe_pickle.NUMPY_ARRAY_GLOBALS
AUTOENCODER_PREFIXES = ("encoder.", "decoder.", "quant_conv.", "post_quant_conv.")
GROUPS = 32  # LDM's Normalize: GroupNorm(32, C, eps=1e-6)
# LDM -> diffusers names inside a resnet and an attention block.
_RESNET = {"norm1": "norm1", "conv1": "conv1", "norm2": "norm2", "conv2": "conv2", "nin_shortcut": "conv_shortcut"}
_ATTENTION = {"norm": "group_norm", "q": "to_q", "k": "to_k", "v": "to_v", "proj_out": "to_out.0"}
_LEVEL = re.compile(r"^(encoder\.down|decoder\.up)\.(\d+)\.(.*)$")


def read_ldm_state_dict(path: Path) -> dict[str, torch.Tensor]:
    """The autoencoder's tensors of an LDM / VA-VAE checkpoint (Lightning's `{"state_dict": ...}` or a plain state
    dict), through the allow-list; the losses' and the foundation model's entries dropped."""
    if not path.is_file():
        raise FileNotFoundError(f"SRC: {path} does not exist")
    loaded = safe_pickle.torch_load_file(path, VAE_PICKLE_GLOBALS, "an autoencoder checkpoint")
    state = loaded.get("state_dict", loaded) if isinstance(loaded, dict) else None
    if not isinstance(state, dict):
        raise ValueError(f"{path}: holds no state dict (a Lightning checkpoint's 'state_dict', or the dict itself)")
    kept = {k: v for k, v in state.items() if k.startswith(AUTOENCODER_PREFIXES) and isinstance(v, torch.Tensor)}
    if "encoder.conv_in.weight" not in kept or "post_quant_conv.weight" not in kept:
        raise ValueError(f"{path}: no LDM autoencoder in it (no encoder.conv_in.weight / post_quant_conv.weight)")
    logger.info(f"{path}: {len(kept)} autoencoder tensors kept, {len(state) - len(kept)} other entries dropped "
                "(losses, foundation model)")  # fmt: skip
    return kept


def _levels(state: dict, half: str) -> list[set[str]]:
    """Per level of `half` ("encoder.down" or "decoder.up"): the names under it."""
    found: dict[int, set[str]] = {}
    for key in state:
        match = _LEVEL.match(key)
        if match and match.group(1) == half:
            found.setdefault(int(match.group(2)), set()).add(match.group(3))
    return [found[i] for i in sorted(found)]


def _count(names: set[str], part: str) -> int:
    return len({name.split(".")[1] for name in names if name.startswith(part + ".")})


def diffusers_config(state: dict) -> dict:
    """The `AutoencoderKL` config of an LDM autoencoder's weights."""
    down, up = _levels(state, "encoder.down"), _levels(state, "decoder.up")
    if not down or len(down) != len(up):
        raise ValueError(f"encoder levels {len(down)}, decoder levels {len(up)}: not an LDM autoencoder")
    layers = _count(down[0], "block")
    encoder_blocks, decoder_blocks = [_count(d, "block") for d in down], [_count(u, "block") for u in up]
    if set(encoder_blocks) != {layers} or set(decoder_blocks) != {layers + 1}:
        raise ValueError(f"blocks per level {encoder_blocks} (encoder), {decoder_blocks} (decoder): LDM has "
                         "num_res_blocks per encoder level and one more per decoder level")  # fmt: skip
    channels = [state[f"encoder.down.{i}.block.0.conv2.weight"].shape[0] for i in range(len(down))]
    latent = state["post_quant_conv.weight"].shape[0]
    if state["encoder.conv_out.weight"].shape[0] != 2 * latent:
        raise ValueError(f"encoder.conv_out has {state['encoder.conv_out.weight'].shape[0]} channels, not 2 x "
                         f"{latent}: LDM's double_z Gaussian posterior is the only kind supported")  # fmt: skip
    bad = [c for c in channels if c % GROUPS]
    if bad:
        raise ValueError(f"channels {bad} are not multiples of {GROUPS}: not LDM's GroupNorm(32)")
    attends = lambda level: _count(level, "attn") > 0  # noqa: E731
    return {
        "_class_name": "AutoencoderKL",
        "in_channels": int(state["encoder.conv_in.weight"].shape[1]),
        "out_channels": int(state["decoder.conv_out.weight"].shape[0]),
        "down_block_types": ["AttnDownEncoderBlock2D" if attends(d) else "DownEncoderBlock2D" for d in down],
        # diffusers' up_blocks run from the lowest resolution: LDM's up.(n - 1) first.
        "up_block_types": ["AttnUpDecoderBlock2D" if attends(u) else "UpDecoderBlock2D" for u in reversed(up)],
        "block_out_channels": [int(c) for c in channels],
        "layers_per_block": int(layers),
        "act_fn": "silu",
        "latent_channels": int(latent),
        "norm_num_groups": GROUPS,
        "sample_size": 256,
        "scaling_factor": 1.0,
        "mid_block_add_attention": True,
    }


def _rename_block(rest: str, half: str, level: int, levels: int) -> str:
    """A name under LDM's encoder.down.i / decoder.up.i -> under diffusers' down_blocks / up_blocks."""
    index = level if half == "encoder" else levels - 1 - level
    kind, _, tail = rest.partition(".")
    prefix = f"{half}.{'down_blocks' if half == 'encoder' else 'up_blocks'}.{index}"
    if kind in ("downsample", "upsample"):
        return f"{prefix}.{kind}rs.0.{tail}"  # downsample.conv -> downsamplers.0.conv
    j, _, tail = tail.partition(".")
    module, _, param = tail.partition(".")
    if kind == "block":
        return f"{prefix}.resnets.{j}.{_RESNET[module]}.{param}"
    return f"{prefix}.attentions.{j}.{_ATTENTION[module]}.{param}"


def _rename(key: str, levels: int) -> str:
    match = _LEVEL.match(key)
    if match:
        half = match.group(1).split(".")[0]
        return _rename_block(match.group(3), half, int(match.group(2)), levels)
    half, _, rest = key.partition(".")
    if half in ("quant_conv", "post_quant_conv"):
        return key
    rest = rest.replace("norm_out.", "conv_norm_out.")
    for ldm, ours in (("mid.block_1.", "mid_block.resnets.0."), ("mid.block_2.", "mid_block.resnets.1."),
                      ("mid.attn_1.", "mid_block.attentions.0.")):  # fmt: skip
        if rest.startswith(ldm):
            module, _, param = rest[len(ldm) :].partition(".")
            table = _ATTENTION if "attentions" in ours else _RESNET
            return f"{half}.{ours}{table[module]}.{param}"
    return f"{half}.{rest}"


def to_diffusers(state: dict) -> tuple[dict, dict]:
    """(the diffusers config, the state dict in diffusers' names): attention convolutions (C, C, 1, 1) become
    linear weights (C, C)."""
    config = diffusers_config(state)
    levels = len(config["block_out_channels"])
    out = {}
    for key, tensor in state.items():
        try:
            name = _rename(key, levels)
        except KeyError:
            raise ValueError(f"unexpected key {key!r}: not a module of an LDM autoencoder") from None
        if ".attentions." in name and tensor.ndim == 4:
            tensor = tensor.flatten(1)  # a 1x1 convolution is a linear layer
        out[name] = tensor.float().contiguous()
    return config, out


def convert(src: Path, dst: Path) -> Path:
    """Reads the LDM / VA-VAE checkpoint SRC and writes the diffusers folder DST (config.json and
    diffusion_pytorch_model.safetensors, through `from_pretrained` and `save_pretrained`: the folder loads as any
    diffusers autoencoder); returns DST.

    Raises:
        FileNotFoundError, ValueError: SRC is missing or not an LDM autoencoder, DST exists; named.
    """
    if dst.exists():
        raise ValueError(f"DST: {dst} exists; nothing is overwritten")
    config, state = to_diffusers(read_ldm_state_dict(src))
    from diffusers import AutoencoderKL

    vae = AutoencoderKL.from_config({k: v for k, v in config.items() if not k.startswith("_")})
    expected = vae.state_dict()
    missing, unexpected = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    if missing or unexpected:
        raise ValueError(f"SRC: {src} does not fill diffusers' AutoencoderKL of its config: missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]}")  # fmt: skip
    shapes = [k for k in state if state[k].shape != expected[k].shape]
    if shapes:
        raise ValueError(f"SRC: {src}: {shapes[0]} has shape {tuple(state[shapes[0]].shape)}, diffusers' "
                         f"{tuple(expected[shapes[0]].shape)}")  # fmt: skip
    vae.load_state_dict(state, strict=True)
    tmp = dst.with_name(dst.name + ".tmp")
    vae.save_pretrained(str(tmp), safe_serialization=True)
    tmp.replace(dst)  # whole or absent
    downsample = 2 ** (len(config["block_out_channels"]) - 1)
    logger.info(f"wrote {dst} (diffusers AutoencoderKL: {json.dumps(config['block_out_channels'])} channels, "
                f"{config['latent_channels']} latent channels, f{downsample}) from {src}")  # fmt: skip
    return dst


def main(argv: list[str] | None = None) -> int:
    init_logger()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("src", type=Path, help="the VA-VAE (LDM AutoencoderKL) checkpoint, e.g. vavae-*.pt / .ckpt")
    parser.add_argument("dst", type=Path, help="the diffusers folder to write (must not exist)")
    args = parser.parse_args(argv)
    try:
        convert(args.src, args.dst)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
