"""The batch-size finder: finds a planted memory limit in O(log) probes; one real probe in a fresh process."""

import math

import pytest

from scripts.find_max_batch_size import (
    Probe,
    ProbeFailed,
    benchmark_probe,
    find_max_batch_size,
    find_max_local_batch_size,
)
from tests.conftest import ROOT


def planted(limit: int, calls: list[int]):
    """A fake run that 'runs out of memory' above `limit`."""

    def probe(batch: int) -> Probe:
        calls.append(batch)
        return Probe(batch, "ok" if batch <= limit else "OOM", peak_memory_gib=batch / 10)

    return probe


@pytest.mark.parametrize("start", [1, 16, 37, 40, 64, 500, 10_000])
def test_finds_the_planted_limit_in_log_probes(start):
    calls = []
    best, history = find_max_batch_size(planted(37, calls), start, limit=4096)
    assert best == 37
    assert [p.batch for p in history] == calls and len(set(calls)) == len(calls)  # no batch probed twice
    assert len(calls) <= 2 * math.ceil(math.log2(max(start, 37))) + 2


@pytest.mark.parametrize("limit", [0, 1, 2, 100, 4096])
def test_edges(limit):
    best, history = find_max_batch_size(planted(limit, []), 32, limit=4096)
    assert best == limit
    assert len(history) <= 2 * 12 + 2


def test_multiple_of_and_upper_limit():
    best, _ = find_max_batch_size(planted(37, []), 8, limit=4096, multiple_of=8)
    assert best == 32
    best, history = find_max_batch_size(planted(10**6, []), 8, limit=100)
    assert best == 100 and max(p.batch for p in history) == 100


def test_a_failure_that_is_not_oom_stops_the_search():
    def broken(batch):
        return Probe(batch, "failed (2)")

    with pytest.raises(ProbeFailed, match="batch 16"):
        find_max_batch_size(broken, 16)


def test_start_comes_from_the_estimate():
    config = str(ROOT / "train_configs/debug_model.toml")
    calls = []
    result = find_max_local_batch_size(config, [], memory_gib=0.1, probe=planted(37, calls))
    # The debug model's estimate allows a few hundred images in 0.1 GiB; the probes then bisect down to 37.
    assert result["start"] > 37 and calls[0] == result["start"]
    assert result["batch"] == 37 and result["peak_memory_gib"] == pytest.approx(3.7)
    assert [p["batch"] for p in result["probes"]] == calls


def test_real_probe_runs_in_a_fresh_process(tmp_path):
    args = ["--training.ema_decay", "0", "--job.dump_folder", str(tmp_path)]
    probe = benchmark_probe(str(ROOT / "train_configs/debug_model.toml"), args, steps=1)
    outcome = probe(4)
    assert outcome.ok, outcome.status
    assert outcome.result["global_batch"] == 4
