"""The qkv Linear whose backward assembles q, k and v's gradients and sums its bias gradient in one Triton kernel,
against the torch maths (the kernel in Triton's CPU interpreter here, compiled on CUDA).

As in test_kernels_mlp.py, the interpreter tests run in a TRITON_INTERPRET=1 child process of
`test_kernels_in_interpreter`.
"""

import dataclasses

import pytest
import torch

from tests.conftest import needs_cuda_triton, needs_interpreter
from torchtitan.kernels import qkv as qp
from torchtitan.kernels.converters import apply_converters
from torchtitan.kernels.dit_modules import FusedQKVAttention
from torchtitan.models.dit import DiT, dit_configs
from torchtitan.models.dit.model import Attention

pytestmark = pytest.mark.skipif(qp.triton is None, reason="triton is not installed")


def _inputs(batch, tokens, dim, dtype, device="cpu"):
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(batch, tokens, dim, device=device, generator=g).to(dtype)
    weight = (torch.randn(3 * dim, dim, device=device, generator=g) / dim**0.5).to(dtype)
    bias = torch.randn(3 * dim, device=device, generator=g).to(dtype)
    grads = [torch.randn(batch, tokens, dim, device=device, generator=g).to(dtype) for _ in range(3)]
    return x, weight, bias, grads


def _run(fn, x, weight, bias, grads, num_heads, used=(0, 1, 2)):
    """q, k, v and the gradients of sum_i <out_i, grads_i> (over the outputs in `used`) for x, weight and bias."""
    x, weight, bias = (t.detach().requires_grad_() for t in (x, weight, bias))
    outs = fn(x, weight, bias, num_heads)
    loss = sum((outs[i].double() * grads[i].double().view_as(outs[i])).sum() for i in used)
    return [*outs, *torch.autograd.grad(loss, (x, weight, bias))]


@needs_interpreter
@pytest.mark.parametrize("block_m,rows", [(32, 256), (8, 16)])
@pytest.mark.parametrize("used", [(0, 1, 2), (0, 2)])
def test_kernel_matches_torch(monkeypatch, block_m, rows, used):
    # 3 x 37 rows leave a ragged last run and a ragged row block; D = 200 a ragged column block of 128; `(0, 2)`:
    # k reaches no loss, its gradient is None. fp32 against fp64 maths on the same inputs: rtol 1e-5, atol 1e-4
    # (the weight gradient and the bias sums add up 111 rows).
    monkeypatch.setitem(qp.LAUNCH, "block_m", block_m)
    monkeypatch.setitem(qp.LAUNCH, "rows", rows)
    x, weight, bias, grads = _inputs(3, 37, 200, torch.float32)
    ref = _run(qp.qkv_linear_torch, x.double(), weight.double(), bias.double(), grads, 4, used)
    got = _run(qp.qkv_linear, x, weight, bias, grads, 4, used)
    for name, a, b in zip(["q", "k", "v", "x", "weight", "bias"], got, ref, strict=True):
        assert a.dtype == torch.float32, name
        torch.testing.assert_close(a.double(), b, rtol=1e-5, atol=1e-4, msg=lambda m, name=name: f"{name}: {m}")


@needs_interpreter
def test_autocast_runs_the_gemms_in_bf16_and_returns_fp32_gradients():
    # Under bf16 autocast the path casts x, weight and bias itself, as F.linear's autocast would: q, k, v come out
    # in bf16 and equal the module path's bitwise (the same GEMM); gradients come back in the parameters' fp32,
    # within bf16 rounding of the module path's (the bias gradient is summed in fp32 here, after a bf16 round there).
    x, weight, bias, grads = _inputs(2, 16, 64, torch.float32)
    results = []
    for fn in (qp.qkv_linear_torch, qp.qkv_linear):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            results.append(_run(fn, x, weight, bias, [g.bfloat16() for g in grads], 2))
    for name, a, b in zip(["q", "k", "v", "x", "weight", "bias"], *results, strict=True):
        assert a.dtype == b.dtype == (torch.bfloat16 if name in ("q", "k", "v") else torch.float32), name
        if name in ("q", "k", "v"):
            assert torch.equal(a, b), name
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2 * b.abs().max().item(), msg=lambda m, n=name: f"{n}: {m}")


@needs_cuda_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_on_cuda(dtype):
    # At DiT-XL/2's width, against fp64 maths on the same inputs: fp32 within TF32-free matmul rounding; bf16
    # within a few bf16 ulps of each tensor's scale (outputs and gradients stored in bf16, sums in fp32).
    x, weight, bias, grads = _inputs(4, 256, 1152, dtype, device="cuda")
    ref = _run(qp.qkv_linear_torch, x.double(), weight.double(), bias.double(), grads, 16)
    got = _run(qp.qkv_linear, x, weight, bias, grads, 16)
    for a, b in zip(got, ref, strict=True):
        if dtype == torch.float32:
            torch.testing.assert_close(a.double(), b, rtol=1e-4, atol=1e-3)
        else:
            torch.testing.assert_close(a.double(), b, rtol=2e-2, atol=2e-2 * b.abs().max().item())


@needs_cuda_triton
def test_compiled_attention_matches_the_plain_attention_on_cuda():
    # The DiT attention under torch.compile(fullgraph=True) and bf16 autocast, as the trainer runs it: the autograd
    # function and the custom op trace without graph breaks, and output and gradients match the plain attention's
    # within bf16 tolerance.
    results = []
    for fused in (False, True):
        torch.manual_seed(0)
        attention = Attention(dit_configs["DiT-XL/2"]).cuda()
        if fused:
            attention = FusedQKVAttention(attention)
        g = torch.Generator(device="cuda").manual_seed(1)
        x = torch.randn(8, 256, dit_configs["DiT-XL/2"].dim, device="cuda", generator=g, requires_grad=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = torch.compile(attention, fullgraph=True)(x, None)
        out.float().square().mean().backward()
        results.append([out.float(), x.grad, *(p.grad for p in attention.parameters())])
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(a.float(), b.float(), rtol=3e-2, atol=3e-2 * b.abs().max().item())


@needs_cuda_triton
@pytest.mark.parametrize(
    "converters,mode,option",
    [([name], *ac) for name in ("fused_qkv", "fused_mlp", "fused_norm") for ac in (("none", "op"), ("full", "op"),
                                                                                   ("selective", "op"))]
    + [(["fused_norm", "fused_mlp", "fused_qkv"], "selective", "2")],
    ids=lambda value: "+".join(value) if isinstance(value, list) else None,
)  # fmt: skip
def test_compiled_checkpointed_dit_matches_the_plain_model_on_cuda(converters, mode, option):
    # As parallelize_dit builds it: the converters, activation checkpointing, then per-block
    # torch.compile(fullgraph=True), bf16 autocast. The qkv autograd function (fused_qkv), the MLP as one op of cuBLASLt
    # GEMMs (fused_mlp), and the adaLN kernels with the residual stream handed on in parts (fused_norm; with every 2nd
    # block checkpointed, blocks that finish their residual and one that does not) trace inside the checkpointed,
    # compiled blocks; output and gradients match the plain model's within bf16 tolerance.
    from torchtitan.parallelisms.utils import apply_ac, apply_compile, checkpointed_blocks

    results = []
    for fused in (False, True):
        torch.manual_seed(0)
        model = DiT(dataclasses.replace(dit_configs["DiT-S/2"], depth=4)).cuda()
        model.init_weights()
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.02 * torch.randn_like(p))
        checkpointed = checkpointed_blocks(4, mode, option)
        conversion = apply_converters(model, converters if fused else [], checkpointed, None, fsdp_enabled=False)
        if mode != "none":
            apply_ac(model.blocks, mode, option, save_ops=conversion.save_ops)
        apply_compile(model, "default", "block")
        g = torch.Generator(device="cuda").manual_seed(1)
        x = torch.randn(8, 4, 32, 32, device="cuda", generator=g)
        t, y = (torch.randint(0, 1000, (8,), device="cuda", generator=g) for _ in range(2))
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(x, t.float(), y)
        out.float().square().mean().backward()
        results.append([out.float(), *(p.grad for p in model.parameters())])
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(a.float(), b.float(), rtol=3e-2, atol=3e-2 * b.abs().max().item())
