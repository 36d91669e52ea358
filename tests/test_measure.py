"""torchtitan.measure on CPU: what scripts/benchmark.py reports of the trainer's own step, and of its loader."""

import gzip
import json

import pytest

from tests.conftest import TINY
from torchtitan.measure import measure_overrides, measure_steps


def test_own_data_keeps_the_config_dataset_and_times_its_loader_and_profiles_the_host(tmp_path, capsys):
    args = [*TINY, "--job.dump_folder", str(tmp_path), "--training.local_batch_size", "8"]
    assert measure_overrides(args)[-4:] == ["--training.dataset", "dummy", "--sampling.freq", "0"]
    assert "--training.dataset" not in measure_overrides(args, own_data=True)
    result = measure_steps(args, warmup=1, steps=3, own_data=True, profile=True, profile_dir=str(tmp_path / "prof"))
    assert result["global_batch"] == 8 and (result["world_size"], result["layout"]) == (1, "single")
    assert result["images_per_second"] == pytest.approx(8 / result["step_time_s"], rel=1e-12)
    assert 0 < result["data_time_share"] < 1 and result["streamed_step_time_s"] > 0
    # No loader workers: the main process is the one worker.
    assert result["loader_workers"] == 0 and result["loader_images_per_second"] > 0
    assert result["loader_images_per_second_per_worker"] == result["loader_images_per_second"]
    # The profile (here the host's alone: no CUDA): a row per op, heaviest first, per step of the 3 profiled; the
    # same table and a trace in the folder.
    printed = capsys.readouterr().out
    table = printed[printed.index("PROFILE host per step") :]
    rows = [line.split(" | ") for line in table.splitlines()[3:] if line.startswith("| ")]
    assert len(rows) == 25 and all(float(r[1]) > 0 and float(r[2]) >= float(r[1]) for r in rows), table
    own = [float(r[1]) for r in rows]
    assert own == sorted(own, reverse=True) and sum(own) <= float(table.split(": ")[1].split(" ms")[0]) + 0.1, table
    # Every step runs the same ops: the model's linear layers' matmuls come a whole number of times per step.
    matmuls = [float(r[3].rstrip(" |")) for r in rows if r[0].strip("| ") in ("aten::mm", "aten::addmm")]
    assert matmuls and all(calls >= 1 and calls == int(calls) for calls in matmuls), table
    assert (tmp_path / "prof" / "profile.md").read_text().strip() == table.strip()
    trace = json.loads(gzip.open(tmp_path / "prof" / "trace.json.gz").read())
    assert any(e.get("name", "").startswith("aten::") for e in trace["traceEvents"])
