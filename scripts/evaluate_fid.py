"""ADM's five numbers (FID, sFID, Inception Score, precision, recall) of generated samples against a reference batch.

    python scripts/evaluate_fid.py --samples samples.npz --reference VIRTUAL_imagenet256_labeled.npz \
        --inception-weights pt_inception-2015-12-05-6726825d.pth

`--samples`: `arr_0` (N, H, W, 3) uint8, as `sample.py --npz` writes. `--reference`: an ADM reference batch
(`arr_0` images for precision and recall, `mu`/`sigma` and `mu_s`/`sigma_s` statistics of the whole dataset) or
another sample .npz. The numbers go to stderr as the evaluator prints them, and one JSON line to stdout. The
Inception weights are read from a local file; see torchtitan/tools/fid.py, torchtitan/tools/adm_metrics.py and
docs/latent.md.
"""

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root, when run as a script

from torchtitan.tools.adm_metrics import METRICS, evaluate  # noqa: E402
from torchtitan.tools.fid import build_inception, read_eval_batch  # noqa: E402
from torchtitan.tools.sample_shards import stored_settings  # noqa: E402

LABELS = {"inception_score": "Inception Score", "fid": "FID", "sfid": "sFID", "precision": "Precision",
          "recall": "Recall"}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="FID, sFID, IS, precision and recall of samples, as ADM's evaluator.")
    parser.add_argument("--samples", required=True, help=".npz with arr_0 images (or mu/sigma: FID and sFID only)")
    parser.add_argument("--reference", required=True, help=".npz with arr_0 images and/or mu/sigma (and mu_s/sigma_s)")
    parser.add_argument("--inception-weights", required=True, help="local FID Inception state dict (.pth)")
    parser.add_argument("--dims", type=int, default=2048,
                        help="2048: pool_3, all five numbers; 64/192/768: FID of an earlier block only")  # fmt: skip
    parser.add_argument("--batch-size", type=int, default=None, help="images an Inception batch (500 on a GPU, 100 on "
                        "the CPU)")  # fmt: skip
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--save-stats", default="", help="also write the samples' mu/sigma (mu_s/sigma_s) to this .npz")
    args = parser.parse_args(argv)
    batch_size = args.batch_size or (100 if args.device == "cpu" else 500)
    start = time.perf_counter()
    try:
        for path in (args.samples, args.reference):  # before any Inception pass, which may take minutes
            if not Path(path).is_file():
                raise FileNotFoundError(f"{path} does not exist")
        settings = stored_settings(args.samples)
        model = build_inception(args.inception_weights, args.device, args.dims)
        # ADM reads the reference's images even beside stored statistics: precision and recall need them.
        reference = read_eval_batch(args.reference, model, batch_size, images=args.dims == 2048, progress=True)
        samples = read_eval_batch(args.samples, model, batch_size, progress=True)
        features_done = time.perf_counter()
        values, reasons = evaluate(samples, reference, model.logits_weight, args.device)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.save_stats:
        stats = dict(zip(("mu", "sigma"), samples.statistics, strict=True))
        if samples.spatial_statistics is not None:
            stats.update(zip(("mu_s", "sigma_s"), samples.spatial_statistics, strict=True))
        np.savez(args.save_stats, **stats)
    for name in METRICS:
        shown = values[name] if values[name] is not None else f"n/a ({reasons[name]})"
        print(f"{LABELS[name]}: {shown}", file=sys.stderr)
    num_samples = len(samples.pool) if samples.pool is not None else None
    end = time.perf_counter()
    print(json.dumps({**values, "samples": args.samples, "reference": args.reference, "num_samples": num_samples,
                      "dims": args.dims, "seconds": round(end - start, 1),
                      "inception_seconds": round(features_done - start, 1),
                      "metrics_seconds": round(end - features_done, 1), "settings": settings}))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
