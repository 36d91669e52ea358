"""Encode an image dataset once into latent shards (see latents.py for the format).

Used by `data/<dataset>/prepare.py`, launched with torchrun: shard k is encoded by rank k % world_size,
each rank on its own GPU (CPU works too). Each shard is written to a temporary file and renamed into
place (`os.replace`, atomic), so a shard that exists is complete: a rerun after an interruption skips
the finished shards and encodes only the rest. When every shard exists, rank 0 combines the per-shard
channel moments into the normalization statistics and writes `meta.json` last; its presence marks a
finished preparation.

`prepare.py` scripts run their body through `exit_code_of`: an error a user can fix (a missing folder, a
bad option, a broken tokenizer file) prints one `error: ...` line naming the file or flag and exits with 2.
"""

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset, Subset

from torchtitan.datasets.latent_tokenizer import describe_tokenizer, same_tokenizer, tokenizer_record
from torchtitan.datasets.latents import (
    FEATURES_METADATA,
    FORMAT,
    META_FILE,
    LatentNormalization,
    combine_moments,
    features_metadata,
    file_tokenizer,
    latent_file_metadata,
    moments_std,
    shard_name,
)
from torchtitan.datasets.prefetch import images_to_float
from torchtitan.tools.logging import logger

STORAGE_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


def add_prepare_args(parser: argparse.ArgumentParser, default_out: str) -> None:
    """The options every prepare.py shares (tokenizer, sharding, normalization)."""
    parser.add_argument("--out", default=default_out, help="output folder of shards and meta.json")
    parser.add_argument("--tokenizer", default="cosmos_jit", choices=("cosmos_jit", "diffusers"))
    parser.add_argument("--checkpoint-dir", required=True, help="local tokenizer folder")
    parser.add_argument("--shard-size", type=int, default=4096, help="images per shard (the resume unit)")
    parser.add_argument("--batch-size", type=int, default=64, help="images per encoder call (x2 with flips)")
    parser.add_argument("--num-workers", type=int, default=4, help="image-loading workers per rank")
    parser.add_argument("--no-flip", action="store_true", help="skip the horizontally flipped copies")
    parser.add_argument("--normalization", default="channel", choices=("channel", "scale"),
                        help="'channel': per-channel mean/std measured here; 'scale': z * --scale-factor")  # fmt: skip
    parser.add_argument("--scale-factor", type=float, default=0.18215, help="for --normalization scale")
    parser.add_argument("--dtype", default="float16", choices=tuple(STORAGE_DTYPES), help="storage dtype")
    parser.add_argument("--store-images", action="store_true",
                        help="keep each image (uint8) beside its latents, for [alignment]'s encoder on latent runs "
                             "(3 H W bytes an image: 192 KiB at 256 px)")  # fmt: skip
    parser.add_argument("--store-features", default="", metavar="ENCODER",
                        help="run [alignment]'s frozen encoder (a DINOv2 .pth or Hugging Face folder, as "
                             "alignment.encoder_path) over each image and its mirror, and keep its features beside the "
                             "latents: training reads them instead of running the encoder (T D bytes a view at "
                             "float16 x 2: 384 KiB for DINOv2-B at 16 x 16 tokens)")  # fmt: skip
    parser.add_argument("--features-patch-size", type=int, default=2,
                        help="patch size of the DiT that aligns to the features (SiT-XL/2: 2): one feature per DiT "
                             "token, (latent side / patch size)^2 of them")  # fmt: skip
    parser.add_argument("--features-dtype", default="float16", choices=tuple(STORAGE_DTYPES),
                        help="storage dtype of --store-features")  # fmt: skip
    parser.add_argument("--max-shards", type=int, default=0,
                        help="stop after encoding this many shards on each rank (0: all); rerun to resume")  # fmt: skip


def init_distributed() -> tuple[int, int, torch.device]:
    """(rank, world size, device) under torchrun (gloo: only barriers are needed), or (0, 1, device)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if world > 1 and not dist.is_initialized():
        # Ranks finish their shards at different times; the final barrier may wait long.
        dist.init_process_group("gloo", timeout=timedelta(hours=12))
    if torch.cuda.is_available():
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        return rank, world, torch.device("cuda", local_rank)
    return rank, world, torch.device("cpu")


def _shard_metadata(record: dict, index: int, num_shards: int, shard_size: int, image_size: int, flip: bool,
                    images: bool = False, features: dict | None = None) -> dict:  # fmt: skip
    """A shard's metadata: raw latents of the tokenizer `record` (`tokenizer_record`), the shard's layout, and the
    record of the encoder's features it holds (`features_record`; '' for none)."""
    layout = {"image_size": image_size, "shard_index": index, "num_shards": num_shards, "shard_size": shard_size,
              "flip": flip, "images": images}  # fmt: skip
    return (latent_file_metadata(LatentNormalization("none"), record) | {k: str(v) for k, v in layout.items()}
            | {FEATURES_METADATA: features_metadata(features)})  # fmt: skip


def _check_existing(path: Path, expected: dict) -> None:
    """A finished shard must come from the same tokenizer (by its hashes, not its folder's name) and layout as this
    run; raises naming both."""
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        found = f.metadata() or {}
    theirs, ours = file_tokenizer(found) or {}, file_tokenizer(expected)
    if not theirs.get("encoder_sha256"):
        raise ValueError(f"{path} was written before TorchDiTan recorded the tokenizer's hash in each shard: whether "
                         f"{describe_tokenizer(ours)} encoded it cannot be checked; encode into another --out folder "
                         "(or delete this folder's shards to encode them again)")  # fmt: skip
    if not same_tokenizer(theirs, ours):
        raise ValueError(f"{path} was encoded by tokenizer {describe_tokenizer(theirs, hashes=True)}, this run uses "
                         f"{describe_tokenizer(ours, hashes=True)}: use another --out folder")  # fmt: skip
    for key in ("image_size", "num_shards", "shard_size", "flip", "images"):
        if found.get(key, "False") != expected[key]:  # shards of before --store-images hold none
            raise ValueError(f"{path} has {key} = {found.get(key)} but this run uses {expected[key]}: "
                             "use another --out folder or the same options")  # fmt: skip
    if found.get(FEATURES_METADATA, "") != expected[FEATURES_METADATA]:
        theirs = found.get(FEATURES_METADATA) or "no features"
        raise ValueError(f"{path} holds {theirs}, this run stores {expected[FEATURES_METADATA] or 'none'} "
                         "(--store-features, --features-patch-size, --features-dtype): use another --out folder or "
                         "the same options")  # fmt: skip


def channel_moments(z: torch.Tensor) -> tuple[float, torch.Tensor, torch.Tensor]:
    """(count, mean, M2) per channel of (n, V, C, h, w) latents, in float64."""
    channels = z.transpose(0, 2).reshape(z.shape[2], -1).double()  # (C, V*n*h*w)
    mean = channels.mean(1)
    return float(channels.shape[1]), mean.cpu(), (channels - mean[:, None]).pow(2).sum(1).cpu()


@torch.no_grad()
def encode_shard(tokenizer, images: Dataset, batch_size: int, num_workers: int, flip: bool, dtype: torch.dtype,
                 progress=None, store_images: bool = False, features=None) -> dict[str, torch.Tensor]:  # fmt: skip
    """Encodes every image of `images` (and its mirror when flip) into one shard's tensors; with store_images the
    images too, as uint8; with `features` ((FrozenEncoder, storage dtype)) the encoder's features of each view."""
    loader = DataLoader(images, batch_size=batch_size, num_workers=num_workers, shuffle=False)
    latents, labels, moments, pixels, feats = [], [], [], [], []
    for x, y in loader:
        # As the tokenizer sees them: a float source's [-1, 1] back to 0..255.
        uint8 = x if x.dtype == torch.uint8 else ((x + 1) * 127.5).round().clamp(0, 255).to(torch.uint8)
        if store_images:
            pixels.append(uint8)
        if features is not None:  # from the uint8 image, as the encoder sees a stored one on the fly
            feats.append(encode_views(*features, uint8, flip))
        x, n = images_to_float(x), x.shape[0]  # an image folder's uint8 -> [-1, 1]
        # One call for the image and its mirror: twice the batch, better use of the GPU.
        z = tokenizer.encode(torch.cat([x, x.flip(-1)]) if flip else x)  # (V*n, C, h, w)
        z = z.view(-1, n, *z.shape[1:]).transpose(0, 1)  # (n, V, C, h, w)
        stored = z.to(dtype)
        if not torch.isfinite(stored).all():
            raise ValueError(f"latents overflow {dtype} (max |z| = {z.abs().max():.3g}): use --dtype float32")
        moments.append(channel_moments(stored))  # of what the dataset will read: the stored values
        latents.append(stored.cpu())
        labels.append(torch.as_tensor(y, dtype=torch.long))
        if progress is not None:
            progress.update(n)
    count, mean, m2 = combine_moments(moments)
    return {
        **({"images": torch.cat(pixels).contiguous()} if store_images else {}),
        **({"features": torch.cat(feats).contiguous()} if features is not None else {}),
        "latents": torch.cat(latents).contiguous(),
        "labels": torch.cat(labels),
        "stats_count": torch.tensor(count, dtype=torch.float64),
        "stats_mean": mean,
        "stats_m2": m2,
    }


def encode_views(encoder, dtype: torch.dtype, pixels: torch.Tensor, flip: bool) -> torch.Tensor:
    """The encoder's features of uint8 images (n, 3, H, W) and, with flip, of their mirrors, in one call: (n, V, T, D)
    in `dtype` on the CPU. The images go to [-1, 1] as the device takes a stored one (`images_to_float`), so these
    are the features the encoder computes on the fly from the image --store-images keeps.

    Raises:
        ValueError: a feature overflows `dtype`, naming --features-dtype.
    """
    x = images_to_float(pixels.to(encoder.mean.device))
    z = encoder(torch.cat([x, x.flip(-1)]) if flip else x)  # (V n, T, D) float32
    z = z.view(-1, pixels.shape[0], *z.shape[1:]).transpose(0, 1)  # (n, V, T, D)
    stored = z.to(dtype)
    if not torch.isfinite(stored).all():
        raise ValueError(f"features overflow {dtype} (max |z| = {z.abs().max():.3g}): use --features-dtype float32")
    return stored.cpu()


def feature_encoder(encoder_path: str, tokenizer, image_size: int, patch_size: int):
    """--store-features' encoder on the tokenizer's device, at the token grid of a DiT of `patch_size` on these
    latents; bf16 on CUDA, as a bf16 run's encoder computes.

    Raises:
        FileNotFoundError, ValueError: the encoder's file is missing or not DINOv2 weights, or the latent side is
            not a multiple of --features-patch-size (each names the flag).
    """
    from torchtitan.alignment.encoder import build_encoder
    from torchtitan.job_config import Alignment

    latent = image_size // tokenizer.downsample
    if patch_size <= 0 or latent % patch_size:
        raise ValueError(f"--features-patch-size {patch_size}: the latents are {latent} x {latent} "
                         f"(--image-size {image_size} / downsample {tokenizer.downsample}); a DiT's patch size "
                         "divides their side")  # fmt: skip
    try:
        return build_encoder(Alignment(encoder_path=encoder_path), latent // patch_size, tokenizer.device,
                             bf16=tokenizer.device.type == "cuda", compile=False)  # fmt: skip
    except (FileNotFoundError, ValueError) as e:
        raise type(e)(f"--store-features {encoder_path}: {e}") from e


def _write_atomic(tensors: dict, metadata: dict, path: Path) -> None:
    from safetensors.torch import save_file

    tmp = path.with_name(path.name + ".tmp")
    save_file(tensors, str(tmp), metadata=metadata)
    os.replace(tmp, path)  # atomic: a shard that exists is complete


def prepare_latents(source: Dataset, out: str | Path, tokenizer, *, image_size: int, num_classes: int,
                    classes: list[str] | None = None, shard_size: int = 4096, batch_size: int = 64,
                    num_workers: int = 0, flip: bool = True, normalization: str = "channel",
                    scale_factor: float = 0.18215, dtype: str = "float16", max_shards: int = 0, rank: int = 0,
                    world_size: int = 1, description: str = "", store_images: bool = False,
                    store_features: str = "", features_patch_size: int = 2,
                    features_dtype: str = "float16") -> bool:  # fmt: skip
    """Encodes `source` ((image (3, H, W) in [-1, 1] or uint8, label) pairs, unflipped) into shards under `out`;
    with `store_images` the uint8 images too, with `store_features` (a DINOv2 file, as alignment.encoder_path) the
    encoder's features of each view at the token grid of a DiT of `features_patch_size`, in `features_dtype`.

    Every shard and meta.json record the sha256 of the tokenizer's encoder and decoder in its folder
    (`tokenizer_record`): a resume refuses shards of another tokenizer, and every later decoding checks the decoder
    (`check_tokenizer_matches`); a folder without the decoder file records none for it, and a warning says so.

    Returns:
        True when the folder is complete (meta.json written), False when shards are still missing
        (stopped by max_shards, or another rank's shards are not there yet).
    """
    check_image_size(tokenizer, image_size)
    features, record_of_features = None, None
    if store_features:
        from torchtitan.alignment.features import features_record

        encoder = feature_encoder(store_features, tokenizer, image_size, features_patch_size)
        features = (encoder, STORAGE_DTYPES[features_dtype])
        record_of_features = features_record(store_features, encoder, features[1])
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    num_shards = math.ceil(len(source) / shard_size)
    record = tokenizer_record(tokenizer)
    mine = list(range(rank, num_shards, world_size))
    pending = []
    for index in mine:
        metadata = _shard_metadata(record, index, num_shards, shard_size, image_size, flip, store_images,
                                   record_of_features)  # fmt: skip
        path = out / shard_name(index)
        if path.is_file():
            _check_existing(path, metadata)
            logger.info(f"skipped shard {index} (already complete: {path})")
        else:
            pending.append((index, path, metadata))
    if max_shards > 0:
        pending = pending[:max_shards]
    from tqdm import tqdm

    total = sum(min(shard_size, len(source) - i * shard_size) for i, _, _ in pending)
    progress = tqdm(total=total, desc=f"encoding {len(pending)} shard(s)", unit="img", disable=rank != 0)
    for index, path, metadata in pending:
        start = time.perf_counter()
        first = index * shard_size
        subset = Subset(source, range(first, min(first + shard_size, len(source))))
        tensors = encode_shard(tokenizer, subset, batch_size, num_workers, flip, STORAGE_DTYPES[dtype], progress,
                               store_images, features)  # fmt: skip
        tensors["indices"] = torch.arange(first, first + len(subset))
        _write_atomic(tensors, metadata, path)
        logger.info(f"encoded shard {index} ({len(subset)} images) in {time.perf_counter() - start:.1f}s: {path}")
    progress.close()
    if dist.is_initialized():
        dist.barrier()
    complete = all((out / shard_name(i)).is_file() for i in range(num_shards))
    if rank == 0:
        if complete:
            meta = build_meta(out, num_shards, record, image_size, num_classes, classes, flip, dtype,
                              normalization, scale_factor, description)  # fmt: skip
            meta["images"] = store_images
            if record_of_features is not None:
                meta["features"] = record_of_features
            if record["decoder_sha256"] is None:
                logger.warning(f"no decoder file in the tokenizer folder {str(tokenizer.checkpoint_dir)!r}: meta.json "
                               "records no decoder hash; decoding is checked by kind, channels and downsample "
                               "alone")  # fmt: skip
            tmp = out / (META_FILE + ".tmp")
            tmp.write_text(json.dumps(meta, indent=1))
            os.replace(tmp, out / META_FILE)
            logger.info(f"wrote {out / META_FILE}: {meta['num_images']} images in {num_shards} shards")
        else:
            missing = sum(not (out / shard_name(i)).is_file() for i in range(num_shards))
            logger.info(f"{missing} of {num_shards} shards still missing: run again to resume")
    return complete


def build_meta(out: Path, num_shards: int, record: dict, image_size: int, num_classes: int, classes, flip: bool,
               dtype: str, normalization: str, scale_factor: float, description: str) -> dict:  # fmt: skip
    """meta.json's content: the tokenizer `record`, dataset facts and the normalization, from the shards' stored
    moments."""
    from safetensors import safe_open

    parts, num_images, latent_size = [], 0, 0
    for i in range(num_shards):
        with safe_open(str(out / shard_name(i)), "pt") as f:
            parts.append((f.get_tensor("stats_count").item(), f.get_tensor("stats_mean"), f.get_tensor("stats_m2")))
            shape = f.get_slice("latents").get_shape()
            num_images += shape[0]
            latent_size = shape[-1]
    count, mean, m2 = combine_moments(parts)
    std = moments_std(count, m2)
    if normalization == "channel":
        norm = LatentNormalization("channel", mean.tolist(), std.clamp_min(1e-6).tolist(), 1.0)
    else:
        norm = LatentNormalization("scale", mean.tolist(), std.tolist(), scale_factor)
    return {
        "format": FORMAT,
        "description": description,
        "tokenizer": record,
        "image_size": image_size,
        "latent_size": latent_size,
        "num_images": num_images,
        "num_classes": num_classes,
        "classes": classes or [],
        "flip": flip,
        "dtype": dtype,
        "num_shards": num_shards,
        # mean/std are always the measured per-channel statistics; mode says which map the dataset applies.
        "normalization": norm.to_dict(),
    }


def check_prepare_args(args: argparse.Namespace) -> None:
    """Raises ValueError naming the flag of a shared option no preparation can use (before the source is read)."""
    for flag in ("shard_size", "batch_size", "features_patch_size"):
        if getattr(args, flag) <= 0:
            raise ValueError(f"--{flag.replace('_', '-')} {getattr(args, flag)}: must be > 0")
    for flag in ("num_workers", "max_shards"):
        if getattr(args, flag) < 0:
            raise ValueError(f"--{flag.replace('_', '-')} {getattr(args, flag)}: must be >= 0")
    if args.normalization == "scale" and not (math.isfinite(args.scale_factor) and args.scale_factor > 0):
        raise ValueError(f"--scale-factor {args.scale_factor}: must be a finite number > 0 with --normalization scale")


def check_image_size(tokenizer, image_size: int) -> None:
    """Refuses an image side the tokenizer cannot take whole (a partial latent cell decodes to a larger image)."""
    f = tokenizer.downsample
    if image_size % f:
        lower, upper = image_size // f * f, (image_size // f + 1) * f
        sizes = f"{lower} or {upper}" if lower else f"{upper}"
        raise ValueError(f"image size {image_size} (--image-size) is not a multiple of the downsample factor {f} of "
                         f"{tokenizer.describe()}: use {sizes}")  # fmt: skip


def exit_code_of(prepare: Callable[[], int]) -> int:
    """Runs a prepare.py body; a user's error becomes one `error: ...` line on stderr and exit code 2.

    FileNotFoundError, ValueError and RuntimeError (a missing folder, a bad option, a broken tokenizer
    file) name the file or flag at fault. A traceback would say no more, and under torchrun its summary shows
    only "To enable traceback see ...".
    """
    try:
        return prepare()
    except (FileNotFoundError, ValueError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def run_prepare(args: argparse.Namespace, source: Dataset, image_size: int, num_classes: int,
                classes: list[str] | None, description: str) -> int:  # fmt: skip
    """Loads the tokenizer's encoder on this rank's device and prepares `source` into `args.out`; the exit code."""
    from torchtitan.datasets.tokenizers import load_tokenizer

    rank, world, device = init_distributed()
    try:
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        tokenizer = load_tokenizer(args.tokenizer, args.checkpoint_dir, device, dtype, parts=("encoder",))
        if rank == 0:
            logger.info(f"{description}: {len(source)} images -> {tokenizer.describe()} on {world} rank(s)")
        prepare_latents(source, args.out, tokenizer, image_size=image_size, num_classes=num_classes,
                        classes=classes, shard_size=args.shard_size, batch_size=args.batch_size,
                        num_workers=args.num_workers, flip=not args.no_flip, normalization=args.normalization,
                        scale_factor=args.scale_factor, dtype=args.dtype, max_shards=args.max_shards, rank=rank,
                        world_size=world, description=description, store_images=args.store_images,
                        store_features=args.store_features, features_patch_size=args.features_patch_size,
                        features_dtype=args.features_dtype)  # fmt: skip
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0
