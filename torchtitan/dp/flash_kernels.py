"""Per-sample gradient norms of matmul layers without per-sample gradients in memory.

For a layer whose weight gradient is a sum over tokens, the gradient of sample i is
A_i^T G_i with A_i (T, d) the layer input and G_i (T, p) the output gradient. Its squared
Frobenius norm has two forms:

- explicit: ||A_i^T G_i||^2, B T d p multiply-adds, a d x p matrix per sample;
- Gram (the "ghost norm" of Goodfellow, 2015; Li et al., 2021): sum((A_i A_i^T) * (G_i G_i^T)),
  B T^2 (d + p) multiply-adds, a T x T matrix per sample.

The cheaper form is picked per layer by FastDP's rule (Bu et al., 2023): Gram when 2 T^2 < d p.
The Triton kernels below compute either form tile by tile in registers, so neither the d x p
nor the T x T matrix is ever written to memory. Each program writes one partial sum, and the
partials are added in torch, so the result is deterministic (no atomics).

Triton is used on CUDA tensors, and on CPU tensors when Triton runs in its interpreter (tests; see
torchtitan/kernels/triton_support.py). Elsewhere the torch implementations of the same maths below run instead.
"""

import functools
import logging

import torch

from torchtitan.kernels.triton_support import jit as _jit
from torchtitan.kernels.triton_support import tl, triton, triton_interpreting

logger = logging.getLogger(__name__)

# Temporaries of the torch path are bounded to about this many fp32 elements per chunk of samples.
_CHUNK_NUMEL = 1 << 25


def use_gram_form(num_tokens: int, in_features: int, out_features: int) -> bool:
    """FastDP's cost rule: the Gram form is cheaper when 2 T^2 < d p."""
    return 2 * num_tokens * num_tokens < in_features * out_features


def matmul_grad_norm_sq(a: torch.Tensor, g: torch.Tensor, flash: bool) -> torch.Tensor:
    """Per-sample squared norms ||A_i^T G_i||_F^2.

    Args:
        a: (B, T, d) layer inputs.
        g: (B, T, p) output gradients, same dtype as `a`.
        flash: use the Triton kernels where they can run (CUDA, or the interpreter).

    Returns:
        (B,) float32.
    """
    num_tokens, d, p = a.shape[1], a.shape[2], g.shape[2]
    if num_tokens == 1:  # rank one per sample: ||a||^2 ||g||^2
        return a.float().square().sum((1, 2)) * g.float().square().sum((1, 2))
    gram = use_gram_form(num_tokens, d, p)
    if flash:
        if triton is not None and (a.is_cuda or triton_interpreting()):
            return _triton_norm_sq(a, g, gram)
        _log_fallback_once(a.device.type)
    return gram_norm_sq_torch(a, g) if gram else explicit_norm_sq_torch(a, g)


def explicit_norm_sq_torch(a: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """||A_i^T G_i||^2 through the per-sample gradients, a chunk of samples at a time."""
    chunk = max(1, _CHUNK_NUMEL // (a.shape[2] * g.shape[2]))
    out = []
    for a_c, g_c in zip(a.split(chunk), g.split(chunk)):
        per_sample = matmul_float32(a_c.mT, g_c)  # (b, d, p)
        out.append(per_sample.square().sum((1, 2)))
    return torch.cat(out)


def gram_norm_sq_torch(a: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """sum((A_i A_i^T) * (G_i G_i^T)), a chunk of samples at a time."""
    chunk = max(1, _CHUNK_NUMEL // (a.shape[1] * a.shape[1]))
    out = []
    for a_c, g_c in zip(a.split(chunk), g.split(chunk)):
        out.append((matmul_float32(a_c, a_c.mT) * matmul_float32(g_c, g_c.mT)).sum((1, 2)))  # (b, T, T) products
    return torch.cat(out)


def matmul_float32(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """x @ y (2-D, or batched 3-D) as float32, at the matrix units' rate for bf16/fp16 operands on CUDA.

    Upcasting bf16 operands to float32 first would run the products at the far lower fp32 rate (ghost
    clipping's norms were most of its step time that way); instead the operands stay in their dtype and
    the products accumulate in float32, as the flash kernels do, rounded once to float32 (not to the operands'
    dtype and then widened). float32 operands stay float32 (exact tests).
    """
    mm = torch.bmm if x.dim() == 3 else torch.mm
    if x.dtype in (torch.bfloat16, torch.float16) and x.is_cuda:
        if _OUT_DTYPE:
            return mm(x, y, out_dtype=torch.float32)
        return mm(x, y).float()  # older torch: fp32 accumulation, one rounding of each product
    return mm(x.float(), y.float())


# torch >= 2.8 has mm and bmm with a float32 output for bf16/fp16 CUDA operands (aten::mm.dtype, aten::bmm.dtype).
_OUT_DTYPE = hasattr(torch.ops.aten.bmm, "dtype") and hasattr(torch.ops.aten.mm, "dtype")


def scale_samples(t: torch.Tensor, coef: torch.Tensor) -> torch.Tensor:
    """t[i] * coef[i] for each sample i along dim 0, computed in float32 and rounded to t's dtype.

    Book-keeping scales one operand of every weight-gradient matmul by the clipping coefficients. PyTorch's
    broadcast multiply takes its unvectorized path for this shape; one Triton pass over a contiguous t runs
    at memory bandwidth on CUDA. Elsewhere (and for strided t) the torch multiply, same values.
    """
    if triton is None or not (t.is_cuda or triton_interpreting()) or not t.is_contiguous() or t.dim() == 0:
        return (t.float() * coef.float().view(-1, *([1] * (t.dim() - 1)))).to(t.dtype)
    out = torch.empty_like(t)
    sample_numel, coef = t[0].numel(), coef.float().contiguous()
    if out.numel():
        for rows in _sample_chunks(t.shape[0]):  # the samples are the grid's y axis
            t_c = t[rows]
            grid = (triton.cdiv(sample_numel, _SCALE_BLOCK), t_c.shape[0])
            _scale_kernel[grid](t_c, coef[rows], out[rows], sample_numel, _SCALE_BLOCK)
    return out


_SCALE_BLOCK = 4096
_MAX_GRID_YZ = 65535  # CUDA's limit on a grid's y and z axes


def _sample_chunks(num_samples: int) -> list[slice]:
    """Launches of at most 65535 samples each: the kernels here put the samples on the grid's y or z axis."""
    return [slice(start, start + _MAX_GRID_YZ) for start in range(0, num_samples, _MAX_GRID_YZ)]


@_jit
def _scale_kernel(t_ptr, coef_ptr, out_ptr, sample_numel, BLOCK: tl.constexpr):
    # One program: BLOCK elements of sample b.
    b = tl.program_id(1)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < sample_numel
    base = b.to(tl.int64) * sample_numel
    x = tl.load(t_ptr + base + offs, mask=mask)
    c = tl.load(coef_ptr + b)
    tl.store(out_ptr + base + offs, (x.to(tl.float32) * c).to(x.dtype), mask=mask)


@functools.cache
def _log_fallback_once(device_type: str) -> None:
    logger.info(
        "flash DP norms: Triton needs CUDA (or TRITON_INTERPRET=1); using the torch implementation on %s",
        device_type,
    )


@_jit
def _explicit_kernel(
    a_ptr, g_ptr, out_ptr, out_stride, T, D, P, sa_b, sa_t, sa_d, sg_b, sg_t, sg_p,
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_P: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    # One program: sample b, a (BLOCK_D, BLOCK_P) tile of A_b^T G_b accumulated over T in registers. The sample
    # is the slowest grid axis, so the programs running together share one sample's A and G through L2.
    pid_d = tl.program_id(0)
    pid_p = tl.program_id(1)
    b = tl.program_id(2)
    offs_d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    offs_p = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)
    a_base = a_ptr + b.to(tl.int64) * sa_b
    g_base = g_ptr + b.to(tl.int64) * sg_b
    acc = tl.zeros((BLOCK_D, BLOCK_P), dtype=tl.float32)
    for t0 in range(0, T, BLOCK_T):
        offs_t = t0 + tl.arange(0, BLOCK_T)
        a_mask = (offs_d[:, None] < D) & (offs_t[None, :] < T)
        a_t = tl.load(a_base + offs_d[:, None] * sa_d + offs_t[None, :] * sa_t, mask=a_mask, other=0.0)  # (BD, BT)
        g_mask = (offs_t[:, None] < T) & (offs_p[None, :] < P)
        g = tl.load(g_base + offs_t[:, None] * sg_t + offs_p[None, :] * sg_p, mask=g_mask, other=0.0)  # (BT, BP)
        acc = tl.dot(a_t, g, acc, input_precision=PRECISION)
    partial = tl.sum(tl.sum(acc * acc, axis=1), axis=0)
    tl.store(out_ptr + b * out_stride + pid_d * tl.num_programs(1) + pid_p, partial)


@_jit
def _gram_kernel(
    a_ptr, g_ptr, out_ptr, out_stride, T, D, P, sa_b, sa_t, sa_d, sg_b, sg_t, sg_p,
    BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    # One program: sample b, token tiles (i, j) of (A A^T) * (G G^T); the Gram matrices are
    # symmetric, so only j >= i runs and off-diagonal tiles count twice. The sample is the slowest grid
    # axis, as in the explicit kernel.
    pid_i = tl.program_id(0)
    pid_j = tl.program_id(1)
    b = tl.program_id(2)
    if pid_j >= pid_i:
        offs_i = pid_i * BLOCK_T + tl.arange(0, BLOCK_T)
        offs_j = pid_j * BLOCK_T + tl.arange(0, BLOCK_T)
        a_base = a_ptr + b.to(tl.int64) * sa_b
        g_base = g_ptr + b.to(tl.int64) * sg_b
        aa = tl.zeros((BLOCK_T, BLOCK_T), dtype=tl.float32)  # tile (i, j) of A_b A_b^T
        for k0 in range(0, D, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            ai = tl.load(
                a_base + offs_i[:, None] * sa_t + offs_k[None, :] * sa_d,
                mask=(offs_i[:, None] < T) & (offs_k[None, :] < D),
                other=0.0,
            )  # (BT, BK)
            aj_t = tl.load(
                a_base + offs_k[:, None] * sa_d + offs_j[None, :] * sa_t,
                mask=(offs_k[:, None] < D) & (offs_j[None, :] < T),
                other=0.0,
            )  # (BK, BT)
            aa = tl.dot(ai, aj_t, aa, input_precision=PRECISION)
        gg = tl.zeros((BLOCK_T, BLOCK_T), dtype=tl.float32)  # tile (i, j) of G_b G_b^T
        for k0 in range(0, P, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            gi = tl.load(
                g_base + offs_i[:, None] * sg_t + offs_k[None, :] * sg_p,
                mask=(offs_i[:, None] < T) & (offs_k[None, :] < P),
                other=0.0,
            )
            gj_t = tl.load(
                g_base + offs_k[:, None] * sg_p + offs_j[None, :] * sg_t,
                mask=(offs_k[:, None] < P) & (offs_j[None, :] < T),
                other=0.0,
            )
            gg = tl.dot(gi, gj_t, gg, input_precision=PRECISION)
        weight = tl.where(pid_j > pid_i, 2.0, 1.0)
        partial = tl.sum(tl.sum(aa * gg, axis=1), axis=0) * weight
        tl.store(out_ptr + b * out_stride + pid_i * tl.num_programs(1) + pid_j, partial)


# Tile sizes: (BLOCK_D, BLOCK_P, BLOCK_T, warps, stages) and (BLOCK_T, BLOCK_K, warps, stages). The
# interpreter runs the first of each; on CUDA Triton's autotuner picks per (T, D, P). Every entry was timed alone
# at the DiT-L/8 and DiT-XL/2 layer shapes on an H100 (docs/benchmark_log.md).
_EXPLICIT_TILES = [
    (64, 64, 32, 4, 3), (128, 64, 32, 4, 3), (128, 128, 32, 8, 3), (128, 128, 64, 8, 3), (128, 256, 32, 8, 3),
    (256, 128, 32, 8, 3), (128, 128, 64, 4, 4), (128, 256, 64, 8, 3),
]  # fmt: skip
_GRAM_TILES = [(64, 32, 4, 3), (64, 64, 4, 3), (128, 32, 8, 3), (128, 64, 8, 3), (128, 64, 8, 4), (128, 128, 8, 3),
               (64, 128, 4, 3)]  # fmt: skip


@functools.cache
def _launchers() -> tuple:
    if triton_interpreting():
        bd, bp, bt = _EXPLICIT_TILES[0][:3]
        explicit = functools.partial(_explicit_kernel.run, BLOCK_D=bd, BLOCK_P=bp, BLOCK_T=bt)
        gram = functools.partial(_gram_kernel.run, BLOCK_T=_GRAM_TILES[0][0], BLOCK_K=_GRAM_TILES[0][1])
        return explicit, gram
    # reset_to_zero: every config the tuner tries writes its own partials layout into one buffer.
    explicit = triton.autotune(
        [triton.Config({"BLOCK_D": d, "BLOCK_P": p, "BLOCK_T": t}, num_warps=w, num_stages=s)
         for d, p, t, w, s in _EXPLICIT_TILES],
        key=["T", "D", "P"], reset_to_zero=["out_ptr"],
    )(_explicit_kernel)  # fmt: skip
    gram = triton.autotune(
        [triton.Config({"BLOCK_T": t, "BLOCK_K": k}, num_warps=w, num_stages=s) for t, k, w, s in _GRAM_TILES],
        key=["T", "D", "P"], reset_to_zero=["out_ptr"],
    )(_gram_kernel)  # fmt: skip
    return explicit.run, gram.run


def _triton_norm_sq(a: torch.Tensor, g: torch.Tensor, gram: bool) -> torch.Tensor:
    if g.dtype != a.dtype:
        g = g.to(a.dtype)
    B, T, D = a.shape
    P = g.shape[2]
    fp32_exact = a.dtype == torch.float32 and not torch.backends.cuda.matmul.allow_tf32
    precision = "ieee" if fp32_exact or not a.is_cuda else "tf32"
    explicit, gram_kernel = _launchers()
    if gram:
        # Partials: one per (i, j) token tile; the smallest tile sizes the buffer, others use part of it.
        n_t = triton.cdiv(T, min(t for t, *_ in _GRAM_TILES))
        partials = torch.zeros(B, n_t * n_t, device=a.device, dtype=torch.float32)
        launch = gram_kernel

        def tiles(meta):
            return triton.cdiv(T, meta["BLOCK_T"]), triton.cdiv(T, meta["BLOCK_T"])
    else:
        n_d = triton.cdiv(D, min(d for d, *_ in _EXPLICIT_TILES))
        n_p = triton.cdiv(P, min(p for _, p, *_ in _EXPLICIT_TILES))
        partials = torch.zeros(B, n_d * n_p, device=a.device, dtype=torch.float32)
        launch = explicit

        def tiles(meta):
            return triton.cdiv(D, meta["BLOCK_D"]), triton.cdiv(P, meta["BLOCK_P"])

    for rows in _sample_chunks(B):  # the samples are the grid's z axis
        a_c, g_c, out = a[rows], g[rows], partials[rows]
        args = (a_c, g_c, out, out.stride(0), T, D, P, *a_c.stride(), *g_c.stride())
        launch(*args, grid=lambda meta, n=a_c.shape[0]: (*tiles(meta), n), warmup=False, PRECISION=precision)
    return partials.sum(1)
