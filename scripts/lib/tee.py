"""Runs a command with its output into a log file and to stdout, then prints the result line of its return code.

    python scripts/lib/tee.py LOG -- COMMAND ...

scripts/lib's `execute` runs train.py through this, under torchtitan.tools.runs' `launch_command`: the log keeps
every line (the launcher keeps only the end), the launcher still sees the whole output (it looks for torch's
out-of-memory error there) and reads the last `RESULT_PREFIX` line, which here holds the return code, so a
run that ends well is "ok" and a failed one's code is recorded. Exits with the command's code.
"""

import ctypes
import json
import signal
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from torchtitan.tools.runs import RESULT_PREFIX  # noqa: E402  (needs the repository root on the path)

PR_SET_PDEATHSIG = 1  # linux/prctl.h


def _stop_with_this_process() -> None:
    """In the child: SIGTERM when this wrapper dies. The launcher's timeout kills the wrapper (SIGKILL, which it
    cannot catch); without this, train.py would run on unseen, and torchrun stops its workers on SIGTERM."""
    ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def run(log_path: Path, cmd: list[str]) -> int:
    """Runs `cmd`, stdout and stderr line by line into `log_path` and to this process's stdout.

    Returns:
        The command's exit status (128 + N when signal N killed it; 127 when it could not start).
    """
    preexec = _stop_with_this_process if sys.platform == "linux" else None
    with open(log_path, "w") as log:
        try:
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                    errors="replace", preexec_fn=preexec)  # fmt: skip
        except OSError as e:  # no such program: recorded like any failed run
            print(e, file=log, flush=True)
            print(e, flush=True)
            return 127
        for line in proc.stdout:
            log.write(line)
            log.flush()  # `tail -f train.log` follows a run
            sys.stdout.write(line)
        returncode = proc.wait()
    # Killed by signal N (the kernel's OOM killer: 9): 128 + N, as a shell says it; an exit status is never negative.
    return returncode if returncode >= 0 else 128 - returncode


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[1] != "--":
        raise SystemExit(__doc__)
    returncode = run(Path(argv[0]), argv[2:])
    print(RESULT_PREFIX + json.dumps({"returncode": returncode}), flush=True)
    return returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
