"""One warm-step summary of a run folder: medians over the steps after the first few, and the peak memory."""

import json
import statistics
from pathlib import Path

from torchtitan.tools.runs import warm_summary

GIB = 1024**3
# Per-step rates whose median the summary reports (tokens and sequences for language models; mfu and tflops exist
# on GPUs only).
RATES = ("images_per_second", "tokens_per_second", "sequences_per_second", "mfu", "tflops")


def read_jsonl(path: Path) -> list[dict]:
    """The records of a JSON-lines file ([] when there is none)."""
    path = Path(path)
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def warm_metrics(run_dir: Path, skip: int) -> dict:
    """The warm steps of a run's metrics.jsonl (every step logged): all but the first `skip` logged steps.

    Args:
        run_dir: the run folder (metrics.jsonl; memory_breakdown.json where the breakdown was on).
        skip: logged steps left out: compilation, warm-up, the breakdown's synchronizing steps.

    Returns:
        warm_steps (their step numbers); the median step_time_s (with its min, max and count, as
        torchtitan.tools.runs' `warm_summary` gives them) and the medians of images_per_second, mfu and
        tflops (tokens_per_second and sequences_per_second for language models), a stray slow step does not
        move them; peak_memory_gib, the largest `memory_peak_active_gib` of
        the warm steps (rank 0), or on CPU, where train.py logs no memory, the breakdown's largest "peak"
        (peak_memory_source says which); reserved_gib, the largest reserved memory. Keys without data are left out.
    """
    records = read_jsonl(Path(run_dir) / "metrics.jsonl")
    warm = [r for r in records if "validation_loss" not in r][skip:]  # training steps, not validation records
    out: dict = {"warm_steps": [r["step"] for r in warm]}
    times = [r["step_time_s"] for r in warm if "step_time_s" in r]
    if times:
        out.update(warm_summary(times))
    for key in RATES:
        values = [r[key] for r in warm if key in r]
        if values:
            out[key] = statistics.median(values)
    peaks = [r["memory_peak_active_gib"] for r in warm if "memory_peak_active_gib" in r]
    if peaks:
        out.update(peak_memory_gib=max(peaks), peak_memory_source="metrics.jsonl (warm steps, rank 0)")
    else:
        out.update(_breakdown_peak(run_dir))
    reserved = [r["memory_peak_reserved_gib"] for r in warm if "memory_peak_reserved_gib" in r]
    if reserved:
        out["reserved_gib"] = max(reserved)
    return out


def breakdown_records(run_dir: Path) -> list[dict]:
    """The records of a run's memory_breakdown.json (rank 0; [] without one): step, stage ("init", "forward",
    "backward", "optimizer_step", "zero_grad"), bytes per part, "total", "peak" since the previous record
    (torchtitan/tools/memory_breakdown.py)."""
    path = Path(run_dir) / "memory_breakdown.json"
    return json.loads(path.read_text())["records"] if path.is_file() else []


def _breakdown_peak(run_dir: Path) -> dict:
    """The largest "peak" of a run's memory breakdown (bytes per record) in GiB, or {} without one."""
    records = breakdown_records(run_dir)
    if not records:
        return {}
    peak = max(r["peak"] for r in records) / GIB
    return {"peak_memory_gib": peak, "peak_memory_source": "memory_breakdown.json (peak)"}
