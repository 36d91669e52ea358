"""The largest batch a script's run trains at: the package's finder over probes that are recorded runs.

The search is torchtitan.tools.batch_size_finder's (double while probes fit, halve while they do not, then
bisect); each probe here is the script's own run at that batch, executed and recorded like any other
(`execute`: train.log, status.json), so a probe that failed can be read afterwards.
"""

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from scripts.lib.runner import execute, read_status, same_command
from scripts.lib.summary import GIB, warm_metrics
from torchtitan.tools.batch_size_finder import (
    ESTIMATE_HEADROOM,
    Probe,
    ProbeFailed,
    estimated_gib_per_sample,
    estimated_max_batch,
    find_max_batch_size,
    predicted_max_batch,
)
from torchtitan.tools.runs import Run


def device_memory_gib() -> float | None:
    """GPU 0's memory, asked in a child process: CUDA in this one would hold memory that the probes need."""
    code = "import torch; print(torch.cuda.get_device_properties(0).total_memory if torch.cuda.is_available() else 0)"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    total = int(proc.stdout.strip() or 0) if proc.returncode == 0 else 0
    return total / GIB or None


def recorded_probes(run_at: Callable[[int], Run], folder: Path) -> tuple[Probe, ...]:
    """The probes of this search that an earlier call recorded under `folder` (ok or out of memory, for the same
    command as `run_at` gives now), as the search resumes from them."""
    found = []
    for status_file in sorted(Path(folder).glob("*/status.json")):
        record = read_status(status_file.parent)
        batch = (record.get("knobs") or {}).get("batch")
        if record.get("status") not in ("ok", "OOM") or not batch:
            continue
        run = run_at(batch)
        if run.name != status_file.parent.name or not same_command(record, run, status_file.parent):
            continue
        measured = warm_metrics(status_file.parent, skip=0)
        found.append(Probe(batch, record["status"], measured.get("peak_memory_gib"), {**record, **measured},
                           measured.get("reserved_gib")))  # fmt: skip
    return tuple(sorted(found, key=lambda p: p.batch))


def batch_probe(run_at: Callable[[int], Run], folder: Path, timeout: float | None = None,
                force: bool = False) -> Callable[[int], Probe]:  # fmt: skip
    """A finder probe: executes `run_at(batch)` in `folder/<its name>/` and reads its peak memory.

    Every step counts for the peak (probes are short: the optimizer's states exist from the second step on).
    """

    def probe(batch: int) -> Probe:
        run = run_at(batch)
        run_dir = Path(folder) / run.name
        record = execute(run, run_dir, timeout, force, keep=("ok", "OOM"))
        measured = warm_metrics(run_dir, skip=0)
        return Probe(batch, record["status"], measured.get("peak_memory_gib"), {**record, **measured},
                     measured.get("reserved_gib"))  # fmt: skip

    return probe


def search(probe: Callable[[int], Probe], start: int, limit: int, multiple_of: int = 1,
           predict: Callable[[list[Probe]], float | None] | None = None,
           known: tuple[Probe, ...] = ()) -> dict:  # fmt: skip
    """The finder's answer from `start`, at most `limit`, in multiples of `multiple_of`, steered by `predict` and
    resumed from the `known` probes where given (`find_max_batch_size`).

    Returns:
        batch (the largest that ran, 0: none; None when a probe failed otherwise, `error` says how), start,
        lower_bound (no probe ran out of memory above it: the device may hold more, e.g. at the limit),
        peak_memory_gib of that batch's probe, and every probe (batch, status, peak memory) in the order run.
    """
    try:
        best, history = find_max_batch_size(probe, start, limit, multiple_of, predict, known)
    except ProbeFailed as e:  # a broken run must not pass for a memory limit
        return {"batch": None, "start": start, "error": str(e)}
    oom_above = any(p.status == "OOM" and p.batch > best for p in history)
    return {"batch": best, "start": start, "lower_bound": not oom_above,
            "peak_memory_gib": next((p.peak_memory_gib for p in history if p.ok and p.batch == best), None),
            "probes": [{"batch": p.batch, "status": p.status, "peak_memory_gib": p.peak_memory_gib,
                        "reserved_gib": p.reserved_gib} for p in history]}  # fmt: skip


def estimated_start(run: Run, memory_gib: float | None) -> int:
    """The largest batch whose analytic memory estimate (per rank) fits `memory_gib`; 1 without a GPU."""
    from torchtitan.config_manager import parse_args

    if not memory_gib:
        return 1
    return max(1, estimated_max_batch(parse_args(run.args), run.nproc, int(memory_gib * GIB)))


def memory_guide(run: Run, memory_gib: float | None, start: int) -> Callable[[list[Probe]], float | None] | None:
    """The finder's guide for `run` on a device of `memory_gib`: the line through the probes' peaks, with the
    analytic estimate's memory per sample while only one probe ran; None without a GPU."""
    from torchtitan.config_manager import parse_args

    if not memory_gib:
        return None
    slope = estimated_gib_per_sample(parse_args(run.args), run.nproc, start)
    return lambda probes: predicted_max_batch(probes, ESTIMATE_HEADROOM * memory_gib, slope)


def find_max_batch(run_at: Callable[[int], Run], folder: Path, limit: int, timeout: float | None = None,
                   force: bool = False) -> dict:  # fmt: skip
    """The largest batch at which `run_at(batch)` trains, from the memory estimate, kept in `<folder>.json`.

    Args:
        run_at: the script's run at a batch (short: a few steps); its name must tell batches apart.
        folder: the probes' run folders go below it; the answer next to it (an earlier answer is reused; an earlier
            failure is not: the search runs again over the probes recorded ok or OOM).
        limit: largest batch to try (on CPU nothing runs out of memory: the search stops there).
        timeout, force: per probe, as `execute` takes them; force also searches again.

    Returns:
        `search`'s answer; a config that does not parse gives batch None and the error too.
    """
    folder = Path(folder)
    found_file = folder.parent / f"{folder.name}.json"  # not with_suffix: run names hold dots ("dit_0.5B_...")
    if found_file.is_file() and not force:  # the probes are the expensive part: keep their answer
        kept = json.loads(found_file.read_text())
        if kept.get("batch") is not None:  # a search that failed (a probe's timeout, a crash) runs again
            return kept
    memory = device_memory_gib()
    try:
        start = min(estimated_start(run_at(1), memory), limit)
        guide = memory_guide(run_at(1), memory, start)
    except ValueError as e:  # ConfigError: the run could not start either
        found = {"batch": None, "start": None, "error": str(e)}
    else:
        known = () if force else recorded_probes(run_at, folder)
        found = search(batch_probe(run_at, folder, timeout, force), start, limit, predict=guide, known=known)
    found_file.parent.mkdir(parents=True, exist_ok=True)
    found_file.write_text(json.dumps(found, indent=1))
    return found
