"""Measure the trainer's own step: warm step time, images/s, MFU and memory, or the memory breakdown by stage.

    python -m torchtitan.measure [--warmup 3 --steps 10 --profile [--profile-dir DIR]] -- --job.config_file X.toml [...]
    python -m torchtitan.measure --memory-breakdown [--forward-only] [--steps 2] -- --job.config_file X.toml

Builds the Trainer in this process from train.py's arguments, with the `dummy` dataset (the config's own with
`--own-data`), no checkpoints, no samples and no TensorBoard (a run folder of its own unless `--job.dump_folder` is
given), and drives `Trainer.train_step()`:
warm-up steps (compilation, autotuning), then timed steps, each timed to a device sync; the result is the median
step time through the trainer's `ThroughputMeter.rates` (the one MFU formula). The same number of steps is then run
back to back, as training runs them, with one sync at the end: `streamed_step_time_s`, their mean, and the share of
it the host waited for the loader (`data_time_share`). With `--own-data` the loader alone is timed last:
`loader_images_per_second` (and per worker), what the data path can feed whatever the model. Rank 0 prints
one line `MEASURE_RESULT {json}`, which `torchtitan.tools.runs.launch` reads: scripts/benchmark.py, the max-batch
finder and the script grids run this module in fresh processes.
"""

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

from torchtitan.config_manager import parse_args
from torchtitan.tools.logging import init_logger
from torchtitan.tools.runs import RESULT_PREFIX, warm_summary
from torchtitan.tools.utils import peak_memory_gib
from torchtitan.trainer import Trainer

# A measurement finds the real limit (the max-batch finder's probes run into it): the memory estimate only warns.
MEASURE_OVERRIDES = ["--checkpoint.enable", "false", "--validation.enable", "false", "--metrics.enable_tensorboard",
                     "false", "--metrics.enable_wandb", "false", "--training.skip_memory_check", "true"]  # fmt: skip


def measure_overrides(train_args: list[str], own_data: bool = False) -> list[str]:
    """What a measurement changes in a config: no checkpoints, validation or sinks, and the model family's own
    (TrainSpec.measure_overrides: the DiT measures on generated images, without sample grids); `own_data` keeps the
    config's dataset."""
    from torchtitan.train_spec import get_train_spec

    family = list(get_train_spec(parse_args(train_args).model.name).measure_overrides)
    if own_data and "--training.dataset" in family:
        at = family.index("--training.dataset")
        del family[at : at + 2]
    return [*MEASURE_OVERRIDES, *family]


@contextlib.contextmanager
def measuring_trainer(train_args: list[str], own_data: bool = False):
    """A Trainer for measurement (see the module docstring), closed on exit."""
    with tempfile.TemporaryDirectory(prefix="measure_") as tmp:
        own_folder = not any(a.split("=")[0] == "--job.dump_folder" for a in train_args)
        folder = ["--job.dump_folder", tmp] if own_folder else []
        trainer = Trainer(parse_args([*folder, *train_args, *measure_overrides(train_args, own_data)]))
        try:
            yield trainer
        finally:
            trainer.close()


def _sync(trainer: Trainer) -> None:
    if trainer.device.type == "cuda":
        torch.cuda.synchronize(trainer.device)


def measure_steps(train_args: list[str], warmup: int = 3, steps: int = 10, profile: bool = False,
                  own_data: bool = False, profile_dir: str | None = None) -> dict:  # fmt: skip
    """Warm step time of the trainer's `train_step()`, and what it means (images/s, TFLOP/s, MFU), peak memory
    over the timed steps, the last loss; with `own_data` on the config's dataset, and the loader's own rate. With
    `profile` or a `profile_dir`, then `print_profile` (into `profile_dir` too)."""
    with measuring_trainer(train_args, own_data) as trainer:
        start = time.perf_counter()
        for _ in range(warmup):
            trainer.train_step()
        _sync(trainer)
        warmup_s = time.perf_counter() - start
        trainer.meter.reset()  # peak memory from here
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            out = trainer.train_step()
            _sync(trainer)
            times.append(time.perf_counter() - start)
        summary = warm_summary(times)
        # As training runs them: back to back, one sync at the end, so the CPU may queue ahead of the GPU. Against
        # the per-step time above, the gap is what the per-step sync cost (the host's launch time hidden or not).
        peak = peak_memory_gib(trainer.device)
        trainer.meter.data_time = 0.0
        start = time.perf_counter()
        for _ in range(steps):
            out = trainer.train_step()
        _sync(trainer)
        streamed_s = (time.perf_counter() - start) / steps
        loss = out["loss_sum"].item() * trainer.dp_degree / trainer.global_batch  # this rank's mean
        result = {"global_batch": trainer.global_batch, "world_size": trainer.world_size,
                  "layout": trainer.parallel_dims.mode, **trainer.meter.rates(summary["step_time_s"]), **summary,
                  "streamed_step_time_s": streamed_s, "data_time_share": trainer.meter.data_time / (steps * streamed_s),
                  "warmup_s": warmup_s, "loss": loss, "gflop_per_image": trainer.meter.flops_per_sample / 1e9,
                  **peak}  # fmt: skip
        if own_data:
            result.update(loader_rate(trainer, steps))
        if trainer.device.type == "cuda":
            result["device"] = torch.cuda.get_device_name(trainer.device)
        if trainer.private is not None:  # epsilon, and the per-sample norms of every step (all ranks)
            result.update(trainer.private.metrics(trainer.parallel_dims.dp_group()))
        if profile or profile_dir:
            print_profile(trainer, out_dir=profile_dir)
        return result


def loader_rate(trainer: Trainer, batches: int) -> dict:
    """This rank's host loader alone, as fast as it can hand batches over: images/s, and per loader worker (the
    main process counts as one when there are none). The batches its workers had ready are taken first, untimed."""
    host = trainer.dataloader.host
    workers = trainer.job_config.training.dataloader.num_workers
    ready = workers * trainer.job_config.training.dataloader.prefetch_factor + 1
    for _ in range(ready):
        next(host)
    start = time.perf_counter()
    for _ in range(batches):
        next(host)
    rate = batches * trainer.job_config.training.local_batch_size / (time.perf_counter() - start)
    return {"loader_images_per_second": rate, "loader_images_per_second_per_worker": rate / max(workers, 1),
            "loader_workers": workers}  # fmt: skip


def print_profile(trainer: Trainer, steps: int = 3, out_dir: str | None = None) -> None:
    """Profiles a few warm steps twice and prints what each found. On CUDA, first the device alone (the profiler
    barely slows the host): the top kernels, and where the GPU waited between them. Then the host too: where its
    time goes, by op. With `out_dir`, rank 0 also writes the text (`profile.md`) and the second pass's trace
    (`trace.json.gz`, for chrome://tracing or Perfetto) there."""
    from torchtitan.components.profiling import host_summary, idle_gaps, kernel_summary

    activity = torch.profiler.ProfilerActivity
    parts = []
    if trainer.device.type == "cuda":
        _sync(trainer)
        start = time.perf_counter()
        with torch.profiler.profile(activities=[activity.CUDA]) as prof:
            for _ in range(steps):
                trainer.train_step()
            _sync(trainer)
        parts += [kernel_summary(prof, steps, 1000 * (time.perf_counter() - start) / steps), idle_gaps(prof, steps)]
        print("\n".join(parts), flush=True)
    activities = [activity.CPU, *([activity.CUDA] if trainer.device.type == "cuda" else [])]
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(steps):
            trainer.train_step()
        _sync(trainer)
    parts.append(host_summary(prof, steps))
    print(parts[-1], flush=True)
    if out_dir and int(os.environ.get("RANK", "0")) == 0:
        folder = Path(out_dir)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "profile.md").write_text("\n\n".join(parts) + "\n")
        prof.export_chrome_trace(str(folder / "trace.json.gz"))  # the profiler gzips a .gz path itself


def measure_breakdown(train_args: list[str], forward_only: bool = False, steps: int = 2, out=None) -> dict:
    """The memory breakdown of `steps` steps of the trainer, by stage (torchtitan/tools/memory_breakdown.py).

    Args:
        train_args: train.py arguments, e.g. ["--job.config_file", "train_configs/debug_model.toml"].
        forward_only: the trainer's forward under torch.no_grad, no backward or optimizer step (inference memory).
        steps: steps to record (the optimizer states appear in the first, the steady state in the second).
        out: folder for the JSON and PNG; defaults to the run folder (job.dump_folder).

    Returns:
        {"device", "forward_only", "records": [...], "json": path, "png": path} (paths on rank 0 only).
    """
    from torchtitan.tools.memory_breakdown import MemoryBreakdownObserver

    with measuring_trainer(train_args) as trainer:
        cfg = trainer.job_config
        if trainer.device.type != "cuda" and cfg.compile.enable:
            from torchtitan.tools.logging import logger

            logger.warning("memory breakdown on CPU follows eager ops: compiled blocks may hide their tensors")
        observer = MemoryBreakdownObserver.for_trainer(trainer, steps, out)
        mode = "forward only (no_grad)" if forward_only else "training"
        title = f"{cfg.model.flavor}, batch {cfg.training.local_batch_size}, {mode}, {trainer.device.type}"
        trainer.observers = [] if forward_only else [observer]
        for step in range(1, steps + 1):
            if forward_only:  # the trainer's forward, without its backward
                x, y, _ = trainer.next_batch()
                with torch.no_grad(), observer.track(step):
                    trainer.forward_losses(x, y, trainer.step, 0)
                observer.stage("forward", step)
            else:
                trainer.train_step()
        name = "memory_breakdown_forward" if forward_only else "memory_breakdown"
        written = observer.written if not forward_only else observer.write(name, title)
        result = {"device": trainer.device.type, "forward_only": forward_only, "records": observer.breakdown.records}
        if trainer.rank == 0 and written:
            result.update(json=str(written[0]), png=str(written[1]))
        return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--warmup", type=int, default=3, help="steps before timing (compilation, autotuning)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps (recorded steps with --memory-breakdown)")
    parser.add_argument("--profile", action="store_true", help="then profile 3 steps: the top CUDA kernels and the "
                        "GPU's waits, then the host's ops (print_profile)")  # fmt: skip
    parser.add_argument("--profile-dir", default="", help="profile as --profile does, and write profile.md and "
                        "trace.json.gz here (rank 0)")  # fmt: skip
    parser.add_argument("--own-data", action="store_true", help="the config's dataset, not dummy data; and time "
                        "its loader alone")  # fmt: skip
    parser.add_argument("--memory-breakdown", action="store_true", help="record memory by stage instead of timing")
    parser.add_argument("--forward-only", action="store_true", help="with --memory-breakdown: forward under no_grad")
    parser.add_argument("--out", default="", help="with --memory-breakdown: output folder (default: run folder)")
    argv = sys.argv[1:] if argv is None else argv
    ours, train_args = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    args = parser.parse_args(ours)
    init_logger()
    if args.memory_breakdown:
        result = measure_breakdown(train_args, args.forward_only, args.steps, args.out or None)
        if int(os.environ.get("RANK", "0")) == 0:
            from torchtitan.tools.memory_breakdown import format_records

            print(format_records(result["records"]))
    else:
        result = measure_steps(
            train_args, args.warmup, args.steps, args.profile, args.own_data, args.profile_dir or None
        )
    if int(os.environ.get("RANK", "0")) == 0:
        print(RESULT_PREFIX + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
