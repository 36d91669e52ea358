"""Started by tests/conftest.py's run_python, once per pytest process and environment: imports train.py's modules
(torch, torchtitan) once, then forks a child per one-process run, which executes its script (train.py,
tests/layout_grads.py) as `python SCRIPT ARGS` would.

A run of the tiny config spends about 6 of its 8 CPU-s importing torch and torchtitan, and the suite starts some 70
of them on CI's 2 cores. The child of a fork is that fresh process with its imports done: this process imports
and does nothing else (no thread, no tensor, no compile: a fork copies only the thread that calls it, so a lock
another thread held would stay locked in the child; it checks that it runs one thread before each fork), its
environment is the run's (conftest starts a server per environment), and each child gets its own output files,
argv, sys.path[0] and exit status.

Protocol, a line each: the test writes {"script": path, "args": [...], "env": {...}, "stdout": path, "stderr": path};
this process answers the child's pid, then its exit status (negative: killed by that signal) once it has ended.
"""

import json
import os
import runpy
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


request = serve()
# The child: the run's own streams, environment (the same but for PYTEST_CURRENT_TEST) and arguments, then its script
# as the main module. Its exit (sys.exit(main()), or an uncaught exception: traceback, status 1) ends this process as
# it would end `python SCRIPT`.
for fd, path, flags in ((0, os.devnull, os.O_RDONLY), (1, request["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
                        (2, request["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)):  # fmt: skip
    file = os.open(path, flags, 0o644)
    os.dup2(file, fd)
    os.close(file)
os.environ.clear()
os.environ.update(request["env"])
script = os.path.abspath(request["script"])
sys.argv = [request["script"], *request["args"]]
sys.path[0] = os.path.dirname(script)
runpy.run_path(script, run_name="__main__")
