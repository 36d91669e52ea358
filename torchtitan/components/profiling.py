"""Torch profiler traces and CUDA memory snapshots for chosen steps (TorchTitan's [profiling])."""

import pickle
from pathlib import Path

import torch

from torchtitan.tools.logging import logger

_MAX_SNAPSHOT_ENTRIES = 100000


class Profiler:
    """Call `step(n)` after each training step; traces/snapshots land under the run folder."""

    def __init__(self, profiling_config, dump_folder: Path, rank: int, device: torch.device):
        self.config = profiling_config
        self.rank = rank
        self.trace_folder = dump_folder / profiling_config.save_traces_folder
        self.snapshot_folder = dump_folder / profiling_config.save_memory_snapshot_folder
        self.torch_profiler = None
        self.snapshots = profiling_config.enable_memory_snapshot and device.type == "cuda"
        if profiling_config.enable_memory_snapshot and device.type != "cuda":
            logger.warning("profiling.enable_memory_snapshot needs a CUDA device: snapshots are off on CPU")
        if self.snapshots:
            torch.cuda.memory._record_memory_history(max_entries=_MAX_SNAPSHOT_ENTRIES)
        if profiling_config.enable_profiling:
            freq, active, warmup = profiling_config.profile_freq, profiling_config.profiler_active, 0
            warmup = min(profiling_config.profiler_warmup, max(freq - active - 1, 0))
            activities = [torch.profiler.ProfilerActivity.CPU]
            if device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self.torch_profiler = torch.profiler.profile(
                activities=activities,
                schedule=torch.profiler.schedule(wait=freq - active - warmup, warmup=warmup, active=active),
                on_trace_ready=self._write_trace,
                record_shapes=True,
            )
            self.torch_profiler.start()
        self.last_step = 0

    def _write_trace(self, prof) -> None:
        folder = self.trace_folder / f"iteration_{self.last_step}"
        folder.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(folder / f"rank{self.rank}_trace.json"))
        logger.info(f"wrote profiler trace to {folder}")

    def step(self, step: int) -> None:
        self.last_step = step
        if self.torch_profiler is not None:
            self.torch_profiler.step()
        if self.snapshots and step % self.config.profile_freq == 0:
            self.dump_snapshot(f"iteration_{step}")

    def dump_snapshot(self, name: str) -> Path | None:
        """Writes rank{r}_memory_snapshot.pickle (viewable at pytorch.org/memory_viz)."""
        if not self.snapshots:
            return None
        folder = self.snapshot_folder / name
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"rank{self.rank}_memory_snapshot.pickle"
        with open(path, "wb") as f:
            pickle.dump(torch.cuda.memory._snapshot(), f)
        logger.info(f"wrote memory snapshot {path}")
        return path

    def close(self) -> None:
        if self.torch_profiler is not None:
            self.torch_profiler.stop()
        if self.snapshots:
            torch.cuda.memory._record_memory_history(enabled=None)
