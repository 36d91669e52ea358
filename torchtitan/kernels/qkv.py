"""The attention's qkv Linear, whose backward takes q, k and v's gradients apart and sums the bias gradient in one pass.

Attention reads q, k and v as three views of the qkv Linear's output. Its backward returns their gradients as three
tensors, which autograd stacks into the (B*T, 3D) gradient of the output (one pass over it, compiled by Inductor);
the bias gradient, a sum of that over every token, is a second pass that reads it all again: a sum over rows does
not fuse with an elementwise pass. Here an autograd function owns the Linear and returns q, k and v itself, so its
backward receives the three gradients, and

    grad_qkv = [dq, dk, dv],   grad_bias = sum over rows of grad_qkv

is one Triton kernel (the sums over runs of rows, added in torch: deterministic, no atomics), followed by the
Linear's two GEMMs. The forward is the Linear as before: one GEMM with the bias added in its epilogue.

The converter `fused_qkv` (kernels/dit_modules.py) puts this in a DiT's attention, where `kernel_path_applies`
(triton_support) allows; tests run the kernel on CPU tensors in Triton's interpreter.
"""

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.library import triton_op

from torchtitan.kernels.triton_support import autocast_dtype, tl, triton, wrap_triton

# Launch settings: columns per program, rows per load, rows a program walks (its bias partial sums cover them), warps.
LAUNCH = {"block_n": 128, "block_m": 64, "rows": 256, "num_warps": 4}


def qkv_linear(x: Tensor, weight: Tensor, bias: Tensor, num_heads: int) -> tuple[Tensor, Tensor, Tensor]:
    """F.linear(x, weight, bias) for x (B, T, D) split into q, k, v, each (B, T, nh, hd), by the kernel's backward."""
    return _QKVLinear.apply(x, weight, bias, num_heads)


def qkv_linear_torch(x: Tensor, weight: Tensor, bias: Tensor, num_heads: int) -> tuple[Tensor, Tensor, Tensor]:
    """The reference maths (and the plain Attention's): the same split of F.linear's output."""
    B, T, D = x.shape
    return F.linear(x, weight, bias).view(B, T, 3, num_heads, D // num_heads).unbind(2)


class _QKVLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, num_heads):
        # Autocast would cast the operands inside F.linear; cast them here, so backward's GEMMs get the same ones.
        dtype = autocast_dtype(x)
        if dtype is not None:
            x, weight_c, bias_c = x.to(dtype), weight.to(dtype), bias.to(dtype)
        else:
            weight_c, bias_c = weight, bias
        ctx.save_for_backward(x, weight_c)
        ctx.dtypes = (weight.dtype, bias.dtype)
        with torch.autocast(x.device.type, enabled=False):
            return qkv_linear_torch(x, weight_c, bias_c, num_heads)

    @staticmethod
    def backward(ctx, grad_q, grad_k, grad_v):
        x, weight = ctx.saved_tensors
        B, T, D = x.shape
        dtype = next(g.dtype for g in (grad_q, grad_k, grad_v) if g is not None)
        grads = [
            x.new_zeros(B * T, D, dtype=dtype) if g is None else g.reshape(B * T, D) for g in (grad_q, grad_k, grad_v)
        ]
        grad_out, grad_bias = _qkv_grad(*grads)  # (B*T, 3D), (3D,) float32
        grad_x = grad_weight = None
        if ctx.needs_input_grad[0]:
            grad_x = (grad_out @ weight).view(B, T, D)
        if ctx.needs_input_grad[1]:
            grad_weight = (grad_out.T @ x.reshape(B * T, D)).to(ctx.dtypes[0])  # (3D, D)
        return grad_x, grad_weight, grad_bias.to(ctx.dtypes[1]), None


if triton is not None:

    @triton.jit
    def _qkv_grad_kernel(DQ, DK, DV, OUT, PART, M, D, stride_q, stride_k, stride_v, ROWS: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):  # fmt: skip
        # Program (run, column block, source) copies rows [run * ROWS, (run + 1) * ROWS) of one column block of dq,
        # dk or dv into its place in the (M, 3D) output, adding them up: one partial sum of the bias gradient.
        run, source = tl.program_id(0), tl.program_id(2)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]  # (1, BLOCK_N) within D
        col_mask = cols < D
        if source == 0:
            src, stride = DQ, stride_q
        elif source == 1:
            src, stride = DK, stride_k
        else:
            src, stride = DV, stride_v
        acc = tl.zeros([BLOCK_N], tl.float32)
        for first in range(0, ROWS, BLOCK_M):
            rows = run.to(tl.int64) * ROWS + first + tl.arange(0, BLOCK_M)[:, None]  # (BLOCK_M, 1)
            mask = (rows < M) & col_mask
            g = tl.load(src + rows * stride + cols, mask=mask, other=0.0)
            tl.store(OUT + rows * 3 * D + source * D + cols, g, mask=mask)
            acc += tl.sum(g.to(tl.float32), axis=0)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        tl.store(PART + run * 3 * D + source * D + cols, acc, mask=cols < D)

    @triton_op("torchditan::qkv_grad", mutates_args=())
    def _qkv_grad(grad_q: Tensor, grad_k: Tensor, grad_v: Tensor) -> tuple[Tensor, Tensor]:
        """(M, D) gradients of q, k and v (unit column stride) -> ((M, 3D) gradient of the output, (3D,) sums)."""
        m, d = grad_q.shape
        block_m, block_n, rows = LAUNCH["block_m"], LAUNCH["block_n"], LAUNCH["rows"]
        if rows % block_m:
            raise ValueError(f"kernels.qkv.LAUNCH: rows {rows} is not a multiple of block_m {block_m}")
        grads = [g if g.stride(1) == 1 else g.contiguous() for g in (grad_q, grad_k, grad_v)]
        num_runs = triton.cdiv(m, rows)
        out = grad_q.new_empty((m, 3 * d))
        partial = grad_q.new_empty((num_runs, 3 * d), dtype=torch.float32)
        wrap_triton(_qkv_grad_kernel)[(num_runs, triton.cdiv(d, block_n), 3)](
            *grads,
            out,
            partial,
            m,
            d,
            *(g.stride(0) for g in grads),
            ROWS=rows,
            BLOCK_M=block_m,
            BLOCK_N=block_n,
            num_warps=LAUNCH["num_warps"],
        )
        return out, partial.sum(0)
