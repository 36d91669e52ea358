"""Two torchrun launchers as two 'nodes' on one machine, c10d rendezvous on localhost."""

import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT, TINY, free_port, read_metrics, run_train


@pytest.mark.slow
def test_two_nodes_match_one_process(tmp_path):
    args = [*TINY, "--training.steps", "3", "--training.global_batch_size", "16"]
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    launchers = []
    for node in range(2):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "1",
               "--node_rank", str(node), "--rdzv_backend", "c10d", "--rdzv_endpoint", f"localhost:{port}",
               "--rdzv_id", "test", "train.py", *args, "--training.local_batch_size", "8",
               "--parallelism.data_parallel_replicate_degree", "2",
               "--job.dump_folder", str(tmp_path / "multi")]  # fmt: skip
        launchers.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                          text=True))  # fmt: skip
    outputs = [p.communicate(timeout=300)[0] for p in launchers]
    assert all(p.returncode == 0 for p in launchers), outputs[0][-3000:] + outputs[1][-3000:]
    run_train([*args, "--training.local_batch_size", "16", "--job.dump_folder", str(tmp_path / "one")])
    for a, b in zip(read_metrics(tmp_path / "multi"), read_metrics(tmp_path / "one")):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)


def test_device_comes_from_local_rank(monkeypatch):
    """On a second node RANK is 8.. but the GPU index is LOCAL_RANK (the classic DiT/SiT bug)."""
    import torch

    from torchtitan.tools import utils

    picked = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", picked.append)
    monkeypatch.setenv("RANK", "9")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert utils.get_device() == torch.device("cuda", 1) and picked == [1]
