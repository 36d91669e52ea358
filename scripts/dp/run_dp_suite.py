"""Suite (a): each DP mode against non-private training on one GPU, DiT-L/8 on 256x256 pixels (1024 tokens).

    python scripts/dp/run_dp_suite.py [--batch-sizes "2 16"] [--modes "vanilla ghost ..."] [--steps 8]
        [--output-dir outputs/dp_suite] [--find-max-batch] [--dry-run] [train.py flags ...]

For every batch size, each mode trains in its own process (train.py, the config's settings, the memory
breakdown on for the first --breakdown-steps steps): "vanilla" is non-private training (--dp.enable false),
the others are DP-SGD with that dp.mode. Each run writes its folder under <output dir>/runs/<mode>_bs<B>/,
and the suite writes <output dir>/<mode>_bs<B>.json (see scripts/dp/common.py for the fields), then the
plots and summary.txt of scripts/dp/visualize.py. Runs already ok are kept unless --force.

--find-max-batch: per mode, the largest local batch that trains, found by the batch-size finder's bisection
(scripts/find_max_batch_size.py) over probes that are runs of this suite (fresh processes, --probe-steps
steps, no breakdown), recorded under <output dir>/find_max/. Peak memory is affine in the batch, so a line
through the measured peaks of the suite's smallest and largest batch predicts the largest batch; the search
stays within --find-max-margin of that prediction (few probes). A result at the top of that window, with no
OOM above it, is only a lower bound (`lower_bound: true`). Writes <output dir>/max_batch.json.
"""

import argparse
import json
import math
import subprocess
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
    model_shape,
    run_args,
    run_one,
    run_suite,
    split_extra,
    summarize,
    words,
)
from scripts.find_max_batch_size import Probe, ProbeFailed, find_max_batch_size  # noqa: E402

MODES = ("vanilla", "ghost", "flash", "bookkeeping", "flash_bookkeeping")


def device_memory_gib() -> float | None:
    """GPU 0's memory, asked in a child process: CUDA in this one would hold memory that the runs need."""
    code = "import torch; print(torch.cuda.get_device_properties(0).total_memory if torch.cuda.is_available() else 0)"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    total = int(proc.stdout.strip() or 0) if proc.returncode == 0 else 0
    return total / 1024**3 or None


def predicted_max_batch(results: list[dict], memory_gib: float | None) -> float | None:
    """The batch at which a line through the peaks of the smallest and largest ok batch reaches memory_gib."""
    points = sorted((r["batch"], r["peak_memory_gib"]) for r in results if r["status"] == "ok" and
                    r.get("peak_memory_gib"))  # fmt: skip
    if not memory_gib or len(points) < 2:
        return None
    (b1, m1), (b2, m2) = points[0], points[-1]
    if b2 == b1 or m2 <= m1:
        return None
    return b1 + (memory_gib - m1) * (b2 - b1) / (m2 - m1)


def search_window(results: list[dict], memory_gib: float | None, limit: int, multiple_of: int,
                  margin: float) -> tuple[int, int, float | None]:  # fmt: skip
    """(start, limit, prediction) of the finder for one mode: around the prediction, else from the largest ok batch."""
    predicted = predicted_max_batch(results, memory_gib)
    if predicted is None:
        return max((r["batch"] for r in results if r["status"] == "ok"), default=multiple_of), limit, None
    start = max(multiple_of, math.floor(predicted * (1 - margin) / multiple_of) * multiple_of)
    top = max(start + multiple_of, math.ceil(predicted * (1 + margin) / multiple_of) * multiple_of)
    return min(start, limit), min(top, limit), predicted


def suite_probe(mode: str, input_size: int, tokens: int, config: str, out: Path, extra: list[str], opts):
    """A finder probe: this suite's run of `mode` at a batch, short and without the breakdown."""

    def probe(batch: int) -> Probe:
        run = SuiteRun("dp", mode, batch, input_size, tokens)
        run_dir = out / "find_max" / run.name
        run_one(run, config, run_args(run, opts.probe_steps, 0), run_dir, extra, opts.timeout or None, opts.force)
        result = summarize(run, run_dir, skip_steps=0)  # no breakdown steps: every step's peak is true
        return Probe(batch, result["status"], result.get("peak_memory_gib"), result)

    return probe


def find_max_batches(results: list[dict], modes: list[str], input_size: int, tokens: int, config: str, out: Path,
                     extra: list[str], opts) -> dict:  # fmt: skip
    """The largest local batch per mode; writes and returns max_batch.json's content."""
    memory = opts.memory_gib or device_memory_gib()
    report = {"memory_gib": memory, "multiple_of": opts.find_max_multiple_of, "probe_steps": opts.probe_steps,
              "modes": {}}  # fmt: skip
    for mode in modes:
        mine = [r for r in results if r["mode"] == mode]
        start, top, predicted = search_window(mine, memory, opts.find_max_limit, opts.find_max_multiple_of,
                                              opts.find_max_margin)  # fmt: skip
        entry = {"start": start, "limit": top, "predicted": predicted}
        probe = suite_probe(mode, input_size, tokens, config, out, extra, opts)
        try:
            best, history = find_max_batch_size(probe, start, top, opts.find_max_multiple_of)
        except ProbeFailed as e:  # a broken run must not pass for a memory limit
            entry.update(batch=None, error=str(e))
        else:
            oom_above = any(p.status == "OOM" and p.batch > best for p in history)
            peak = next((p.peak_memory_gib for p in history if p.ok and p.batch == best), None)
            entry.update(batch=best, lower_bound=not oom_above, peak_memory_gib=peak,
                         probes=[{"batch": p.batch, "status": p.status, "peak_memory_gib": p.peak_memory_gib}
                                 for p in history])  # fmt: skip
        report["modes"][mode] = entry
        bound = "at least " if entry.get("lower_bound") else ""
        print(f"largest batch of {mode}: {bound}{entry['batch']} (window {start}..{top})", flush=True)
    (out / "max_batch.json").write_text(json.dumps(report, indent=1))
    return report


def parse(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False
    )  # no abbreviations: a train.py flag is never taken for one of these options
    add_common_args(parser)
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
    opts, extra = parser.parse_known_args(argv)
    check_common_args(opts)
    return opts, split_extra(extra)


def main(argv: list[str] | None = None) -> int:
    opts, extra = parse(argv)
    modes = check_modes(words(opts.modes), "vanilla")
    input_size, patch = model_shape(opts.config, extra)
    tokens = (input_size // patch) ** 2
    runs = [SuiteRun("dp", mode, int(b), input_size, tokens) for b in words(opts.batch_sizes) for mode in modes]
    out = Path(opts.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    print(f"{len(runs)} runs, {tokens} tokens ({input_size}px, patch {patch}), {opts.steps} steps each -> {out}/")
    results = run_suite(runs, opts.config, out, extra, opts)
    if opts.dry_run:
        return 0
    if opts.find_max_batch:
        find_max_batches(results, modes, input_size, tokens, opts.config, out, extra, opts)
    finish(results, out, opts)
    return 0


if __name__ == "__main__":
    sys.exit(main())
