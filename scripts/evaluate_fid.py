"""FID between generated samples and a reference, both .npz in ADM's format.

    python scripts/evaluate_fid.py --samples samples.npz --reference VIRTUAL_imagenet256_labeled.npz \
        --inception-weights pt_inception-2015-12-05-6726825d.pth

`--samples`: `arr_0` (N, H, W, 3) uint8, as `sample.py --npz` writes. `--reference`: ADM reference
statistics (`mu`, `sigma`) or another sample .npz (its `arr_0` is run through the network).
The Inception weights are read from a local file; see torchtitan/tools/fid.py and docs/latent.md.
"""

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root, when run as a script

from torchtitan.tools.fid import build_inception, frechet_distance, load_statistics  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="FID of generated samples against a reference.")
    parser.add_argument("--samples", required=True, help=".npz with arr_0 images (or mu/sigma)")
    parser.add_argument("--reference", required=True, help=".npz with mu/sigma or arr_0 images")
    parser.add_argument("--inception-weights", required=True, help="local FID Inception state dict (.pth)")
    parser.add_argument("--dims", type=int, default=2048, help="feature block: 2048 (pool3, standard) or 64/192/768")
    parser.add_argument("--batch-size", type=int, default=50)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--save-stats", default="", help="also write the samples' mu/sigma to this .npz")
    args = parser.parse_args(argv)
    try:
        model = build_inception(args.inception_weights, args.device, args.dims)
        mu1, sigma1 = load_statistics(args.samples, model, args.batch_size)
        mu2, sigma2 = load_statistics(args.reference, model, args.batch_size)
        fid = frechet_distance(mu1, sigma1, mu2, sigma2)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.save_stats:
        np.savez(args.save_stats, mu=mu1, sigma=sigma1)
    print(json.dumps({"fid": fid, "samples": args.samples, "reference": args.reference, "dims": args.dims}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
