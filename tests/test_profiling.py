"""Profiler traces on CPU every profile_freq steps; memory snapshots are CUDA-only and off cleanly on CPU."""

import json
import logging
from types import SimpleNamespace

import torch

from torchtitan.components.profiling import Profiler, idle_gaps
from torchtitan.job_config import Profiling


def test_traces_every_profile_freq_steps_and_no_snapshot_on_cpu(tmp_path, caplog):
    config = Profiling(enable_profiling=True, profile_freq=2, profiler_active=1, enable_memory_snapshot=True)
    with caplog.at_level(logging.WARNING):
        profiler = Profiler(config, tmp_path, rank=0, device=torch.device("cpu"))
    assert "enable_memory_snapshot needs a CUDA device" in caplog.text
    layer = torch.nn.Linear(8, 8)
    for step in range(1, 5):
        layer(torch.randn(4, 8)).sum().backward()
        profiler.step(step)
    assert profiler.dump_snapshot("oom") is None  # what train.py calls on an out-of-memory error
    profiler.close()
    traces = sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*.json"))
    assert traces == ["profile_traces/iteration_2/rank0_trace.json", "profile_traces/iteration_4/rank0_trace.json"]
    events = json.loads((tmp_path / traces[0]).read_text())["traceEvents"]
    assert any("addmm" in event.get("name", "") for event in events)  # the Linear's matmul was recorded
    assert not (tmp_path / "memory_snapshot").exists()


def test_idle_gaps_sums_the_waits_between_gpu_kernels():
    # Fake CUDA events (times in us) over 2 steps: waits of 100 and 300 us after "a", 2 us (under the 5 us floor)
    # after "b", none where "c" overlaps "b"'s end; CPU events do not count.
    def event(name, start, end, device=torch.autograd.DeviceType.CUDA):
        return SimpleNamespace(name=name, time_range=SimpleNamespace(start=start, end=end), device_type=device)

    events = [
        event("a", 0, 10),
        event("b", 110, 200),
        event("c", 150, 220),
        event("b", 222, 300),
        event("a", 300, 310),
        event("cpu op", 310, 900, torch.autograd.DeviceType.CPU),
        event("c", 610, 620),
    ]
    text = idle_gaps(SimpleNamespace(events=lambda: events), steps=2)
    assert "0.20 ms per step" in text  # (100 + 300) us over 2 steps
    assert "| a -> b | 0.050 | 0.5 |" in text and "| a -> c | 0.150 | 0.5 |" in text
    assert "c -> b" not in text
