"""Flash norm kernels (Triton, run by its CPU interpreter here) against the torch implementations.

triton.jit picks the interpreter or the compiler when it decorates, and triton decorates its own
library functions (tl.sum, ...) when it is first imported; so TRITON_INTERPRET=1 must be set
before anything imports triton. The pytest process has long imported it (collection imports
every test module), so test_kernels_triton_support.py's `test_kernels_in_interpreter` reruns this module
in a child process with the variable set, where the tests marked `needs_interpreter` run.
"""

import logging

import pytest
import torch
from torch import nn

from tests.conftest import needs_interpreter
from torchtitan.dp import DPEngine
from torchtitan.dp import flash_kernels as fk
from torchtitan.dp.testing import clipped_mean, per_sample_grads

pytestmark = pytest.mark.skipif(fk.triton is None, reason="triton is not installed")


# (B, T, d, p): ragged edges everywhere, more than one tile along T (Gram: off-diagonal tiles
# count twice) and along d and p (explicit).
SHAPES = [(3, 5, 7, 9), (2, 70, 33, 17), (2, 40, 70, 65), (1, 130, 8, 8)]


@needs_interpreter
@pytest.mark.parametrize("gram", [False, True])
@pytest.mark.parametrize("shape", SHAPES)
def test_kernels_match_torch(shape, gram):
    B, T, d, p = shape
    g = torch.Generator().manual_seed(0)
    a, grad = torch.randn(B, T, d, generator=g), torch.randn(B, T, p, generator=g)
    expected = fk.explicit_norm_sq_torch(a.double(), grad.double()).float()
    torch.testing.assert_close(fk._triton_norm_sq(a, grad, gram), expected, rtol=1e-5, atol=0)
    torch.testing.assert_close(fk.gram_norm_sq_torch(a, grad), expected, rtol=1e-5, atol=0)
    # Strided inputs: the kernels read through strides, no copy.
    a_t = torch.randn(B, d, T, generator=g).transpose(1, 2)
    expected = fk.explicit_norm_sq_torch(a_t.double(), grad.double()).float()
    torch.testing.assert_close(fk._triton_norm_sq(a_t, grad, gram), expected, rtol=1e-5, atol=0)


@needs_interpreter
@pytest.mark.parametrize("gram", [False, True])
def test_kernels_launch_samples_in_chunks_of_the_grid_limit(monkeypatch, gram):
    # Samples are the grid's z axis (at most 65535 on CUDA): here a limit of 2 splits 5 samples 2 + 2 + 1.
    monkeypatch.setattr(fk, "_MAX_GRID_YZ", 2)
    g = torch.Generator().manual_seed(0)
    a, grad = torch.randn(5, 70, 33, generator=g), torch.randn(5, 70, 17, generator=g)
    expected = fk.explicit_norm_sq_torch(a.double(), grad.double()).float()
    torch.testing.assert_close(fk._triton_norm_sq(a, grad, gram), expected, rtol=1e-5, atol=0)


@needs_interpreter
def test_scale_kernel_launches_samples_in_chunks_of_the_grid_limit(monkeypatch):
    monkeypatch.setattr(fk, "_MAX_GRID_YZ", 2)  # samples are the scale kernel's grid y axis: 5 go 2 + 2 + 1
    t, coef = torch.randn(5, 70, 65, generator=torch.Generator().manual_seed(0)), torch.rand(5)
    torch.testing.assert_close(fk.scale_samples(t, coef), t * coef.view(-1, 1, 1), rtol=0, atol=0)


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_scale_kernel_matches_torch(dtype):
    g = torch.Generator().manual_seed(0)
    t = torch.randn(3, 70, 65, generator=g).to(dtype)  # 4550 elements a sample: two blocks, a ragged one
    coef = torch.rand(3, generator=g).to(dtype)
    expected = (t.float() * coef.float().view(-1, 1, 1)).to(dtype)  # one rounding of the fp32 product
    # The interpreter truncates float32 -> bf16 where CUDA rounds to nearest (test_scale_kernel_on_cuda): 1 ulp.
    rtol = 0 if dtype == torch.float32 else 2**-7
    torch.testing.assert_close(fk.scale_samples(t, coef), expected, rtol=rtol, atol=0)
    assert torch.equal(fk.scale_samples(t.transpose(1, 2), coef), expected.transpose(1, 2))  # strided: torch path


@needs_interpreter
def test_dispatch_picks_form_by_cost(monkeypatch):
    calls = []
    monkeypatch.setattr(fk, "_triton_norm_sq", lambda a, g, gram: calls.append(gram) or torch.zeros(a.shape[0]))
    fk.matmul_grad_norm_sq(torch.randn(2, 4, 8), torch.randn(2, 4, 8), flash=True)  # 32 < 64: Gram
    fk.matmul_grad_norm_sq(torch.randn(2, 8, 8), torch.randn(2, 8, 8), flash=True)  # 128 > 64: explicit
    fk.matmul_grad_norm_sq(torch.randn(2, 8, 8), torch.randn(2, 8, 8), flash=False)  # torch path
    assert calls == [True, False]


@pytest.mark.skipif(fk.triton_interpreting(), reason="the fallback is for a CPU without the interpreter")
def test_falls_back_to_torch_on_cpu(caplog):
    fk._log_fallback_once.cache_clear()
    a, g = torch.randn(3, 6, 5), torch.randn(3, 6, 4)
    with caplog.at_level(logging.INFO, logger=fk.__name__):
        out = fk.matmul_grad_norm_sq(a, g, flash=True)
    assert "using the torch implementation" in caplog.text
    torch.testing.assert_close(out, fk.explicit_norm_sq_torch(a, g))


@needs_interpreter
@pytest.mark.parametrize("mode", ["flash", "flash_bookkeeping"])
def test_flash_modes_under_interpreter(mode):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(12, 20), nn.GELU(), nn.Linear(20, 3))  # T = 6: one Gram, one explicit layer
    x = torch.randn(4, 6, 12)

    def loss_fn(out, x):
        return out.square().mean((1, 2))

    ref, ref_norms = clipped_mean(per_sample_grads(model, loss_fn, x), 0.5)
    engine = DPEngine(model, mode, 0.5, 0.0)
    norms = engine.backward(loss_fn(model(x), x))
    torch.testing.assert_close(norms, ref_norms, rtol=1e-5, atol=0)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, ref[name], rtol=1e-4, atol=1e-7)


@pytest.mark.skipif(not torch.cuda.is_available() or fk.triton_interpreting(), reason="needs CUDA, compiled")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("gram", [False, True])
def test_compiled_kernels_on_cuda(dtype, gram):
    g = torch.Generator(device="cuda").manual_seed(0)
    for B, T, d, p in [(3, 257, 96, 200), (2, 1024, 256, 768)]:
        a = torch.randn(B, T, d, device="cuda", generator=g).to(dtype)
        grad = torch.randn(B, T, p, device="cuda", generator=g).to(dtype)
        expected = fk.explicit_norm_sq_torch(a.double(), grad.double()).float()  # same inputs, exact sums
        # bf16 inputs are exact in the kernel's fp32 products; only the accumulation order differs.
        torch.testing.assert_close(fk._triton_norm_sq(a, grad, gram), expected, rtol=1e-4, atol=0)


@pytest.mark.skipif(not torch.cuda.is_available() or fk.triton_interpreting(), reason="needs CUDA, compiled")
def test_scale_kernel_on_cuda():
    t = torch.randn(5, 300, 77, device="cuda").bfloat16()
    coef = torch.rand(5, device="cuda").bfloat16()
    assert torch.equal(fk.scale_samples(t, coef), t * coef.view(-1, 1, 1))  # bf16 multiply: fp32, one rounding


@pytest.mark.skipif(not torch.cuda.is_available() or fk.triton_interpreting(), reason="needs CUDA, compiled")
@pytest.mark.parametrize("gram", [False, True])
def test_compiled_kernels_launch_samples_in_chunks_on_cuda(monkeypatch, gram):
    # The compiled launches with the grid limit cut to 2: 5 samples go 2 + 2 + 1, each chunk its own grid.
    monkeypatch.setattr(fk, "_MAX_GRID_YZ", 2)
    g = torch.Generator(device="cuda").manual_seed(0)
    a, grad = torch.randn(5, 257, 96, device="cuda", generator=g), torch.randn(5, 257, 200, device="cuda", generator=g)
    expected = fk.explicit_norm_sq_torch(a.double(), grad.double()).float()
    torch.testing.assert_close(fk._triton_norm_sq(a, grad, gram), expected, rtol=1e-4, atol=0)
    t, coef = grad.bfloat16(), torch.rand(5, device="cuda", generator=g).bfloat16()
    assert torch.equal(fk.scale_samples(t, coef), t * coef.view(-1, 1, 1))
