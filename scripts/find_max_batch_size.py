"""Largest local batch size that trains: start from the memory estimate, then probe and bisect.

Each probe runs a few real steps in a fresh process (scripts/benchmark.py), so one OOM cannot poison the
next probe. Example:

    python scripts/find_max_batch_size.py --config train_configs/dit_xl2_latent256.toml --steps 3 \
        [--nproc 4] [--start 64] [--limit 1024] [-- --activation_checkpoint.mode selective]

The search doubles from the start while probes fit (halves while they do not), then bisects between the
largest batch that ran and the smallest that ran out of memory: O(log(batch)) probes. A probe that fails
for any other reason stops the search, since a broken config must not pass for a memory limit.
"""

import argparse
import json
import shlex
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


@dataclass
class Probe:
    """One probe's outcome: status "ok", "OOM" or "failed (...)"; peak memory when measured."""

    batch: int
    status: str
    peak_memory_gib: float | None = None
    result: dict = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.status == "ok"


class ProbeFailed(RuntimeError):
    """A probe failed for a reason other than running out of memory."""


def find_max_batch_size(probe: Callable[[int], Probe], start: int, limit: int = 4096,
                        multiple_of: int = 1) -> tuple[int, list[Probe]]:  # fmt: skip
    """Largest batch (a multiple of `multiple_of`, at most `limit`) for which `probe` runs; 0 if none.

    Args:
        probe: runs the training at a batch size and says whether it fitted (injectable for tests).
        start: first batch to try (e.g. the largest whose estimate fits the device).
        limit: never probe above this (on CPU nothing runs out of memory).
        multiple_of: batch granularity (e.g. to keep a global batch divisible).

    Returns:
        (the largest batch that ran, every probe in the order run).

    Raises:
        ProbeFailed: a probe failed without running out of memory.
    """
    history: list[Probe] = []

    def fits(k: int) -> bool:
        outcome = probe(k * multiple_of)
        history.append(outcome)
        if not outcome.ok and outcome.status != "OOM":
            raise ProbeFailed(f"batch {k * multiple_of}: {outcome.status}")
        return outcome.ok

    top = limit // multiple_of
    if top < 1:
        return 0, history
    k = min(max(1, start // multiple_of), top)
    fit, fail = (k, None) if fits(k) else (0, k)  # in units of multiple_of; fail = smallest known OOM
    while fail is None and fit < top:  # grow until something runs out of memory
        nxt = min(2 * fit, top)
        fit, fail = (nxt, None) if fits(nxt) else (fit, nxt)
    while fit == 0 and fail > 1:  # shrink until something runs
        nxt = fail // 2
        fit, fail = (nxt, fail) if fits(nxt) else (0, nxt)
    while fail is not None and fail - fit > 1:
        mid = (fit + fail) // 2
        fit, fail = (mid, fail) if fits(mid) else (fit, mid)
    return fit * multiple_of, history


def benchmark_probe(config: str, train_args: list[str], nproc: int = 1, steps: int = 3,
                    warmup: int = 1) -> Callable[[int], Probe]:  # fmt: skip
    """A probe that runs scripts/benchmark.py for one case in a fresh process at the given batch."""

    def probe(batch: int) -> Probe:
        overrides = shlex.join([*train_args, "--training.local_batch_size", str(batch),
                                "--training.global_batch_size=-1"])  # fmt: skip
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "result.json"
            cmd = [sys.executable, str(ROOT / "scripts" / "benchmark.py"), "--config", config, "--warmup",
                   str(warmup), "--steps", str(steps), "--nproc", str(nproc), "--case", f"bs{batch}={overrides}",
                   "--json-out", str(out)]  # fmt: skip
            proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
            if not out.is_file():
                return Probe(batch, f"failed ({proc.returncode}): {proc.stderr[-500:]}")
            result = json.loads(out.read_text())[0]
        print(f"probe batch {batch}: {result['status']}", flush=True)
        return Probe(batch, result["status"], result.get("peak_memory_gib"), result)

    return probe


def device_memory_bytes() -> int | None:
    """Total memory of this machine's first GPU, or None without one."""
    import torch

    return torch.cuda.get_device_properties(0).total_memory if torch.cuda.is_available() else None


def estimated_start(config: str, train_args: list[str], nproc: int, memory_bytes: int | None) -> int:
    """The largest batch whose analytic estimate fits `memory_bytes` (1 when no memory size is known)."""
    from torchtitan.config_manager import parse_args
    from torchtitan.tools.memory_estimate import estimate_from_job_config, max_batch_that_fits

    if not memory_bytes:
        return 1
    cfg = parse_args(["--job.config_file", config, *train_args])

    def estimate(batch: int):
        cfg.training.local_batch_size = batch
        return estimate_from_job_config(cfg, nproc)

    return max(1, max_batch_that_fits(memory_bytes, estimate))


def find_max_local_batch_size(config: str, train_args: list[str] | None = None, nproc: int = 1, steps: int = 3,
                              start: int = 0, limit: int = 4096, memory_gib: float = 0.0,
                              probe: Callable[[int], Probe] | None = None) -> dict:  # fmt: skip
    """Estimate, then probe: the entry point for scripts and for `--training.local_batch_size auto`.

    Returns:
        {"batch": the largest batch that ran (0: none), "start", "peak_memory_gib", "probes": [...]}.
    """
    train_args = list(train_args or [])
    memory = int(memory_gib * 1024**3) if memory_gib else device_memory_bytes()
    start = start or estimated_start(config, train_args, nproc, memory)
    probe = probe or benchmark_probe(config, train_args, nproc, steps)
    best, history = find_max_batch_size(probe, start, limit)
    peak = next((p.peak_memory_gib for p in history if p.batch == best and p.ok), None)
    probes = [{"batch": p.batch, "status": p.status, "peak_memory_gib": p.peak_memory_gib} for p in history]
    return {"batch": best, "start": start, "peak_memory_gib": peak, "probes": probes}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="TOML config the probes train")
    parser.add_argument("--nproc", type=int, default=1, help="processes per probe (torchrun)")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per probe (after 1 warmup step)")
    parser.add_argument("--start", type=int, default=0, help="first batch (default: from the memory estimate)")
    parser.add_argument("--limit", type=int, default=4096, help="largest batch to try")
    parser.add_argument("--memory-gib", type=float, default=0.0, help="device memory (default: GPU 0's)")
    parser.add_argument("--json-out", default="", help="also write the result here")
    args, train_args = parser.parse_known_args(argv)
    train_args = [a for a in train_args if a != "--"]
    result = find_max_local_batch_size(args.config, train_args, args.nproc, args.steps, args.start, args.limit,
                                       args.memory_gib)  # fmt: skip
    peak = result["peak_memory_gib"]
    memory = f", peak memory {peak:.2f} GiB" if peak is not None else ""
    print(f"largest local batch that runs: {result['batch']}{memory} "
          f"(start {result['start']}, {len(result['probes'])} probes)")  # fmt: skip
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
