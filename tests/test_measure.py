"""torchtitan.measure on CPU: what scripts/benchmark.py reports of the trainer's own step, and of its loader."""

import pytest

from tests.conftest import TINY
from torchtitan.measure import measure_overrides, measure_steps


def test_own_data_keeps_the_config_dataset_and_times_its_loader(tmp_path):
    args = [*TINY, "--job.dump_folder", str(tmp_path), "--training.local_batch_size", "8"]
    assert measure_overrides(args)[-4:] == ["--training.dataset", "dummy", "--sampling.freq", "0"]
    assert "--training.dataset" not in measure_overrides(args, own_data=True)
    result = measure_steps(args, warmup=1, steps=3, own_data=True)
    assert result["global_batch"] == 8 and (result["world_size"], result["layout"]) == (1, "single")
    assert result["images_per_second"] == pytest.approx(8 / result["step_time_s"], rel=1e-12)
    assert 0 < result["data_time_share"] < 1 and result["streamed_step_time_s"] > 0
    # No loader workers: the main process is the one worker.
    assert result["loader_workers"] == 0 and result["loader_images_per_second"] > 0
    assert result["loader_images_per_second_per_worker"] == result["loader_images_per_second"]
