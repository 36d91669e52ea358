"""Fresh-process runs of the trainer's step: one run type, one launcher, one warm-step summary.

Each run is a new process (one OOM cannot poison the next), `python -m torchtitan.measure` with train.py's
arguments (through torchrun for several processes). The launcher records how it ended: "ok", "OOM" (the device's
memory ran out: torch's CUDA out-of-memory error, or cuBLAS's or cuDNN's allocation failure), "timeout" or "failed
(exit code)". The max-batch finder, scripts/benchmark.py, the ablation grids, the DP suites and the attention lab all
launch their runs here (scripts/lib adds what only the scripts need).
"""

import json
import os
import shlex
import statistics
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULT_PREFIX = "MEASURE_RESULT "
# Under torchrun these describe the parent's process group; a launched run is a world of its own.
TORCHRUN_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK", "ROLE_WORLD_SIZE",
                 "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_USE_AGENT_STORE")  # fmt: skip


@dataclass
class Run:
    """One run: a name, train.py arguments, processes, extra environment, and the knobs a script records with it
    (a grid point's settings, which scripts/lib writes into the run's status.json for the script's summary)."""

    name: str
    args: list[str]
    nproc: int = 1
    env: dict[str, str] = field(default_factory=dict)
    knobs: dict = field(default_factory=dict)


@dataclass
class RunResult:
    """How a run ended and what it measured (`torchtitan.measure`'s result; empty unless "ok")."""

    name: str
    status: str
    result: dict = field(default_factory=dict)
    output: str = ""  # the end of stdout + stderr, for a failed run's report

    @property
    def ok(self) -> bool:
        return self.status == "ok"


# Device memory ran out: torch's allocator, or a CUDA library that allocates its own (cuBLAS creating a handle for a
# thread, e.g. autograd's backward thread, when the caching allocator holds the rest: H100, 2026-11-25).
_OUT_OF_MEMORY = ("CUDA out of memory", "CUBLAS_STATUS_ALLOC_FAILED", "CUDNN_STATUS_ALLOC_FAILED")


def ran_out_of_memory(output: str) -> bool:
    """Whether a failed run's output shows the device's memory running out (torch's CUDA out-of-memory error, or
    cuBLAS's or cuDNN's allocation failure). Not Triton's "out of resource" (shared memory of a GEMM config), which
    Inductor's autotuning logs as an `OutOfMemoryError` and survives."""
    return any(sign in output for sign in _OUT_OF_MEMORY)


def status_of(returncode: int, output: str) -> str:
    if returncode == 0:
        return "ok"
    return "OOM" if ran_out_of_memory(output) else f"failed ({returncode})"


def launcher(nproc: int) -> list[str]:
    """How a run's processes start: this Python, through torchrun (standalone) for several."""
    if nproc > 1:
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    return [sys.executable]


def command(run: Run, measure_args: list[str], module: str = "torchtitan.measure") -> list[str]:
    """The command line of a run: `python -m MODULE MEASURE_ARGS -- TRAIN_ARGS` (torchrun for nproc > 1)."""
    return [*launcher(run.nproc), "-m", module, *measure_args, "--", *run.args]


def launch(run: Run, warmup: int = 3, steps: int = 10, timeout: float | None = None, profile: bool = False,
           cwd: Path = ROOT, own_data: bool = False, profile_dir: str | None = None) -> RunResult:  # fmt: skip
    """Runs `torchtitan.measure` for one run in a fresh process: `warmup` steps, then `steps` timed ones (on the
    config's dataset with `own_data`), then with `profile` or a `profile_dir` its profile (written into `profile_dir`
    too)."""
    measure_args = ["--warmup", str(warmup), "--steps", str(steps), *(["--profile"] if profile else []),
                    *(["--profile-dir", str(profile_dir)] if profile_dir else []),
                    *(["--own-data"] if own_data else [])]  # fmt: skip
    return launch_command(run, command(run, measure_args), timeout, cwd)


def run_to_end(cmd: list[str], timeout: float | None = None, cwd: Path = ROOT, env: dict | None = None,
               grace_s: float = 60.0) -> subprocess.CompletedProcess:  # fmt: skip
    """`subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)`, except how a timeout stops it.

    subprocess.run sends SIGKILL, which torchrun cannot pass on: its workers, each in a session of its own, run on
    unseen (one, stuck in a collective, once spun a CPU core for an hour under the tests). Here the command gets
    SIGTERM first, on which torchrun stops its workers (SIGTERM, then SIGKILL after 30 s); SIGKILL only after
    `grace_s`.

    Raises:
        subprocess.TimeoutExpired: at the timeout, once the command has ended, with its output.
    """
    with subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as proc:
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.terminate()
            try:
                stdout, stderr = proc.communicate(timeout=grace_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                stdout, stderr = proc.communicate()
            raise subprocess.TimeoutExpired(cmd, timeout, output=stdout, stderr=stderr) from None
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)


def launch_command(run: Run, cmd: list[str], timeout: float | None = None, cwd: Path = ROOT) -> RunResult:
    """Runs a command for `run`, reading the last result line it printed; the status says how it ended."""
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_VARS}
    env.update({"PYTHONUNBUFFERED": "1", **run.env})
    try:
        proc = run_to_end(cmd, timeout, cwd, env)
    except subprocess.TimeoutExpired as e:
        return RunResult(run.name, "timeout", output=(e.stdout or "")[-4000:])  # run_to_end's output is text
    output = proc.stdout + proc.stderr
    lines = [line for line in proc.stdout.splitlines() if line.startswith(RESULT_PREFIX)]
    status = status_of(proc.returncode, output)
    if status == "ok" and not lines:
        status = "failed (no result)"
    result = json.loads(lines[-1][len(RESULT_PREFIX) :]) if lines and status == "ok" else {}
    return RunResult(run.name, status, result, output[-4000:])


def warm_summary(step_times_s: list[float]) -> dict:
    """The warm steps' median step time (robust to a stray slow step) and its spread."""
    return {"step_time_s": statistics.median(step_times_s), "step_time_min_s": min(step_times_s),
            "step_time_max_s": max(step_times_s), "timed_steps": len(step_times_s)}  # fmt: skip


def shell_words(text: str) -> list[str]:
    """train.py arguments written as one shell string (a case's overrides)."""
    return shlex.split(text)
