"""Metrics to the console, metrics.jsonl, TensorBoard and wandb; MFU from the analytic FLOP count."""

import json
import math
import os
import time
from pathlib import Path

import torch

from torchtitan.tools.logging import logger
from torchtitan.tools.utils import device_peak_flops, peak_memory_gib

# metrics.jsonl key -> namespaced TensorBoard / wandb key.
_NAMESPACED = {
    "loss": "loss/train",
    "grad_norm": "optim/grad_norm",
    "lr": "optim/lr",
    "images_per_second": "throughput/images_per_second",
    "tokens_per_second": "throughput/tokens_per_second",
    "sequences_per_second": "throughput/sequences_per_second",
    "validation_loss": "loss/validation",
    "validation_perplexity": "loss/validation_perplexity",
    "tflops": "throughput/tflops",
    "mfu": "throughput/mfu",
    "step_time_s": "time/step_s",
    "data_time_s": "time/data_s",
    "data_time_share": "time/data_share",
    "memory_peak_active_gib": "memory/peak_active_gib",
    "memory_peak_reserved_gib": "memory/peak_reserved_gib",
    "dp_epsilon": "dp/epsilon",
    "dp_noised_grad_norm": "dp/noised_grad_norm",
    "dp_grad_norm_mean": "dp/grad_norm_mean",
    "dp_grad_norm_p95": "dp/grad_norm_p95",
    "dp_clipped_fraction": "dp/clipped_fraction",
    "dp_empty_steps": "dp/empty_steps",
}


_SINK_NAMES = {"jsonl": "metrics.jsonl", "tb": "TensorBoard", "wandb": "wandb"}


class ThroughputMeter:
    """Step and data time over the window since the last log; images/s (tokens/s for language models), TFLOP/s and
    MFU per GPU. `tokens_per_sample` > 0 reports sequences/s and tokens/s instead of images/s."""

    def __init__(self, device: torch.device, flops_per_sample: float, samples_per_step: int, world_size: int,
                 tokens_per_sample: int = 0):  # fmt: skip
        self.device = device
        self.flops_per_sample = flops_per_sample
        self.samples_per_step = samples_per_step
        self.tokens_per_sample = tokens_per_sample
        self.world_size = world_size
        self.peak_flops = device_peak_flops(device)
        self.reset()

    def reset(self) -> None:
        self.window_start = time.perf_counter()
        self.steps = 0
        self.data_time = 0.0
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)

    def summary(self) -> dict:
        """The window since the last reset: mean step and data time, throughput, peak memory."""
        elapsed = time.perf_counter() - self.window_start
        steps = max(self.steps, 1)
        out = self.rates(elapsed / steps)
        out["data_time_s"] = self.data_time / steps
        # The share of the step the host spent waiting for the loader: batches come a step ahead, so a large share
        # means the loader cannot keep up and the GPU starves.
        out["data_time_share"] = self.data_time / elapsed if elapsed > 0 else 0.0
        out.update(peak_memory_gib(self.device))
        return out

    def rates(self, step_time_s: float) -> dict:
        """What a step time means: images/s (sequences/s and tokens/s), and per GPU TFLOP/s and MFU (against the
        datasheet peak; none on CPU or unknown GPUs). The one place MFU is computed: the trainer's logs and
        torchtitan.measure use it."""
        samples_per_second = self.samples_per_step / step_time_s
        if self.tokens_per_sample:
            out = {"sequences_per_second": samples_per_second,
                   "tokens_per_second": samples_per_second * self.tokens_per_sample}  # fmt: skip
        else:
            out = {"images_per_second": samples_per_second}
        out["step_time_s"] = step_time_s
        if self.peak_flops is not None:
            flops_per_gpu = self.flops_per_sample * samples_per_second / self.world_size
            out["tflops"] = flops_per_gpu / 1e12
            out["mfu"] = 100.0 * flops_per_gpu / self.peak_flops
        return out


class MetricsLogger:
    """One console line per log step on rank 0; jsonl, TensorBoard and wandb beside it."""

    def __init__(self, job_config, dump_folder: Path, rank: int, start_step: int | None = None):
        """`start_step`: the step this run starts from (0, or the step it resumed at). Records of later steps in
        metrics.jsonl were logged by an earlier run of the folder past its last checkpoint (a killed run) and this
        run logs those steps again: they are dropped, so each step has one record. None keeps the file as it is."""
        metrics_config = job_config.metrics
        self.enabled = rank == 0 or metrics_config.save_for_all_ranks
        suffix = "" if rank == 0 else f"_rank{rank}"
        self.color = not metrics_config.disable_color_printing
        self.jsonl = None
        self.tb = None
        self.wandb = None
        if not self.enabled:
            return
        dump_folder.mkdir(parents=True, exist_ok=True)
        path = dump_folder / f"metrics{suffix}.jsonl"
        if start_step is not None:
            drop_records_after(path, start_step)
        self.jsonl = open(path, "a")  # noqa: SIM115 (open for the run)
        if metrics_config.enable_tensorboard:
            self.tb = self._start("TensorBoard", lambda: _tensorboard_writer(dump_folder, metrics_config, suffix,
                                                                             start_step))  # fmt: skip
        if metrics_config.enable_wandb and rank == 0:
            self.wandb = self._start("wandb", lambda: _wandb_run(dump_folder, job_config))

    @staticmethod
    def _start(name: str, start):
        """A sink that fails to start is a logged error: the run trains without it."""
        try:
            return start()
        except Exception as e:  # noqa: BLE001
            logger.exception(f"metrics: starting {name} failed ({type(e).__name__}: {e}); training without it")
            return None

    def log(self, step: int, metrics: dict) -> None:
        """One record: the console line, a line of metrics.jsonl, the scalars to TensorBoard and wandb. A value of
        None has no number (a training step that drew no sample has no loss): null in metrics.jsonl, left out of
        the scalars. metrics.jsonl is strict JSON: a non-finite number (epsilon at sigma 0 is inf) is null there,
        shown as it is on the console."""
        if not self.enabled:
            return
        record = {"step": step, **metrics}
        logger.info(self._console_line(record))
        scalars = {_NAMESPACED.get(k, k): v for k, v in record.items() if k != "step" and isinstance(v, int | float)}
        strict = {k: _json_number(v) for k, v in record.items()}
        self._guarded("jsonl", lambda: (self.jsonl.write(json.dumps(strict, allow_nan=False) + "\n"),
                                        self.jsonl.flush()))  # fmt: skip
        self._guarded("tb", lambda: [self.tb.add_scalar(key, value, step) for key, value in scalars.items()])
        self._guarded("wandb", lambda: self.wandb.log(scalars, step=step))

    def _guarded(self, sink: str, write) -> None:
        """Runs a write to one sink (metrics.jsonl, TensorBoard, wandb); a failure is a logged error, never the end
        of the run. A sink that fails is left off from then on (the console line still shows every step)."""
        if getattr(self, sink) is None:
            return
        try:
            write()
        except Exception as e:  # noqa: BLE001 (a metrics sink must not end a training run)
            logger.exception(f"metrics: writing to {_SINK_NAMES[sink]} failed ({type(e).__name__}: {e}); "
                             "it is off for the rest of this run")  # fmt: skip
            setattr(self, sink, None)

    def _console_line(self, r: dict) -> str:
        c = (lambda code, s: f"\033[{code}m{s}\033[0m") if self.color else (lambda code, s: s)
        if "loss" not in r:  # a validation record: held-out loss (LMs), FID or fixed-timestep loss (DiTs)
            parts = [c(31, f"step {r['step']:>6}")]
            if "loss/val" in r:
                at_times = " ".join(f"{r[f'loss/val_t{k}']:.4f}" for k in range(8))
                parts.append(c(32, f"validation loss {r['loss/val']:.4f}"))
                parts.append(f"at t_0..t_7 {at_times}  {r['validation/loss_samples']} samples in "
                             f"{r['validation/loss_seconds']:.1f}s")  # fmt: skip
            if "validation_loss" in r:
                parts.append(c(32, f"validation loss {r['validation_loss']:.4f}"))
            if "validation_perplexity" in r:
                parts.append(c(32, f"perplexity {r['validation_perplexity']:.2f}"))
            if "validation/fid" in r:
                parts.append(c(32, f"validation fid {r['validation/fid']:.4f}"))
            if "validation/inception_score" in r:
                parts.append(c(32, f"inception_score {r['validation/inception_score']:.2f}"))
            if "validation/fid_seconds" in r:  # what the pass cost
                parts.append(f"{r['validation/fid_samples']} samples in {r['validation/fid_seconds']:.1f}s "
                             f"({r['validation/fid_images_per_second']:.1f} images/s)")  # fmt: skip
            return "  ".join(parts)
        if r["loss"] is None:  # a Poisson batch can be empty: no loss, and no divergence either
            parts = [c(31, f"step {r['step']:>6}"), c(32, "empty step: drew no sample, no loss")]
        else:
            parts = [c(31, f"step {r['step']:>6}"), c(32, f"loss {r['loss']:.4f}")]
        if "dp_noised_grad_norm" in r:  # under DP: the norm of the clipped, noised gradient the optimizer applies
            parts.append(c(33, f"noised_grad_norm {r['dp_noised_grad_norm']:.3f}"))
        else:
            parts.append(c(33, f"grad_norm {r['grad_norm']:.3f}"))
        parts.append(f"lr {r['lr']:.2e}")
        if "tokens_per_second" in r:
            parts.append(c(36, f"tokens/s {r['tokens_per_second']:,.0f}"))
        else:
            parts.append(c(36, f"images/s {r['images_per_second']:,.1f}"))
        if "mfu" in r:
            parts.append(c(35, f"mfu {r['mfu']:.1f}% tflops {r['tflops']:.1f}"))
        share = f" ({100 * r['data_time_share']:.0f}%)" if "data_time_share" in r else ""
        parts.append(f"step {r['step_time_s'] * 1000:.0f}ms data {r['data_time_s'] * 1000:.1f}ms{share}")
        if "memory_peak_active_gib" in r:
            parts.append(c(34, f"mem {r['memory_peak_active_gib']:.2f}GiB"))
        if "dp_epsilon" in r:
            parts.append(c(35, f"eps {r['dp_epsilon']:.3f}"))
        if "dp_grad_norm_mean" in r:  # per-sample norms before clipping since the last log: what C is tuned by
            parts.append(c(33, f"sample_norm mean {r['dp_grad_norm_mean']:.3f} p95 {r['dp_grad_norm_p95']:.3f} "
                               f"clipped {100 * r['dp_clipped_fraction']:.1f}%"))  # fmt: skip
        if r.get("dp_empty_steps"):  # Poisson steps since the last log that drew no sample
            parts.append(f"empty steps {r['dp_empty_steps']}")
        return "  ".join(parts)

    def log_image(self, step: int, path: Path, tag: str = "samples") -> None:
        if not self.enabled:
            return

        def to_tb():
            import numpy as np
            from PIL import Image

            self.tb.add_image(tag, np.asarray(Image.open(path).convert("RGB")), step, dataformats="HWC")

        def to_wandb():
            import wandb

            self.wandb.log({tag: wandb.Image(str(path))}, step=step)

        self._guarded("tb", to_tb)
        self._guarded("wandb", to_wandb)

    def close(self) -> None:
        if self.jsonl is not None:
            self.jsonl.close()
        self._guarded("tb", self.tb.close if self.tb is not None else None)
        self._guarded("wandb", self.wandb.finish if self.wandb is not None else None)


def _json_number(value):
    """A value as strict JSON holds it: null for NaN and the infinities (json.dumps would write NaN, Infinity)."""
    return None if isinstance(value, float) and not math.isfinite(value) else value


def drop_records_after(path: Path, step: int) -> int:
    """Removes the records of steps after `step` (and a last line cut short by a kill) from a metrics.jsonl, by an
    atomic rewrite that is logged; returns how many were dropped. A run starting from step 0 drops nothing: an
    earlier run's whole file (one without checkpoints, or killed before its first) is moved aside, named in the log."""
    if not path.is_file():
        return 0
    if step == 0:
        if path.stat().st_size:
            aside = path.with_name(f"{path.stem}.before-{time.strftime('%Y%m%d-%H%M%S')}{path.suffix}")
            os.replace(path, aside)
            logger.info(f"metrics: {path} holds an earlier run's records and this run starts from step 0: moved "
                        f"them to {aside}")  # fmt: skip
        return 0
    kept, dropped = [], 0
    for line in path.read_text().splitlines():
        try:
            keep = json.loads(line)["step"] <= step
        except (ValueError, KeyError, TypeError):  # not a whole record
            keep = False
        if keep:
            kept.append(line + "\n")
        else:
            dropped += 1
    if dropped:
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text("".join(kept))
        os.replace(tmp, path)
        logger.info(f"metrics: dropped {dropped} record(s) after step {step} from {path}: an earlier run of this "
                    "folder logged them past its last checkpoint, and this run logs those steps again")  # fmt: skip
    return dropped


def _tensorboard_writer(dump_folder: Path, metrics_config, suffix: str, start_step: int | None):
    from torch.utils.tensorboard import SummaryWriter

    # purge_step: TensorBoard drops an earlier run's events past the step this run starts from, as metrics.jsonl does.
    purge_step = start_step + 1 if start_step is not None else None
    return SummaryWriter(str(dump_folder / f"{metrics_config.save_tb_folder}{suffix}"), purge_step=purge_step)


def _wandb_run(dump_folder: Path, job_config):
    import wandb

    os.environ.setdefault("WANDB_DIR", str(dump_folder))
    return wandb.init(
        project=os.environ.get("WANDB_PROJECT", "torchditan"),
        name=os.environ.get("WANDB_RUN_NAME", dump_folder.name),
        dir=str(dump_folder),
        config=job_config.to_dict(),
    )
