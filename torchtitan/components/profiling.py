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


# Kernel name patterns -> category, first match wins (cuBLAS nvjet/xmma GEMMs, cuDNN/flash attention, Inductor's
# fused Triton kernels, the optimizer's and EMA's multi-tensor kernels).
KERNEL_CATEGORIES = [
    ("dp norms (flash kernels)", ("_gram_kernel", "_explicit_kernel")),
    ("attention", ("sdpa", "fmha", "flash", "attention", "cudnn")),
    ("gemm", ("gemm", "nvjet", "xmma", "cutlass", "splitk", "gemv")),
    ("inductor triton", ("triton_",)),
    ("optimizer + ema (multi-tensor)", ("multi_tensor", "fused_adam", "foreach")),
    ("aten elementwise/reduce", ("elementwise", "reduce_kernel", "reduce")),
    ("copy/memset", ("memcpy", "memset", "copy", "cat")),
]


def kernel_summary(prof: torch.profiler.profile, steps: int, wall_ms: float, top: int = 30) -> str:
    """A markdown summary of a CUDA profile of `steps` steps: GPU time per step by kernel category, then the
    top kernels; `wall_ms` (the host's time per step) tells how busy the GPU was."""
    kernels = [(e.key, e.self_device_time_total / 1000 / steps, e.count / steps) for e in prof.key_averages()]
    totals: dict[str, float] = {}
    for name, ms, _ in kernels:
        low = name.lower()
        category = next((c for c, keys in KERNEL_CATEGORIES if any(k in low for k in keys)), "other")
        totals[category] = totals.get(category, 0.0) + ms
    busy = sum(totals.values())
    lines = [f"PROFILE per step: wall {wall_ms:.1f} ms, kernels {busy:.1f} ms ({100 * busy / wall_ms:.0f}% busy)",
             "| category | ms/step | % of kernel time |", "|---|---|---|"]  # fmt: skip
    lines += [f"| {c} | {ms:.2f} | {100 * ms / busy:.1f} |" for c, ms in sorted(totals.items(), key=lambda kv: -kv[1])]
    lines += ["| kernel | ms/step | calls/step |", "|---|---|---|"]
    for name, ms, calls in sorted(kernels, key=lambda k: -k[1])[:top]:
        lines.append(f"| {name[:110]} | {ms:.3f} | {calls:.0f} |")
    return "\n".join(lines)


def idle_gaps(prof: torch.profiler.profile, steps: int, top: int = 10, min_us: float = 5.0) -> str:
    """Where the GPU waited: the time per step between one kernel's end and the next one's start (copies and
    memsets count as work), and the largest waits summed by the kernels on either side. A wait is the host not
    launching fast enough, or a host sync; the profiler's own launch overhead lengthens them a little."""
    work = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                  if e.device_type == torch.autograd.DeviceType.CUDA)  # fmt: skip
    waits: dict[str, list[float]] = {}
    total, last_end, last_name = 0.0, None, ""
    for start, end, name in work:
        if last_end is not None and start - last_end >= min_us:
            total += start - last_end
            entry = waits.setdefault(f"{last_name[:50]} -> {name[:50]}", [0.0, 0])
            entry[0] += start - last_end
            entry[1] += 1
        if last_end is None or end >= last_end:
            last_end, last_name = end, name
    head = f"PROFILE GPU idle between kernels (waits of {min_us:g} us or more): {total / 1000 / steps:.2f} ms per step"
    lines = [head, "| kernel before -> kernel after | idle ms/step | waits/step |", "|---|---|---|"]
    for key, (us, count) in sorted(waits.items(), key=lambda kv: -kv[1][0])[:top]:
        lines.append(f"| {key} | {us / 1000 / steps:.3f} | {count / steps:.1f} |")
    return "\n".join(lines)


def host_summary(prof: torch.profiler.profile, steps: int, top: int = 25) -> str:
    """Where the host's time goes in a profile with the CPU activity: the ops (aten ops, autograd nodes, compiled
    graphs, launches, syncs) by their own CPU time per step. The CPU profiler slows the host itself (2-3x on a short
    step), so these say which host work there is and in what proportion, not how long a step takes unprofiled."""
    ops = [e for e in prof.key_averages() if e.self_cpu_time_total > 0]
    total = sum(e.self_cpu_time_total for e in ops) / 1000 / steps
    lines = [f"PROFILE host per step (CPU profiler on): {total:.1f} ms of CPU time in ops",
             "| op | self CPU ms/step | CPU ms/step with children | calls/step |", "|---|---|---|---|"]  # fmt: skip
    for e in sorted(ops, key=lambda e: -e.self_cpu_time_total)[:top]:
        lines.append(f"| {e.key[:110]} | {e.self_cpu_time_total / 1000 / steps:.3f} | "
                     f"{e.cpu_time_total / 1000 / steps:.3f} | {e.count / steps:.1f} |")  # fmt: skip
    return "\n".join(lines)
