"""Decode latents with an image tokenizer from a local folder; the tokenizers themselves live in
`torchtitan.datasets.tokenizers` (re-exported here, so `cosmos_latent_decoder.load_tokenizer` keeps working).

The two kinds (`cosmos_jit`: NVIDIA Cosmos TorchScript files, each run in its saved dtype; `diffusers`: an
autoencoder folder) and what each command loads are described there; nothing is ever downloaded.

CLI, decode a latent file to a PNG grid:

    python cosmos_latent_decoder.py --checkpoint-dir DIR --latents FILE --out grid.png [--kind cosmos_jit]

FILE is `.safetensors` or `.pt` with a tensor under "latents" (or its only tensor), shaped (N, C, h, w),
(C, h, w), or (N, V, C, h, w) as in a prepared shard (view 0, the unflipped image, is decoded).

The file says what it holds, and the decoder follows it: a prepared shard records raw latents, a run's saved samples
(`samples/step-N.safetensors`) the normalization of the latents the model trained on; both record the tokenizer that
encoded them (its decoder's sha256). A file that records nothing (written by other code, or by TorchDiTan before its
files did) must be described by one flag: `--raw`, `--stats PREPARED_FOLDER` (normalized with its meta.json) or
`--scale-factor S` (z * S); on a file that records its normalization these flags are refused, as they could only
decode it wrongly.

The tokenizer is always checked against the one that encoded the latents, as the file records it, or else the
meta.json of `--stats` or the one beside FILE (its decoder's sha256, or for an older record its channels and
downsample): another is refused, and so are latents with no record, unless `--allow-tokenizer-mismatch` is given
(which changes the tokenizer only: the latents are still un-normalized as recorded).
"""

import argparse
import math
import sys
from pathlib import Path

import torch

from torchtitan.datasets.latent_tokenizer import check_tokenizer_matches, same_tokenizer
from torchtitan.datasets.latents import (
    META_FILE,
    LatentNormalization,
    file_normalization,
    file_tokenizer,
    normalization_for,
    read_file_metadata,
    read_meta,
)
from torchtitan.datasets.tokenizers import (  # noqa: F401  (the public API, re-exported)
    KINDS,
    PARTS,
    CosmosJITTokenizer,
    DiffusersTokenizer,
    LatentTokenizer,
    decode_for_training,
    load_tokenizer,
    load_training_decoder,
    read_latent_file,
    refuse_unsupported_cosmos,
)


def check_args(args: argparse.Namespace) -> None:
    """Raises ValueError naming the flag of an argument no run can use."""
    for flag in ("max_images", "batch_size"):
        if getattr(args, flag) <= 0:
            raise ValueError(f"--{flag.replace('_', '-')} {getattr(args, flag)}: must be > 0")
    if not math.isfinite(args.scale_factor) or args.scale_factor < 0:
        raise ValueError(f"--scale-factor {args.scale_factor}: must be a finite number >= 0 (0: not normalized)")


def latent_normalization(args: argparse.Namespace, metadata: dict) -> LatentNormalization:
    """How the file's latents map back to raw ones: as the file records, else as the one flag given says.

    Raises:
        ValueError: a flag on a file that records its normalization (it could only decode it wrongly), several flags,
            or none on a file that records nothing.
    """
    recorded = file_normalization(metadata)
    flags = [flag for flag, given in (("--raw", args.raw), ("--stats", bool(args.stats)),
                                      ("--scale-factor", args.scale_factor > 0)) if given]  # fmt: skip
    if recorded is not None:
        if flags:
            raise ValueError(f"--latents {args.latents} records {recorded.describe()}: {flags[0]} says how a file "
                             "that records nothing is normalized; drop it")  # fmt: skip
        return recorded
    if len(flags) > 1:
        raise ValueError(f"{' and '.join(flags)}: give one of --raw, --stats, --scale-factor")
    if not flags:
        raise ValueError(f"--latents {args.latents} does not record how its latents are normalized (a file of other "
                         "code, or of TorchDiTan before its files recorded it): say it with --raw (raw tokenizer "
                         "latents, as a prepared shard holds), --stats PREPARED_FOLDER (a latent DiT's samples, "
                         "normalized with the meta.json of the folder it trained on: its training.dataset_path) or "
                         "--scale-factor S (latents scaled by S)")  # fmt: skip
    if args.raw:
        return LatentNormalization("none")
    if args.scale_factor > 0:
        return normalization_for({}, args.scale_factor)
    return normalization_for(read_meta(_stats_folder(args.stats)))


def _stats_folder(stats: str) -> Path:
    path = Path(stats)
    return path.parent if path.is_file() else path  # a prepared folder or its meta.json


def check_tokenizer(args: argparse.Namespace, metadata: dict, tokenizer: LatentTokenizer) -> None:
    """Refuses a tokenizer other than the one that encoded the latents.

    The record is the file's own, else the meta.json of `--stats` or the one beside `--latents` (also when the file's
    record has no decoder hash, as a shard of format 1: meta.json's has one). Without any, nothing can be checked:
    refused unless `--allow-tokenizer-mismatch`.

    Raises:
        ValueError: naming the record's file and the values that disagree (`check_tokenizer_matches`), or the missing
            record.
    """
    from torchtitan.job_config import Latent
    from torchtitan.tools.logging import logger

    record, where = file_tokenizer(metadata), Path(args.latents)
    folder = _stats_folder(args.stats) if args.stats else Path(args.latents).parent
    if (record is None or not record["decoder_sha256"]) and (folder / META_FILE).is_file():
        meta = read_meta(folder)
        if record is None or same_tokenizer(record, meta["tokenizer"]):
            record, where = meta["tokenizer"], folder
    if record is None:
        if not args.allow_tokenizer_mismatch:
            raise ValueError(f"--latents {args.latents}: neither it nor a {META_FILE} beside it records the tokenizer "
                             f"that encoded these latents, so --checkpoint-dir {args.checkpoint_dir} cannot be checked "
                             "against it: give --allow-tokenizer-mismatch to decode unchecked")  # fmt: skip
        logger.warning(f"no record of the tokenizer of {args.latents}: the tokenizer is not checked (allowed)")
        return
    latent = Latent(tokenizer=args.kind, checkpoint_dir=args.checkpoint_dir,
                    allow_tokenizer_mismatch=args.allow_tokenizer_mismatch)  # fmt: skip
    check_tokenizer_matches({"tokenizer": record}, latent, tokenizer, source=where)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Decode latents with an image tokenizer to a PNG grid.")
    parser.add_argument("--checkpoint-dir", required=True, help="local tokenizer folder")
    parser.add_argument("--latents", required=True, help=".safetensors or .pt file of latents")
    parser.add_argument("--out", default="grid.png", help="PNG grid to write")
    parser.add_argument("--kind", default="cosmos_jit", choices=KINDS)
    parser.add_argument("--raw", action="store_true", help="a file that records nothing holds raw tokenizer latents")
    parser.add_argument("--stats", default="", help="prepared folder or meta.json: a file that records nothing holds "
                        "latents normalized with its statistics (and encoded by its tokenizer)")  # fmt: skip
    parser.add_argument("--scale-factor", type=float, default=0.0,
                        help="> 0: a file that records nothing holds latents z * this")  # fmt: skip
    parser.add_argument("--allow-tokenizer-mismatch", action="store_true",
                        help="decode even if the latents' record names another tokenizer or there is none")  # fmt: skip
    parser.add_argument("--max-images", type=int, default=64, help="decode at most this many")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)

    from torchtitan.tools.images import save_image_grid
    from torchtitan.tools.logging import init_logger

    init_logger()  # a mismatch allowed by --allow-tokenizer-mismatch is a logged warning
    try:
        check_args(args)
        z = read_latent_file(args.latents)[: args.max_images]
        metadata = read_file_metadata(args.latents)
        normalization = latent_normalization(args, metadata)
        device = torch.device(args.device)
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        tokenizer = load_tokenizer(args.kind, args.checkpoint_dir, device, dtype, parts=("decoder",))
        check_tokenizer(args, metadata, tokenizer)
        images = tokenizer.decode_batches(normalization.denormalize(z), args.batch_size)
    except (FileNotFoundError, ValueError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    path = save_image_grid(images, Path(args.out))
    print(f"decoded {len(images)} latents with {tokenizer.describe()} to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
