"""Suite (a): each DP mode against non-private training on one GPU, DiT-L/8 on 256x256 pixels (1024 tokens).

    python scripts/dp/run_dp_suite.py [--batch-sizes "2 16"] [--modes "vanilla ghost ..."] [--steps 8]
        [--output-dir outputs/dp_suite] [--find-max-batch] [--dry-run] [train.py flags ...]

For every batch size, each mode trains in its own process (train.py, the config's settings, the memory
breakdown on for the first --breakdown-steps steps): "vanilla" is non-private training (--dp.enable false),
the others are DP-SGD with that dp.mode. Each run writes its folder under <output dir>/runs/<mode>_bs<B>/,
and the suite writes <output dir>/<mode>_bs<B>.json (see scripts/dp/common.py for the fields: step time and
images/s are medians over the warm steps), then the plots and summary.txt of scripts/dp/visualize.py. Runs
already ok are kept unless --force.

--find-max-batch: per mode, the largest local batch that trains, found by the batch-size finder's bisection
(torchtitan/tools/batch_size_finder.py, through scripts/lib's `batch_probe` and `search`) over probes that
are runs of this suite (fresh processes, --probe-steps steps, no breakdown), recorded under
<output dir>/find_max/. Peak memory is affine in the batch, so a line through the measured peaks of the
suite's smallest and largest batch predicts the largest batch; the search stays within --find-max-margin of
that prediction (few probes). A result at the top of that window, with no OOM above it, is only a lower bound
(`lower_bound: true`). Writes <output dir>/max_batch.json.
"""

import json
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from scripts.dp import common, visualize  # noqa: E402  (needs the repository root on the path)
from scripts.lib import batch_probe, device_memory_gib, search, words  # noqa: E402
from torchtitan.tools.batch_size_finder import Probe  # noqa: E402
from torchtitan.tools.batch_size_finder import predicted_max_batch as finder_prediction  # noqa: E402

MODES = ("vanilla", "ghost", "flash", "bookkeeping", "flash_bookkeeping")


def predicted_max_batch(results: list[dict], memory_gib: float | None) -> float | None:
    """The batch at which a line through the peaks of the smallest and largest ok batch reaches memory_gib (the
    finder's `predicted_max_batch` over the suite's results)."""
    probes = [Probe(r["batch"], r["status"], r.get("peak_memory_gib")) for r in results]
    return finder_prediction(probes, memory_gib)


def search_window(results: list[dict], memory_gib: float | None, limit: int, multiple_of: int,
                  margin: float) -> tuple[int, int, float | None]:  # fmt: skip
    """(start, limit, prediction) of the finder for one mode: around the prediction, else from the largest ok batch."""
    predicted = predicted_max_batch(results, memory_gib)
    if predicted is None:
        return max((r["batch"] for r in results if r["status"] == "ok"), default=multiple_of), limit, None
    start = max(multiple_of, math.floor(predicted * (1 - margin) / multiple_of) * multiple_of)
    top = max(start + multiple_of, math.ceil(predicted * (1 + margin) / multiple_of) * multiple_of)
    return min(start, limit), min(top, limit), predicted


def find_max_batches(results: list[dict], modes: list[str], input_size: int, tokens: int, out: Path,
                     extra: list[str], opts) -> dict:  # fmt: skip
    """The largest local batch per mode, probed by short suite runs under out/find_max/; writes and returns
    max_batch.json's content."""
    memory = opts.memory_gib or device_memory_gib()
    report = {"memory_gib": memory, "multiple_of": opts.find_max_multiple_of, "probe_steps": opts.probe_steps,
              "modes": {}}  # fmt: skip
    for mode in modes:
        mine = [r for r in results if r["mode"] == mode]
        start, top, predicted = search_window(mine, memory, opts.find_max_limit, opts.find_max_multiple_of,
                                              opts.find_max_margin)  # fmt: skip

        def run_at(batch: int, mode: str = mode):  # no breakdown: every probe step's peak is true
            knobs = common.suite_knobs("dp", mode, batch, input_size, tokens)
            return common.suite_run(knobs, opts.config, opts.probe_steps, 0, extra)

        probe = batch_probe(run_at, out / "find_max", opts.timeout or None, opts.force)
        entry = {"limit": top, "predicted": predicted, **search(probe, start, top, opts.find_max_multiple_of)}
        report["modes"][mode] = entry
        bound = "at least " if entry.get("lower_bound") else ""
        print(f"largest batch of {mode}: {bound}{entry['batch']} (window {start}..{top})", flush=True)
    (out / "max_batch.json").write_text(json.dumps(report, indent=1))
    return report


def add_args(parser) -> None:
    """Suite (a)'s own options."""
    parser.add_argument("--modes", default=" ".join(MODES), help="vanilla (non-private) and dp.mode values")
    parser.add_argument("--batch-sizes", default="2 16", help="local batch sizes, space or comma separated")
    parser.add_argument("--output-dir", default="outputs/dp_suite")
    parser.add_argument("--find-max-batch", action="store_true", help="also find each mode's largest batch")
    parser.add_argument("--find-max-limit", type=int, default=4096, help="largest batch the finder tries")
    parser.add_argument("--find-max-multiple-of", type=int, default=1, help="batch granularity of the search")
    parser.add_argument("--find-max-margin", type=float, default=0.1,
                        help="search within this fraction of the predicted largest batch")  # fmt: skip
    parser.add_argument("--probe-steps", type=int, default=2,
                        help="steps per probe (2: the optimizer states exist in the second)")  # fmt: skip
    parser.add_argument("--memory-gib", type=float, default=0.0, help="device memory (default: GPU 0's)")


def main(argv: list[str] | None = None) -> int:
    opts, extra = common.parse_suite_args(argv, __doc__, 8, add_args)
    modes = common.check_modes(words(opts.modes), "vanilla")
    input_size, patch = common.model_shape(opts.config, extra)
    tokens = (input_size // patch) ** 2
    points = [common.suite_knobs("dp", mode, int(b), input_size, tokens) for b in words(opts.batch_sizes)
              for mode in modes]  # fmt: skip
    results = common.run_suite(
        points, extra, opts, f"{len(points)} runs, {tokens} tokens ({input_size}px, patch {patch})"
    )
    if not opts.dry_run and opts.find_max_batch:
        find_max_batches(results, modes, input_size, tokens, Path(opts.output_dir), extra, opts)
    if not opts.dry_run:
        visualize.finish(results, opts)
    return 0


if __name__ == "__main__":
    sys.exit(main())
