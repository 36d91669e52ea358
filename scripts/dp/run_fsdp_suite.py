"""Suite (b): DP modes against non-private training under FSDP on several GPUs, across sequence lengths.

    python scripts/dp/run_fsdp_suite.py --nproc 2 [--tokens "1024 2304 4096"] [--batch-sizes 16]
        [--modes "no_dp ghost flash flash_bookkeeping"] [--output-dir outputs/dp_fsdp_suite] [train.py flags ...]

Every (tokens, batch, mode) is one torchrun of train.py over --nproc processes with FSDP (shard degree
nproc). Token counts set the input size: with DiT-L/8's patch 8, 1024, 2304 and 4096 tokens are 256, 384
and 512 pixels a side. "no_dp" is non-private training (--dp.enable false) with the same settings. Each
run writes its folder under <output dir>/runs/<mode>_t<tokens>_bs<B>/, and the suite writes
<output dir>/<mode>_t<tokens>_bs<B>.json (fields in scripts/dp/common.py: step time and images/s are medians
over the warm steps; memory and the breakdown are rank 0's), then the plots (memory, time and overhead against
tokens) and summary.txt of scripts/dp/visualize.py. Runs already ok are kept unless --force.
"""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from scripts.dp import common  # noqa: E402  (needs the repository root on the path)
from scripts.lib import words  # noqa: E402

MODES = ("no_dp", "ghost", "flash", "flash_bookkeeping")


def add_args(parser) -> None:
    """Suite (b)'s own options."""
    parser.add_argument("--nproc", type=int, default=2, help="processes (GPUs) per run, FSDP over all of them")
    parser.add_argument("--tokens", default="1024 2304 4096", help="tokens per image (squares), space separated")
    parser.add_argument("--modes", default=" ".join(MODES), help="no_dp (non-private) and dp.mode values")
    parser.add_argument("--batch-sizes", default="16", help="local batch sizes, space or comma separated")
    parser.add_argument("--output-dir", default="outputs/dp_fsdp_suite")


def main(argv: list[str] | None = None) -> int:
    # 16 images and 20 steps: the measured setting (docs/benchmark_log.md)
    opts, extra = common.parse_suite_args(argv, __doc__, 20, add_args)
    if opts.nproc < 2:
        raise SystemExit("--nproc must be at least 2: FSDP shards over several processes")
    modes = common.check_modes(words(opts.modes), "no_dp")
    _, patch = common.model_shape(opts.config, extra)
    points = [common.suite_knobs("fsdp", mode, int(b), common.input_size_for(int(t), patch), int(t), opts.nproc)
              for t in words(opts.tokens) for b in words(opts.batch_sizes) for mode in modes]  # fmt: skip
    results = common.run_suite(points, extra, opts, f"{len(points)} runs over {opts.nproc} processes (FSDP)")
    if not opts.dry_run:
        common.finish(results, opts)
    return 0


if __name__ == "__main__":
    sys.exit(main())
