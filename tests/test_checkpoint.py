"""Checkpoints are never destroyed, never silently wrong, and one run owns its folder (debug config, CPU)."""

import errno
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.conftest import ROOT, TINY, read_metrics, run_train
from torchtitan.components.checkpoint import _save_failure_reason

CKPT = [*TINY, "--checkpoint.enable", "true", "--checkpoint.interval", "2", "--checkpoint.keep_latest_k", "0",
        "--debug.deterministic", "true"]  # fmt: skip


def steps_in(folder: Path) -> list[int]:
    return sorted(int(p.name.split("-")[1]) for p in (folder / "checkpoint").glob("step-*") if p.name[5:].isdigit())


def snapshot(folder: Path) -> dict[str, bytes]:
    files = sorted(p for p in (folder / "checkpoint").rglob("*") if p.is_file())
    return {str(p.relative_to(folder)): p.read_bytes() for p in files}


@pytest.fixture(scope="module")
def four_checkpoints(tmp_path_factory):
    """A run with checkpoints at steps 2, 4, 6 and 8, copied afresh by each test that changes it."""
    out = tmp_path_factory.mktemp("base") / "run"
    run_train([*CKPT, "--job.dump_folder", str(out), "--training.steps", "8"])
    assert steps_in(out) == [2, 4, 6, 8]
    return out


@pytest.fixture
def run_folder(four_checkpoints, tmp_path):
    import shutil

    out = tmp_path / "run"
    shutil.copytree(four_checkpoints, out)
    return out


@pytest.mark.parametrize("change, why", [
    (["--dp.enable", "true"], "checkpoint has no 'dp' state"),
    (["--optimizer.name", "SGD"], "it was written with optimizer.name = 'AdamW', this run has 'SGD'"),
])  # fmt: skip
def test_unloadable_checkpoints_refuse_to_start_and_are_kept(run_folder, change, why):
    before = snapshot(run_folder)
    result = run_train([*CKPT, "--job.dump_folder", str(run_folder), "--training.steps", "10", *change], check=False)
    assert result.returncode == 2
    for step in (2, 4, 6, 8):  # each one named, with why
        assert f"step-{step}: ValueError: {why}" in result.stderr
    assert snapshot(run_folder) == before  # nothing removed, nothing written
    assert len(read_metrics(run_folder)) == 8


def test_branch_from_an_older_step_keeps_its_checkpoints_and_restarts_on_the_branch(run_folder):
    run_train([*CKPT, "--job.dump_folder", str(run_folder), "--checkpoint.load_step", "2", "--checkpoint.keep_latest_k",
               "2", "--training.steps", "5"])  # fmt: skip
    # step-2 (resumed from) and the branch's own 4 and 5 are kept; the old 4, 6, 8 are set aside, not deleted.
    assert steps_in(run_folder) == [2, 4, 5]
    aside = sorted(p.name.split(".")[0] for p in (run_folder / "checkpoint" / "set_aside").iterdir())
    assert aside == ["step-4", "step-6", "step-8"]
    result = run_train([*CKPT, "--job.dump_folder", str(run_folder), "--training.steps", "6"])
    assert f"resumed from {run_folder / 'checkpoint' / 'step-5'} at step 5" in result.stderr
    branch = [m for m in read_metrics(run_folder) if m["step"] in (3, 4)][-2:]
    original = [m for m in read_metrics(run_folder) if m["step"] in (3, 4)][:2]
    assert [m["loss"] for m in branch] == [m["loss"] for m in original]  # the branch retraced steps 3-4 exactly


def test_a_truncated_data_file_is_named_and_the_one_before_resumes(run_folder):
    damaged = next((run_folder / "checkpoint" / "step-8").glob("*.distcp"))
    os.truncate(damaged, damaged.stat().st_size // 2)
    result = run_train([*CKPT, "--job.dump_folder", str(run_folder), "--training.steps", "9"])
    assert f"checkpoint {run_folder / 'checkpoint' / 'step-8'} could not be loaded" in result.stderr
    assert f"resumed from {run_folder / 'checkpoint' / 'step-6'} at step 6" in result.stderr
    assert read_metrics(run_folder)[-1]["step"] == 9


def test_a_non_finite_weight_in_a_checkpoint_is_refused(run_folder):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save, torch_save_to_dcp

    step8 = run_folder / "checkpoint" / "step-8"
    flat = run_folder / "flat.pt"
    dcp_to_torch_save(step8, flat)
    state = torch.load(flat, weights_only=False)
    state["model"]["final_layer.linear.weight"][0, 0] = float("nan")  # a flipped weight
    torch.save(state, flat)
    for path in step8.iterdir():
        path.unlink()
    torch_save_to_dcp(flat, step8)
    result = run_train([*CKPT, "--job.dump_folder", str(run_folder), "--training.steps", "10",
                        "--checkpoint.keep_latest_k", "1"])  # fmt: skip
    assert "non-finite values in ['model.final_layer.linear.weight']" in result.stderr
    assert f"resumed from {run_folder / 'checkpoint' / 'step-6'} at step 6" in result.stderr
    assert steps_in(run_folder) == [6, 10]  # the run kept the one it resumed from; the bad one is set aside
    assert [p.name.split(".")[0] for p in (run_folder / "checkpoint" / "set_aside").iterdir()] == ["step-8"]


@pytest.mark.parametrize("lr", ["1e6", "1e30"])
def test_a_non_finite_step_stops_the_run_before_it_is_applied_or_saved(tmp_path, lr):
    out = tmp_path / "run"
    result = run_train([*CKPT, "--job.dump_folder", str(out), "--training.steps", "20", "--optimizer.lr", lr,
                        "--training.max_norm", "0", "--checkpoint.interval", "1"], check=False)  # fmt: skip
    assert result.returncode == 1
    metrics = read_metrics(out)
    stopped = len(metrics) + 1  # the first step whose loss or gradient norm is not finite
    assert f"error: step {stopped}: " in result.stderr and "the run stops before applying this update" in result.stderr
    assert all(torch.isfinite(torch.tensor([m["loss"], m["grad_norm"]])).all() for m in metrics)
    assert steps_in(out) == list(range(1, stopped))  # no checkpoint of the step that failed, or after it
    assert not (out / "ema.safetensors").exists()
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(out / "checkpoint" / f"step-{stopped - 1}", tmp_path / "last.pt")
    last = torch.load(tmp_path / "last.pt", weights_only=False)
    assert all(torch.isfinite(t).all() for t in last["model"].values())


def test_a_changed_lr_on_resume_is_applied_and_logged(run_folder):
    args = [*CKPT, "--job.dump_folder", str(run_folder), "--lr_scheduler.decay_ratio", "0"]
    result = run_train([*args, "--training.steps", "10", "--optimizer.lr", "5e-4", "--optimizer.weight_decay",
                        "0.01"])  # fmt: skip
    assert "optimizer.lr: 0.001 in the checkpoint, 0.0005 in the config (applied)" in result.stderr
    assert "optimizer.weight_decay: 0.0 in the checkpoint, 0.01 in the config (applied)" in result.stderr
    assert [m["lr"] for m in read_metrics(run_folder)[8:]] == [pytest.approx(5e-4)] * 2
    assert "lr = 0.0005" in (run_folder / "config.toml").read_text()


@pytest.mark.slow
def test_a_one_process_checkpoint_resumes_every_rank_of_two(tmp_path):
    out = tmp_path / "run"
    args = [*CKPT, "--job.dump_folder", str(out), "--metrics.save_for_all_ranks", "true", "--lr_scheduler.warmup_steps",
            "10", "--training.global_batch_size", "8"]  # fmt: skip
    run_train([*args, "--training.steps", "4"])
    result = run_train([*args, "--training.steps", "6", "--training.local_batch_size", "4",
                        "--parallelism.data_parallel_replicate_degree", "2"], nproc=2)  # fmt: skip
    assert "was written by 1 rank(s), this run has 2: the data order restarts the epoch in progress" in result.stderr
    rank0, rank1 = read_metrics(out)[4:], read_metrics_of_rank(out, 1)
    # Every rank continues the warmup where the checkpoint left it (lr 5e-4 at step 5), Adam state and all.
    assert [m["lr"] for m in rank1] == [m["lr"] for m in rank0] == [pytest.approx(5e-4), pytest.approx(6e-4)]
    assert [m["grad_norm"] for m in rank1] == [m["grad_norm"] for m in rank0]


def read_metrics_of_rank(folder: Path, rank: int) -> list[dict]:
    import json

    return [json.loads(line) for line in (folder / f"metrics_rank{rank}.jsonl").read_text().splitlines()]


def test_a_second_run_in_the_same_folder_is_refused(tmp_path):
    out = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "train.py", *CKPT, "--job.dump_folder", str(out), "--training.steps", "100000"]
    first = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 120
        while not (out / "metrics.jsonl").is_file() or not (out / "metrics.jsonl").read_text():
            assert first.poll() is None and time.time() < deadline, "the first run did not start"
            time.sleep(0.1)
        second = run_train([*CKPT, "--job.dump_folder", str(out), "--training.steps", "2"], check=False)
        assert second.returncode == 2
        assert f"job.dump_folder {out} is in use by another run (pid {first.pid} on " in second.stderr
        assert first.poll() is None  # the first run goes on, untouched
    finally:
        first.kill()
        first.wait()
    steps = [m["step"] for m in read_metrics(out)]
    assert steps == list(range(1, len(steps) + 1))  # one run's lines only
    run_train([*CKPT, "--job.dump_folder", str(out), "--training.steps", "2", "--checkpoint.enable", "false"])


def test_a_failed_save_removes_its_partial_folder_and_keeps_the_last_good_one(run_folder):
    # A file-size limit cuts the checkpoint's data file short, as a full disk does (torch's writer then reports
    # only "unexpected pos"); the training files stay far below it.
    def limit_file_size():
        resource.setrlimit(resource.RLIMIT_FSIZE, (1_000_000, 1_000_000))

    cmd = [sys.executable, "train.py", *CKPT, "--job.dump_folder", str(run_folder), "--training.steps", "10"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, preexec_fn=limit_file_size)
    assert result.returncode == 1
    assert "error: checkpoint step-10 could not be written: a write was cut short" in result.stderr
    assert f"Removed the partial {run_folder / 'checkpoint' / 'step-10.tmp'}" in result.stderr
    assert not (run_folder / "checkpoint" / "step-10.tmp").exists() and steps_in(run_folder) == [2, 4, 6, 8]
    resumed = run_train([*CKPT, "--job.dump_folder", str(run_folder), "--training.steps", "10"])
    assert "at step 8" in resumed.stderr and steps_in(run_folder) == [2, 4, 6, 8, 10]


def test_a_full_disk_is_called_that(tmp_path):
    full = OSError(errno.ENOSPC, "No space left on device")
    wrapped = RuntimeError("[enforce fail at inline_container.cc:671] . unexpected pos 704 vs 598")
    wrapped.__cause__ = full
    assert _save_failure_reason(wrapped, tmp_path, None).startswith("the disk is full (")
    cut = RuntimeError("[enforce fail at inline_container.cc:671] . unexpected pos 704 vs 598")
    assert _save_failure_reason(cut, tmp_path, None).startswith("a write was cut short")


def test_a_non_finite_state_is_never_saved(tmp_path):
    from types import SimpleNamespace

    from torchtitan.components.checkpoint import CheckpointManager, NonFiniteStateError
    from torchtitan.components.lr_scheduler import build_lr_scheduler
    from torchtitan.config_manager import JobConfig

    cfg = JobConfig()
    cfg.checkpoint.enable = True
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    loader = SimpleNamespace(state_dict=lambda: {"epoch": 0})
    manager = CheckpointManager(cfg.checkpoint, tmp_path, model, optimizer, build_lr_scheduler(optimizer,
                                cfg.lr_scheduler, 10), None, loader, rank=0)  # fmt: skip
    manager.save(1)
    with torch.no_grad():
        model.weight[1, 2] = float("inf")
    with pytest.raises(NonFiniteStateError, match=r"step 2: not saving .*: non-finite values in \['model.weight'\]"):
        manager.save(2)
    assert [p.name for p in (tmp_path / "checkpoint").iterdir()] == ["step-1"]
