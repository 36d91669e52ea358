"""End to end on CPU: the loss falls, a killed run resumes bit for bit, checkpoints are atomic."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from unittest import mock

import pytest
import torch
from PIL import Image

from tests.conftest import ROOT, TINY, read_metrics, run_train

RESUME = [*TINY, "--debug.deterministic", "true", "--training.steps", "12", "--checkpoint.enable", "true",
          "--checkpoint.interval", "4", "--training.ema_decay", "0.9"]  # fmt: skip


def test_loss_falls_and_outputs_are_written(tmp_path):
    out = tmp_path / "run"
    run_train([*TINY, "--job.dump_folder", str(out), "--training.steps", "40", "--training.local_batch_size", "32",
               "--sampling.freq", "40", "--sampling.num_samples", "4", "--sampling.steps", "4",
               "--metrics.enable_tensorboard", "true"])  # fmt: skip
    metrics = read_metrics(out)
    assert [m["step"] for m in metrics] == list(range(1, 41))
    first, last = sum(m["loss"] for m in metrics[:5]) / 5, sum(m["loss"] for m in metrics[-5:]) / 5
    assert last < 0.6 * first, (first, last)
    for key in ("loss", "grad_norm", "lr", "images_per_second", "step_time_s", "data_time_s"):
        assert key in metrics[-1]
    assert "mfu" not in metrics[-1]  # no GPU: no made-up MFU
    for m in metrics:  # loss by timestep (minRF): at log_freq 1 the step's loss is a mix of its bins' means
        bins = [v for k, v in m.items() if k.startswith("loss/t_bin_")]
        assert bins and {k for k in m if k.startswith("loss/t_bin_")} <= {f"loss/t_bin_{k}" for k in range(10)}
        assert min(bins) * (1 - 1e-6) <= m["loss"] <= max(bins) * (1 + 1e-6), m
    grid = Image.open(out / "samples" / "step-40.png")
    assert grid.size == (2 + 2 * 66, 2 + 2 * 66)  # 2 x 2 grid of 16 px images enlarged to 64, 2 px gaps
    assert (out / "config.toml").is_file() and list((out / "tb").iterdir())


def test_sparse_logging_changes_no_number(tmp_path):
    # The gradient norm is computed only on logged steps (without clipping): logging every 3rd step must train
    # the very same run, and its logged losses and norms equal the every-step run's, bitwise.
    args = [*TINY, "--debug.deterministic", "true", "--training.steps", "7"]
    run_train([*args, "--job.dump_folder", str(tmp_path / "every")])
    run_train([*args, "--job.dump_folder", str(tmp_path / "sparse"), "--metrics.log_freq", "3"])
    every = {m["step"]: m for m in read_metrics(tmp_path / "every")}
    sparse = read_metrics(tmp_path / "sparse")
    assert [m["step"] for m in sparse] == [3, 6, 7]
    for m in sparse:
        assert (m["loss"], m["grad_norm"]) == (every[m["step"]]["loss"], every[m["step"]]["grad_norm"]), m["step"]
    # The loss by timestep covers every step since the last log: the bins of steps 1-3 pool into step 3's record,
    # each between its every-step values.
    pooled = {k: v for k, v in sparse[0].items() if k.startswith("loss/t_bin_")}
    per_step = [{k: v for k, v in every[step].items() if k.startswith("loss/t_bin_")} for step in (1, 2, 3)]
    assert set(pooled) == set().union(*per_step)
    for key, value in pooled.items():
        seen = [bins[key] for bins in per_step if key in bins]
        assert min(seen) * (1 - 1e-6) <= value <= max(seen) * (1 + 1e-6), key


def test_killed_run_resumes_bitwise(tmp_path):
    reference = tmp_path / "reference"
    run_train([*RESUME, "--job.dump_folder", str(reference)])

    resumed = tmp_path / "resumed"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "train.py", *RESUME, "--job.dump_folder", str(resumed)], cwd=ROOT,
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    deadline = time.time() + 300
    while not (resumed / "checkpoint" / "step-8" / ".metadata").exists():  # two checkpoints are complete
        assert proc.poll() is None and time.time() < deadline, "run ended before its second checkpoint"
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    killed_at = len(read_metrics(resumed))
    result = run_train([*RESUME, "--job.dump_folder", str(resumed)])
    assert f"resumed from {resumed / 'checkpoint' / 'step-8'} at step 8" in result.stderr  # the newest complete one
    if killed_at > 8:  # the killed run logged steps past its last checkpoint: this run logs them again
        assert f"metrics: dropped {killed_at - 8} record(s) after step 8" in result.stderr

    expected = {m["step"]: m for m in read_metrics(reference)}
    got = read_metrics(resumed)
    assert [record["step"] for record in got] == list(range(1, 13)), "one record per step"
    for record in got:  # bitwise: the very same losses and grad norms, step for step
        assert record["loss"] == expected[record["step"]]["loss"], record["step"]
        assert record["grad_norm"] == expected[record["step"]]["grad_norm"], record["step"]
    from safetensors.torch import load_file

    a, b = load_file(reference / "ema.safetensors"), load_file(resumed / "ema.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_partial_checkpoint_is_skipped(tmp_path):
    out = tmp_path / "run"
    run_train([*RESUME, "--job.dump_folder", str(out), "--training.steps", "8"])
    folder = out / "checkpoint"
    # A crash mid-save leaves a staging folder; a corrupt one has its data files damaged.
    (folder / "step-12.tmp").mkdir()
    corrupt = folder / "step-10"
    corrupt.mkdir()
    (corrupt / ".metadata").write_bytes(b"not a checkpoint")
    result = run_train([*RESUME, "--job.dump_folder", str(out), "--training.steps", "9"])
    assert "step-10 could not be loaded" in result.stderr
    assert "resumed from" in result.stderr and "step-8 at step 8" in result.stderr
    assert read_metrics(out)[-1]["step"] == 9


def test_keep_latest_k(tmp_path):
    out = tmp_path / "run"
    run_train([*RESUME, "--job.dump_folder", str(out), "--checkpoint.interval", "2", "--checkpoint.keep_latest_k",
               "2"])  # fmt: skip
    names = sorted(p.name for p in (out / "checkpoint").iterdir())
    assert names == ["step-10", "step-12"]


@pytest.mark.slow
def test_ddp_two_processes_match_one(tmp_path):
    """Same global batch, same samples, same noise: DDP on 2 ranks tracks 1 process within fp32 rounding."""
    common = [*TINY, "--training.steps", "4", "--training.global_batch_size", "16"]
    run_train([*common, "--job.dump_folder", str(tmp_path / "one"), "--training.local_batch_size", "16"])
    run_train([*common, "--job.dump_folder", str(tmp_path / "ddp"), "--training.local_batch_size", "8",
               "--parallelism.data_parallel_replicate_degree", "2"], nproc=2)  # fmt: skip
    one, ddp = read_metrics(tmp_path / "one"), read_metrics(tmp_path / "ddp")
    for a, b in zip(one, ddp):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4)
        bins = {k: v for k, v in a.items() if k.startswith("loss/t_bin_")}  # summed over the ranks: the same bins
        assert bins and {k: v for k, v in b.items() if k.startswith("loss/t_bin_")} == pytest.approx(bins, rel=1e-5)


def test_export_loads_into_plain_model(tmp_path):
    out = tmp_path / "run"
    run_train([*RESUME, "--job.dump_folder", str(out), "--training.steps", "4"])
    from safetensors import safe_open

    from torchtitan.models.dit import DiT, DiTArgs

    with safe_open(str(out / "ema.safetensors"), "pt") as f:
        import json

        args = DiTArgs.from_dict(json.loads(f.metadata()["model_args"]))
        state = {k: f.get_tensor(k) for k in f.keys()}
    model = DiT(args)
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and all(Path(k).suffix in (".sincos", ".rope") or k in ("sincos", "rope") for k in missing)


def test_wandb_offline_logs_metrics_and_samples(tmp_path):
    pytest.importorskip("wandb")
    out = tmp_path / "run"
    run_train([*TINY, "--job.dump_folder", str(out), "--training.steps", "2", "--metrics.enable_wandb", "true",
               "--sampling.freq", "2", "--sampling.num_samples", "2", "--sampling.steps", "2"],
              env={"WANDB_MODE": "offline", "WANDB_SILENT": "true"})  # fmt: skip
    runs = list((out / "wandb").glob("offline-run-*"))
    assert runs and list(runs[0].glob("*.wandb")), "wandb wrote no offline run"
    assert list(runs[0].rglob("*.png")), "the sample grid was not logged to wandb"


@pytest.mark.parametrize("ac", ["full", "selective"])
def test_checkpoint_recompute_uses_the_configured_attention_kernel(tmp_path, ac):
    # Recomputation runs in backward, outside the forward's context: were the SDPA priority not set there too,
    # it would pick another kernel than forward did, and checkpointing would refuse the different saved tensors
    # (seen on an H100: cuDNN in forward, flash in recompute). On CPU, "math" against the default CPU kernel.
    out = tmp_path / ac
    run_train([*TINY, "--job.dump_folder", str(out), "--training.steps", "2", "--model.sdpa_backends", "math",
               "--activation_checkpoint.mode", ac, "--activation_checkpoint.selective_ac_option", "op"])  # fmt: skip
    assert [m["step"] for m in read_metrics(out)] == [1, 2]


def test_failing_side_features_never_end_the_run(tmp_path):
    """Sample grids, TensorBoard, wandb and the EMA export all fail here; each is an error in the log, and the run
    trains to the end with its checkpoints (written before the samples of their step)."""
    out = tmp_path / "run"
    out.mkdir()
    (out / "samples").write_text("a file where the samples folder goes")
    (out / "tb").write_text("a file where TensorBoard's folder goes")
    (out / "ema.safetensors").mkdir()  # the export cannot replace a folder
    result = run_train([*TINY, "--job.dump_folder", str(out), "--training.steps", "4", "--sampling.freq", "2",
                        "--sampling.num_samples", "2", "--sampling.steps", "2", "--checkpoint.enable", "true",
                        "--checkpoint.interval", "2", "--metrics.enable_tensorboard", "true",
                        "--metrics.enable_wandb", "true"], env={"WANDB_MODE": "not-a-mode"})  # fmt: skip
    assert [m["step"] for m in read_metrics(out)] == [1, 2, 3, 4]
    assert sorted(p.name for p in (out / "checkpoint").iterdir()) == ["step-2", "step-4"]
    for failure in ("step 2: writing samples failed", "step 4: writing samples failed",
                    "metrics: starting TensorBoard failed", "metrics: starting wandb failed",
                    "exporting ema.safetensors failed"):  # fmt: skip
        assert failure in result.stderr, failure
    assert result.stderr.index("saved checkpoint") < result.stderr.index("step 2: writing samples failed")
    assert "training done" in result.stderr


@pytest.mark.parametrize("failure, together", [(None, True), ("non-finite", True), ("oom", False),
                                               ("unreadable", False), ("other", False)])  # fmt: skip
def test_a_rank_that_fails_alone_leaves_without_waiting_for_the_others(monkeypatch, failure, together):
    """Only a finished run, or a stop every rank takes at one step, meets the other ranks at teardown. A rank's own
    failure (an OOM: 7B probes on 4 H200s hung there until the 200 s limit, 2026-11-28) must not enter a barrier
    that ranks waiting inside FSDP's all-gather never reach: it leaves, and torchrun stops the rest."""
    import train
    from torchtitan.components.step_guard import NonFiniteStepError
    from torchtitan.datasets.imagefolder import UnreadableImageError

    raised = {
        "non-finite": NonFiniteStepError("step 3: loss nan"),
        "oom": torch.OutOfMemoryError("CUDA out of memory"),
        "unreadable": UnreadableImageError("img.png: truncated"),
        "other": RuntimeError("NCCL error"),
    }
    closed = []

    class FakeTrainer:
        def __init__(self, job_config):
            self.profiler = mock.Mock()

        def train(self):
            if failure:
                raise raised[failure]

        def close(self, together=True):
            closed.append(together)

    monkeypatch.setattr(train, "Trainer", FakeTrainer)
    monkeypatch.setattr(train, "parse_args", lambda argv: None)
    if failure in ("oom", "other"):
        with pytest.raises(type(raised[failure])):
            train.main([])
    else:
        assert train.main([]) == (1 if failure else 0)
    assert closed == [together]


def test_close_apart_skips_the_barrier_and_the_teardown(monkeypatch):
    from torchtitan.trainer import Trainer

    calls = []
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda: 2)
    monkeypatch.setattr(torch.distributed, "barrier", lambda: calls.append("barrier"))
    monkeypatch.setattr(torch.distributed, "destroy_process_group", lambda: calls.append("destroy"))
    trainer = Trainer.__new__(Trainer)
    trainer.dataloader, trainer.profiler, trainer.metrics, trainer.run_lock = (
        mock.Mock(),
        mock.Mock(),
        mock.Mock(),
        None,
    )
    trainer.close(together=False)
    assert calls == [] and trainer.dataloader.close.called and trainer.metrics.close.called
    trainer.close()
    assert calls == ["barrier", "destroy"]
