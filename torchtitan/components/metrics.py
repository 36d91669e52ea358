"""Metrics to the console, metrics.jsonl, TensorBoard and wandb; MFU from the analytic FLOP count."""

import json
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
    "tflops": "throughput/tflops",
    "mfu": "throughput/mfu",
    "step_time_s": "time/step_s",
    "data_time_s": "time/data_s",
    "memory_peak_active_gib": "memory/peak_active_gib",
    "memory_peak_reserved_gib": "memory/peak_reserved_gib",
    "dp_epsilon": "dp/epsilon",
}


class ThroughputMeter:
    """Step and data time over the window since the last log; images/s, TFLOP/s and MFU per GPU."""

    def __init__(self, device: torch.device, flops_per_image: float, images_per_step: int, world_size: int):
        self.device = device
        self.flops_per_image = flops_per_image
        self.images_per_step = images_per_step
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
        elapsed = time.perf_counter() - self.window_start
        steps = max(self.steps, 1)
        images_per_second = self.images_per_step * steps / elapsed
        out = {
            "images_per_second": images_per_second,
            "step_time_s": elapsed / steps,
            "data_time_s": self.data_time / steps,
        }
        if self.peak_flops is not None:
            flops_per_gpu = self.flops_per_image * images_per_second / self.world_size
            out["tflops"] = flops_per_gpu / 1e12
            out["mfu"] = 100.0 * flops_per_gpu / self.peak_flops
        out.update(peak_memory_gib(self.device))
        return out


class MetricsLogger:
    """One console line per log step on rank 0; jsonl, TensorBoard and wandb beside it."""

    def __init__(self, job_config, dump_folder: Path, rank: int):
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
        self.jsonl = open(dump_folder / f"metrics{suffix}.jsonl", "a")
        if metrics_config.enable_tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(dump_folder / f"{metrics_config.save_tb_folder}{suffix}"))
        if metrics_config.enable_wandb and rank == 0:
            import wandb

            os.environ.setdefault("WANDB_DIR", str(dump_folder))
            self.wandb = wandb.init(
                project=os.environ.get("WANDB_PROJECT", "torchditan"),
                name=os.environ.get("WANDB_RUN_NAME", dump_folder.name),
                dir=str(dump_folder),
                config=job_config.to_dict(),
            )

    def log(self, step: int, metrics: dict) -> None:
        if not self.enabled:
            return
        record = {"step": step, **{k: v for k, v in metrics.items() if v is not None}}
        self.jsonl.write(json.dumps(record) + "\n")
        self.jsonl.flush()
        scalars = {_NAMESPACED.get(k, k): v for k, v in record.items() if k != "step" and isinstance(v, int | float)}
        if self.tb is not None:
            for key, value in scalars.items():
                self.tb.add_scalar(key, value, step)
        if self.wandb is not None:
            self.wandb.log(scalars, step=step)
        logger.info(self._console_line(record))

    def _console_line(self, r: dict) -> str:
        c = (lambda code, s: f"\033[{code}m{s}\033[0m") if self.color else (lambda code, s: s)
        parts = [c(31, f"step {r['step']:>6}"), c(32, f"loss {r['loss']:.4f}")]
        parts.append(c(33, f"grad_norm {r['grad_norm']:.3f}"))
        parts.append(f"lr {r['lr']:.2e}")
        parts.append(c(36, f"images/s {r['images_per_second']:,.1f}"))
        if "mfu" in r:
            parts.append(c(35, f"mfu {r['mfu']:.1f}% tflops {r['tflops']:.1f}"))
        parts.append(f"step {r['step_time_s'] * 1000:.0f}ms data {r['data_time_s'] * 1000:.1f}ms")
        if "memory_peak_active_gib" in r:
            parts.append(c(34, f"mem {r['memory_peak_active_gib']:.2f}GiB"))
        if "dp_epsilon" in r:
            parts.append(c(35, f"eps {r['dp_epsilon']:.3f}"))
        return "  ".join(parts)

    def log_image(self, step: int, path: Path, tag: str = "samples") -> None:
        if not self.enabled:
            return
        if self.tb is not None:
            import numpy as np
            from PIL import Image

            self.tb.add_image(tag, np.asarray(Image.open(path).convert("RGB")), step, dataformats="HWC")
        if self.wandb is not None:
            import wandb

            self.wandb.log({tag: wandb.Image(str(path))}, step=step)

    def close(self) -> None:
        if self.jsonl is not None:
            self.jsonl.close()
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()
