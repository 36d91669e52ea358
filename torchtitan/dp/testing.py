"""Reference DP-SGD gradients from torch.func, to check the engine (and any new layer rule) against; and a
runner for the tests of the Triton kernels under Triton's CPU interpreter."""

import copy
import os
import re
import subprocess
import sys
from pathlib import Path

import torch
from torch import nn
from torch.func import functional_call, grad, vmap


def per_sample_grads(
    model: nn.Module, loss_fn, *batch: torch.Tensor, dtype: torch.dtype | None = torch.float64
) -> dict[str, torch.Tensor]:
    """{name: (B, *param.shape)} gradients of each sample's loss, by vmap over torch.func.grad.

    `loss_fn(output, *batch)` must return the (B,) per-sample losses of `model(*batch)`. By default
    the reference runs on a float64 copy of the model and inputs, so that comparisons against an
    fp32 engine measure the engine's rounding alone; the result is in the model's dtype.
    """
    out_dtype = next(model.parameters()).dtype
    if dtype is not None:
        model = copy.deepcopy(model).to(dtype)
        batch = tuple(b.to(dtype) if b.is_floating_point() else b for b in batch)
    params = {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}
    buffers = {n: b.detach() for n, b in model.named_buffers()}

    def one_loss(params, *sample):
        batch1 = tuple(s.unsqueeze(0) for s in sample)
        return loss_fn(functional_call(model, (params, buffers), batch1), *batch1)[0]

    grads = vmap(grad(one_loss), in_dims=(None, *([0] * len(batch))))(params, *batch)
    return {n: g.to(out_dtype) for n, g in grads.items()}


def clipped_mean(grads: dict[str, torch.Tensor], max_grad_norm: float, batch_size: int | None = None):
    """(sum_i c_i g_i / B per param, (B,) per-sample norms) with c_i = min(1, C / (||g_i|| + 1e-6))."""
    norms = torch.cat([g.flatten(1) for g in grads.values()], dim=1).norm(dim=1)
    coef = (max_grad_norm / (norms + 1e-6)).clamp(max=1.0)
    batch_size = batch_size or norms.shape[0]
    return {n: torch.einsum("b...,b->...", g, coef) / batch_size for n, g in grads.items()}, norms


def rerun_under_triton_interpreter(min_passed: dict[str, int], timeout: float = 1200) -> None:
    """Runs test modules again, all in one child process with TRITON_INTERPRET=1, and asserts that they passed.

    triton.jit picks the interpreter or the compiler when it decorates, and triton decorates its own library
    functions (tl.sum, ...) when it is first imported, so the variable must be set before anything imports
    triton: the pytest process has long imported it (collection imports every test module). One child for every
    module: each would otherwise pay the start of Python, torch and pytest again.

    Args:
        min_passed: {test module's path: how many of its tests must pass in the child}, which proves that its
            interpreter-only tests did run there.

    Skipped where CUDA is: the interpreter stands in for a GPU on CPU machines (CI), and the kernels' CUDA tests run
    there instead. (The GPU machine's Triton, 3.6, cannot interpret `range(0, T, BLOCK_T)` over a runtime T: with
    NumPy 2.4 the flash norm kernels' child fails under it, there and on CPU, while they pass on CUDA.)
    """
    if torch.cuda.is_available():
        import pytest

        pytest.skip("CUDA is here: the kernels' CUDA tests stand for the interpreter's CPU run")
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    files = list(min_passed)
    cmd = [sys.executable, "-m", "pytest", "-q", "-rA", "-n", "0", "-p", "no:cacheprovider", "-p", "no:warnings"]
    cmd += files
    result = subprocess.run(cmd, env=env, cwd=Path(files[0]).parents[1], capture_output=True, text=True,
                            timeout=timeout)  # fmt: skip
    assert result.returncode == 0, result.stdout[-5000:] + result.stderr[-2000:]
    passed = re.findall(r"^PASSED ([^:\s]+)::", result.stdout, flags=re.MULTILINE)
    for file, least in min_passed.items():
        ran = sum(Path(p).name == Path(file).name for p in passed)
        assert ran >= least, f"{Path(file).name}: {ran} passed in the interpreter, expected at least {least}"
