"""Shared test helpers: tiny configs and a torchrun launcher for multi-process (gloo) tests."""

import contextlib
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from torchtitan.kernels.triton_support import triton_interpreting
from torchtitan.tools.runs import launcher, run_to_end

ROOT = Path(__file__).resolve().parents[1]

# Kernel tests: those that run only in the TRITON_INTERPRET=1 child process their module starts, and CUDA ones.
needs_interpreter = pytest.mark.skipif(
    not triton_interpreting(), reason="runs in the TRITON_INTERPRET=1 child of test_kernels_in_interpreter"
)
needs_cuda_triton = pytest.mark.skipif(
    not torch.cuda.is_available() or triton_interpreting(), reason="needs CUDA, compiled"
)

# Integration tests whose interpreter child runs the kernels inside a whole DiT (converters, DP) run a small image
# there, 4x4 (4 tokens) instead of 16x16, and the modulated norm's backward walks 16 tokens a step instead of 2: the
# interpreter runs each program (the norm's forward has one per token), and each step of its loop, in Python. 8x8
# images and the tile made those children about 3x faster (89/56 s -> 28/19 s alone); 4x4 takes another third off
# their CPU time (the converters' two AC tests 36 -> 24 CPU-s, the DP child 53 -> 39). The tile only paces the GPU,
# and these tests check the converters' wiring: test_kernels_adaln_norm, _mlp and _qkv check each kernel's values over
# several tiles and ragged ends.
INTERPRETED_IMAGE_SIZE = 4 if triton_interpreting() else 16


@pytest.fixture
def interpreter_launch(monkeypatch):
    if triton_interpreting():
        from torchtitan.kernels import adaln_norm

        monkeypatch.setitem(adaln_norm.LAUNCH, "bwd_tile", 16)


# Few threads per process: CI has 2 cores, and multi-process tests run several processes at once.
torch.set_num_threads(2)


# The longest files first (seconds of each in the suite on CI's 2 cores, 2026-11-27; test_kernels_triton_support's
# interpreter child estimated from the eight children it replaced, each file's own): `--dist loadfile` hands files to
# the two workers in collection order, each when it frees up, so a long file handed out last would run alone at the
# end while the other worker idles (alphabetically, test_train*.py came last).
LONG_FILES = {
    "test_parallelisms.py": 306, "test_kernels_triton_support.py": 250, "test_dp_composition.py": 180,
    "test_dp_suite.py": 183, "test_train.py": 158, "test_train_dp.py": 133, "test_train_configs.py": 122,
    "test_checkpoint.py": 120, "test_dp_engine.py": 109, "test_latents.py": 86, "test_config_manager.py": 86,
    "test_profile_memory.py": 47, "test_sample.py": 47, "test_attention_lab.py": 43, "test_benchmark_sampling.py": 41,
    "test_dp_distributed.py": 41, "test_dp_llama3.py": 38, "test_memory_estimate.py": 36,
    "test_optimization_analysis.py": 36, "test_validation.py": 32,
}  # fmt: skip


def pytest_collection_modifyitems(session, config, items) -> None:
    items.sort(key=lambda item: -LONG_FILES.get(item.path.name, 0))  # stable: a file's tests keep their order


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Dynamo's recompile limit (8 per code object) counts across the tests of one process: several tests compile
    DiTBlock.forward with other configs, and a fullgraph compile past the limit fails (seen on an H100 when the
    CUDA tests of four files ran in one process). Each test starts from no compiled code."""
    torch._dynamo.reset()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class TrainServer:
    """tests/train_server.py: forks runs of a script from a process that has imported train.py's modules (a run of
    the tiny config then starts in about 1 CPU-s instead of 7; a multi-process run forks its ranks there instead of
    starting torchrun), in the environment it was started with."""

    def __init__(self, env: dict):
        self.proc = subprocess.Popen([sys.executable, str(ROOT / "tests" / "train_server.py")], cwd=ROOT, env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0)  # fmt: skip
        self.folder = Path(tempfile.mkdtemp(prefix="train_server_"))
        self.running: int | None = None  # the pid of the run under way (of its agent, for several processes)
        self.group = False  # whether that pid leads a process group: the agent of a multi-process run and its ranks

    def _answer(self, timeout: float | None) -> int:
        line = b""
        while not line.endswith(b"\n"):
            if not select.select([self.proc.stdout], [], [], timeout)[0]:
                raise TimeoutError
            byte = self.proc.stdout.read(1)
            assert byte, f"tests/train_server.py ended ({self.proc.wait()})"
            line += byte
        return int(line)

    def _kill(self, pid: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            if self.group:
                os.killpg(pid, signal.SIGKILL)
            else:
                os.kill(pid, signal.SIGKILL)

    def run(self, cmd: list[str], script: str, args: list[str], env: dict, timeout: float, nproc: int = 1):
        """As run_to_end(cmd, timeout, ROOT, env): at the timeout the run gets SIGTERM, then SIGKILL after 60 s."""
        out, err = self.folder / "stdout", self.folder / "stderr"
        request = {"script": script, "args": args, "env": env, "stdout": str(out), "stderr": str(err), "nproc": nproc,
                   "port": free_port()}  # fmt: skip
        self.proc.stdin.write((json.dumps(request) + "\n").encode())
        self.group = nproc > 1
        pid = self.running = self._answer(None)
        try:
            status = self._answer(timeout)
        except TimeoutError:
            os.kill(pid, signal.SIGTERM)
            try:
                self._answer(60)
            except TimeoutError:
                self._kill(pid)
                self._answer(None)
            self.running = None
            raise subprocess.TimeoutExpired(cmd, timeout, output=out.read_text(), stderr=err.read_text()) from None
        self.running = None
        return subprocess.CompletedProcess(cmd, status, out.read_text(), err.read_text())

    def close(self) -> None:
        """Ends the server and the run it waits on, if any."""
        if self.running is not None:
            self._kill(self.running)
        self.proc.kill()
        self.proc.wait()
        shutil.rmtree(self.folder, ignore_errors=True)


_train_servers: dict[str, TrainServer] = {}  # by environment


def pytest_sessionfinish(session, exitstatus) -> None:
    """Ends this pytest process's train servers (in each xdist worker too, where atexit handlers do not run). The
    tests import this file as `tests.conftest`, a module apart from pytest's plugin copy: the servers are there."""
    for module in {sys.modules[__name__], sys.modules.get("tests.conftest")} - {None}:
        while module._train_servers:
            module._train_servers.popitem()[1].close()


def run_python(script: str, args: list[str], nproc: int = 1, timeout: float = 600, env: dict | None = None):
    """`python SCRIPT ARGS` in ROOT (through torchrun --standalone when nproc > 1), a thread a process; returns the
    CompletedProcess. Without `env`, the run (its ranks, for nproc > 1) forks from the TrainServer of this
    environment (with TORCHDITAN_TEST_FORK=0: never; scripts' own torchrun launches are tested elsewhere)."""
    base_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "WANDB_MODE": "offline"}
    cmd = [*launcher(nproc), script, *args]  # torchrun --standalone: its store takes a port no other run holds
    if env is None and os.environ.get("TORCHDITAN_TEST_FORK", "1") != "0":
        # Variables read at import are the server's: a server per environment but for the name of the test
        key = json.dumps({k: v for k, v in sorted(base_env.items()) if k != "PYTEST_CURRENT_TEST"})
        if key not in _train_servers:
            _train_servers[key] = TrainServer(base_env)
        server = _train_servers[key]
        try:
            return server.run(cmd, script, args, base_env, timeout, nproc)
        except BaseException as e:
            if not isinstance(e, subprocess.TimeoutExpired):  # a protocol cut mid-way: no later run may read it
                del _train_servers[key]
                server.close()
            raise
    return run_to_end(cmd, timeout, ROOT, {**base_env, **(env or {})})  # at the timeout torchrun stops its workers


def run_train(args: list[str], nproc: int = 1, timeout: int = 600, check: bool = True, env: dict | None = None):
    """Runs train.py (through torchrun --standalone when nproc > 1) and returns the CompletedProcess."""
    result = run_python("train.py", args, nproc, timeout, env)
    if check and result.returncode != 0:
        raise AssertionError(f"{' '.join(result.args)} failed ({result.returncode}):\n{result.stdout[-4000:]}\n"
                             f"{result.stderr[-6000:]}")  # fmt: skip
    return result


def read_metrics(folder: Path, validation: bool = False) -> list[dict]:
    """The training records of a run's metrics.jsonl, or its validation records (held-out loss, FID): those with
    no training loss."""
    records = [json.loads(line) for line in (Path(folder) / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if ("loss" not in r) == validation]


TINY = [
    "--job.config_file", str(ROOT / "train_configs/debug_model.toml"),
    "--metrics.log_freq", "1",
    "--metrics.enable_tensorboard", "false",
    "--sampling.freq", "0",
    "--checkpoint.enable", "false",
    "--training.local_batch_size", "8",
    "--lr_scheduler.warmup_steps", "2",
]  # fmt: skip


@pytest.fixture
def tiny_args():
    return list(TINY)


def debug_dit_outputs_and_grads(prepare=None, **overrides) -> dict[str, torch.Tensor]:
    """The debug DiT (seeded, every parameter nudged off its init: adaLN-Zero starts every gate at 0) on three fixed
    samples: {"output": the output, with its autograd graph, name: gradient of a weighted sum of it}.

    `prepare(model)` runs before the forward (e.g. activation checkpointing); gradient names leave out the
    checkpoint wrapper's prefix, so they match a plain model's.
    """
    import dataclasses

    from torchtitan.models.dit import DiT, dit_configs

    torch.manual_seed(0)
    model = DiT(dataclasses.replace(dit_configs["debug"], **overrides))
    model.init_weights()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    if prepare is not None:
        prepare(model)
    size, channels = model.args.input_size, model.args.in_channels
    x, t, y = torch.randn(3, channels, size, size), torch.tensor([1.0, 500.0, 999.0]), torch.tensor([0, 3, 10])
    out = model(x, t, y)
    (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
    grads = {n.replace("_checkpoint_wrapped_module.", ""): p.grad for n, p in model.named_parameters()}
    return {"output": out, **grads}


def assert_close_by_name(got: dict, expected: dict, rtol: float, atol: float) -> None:
    assert got.keys() == expected.keys()
    for name, value in expected.items():
        torch.testing.assert_close(got[name].detach(), value.detach(), rtol=rtol, atol=atol,
                                   msg=lambda m, name=name: f"{name}: {m}")  # fmt: skip


@pytest.fixture
def keep_tf32_flags():
    """A reference benchmark's main() sets TF32 as its reference runs; later tests in the process keep their own."""
    flags = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = flags
