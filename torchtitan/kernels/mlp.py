"""The DiT MLP's bias add and activation as one Triton kernel each way, the backward adding up fc1's bias gradient.

The MLP computes fc2(act(fc1(x))). Compiled, Inductor adds fc1's bias in the GEMM, runs act's backward as one pass
over the (B*T, H) hidden activations, and the bias gradient (a sum over every token) as a second pass that reads
them all again: a sum over rows does not fuse with an elementwise pass. Here fc1 runs as a plain GEMM, without its
bias, and

    h = act(pre + bias)      act: GELU with the tanh approximation (DiT), or SwiGLU: silu(gate) * up, where
                             pre + bias = [gate, up] (the Llama-style flavors)

is one kernel; its backward writes the gradient of pre and, in the same pass, sums of it over runs of rows
(added in torch: deterministic, no atomics), the bias gradient.

The converter `fused_mlp` (kernels/dit_modules.py) puts these in a DiT's MLPs, where `kernel_path_applies(x, fc1)`
(triton_support) allows; tests run the kernels on CPU tensors in Triton's interpreter.

On CUDA in bf16 or fp16, GELU goes one step further (`gelu_mlp`, the whole MLP as one op): fc1's GEMM adds the
bias and applies GELU in its epilogue, writing pre + bias beside h for backward, and in backward fc2's input-gradient
GEMM multiplies by GELU's derivative in its epilogue (cuBLASLt, torchtitan/kernels/cublaslt.py), so no pass over the
hidden activations is left but fc1's bias gradient, a sum over rows.
"""

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.library import triton_op

from torchtitan.kernels.cublaslt import gelu_aux_bias, matmul_dgelu
from torchtitan.kernels.triton_support import autocast_dtype, tl, triton, wrap_triton

ACTIVATIONS = ("gelu", "swiglu")
# Launch settings, forward and backward (bwd_*): columns per program, rows per load, warps, and the rows a backward
# program walks (its bias partial sums cover them; (B*T / bwd_rows, H) float32 partials).
# The backward's small tiles and 2 warps: 12% faster than the forward's settings at DiT-XL/2's width, 10% at the
# 0.5B's (docs/benchmark_log.md, 2026-11-24 late evening).
LAUNCH = {"block_n": 128, "block_m": 32, "warps": 4, "bwd_block_n": 128, "bwd_block_m": 16, "bwd_warps": 2,
          "bwd_rows": 128}  # fmt: skip
# `gelu_mlp`'s two weight gradients, each a sum over every token: the tokens split into this many equal blocks, one
# batched GEMM with a float32 result per block, then added (1 or a count that does not divide the tokens: one GEMM).
# A (4608, 1152) result has too few tiles to fill an H100 well; four blocks of tokens run as one launch do. At
# DiT-XL/2's batch 224 on an H100, 4 blocks were 1.2-1.5% faster a step than one GEMM, 2 and 8 slower or level
# (docs/benchmark_log.md, 2026-11-25 morning).
WGRAD_SPLITS = 4


def activation(h: Tensor, kind: str) -> Tensor:
    """The MLP's activation in torch: GELU-tanh of h, or SwiGLU of h = [gate, up]."""
    if kind == "swiglu":
        gate, up = h.chunk(2, dim=-1)
        return F.silu(gate) * up
    return F.gelu(h, approximate="tanh")


def bias_activation_torch(pre: Tensor, bias: Tensor, kind: str) -> Tensor:
    """The reference maths: act(pre + bias)."""
    return activation(pre + bias, kind)


def gelu_mlp_applies(x: Tensor, kind: str) -> bool:
    """Whether `gelu_mlp` may run the MLP for x: GELU, CUDA, compute in bf16 or fp16 (autocast's or x's)."""
    return kind == "gelu" and x.is_cuda and (autocast_dtype(x) or x.dtype) in (torch.bfloat16, torch.float16)


def gelu_mlp(x: Tensor, w1: Tensor, b1: Tensor, w2: Tensor, b2: Tensor) -> Tensor:
    """fc2(gelu_tanh(fc1(x))) for x (..., D), fc1 = (w1 (H, D), b1), fc2 = (w2 (D, H), b2), by cuBLASLt GEMMs with
    the GELU (forward) and its derivative (backward) in their epilogues (`gelu_mlp_applies` says where).

    Casts x and the weights to autocast's dtype as autocast would (a custom op is not autocast's); the biases stay as
    they are, so their gradients keep their dtypes.
    """
    dtype = autocast_dtype(x) or x.dtype
    y, _, _ = _gelu_mlp(x.reshape(-1, x.shape[-1]).to(dtype), w1.to(dtype), b1, w2.to(dtype), b2)
    return y.view(*x.shape[:-1], w2.shape[0])


@torch.library.custom_op("torchditan::gelu_mlp", mutates_args=(), device_types="cuda")
def _gelu_mlp(x: Tensor, w1: Tensor, b1: Tensor, w2: Tensor, b2: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(y, h, pre + b1) of x (M, D): the output, and the GELU's output and input kept for backward."""
    h, pre = gelu_aux_bias(x.contiguous(), w1.contiguous(), b1.to(x.dtype).contiguous())  # (M, H) each
    return torch.addmm(b2.to(x.dtype), h, w2.t()), h, pre


@_gelu_mlp.register_fake
def _(x, w1, b1, w2, b2):
    hidden = (x.shape[0], w1.shape[0])
    return x.new_empty(x.shape[0], w2.shape[0]), x.new_empty(hidden), x.new_empty(hidden)


def _gelu_mlp_setup_context(ctx, inputs, output):
    x, w1, b1, w2, b2 = inputs
    ctx.save_for_backward(x, w1, w2, output[1], output[2])
    ctx.bias_dtypes = (b1.dtype, b2.dtype)


def _gelu_mlp_backward(ctx, grad_y, _grad_h, _grad_pre):
    x, w1, w2, h, pre = ctx.saved_tensors
    grad_y = grad_y.contiguous()
    grad_pre = _matmul_dgelu(grad_y, w2.contiguous(), pre)  # (M, H): fc2's input gradient through the GELU
    grad_b1 = grad_pre.sum(0, dtype=torch.float32).to(ctx.bias_dtypes[0])
    grad_b2 = grad_y.sum(0, dtype=torch.float32).to(ctx.bias_dtypes[1])
    return grad_pre @ w1, _weight_grad(grad_pre, x), grad_b1, _weight_grad(grad_y, h), grad_b2


_gelu_mlp.register_autograd(_gelu_mlp_backward, setup_context=_gelu_mlp_setup_context)


def _weight_grad(grad: Tensor, x: Tensor) -> Tensor:
    """grad.t() @ x for grad (M, N), x (M, K), in grad's dtype: over WGRAD_SPLITS blocks of rows as one batched GEMM
    with float32 results, added in float32 and rounded once, as the one GEMM's float32 accumulator would be."""
    m, splits = grad.shape[0], WGRAD_SPLITS
    if splits <= 1 or m % splits:
        return grad.t() @ x
    blocks = torch.bmm(grad.reshape(splits, m // splits, -1).transpose(1, 2), x.reshape(splits, m // splits, -1),
                       out_dtype=torch.float32)  # fmt: skip
    return blocks.sum(0).to(grad.dtype)


@torch.library.custom_op("torchditan::matmul_dgelu", mutates_args=(), device_types="cuda")
def _matmul_dgelu(grad: Tensor, weight: Tensor, pre: Tensor) -> Tensor:
    """(grad @ weight) * gelu_tanh'(pre): one cuBLASLt GEMM with the derivative in its epilogue."""
    return matmul_dgelu(grad, weight, pre)


@_matmul_dgelu.register_fake
def _(grad, weight, pre):
    return grad.new_empty(grad.shape[0], weight.shape[1])


def bias_activation(pre: Tensor, bias: Tensor, kind: str) -> Tensor:
    """act(pre + bias) by the kernels, for pre (..., N) (N = 2H for SwiGLU) -> (..., H) in pre's dtype."""
    if kind not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {kind!r}")
    return _bias_act_fwd(pre.contiguous(), bias, kind == "swiglu")


if triton is not None:

    @triton.jit
    def _gelu_tanh(z):
        # tanh(u) = 2 sigmoid(2u) - 1: tl has sigmoid on every backend, the interpreter included.
        u = 0.7978845608028654 * (z + 0.044715 * z * z * z)  # sqrt(2 / pi) (z + 0.044715 z^3)
        t = 2.0 * tl.sigmoid(2.0 * u) - 1.0
        d = 0.5 * (1.0 + t) + 0.5 * z * (1.0 - t * t) * 0.7978845608028654 * (1.0 + 3 * 0.044715 * z * z)
        return 0.5 * z * (1.0 + t), d  # value, derivative

    @triton.jit
    def _bias_act_fwd_kernel(PRE, BIAS, H, M, N_OUT, stride_pre, SWIGLU: tl.constexpr, BLOCK_M: tl.constexpr,
                             BLOCK_N: tl.constexpr):  # fmt: skip
        rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)[:, None]  # (BLOCK_M, 1)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]  # (1, BLOCK_N)
        mask = (rows < M) & (cols < N_OUT)
        z = tl.load(PRE + rows * stride_pre + cols, mask=mask, other=0.0).to(tl.float32)
        z += tl.load(BIAS + cols, mask=cols < N_OUT, other=0.0).to(tl.float32)
        if SWIGLU:  # z is the gate; up sits N_OUT columns on
            up = tl.load(PRE + rows * stride_pre + N_OUT + cols, mask=mask, other=0.0).to(tl.float32)
            up += tl.load(BIAS + N_OUT + cols, mask=cols < N_OUT, other=0.0).to(tl.float32)
            h = z * tl.sigmoid(z) * up
        else:
            h, _ = _gelu_tanh(z)
        tl.store(H + rows * N_OUT + cols, h, mask=mask)

    @triton.jit
    def _bias_act_bwd_kernel(DH, PRE, BIAS, DPRE, PART, M, N_OUT, stride_pre, SWIGLU: tl.constexpr,
                             ROWS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):  # fmt: skip
        # Program (run, column block) walks rows [run * ROWS, (run + 1) * ROWS), BLOCK_M at a time, adding up the
        # gradient of pre over them: one partial sum of the bias gradient per run.
        run = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
        col_mask = cols < N_OUT
        bias = tl.load(BIAS + cols, mask=col_mask, other=0.0).to(tl.float32)
        if SWIGLU:
            bias_up = tl.load(BIAS + N_OUT + cols, mask=col_mask, other=0.0).to(tl.float32)
        acc = tl.zeros([BLOCK_N], tl.float32)
        acc_up = tl.zeros([BLOCK_N], tl.float32)
        for first in range(0, ROWS, BLOCK_M):
            rows = run.to(tl.int64) * ROWS + first + tl.arange(0, BLOCK_M)[:, None]
            mask = (rows < M) & col_mask
            dh = tl.load(DH + rows * N_OUT + cols, mask=mask, other=0.0).to(tl.float32)
            z = tl.load(PRE + rows * stride_pre + cols, mask=mask, other=0.0).to(tl.float32) + bias
            if SWIGLU:
                up = tl.load(PRE + rows * stride_pre + N_OUT + cols, mask=mask, other=0.0).to(tl.float32) + bias_up
                s = tl.sigmoid(z)
                dz = dh * up * s * (1.0 + z * (1.0 - s))  # d silu(z) / dz = s (1 + z (1 - s))
                dup = dh * z * s
                tl.store(DPRE + rows * stride_pre + N_OUT + cols, dup, mask=mask)
                acc_up += tl.sum(dup, axis=0)
            else:
                _, d = _gelu_tanh(z)
                dz = dh * d
            tl.store(DPRE + rows * stride_pre + cols, dz, mask=mask)
            acc += tl.sum(dz, axis=0)
        n_in = stride_pre  # partial rows are as wide as pre: [gate, up] for SwiGLU
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        tl.store(PART + run * n_in + cols, acc, mask=cols < N_OUT)
        if SWIGLU:
            tl.store(PART + run * n_in + N_OUT + cols, acc_up, mask=cols < N_OUT)

    def _widths(pre: Tensor, swiglu: bool) -> tuple[int, int, int]:
        """(columns of pre, columns of the activation, rows) of a (..., N) pre."""
        n_in = pre.shape[-1]
        return n_in, n_in // 2 if swiglu else n_in, pre.numel() // n_in

    @triton_op("torchditan::bias_act_fwd", mutates_args=())
    def _bias_act_fwd(pre: Tensor, bias: Tensor, swiglu: bool) -> Tensor:
        n_in, n_out, m = _widths(pre, swiglu)
        h = pre.new_empty((*pre.shape[:-1], n_out))
        block_m, block_n = LAUNCH["block_m"], LAUNCH["block_n"]
        wrap_triton(_bias_act_fwd_kernel)[(triton.cdiv(m, block_m), triton.cdiv(n_out, block_n))](
            pre, bias, h, m, n_out, n_in, SWIGLU=swiglu, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=LAUNCH["warps"]
        )
        return h

    @triton_op("torchditan::bias_act_bwd", mutates_args=())
    def _bias_act_bwd(grad_h: Tensor, pre: Tensor, bias: Tensor, swiglu: bool) -> tuple[Tensor, Tensor]:
        """(grad of pre, grad of bias)."""
        n_in, n_out, m = _widths(pre, swiglu)
        block_m, block_n, rows = LAUNCH["bwd_block_m"], LAUNCH["bwd_block_n"], LAUNCH["bwd_rows"]
        if rows % block_m:
            raise ValueError(f"kernels.mlp.LAUNCH: bwd_rows {rows} is not a multiple of bwd_block_m {block_m}")
        num_runs = triton.cdiv(m, rows)
        grad_pre = torch.empty_like(pre)
        partial = pre.new_empty((num_runs, n_in), dtype=torch.float32)
        wrap_triton(_bias_act_bwd_kernel)[(num_runs, triton.cdiv(n_out, block_n))](
            grad_h.contiguous(), pre, bias, grad_pre, partial, m, n_out, n_in,
            SWIGLU=swiglu, ROWS=rows, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=LAUNCH["bwd_warps"],
        )  # fmt: skip
        return grad_pre, partial.sum(0).to(bias.dtype)

    def _setup_context(ctx, inputs, output):
        pre, bias, swiglu = inputs
        ctx.swiglu = swiglu
        ctx.save_for_backward(pre, bias)

    def _backward(ctx, grad_h):
        pre, bias = ctx.saved_tensors
        grad_pre, grad_bias = _bias_act_bwd(grad_h, pre, bias, ctx.swiglu)
        return grad_pre, grad_bias, None

    _bias_act_fwd.register_autograd(_backward, setup_context=_setup_context)
