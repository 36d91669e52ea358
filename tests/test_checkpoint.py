"""Checkpoints are never destroyed, never silently wrong, and one run owns its folder (debug config, CPU)."""

import contextlib
import errno
import os
import re
import resource
import subprocess
import sys
import time
from dataclasses import replace
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


def test_branch_from_an_older_step_keeps_its_checkpoints_and_restarts_on_the_branch(four_checkpoints, run_folder):
    run_train([*CKPT, "--job.dump_folder", str(run_folder), "--checkpoint.load_step", "2", "--checkpoint.keep_latest_k",
               "2", "--training.steps", "5"])  # fmt: skip
    # step-2 (resumed from) and the branch's own 4 and 5 are kept; the old 4, 6, 8 are set aside, not deleted.
    assert steps_in(run_folder) == [2, 4, 5]
    aside = sorted(p.name.split(".")[0] for p in (run_folder / "checkpoint" / "set_aside").iterdir())
    assert aside == ["step-4", "step-6", "step-8"]
    result = run_train([*CKPT, "--job.dump_folder", str(run_folder), "--training.steps", "6"])
    assert f"resumed from {run_folder / 'checkpoint' / 'step-5'} at step 5" in result.stderr
    # One record per step: the first run's records after step 2 were dropped when the branch started.
    assert [m["step"] for m in read_metrics(run_folder)] == [1, 2, 3, 4, 5, 6]
    branch, original = read_metrics(run_folder)[2:4], read_metrics(four_checkpoints)[2:4]
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
    assert f"error: step {stopped}: " in result.stderr
    assert "the run stops and this update was not applied" in result.stderr
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


@pytest.mark.parametrize("flags, flavor, refusal", [
    (["--model.pos_embed", "sincos"], {}, "model.pos_embed: it was built with pos_embed 'rope2d', this run's config "
                                          "gives 'sincos'"),
    ([], {"norm_eps": 1e-5}, "model.flavor: it was built with norm_eps 1e-06, this run's config gives 1e-05"),
])  # fmt: skip
def test_a_resume_with_other_model_args_is_refused_by_key(run_folder, monkeypatch, flags, flavor, refusal):
    """Every checkpoint records the model args that built it (here the trainer's own); a resume whose model would
    differ is refused naming the key that sets the arg (model.flavor when no key does: a flavor's numerics, as a
    release could change them) and both values."""
    from torchtitan.config_manager import parse_args
    from torchtitan.errors import ResumeRefusedError
    from torchtitan.models.dit import dit_configs
    from torchtitan.train_spec import build_model_args, get_train_spec

    monkeypatch.setitem(dit_configs, "debug", replace(dit_configs["debug"], **flavor))
    spec = get_train_spec("dit")
    args = build_model_args(spec, parse_args([*CKPT, "--job.dump_folder", str(run_folder), *flags]))
    manager = manager_of(run_folder, torch.nn.Linear(3, 2), enable=True, model_args=args, arg_key=spec.config_key)
    with pytest.raises(ResumeRefusedError) as refused:
        manager.maybe_load()
    assert str(refused.value) == (
        f"checkpoint {run_folder / 'checkpoint' / 'step-8'}: {refusal}: resume with the checkpoint's, or start a new "
        "job.dump_folder from its weights (checkpoint.initial_load_path)"
    )


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
        # The first run now holds the folder and need only stay alive: it yields the CPU to the second (on CI's 2
        # busy cores the two otherwise share it, and the refusal waits on the second's start-up).
        for thread in os.listdir(f"/proc/{first.pid}/task"):
            with contextlib.suppress(ProcessLookupError):
                os.setpriority(os.PRIO_PROCESS, int(thread), 19)
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


def manager_of(folder: Path, model: torch.nn.Module, ema=None, model_args=None, arg_key=None, **checkpoint):
    """A CheckpointManager of a small model (AdamW, a stand-in data loader), with `checkpoint` keys set; it records
    `model_args` as the args that built the model (`arg_key`: the config key of each)."""
    from types import SimpleNamespace

    from torchtitan.components.checkpoint import CheckpointManager
    from torchtitan.components.lr_scheduler import build_lr_scheduler
    from torchtitan.config_manager import JobConfig

    cfg = JobConfig()
    for key, value in checkpoint.items():
        setattr(cfg.checkpoint, key, value)
    optimizer = torch.optim.AdamW(model.parameters())
    loader = SimpleNamespace(state_dict=lambda: {"epoch": 0}, load_state_dict=lambda state, same_layout=True: None)
    return CheckpointManager(cfg.checkpoint, folder, model, optimizer, build_lr_scheduler(optimizer, cfg.lr_scheduler,
                             10), ema, loader, rank=0, model_args=model_args,
                             arg_key=arg_key)  # fmt: skip


def test_a_non_finite_state_is_never_saved(tmp_path):
    from torchtitan.components.checkpoint import NonFiniteStateError

    model = torch.nn.Linear(3, 2)
    manager = manager_of(tmp_path, model, enable=True)
    manager.save(1)
    with torch.no_grad():
        model.weight[1, 2] = float("inf")
    with pytest.raises(NonFiniteStateError, match=r"step 2: not saving .*: non-finite values in \['model.weight'\]"):
        manager.save(2)
    assert [p.name for p in (tmp_path / "checkpoint").iterdir()] == ["step-1"]


def test_an_initial_load_path_gives_the_starting_weights_with_saving_off(tmp_path):
    from torchtitan.components.ema import EMA

    torch.manual_seed(0)
    source = torch.nn.Linear(3, 2)
    manager_of(tmp_path / "source", source, enable=True).save(5, model_only=True)  # as a seed checkpoint: no EMA
    model = torch.nn.Linear(3, 2)  # other random weights
    ema = EMA(model, 0.9)
    start = tmp_path / "source" / "checkpoint" / "step-5"
    manager = manager_of(tmp_path / "run", model, ema, enable=False, initial_load_path=str(start))
    assert manager.maybe_load() == 0  # training starts at step 0, from the loaded weights
    assert torch.equal(model.weight, source.weight) and torch.equal(model.bias, source.bias)
    assert all(torch.equal(e, p) for e, p in zip(ema.shadow, source.parameters()))  # the average starts there too
    assert not (tmp_path / "run" / "checkpoint").exists()  # and nothing is saved


def test_llama3_model_args_are_recorded_and_a_changed_head_is_refused(tmp_path):
    from torchtitan.components.checkpoint_model_args import read_model_args
    from torchtitan.errors import ResumeRefusedError
    from torchtitan.models.llama3 import Llama3Args
    from torchtitan.models.llama3.model import RopeScaling
    from torchtitan.train_spec import get_train_spec

    args = Llama3Args(dim=8, n_layers=1, n_heads=2, vocab_size=16, ffn_dim=16, max_seq_len=8,
                      rope_scaling=RopeScaling(8.0, 1.0, 4.0, 64))  # fmt: skip
    manager_of(tmp_path, torch.nn.Linear(3, 2), enable=True, model_args=args).save(1, model_only=True)
    assert Llama3Args(**read_model_args(tmp_path / "checkpoint" / "step-1")) == args
    classifier = replace(args, num_labels=3)
    other = manager_of(tmp_path, torch.nn.Linear(3, 2), enable=True, model_args=classifier,
                       arg_key=get_train_spec("llama3").config_key)  # fmt: skip
    with pytest.raises(ResumeRefusedError, match=r"step-1: model.num_classes: it was built with num_labels 0, this "
                                                  r"run's config gives 3: "):  # fmt: skip
        other.maybe_load()


def test_a_hugging_face_folder_without_its_format_is_called_that(tmp_path):
    from torchtitan.errors import CheckpointLoadError

    folder = tmp_path / "Llama-3.2-1B"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    (folder / "model.safetensors").write_bytes(b"")
    manager = manager_of(tmp_path / "run", torch.nn.Linear(3, 2), enable=False, initial_load_path=str(folder))
    with pytest.raises(CheckpointLoadError) as refused:
        manager.maybe_load()
    assert str(refused.value) == (
        f"checkpoint.initial_load_path: {folder} is not a DCP checkpoint (no .metadata); it looks like a Hugging Face "
        "model folder (config.json): set checkpoint.initial_load_format = 'hf'"
    )


class Record:
    """An `extra` state of a checkpoint: entries `keys`; `optional_keys` may be missing from older checkpoints."""

    def __init__(self, keys: tuple[str, ...], optional_keys: tuple[str, ...] = ()):
        self.state = {key: len(key) for key in keys}
        self.optional_keys = optional_keys
        self.loaded = None

    def state_dict(self) -> dict:
        return dict(self.state)

    def load_state_dict(self, state: dict) -> None:
        self.loaded = state


def test_extras_refusals_and_entries_an_older_checkpoint_lacks(tmp_path):
    """`foreign` refuses by name (and tries no older checkpoint); an extra's `optional_keys` load from a checkpoint
    written before they existed, its other entries are required."""
    from torchtitan.errors import CheckpointLoadError, ResumeRefusedError

    model = torch.nn.Linear(3, 2)
    writer = manager_of(tmp_path, model, enable=True)
    writer.extra = {"dp": Record(("engine",))}
    writer.save(1)
    writer.save(2)
    reader = manager_of(tmp_path, torch.nn.Linear(3, 2), enable=True)
    reader.extra = {"dp": Record(("engine", "calibration"), optional_keys=("calibration",))}
    assert reader.maybe_load() == 2 and reader.extra["dp"].loaded == {"engine": 6}
    strict = manager_of(tmp_path, torch.nn.Linear(3, 2), enable=True)
    strict.extra = {"dp": Record(("engine", "calibration"))}
    with pytest.raises(CheckpointLoadError, match="dp.calibration"):
        strict.maybe_load()
    refusing = manager_of(tmp_path, torch.nn.Linear(3, 2), enable=True)
    refusing.foreign = {"dp": "it was written with DP"}
    with pytest.raises(ResumeRefusedError) as refused:
        refusing.maybe_load()
    assert str(refused.value) == f"checkpoint {tmp_path / 'checkpoint' / 'step-2'}: it was written with DP"
    assert sorted(p.name for p in (tmp_path / "checkpoint").iterdir()) == ["step-1", "step-2"]  # none set aside


class RunsShell:
    """Unpickled by pickle.load or torch.load(weights_only=False), this runs a shell command that writes a marker."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"echo pwned > {self.marker}",)


def plant_code(step: Path, marker: Path, entry: str = "") -> None:
    """Makes a checkpoint run code when loaded by a plain pickle: its `.metadata` (or, with `entry`, that byte entry,
    written to a file of its own that the metadata points to) becomes a RunsShell."""
    import dataclasses
    import io
    import pickle

    from torch.distributed.checkpoint.metadata import MetadataIndex

    if not entry:
        (step / ".metadata").write_bytes(pickle.dumps(RunsShell(marker)))
        return
    metadata = pickle.loads((step / ".metadata").read_bytes())  # this test's own checkpoint
    payload = io.BytesIO()
    torch.save(RunsShell(marker), payload)
    (step / "planted.distcp").write_bytes(payload.getvalue())
    index = MetadataIndex(entry)
    metadata.storage_data[index] = dataclasses.replace(metadata.storage_data[index], relative_path="planted.distcp",
                                                       offset=0, length=len(payload.getvalue()))  # fmt: skip
    (step / ".metadata").write_bytes(pickle.dumps(metadata))


def test_a_checkpoint_whose_pickles_name_code_is_refused_by_name_and_never_runs(run_folder, tmp_path, capsys):
    import sample
    from torchtitan.errors import CheckpointLoadError

    marker, folder = tmp_path / "pwned", run_folder / "checkpoint"
    plant_code(folder / "step-8", marker)
    plant_code(folder / "step-6", marker, entry="rng_rank0.numpy")
    refusal = f"refers to {os.system.__module__}.system, which a checkpoint may not hold"  # os.system is posix.system

    # Resume: each planted checkpoint is skipped by name, the newest clean one resumes.
    result = run_train([*CKPT, "--job.dump_folder", str(run_folder), "--training.steps", "5"])
    assert f"checkpoint {folder / 'step-8' / '.metadata'} {refusal}" in result.stderr
    assert f"checkpoint {folder / 'step-6'} entry 'rng_rank0.numpy' {refusal}" in result.stderr
    assert f"resumed from {folder / 'step-4'} at step 4" in result.stderr
    # metrics.jsonl: the first run's records of steps 5-8 are dropped, step 5 is this run's.
    assert "metrics: dropped 4 record(s) after step 4" in result.stderr
    assert [m["step"] for m in read_metrics(run_folder)] == [1, 2, 3, 4, 5]
    planted = sorted((folder / "set_aside").iterdir())

    # checkpoint.initial_load_path, in process (saving on or off).
    for enable in (True, False):
        manager = manager_of(tmp_path / f"run_{enable}", torch.nn.Linear(3, 2), enable=enable,
                             initial_load_path=str(planted[1]))  # fmt: skip
        with pytest.raises(CheckpointLoadError, match=f"{re.escape(str(planted[1] / '.metadata'))} {refusal}"):
            manager.maybe_load()

    # sample.py: one error line, exit code 2.
    assert sample.main(["--checkpoint", str(planted[1]), "--out", str(tmp_path / "x.png")]) == 2
    err = capsys.readouterr().err
    assert err.splitlines() == [f"error: checkpoint {planted[1] / '.metadata'} {refusal} (loading it could run code)"]
    assert not marker.exists()  # the payload never ran
