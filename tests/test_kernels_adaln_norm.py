"""The fused adaLN norm kernels (Triton; its CPU interpreter here, compiled on CUDA) against the torch maths.

As in test_dp_flash_kernels.py, the interpreter tests run in a TRITON_INTERPRET=1 child process of
`test_kernels_in_interpreter`: triton picks the interpreter when it is first imported.
"""

import pytest
import torch

from tests.conftest import needs_cuda_triton, needs_interpreter
from torchtitan.kernels import adaln_norm as an
from torchtitan.kernels.dit_modules import FusedNormDiTBlock, ResidualStream
from torchtitan.kernels.triton_support import triton_interpreting
from torchtitan.models.dit import dit_configs
from torchtitan.models.dit.model import DiTBlock

pytestmark = pytest.mark.skipif(an.triton is None, reason="triton is not installed")


def _inputs(B, T, D, dtype, device="cpu", seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(B, T, D, device=device, generator=g).to(dtype)
    branch = torch.randn(B, T, D, device=device, generator=g).to(dtype)
    modulation = (0.5 * torch.randn(B, 6 * D, device=device, generator=g)).to(dtype)  # as adaLN's Linear output
    grads = [torch.randn(B, T, D, device=device, generator=g).to(dtype) for _ in range(2)]  # for x' and h
    return x, branch, modulation, grads


def _run(fn, x, branch, modulation, grads, residual, use_grad_x_new, kind):
    """Outputs (x', h) and the gradients of <x', grad_x'> + <h, grad_h> for x, the modulation and the branch."""
    x, branch, modulation = (t.detach().requires_grad_() for t in (x, branch, modulation))
    D = x.shape[-1]
    shift, scale, gate = modulation[:, :D], modulation[:, D : 2 * D], modulation[:, 2 * D : 3 * D]  # strided views
    x_new, h = fn(x, shift, scale, branch if residual else None, gate if residual else None, kind, 1e-6)
    loss = (h.float() * grads[1].float()).sum()
    if residual and use_grad_x_new:
        loss = loss + (x_new.float() * grads[0].float()).sum()
    inputs = [x, modulation] + ([branch] if residual else [])
    return [x_new, h, *torch.autograd.grad(loss, inputs)]


@needs_interpreter
@pytest.mark.parametrize("kind", ["layernorm", "rmsnorm"])
@pytest.mark.parametrize(
    "residual,use_grad_x_new,save_output", [(False, False, False), (True, False, False), (True, True, False),
                                            (True, True, True)]
)  # fmt: skip
@pytest.mark.parametrize("rows,tile", [(32, 2), (8, 4)])
def test_kernels_match_torch(monkeypatch, kind, residual, use_grad_x_new, save_output, rows, tile):
    # B = 2: each sample its own modulation row, at a stride. T = 37 leaves a ragged last run of tokens (and a ragged
    # tile); D = 48 a masked row (block of 64). save_output: backward reads the kept x' instead of recomputing it.
    monkeypatch.setitem(an.LAUNCH, "bwd_rows", rows)
    monkeypatch.setitem(an.LAUNCH, "bwd_tile", tile)
    args = _inputs(2, 37, 48, torch.float32)
    ref = _run(an.modulated_norm_torch, *[t.double() if torch.is_tensor(t) else t for t in args[:3]],
               [g.double() for g in args[3]], residual, use_grad_x_new, kind)  # fmt: skip

    def kernels(*tensors):
        return an.modulated_norm_triton(*tensors, save_output=save_output)

    got = _run(kernels, *args, residual, use_grad_x_new, kind)
    # fp32 kernels against fp64 maths on the same inputs: sums of 37 tokens and 48 features.
    for a, b in zip(got, ref, strict=True):
        torch.testing.assert_close(a.double(), b, rtol=1e-4, atol=1e-5)


@needs_interpreter
def test_bf16_matches_torch_in_fp32():
    # bf16 storage, fp32 maths: against the torch maths in fp32 on the same (bf16-exact) values, one bf16 rounding
    # of each output apart; the residual sum is rounded to bf16 before the norm in both. The interpreter casts
    # fp32 to bf16 by truncation (CUDA rounds to nearest), so x' may be one bf16 ulp (2^-7 relative) off.
    x, branch, modulation, grads = _inputs(2, 20, 40, torch.bfloat16)
    got = _run(an.modulated_norm_triton, x, branch, modulation, grads, True, True, "layernorm")
    x_new_ref = (x.float() + modulation[:, 80:120].float().unsqueeze(1) * branch.float()).bfloat16()
    ref = _run(an.modulated_norm_torch, x_new_ref.float(), branch.float(), modulation.float(),
               [g.float() for g in grads], False, False, "layernorm")  # fmt: skip
    torch.testing.assert_close(got[0].float(), x_new_ref.float(), rtol=2**-7, atol=0)
    torch.testing.assert_close(got[1].float(), ref[1], rtol=1.6e-2, atol=1e-2)


@pytest.mark.skipif(triton_interpreting(), reason="the interpreter runs CPU tensors through the kernels")
def test_cpu_tensors_take_the_torch_path(monkeypatch):
    def fail(*args):
        raise AssertionError("Triton path on CPU tensors")

    monkeypatch.setattr(an, "modulated_norm_triton", fail)
    x, branch, modulation, _ = _inputs(2, 4, 8, torch.float32)
    x_new, h = an.modulated_norm(x, modulation[:, :8], modulation[:, 8:16], branch, modulation[:, 16:24])
    expected = an.modulated_norm_torch(x, modulation[:, :8], modulation[:, 8:16], branch, modulation[:, 16:24],
                                       "layernorm", 1e-6)  # fmt: skip
    assert torch.equal(x_new, expected[0]) and torch.equal(h, expected[1])


@needs_cuda_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["layernorm", "rmsnorm"])
@pytest.mark.parametrize("rows,tile", [(32, 2), (16, 1), (16, 4)])
def test_compiled_kernels_on_cuda(monkeypatch, dtype, kind, rows, tile):
    # DiT-XL/2's width and a ragged token count; fp64 maths on the same inputs as the reference.
    monkeypatch.setitem(an.LAUNCH, "bwd_rows", rows)
    monkeypatch.setitem(an.LAUNCH, "bwd_tile", tile)
    args = _inputs(4, 257, 1152, dtype, device="cuda")
    ref = _run(an.modulated_norm_torch, *[t.double() for t in args[:3]], [g.double() for g in args[3]],
               True, True, kind)  # fmt: skip
    got = _run(an.modulated_norm_triton, *args, True, True, kind)
    for a, b in zip(got, ref, strict=True):
        if dtype == torch.float32:
            torch.testing.assert_close(a.double(), b, rtol=1e-4, atol=1e-4)
        else:  # bf16 outputs, and x' rounded to bf16 before the norm: a few bf16 ulps of the largest value
            torch.testing.assert_close(a.double(), b, rtol=2e-2, atol=2e-2 * b.abs().max().item())


@needs_cuda_triton
def test_compiled_block_matches_the_plain_block_on_cuda():
    # A DiT-B/2-wide block under torch.compile(fullgraph=True): the custom ops trace without graph breaks, and the
    # fused block's output and gradients match the plain block's (bf16 autocast, as the trainer runs), with the
    # previous block's residual handed in parts (norm1 keeps x') and whole (the first block).
    results = []
    for fused in (False, True):
        torch.manual_seed(0)
        block = DiTBlock(dit_configs["DiT-B/2"]).cuda()
        torch.nn.init.normal_(block.adaLN_modulation[-1].weight, std=0.05)
        if fused:
            block = FusedNormDiTBlock(block, finish_residual=False)
        compiled = torch.compile(block, fullgraph=True)
        g = torch.Generator(device="cuda").manual_seed(1)
        dim = block.adaLN_modulation[-1].in_features
        x = torch.randn(8, 256, dim, device="cuda", generator=g, requires_grad=True)
        c = torch.randn(8, dim, device="cuda", generator=g)
        branch = torch.randn(8, 256, dim, device="cuda", generator=g, requires_grad=True)
        gate = (0.5 * torch.randn(8, dim, device="cuda", generator=g)).requires_grad_()
        outs = []
        with torch.autocast("cuda", dtype=torch.bfloat16):
            for handed in (x, ResidualStream(x, branch, gate)):
                if not fused and isinstance(handed, ResidualStream):  # the plain block gets the stream summed
                    handed = x + gate.unsqueeze(1) * branch
                out = compiled(handed, c, None, None)
                outs.append(out.x + out.gate.unsqueeze(1) * out.branch if fused else out)
        sum(out.float().square().mean() for out in outs).backward()
        grads = [x.grad, branch.grad, gate.grad, *(p.grad for p in block.parameters())]
        results.append([*(out.float() for out in outs), *grads])
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(a.float(), b.float(), rtol=3e-2, atol=3e-2)
