"""Warm steady-state training throughput: images/s, TFLOP/s, MFU and peak memory per case.

Each case runs in a fresh process (`python -m torchtitan.measure`, launched by torchtitan.tools.runs) with the
trainer's own train_step() and the trainer's own MFU formula; the step time is the median of the timed steps.
DP-SGD cases are cases like any other (`--dp.enable true --dp.mode flash_bookkeeping`). Example:

    python scripts/benchmark.py --config train_configs/dit_xl2_latent256.toml \
        --case "bs256=--training.local_batch_size 256" --case "eager=--compile.enable false" --warmup 5 --steps 20

Each case is timed twice: each step to a device sync (the median: "step ms"), and the same number of steps back to
back as training runs them ("streamed ms"), with the share of those the host waited for data ("data %").
`--data config` measures on the config's own dataset (an image folder of JPEGs, say) instead of generated
batches, and adds the loader's own images/s per worker. `--profile` then profiles each case's warm steps: the
top CUDA kernels and where the GPU waited, then where the host's time went by op; `--profile-dir` keeps each
case's tables and trace.
"""

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from scripts.lib import parse_case, result_table  # noqa: E402
from torchtitan.tools.runs import launch  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="TOML config every case starts from")
    parser.add_argument("--case", action="append", default=[], help="NAME=OVERRIDES (train.py flags); repeatable")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--nproc", type=int, default=1, help="processes per case (torchrun)")
    parser.add_argument("--timeout", type=float, default=None, help="seconds a case may take")
    parser.add_argument("--json-out", default="", help="also write the results here")
    parser.add_argument("--profile", action="store_true", help="then profile each case: its top CUDA kernels, where "
                        "the GPU waited, where the host's time went (torchtitan.measure.print_profile)")  # fmt: skip
    parser.add_argument("--profile-dir", default="", help="as --profile, and write each case's profile.md and "
                        "trace.json.gz (Perfetto) into PROFILE_DIR/<case>/")  # fmt: skip
    parser.add_argument("--data", choices=["dummy", "config"], default="dummy",
                        help="dummy: generated batches of the model's shape (no I/O); config: the config's own "
                             "dataset and loader, whose rate alone is reported too")  # fmt: skip
    args = parser.parse_args(argv)
    results = []
    for case in args.case or ["default="]:
        run = parse_case(case, args.config, args.nproc)
        profile_dir = str(Path(args.profile_dir) / run.name) if args.profile_dir else None
        outcome = launch(run, args.warmup, args.steps, args.timeout, args.profile, own_data=args.data == "config",
                         profile_dir=profile_dir)  # fmt: skip
        results.append({"name": run.name, "status": outcome.status, **outcome.result})
        if not outcome.ok:
            print(outcome.output[-3000:], file=sys.stderr)
        elif args.profile or args.profile_dir:
            print("\n".join(line for line in outcome.output.splitlines() if not line.startswith("MEASURE_RESULT")))
        print(json.dumps(results[-1]), flush=True)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(results, indent=1))
    print(result_table(results))


if __name__ == "__main__":
    main()
