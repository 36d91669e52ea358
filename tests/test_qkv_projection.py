"""The qkv Linear whose backward assembles q, k and v's gradients and sums its bias gradient in one Triton kernel,
against the torch maths (the kernel in Triton's CPU interpreter here, compiled on CUDA).

As in test_mlp_activation.py, the interpreter tests run in a TRITON_INTERPRET=1 child process of
`test_kernels_in_interpreter`.
"""

import dataclasses

import pytest
import torch

from tests.conftest import assert_close_by_name, debug_dit_outputs_and_grads, needs_cuda_triton, needs_interpreter
from torchtitan.dp.testing import rerun_under_triton_interpreter
from torchtitan.models.dit import DiT, dit_configs
from torchtitan.models.dit import qkv_projection as qp
from torchtitan.tools.triton_support import triton_interpreting

pytestmark = pytest.mark.skipif(qp.triton is None, reason="triton is not installed")


@pytest.mark.skipif(triton_interpreting(), reason="this is the child")
def test_kernels_in_interpreter():
    rerun_under_triton_interpreter(__file__, min_passed=8)


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


@needs_interpreter
def test_dit_with_the_kernel_matches_torch():
    # The debug DiT with and without the kernel (the interpreter runs it on CPU tensors): the same outputs and
    # parameter gradients, fp32, rtol 1e-4 and atol 1e-5 (the bias gradient summed in another order).
    unfused, fused = (debug_dit_outputs_and_grads(fused_qkv=fused, fused_mlp=False, fused_norm=False)
                      for fused in (False, True))  # fmt: skip
    assert not _graph_has(unfused["output"], "_QKVLinearBackward")
    assert _graph_has(fused["output"], "_QKVLinearBackward")
    assert_close_by_name(fused, unfused, rtol=1e-4, atol=1e-5)


@needs_interpreter
@pytest.mark.parametrize("mode,option", [("full", "op"), ("selective", "op"), ("selective", "2")])
def test_the_kernel_path_under_activation_checkpointing(mode, option):
    # Checkpointed blocks rerun the autograd function in backward (full) or replay its saved GEMM (per-op policy):
    # the same gradients as without checkpointing, fp32, rtol 1e-5 and atol 1e-6.
    from torchtitan.models.dit.parallelize import apply_dit_ac

    plain = debug_dit_outputs_and_grads(fused_qkv=True, fused_mlp=False, fused_norm=False)
    assert _graph_has(plain["output"], "_QKVLinearBackward")
    checkpointed = debug_dit_outputs_and_grads(lambda model: apply_dit_ac(model, mode, option), fused_qkv=True,
                                               fused_mlp=False, fused_norm=False)  # fmt: skip
    assert_close_by_name(checkpointed, plain, rtol=1e-5, atol=1e-6)


def _graph_has(out: torch.Tensor, name: str) -> bool:
    seen, stack = set(), [out.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        stack.extend(n for n, _ in node.next_functions)
    return any(type(node).__name__ == name for node in seen)


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
def test_compiled_attention_matches_module_path_on_cuda():
    # The DiT attention under torch.compile(fullgraph=True) and bf16 autocast, as the trainer runs it: the autograd
    # function and the custom op trace without graph breaks, and output and gradients match the module path's
    # within bf16 tolerance.
    from torchtitan.models.dit.model import Attention

    results = []
    for fused in (False, True):
        args = dataclasses.replace(dit_configs["DiT-XL/2"], fused_qkv=fused)
        torch.manual_seed(0)
        attention = Attention(args).cuda()
        g = torch.Generator(device="cuda").manual_seed(1)
        x = torch.randn(8, 256, args.dim, device="cuda", generator=g, requires_grad=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = torch.compile(attention, fullgraph=True)(x, None)
        out.float().square().mean().backward()
        results.append([out.float(), x.grad, *(p.grad for p in attention.parameters())])
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(a.float(), b.float(), rtol=3e-2, atol=3e-2 * b.abs().max().item())


@needs_cuda_triton
@pytest.mark.parametrize("flag", ["fused_qkv", "fused_mlp"])
@pytest.mark.parametrize("mode,option", [("none", "op"), ("full", "op"), ("selective", "op")])
def test_compiled_checkpointed_dit_matches_module_path_on_cuda(mode, option, flag):
    # As the trainer builds it: activation checkpointing, then per-block torch.compile(fullgraph=True), bf16 autocast.
    # The qkv autograd function (fused_qkv), and the MLP as one op of cuBLASLt GEMMs (fused_mlp), trace
    # inside the checkpointed, compiled blocks; output and gradients match the module path's within bf16 tolerance.
    from torchtitan.models.dit.parallelize import apply_dit_ac
    from torchtitan.parallelisms.utils import apply_compile

    results = []
    for fused in (False, True):
        torch.manual_seed(0)
        model = DiT(dataclasses.replace(dit_configs["DiT-S/2"], depth=4, **{flag: fused})).cuda()
        model.init_weights()
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.02 * torch.randn_like(p))
        if mode != "none":
            apply_dit_ac(model, mode, option)
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
