"""Started by tests/conftest.py's run_python, once per pytest process and environment: imports train.py's modules
(torch, torchtitan) once, then forks a child per run (or its ranks), which executes its script (train.py,
tests/layout_grads.py) as `python SCRIPT ARGS` would.

A run of the tiny config spends about 6 of its 8 CPU-s importing torch and torchtitan, and the suite starts some 70
of them on CI's 2 cores. The child of a fork is that fresh process with its imports done: this process imports
and does nothing else (no thread, no tensor, no compile: a fork copies only the thread that calls it, so a lock
another thread held would stay locked in the child; it checks that it runs one thread before each fork), its
environment is the run's (conftest starts a server per environment), and each child gets its own output files,
argv, sys.path[0] and exit status.

A multi-process run (torchrun's part, as `torchrun --standalone` would: a torchrun and a fresh process per rank
cost some 5 + 9 CPU-s on CI's 2 cores) forks an agent in a process group of its own, which forks a child per rank
with torchrun's variables (RANK, WORLD_SIZE, MASTER_ADDR/PORT, ...: rank 0 holds the rendezvous store) and the
run's streams shared; as torchrun does, the first rank that fails stops the others (SIGTERM), the agent ends 1 if
any rank failed, and SIGTERM to the agent stops its ranks.

Protocol, a line each: the test writes {"script": path, "args": [...], "env": {...}, "stdout": path, "stderr": path,
"nproc": n, "port": free port}; this process answers the child's (the agent's) pid, then its exit status (negative:
killed by that signal) once it has ended.
"""

import json
import os
import runpy
import signal
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[0] = str(ROOT)  # as `python train.py` sets it
os.chdir(ROOT)

import train  # noqa: E402, F401  (the imports every child would otherwise repeat)


def serve() -> dict:
    """Answers requests until stdin closes (then exits); returns the request in each forked child."""
    for line in sys.stdin:
        request = json.loads(line)
        threads = len(os.listdir("/proc/self/task"))
        assert threads == 1, f"tests/train_server.py runs {threads} threads: a fork would copy only one"
        pid = os.fork()
        if pid == 0:
            return request
        print(pid, flush=True)
        _, status = os.waitpid(pid, 0)
        print(os.waitstatus_to_exitcode(status), flush=True)
    sys.exit(0)


def supervise(request: dict) -> dict:
    """The agent of a multi-process run: returns the request, with its rank's variables, in each rank's child; exits
    with the run's status itself."""
    os.setpgid(0, 0)  # the test stops the run's whole group if the agent is killed
    nproc = request["nproc"]
    ranks = {}
    for rank in range(nproc):
        pid = os.fork()
        if pid == 0:
            world = {"RANK": rank, "LOCAL_RANK": rank, "WORLD_SIZE": nproc, "LOCAL_WORLD_SIZE": nproc, "GROUP_RANK": 0,
                     "ROLE_RANK": rank, "ROLE_WORLD_SIZE": nproc, "MASTER_ADDR": "127.0.0.1",
                     "MASTER_PORT": request["port"]}  # fmt: skip
            return {**request, "env": {**request["env"], **{k: str(v) for k, v in world.items()}}}
        ranks[pid] = rank

    def stop(signum=None, frame=None) -> None:
        for pid in ranks:
            os.kill(pid, signal.SIGTERM)
        if signum is not None:  # stopped by the test: the ranks' ends are not waited for
            os._exit(128 + signum)

    signal.signal(signal.SIGTERM, stop)
    failed = False
    while ranks:
        pid, status = os.wait()
        del ranks[pid]
        if os.waitstatus_to_exitcode(status) != 0 and not failed:
            failed = True
            stop()  # as torchrun stops the other workers when one fails
    os._exit(1 if failed else 0)


request = serve()
# Shared by a multi-process run's ranks (appended: their lines interleave as under torchrun, none overwritten).
for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
    file = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o644)
    os.dup2(file, fd)
    os.close(file)
file = os.open(os.devnull, os.O_RDONLY)
os.dup2(file, 0)
os.close(file)
if request.get("nproc", 1) > 1:
    request = supervise(request)
# The child: the run's own streams, environment (the same but for PYTEST_CURRENT_TEST) and arguments, then its script
# as the main module. Its exit (sys.exit(main()), or an uncaught exception: traceback, status 1) ends this process as
# it would end `python SCRIPT`.
os.environ.clear()
os.environ.update(request["env"])
script = os.path.abspath(request["script"])
sys.argv = [request["script"], *request["args"]]
sys.path[0] = os.path.dirname(script)
runpy.run_path(script, run_name="__main__")
