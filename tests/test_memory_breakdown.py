"""The per-stage memory breakdown on CPU: each part counted from its tensors, consistent across stages."""

import json

import pytest
import torch
from PIL import Image

from tests.conftest import ROOT
from torchtitan.measure import measure_breakdown
from torchtitan.tools.memory_breakdown import PARTS, MemoryBreakdown, storage_bytes

ARGS = ["--job.config_file", str(ROOT / "train_configs/debug_model.toml"), "--training.local_batch_size", "8"]
STAGES = ["init", "forward", "backward", "optimizer_step", "zero_grad"]


@pytest.fixture(scope="module")
def training(tmp_path_factory):
    folder = tmp_path_factory.mktemp("breakdown")
    return measure_breakdown([*ARGS, "--job.dump_folder", str(folder)], steps=2), folder


def test_stages_and_parts_are_consistent(training):
    result, _ = training
    records = result["records"]
    assert [(r["step"], r["stage"]) for r in records] == [(0, "init")] + [(s, n) for s in (1, 2) for n in STAGES[1:]]
    by = {(r["step"], r["stage"]): r for r in records}
    params = by[(0, "init")]["parameters"]
    assert params == 4 * 1_272_324  # the debug flavor's fp32 parameters, one storage each
    assert all(r["parameters"] == params and r["ema"] == params for r in records)
    # Gradients exist from backward to zero_grad; AdamW's states from the first step on (+ a 4 B step counter each).
    for r in records:
        has_grads = r["stage"] in ("backward", "optimizer_step")
        assert r["gradients"] == (params if has_grads else 0), r
    assert by[(1, "forward")]["optimizer_states"] == 0
    assert by[(1, "optimizer_step")]["optimizer_states"] == 2 * params + 4 * 51
    assert by[(2, "forward")]["optimizer_states"] == 2 * params + 4 * 51
    # Activations: what forward keeps for backward, gone once backward has run.
    for step in (1, 2):
        assert by[(step, "forward")]["activations"] > 10 * 2**20
        assert by[(step, "forward")]["saved_for_backward"] <= by[(step, "forward")]["activations"]
        assert by[(step, "backward")]["activations"] < 1024
    assert by[(1, "forward")]["activations"] == by[(2, "forward")]["activations"]
    for r in records:
        assert r["total"] == sum(r[p] for p in PARTS) and r["fsdp_gathered"] == r["dp_buffers"] == 0
        assert r["peak"] >= r["total"]


def test_json_and_png_are_written(training):
    result, folder = training
    assert result["json"] == str(folder / "memory_breakdown.json")
    saved = json.loads((folder / "memory_breakdown.json").read_text())
    assert saved["device"] == ("cuda" if torch.cuda.is_available() else "cpu") and saved["records"] == result["records"]
    with Image.open(folder / "memory_breakdown.png") as image:
        assert image.size[0] > 300 and image.size[1] > 200


def test_forward_only_keeps_no_gradients_or_activations(tmp_path, training):
    result = measure_breakdown([*ARGS, "--job.dump_folder", str(tmp_path)], forward_only=True, steps=2)
    records = result["records"]
    assert [r["stage"] for r in records] == ["init", "forward", "forward"]
    assert all(r["gradients"] == 0 and r["optimizer_states"] == 0 for r in records)
    assert all(r["activations"] < 1024 for r in records)  # no_grad: nothing is kept for a backward
    train_forward = training[0]["records"][1]
    for r in records[1:]:
        assert r["total"] < r["peak"] < train_forward["total"]  # transient tensors only, fewer than training keeps
    assert (tmp_path / "memory_breakdown_forward.json").is_file()
    assert (tmp_path / "memory_breakdown_forward.png").is_file()


def test_dp_buffers_and_shared_storages():
    """DP buffers reported as tensors leave activations; a storage shared by two parts counts once."""
    model = torch.nn.Linear(16, 16)
    optimizer = torch.optim.AdamW(model.parameters())
    buffers = []
    breakdown = MemoryBreakdown(model, optimizer, torch.device("cpu"), dp_buffer_bytes=lambda: buffers)
    x = torch.randn(4, 16)
    with breakdown.track():
        out = model(x)
        buffers.append(torch.zeros(4, 16))  # e.g. per-sample norms captured during forward
    record = breakdown.record("forward", 1)
    assert record["dp_buffers"] == 4 * 16 * 4
    assert record["activations"] == storage_bytes([out])  # the output; the input is saved but not created here
    assert record["parameters"] == (16 * 16 + 16) * 4
    model.weight.grad = model.weight.data  # aliases the parameter: counted as a parameter only
    assert breakdown.record("alias", 1)["gradients"] == 0
    counted = MemoryBreakdown(model, optimizer, torch.device("cpu"), dp_buffer_bytes=lambda: 123).record("x")
    assert counted["dp_buffers"] == 123


def test_cuda_parts_come_from_the_allocator(monkeypatch):
    """On CUDA: activations are the bytes requested since the step began, less the parts; the allocator's rounding
    and what was there before the step (cuBLAS workspaces) are "other". Here the allocator is simulated: a 25 MiB
    parameter in a 26 MiB block, a 32 MiB workspace, then a forward that asks for 10 MiB and gets 11 MiB."""
    mib = 2**20
    state = {"requested": 25 * mib + 32 * mib, "allocated": 26 * mib + 32 * mib}
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(
        torch.cuda, "memory_stats", lambda device=None: {"requested_bytes.all.current": state["requested"]}
    )
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: state["allocated"])
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: state["allocated"])
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: None)
    breakdown = MemoryBreakdown(torch.nn.Linear(1, 1), None, torch.device("cuda"))
    owned = {part: 0 for part in PARTS if part not in ("activations", "other")}
    monkeypatch.setattr(breakdown, "_parts", lambda: ({**owned, "parameters": 25 * mib}, {}))
    init = breakdown.record("init", 0)
    assert (init["activations"], init["other"], init["total"]) == (0, 33 * mib, 58 * mib)
    with breakdown.track(1):
        state["requested"] += 10 * mib
        state["allocated"] += 11 * mib
    with breakdown.track(1):  # the step's backward: the baseline stays the step's
        pass
    forward = breakdown.record("forward", 1)
    assert (forward["activations"], forward["other"], forward["total"]) == (10 * mib, 34 * mib, 69 * mib)
    with breakdown.track(2):  # the next step: what step 1 left is its baseline
        pass
    assert breakdown.record("forward", 2)["activations"] == 0


def test_observer_records_the_first_steps_then_writes(tmp_path):
    """The observer as the trainer calls it: records the run's first N steps (here resumed at step 6), then writes."""
    from torchtitan.tools.memory_breakdown import MemoryBreakdownObserver

    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.GELU(), torch.nn.Linear(32, 8))
    optimizer = torch.optim.AdamW(model.parameters())
    observer = MemoryBreakdownObserver(MemoryBreakdown(model, optimizer, torch.device("cpu")), 2, tmp_path, rank=0)
    for step in range(6, 9):  # the trainer's stages, steps counted from 1
        with observer.track(step):
            loss = model(torch.randn(4, 8)).square().mean()
        observer.stage("forward", step)
        with observer.track(step):
            loss.backward()
        observer.stage("backward", step)
        optimizer.step()
        observer.stage("optimizer_step", step)
        optimizer.zero_grad(set_to_none=True)
        observer.stage("zero_grad", step)
    records = json.loads((tmp_path / "memory_breakdown.json").read_text())["records"]
    assert [(r["step"], r["stage"]) for r in records] == [(0, "init")] + [(s, n) for s in (6, 7) for n in STAGES[1:]]
    assert (tmp_path / "memory_breakdown.png").is_file()


def test_a_training_run_writes_its_breakdown(tmp_path):
    """[profiling] enable_memory_breakdown: the trainer's own steps, recorded by the observer at its stages."""
    from tests.conftest import TINY, run_train

    run_train([*TINY, "--job.dump_folder", str(tmp_path), "--training.steps", "3",
               "--profiling.enable_memory_breakdown", "true", "--profiling.memory_breakdown_steps", "2"])  # fmt: skip
    records = json.loads((tmp_path / "memory_breakdown.json").read_text())["records"]
    assert [(r["step"], r["stage"]) for r in records] == [(0, "init")] + [(s, n) for s in (1, 2) for n in STAGES[1:]]


@pytest.mark.skipif(torch.cuda.is_available(), reason="byte counts of the fp32 CPU step (CUDA trains in bf16)")
@pytest.mark.parametrize("mode", ["bookkeeping", "flash"])
def test_dp_buffers_at_the_norm_stage(tmp_path, mode):
    """Under DP a "dp_norms" stage is recorded inside the engine's backward, when its buffers peak."""
    dp = ["--dp.enable", "true", "--dp.mode", mode, "--training.ema_decay", "0", "--job.dump_folder", str(tmp_path)]
    records = measure_breakdown([*ARGS, *dp], steps=1)["records"]
    assert [r["stage"] for r in records] == ["init", "forward", "dp_norms", "backward", "optimizer_step", "zero_grad"]
    by = {r["stage"]: r for r in records}
    assert all(r["dp_buffers"] == 0 for r in records if r["stage"] != "dp_norms")
    norms = 8 * 4  # (B,) float32
    if mode == "flash":  # two passes: the second is a normal backward, nothing but the norms is kept
        assert by["dp_norms"]["dp_buffers"] == norms
        return
    # Book-keeping keeps every clipped layer's fp32 output gradient until the weight gradients are formed.
    # Per sample of the debug DiT (D 128, 64 tokens, MLP 512, 4 blocks): qkv, proj, fc1, fc2 and adaLN per
    # block; patch embedding, timestep MLP (2), final linear (4 values a token) and adaLN. The label embedding's
    # output gradient is the timestep MLP's (c = t_emb + y_emb hands one tensor to both): one storage.
    per_block = 64 * (3 * 128 + 128 + 512 + 128) + 6 * 128
    per_sample = 4 * per_block + 64 * 128 + 128 + 128 + 64 * 4 + 2 * 128
    # And each Linear/Conv2d's per-sample bias sums (fp32, one value per output feature), kept for the grad pass.
    bias_sums = 4 * (3 * 128 + 128 + 512 + 128 + 6 * 128) + 128 + 128 + 128 + 4 + 2 * 128
    assert by["dp_norms"]["dp_buffers"] == 8 * 4 * (per_sample + bias_sums) + norms
    assert by["dp_norms"]["total"] == sum(by["dp_norms"][p] for p in PARTS)
