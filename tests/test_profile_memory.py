"""scripts/profile_memory.py (CS336's memory profiling through the trainer): tiny real runs on CPU whose table and
JSON agree with their run folders and the model's shape, the estimate's derivation and its relative error, an
out-of-memory run recorded as a row, and the largest allocations read from a CUDA memory snapshot."""

import json
import sys
from pathlib import Path

import pytest
import torch

from scripts import profile_memory
from torchtitan.models.llama3 import Llama3, llama3_configs
from torchtitan.tools.memory_estimate import MemoryEstimate

# The byte-level debug flavor (d 64, 2 layers, vocabulary 258) at contexts 16 and 32, batch 2, one step per run.
TINY = ["--sizes", "debugmodel", "--contexts", "16 32", "--batch", "2", "--precisions", "fp32", "--steps", "1"]


def debug_parameter_bytes() -> int:
    """fp32 bytes of the causal debug model's parameters (CPU runs train in fp32)."""
    with torch.device("meta"):
        return 4 * sum(p.numel() for p in Llama3(llama3_configs["debugmodel"]).parameters())


@pytest.fixture(scope="module")
def profiled(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("profile_memory")
    assert profile_memory.main([*TINY, "--passes", "train", "--output-dir", str(out)]) == 0
    return out


def rows_of(out: Path) -> dict[tuple, dict]:
    runs = json.loads((out / "profile_memory.json").read_text())["runs"]
    return {(r["context"], r["pass"]): r for r in runs}


def test_training_runs_agree_with_their_breakdowns_and_the_model_shape(profiled):
    rows = rows_of(profiled)
    for context in (16, 32):
        row = rows[(context, "train")]
        assert row["status"] == "ok" and row["device"] == "cpu" and (row["batch"], row["precision"]) == (2, "fp32")
        records = json.loads((Path(row["run_dir"]) / "memory_breakdown.json").read_text())["records"]
        assert row["peak_bytes"] == max(r["peak"] for r in records)
        assert row["parameters_bytes"] == debug_parameter_bytes()
        assert row["activations_bytes"] == [r["activations"] for r in records if r["stage"] == "forward"][-1]
        d = row["derivation"]
        assert d["residual_stream_bytes"] == 2 * context * 64 * 4 and d["layers"] == 2  # B x T x d x fp32
        per_layer = row["activations_bytes"] / 2 / d["residual_stream_bytes"]
        assert d["measured_residual_tensors_per_layer"] == pytest.approx(per_layer)
    # At these lengths attention's T x T is negligible: what forward keeps is linear in the context.
    short, long = rows[(16, "train")]["activations_bytes"], rows[(32, "train")]["activations_bytes"]
    assert long == pytest.approx(2 * short, rel=1e-3)


def test_report_has_the_peak_table_the_derivation_and_its_error(profiled):
    report = (profiled / "profile_memory.md").read_text()
    assert "| size | context | train fp32 |" in report
    assert "| debugmodel | 16 |" in report and "| debugmodel | 32 |" in report
    assert "relative error |" in report and "B x T x d x bytes = 2 x 32 x 64 x 4 B" in report
    assert "GPU only" in report  # no snapshot on CPU
    row = rows_of(profiled)[(16, "train")]
    if "estimate_error" in row["derivation"]:  # memory_estimate does not cover Llama 3 (yet): said, not hidden
        assert "Estimate unavailable" in report and "n/a |" in report
    else:
        d = row["derivation"]
        error = (d["estimate_activations_bytes"] - row["activations_bytes"]) / row["activations_bytes"]
        assert d["relative_error"] == pytest.approx(error) and f"{100 * error:+.1f}%" in report


def test_relative_error_against_an_estimate(profiled, monkeypatch):
    """The derivation's figures and error from a given estimate (the real one may not cover Llama 3 yet)."""
    import torchtitan.tools.memory_estimate as memory_estimate

    row = rows_of(profiled)[(32, "train")]
    measured = row["activations_bytes"]
    estimate = MemoryEstimate(parts={"activations": 3 * measured // 2}, peak=10**6, lines=["one residual-stream"])
    monkeypatch.setattr(memory_estimate, "estimate_from_job_config", lambda cfg, world, device: estimate)
    run = profile_memory.profile_run("debugmodel", 32, "train", "fp32", 2, "train_configs/llama3_debug.toml", [])
    again = profile_memory.summarize(run, Path(row["run_dir"]), profiled / "none.pickle")
    d = again["derivation"]
    assert d["relative_error"] == pytest.approx(0.5, abs=1e-5)
    assert d["estimate_per_layer_bytes"] == 3 * measured // 2 / 2
    assert d["estimate_residual_tensors_per_layer"] == pytest.approx((3 * measured // 2) / 2 / (2 * 32 * 64 * 4))
    opts = profile_memory.parse_profile_args([*TINY, "--output-dir", str(profiled / "with_estimate")])[0]
    (profiled / "with_estimate").mkdir()
    report = profile_memory.write_report([again], opts, profiled / "with_estimate").read_text()
    assert "+50.0% |" in report and "Derivation of debugmodel_ctx32_train_fp32" in report


def test_forward_only_runs_beside_training(profiled):
    # The training runs are already ok (kept, not rerun); the forward runs are new.
    assert profile_memory.main([*TINY, "--passes", "forward train", "--output-dir", str(profiled)]) == 0
    rows = rows_of(profiled)
    for context in (16, 32):
        forward, train = rows[(context, "forward")], rows[(context, "train")]
        assert forward["status"] == "ok" and "derivation" not in forward
        records = json.loads((Path(forward["run_dir"]) / "memory_breakdown_forward.json").read_text())["records"]
        assert forward["peak_bytes"] == max(r["peak"] for r in records)
        # No gradients, no AdamW states, nothing kept for backward: below the step's peak by more than the states.
        assert forward["peak_bytes"] + 2 * train["parameters_bytes"] < train["peak_bytes"]
    assert "| size | context | forward fp32 | train fp32 |" in (profiled / "profile_memory.md").read_text()


def test_out_of_memory_is_a_row_and_its_snapshot_is_read(tmp_path, monkeypatch):
    snapshot = {"device_traces": [[{"action": "alloc", "addr": 1, "size": 2**30, "frames": []}]], "segments": []}

    def dies_of_oom(run, run_dir, snapshot_path, steps):  # what a run that fills the GPU leaves behind
        code = (f"import pickle, sys; pickle.dump({snapshot!r}, open({str(snapshot_path)!r}, 'wb')); "
                "print('torch.OutOfMemoryError: CUDA out of memory'); sys.exit(1)")  # fmt: skip
        Path(snapshot_path).parent.mkdir(parents=True, exist_ok=True)
        return [sys.executable, "-c", code]

    monkeypatch.setattr(profile_memory, "child_command", dies_of_oom)
    argv = ["--sizes", "2.7B", "--contexts", "512", "--passes", "train", "--precisions", "fp32", "--output-dir",
            str(tmp_path)]  # fmt: skip
    assert profile_memory.main(argv) == 0
    (row,) = json.loads((tmp_path / "profile_memory.json").read_text())["runs"]
    assert row["status"] == "OOM" and "peak_bytes" not in row
    assert row["largest_allocations"]["allocations"] == [{"bytes": 2**30, "count": 1, "frames": []}]
    report = (tmp_path / "profile_memory.md").read_text()
    assert "| 2.7B | 512 | OOM |" in report and "1 x 1.00 GiB" in report


def test_largest_allocations_alive_at_the_peak():
    here = str(profile_memory.ROOT / "torchtitan" / "models" / "llama3" / "model.py")
    mlp = [{"filename": "/usr/lib/torch/nn/functional.py", "line": 1, "name": "linear"},
           {"filename": here, "line": 120, "name": "forward"}]  # fmt: skip
    logits = [{"filename": here, "line": 200, "name": "forward"}]
    events = [("alloc", 1, 100, logits), ("alloc", 2, 50, logits), ("free_completed", 1, 100, logits),
              ("alloc", 3, 300, mlp), ("alloc", 4, 300, mlp), ("alloc", 5, 200, logits),
              ("free_requested", 3, 300, mlp), ("free_completed", 4, 300, mlp), ("alloc", 6, 500, logits)]  # fmt: skip
    trace = [{"action": a, "addr": addr, "size": size, "frames": frames} for a, addr, size, frames in events]
    found = profile_memory.largest_allocations({"device_traces": [trace]})
    # The peak is after block 5 (50 + 300 + 300 + 200 bytes); block 6 comes after two MLP blocks are freed.
    assert found["peak_bytes"] == 850
    assert found["allocations"] == [  # the two MLP blocks of one call site counted together; torch's frames left out
        {"bytes": 300, "count": 2, "frames": ["forward (torchtitan/models/llama3/model.py:120)"]},
        {"bytes": 200, "count": 1, "frames": ["forward (torchtitan/models/llama3/model.py:200)"]},
        {"bytes": 50, "count": 1, "frames": ["forward (torchtitan/models/llama3/model.py:200)"]},
    ]
    without_history = {"segments": [{"blocks": [{"size": 64, "state": "active_allocated"},
                                                {"size": 999, "state": "inactive"}]}]}  # fmt: skip
    found = profile_memory.largest_allocations(without_history)
    assert found["peak_bytes"] == 64 and found["allocations"] == [{"bytes": 64, "count": 1, "frames": []}]
    assert found["source"].startswith("segments")
