"""scripts/lib: the command a run gets, status.json for every way a run ends, the warm-step medians, and the
batch search over recorded runs (stand-in commands: no training here, the suites' tests train)."""

import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest

import scripts.lib.batch_search
import scripts.lib.runner
from scripts.lib import GIB, Run, execute, find_max_batch, parallelism, train_command, warm_metrics
from torchtitan.tools.runs import launcher, run_to_end


def python(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def test_train_command_for_one_and_two_processes(tmp_path):
    args = ["--job.config_file", "c.toml", "--training.steps", "3", "--optimizer.lr", "3e-4"]  # the user's last
    one = train_command(Run("a", args), tmp_path / "a")
    assert one == [sys.executable, "train.py", "--job.dump_folder", str(tmp_path / "a"), *args]
    two = train_command(Run("b", args, nproc=2), tmp_path / "b")
    assert two == [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "train.py",
                   "--job.dump_folder", str(tmp_path / "b"), *args]  # fmt: skip
    assert [parallelism(r, s) for r, s in ((1, 1), (8, 1), (1, 8), (2, 4))] == ["single", "ddp", "fsdp", "hsdp"]


def test_status_json_for_ok_oom_failed_and_timeout(tmp_path):
    knobs, ok_cmd = {"mode": "ghost", "batch": 4}, python("import os; print('value', os.environ['LAB_VALUE'])")
    ok = execute(Run("ok", [], env={"LAB_VALUE": "seen"}, knobs=knobs), tmp_path / "ok", cmd=ok_cmd)
    oom_cmd = python("import sys; print('torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB');"
                     "sys.exit(1)")  # fmt: skip
    oom = execute(Run("oom", []), tmp_path / "oom", cmd=oom_cmd)
    failed = execute(Run("failed", []), tmp_path / "failed", cmd=python("import sys; sys.exit('broken config')"))
    start = time.perf_counter()
    slow = python("import os, time; print('pid', os.getpid(), flush=True); time.sleep(60)")
    timeout = execute(Run("slow", []), tmp_path / "slow", timeout=2, cmd=slow)
    assert time.perf_counter() - start < 30
    for name, record in (("ok", ok), ("oom", oom), ("failed", failed), ("slow", timeout)):
        assert json.loads((tmp_path / name / "status.json").read_text()) == record
    assert (ok["status"], ok["returncode"], ok["knobs"]) == ("ok", 0, knobs)
    assert shlex.split(ok["command"]) == ok_cmd and ok["elapsed_s"] > 0
    assert (tmp_path / "ok" / "train.log").read_text() == "value seen\n"  # the run's env reached it
    assert (oom["status"], oom["returncode"]) == ("OOM", 1)
    assert (failed["status"], failed["returncode"]) == ("failed (1)", 1)
    assert "broken config" in (tmp_path / "failed" / "train.log").read_text()  # stderr too
    assert (timeout["status"], timeout["returncode"]) == ("timeout", None)
    pid = int((tmp_path / "slow" / "train.log").read_text().split()[1])
    assert gone(pid), "a timed-out run's process must not run on"


def gone(pid: int, seconds: float = 10.0) -> bool:
    """Whether process `pid` has ended (a zombie counts: it runs nothing) within `seconds`."""
    status = Path(f"/proc/{pid}/status")
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not status.exists() or "State:\tZ" in status.read_text():
            return True
        time.sleep(0.1)
    return False


def test_a_timed_out_torchrun_stops_its_workers(tmp_path):
    """The workers of a torchrun that times out are stopped with it (subprocess.run's SIGKILL left them running:
    torchrun starts each in a session of its own and can pass nothing on when killed)."""
    worker = tmp_path / "worker.py"
    # Each worker names itself in a file of its own: the two share one stdout, where unbuffered writes interleave.
    worker.write_text(f"import os, time\nopen({str(tmp_path)!r} + f'/pid-{{os.getpid()}}', 'w')\ntime.sleep(600)\n")
    with pytest.raises(subprocess.TimeoutExpired) as err:
        run_to_end([*launcher(2), str(worker)], timeout=15, env={**os.environ, "OMP_NUM_THREADS": "1"})
    pids = [int(p.name.removeprefix("pid-")) for p in tmp_path.glob("pid-*")]
    assert len(pids) == 2, err.value.output
    assert all(gone(pid) for pid in pids), "a timed-out torchrun's workers must not run on"


def test_runs_already_done_are_skipped_unless_forced(tmp_path):
    run, run_dir = Run("r", []), tmp_path / "r"
    first = execute(run, run_dir, cmd=python("print('first')"))
    assert execute(run, run_dir, cmd=python("print('first')")) == first  # already done: not run
    assert (run_dir / "train.log").read_text() == "first\n"
    changed = execute(run, run_dir, cmd=python("print('other flags')"))  # ok, but with another command: run again
    assert changed["command"] != first["command"] and (run_dir / "train.log").read_text() == "other flags\n"
    (run_dir / "metrics.jsonl").write_text('{"step": 1}\n')  # train.py appends: a rerun must start clean
    again = execute(run, run_dir, force=True, cmd=python("import sys; sys.exit(5)"))
    assert (again["status"], again["returncode"]) == ("failed (5)", 5) and not (run_dir / "metrics.jsonl").exists()
    retried = execute(run, run_dir, cmd=python("print('second')"))  # not ok: run again without force
    assert retried["status"] == "ok" and (run_dir / "train.log").read_text() == "second\n"


def write_metrics(run_dir: Path, rows: list[tuple[float, float]]) -> list[dict]:
    """metrics.jsonl of steps 1.. with (step time, peak memory) each, batch 4; returns the records."""
    records = [{"step": i + 1, "loss": 1.0, "step_time_s": t, "images_per_second": 4 / t, "memory_peak_active_gib": m}
               for i, (t, m) in enumerate(rows)]  # fmt: skip
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return records


def test_warm_metrics_are_medians_of_the_steps_after_the_first(tmp_path):
    # Step 1 compiles (slow, most memory); step 4 is a stray slow step that a mean would follow.
    write_metrics(tmp_path, [(2.0, 9.0), (0.10, 2.0), (0.11, 2.5), (0.50, 2.2), (0.12, 2.1)])
    warm = warm_metrics(tmp_path, skip=1)
    assert warm["warm_steps"] == [2, 3, 4, 5] and warm["timed_steps"] == 4
    assert warm["step_time_s"] == pytest.approx(0.115)  # the mean would be 0.2075
    assert (warm["step_time_min_s"], warm["step_time_max_s"]) == (0.10, 0.50)
    assert warm["images_per_second"] == pytest.approx(statistics.median([40, 4 / 0.11, 8, 4 / 0.12]))
    assert warm["peak_memory_gib"] == 2.5 and warm["peak_memory_source"].startswith("metrics.jsonl")
    assert warm_metrics(tmp_path, skip=0)["peak_memory_gib"] == 9.0
    # CPU: no memory in metrics.jsonl, so the breakdown's largest peak.
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "step_time_s": 0.3}\n{"step": 2, "step_time_s": 0.2}\n')
    records = [{"step": 1, "stage": "forward", "total": 3 * GIB, "peak": 5 * GIB}, {"step": 1, "stage": "backward",
               "total": 4 * GIB, "peak": 6 * GIB}]  # fmt: skip
    (tmp_path / "memory_breakdown.json").write_text(json.dumps({"records": records}))
    cpu = warm_metrics(tmp_path, skip=1)
    assert cpu["step_time_s"] == 0.2 and "images_per_second" not in cpu
    assert cpu["peak_memory_gib"] == 6.0 and cpu["peak_memory_source"].startswith("memory_breakdown")


# A stand-in for train.py: batch > 5 dies of CUDA's OOM, batch 7 of something else, others log peak batch / 10 GiB.
FAKE_TRAIN = """import json, sys
batch, run_dir = int(sys.argv[1]), sys.argv[2]
if batch == 7:
    sys.exit(2)
if batch > 5:
    sys.exit("torch.OutOfMemoryError: CUDA out of memory")
open(run_dir + "/metrics.jsonl", "w").write(json.dumps({"step": 1, "memory_peak_active_gib": batch / 10}) + "\\n")
"""


def test_find_max_batch_over_recorded_probes(tmp_path, monkeypatch):
    monkeypatch.setattr(scripts.lib.runner, "train_command",
                        lambda run, run_dir: [*python(FAKE_TRAIN), str(run.knobs["batch"]), str(run_dir)])  # fmt: skip
    monkeypatch.setattr(scripts.lib.batch_search, "device_memory_gib", lambda: None)  # no GPU: start at batch 1
    folder = tmp_path / "autotune" / "dit_0.5B_bsauto"

    def run_at(batch: int) -> Run:
        return Run(f"bs{batch}", ["--job.config_file", "train_configs/debug_model.toml"], knobs={"batch": batch})

    found = find_max_batch(run_at, folder, limit=16)
    assert found["batch"] == 5 and found["start"] == 1 and found["lower_bound"] is False
    assert found["peak_memory_gib"] == 0.5
    assert [(p["batch"], p["status"]) for p in found["probes"]] == [
        (1, "ok"), (2, "ok"), (4, "ok"), (8, "OOM"), (6, "OOM"), (5, "ok")]  # fmt: skip
    assert json.loads((tmp_path / "autotune" / "dit_0.5B_bsauto.json").read_text()) == found  # kept
    assert json.loads((folder / "bs8" / "status.json").read_text())["status"] == "OOM"  # each probe recorded
    assert find_max_batch(lambda b: pytest.fail("probed again"), folder, limit=16) == found  # the kept answer
    broken = find_max_batch(run_at, tmp_path / "broken", limit=7, force=True)  # 1, 2, 4, then 7 fails otherwise
    assert broken == {"batch": None, "start": 1, "error": "batch 7: failed (2)"}
    shutil.rmtree(tmp_path / "broken" / "bs7")
    assert find_max_batch(run_at, tmp_path / "broken", limit=7) == broken  # a failed search is not an answer to keep:
    assert (tmp_path / "broken" / "bs7" / "status.json").is_file()  # it searched again (a timeout may not recur)
    at_limit = find_max_batch(run_at, tmp_path / "small", limit=3)
    assert at_limit["batch"] == 3 and at_limit["lower_bound"] is True  # nothing ran out of memory above it


def test_a_search_cut_off_resumes_from_its_committed_probes(tmp_path, monkeypatch):
    """A search cut off by a call's time limit resumes in the next call, on another machine, from the folder its
    probes were committed to: each probe recorded ok or out of memory is reused, though its command ran another
    interpreter in another run folder, and only the unfinished probe runs again (the 7B autotune's, 2026-11-28)."""
    fake = tmp_path / "bin" / "train.py"  # launched by path, as the scripts launch train.py from the repo
    fake.parent.mkdir()
    fake.write_text(FAKE_TRAIN.replace("int(sys.argv[1]), sys.argv[2]", "int(sys.argv[3]), sys.argv[2]"))
    ran = []
    launch = scripts.lib.runner.launch_command
    monkeypatch.setattr(scripts.lib.runner, "launch_command", lambda run, *a, **k: ran.append(run.name) or
                        launch(run, *a, **k))  # fmt: skip
    monkeypatch.setattr(scripts.lib.runner, "train_command", lambda run, run_dir: [
        sys.executable, str(fake), "--job.dump_folder", str(run_dir), str(run.knobs["batch"])])  # fmt: skip
    monkeypatch.setattr(scripts.lib.batch_search, "device_memory_gib", lambda: None)

    def run_at(batch: int) -> Run:
        return Run(f"bs{batch}", ["--job.config_file", "train_configs/debug_model.toml"], knobs={"batch": batch})

    found = find_max_batch(run_at, tmp_path / "call_d" / "bsauto", limit=16)
    assert found["batch"] == 5 and ran == ["bs1", "bs2", "bs4", "bs8", "bs6", "bs5"]
    moved = tmp_path / "committed" / "bsauto"
    shutil.copytree(tmp_path / "call_d" / "bsauto", moved)
    for status in moved.glob("*/status.json"):
        record = json.loads(status.read_text())
        record["command"] = record["command"].replace(sys.executable, "/elsewhere/bin/python3")
        status.write_text(json.dumps(record))
    (moved / "bs5" / "status.json").unlink()  # bs5 was still running when the call ended
    ran.clear()
    resumed = find_max_batch(run_at, moved, limit=16)
    assert ran == ["bs5"]  # the search went on from the bracket its records set (4 ran, 6 out of memory)
    assert {k: resumed[k] for k in ("batch", "start", "lower_bound")} == {"batch": 5, "start": 1, "lower_bound": False}
    assert sorted(p["batch"] for p in resumed["probes"]) == sorted(p["batch"] for p in found["probes"])
