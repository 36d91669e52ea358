"""The attention lab: variants' commands, and a tiny CPU grid whose table and JSON come from the runs' metrics."""

import json
import os
import statistics
import subprocess
import sys
import tomllib

import scripts.run_attention_lab as lab
from tests.conftest import ROOT, read_metrics


def test_grid_dry_run_through_the_shell_script():
    env = {**os.environ, "PYTHON": sys.executable, "WINDOWS": "2 4", "BATCH": "32", "OUTPUT_DIR": "/tmp/lab"}
    out = subprocess.run(["bash", "scripts/run_attention_lab.sh", "--dry-run", "--optimizer.lr", "2e-4"], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=60)  # fmt: skip
    assert out.returncode == 0, out.stderr
    lines = {line.split(":")[0]: line for line in out.stdout.splitlines() if ": " in line}
    assert list(lines) == ["fp32", "bf16", "bf16_flash", "bf16_window2", "bf16_window4", "bf16_ac_full",
                           "bf16_ac_selective", "bf16_flash_ac_full", "bf16_window4_ac_full"]  # fmt: skip
    for flag in ("--model.flavor DiT-B/2", "--training.dataset dummy", "--training.local_batch_size 32",
                 "--metrics.log_freq 1", "--job.dump_folder /tmp/lab/bf16_window4_ac_full"):  # fmt: skip
        assert flag in lines["bf16_window4_ac_full"], flag
    assert "--training.mixed_precision_param float32 --model.sdpa_backends math" in lines["fp32"]
    assert "--model.sdpa_backends flash,cudnn --activation_checkpoint.mode full" in lines["bf16_flash_ac_full"]
    assert "--model.attn_window 4 --activation_checkpoint.mode full" in lines["bf16_window4_ac_full"]
    assert "--activation_checkpoint.selective_ac_option op" in lines["bf16_ac_selective"]
    assert all(line.endswith("--optimizer.lr 2e-4") for line in lines.values())  # "$@" comes last, so it wins


def test_tiny_grid_reports_what_the_runs_measured(tmp_path, monkeypatch):
    grid = lab.variants  # plus a variant that cannot start: 16 latent cells do not split into patches of 3
    monkeypatch.setattr(lab, "variants", lambda *a: {**grid(*a), "broken": ["--model.patch_size", "3"]})
    probed = {}

    def fake_finder(run_at, folder, limit, timeout, force):  # scripts/lib's find_max_batch, tested in test_scripts_lib
        probed[folder.name] = (run_at(8), folder, limit)
        if "bf16_window2" in folder.name:
            return {"batch": None, "start": 1, "error": "batch 8: failed (1)"}
        return {"batch": 12, "peak_memory_gib": 1.5, "start": 8, "probes": []}

    monkeypatch.setattr(lab.lib, "find_max_batch", fake_finder)
    out = tmp_path / "lab"
    argv = ["--config", str(ROOT / "train_configs/debug_model.toml"), "--flavor", "debug", "--batch", "4",
            "--steps", "3", "--windows", "2", "--variants", "fp32 bf16_window2 broken", "--max-batch",
            "--max-batch-limit", "64", "--output-dir", str(out), "--training.ema_decay", "0"]  # fmt: skip
    assert lab.main(argv) == 0
    rows = {r["variant"]: r for r in json.loads((out / "attention_lab.json").read_text())}
    table = (out / "attention_lab.md").read_text()
    for name in ("fp32", "bf16_window2"):
        records, row = read_metrics(out / name), rows[name]
        warm = records[1:]  # --skip 1: the first logged step is left out
        assert row["status"] == "ok" and row["batch"] == 4 and row["warm_steps"] == [2, 3]
        assert row["final_loss"] == records[-1]["loss"]
        assert row["step_time_s"] == statistics.median(r["step_time_s"] for r in warm)
        assert row["images_per_second"] == statistics.median(r["images_per_second"] for r in warm)
        assert "peak_memory_gib" not in row  # CPU runs log no allocator peak
        line = next(line for line in table.splitlines() if line.startswith(f"| {name} |"))
        assert f"| {records[-1]['loss']:.4f} |" in line and f"| {1000 * row['step_time_s']:.1f} |" in line
        status = json.loads((out / name / "status.json").read_text())
        assert status["knobs"] == {"variant": name, "overrides": row["overrides"]}
    assert rows["fp32"]["max_batch"] == 12 and rows["fp32"]["max_batch_peak_memory_gib"] == 1.5
    assert rows["bf16_window2"]["max_batch"] is None
    config = tomllib.loads((out / "bf16_window2" / "config.toml").read_text())
    assert config["model"]["attn_window"] == 2
    assert sorted(probed) == ["bf16_window2", "fp32"]  # the broken variant is not probed
    probe, folder, limit = probed["fp32"]
    assert probe.name == "fp32_bs8" and folder == out / "max_batch" / "fp32" and limit == 64
    flags = " ".join(probe.args)  # a short run of the variant at the probed batch, "$@" still last
    assert "--training.steps 2 --training.local_batch_size 8 " in flags and flags.endswith("--training.ema_decay 0")
    assert "--training.mixed_precision_param float32 --model.sdpa_backends math" in flags
    broken = json.loads((out / "broken" / "status.json").read_text())
    assert (
        broken["returncode"] != 0 and broken["status"] == rows["broken"]["status"] == f"failed ({broken['returncode']})"
    )
    assert "final_loss" not in rows["broken"] and "| broken | failed (" in table
