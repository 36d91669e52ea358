"""What both DP suites share: one train.py run per (mode, batch, tokens), its result JSON, ratios to the baseline.

Every run is a scripts/lib `Run` (its knobs: suite, mode, batch, tokens, processes), executed and recorded by
scripts/lib's `execute` (a fresh process; train.log, status.json: ok / OOM / failed (exit code) / timeout).
Its run folder lies under `<output dir>/runs/<name>/`; the suite then writes `<output dir>/<name>.json` from it:

- status, return code, command, the run's knobs (suite, mode, private, local and global batch, tokens, input
  size, processes);
- scripts/lib's `warm_metrics` of the run's metrics.jsonl, the first `skip_steps` left out (the memory
  breakdown's synchronizing steps and the warm-up): warm_steps, step_time_s (the MEDIAN of the warm steps;
  the mean before the suites shared scripts/lib, with step_time_min_s, step_time_max_s, timed_steps) and
  images_per_second (the median of the steps' images/s; before, the global batch over the mean step time);
- peak_memory_gib: the largest `memory_peak_active_gib` of the warm steps (CUDA, rank 0), or on CPU,
  where train.py logs no memory, the largest "peak" of the memory breakdown (peak_memory_source says which);
- memory_breakdown: the records of the run's memory_breakdown.json (rank 0), whatever stages and parts
  it holds, and breakdown_at_peak, the record of largest total;
- time_ratio and memory_ratio against the non-private run ("vanilla" / "no_dp") of the same batch and tokens;
- language models (the FSDP suite's `--model llama3`): model, flavor and seq_len among the knobs (input_size is
  None), and `warm_metrics`' medians of tokens_per_second and sequences_per_second instead of images_per_second.
"""

import argparse
import json
import math
import shlex
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from scripts.lib import (  # noqa: E402  (needs the repository root on the path)
    GIB,
    Run,
    execute,
    parse_script_args,
    read_status,
    train_command,
    warm_metrics,
)

NON_PRIVATE = ("vanilla", "no_dp")  # non-private training with the same settings: --dp.enable false
# Keys of a breakdown record that are not memory parts.
RECORD_META = ("step", "stage", "total", "peak", "saved_for_backward")


def suite_run(knobs: dict, config: str, steps: int, breakdown_steps: int, extra: list[str]) -> Run:
    """The run of a suite point (`suite_knobs`): train.py flags of its mode and size, then `extra`, last so it wins.

    Args:
        knobs: suite ("dp": one process, suite a; "fsdp": FSDP over nproc processes, suite b, a one-rank mesh at
            nproc 1), mode (NON_PRIVATE or a dp.mode), batch (local), input_size (pixels or latent cells a side),
            tokens, nproc; for a language model seq_len (training.seq_len) instead of input_size.
        breakdown_steps: steps the memory breakdown records (0: off, as the batch finder's probes run).
    """
    k = knobs
    name = f"{k['mode']}_bs{k['batch']}" if k["suite"] == "dp" else f"{k['mode']}_t{k['tokens']}_bs{k['batch']}"
    private = ["--dp.enable", "true", "--dp.mode", k["mode"]] if k["private"] else ["--dp.enable", "false"]
    breakdown = ["--profiling.enable_memory_breakdown", str(breakdown_steps > 0).lower()]
    if breakdown_steps > 0:
        breakdown += ["--profiling.memory_breakdown_steps", str(breakdown_steps)]
    if k.get("seq_len") is not None:
        size = ["--training.seq_len", str(k["seq_len"])]
    else:
        size = ["--model.input_size", str(k["input_size"])]
    args = ["--job.config_file", config, *private, *size,
            "--training.local_batch_size", str(k["batch"]), "--training.global_batch_size=-1",
            "--training.steps", str(steps), "--metrics.log_freq", "1",
            "--parallelism.data_parallel_replicate_degree", "1",
            "--parallelism.data_parallel_shard_degree", str(k["nproc"]), *breakdown]  # fmt: skip
    if k["suite"] == "fsdp" and k["nproc"] == 1:  # FSDP2 on a one-rank mesh: what one GPU allows of suite b
        args += ["--parallelism.fsdp_single_device", "true"]
    return Run(name, [*args, *extra], k["nproc"], knobs=k)


def suite_knobs(suite: str, mode: str, batch: int, input_size: int | None, tokens: int, nproc: int = 1,
                **model) -> dict:  # fmt: skip
    """The knobs of one suite point, as its result JSON reports them; `model` adds a language model's (model,
    flavor, seq_len)."""
    return {"suite": suite, "mode": mode, "private": mode not in NON_PRIVATE, "batch": batch,
            "global_batch": batch * nproc, "tokens": tokens, "input_size": input_size, "nproc": nproc,
            **model}  # fmt: skip


def model_shape(config: str, extra: list[str]) -> tuple[int, int]:
    """(input size, patch size) of the config with the extra flags applied; fails early on a bad flag."""
    from torchtitan.config_manager import parse_args
    from torchtitan.train_spec import build_model_args, get_train_spec

    cfg = parse_args(["--job.config_file", config, *extra])
    model_args = build_model_args(get_train_spec(cfg.model.name), cfg)
    return model_args.input_size, model_args.patch_size


def input_size_for(tokens: int, patch: int) -> int:
    """Side length giving `tokens` patches of side `patch`: tokens must be a square (1024 = 32^2, ...)."""
    side = math.isqrt(tokens)
    if side * side != tokens:
        raise ValueError(f"{tokens} tokens is not a square number of patches")
    return side * patch


def breakdown_parts(records: list[dict]) -> list[str]:
    """The memory parts the records hold (numbers that are not step, stage, total, peak), in first-seen order."""
    parts: dict[str, None] = {}
    for record in records:
        for key, value in record.items():
            if key not in RECORD_META and isinstance(value, int | float):
                parts.setdefault(key)
    return list(parts)


def summarize(run: Run, run_dir: Path, skip_steps: int) -> dict:
    """The result of one run from its folder (status.json, metrics.jsonl, memory_breakdown.json)."""
    status = read_status(run_dir)
    result = {**run.knobs, "name": run.name, "status": status["status"], "returncode": status.get("returncode"),
              "elapsed_s": status.get("elapsed_s"), "command": status.get("command"),
              "run_dir": str(run_dir)}  # fmt: skip
    if status["status"] == "ok":
        result.update(warm_metrics(run_dir, skip_steps))
    breakdown_file = run_dir / "memory_breakdown.json"
    if breakdown_file.is_file():
        breakdown = json.loads(breakdown_file.read_text())
        records = breakdown["records"]
        result["memory_breakdown"] = {"device": breakdown.get("device"), "records": records}
        if records:
            result["breakdown_at_peak"] = max(records, key=lambda r: r["total"])
            result["dp_buffers_peak_gib"] = max(r.get("dp_buffers", 0) for r in records) / GIB
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


def run_suite(points: list[dict], extra: list[str], opts, what: str) -> list[dict]:
    """Runs (or, with opts.dry_run, prints) the run of every point into opts.output_dir; writes the result of each
    as it ends (the ratios rewritten as their baselines come) and returns them.

    Args:
        points: the suite's knobs (`suite_knobs`), one per run.
        opts: the suite's parsed options (config, output_dir, steps, breakdown_steps, skip_steps, timeout, force,
            dry_run).
        what: the suite's first line, e.g. "10 runs, 1024 tokens"; steps and folder follow.
    """
    out = Path(opts.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    print(f"{what}, {opts.steps} steps each -> {out}/", flush=True)
    results = []
    for knobs in points:
        run = suite_run(knobs, opts.config, opts.steps, opts.breakdown_steps, extra)
        run_dir = out / "runs" / run.name
        if opts.dry_run:
            print(f"{run.name}: {shlex.join(train_command(run, run_dir))}")
            continue
        execute(run, run_dir, opts.timeout or None, opts.force)
        results.append(summarize(run, run_dir, opts.skip_steps))
        # Written as each run ends, then again with the ratios: a suite cut short keeps what it measured.
        add_ratios(results)
        for result in results:
            (out / f"{result['name']}.json").write_text(json.dumps(result, indent=1))
    return results


def parse_suite_args(argv: list[str] | None, doc: str, steps: int, add_args) -> tuple[argparse.Namespace, list[str]]:
    """Both suites' options (and those `add_args(parser)` adds), then the train.py flags passed through.

    Fills the default --skip-steps and refuses runs that would have no warm step to summarize.
    """
    parser = argparse.ArgumentParser(
        description=doc, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False
    )  # no abbreviations: a train.py flag is never taken for one of these options
    parser.add_argument("--config", default="train_configs/dit_l8_pixel_dp.toml", help="TOML config of every run")
    parser.add_argument("--steps", type=int, default=steps, help="training steps per run")
    parser.add_argument("--breakdown-steps", type=int, default=2,
                        help="steps the memory breakdown records (the first ones; 0: none)")  # fmt: skip
    parser.add_argument("--skip-steps", type=int, default=-1,
                        help="first steps left out of the medians (default: breakdown steps + 1 warm-up)")  # fmt: skip
    parser.add_argument("--no-plots", action="store_true", help="skip scripts/dp/visualize.py at the end")
    add_args(parser)
    opts, extra = parse_script_args(parser, argv)
    if opts.skip_steps < 0:
        opts.skip_steps = opts.breakdown_steps + 1
    if opts.steps <= opts.skip_steps:
        raise SystemExit(f"--steps {opts.steps} leaves no warm step after skipping {opts.skip_steps}")
    return opts, extra


def check_modes(modes: list[str], baseline: str) -> list[str]:
    """The modes, each non-private or a DP engine mode, with the non-private baseline first if missing
    (the ratios need it; a baseline run that is already ok is not rerun)."""
    from torchtitan.dp import DP_MODES

    unknown = [m for m in modes if m not in (*NON_PRIVATE, *DP_MODES)]
    if unknown:
        private = [m for m in DP_MODES if m not in NON_PRIVATE]
        raise SystemExit(f"unknown mode(s) {unknown}: use {' or '.join(NON_PRIVATE)} (non-private) or one of {private}")
    return modes if any(m in NON_PRIVATE for m in modes) else [baseline, *modes]
