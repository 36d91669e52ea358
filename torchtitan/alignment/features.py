"""The encoder's features stored beside prepared latents (`prepare.py --store-features`), read in place of running the
encoder: for small DiTs, where DINOv2's forward would cost more than the DiT's step.

What is stored is what the encoder computes on the fly from the image stored with `--store-images`: the uint8 image
(the unflipped one and, with flips, its mirror) through `FrozenEncoder` (ImageNet normalization, bicubic to 14 x the
DiT's token grid, `x_norm_patchtokens`), one (T, D) tensor per view, since a ViT's features of a mirrored image are
not its features' token grid mirrored (the patch embedding and the position table are not symmetric). The record
beside them (meta.json's and each shard's "features") names the encoder by the sha256 of its weights, the token grid
and the dtypes, so a run whose `[alignment]` encoder or DiT grid differs is refused rather than trained on another
encoder's features.
"""

from pathlib import Path

import torch

__all__ = ["features_mismatch", "features_record"]


def features_record(encoder_path: str | Path, encoder, dtype: torch.dtype) -> dict:
    """What stored features are: the encoder (kind, file name, sha256 of its weights, width, depth), the token grid
    and image size it ran at, the compute dtype (bf16 autocast on CUDA, as a bf16 run's encoder) and the stored one.

    Args:
        encoder_path: the encoder's file or folder (alignment.encoder_path's kind of value).
        encoder: the FrozenEncoder that computes them.
        dtype: the storage dtype.
    """
    from torchtitan.alignment.dinov2_weights import dinov2_sha256

    args = encoder.vit.args
    return {"encoder": "dinov2", "encoder_file": Path(encoder_path).name, "encoder_sha256": dinov2_sha256(encoder_path),
            "dim": args.dim, "depth": args.depth, "grid": args.grid, "image_size": args.image_size,
            "compute_dtype": "bfloat16" if encoder.bf16 else "float32",
            "dtype": str(dtype).removeprefix("torch.")}  # fmt: skip


def features_mismatch(record: dict, encoder_path: str, grid: int) -> tuple[str, str] | None:
    """How stored features differ from what a run's encoder would compute: (the config key at fault, what differs),
    or None when they are that encoder's at that grid.

    Args:
        record: meta.json's "features" (`features_record`).
        encoder_path: the run's alignment.encoder_path.
        grid: the run's DiT token grid per side (model.input_size // model.patch_size).

    Raises:
        FileNotFoundError, ValueError: the encoder's file is missing or not DINOv2 weights.
    """
    from torchtitan.alignment.dinov2_weights import dinov2_sha256

    ours = dinov2_sha256(encoder_path)
    if ours != record.get("encoder_sha256"):
        return "alignment.encoder_path", (
            f"they are the features of {record.get('encoder_file')!r} (DINOv2 {record.get('dim')} wide, "
            f"{record.get('depth')} blocks, sha256 {str(record.get('encoder_sha256'))[:16]}...), this run's encoder "
            f"{encoder_path!r} has sha256 {ours[:16]}..."
        )
    if int(record.get("grid", -1)) != grid:
        return "model.patch_size", (
            f"they are {record.get('grid')} x {record.get('grid')} tokens ({record.get('image_size')} px into the "
            f"encoder), this run's DiT has {grid} x {grid} (model.input_size / model.patch_size)"
        )
    return None
