"""Decode latents with an image tokenizer from a local folder; the tokenizers themselves live in
`torchtitan.datasets.tokenizers` (re-exported here, so `cosmos_latent_decoder.load_tokenizer` keeps working).

The two kinds (`cosmos_jit`: NVIDIA Cosmos TorchScript files, each run in its saved dtype; `diffusers`: an
autoencoder folder) and what each command loads are described there; nothing is ever downloaded.

CLI, decode a latent file to a PNG grid:

    python cosmos_latent_decoder.py --checkpoint-dir DIR --latents FILE --out grid.png [--kind cosmos_jit]

FILE is `.safetensors` or `.pt` with a tensor under "latents" (or its only tensor), shaped (N, C, h, w),
(C, h, w), or (N, V, C, h, w) as in a prepared shard (view 0, the unflipped image, is decoded). Latents
are raw tokenizer output (what shards store) unless `--stats` names a prepared folder (or its meta.json)
or `--scale-factor` is given: then they are taken as normalized model-space latents (what a latent DiT
samples) and un-normalized first.

The tokenizer is always checked against the one that encoded the latents, as recorded in the meta.json of
`--stats` or else the one beside FILE (its decoder's sha256, or for an older meta.json its channels and
downsample): another is refused, and so are latents without a meta.json, which cannot be checked, unless
`--allow-tokenizer-mismatch` is given.
"""

import argparse
import math
import sys
from pathlib import Path

import torch

from torchtitan.datasets.latents import META_FILE, check_tokenizer_matches, read_meta
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


def check_tokenizer(args: argparse.Namespace, tokenizer: LatentTokenizer) -> dict | None:
    """Refuses a tokenizer other than the one that encoded the latents; returns the meta.json that says which.

    The record is the meta.json of `--stats`, else the one beside `--latents`. Without either nothing can be
    checked: refused unless `--allow-tokenizer-mismatch` (None is returned then).

    Raises:
        ValueError: naming the files and the values that disagree (`check_tokenizer_matches`), or the missing record.
    """
    from torchtitan.job_config import Latent
    from torchtitan.tools.logging import logger

    stats = Path(args.stats) if args.stats else None
    folder = (stats.parent if stats.is_file() else stats) if stats else Path(args.latents).parent
    if stats is None and not (folder / META_FILE).is_file():
        if not args.allow_tokenizer_mismatch:
            raise ValueError(f"--latents {args.latents}: no {META_FILE} beside it records the tokenizer that "
                             f"encoded these latents, so --checkpoint-dir {args.checkpoint_dir} cannot be checked "
                             "against it: give --stats PREPARED_FOLDER, or --allow-tokenizer-mismatch to decode "
                             "unchecked")  # fmt: skip
        logger.warning(f"no {META_FILE} beside {args.latents}: the tokenizer is not checked (allowed)")
        return None
    meta = read_meta(folder)
    latent = Latent(tokenizer=args.kind, checkpoint_dir=args.checkpoint_dir,
                    allow_tokenizer_mismatch=args.allow_tokenizer_mismatch)  # fmt: skip
    check_tokenizer_matches(meta, latent, tokenizer, source=str(folder))
    return meta


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Decode latents with an image tokenizer to a PNG grid.")
    parser.add_argument("--checkpoint-dir", required=True, help="local tokenizer folder")
    parser.add_argument("--latents", required=True, help=".safetensors or .pt file of latents")
    parser.add_argument("--out", default="grid.png", help="PNG grid to write")
    parser.add_argument("--kind", default="cosmos_jit", choices=KINDS)
    parser.add_argument("--stats", default="", help="prepared folder or meta.json: latents are normalized "
                        "(and were encoded by this tokenizer)")  # fmt: skip
    parser.add_argument("--scale-factor", type=float, default=0.0, help="> 0: latents are z * this")
    parser.add_argument("--allow-tokenizer-mismatch", action="store_true",
                        help="decode even if the latents' meta.json names another tokenizer or is missing")  # fmt: skip
    parser.add_argument("--max-images", type=int, default=64, help="decode at most this many")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)

    from torchtitan.datasets.latents import normalization_for
    from torchtitan.tools.images import save_image_grid
    from torchtitan.tools.logging import init_logger

    init_logger()  # a mismatch allowed by --allow-tokenizer-mismatch is a logged warning
    try:
        check_args(args)
        z = read_latent_file(args.latents)[: args.max_images]
        device = torch.device(args.device)
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        tokenizer = load_tokenizer(args.kind, args.checkpoint_dir, device, dtype, parts=("decoder",))
        meta = check_tokenizer(args, tokenizer)
        if args.scale_factor > 0:
            z = normalization_for({}, args.scale_factor).denormalize(z)
        elif args.stats:
            z = normalization_for(meta).denormalize(z)
        images = tokenizer.decode_batches(z, args.batch_size)
    except (FileNotFoundError, ValueError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    path = save_image_grid(images, Path(args.out))
    print(f"decoded {len(images)} latents with {tokenizer.describe()} to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
