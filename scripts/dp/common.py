"""What both DP suites share: one train.py run per (mode, batch, tokens), its result JSON, ratios to the baseline.

Every run is train.py in a fresh process (one OOM cannot poison the next), executed and recorded by
scripts/run_ablation.py's `execute` (train.log, status.json: ok / OOM / failed / timeout). Its run folder
lies under `<output dir>/runs/<name>/`; the suite then writes `<output dir>/<name>.json` from it:

- status, return code, command, the run's knobs (mode, local and global batch, tokens, processes);
- step_time_s and images_per_second averaged over the warm steps of metrics.jsonl (the first
  `skip_steps` are left out: they hold the memory breakdown's synchronizing steps and the warm-up);
- peak_memory_gib: the largest `memory_peak_active_gib` of the warm steps (CUDA, rank 0), or on CPU,
  where train.py logs no memory, the largest "peak" of the memory breakdown;
- memory_breakdown: the records of the run's memory_breakdown.json (rank 0), whatever stages and parts
  it holds, and breakdown_at_peak, the record of largest total;
- time_ratio and memory_ratio against the non-private run ("vanilla" / "no_dp") of the same batch and tokens.
"""

import argparse
import json
import math
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from scripts.run_ablation import _words as words  # noqa: E402, F401  (the suites parse lists as the grids do)
from scripts.run_ablation import already_done, execute  # noqa: E402  (needs the repository root on the path)

GIB = 1024**3
NON_PRIVATE = ("vanilla", "no_dp")  # non-private training with the same settings: --dp.enable false
# Keys of a breakdown record that are not memory parts.
RECORD_META = ("step", "stage", "total", "peak", "saved_for_backward")


@dataclass
class SuiteRun:
    """One run of a suite; `name` and `parallelism` make it a spec that run_ablation's `execute` records."""

    suite: str  # "dp" (one process, suite a) | "fsdp" (FSDP over nproc processes, suite b)
    mode: str  # NON_PRIVATE or a dp.mode
    batch: int  # local batch size
    input_size: int  # pixels (or latent cells) per side
    tokens: int
    nproc: int = 1

    @property
    def name(self) -> str:
        return f"{self.mode}_bs{self.batch}" if self.suite == "dp" else f"{self.mode}_t{self.tokens}_bs{self.batch}"

    @property
    def parallelism(self) -> str:
        return "fsdp" if self.nproc > 1 else "single"

    @property
    def private(self) -> bool:
        return self.mode not in NON_PRIVATE


def mode_args(mode: str) -> list[str]:
    """train.py flags of a mode: non-private modes turn DP off, the others pick the engine's mode."""
    return ["--dp.enable", "false"] if mode in NON_PRIVATE else ["--dp.enable", "true", "--dp.mode", mode]


def run_args(run: SuiteRun, steps: int, breakdown_steps: int) -> list[str]:
    """train.py flags of a run, without config file and output folder (the batch finder's probes reuse them)."""
    breakdown = ["--profiling.enable_memory_breakdown", str(breakdown_steps > 0).lower()]
    if breakdown_steps > 0:
        breakdown += ["--profiling.memory_breakdown_steps", str(breakdown_steps)]
    return [*mode_args(run.mode), "--model.input_size", str(run.input_size), "--training.local_batch_size",
            str(run.batch), "--training.global_batch_size=-1", "--training.steps", str(steps),
            "--metrics.log_freq", "1", "--parallelism.data_parallel_replicate_degree", "1",
            "--parallelism.data_parallel_shard_degree", str(run.nproc), *breakdown]  # fmt: skip


def train_command(run: SuiteRun, config: str, args: list[str], run_dir: Path, extra: list[str]) -> list[str]:
    """The full command; `extra` (the scripts' "$@") comes last, so it wins."""
    launcher = [sys.executable, "train.py"]
    if run.nproc > 1:
        launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={run.nproc}",
                    "train.py"]  # fmt: skip
    return [*launcher, "--job.config_file", config, *args, "--job.dump_folder", str(run_dir), *extra]


def model_shape(config: str, extra: list[str]) -> tuple[int, int]:
    """(input size, patch size) of the config with the extra flags applied; fails early on a bad flag."""
    from torchtitan.config_manager import parse_args
    from torchtitan.train_spec import build_model_args, get_train_spec

    cfg = parse_args(["--job.config_file", config, *extra])
    model_args = build_model_args(get_train_spec(cfg.model.name), cfg.model)
    return model_args.input_size, model_args.patch_size


def input_size_for(tokens: int, patch: int) -> int:
    """Side length giving `tokens` patches of side `patch`: tokens must be a square (1024 = 32^2, ...)."""
    side = math.isqrt(tokens)
    if side * side != tokens:
        raise ValueError(f"{tokens} tokens is not a square number of patches")
    return side * patch


def read_jsonl(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def breakdown_parts(records: list[dict]) -> list[str]:
    """The memory parts the records hold (numbers that are not step, stage, total, peak), in first-seen order."""
    parts: dict[str, None] = {}
    for record in records:
        for key, value in record.items():
            if key not in RECORD_META and isinstance(value, int | float):
                parts.setdefault(key)
    return list(parts)


def summarize(run: SuiteRun, run_dir: Path, skip_steps: int) -> dict:
    """The result of one run from its folder (status.json, metrics.jsonl, memory_breakdown.json)."""
    status = json.loads((run_dir / "status.json").read_text())
    result = {"suite": run.suite, "name": run.name, "mode": run.mode, "private": run.private, "batch": run.batch,
              "global_batch": run.batch * run.nproc, "tokens": run.tokens, "input_size": run.input_size,
              "nproc": run.nproc, "status": status["status"], "returncode": status.get("returncode"),
              "elapsed_s": status.get("elapsed_s"), "command": status.get("command"),
              "run_dir": str(run_dir)}  # fmt: skip
    warm = [m for m in read_jsonl(run_dir / "metrics.jsonl") if m["step"] > skip_steps]
    if warm:
        step_time = sum(m["step_time_s"] for m in warm) / len(warm)
        result.update(warm_steps=[m["step"] for m in warm], step_time_s=step_time,
                      images_per_second=result["global_batch"] / step_time)  # fmt: skip
        peaks = [m["memory_peak_active_gib"] for m in warm if "memory_peak_active_gib" in m]
        if peaks:
            result.update(peak_memory_gib=max(peaks), peak_memory_source="metrics.jsonl (warm steps, rank 0)")
    breakdown_file = run_dir / "memory_breakdown.json"
    if breakdown_file.is_file():
        breakdown = json.loads(breakdown_file.read_text())
        records = breakdown["records"]
        result["memory_breakdown"] = {"device": breakdown.get("device"), "records": records}
        if records:
            result["breakdown_at_peak"] = max(records, key=lambda r: r["total"])
            result["dp_buffers_peak_gib"] = max(r.get("dp_buffers", 0) for r in records) / GIB
            if "peak_memory_gib" not in result:  # CPU: train.py logs no memory
                result.update(peak_memory_gib=max(r["peak"] for r in records) / GIB,
                              peak_memory_source="memory_breakdown.json (peak)")  # fmt: skip
    return result


def add_ratios(results: list[dict]) -> None:
    """time_ratio and memory_ratio of every ok run against the ok non-private run of its batch and tokens."""
    baselines = {(r["tokens"], r["batch"], r["nproc"]): r for r in results
                 if r["mode"] in NON_PRIVATE and r["status"] == "ok"}  # fmt: skip
    for r in results:
        base = baselines.get((r["tokens"], r["batch"], r["nproc"]))
        if base is None or r["status"] != "ok":
            continue
        r["baseline"] = base["name"]
        if r.get("step_time_s") and base.get("step_time_s"):
            r["time_ratio"] = r["step_time_s"] / base["step_time_s"]
        if r.get("peak_memory_gib") and base.get("peak_memory_gib"):
            r["memory_ratio"] = r["peak_memory_gib"] / base["peak_memory_gib"]


def run_one(run: SuiteRun, config: str, args: list[str], run_dir: Path, extra: list[str],
            timeout: float | None, force: bool) -> None:  # fmt: skip
    """Runs one command unless an earlier suite run of it is ok (status.json, written by `execute`)."""
    if already_done(run_dir) and not force:
        print(f"{run.name}: ok already, skipped (--force reruns)", flush=True)
        return
    for stale in run_dir.glob("memory_breakdown*"):  # a failed rerun must not pass off the old breakdown
        stale.unlink()
    execute(run, train_command(run, config, args, run_dir, extra), run_dir, timeout)


def run_suite(runs: list[SuiteRun], config: str, out: Path, extra: list[str], opts) -> list[dict]:
    """Runs (or, with opts.dry_run, prints) every run; writes and returns the result of each.

    Args:
        opts: the suite's parsed options (steps, breakdown_steps, skip_steps, timeout, force, dry_run).
    """
    results = []
    for run in runs:
        run_dir = out / "runs" / run.name
        args = run_args(run, opts.steps, opts.breakdown_steps)
        if opts.dry_run:
            print(f"{run.name}: {shlex.join(train_command(run, config, args, run_dir, extra))}")
            continue
        run_one(run, config, args, run_dir, extra, opts.timeout or None, opts.force)
        results.append(summarize(run, run_dir, opts.skip_steps))
    add_ratios(results)
    for result in results:
        (out / f"{result['name']}.json").write_text(json.dumps(result, indent=1))
    return results


def add_common_args(parser: argparse.ArgumentParser, steps: int = 8, breakdown_steps: int = 2) -> None:
    """Options both suites take."""
    parser.add_argument("--config", default="train_configs/dit_l8_pixel_dp.toml", help="TOML config of every run")
    parser.add_argument("--steps", type=int, default=steps, help="training steps per run")
    parser.add_argument("--breakdown-steps", type=int, default=breakdown_steps,
                        help="steps the memory breakdown records (the first ones; 0: none)")  # fmt: skip
    parser.add_argument("--skip-steps", type=int, default=-1,
                        help="first steps left out of the averages (default: breakdown steps + 1 warm-up)")  # fmt: skip
    parser.add_argument("--timeout", type=float, default=0, help="seconds per run (0: none)")
    parser.add_argument("--force", action="store_true", help="rerun runs whose status is already ok")
    parser.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    parser.add_argument("--no-plots", action="store_true", help="skip scripts/dp/visualize.py at the end")


def check_common_args(opts) -> None:
    """Fills the default skip and refuses runs that would have no warm step to average."""
    if opts.skip_steps < 0:
        opts.skip_steps = opts.breakdown_steps + 1
    if opts.steps <= opts.skip_steps:
        raise SystemExit(f"--steps {opts.steps} leaves no warm step after skipping {opts.skip_steps}")


def check_modes(modes: list[str], baseline: str) -> list[str]:
    """The modes, each non-private or a DP engine mode, with the non-private baseline first if missing
    (the ratios need it; a baseline run that is already ok is not rerun)."""
    from torchtitan.dp import DP_MODES

    unknown = [m for m in modes if m not in (*NON_PRIVATE, *DP_MODES)]
    if unknown:
        private = [m for m in DP_MODES if m not in NON_PRIVATE]
        raise SystemExit(f"unknown mode(s) {unknown}: use {' or '.join(NON_PRIVATE)} (non-private) or one of {private}")
    return modes if any(m in NON_PRIVATE for m in modes) else [baseline, *modes]


def finish(results: list[dict], out: Path, opts) -> None:
    """The plots and summary.txt of the suite's folder, then how many runs were not ok."""
    if not opts.no_plots:
        from scripts.dp.visualize import main as visualize

        visualize([str(out)])
    failed = sum(r["status"] != "ok" for r in results)
    print(f"done: {failed} run(s) not ok (recorded in their JSON and status.json)", flush=True)


def split_extra(extra: list[str]) -> list[str]:
    """train.py flags passed through, without the `--` that may separate them."""
    return [a for a in extra if a != "--"]
