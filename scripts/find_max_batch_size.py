"""Largest local batch size that trains: start from the memory estimate, then probe and bisect.

Each probe runs a few real steps in a fresh process (scripts/benchmark.py), so one OOM cannot poison the
next probe. Example:

    python scripts/find_max_batch_size.py --config train_configs/dit_xl2_latent256.toml --steps 3 \
        [--nproc 4] [--start 64] [--limit 1024] [-- --activation_checkpoint.mode selective]

The search itself lives in torchtitan/tools/batch_size_finder.py (the trainer's
`--training.local_batch_size auto` uses it too); its names stay importable from here.
"""

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from torchtitan.tools.batch_size_finder import (  # noqa: E402
    Probe,
    ProbeFailed,
    benchmark_probe,
    estimated_start,
    find_max_batch_size,
    find_max_local_batch_size,
)

__all__ = ["Probe", "ProbeFailed", "benchmark_probe", "estimated_start",
           "find_max_batch_size", "find_max_local_batch_size", "main"]  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="TOML config the probes train")
    parser.add_argument("--nproc", type=int, default=1, help="processes per probe (torchrun)")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per probe (after 1 warmup step)")
    parser.add_argument("--start", type=int, default=0, help="first batch (default: from the memory estimate)")
    parser.add_argument("--limit", type=int, default=4096, help="largest batch to try")
    parser.add_argument("--memory-gib", type=float, default=0.0, help="device memory (default: GPU 0's)")
    parser.add_argument("--json-out", default="", help="also write the result here")
    args, train_args = parser.parse_known_args(argv)
    train_args = [a for a in train_args if a != "--"]
    result = find_max_local_batch_size(args.config, train_args, args.nproc, args.steps, args.start, args.limit,
                                       args.memory_gib)  # fmt: skip
    peak = result["peak_memory_gib"]
    memory = f", peak memory {peak:.2f} GiB" if peak is not None else ""
    print(f"largest local batch that runs: {result['batch']}{memory} "
          f"(start {result['start']}, {len(result['probes'])} probes)")  # fmt: skip
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
