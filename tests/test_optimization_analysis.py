"""Ablation grids (names, commands, one real tiny run) and the analysis of their run folders."""

import json
import os
import subprocess
import sys

import pytest
from PIL import Image

from scripts.optimization_analysis import analyze, load_runs
from scripts.run_ablation import grid_run, main, parse_name, run_name
from tests.conftest import ROOT
from torchtitan.config_manager import JobConfig, to_toml


def run_script(script: str, env: dict, *args: str) -> str:
    result = subprocess.run(["bash", f"scripts/{script}", *args], cwd=ROOT, capture_output=True, text=True,
                            env={**os.environ, "PYTHON": sys.executable, **env}, timeout=120)  # fmt: skip
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_05b_grid_dry_run():
    out = run_script("run_ablations_0.5B.sh", {"NGPU": "8", "BATCH_SIZES": "16 32", "OUTPUT_DIR": "/tmp/grid"},
                     "--dry-run", "--optimizer.lr", "2e-4")  # fmt: skip
    lines = [line for line in out.splitlines() if line.startswith("dit_")]
    names = [line.split(":")[0] for line in lines]
    # 2 precisions x (ddp, fsdp, hsdp) x 3 AC modes x compile on/off x 2 batch sizes
    assert len(names) == 2 * 3 * 3 * 2 * 2 == len(set(names))
    assert {"dit_0.5B_bs32ps2_actnone_c1bf16p8s1", "dit_0.5B_bs16ps2_actfull_c0fp32p1s8",
            "dit_0.5B_bs32ps2_actselective_c1bf16p2s4"} <= set(names)  # fmt: skip
    line = next(line for line in lines if line.startswith("dit_0.5B_bs32ps2_actselective_c1bf16p2s4:"))
    for flag in ("--nproc_per_node=8", "--model.flavor 0.5B", "--model.input_size 64", "--model.in_channels 16",
                 "--training.dataset dummy", "--training.local_batch_size 32", "--metrics.log_freq 1",
                 "--parallelism.data_parallel_replicate_degree 2", "--parallelism.data_parallel_shard_degree 4",
                 "--activation_checkpoint.mode selective", "--compile.enable true",
                 "--training.mixed_precision_param bfloat16",
                 "--job.dump_folder /tmp/grid/dit_0.5B_bs32ps2_actselective_c1bf16p2s4"):  # fmt: skip
        assert flag in line, flag
    assert line.endswith("--optimizer.lr 2e-4")  # "$@" reaches every run, last so it wins


def test_7b_grids_dry_run():
    names = [line.split(":")[0] for line in run_script("run_ablations_7B.sh", {"NGPU": "8"}, "--dry-run").splitlines()
             if line.startswith("dit_")]  # fmt: skip
    assert len(names) == 2 * 2 * 3 * 2 * 4  # precisions x (fsdp, hsdp) x AC x compile x batch sizes
    assert not any(name.endswith("p8s1") for name in names)  # no DDP for 7B
    assert "dit_7B_bs4ps2_actfull_c1bf16p1s8" in names
    out = run_script("run_ablations_7B_autotune.sh", {"NGPU": "4"}, "--dry-run")
    assert "dit_7B_bsautops2_actselective_c1bf16p2s2: after find_max_batch_size:" in out


def point(batch: int, ac: str, compile: bool, precision: str, size: str = "0.5B") -> dict:
    """The knobs of a one-GPU grid point, as run_ablation.grid() makes them."""
    return {"size": size, "batch": batch, "patch": 2, "ac": ac, "compile": compile, "precision": precision,
            "replicate": 1, "shard": 1, "parallelism": "single"}  # fmt: skip


def test_names_round_trip():
    knobs = point(32, "none", True, "bf16")
    assert run_name(knobs) == "dit_0.5B_bs32ps2_actnone_c1bf16p1s1"
    assert parse_name(run_name(knobs)) == {k: v for k, v in knobs.items() if k != "parallelism"}
    run = grid_run(knobs, 5, ["--training.steps", "7"])
    assert run.name == run_name(knobs) and run.nproc == 1 and run.knobs == knobs
    assert run.args[-4:] == ["--training.local_batch_size", "32", "--training.steps", "7"]  # "$@" last


def test_one_real_tiny_run(tmp_path):
    grid = ["--size", "debug", "--ngpu", "1", "--steps", "2", "--batch-sizes", "4", "--precisions", "fp32", "--ac",
            "none", "--compile", "0", "--output-dir", str(tmp_path)]  # fmt: skip
    assert main([*grid, "--training.ema_decay", "0"]) == 0
    run = tmp_path / "dit_debug_bs4ps2_actnone_c0fp32p1s1"
    status = json.loads((run / "status.json").read_text())
    assert status["status"] == "ok" and status["returncode"] == 0
    assert status["knobs"] == point(4, "none", False, "fp32", size="debug")
    assert status["command"].endswith("--training.local_batch_size 4 --training.ema_decay 0")
    assert "training done" in (run / "train.log").read_text()  # train.py's whole output
    assert (run / "config.toml").is_file()
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]  # every step logged: the first (warmup) apart
    (loaded,) = load_runs(tmp_path)
    assert loaded["status"] == "ok" and loaded["warm_steps"] == [2] and loaded["parallelism"] == "single"
    assert loaded["step_time_s"] == records[1]["step_time_s"]  # the one warm step's


def test_autotune_records_a_setting_that_fits_nowhere(tmp_path, monkeypatch):
    import scripts.run_ablation as ablation

    answers, asked = iter([{"batch": 0}, {"batch": None, "error": "batch 4: failed (1)"}]), []

    def finder(run_at, folder, limit, timeout, force):  # scripts/lib's find_max_batch, tested in test_scripts_lib
        asked.append((run_at(4), folder, limit))
        return next(answers)

    monkeypatch.setattr(ablation.lib, "find_max_batch", finder)
    grid = ["--size", "debug", "--ngpu", "1", "--autotune", "--autotune-limit", "16", "--probe-steps", "2",
            "--precisions", "fp32", "--ac", "none full", "--compile", "0", "--output-dir", str(tmp_path)]  # fmt: skip
    assert main([*grid, "--training.ema_decay", "0"]) == 0
    probe, folder, limit = asked[0]
    assert probe.name == "dit_debug_bs4ps2_actnone_c0fp32p1s1" and limit == 16
    assert folder == tmp_path / "autotune" / "dit_debug_bsautops2_actnone_c0fp32p1s1"
    assert "--training.steps 2 " in " ".join(probe.args) and probe.args[-2:] == ["--training.ema_decay", "0"]
    oom = json.loads((tmp_path / "dit_debug_bs1ps2_actnone_c0fp32p1s1" / "status.json").read_text())
    assert oom["status"] == "OOM" and oom["knobs"]["batch"] == 1 and "batch 1 does not fit" in oom["note"]
    failed = json.loads((tmp_path / "dit_debug_bs1ps2_actfull_c0fp32p1s1" / "status.json").read_text())
    assert failed["status"] == "failed (finder)" and failed["note"] == "batch 4: failed (1)"
    assert {r["status"] for r in load_runs(tmp_path)} == {"OOM", "failed (finder)"}  # the analysis lists them


def test_autotune_prints_its_answer(tmp_path, monkeypatch, capsys):
    """The autotune ends with its answer for each setting: the largest batch a GPU, with the probes that bracket it,
    then the images/s, MFU and memory of the run at that batch (warm steps)."""
    import scripts.run_ablation as ablation

    found = {"batch": 8, "lower_bound": False, "probes": [{"batch": 4, "status": "ok"}, {"batch": 9, "status": "OOM"},
                                                          {"batch": 8, "status": "ok"}]}  # fmt: skip
    monkeypatch.setattr(ablation.lib, "find_max_batch", lambda *args: found)

    def execute(run, run_dir, timeout, force):  # the run at the answer, as train.py leaves it
        fabricate(run_dir.parent, run.knobs, images_per_second=100.0, memory=12.5)
        return {"status": "ok"}

    monkeypatch.setattr(ablation.lib, "execute", execute)
    grid = ["--size", "debug", "--ngpu", "1", "--autotune", "--precisions", "bf16", "--ac", "full", "--compile", "1",
            "--output-dir", str(tmp_path)]  # fmt: skip
    assert main(grid) == 0
    out = capsys.readouterr().out
    assert "dit_debug_bsautops2_actfull_c1bf16p1s1: the largest batch a GPU is 8 (probes: 4 ok, 9 OOM, 8 ok)" in out
    assert "autotune answer: dit_debug_bs8ps2_actfull_c1bf16p1s1: 8 a GPU, 100.5 images/s, 10.1% MFU, 12.5 GiB" in out


def fabricate(root, knobs: dict, status: str = "ok", images_per_second: float = 100.0, memory: float = 10.0):
    """A run folder as run_ablation.py and train.py leave it; the first logged step is slow (compilation)."""
    folder = root / run_name(knobs)
    folder.mkdir(parents=True)
    cfg = JobConfig()
    cfg.model.flavor, cfg.training.local_batch_size = knobs["size"], knobs["batch"]
    cfg.training.mixed_precision_param = "float32" if knobs["precision"] == "fp32" else "bfloat16"
    cfg.parallelism.data_parallel_replicate_degree = knobs["replicate"]
    cfg.parallelism.data_parallel_shard_degree = knobs["shard"]
    cfg.activation_checkpoint.mode, cfg.compile.enable = knobs["ac"], knobs["compile"]
    (folder / "config.toml").write_text(to_toml(cfg))
    (folder / "status.json").write_text(json.dumps({"name": folder.name, "status": status, "knobs": knobs}))
    if status == "ok":
        steps = [(1, images_per_second / 10, 0.0)] + [(s, images_per_second * (1 + 0.01 * (s % 2)), memory)
                                                      for s in range(2, 6)]  # fmt: skip
        lines = [json.dumps({"step": s, "loss": 1.0, "grad_norm": 1.0, "lr": 1e-4, "images_per_second": ips,
                             "mfu": ips / 10, "step_time_s": knobs["batch"] / ips, "data_time_s": 0.0,
                             "memory_peak_active_gib": mem}) for s, ips, mem in steps]  # fmt: skip
        (folder / "metrics.jsonl").write_text("\n".join(lines) + "\n")


def test_analysis_of_a_fabricated_grid(tmp_path):
    root = tmp_path / "outputs"
    for batch in (8, 16):
        for ac, (speed, memory) in {"none": (1.0, 1.0), "full": (0.8, 0.4)}.items():
            base = 100.0 * batch * speed
            fabricate(root, point(batch, ac, False, "bf16"), images_per_second=base, memory=10 * batch * memory)
            fabricate(root, point(batch, ac, True, "bf16"), images_per_second=1.7 * base,
                      memory=10 * batch * memory * 0.5)  # fmt: skip
    fabricate(root, point(16, "none", False, "fp32"), images_per_second=400.0, memory=300.0)
    fabricate(root, point(32, "none", False, "bf16"), status="OOM")
    fabricate(root, point(32, "none", True, "bf16"), images_per_second=6000.0, memory=160.0)
    (root / "autotune").mkdir()  # not a run: ignored
    cut_off = root / run_name(point(64, "none", True, "bf16"))  # cut off before a step: no status.json, empty metrics
    cut_off.mkdir()
    (cut_off / "metrics.jsonl").touch()

    result = analyze(root, root / "analysis")
    assert len(result["runs"]) == 12
    effects = {(e["knob"], e["change"]): e for e in result["effects"]}
    compile_effect = effects[("compile", "off -> on")]
    assert compile_effect["pairs"] == 4 and compile_effect["fits_only_with"] == 1
    assert compile_effect["images_per_second"] == pytest.approx(0.7)  # warm steps only: the slow first is skipped
    assert compile_effect["peak_memory_gib"] == pytest.approx(-0.5)
    assert effects[("ac", "none -> full")]["images_per_second"] == pytest.approx(-0.2)
    assert effects[("precision", "fp32 -> bf16")]["images_per_second"] == pytest.approx(3.0)
    for knob in ("compile", "ac", "precision"):
        with Image.open(root / "analysis" / f"0.5B_{knob}.png") as image:
            assert image.size[0] > 500
    assert not (root / "analysis" / "0.5B_parallelism.png").exists()  # one layout: nothing to compare
    summary = (root / "analysis" / "summary.md").read_text()
    assert "compile (off -> on), 0.5B: images/s +70%" in summary
    assert "| dit_0.5B_bs32ps2_actnone_c0bf16p1s1 | 0.5B | 32 | bf16 | single | none | off | OOM |" in summary
    assert "0.5B_compile.png" in summary
    assert "| dit_0.5B_bs64ps2_actnone_c1bf16p1s1 | 0.5B | 64 | bf16 | single | none | on | unfinished |" in summary
