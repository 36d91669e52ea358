"""One command builder and one executor for the scripts' train.py runs, each recorded in its own folder.

A run folder holds what train.py writes (config.toml, metrics.jsonl, ...), `train.log` (its whole output) and
`status.json`: name, status ("ok", "OOM", "failed (exit code)" or "timeout", as torchtitan.tools.runs
classifies it), return code, seconds, the command and the run's knobs. Runs that fail are recorded, not
dropped, and a run already "ok" is not run again unless forced.
"""

import argparse
import json
import re
import shlex
import sys
import time
from pathlib import Path

from torchtitan.tools.runs import RESULT_PREFIX, Run, RunResult, launch_command, launcher

TEE = Path(__file__).with_name("tee.py")


def train_command(run: Run, run_dir: Path) -> list[str]:
    """`python train.py` (torchrun for nproc > 1) with the run folder, then the run's arguments.

    The folder comes first so that the run's arguments, which end with the user's "$@" extras, win over it too.
    """
    return [*launcher(run.nproc), "train.py", "--job.dump_folder", str(run_dir), *run.args]


def read_status(run_dir: Path) -> dict:
    """A run's status.json ({} when it has none)."""
    path = Path(run_dir) / "status.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def already_done(run_dir: Path) -> bool:
    """Whether the run in `run_dir` ended "ok" before."""
    return read_status(run_dir).get("status") == "ok"


def write_status(run: Run, run_dir: Path, status: str, **fields) -> dict:
    """Writes and returns status.json: name, status, `fields` (returncode, command, ...), then the run's knobs."""
    run_dir.mkdir(parents=True, exist_ok=True)
    record = {"name": run.name, "status": status, **fields, "knobs": run.knobs}
    (run_dir / "status.json").write_text(json.dumps(record, indent=1))
    return record


def _returncode(outcome: RunResult) -> int | None:
    """The return code the tee wrapper printed last (None when the run timed out before it could)."""
    lines = [line for line in outcome.output.splitlines() if line.startswith(RESULT_PREFIX)]
    return json.loads(lines[-1][len(RESULT_PREFIX) :])["returncode"] if lines else None


def _what_runs(command: str) -> list[str]:
    """A recorded command without what does not change the run: the interpreter and launcher before `train.py`
    (another machine's paths) and the run folder's value (a study folder copied or moved elsewhere)."""
    words = shlex.split(command)
    script = next((i for i, word in enumerate(words) if Path(word).name == "train.py"), 0)
    words = ["train.py", *words[script + 1 :]] if script else words
    at = words.index("--job.dump_folder") if "--job.dump_folder" in words else -1
    return words[:at] + words[at + 2 :] if at >= 0 else words


def same_command(record: dict, run: Run, run_dir: Path, cmd: list[str] | None = None) -> bool:
    """Whether a recorded status.json ran what `run` runs now (`_what_runs`: whatever interpreter and folder)."""
    cmd = cmd or train_command(run, run_dir)
    return _what_runs(record.get("command", "")) == _what_runs(shlex.join(cmd))


def execute(run: Run, run_dir: Path, timeout: float | None = None, force: bool = False,
            cmd: list[str] | None = None, keep: tuple[str, ...] = ("ok",)) -> dict:  # fmt: skip
    """Runs `run` in a fresh process (torchtitan.tools.runs' `launch_command`), unless it is already done: its
    status.json says "ok" for the same command, whatever interpreter launched it and wherever its folder was then
    (a study resumed on another machine, or from the folder its results were committed to).

    Args:
        run: the run; its env reaches the process, its knobs status.json.
        run_dir: its folder: train.py's outputs, train.log and status.json.
        timeout: seconds before it is killed and recorded as "timeout" (None: no limit).
        force: run it again even if its status.json says "ok" for this command.
        cmd: the command (default: `train_command(run, run_dir)`; tests pass others).
        keep: the recorded outcomes that stand for the same command ("ok"; a batch search's probes keep "OOM" too:
            running out of memory again would only cost the time).

    Returns:
        status.json's content (the earlier one when the run was already done).
    """
    cmd = cmd or train_command(run, run_dir)
    earlier = read_status(run_dir)
    if earlier.get("status") in keep and not force:
        if same_command(earlier, run, run_dir, cmd):
            print(f"{run.name}: {earlier['status']} already, skipped (--force reruns)", flush=True)
            return earlier
        print(f"{run.name}: {earlier['status']} earlier with another command, run again", flush=True)  # not this one's
    run_dir.mkdir(parents=True, exist_ok=True)
    # A rerun starts clean: train.py appends to metrics.jsonl, and a failed rerun must not pass off an old breakdown.
    for stale in [run_dir / "metrics.jsonl", *run_dir.glob("memory_breakdown*")]:
        stale.unlink(missing_ok=True)
    start = time.perf_counter()
    outcome = launch_command(run, [sys.executable, str(TEE), str(run_dir / "train.log"), "--", *cmd], timeout)
    record = write_status(run, run_dir, outcome.status, returncode=_returncode(outcome),
                          elapsed_s=time.perf_counter() - start, command=shlex.join(cmd))  # fmt: skip
    print(f"{run.name}: {outcome.status} (returncode {record['returncode']}, {record['elapsed_s']:.0f} s)", flush=True)
    return record


def parallelism(replicate: int, shard: int) -> str:
    """The data-parallel layout of these degrees ("single", "ddp", "fsdp" or "hsdp"), as the trainer names it."""
    from torchtitan.parallelisms.parallel_dims import ParallelDims

    return ParallelDims(replicate, shard, replicate * shard).mode


def words(text: str) -> list[str]:
    """A list given on a command line, space or comma separated ("8 16,32" -> ["8", "16", "32"])."""
    return [w for w in re.split(r"[,\s]+", text) if w]


def parse_script_args(parser: argparse.ArgumentParser, argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    """Adds the options of `execute` every script takes (--timeout, --force, --dry-run), then parses `argv`.

    Returns:
        (the options, the arguments the parser does not know: train.py flags for every run, the user's "$@",
        without a `--` that may separate them).
    """
    parser.add_argument("--timeout", type=float, default=0, help="seconds per run (0: none)")
    parser.add_argument("--force", action="store_true", help="rerun runs already ok (and search batches again)")
    parser.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    opts, extra = parser.parse_known_args(argv)
    return opts, [a for a in extra if a != "--"]
