"""The DP experiment suites (scripts/dp/): tiny real runs whose JSON agrees with their run folders, failures
recorded, the largest-batch search, the shell wrappers, the plots and summary of visualize, and the Llama 3 FSDP
suite (--model llama3: its runs' flags, one tiny point over two processes)."""

import contextlib
import json
import os
import shlex
import statistics
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from PIL import Image

import scripts.lib.runner
from scripts.dp import common, run_dp_suite, run_fsdp_suite, visualize
from tests.conftest import ROOT, read_metrics, run_python
from torchtitan.config_manager import parse_args
from torchtitan.models.dit import DiT, dit_configs
from torchtitan.models.llama3 import Llama3, llama3_configs
from torchtitan.tools.batch_size_finder import Probe
from torchtitan.tools.runs import RESULT_PREFIX, RunResult, launcher, status_of

GIB = 1024**3
# The debug DiT on 16x16x3 dummy pixels (patch 2: 64 tokens); the config keeps its 1000 classes.
TINY = ["--model.flavor", "debug", "--model.input_size", "16"]
# 1 breakdown step + 1 warm-up: steps 3, 4 timed; eager, though the config compiles: an inductor build on the CPU per
# run would cost more than the rest of this file, and compile with DP is tests/test_dp_composition.py's.
RUN = ["--steps", "4", "--breakdown-steps", "1", "--no-plots", "--compile.enable", "false"]


def parameter_bytes() -> int:
    """fp32 bytes of the tiny model's parameters (CPU runs train in fp32)."""
    args = replace(dit_configs["debug"], input_size=16, in_channels=3, num_classes=1000, learn_sigma=False)
    with torch.device("meta"):
        return 4 * sum(p.numel() for p in DiT(args).parameters())


def load(folder: Path, name: str) -> dict:
    return json.loads((folder / f"{name}.json").read_text())


@contextlib.contextmanager
def forked_launches():
    """The suites' train.py runs fork from the train server (tests/conftest.py's run_python; a torchrun's ranks too)
    instead of starting `python scripts/lib/tee.py LOG -- COMMAND` afresh: each process starts with torch and
    torchtitan imported, some 9 CPU-s fewer (about 100 for this file's runs). The run's log and the launcher's result
    are what the tee wrapper and launch_command make of its output and status (the tee's RESULT line holds the
    return code); those two are test_scripts_lib's, on real processes. Other commands (the planted OOM) and runs with
    an environment of their own launch as the script would."""
    real = scripts.lib.runner.launch_command

    def launch(run, cmd, timeout=None, cwd=ROOT):
        log, inner = Path(cmd[2]), cmd[4:]  # [python, tee.py, LOG, "--", *COMMAND]
        head = [*launcher(run.nproc), "train.py"]
        if run.env or cwd != ROOT or inner[: len(head)] != head:
            return real(run, cmd, timeout, cwd)
        try:
            proc = run_python("train.py", inner[len(head) :], run.nproc, timeout)
        except subprocess.TimeoutExpired as e:
            return RunResult(run.name, "timeout", output=(e.stdout or "")[-4000:])
        returncode = proc.returncode if proc.returncode >= 0 else 128 - proc.returncode  # as tee.py records it
        log.write_text(proc.stdout + proc.stderr)
        output = proc.stdout + proc.stderr + RESULT_PREFIX + json.dumps({"returncode": returncode}) + "\n"
        status = status_of(returncode, output)
        return RunResult(run.name, status, {"returncode": returncode} if status == "ok" else {}, output[-4000:])

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(scripts.lib.runner, "launch_command", launch)
        yield


@pytest.fixture(scope="module")
def suite_a(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("dp_suite")
    argv = ["--modes", "vanilla ghost", "--batch-sizes", "2", "--output-dir", str(out), *RUN, "--find-max-batch",
            "--find-max-limit", "2", *TINY]  # fmt: skip
    with forked_launches():
        assert run_dp_suite.main(argv) == 0
    return out


@pytest.fixture(scope="module")
def suite_b(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("dp_fsdp_suite")
    argv = ["--nproc", "2", "--modes", "no_dp ghost", "--tokens", "64", "--batch-sizes", "2", "--output-dir",
            str(out), *RUN, "--model.flavor", "debug"]  # fmt: skip
    with forked_launches():
        assert run_fsdp_suite.main(argv) == 0
    return out


@pytest.fixture(scope="module")
def failed_runs(tmp_path_factory) -> Path:
    """A run that cannot start (no dataset folder) and one whose command dies of an out-of-memory error."""
    out = tmp_path_factory.mktemp("dp_suite_failed")
    bad = ["--training.dataset", "imagefolder", "--training.dataset_path", str(out / "missing")]
    with forked_launches():
        assert run_dp_suite.main(["--modes", "vanilla", "--batch-sizes", "3", "--output-dir", str(out), *RUN, *TINY,
                                  *bad]) == 0  # fmt: skip
    oom = [sys.executable, "-c", "import sys; print('torch.OutOfMemoryError: CUDA out of memory'); sys.exit(1)"]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(scripts.lib.runner, "train_command", lambda *args: oom)
        assert run_dp_suite.main(["--modes", "vanilla", "--batch-sizes", "4", "--output-dir", str(out), *RUN,
                                  *TINY]) == 0  # fmt: skip
    return out


def test_suite_a_json_agrees_with_the_run_folder(suite_a):
    full_model = parameter_bytes()
    for mode in ("vanilla", "ghost"):
        result = load(suite_a, f"{mode}_bs2")
        run = Path(result["run_dir"])
        assert result["status"] == "ok" and json.loads((run / "status.json").read_text())["status"] == "ok"
        assert (result["mode"], result["private"], result["batch"], result["tokens"]) == (
            mode,
            mode != "vanilla",
            2,
            64,
        )
        metrics = read_metrics(run)
        assert [m["step"] for m in metrics] == [1, 2, 3, 4]
        warm = metrics[2:]  # medians of the warm steps (test_scripts_lib tells a median from a mean)
        assert result["warm_steps"] == [3, 4] and result["timed_steps"] == 2
        assert result["step_time_s"] == pytest.approx(statistics.median(m["step_time_s"] for m in warm))
        assert result["images_per_second"] == pytest.approx(statistics.median(m["images_per_second"] for m in warm))
        records = json.loads((run / "memory_breakdown.json").read_text())["records"]
        assert result["memory_breakdown"]["records"] == records
        assert result["breakdown_at_peak"] == max(records, key=lambda r: r["total"])
        # CPU: train.py logs no memory, so the peak is the breakdown's.
        assert result["peak_memory_gib"] == pytest.approx(max(r["peak"] for r in records) / GIB)
        assert result["peak_memory_source"].startswith("memory_breakdown")
        assert all(r["parameters"] == full_model for r in records)
        step = {r["stage"]: r for r in records if r["step"] == 1}
        assert step["backward"]["gradients"] == full_model  # one fp32 gradient per parameter
        assert step["optimizer_step"]["optimizer_states"] >= 2 * full_model  # AdamW's two moments
        if mode == "ghost":  # the engine's stage after the norm pass, where its buffers live
            assert step["dp_norms"]["dp_buffers"] > 0 and result["dp_buffers_peak_gib"] > 0
        else:
            assert "dp_norms" not in step and result["dp_buffers_peak_gib"] == 0
        assert "--dp.enable false" in result["command"] if mode == "vanilla" else "--dp.mode ghost" in result["command"]
    vanilla, ghost = load(suite_a, "vanilla_bs2"), load(suite_a, "ghost_bs2")
    assert ghost["baseline"] == "vanilla_bs2" and vanilla["time_ratio"] == 1.0
    assert ghost["time_ratio"] == pytest.approx(ghost["step_time_s"] / vanilla["step_time_s"])
    assert ghost["memory_ratio"] == pytest.approx(ghost["peak_memory_gib"] / vanilla["peak_memory_gib"])


def test_suite_a_finds_the_largest_batch_with_suite_runs(suite_a):
    report = json.loads((suite_a / "max_batch.json").read_text())
    for mode in ("vanilla", "ghost"):
        entry = report["modes"][mode]
        # Nothing runs out of memory on CPU: the search stops at its limit, a lower bound.
        assert entry["batch"] == 2 and entry["lower_bound"] is True and entry["predicted"] is None
        assert entry["probes"] == [{"batch": 2, "status": "ok", "peak_memory_gib": None, "reserved_gib": None}]
        probe = json.loads((suite_a / "find_max" / f"{mode}_bs2" / "status.json").read_text())
        assert probe["status"] == "ok" and "--training.steps 2" in probe["command"]
        assert "--profiling.enable_memory_breakdown false" in probe["command"]


def test_failed_and_oom_runs_are_recorded(failed_runs):
    failed, oom = load(failed_runs, "vanilla_bs3"), load(failed_runs, "vanilla_bs4")
    assert failed["returncode"] != 0 and failed["status"] == f"failed ({failed['returncode']})"
    assert "missing does not exist" in (Path(failed["run_dir"]) / "train.log").read_text()
    assert oom["status"] == "OOM" and oom["returncode"] == 1
    for result in (failed, oom):
        assert "step_time_s" not in result and "peak_memory_gib" not in result and "time_ratio" not in result


def test_a_suite_cut_short_keeps_the_results_of_its_finished_runs(tmp_path, monkeypatch):
    # A suite stopped mid-way (the GPU machine's time limit) keeps each finished run's JSON: written as it ends.
    oom = [sys.executable, "-c", "import sys; print('torch.OutOfMemoryError: CUDA out of memory'); sys.exit(1)"]
    monkeypatch.setattr(scripts.lib.runner, "train_command", lambda *args: oom)
    finished = []

    def execute(run, *args):
        if finished:
            raise KeyboardInterrupt  # the second run is killed
        finished.append(scripts.lib.runner.execute(run, *args))

    monkeypatch.setattr(common, "execute", execute)
    with pytest.raises(KeyboardInterrupt):
        run_dp_suite.main(["--modes", "vanilla", "--batch-sizes", "3 4", "--output-dir", str(tmp_path), *RUN, *TINY])
    assert load(tmp_path, "vanilla_bs3")["status"] == "OOM" and not (tmp_path / "vanilla_bs4.json").exists()


def test_the_largest_batch_search_starts_from_the_measured_line(tmp_path, monkeypatch):
    # Peaks of 10 and 24 GiB at batches 2 and 16: 1 GiB per image, so 80 GiB holds about 72 images.
    results = [{"mode": "ghost", "batch": b, "status": "ok", "peak_memory_gib": m} for b, m in ((2, 10.0), (16, 24.0))]
    assert run_dp_suite.predicted_max_batch(results, 80.0) == pytest.approx(72.0)
    assert run_dp_suite.search_window(results, 80.0, 4096, 8, 0.1) == (64, 80, pytest.approx(72.0))
    assert run_dp_suite.search_window(results[:1], 80.0, 4096, 1, 0.1) == (2, 4096, None)  # one point: no line
    tried = []

    def planted(run_at, folder, *args):  # runs out of memory above 70 images
        run = run_at(64)  # what a probe runs: a short suite run of the mode, no breakdown
        assert run.name == "ghost_bs64" and folder == tmp_path / "find_max"
        flags = " ".join(run.args)
        assert "--training.steps 2 " in flags and "--profiling.enable_memory_breakdown false" in flags
        return lambda batch: tried.append(batch) or Probe(batch, "ok" if batch <= 70 else "OOM", batch / 10)

    monkeypatch.setattr(run_dp_suite, "batch_probe", planted)
    opts = SimpleNamespace(memory_gib=80.0, find_max_limit=4096, find_max_multiple_of=8, find_max_margin=0.1,
                           probe_steps=2, config="config", timeout=0, force=False)  # fmt: skip
    report = run_dp_suite.find_max_batches(results, ["ghost"], 16, 64, tmp_path, [], opts)
    entry = report["modes"]["ghost"]
    assert entry["batch"] == 64 and entry["lower_bound"] is False and entry["peak_memory_gib"] == 6.4
    assert tried == [64, 80, 72]  # the window's bottom, its top, then one bisection
    assert json.loads((tmp_path / "max_batch.json").read_text()) == report


def test_shell_wrappers_pass_their_arguments_through():
    env = {**os.environ, "PYTHON": sys.executable, "BATCH_SIZES": "4", "OUTPUT_DIR": "/tmp/dp_suite_dry"}
    out = subprocess.run(["bash", "scripts/dp/run_dp_suite.sh", "--dry-run", "--optimizer.lr", "3e-4"], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stderr
    lines = [line for line in out.stdout.splitlines() if "_bs4: " in line]
    assert [line.split(":")[0] for line in lines] == [f"{m}_bs4" for m in run_dp_suite.MODES]
    assert all(line.endswith("--optimizer.lr 3e-4") for line in lines)  # "$@" last, so it wins
    assert "--model.input_size 256" in lines[0] and "--job.dump_folder /tmp/dp_suite_dry/runs/vanilla_bs4" in lines[0]
    env.update(NPROC="4", TOKENS="1024 4096")
    out = subprocess.run(["bash", "scripts/dp/run_fsdp_suite.sh", "--dry-run"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stderr
    names = [line.split(":")[0] for line in out.stdout.splitlines() if "_t" in line.split(":")[0]]
    assert names == [f"{m}_t{t}_bs4" for t in (1024, 4096) for m in run_fsdp_suite.MODES]
    line = next(line for line in out.stdout.splitlines() if line.startswith("ghost_t4096_bs4:"))
    assert "--nproc_per_node=4" in line and "--model.input_size 512" in line  # 64 x 64 patches of 8 pixels
    assert "--parallelism.data_parallel_shard_degree 4" in line


@pytest.mark.slow
def test_suite_b_runs_fsdp_over_two_processes(suite_b):
    full_model = parameter_bytes()
    for mode in ("no_dp", "ghost"):
        result = load(suite_b, f"{mode}_t64_bs2")
        run = Path(result["run_dir"])
        assert result["status"] == "ok" and (result["nproc"], result["global_batch"], result["input_size"]) == (
            2,
            4,
            16,
        )
        assert "--nproc_per_node=2" in result["command"]
        metrics = read_metrics(run)
        assert result["step_time_s"] == pytest.approx(statistics.median(m["step_time_s"] for m in metrics[2:]))
        assert result["images_per_second"] == pytest.approx(
            statistics.median(m["images_per_second"] for m in metrics[2:])
        )
        records = json.loads((run / "memory_breakdown.json").read_text())["records"]  # rank 0's
        assert result["memory_breakdown"]["records"] == records and (run / "memory_breakdown_rank1.json").is_file()
        init = records[0]
        assert init["stage"] == "init" and full_model / 2 <= init["parameters"] < 0.6 * full_model  # one shard
    ghost = load(suite_b, "ghost_t64_bs2")
    assert ghost["baseline"] == "no_dp_t64_bs2" and ghost["time_ratio"] > 0 and ghost["memory_ratio"] > 0


@pytest.mark.slow
def test_visualize_writes_plots_and_a_summary_that_matches_the_json(suite_a, suite_b, failed_runs, tmp_path):
    written = visualize.main([str(suite_a), str(suite_b), str(failed_runs), "--out", str(tmp_path)])
    names = {"memory_breakdown_bars.png", "memory_timeline.png", "tradeoff.png", "fsdp_scaling.png",
             "fsdp_overhead.png", "summary.txt"}  # fmt: skip
    assert {p.name for p in written} == names
    for name in names - {"summary.txt"}:
        with Image.open(tmp_path / name) as image:
            assert image.size[0] > 300 and image.size[1] > 200
    rows = {}
    for line in (tmp_path / "summary.txt").read_text().splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == len(visualize.COLUMNS) and cells[0] in ("dp", "fsdp"):
            rows[(cells[0], cells[1], int(cells[3]))] = dict(zip(visualize.COLUMNS, cells))
    results = [load(suite_a, "vanilla_bs2"), load(suite_a, "ghost_bs2"), load(suite_b, "no_dp_t64_bs2"),
               load(suite_b, "ghost_t64_bs2")]  # fmt: skip
    for result in results:
        row = rows[(result["suite"], result["mode"], result["batch"])]
        assert row["status"] == "ok" and int(row["tokens"]) == result["tokens"]
        assert float(row["peak GiB"]) == pytest.approx(result["peak_memory_gib"], abs=5e-4)
        assert float(row["step ms"]) == pytest.approx(1000 * result["step_time_s"], abs=0.05)
        assert float(row["images/s"]) == pytest.approx(result["images_per_second"], abs=0.05)
        assert float(row["time x"]) == pytest.approx(result["time_ratio"], abs=5e-3)
        assert float(row["memory x"]) == pytest.approx(result["memory_ratio"], abs=5e-3)
    assert rows[("dp", "vanilla", 4)]["status"] == "OOM" and rows[("dp", "vanilla", 4)]["peak GiB"] == ""
    assert "| vanilla | >= 2 |" in (tmp_path / "summary.txt").read_text()  # the max-batch table


def train_flags(command: str) -> list[str]:
    """The train.py arguments of a run's command line."""
    words = shlex.split(command)
    return words[words.index("train.py") + 1 :]


def test_llama3_suite_dry_run_builds_the_runs_of_the_origin_document(capsys):
    argv = ["--model", "llama3", "--nproc", "4", "--dry-run", "--output-dir", "/tmp/llama3_suite_dry", "--optimizer.lr",
            "3e-4"]  # fmt: skip
    assert run_fsdp_suite.main(argv) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if "_bs" in line.split(":")[0]]
    commands = dict(line.split(": ", 1) for line in lines)
    assert list(commands) == [f"{m}_t{t}_bs2" for t in (1024, 2048, 4096) for m in run_fsdp_suite.MODES]
    for name, command in commands.items():
        mode, seq_len = name.split("_t")[0], int(name.split("_t")[1].split("_")[0])
        assert "--nproc_per_node=4" in command and "--model.input_size" not in command
        flags = train_flags(command)
        assert flags[-2:] == ["--optimizer.lr", "3e-4"]  # the user's flags last, so they win
        cfg = parse_args(flags)  # what the trainer will run
        assert (cfg.model.name, cfg.model.flavor, cfg.model.num_classes) == ("llama3", "Llama-3.1-8B", 2)
        assert (cfg.training.dataset, cfg.training.seq_len, cfg.training.local_batch_size) == (
            "synthetic_classification", seq_len, 2)  # fmt: skip
        assert cfg.parallelism.data_parallel_shard_degree == 4 and cfg.parallelism.data_parallel_replicate_degree == 1
        assert cfg.dp.enable is (mode != "no_dp") and (mode == "no_dp" or cfg.dp.mode == mode)
        assert cfg.compile.enable is False and cfg.optimizer.lr == 3e-4 and cfg.profiling.enable_memory_breakdown
    opts = SimpleNamespace(model="llama3", flavor=None, config=None, tokens="1024", batch_sizes="2", output_dir=None,
                           modes="ghost", nproc=2)  # fmt: skip
    points, _ = run_fsdp_suite.plan(opts, [])
    assert [p["mode"] for p in points] == ["no_dp", "ghost"]  # the baseline joins
    assert (points[1]["input_size"], points[1]["seq_len"], points[1]["tokens"]) == (None, 1024, 1024)
    with pytest.raises(SystemExit, match="max_seq_len 256"):  # refused before any run starts
        run_fsdp_suite.main(["--model", "llama3", "--flavor", "debugmodel", "--tokens", "512", "--dry-run"])


def test_llama3_suite_on_one_process_runs_fsdp_on_a_one_rank_mesh(capsys):
    argv = ["--model", "llama3", "--nproc", "1", "--tokens", "1024", "--dry-run", "--output-dir", "/tmp/llama3_one",
            "--optimizer.name", "SGD"]  # fmt: skip
    assert run_fsdp_suite.main(argv) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if "_bs" in line.split(":")[0]]
    assert [line.split(":")[0] for line in lines] == [f"{m}_t1024_bs2" for m in run_fsdp_suite.MODES]
    for line in lines:
        assert "torch.distributed.run" not in line and "--nproc_per_node" not in line
        cfg = parse_args(train_flags(line.split(": ", 1)[1]))
        assert cfg.parallelism.fsdp_single_device and cfg.parallelism.data_parallel_shard_degree == 1
        assert (cfg.model.flavor, cfg.optimizer.name) == ("Llama-3.1-8B", "SGD")
    with pytest.raises(SystemExit, match="at least 1"):
        run_fsdp_suite.main(["--nproc", "0", "--dry-run"])


def test_llama3_suite_shell_wrapper_leaves_the_model_defaults_to_python():
    env = {**os.environ, "PYTHON": sys.executable, "MODEL": "llama3", "NPROC": "8", "FLAVOR": "Llama-3.2-3B",
           "TOKENS": "2048", "OUTPUT_DIR": "/tmp/llama3_suite_dry"}  # fmt: skip
    env.pop("BATCH_SIZES", None)
    env.pop("CONFIG", None)
    out = subprocess.run(["bash", "scripts/dp/run_fsdp_suite.sh", "--dry-run", "--dp.noise_multiplier", "0.5"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stderr
    lines = [line for line in out.stdout.splitlines() if "_bs" in line.split(":")[0]]
    assert [line.split(":")[0] for line in lines] == [f"{m}_t2048_bs2" for m in run_fsdp_suite.MODES]
    for line in lines:
        flags = " ".join(train_flags(line.split(": ", 1)[1]))
        assert "--job.config_file train_configs/llama3_1b.toml" in flags and "--model.flavor Llama-3.2-3B" in flags
        assert "--training.seq_len 2048 --training.local_batch_size 2" in flags and flags.endswith("0.5")
        assert "--nproc_per_node=8" in line and "--parallelism.data_parallel_shard_degree 8" in flags


@pytest.mark.slow
def test_llama3_suite_runs_a_tiny_point_over_two_processes(tmp_path):
    argv = ["--model", "llama3", "--flavor", "debugmodel", "--tokens", "16", "--batch-sizes", "2", "--nproc", "2",
            "--modes", "no_dp", "--output-dir", str(tmp_path), *RUN]  # fmt: skip
    with forked_launches():
        assert run_fsdp_suite.main(argv) == 0
    result = load(tmp_path, "no_dp_t16_bs2")
    assert result["status"] == "ok" and "--nproc_per_node=2" in result["command"]
    assert (result["model"], result["flavor"], result["seq_len"], result["input_size"]) == ("llama3", "debugmodel", 16,
                                                                                           None)  # fmt: skip
    warm = read_metrics(Path(result["run_dir"]))[2:]
    assert result["warm_steps"] == [3, 4] and "images_per_second" not in result
    assert result["tokens_per_second"] == pytest.approx(statistics.median(m["tokens_per_second"] for m in warm))
    records = json.loads((Path(result["run_dir"]) / "memory_breakdown.json").read_text())["records"]  # rank 0's
    assert result["memory_breakdown"]["records"] == records
    args = replace(llama3_configs["debugmodel"], num_labels=2)
    with torch.device("meta"):
        full_model = 4 * sum(p.numel() for p in Llama3(args).parameters())  # fp32: CPU runs train in float32
    assert full_model / 2 <= records[0]["parameters"] < 0.6 * full_model  # one FSDP shard of the classifier
    summary = visualize.write_summary([result], None, tmp_path / "summary.txt").read_text()
    header, _, row = summary.splitlines()[2:5]
    cells = dict(zip(header.strip("|").split("|"), row.strip("|").split("|")))
    assert float(cells[" tokens/s "]) == pytest.approx(result["tokens_per_second"], abs=0.5)


def test_the_peak_stage_is_where_the_allocator_peaked_not_the_largest_total():
    # The 8B suite's no_dp run at 4096 tokens: forward holds the most, the peak came in backward.
    gib = 2**30
    records = [{"step": 0, "stage": "init", "total": 28 * gib, "peak": 28 * gib},
               {"step": 1, "stage": "forward", "total": 70.56 * gib, "peak": 70.63 * gib},
               {"step": 1, "stage": "backward", "total": 56.04 * gib, "peak": 71.48 * gib}]  # fmt: skip
    result = {"memory_breakdown": {"records": records}}
    assert visualize.peak_stage(result) == "1:backward"
    assert visualize.peak_stage({}) == ""
