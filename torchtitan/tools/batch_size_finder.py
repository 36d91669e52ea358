"""Largest local batch size that trains: start from the memory estimate, then probe and bisect.

Each probe runs a few real steps of the trainer in a fresh process (torchtitan.tools.runs), so one OOM cannot
poison the next probe. The search doubles from the start while probes fit (halves while they do not), then
bisects between the largest batch that ran and the smallest that ran out of memory: O(log(batch)) probes. Where
the device's memory is known, the probes' measured peaks steer each step towards where memory runs out (a line
through them, `predicted_max_batch`): two or three probes near the answer instead of a bisection's dozen.
A probe that fails for any other reason stops the search, since a broken config must not pass for a memory
limit.

Used by scripts/find_max_batch_size.py (the CLI) and by the trainer's `--training.local_batch_size auto`
(`resolve_local_batch_size`).
"""

import copy
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from torchtitan.errors import ConfigError
from torchtitan.tools.logging import logger
from torchtitan.tools.runs import Run, launch

ROOT = Path(__file__).resolve().parents[2]
# Share of GPU memory the estimate may fill when it alone picks the batch (several ranks): the estimate
# is within -6%..+11% of measured peaks (docs/memory.md), and the CUDA context and fragmentation come on top. The
# finder's line aims the measured active peaks at it too: the 7B on 4 H200s ran two steps at 227 a GPU with 125.8 GiB
# active (0.90 of 139.8; the call ended in its third) and ran out of memory at 236 (2026-11-28).
ESTIMATE_HEADROOM = 0.9
# Probes that follow the measured-memory line before doubling and bisection take over: an exact line needs one
# probe past the first, and one more confirms the boundary; a third covers a step of the allocator's rounding.
GUIDED_PROBES = 3


@dataclass
class Probe:
    """One probe's outcome: status "ok", "OOM" or "failed (...)"; peak active and reserved memory when measured."""

    batch: int
    status: str
    peak_memory_gib: float | None = None
    result: dict = field(default_factory=dict)
    reserved_gib: float | None = None

    @property
    def ok(self) -> bool:
        return self.status == "ok"


class ProbeFailed(RuntimeError):
    """A probe failed for a reason other than running out of memory."""


def predicted_max_batch(probes: list[Probe], memory_gib: float | None, slope_gib: float | None = None) -> float | None:
    """The batch at which the active peak reaches `memory_gib`, on a line through what the probes that ran measured.

    Peak memory is affine in the batch. The line goes through the smallest and the largest batch that ran, or
    with one only, through it with `slope_gib` per sample (the analytic estimate's). Active memory, not reserved:
    the allocator's reserve grows to fill the device whatever the batch (138.0-138.2 GiB of 139.8 for the 7B at
    214, 218 and 227 a GPU, 2026-11-28), so only the active peak tells how much a batch needs. None without a
    point, a slope or `memory_gib`.
    """
    points = sorted({(p.batch, p.peak_memory_gib) for p in probes if p.ok and p.peak_memory_gib})
    if not memory_gib or not points:
        return None
    (b1, m1), (b2, m2) = points[0], points[-1]
    slope = (m2 - m1) / (b2 - b1) if b2 > b1 else slope_gib
    if not slope or slope <= 0:
        return None
    return b2 + (memory_gib - m2) / slope


def find_max_batch_size(probe: Callable[[int], Probe], start: int, limit: int = 4096, multiple_of: int = 1,
                        predict: Callable[[list[Probe]], float | None] | None = None, known: tuple[Probe, ...] = (),
                        ) -> tuple[int, list[Probe]]:  # fmt: skip
    """Largest batch (a multiple of `multiple_of`, at most `limit`) for which `probe` runs; 0 if none.

    With `predict`, the probes' measured memory guides the search where a probe costs minutes (a 7B model's): the
    next batch is the predicted largest (`predicted_max_batch`), kept inside what doubling or bisection would
    bracket. At most GUIDED_PROBES follow the guide, and none after one that ran out of memory (the line overshot):
    a wrong guide costs a few probes, never the answer, which stays exact: the largest batch that ran, with the
    next multiple out of memory (or at the limit).

    Args:
        probe: runs the training at a batch size and says whether it fitted (injectable for tests).
        start: first batch to try (e.g. the largest whose estimate fits the device).
        limit: never probe above this (on CPU nothing runs out of memory).
        multiple_of: batch granularity (e.g. to keep a global batch divisible).
        predict: the probes so far -> the predicted largest batch, or None (then doubling and bisection).
        known: probes recorded earlier (a search cut off and resumed): the search starts from the bracket they
            establish, the largest that ran and the smallest above it that ran out of memory, and they count in
            the history and in `predict`'s line.

    Returns:
        (the largest batch that ran, every probe in the order run).

    Raises:
        ProbeFailed: a probe failed without running out of memory.
    """
    history: list[Probe] = list(known)

    def fits(k: int) -> bool:
        outcome = probe(k * multiple_of)
        history.append(outcome)
        if not outcome.ok and outcome.status != "OOM":
            raise ProbeFailed(f"batch {k * multiple_of}: {outcome.status}")
        return outcome.ok

    guided_left = GUIDED_PROBES if predict is not None else 0

    def step(fit: int, fail: int | None, plain: int) -> tuple[int, int | None]:
        """One probe: at the guide's predicted largest, inside the bracket, or at `plain`; the new bracket."""
        nonlocal guided_left
        guess = predict(history) if guided_left > 0 else None
        nxt = plain
        if guess is not None:
            guided_left -= 1
            k = int(guess // multiple_of)
            nxt = min(max(k, fit + 1), 2 * fit, top) if fail is None else min(max(k, fit + 1), fail - 1)
        if fits(nxt):
            return nxt, fail
        if guess is not None:  # the line ran past the device: bisection from here
            guided_left = 0
        return fit, nxt

    top = limit // multiple_of
    if top < 1:
        return 0, history
    ran = [p.batch // multiple_of for p in known if p.ok and p.batch % multiple_of == 0 and p.batch <= limit]
    if ran:  # resumed: from the recorded bracket
        fit = max(ran)
        fail = min((p.batch // multiple_of for p in known if p.status == "OOM" and p.batch > fit * multiple_of),
                   default=None)  # fmt: skip
    else:
        k = min(max(1, start // multiple_of), top)
        fit, fail = (k, None) if fits(k) else (0, k)  # in units of multiple_of; fail = smallest known OOM
    while fail is None and fit < top:  # grow until something runs out of memory
        fit, fail = step(fit, fail, min(2 * fit, top))
    while fit == 0 and fail > 1:  # shrink until something runs
        nxt = fail // 2
        fit, fail = (nxt, fail) if fits(nxt) else (0, nxt)
    while fail is not None and fail - fit > 1:
        fit, fail = step(fit, fail, (fit + fail) // 2)
    return fit * multiple_of, history


def benchmark_probe(config: str, train_args: list[str], nproc: int = 1, steps: int = 3,
                    warmup: int = 1) -> Callable[[int], Probe]:  # fmt: skip
    """A probe that measures the trainer's step at the given batch in a fresh process (torchtitan.tools.runs).

    The batch goes last on the command line, so it replaces any `local_batch_size` of the config or of
    `train_args` ("auto" included: a probe never searches itself).
    """

    def probe(batch: int) -> Probe:
        args = ["--job.config_file", config, *train_args, "--training.local_batch_size", str(batch),
                "--training.global_batch_size=-1"]  # fmt: skip
        outcome = launch(Run(f"bs{batch}", args, nproc), warmup, steps)
        print(f"probe batch {batch}: {outcome.status}", flush=True)
        status = outcome.status if outcome.status in ("ok", "OOM") else f"{outcome.status}: {outcome.output[-500:]}"
        return Probe(batch, status, outcome.result.get("memory_peak_active_gib"), outcome.result,
                     outcome.result.get("memory_peak_reserved_gib"))  # fmt: skip

    return probe


def estimated_max_batch(cfg, world_size: int, memory_bytes: int, limit: int = 1 << 16) -> int:
    """The largest local batch whose analytic estimate (per rank, these parallel degrees) fits `memory_bytes`."""
    from torchtitan.tools.memory_estimate import estimate_from_job_config, max_batch_that_fits

    cfg = copy.deepcopy(cfg)  # the estimate reads the batch from the config

    def estimate(batch: int):
        cfg.training.local_batch_size = batch
        return estimate_from_job_config(cfg, world_size)

    return max_batch_that_fits(memory_bytes, estimate, limit)


def estimated_gib_per_sample(cfg, world_size: int, batch: int) -> float:
    """The analytic estimate's memory per sample (GiB, per rank) between batch // 2 and `batch`: the slope of the
    line `predicted_max_batch` draws through a single probe."""
    from torchtitan.tools.memory_estimate import estimate_from_job_config

    cfg = copy.deepcopy(cfg)
    peaks = []
    for b in (max(1, batch // 2), max(2, batch)):
        cfg.training.local_batch_size = b
        peaks.append(estimate_from_job_config(cfg, world_size).peak)
    return (peaks[1] - peaks[0]) / (max(2, batch) - max(1, batch // 2)) / 1024**3


def estimated_start(config: str, train_args: list[str], nproc: int, memory_bytes: int | None) -> int:
    """The largest batch whose analytic estimate fits `memory_bytes` (1 when no memory size is known)."""
    from torchtitan.config_manager import parse_args

    if not memory_bytes:
        return 1
    cfg = parse_args(["--job.config_file", config, *train_args])
    return max(1, estimated_max_batch(cfg, nproc, memory_bytes))


def find_max_local_batch_size(config: str, train_args: list[str] | None = None, nproc: int = 1, steps: int = 3,
                              start: int = 0, limit: int = 4096, memory_gib: float = 0.0,
                              probe: Callable[[int], Probe] | None = None) -> dict:  # fmt: skip
    """Estimate, then probe: the entry point for scripts and for `--training.local_batch_size auto`.

    Returns:
        {"batch": the largest batch that ran (0: none), "start", "peak_memory_gib", "probes": [...]}.
    """
    from torchtitan.config_manager import parse_args
    from torchtitan.tools.memory_estimate import device_memory_bytes

    train_args = list(train_args or [])
    memory = int(memory_gib * 1024**3) if memory_gib else device_memory_bytes()
    start = start or estimated_start(config, train_args, nproc, memory)
    probe = probe or benchmark_probe(config, train_args, nproc, steps)
    predict = None
    if memory:
        slope = estimated_gib_per_sample(parse_args(["--job.config_file", config, *train_args]), nproc, start)
        predict = lambda probes: predicted_max_batch(probes, ESTIMATE_HEADROOM * memory / 1024**3, slope)
    best, history = find_max_batch_size(probe, start, limit, predict=predict)
    peak = next((p.peak_memory_gib for p in history if p.batch == best and p.ok), None)
    probes = [{"batch": p.batch, "status": p.status, "peak_memory_gib": p.peak_memory_gib} for p in history]
    return {"batch": best, "start": start, "peak_memory_gib": peak, "probes": probes}


def largest_divisor_at_most(n: int, bound: int) -> int:
    """The largest d <= bound that divides n (n, bound >= 1)."""
    return next(d for d in range(min(n, bound), 0, -1) if n % d == 0)


def _search_one_process(cfg, memory_bytes: int, limit: int, probe) -> tuple[int, str]:
    """Fresh-process probes of this very config (written out resolved, so CLI overrides count too)."""
    from torchtitan.config_manager import to_toml

    with tempfile.TemporaryDirectory(prefix="batch_probe_") as tmp:
        config = Path(tmp) / "resolved.toml"
        config.write_text(to_toml(cfg))
        args = ["--job.dump_folder", str(Path(tmp) / "probe"), "--metrics.enable_wandb", "false"]
        result = find_max_local_batch_size(str(config), args, limit=limit, memory_gib=memory_bytes / 1024**3,
                                           probe=probe)  # fmt: skip
    peak = result["peak_memory_gib"]
    memory = f", peak memory {peak:.2f} GiB" if peak is not None else ""
    return result["batch"], f"probed in {len(result['probes'])} fresh processes{memory}"


def resolve_local_batch_size(cfg, world_size: int, dp_degree: int, device_type: str, memory_bytes: int | None = None,
                             probe: Callable[[int], Probe] | None = None) -> int:  # fmt: skip
    """`training.local_batch_size` as a number: the config's, or for "auto" the largest that fits.

    One process probes fresh processes (estimate, then bisection); several processes (torchrun) all take
    the analytic estimate for their per-rank share, so ranks agree without probing. With a global batch,
    the answer is the largest divisor of global_batch_size / dp_degree not above what fits.

    Args:
        cfg: the job config; its local batch size is read, not changed.
        world_size, dp_degree: processes in the job and data-parallel ranks among them.
        device_type: "cuda" or "cpu" ("auto" needs a GPU: CPU memory has no allocator limit to probe).
        memory_bytes: device memory (default: this process's GPU's).
        probe: replaces the fresh-process probe (tests).

    Raises:
        ConfigError: not even a batch of 1 fits (a CPU device and an indivisible global batch are refused
            before, by config_validation.validate_layout).
    """
    from torchtitan.tools.memory_estimate import device_memory_bytes

    t = cfg.training
    if t.local_batch_size != "auto":
        return t.local_batch_size
    key = f"training.local_batch_size = 'auto' in {cfg.source_of('training.local_batch_size')}"
    share = t.global_batch_size // dp_degree if t.global_batch_size != -1 else None
    limit = share or 4096
    memory_bytes = memory_bytes or device_memory_bytes(_current_cuda_device())
    if world_size == 1:
        found, how = _search_one_process(cfg, memory_bytes, limit, probe)
    else:
        budget = int(ESTIMATE_HEADROOM * memory_bytes)
        found = _agree_on_min(estimated_max_batch(cfg, world_size, budget, limit))
        how = f"analytic estimate within {ESTIMATE_HEADROOM:.0%} of {memory_bytes / 1024**3:.1f} GiB per rank"
    if found == 0:
        raise ConfigError(f"{key}: not even a batch of 1 fits ({how})")
    chosen = largest_divisor_at_most(share, found) if share else found
    why = ""
    if share:
        why = (f"; using {chosen}, the largest divisor of global_batch_size / dp degree = {t.global_batch_size} / "
               f"{dp_degree} = {share} not above it: {share // chosen} accumulation steps")  # fmt: skip
    logger.info(f"training.local_batch_size auto: {found} fits ({how}){why}")
    return chosen


def _current_cuda_device() -> int:
    import torch

    return torch.cuda.current_device() if torch.cuda.is_available() else 0


def _agree_on_min(batch: int) -> int:
    """The smallest answer over the ranks (GPUs of one job may differ in memory)."""
    import torch
    import torch.distributed as dist

    if not dist.is_initialized():
        return batch
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    value = torch.tensor(batch, device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MIN)
    return int(value.item())
