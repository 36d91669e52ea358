"""Suite (b): DP modes against non-private training under FSDP on several GPUs, across sequence lengths.

    python scripts/dp/run_fsdp_suite.py --nproc 2 [--tokens "1024 2304 4096"] [--batch-sizes 16]
        [--modes "no_dp ghost flash flash_bookkeeping"] [--output-dir outputs/dp_fsdp_suite] [train.py flags ...]

Every (tokens, batch, mode) is one torchrun of train.py over --nproc processes with FSDP (shard degree
nproc). Token counts set the input size: with DiT-L/8's patch 8, 1024, 2304 and 4096 tokens are 256, 384
and 512 pixels a side. "no_dp" is non-private training (--dp.enable false) with the same settings. Each
run writes its folder under <output dir>/runs/<mode>_t<tokens>_bs<B>/, and the suite writes
<output dir>/<mode>_t<tokens>_bs<B>.json (fields in scripts/dp/common.py; memory and the breakdown are
rank 0's), then the plots (memory, time and overhead against tokens) and summary.txt of
scripts/dp/visualize.py. Runs already ok are kept unless --force.
"""

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from scripts.dp.common import (  # noqa: E402  (needs the repository root on the path)
    SuiteRun,
    add_common_args,
    check_common_args,
    check_modes,
    finish,
    input_size_for,
    model_shape,
    run_suite,
    split_extra,
    words,
)

MODES = ("no_dp", "ghost", "flash", "flash_bookkeeping")


def parse(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False
    )  # no abbreviations: a train.py flag is never taken for one of these options
    add_common_args(parser, steps=20)  # 16 images and 20 steps: the measured setting (docs/benchmarks.md)
    parser.add_argument("--nproc", type=int, default=2, help="processes (GPUs) per run, FSDP over all of them")
    parser.add_argument("--tokens", default="1024 2304 4096", help="tokens per image (squares), space separated")
    parser.add_argument("--modes", default=" ".join(MODES), help="no_dp (non-private) and dp.mode values")
    parser.add_argument("--batch-sizes", default="16", help="local batch sizes, space or comma separated")
    parser.add_argument("--output-dir", default="outputs/dp_fsdp_suite")
    opts, extra = parser.parse_known_args(argv)
    check_common_args(opts)
    if opts.nproc < 2:
        raise SystemExit("--nproc must be at least 2: FSDP shards over several processes")
    return opts, split_extra(extra)


def main(argv: list[str] | None = None) -> int:
    opts, extra = parse(argv)
    modes = check_modes(words(opts.modes), "no_dp")
    _, patch = model_shape(opts.config, extra)
    runs = [SuiteRun("fsdp", mode, int(b), input_size_for(int(t), patch), int(t), opts.nproc)
            for t in words(opts.tokens) for b in words(opts.batch_sizes) for mode in modes]  # fmt: skip
    out = Path(opts.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    print(f"{len(runs)} runs over {opts.nproc} processes (FSDP), {opts.steps} steps each -> {out}/")
    results = run_suite(runs, opts.config, out, extra, opts)
    if opts.dry_run:
        return 0
    finish(results, out, opts)
    return 0


if __name__ == "__main__":
    sys.exit(main())
