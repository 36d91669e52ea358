"""The MLP's bias + activation kernels (Triton; its CPU interpreter here, compiled on CUDA) against the torch maths.

As in test_kernels_adaln_norm.py, the interpreter tests run in a TRITON_INTERPRET=1 child process of
`test_kernels_in_interpreter`.
"""

import dataclasses

import pytest
import torch

from tests.conftest import needs_cuda_triton, needs_interpreter
from torchtitan.kernels import mlp as ma
from torchtitan.kernels.dit_modules import FusedFeedForward, apply_fused_mlp
from torchtitan.models.dit import DiT, dit_configs
from torchtitan.models.dit.model import FeedForward

pytestmark = pytest.mark.skipif(ma.triton is None, reason="triton is not installed")


def _run(fn, pre, bias, grad_h, kind):
    """h = act(pre + bias) and the gradients of <h, grad_h> for pre and bias."""
    pre, bias = (t.detach().requires_grad_() for t in (pre, bias))
    h = fn(pre, bias, kind)
    return [h, *torch.autograd.grad((h.double() * grad_h.double()).sum(), (pre, bias))]


def _inputs(rows, n_in, n_out, dtype, device="cpu"):
    g = torch.Generator(device=device).manual_seed(0)
    pre = (2 * torch.randn(3, rows, n_in, device=device, generator=g)).to(dtype)  # GELU's curved part and tails
    bias = torch.randn(n_in, device=device, generator=g).to(dtype)
    grad_h = torch.randn(3, rows, n_out, device=device, generator=g).to(dtype)
    return pre, bias, grad_h


@needs_interpreter
@pytest.mark.parametrize("kind", ["gelu", "swiglu"])
@pytest.mark.parametrize("block_m,bwd_rows", [(32, 256), (8, 16)])
def test_kernels_match_torch(monkeypatch, kind, block_m, bwd_rows):
    # 3 x 37 rows leave a ragged last run and a ragged row block; 200 outputs a ragged column block of 128.
    # fp32 kernels against fp64 maths on the same inputs: rtol 1e-5, atol 1e-5 (the bias gradient sums 111 rows).
    monkeypatch.setitem(ma.LAUNCH, "block_m", block_m)
    monkeypatch.setitem(ma.LAUNCH, "bwd_block_m", block_m)
    monkeypatch.setitem(ma.LAUNCH, "bwd_rows", bwd_rows)
    n_out = 200
    pre, bias, grad_h = _inputs(37, 2 * n_out if kind == "swiglu" else n_out, n_out, torch.float32)
    ref = _run(ma.bias_activation_torch, pre.double(), bias.double(), grad_h, kind)
    got = _run(ma.bias_activation, pre, bias, grad_h, kind)
    for a, b in zip(got, ref, strict=True):
        torch.testing.assert_close(a.double(), b, rtol=1e-5, atol=1e-5)


@needs_cuda_triton
@pytest.mark.parametrize("kind", ["gelu", "swiglu"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernels_on_cuda(kind, dtype):
    # At DiT-XL/2's MLP width (GELU) and the 0.5B's (SwiGLU), against fp64 maths on the same inputs: fp32 as in the
    # interpreter test; bf16 within a few bf16 ulps (outputs and the gradient of pre are stored in bf16; the
    # bias gradient is summed in fp32 from bf16 products).
    n_out = 4608 if kind == "gelu" else 3584
    pre, bias, grad_h = _inputs(256, 2 * n_out if kind == "swiglu" else n_out, n_out, dtype, device="cuda")
    ref = _run(ma.bias_activation_torch, pre.double(), bias.double(), grad_h, kind)
    got = _run(ma.bias_activation, pre, bias, grad_h, kind)
    for a, b in zip(got, ref, strict=True):
        if dtype == torch.float32:
            torch.testing.assert_close(a.double(), b, rtol=1e-5, atol=1e-4)
        else:
            torch.testing.assert_close(a.double(), b, rtol=2e-2, atol=2e-2 * b.abs().max().item())


@needs_cuda_triton
@pytest.mark.parametrize("mlp", ["gelu", "swiglu"])
def test_compiled_mlp_matches_the_plain_mlp_on_cuda(mlp):
    # The DiT MLP under torch.compile(fullgraph=True) and bf16 autocast, as the trainer runs it: the custom op
    # traces without graph breaks, and output and gradients match the plain MLP's within bf16 tolerance.
    results = []
    for fused in (False, True):
        args = dataclasses.replace(dit_configs["DiT-B/2"], mlp=mlp)
        torch.manual_seed(0)
        mlp_module = FeedForward(args).cuda()
        if fused:
            mlp_module = FusedFeedForward(mlp_module)
        g = torch.Generator(device="cuda").manual_seed(1)
        x = torch.randn(8, 256, args.dim, device="cuda", generator=g, requires_grad=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = torch.compile(mlp_module, fullgraph=True)(x)
        out.float().square().mean().backward()
        results.append([out.float(), x.grad, *(p.grad for p in mlp_module.parameters())])
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(a.float(), b.float(), rtol=3e-2, atol=3e-2 * b.abs().max().item())


def test_cublaslt_refuses_operands_it_cannot_take():
    # cuBLASLt reads raw CUDA pointers: anything else is refused, with its dtype, shape and device, before any call.
    from torchtitan.kernels.cublaslt import gelu_aux_bias, matmul_dgelu

    x, weight, bias = torch.randn(4, 8), torch.randn(16, 8), torch.randn(16)
    with pytest.raises(ValueError, match=r"contiguous CUDA tensors, got torch.float32 \(4, 8\) on cpu"):
        gelu_aux_bias(x, weight, bias)
    with pytest.raises(ValueError, match=r"contiguous CUDA tensors, got torch.float32 \(4, 8\) on cpu"):
        matmul_dgelu(torch.randn(4, 8), torch.randn(8, 16), torch.randn(4, 16))
    assert not ma.gelu_mlp_applies(x, "gelu") and not ma.gelu_mlp_applies(x, "swiglu")


def test_selective_checkpointing_keeps_the_gelu_mlp():
    # Per-op selective checkpointing saves matmul outputs; the GELU MLP (a custom op holding fc1's and fc2's GEMMs) is
    # one of them, as the converter declares, so backward does not run it again.
    from torch.utils.checkpoint import CheckpointPolicy

    from torchtitan.parallelisms.utils import op_policy

    policy = op_policy(apply_fused_mlp(DiT(dit_configs["debug"])))
    assert policy(None, torch.ops.torchditan.gelu_mlp.default) == CheckpointPolicy.MUST_SAVE
    assert policy(None, torch.ops.aten.mm.default) == CheckpointPolicy.MUST_SAVE
    assert policy(None, torch.ops.torchditan.bias_act_fwd.default) == CheckpointPolicy.PREFER_RECOMPUTE
    assert op_policy()(None, torch.ops.torchditan.gelu_mlp.default) == CheckpointPolicy.PREFER_RECOMPUTE


@needs_cuda_triton
@pytest.mark.parametrize("fallback", [False, True])
@pytest.mark.parametrize("dtype,bias_dtype", [(torch.bfloat16, torch.float32), (torch.bfloat16, torch.bfloat16),
                                              (torch.float16, torch.float16)])  # fmt: skip
def test_gelu_mlp_on_cuda(monkeypatch, dtype, bias_dtype, fallback):
    # The MLP as cuBLASLt GEMMs with GELU and its derivative in their epilogues, at DiT-XL/2's width, bf16 or fp16
    # operands, against fp64 maths on the same inputs: within 2% of each result's scale (a few bf16 ulps: h, pre,
    # the gradient of pre and the GEMMs' results are stored in 16 bits). The bias gradients come back in the biases'
    # dtype (fp32 for the fp32 parameters under autocast). `fallback`: as where cuBLASLt has no algorithm, the torch
    # maths.
    from torchtitan.kernels import cublaslt

    def unavailable():
        raise cublaslt._Unavailable("no cuBLASLt in this test")

    if fallback:
        monkeypatch.setattr(cublaslt, "_library", unavailable)
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(2, 256, 1152, device="cuda", generator=g).to(dtype).requires_grad_()
    w1 = (0.03 * torch.randn(4608, 1152, device="cuda", generator=g)).to(dtype).requires_grad_()
    b1 = (0.5 * torch.randn(4608, device="cuda", generator=g)).to(bias_dtype).requires_grad_()
    w2 = (0.015 * torch.randn(1152, 4608, device="cuda", generator=g)).to(dtype).requires_grad_()
    b2 = (0.5 * torch.randn(1152, device="cuda", generator=g)).to(bias_dtype).requires_grad_()
    grad_y = torch.randn(2, 256, 1152, device="cuda", generator=g).to(dtype)
    assert ma.gelu_mlp_applies(x, "gelu") and not ma.gelu_mlp_applies(x.float(), "gelu")
    y = ma.gelu_mlp(x, w1, b1, w2, b2)
    got = [y, *torch.autograd.grad(y, (x, w1, b1, w2, b2), grad_y)]
    assert got[3].dtype == got[5].dtype == bias_dtype
    leaves = [t.detach().double().requires_grad_() for t in (x, w1, b1, w2, b2)]
    h = torch.nn.functional.gelu(leaves[0] @ leaves[1].T + leaves[2], approximate="tanh")
    ref_y = h @ leaves[3].T + leaves[4]
    ref = [ref_y, *torch.autograd.grad(ref_y, leaves, grad_y.double())]
    for name, a, b in zip(("y", "x", "w1", "b1", "w2", "b2"), got, ref, strict=True):
        torch.testing.assert_close(
            a.double(), b, rtol=2e-2, atol=2e-2 * b.abs().max().item(), msg=lambda m, name=name: f"{name}: {m}"
        )


@needs_cuda_triton
def test_weight_grad_on_cuda():
    # gelu_mlp's weight gradients at fc1's shape: 512 rows run as 4 blocks of a batched GEMM with float32 results.
    # Against fp64 maths on the same bf16 values: one rounding to bf16 of a float32 sum, within 2^-8 of each element
    # (atol for float32 accumulation near zero). 510 rows (not a multiple of 4) take the one GEMM as it was.
    g = torch.Generator(device="cuda").manual_seed(0)
    grad = torch.randn(512, 4608, device="cuda", generator=g).bfloat16()
    x = torch.randn(512, 1152, device="cuda", generator=g).bfloat16()
    got = ma._weight_grad(grad, x)
    assert got.dtype == torch.bfloat16 and got.shape == (4608, 1152)
    torch.testing.assert_close(got.double(), grad.double().t() @ x.double(), rtol=2**-8, atol=1e-5)
    assert torch.equal(ma._weight_grad(grad[:510], x[:510]), grad[:510].t() @ x[:510])
