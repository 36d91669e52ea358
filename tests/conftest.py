"""Shared test helpers: tiny configs and a torchrun launcher for multi-process (gloo) tests."""

import json
import os
import socket
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


def run_train(args: list[str], nproc: int = 1, timeout: int = 600, check: bool = True, env: dict | None = None):
    """Runs train.py (through torchrun --standalone when nproc > 1) and returns the CompletedProcess."""
    base_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "WANDB_MODE": "offline"}
    base_env.update(env or {})
    cmd = [*launcher(nproc), "train.py", *args]  # torchrun --standalone: its store takes a port no other run holds
    result = run_to_end(cmd, timeout, ROOT, base_env)  # at the timeout torchrun gets to stop its workers
    if check and result.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({result.returncode}):\n{result.stdout[-4000:]}\n"
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
