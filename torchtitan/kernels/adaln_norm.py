"""adaLN's modulated norm, optionally after a gated residual add, as one Triton kernel each way.

Every norm of a DiT block computes, per token,

    x' = x + gate * branch                    (the gated residual add that ends the previous branch, if any)
    h  = norm(x') * (1 + scale) + shift       (LayerNorm or RMSNorm without affine weights; adaLN, DiT paper)

with gate, shift and scale one (D,) vector per sample. Inductor compiles the forward into one kernel that reads
each row twice (D = 1152 is over the 1024 elements it keeps in registers), and the backward into four passes over
(B, T, D): the norm's input gradient, the per-sample sums over tokens for shift and scale, and the gate's. Here the
forward reads x and branch once and the backward reads each of its four (B, T, D) inputs once: a program keeps one
row in registers, and walks a run of one sample's tokens adding the shift, scale and gate gradients up as it goes
(partial sums per run, added in torch: deterministic, no atomics).

`modulated_norm` runs the kernels where Triton runs (CUDA tensors, or CPU ones in Triton's interpreter: tests) and the
same maths in torch elsewhere. The converter `fused_norm` (kernels/dit_modules.py) puts it in a DiT's blocks.
"""

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.library import triton_op

from torchtitan.kernels.triton_support import tl, triton, triton_runs, wrap_triton

# A row stays in registers; past this width the torch path runs instead.
MAX_FUSED_DIM = 8192
# Launch settings, read when a kernel is launched (or traced): warps per program of each kernel (0: by row width),
# the tokens of one sample a backward program walks (its shift/scale/gate partial sums cover them), and how many
# of those rows it loads at once. scripts/benchmarks/benchmark_adaln_norm.py compares settings; on an H100, 32 rows two
# at a time were the fastest measured: the backward 11% faster than 16 rows one at a time at DiT-XL/2's
# (128, 256, 1152), 9% at the 0.5B's (32, 1024, 1280) (docs/benchmark_log.md, 2026-11-24 late evening).
LAUNCH = {"fwd_warps": 0, "bwd_warps": 0, "bwd_rows": 32, "bwd_tile": 2}


def modulated_norm_torch(x, shift, scale, branch, gate, kind: str, eps: float):
    """The reference maths: (x', h) with x' = x + gate * branch (x itself without a branch)."""
    if branch is not None:
        x = x + gate.unsqueeze(1) * branch
    normed = F.layer_norm(x, x.shape[-1:], eps=eps) if kind == "layernorm" else F.rms_norm(x, x.shape[-1:], eps=eps)
    return x, normed * (1 + scale.unsqueeze(1)) + shift.unsqueeze(1)


def modulated_norm(x, shift, scale, branch=None, gate=None, *, kind: str = "layernorm", eps: float = 1e-6,
                   save_output: bool = False):  # fmt: skip
    """x' = x + gate * branch, h = norm(x') * (1 + scale) + shift.

    Args:
        x: (B, T, D) residual stream.
        shift, scale: (B, D) modulation of this norm.
        branch, gate: (B, T, D) and (B, D), the previous branch's output and gate; None for a plain norm.
        kind: "layernorm" or "rmsnorm", neither with affine weights.
        save_output: the kernels keep x' for backward instead of x (and do not recompute x'): right where nothing
            else keeps x but the next norm keeps x' (a block's norm1, handed the previous block's residual apart).

    Returns:
        (x', h): x' in the promoted dtype of x, gate and branch (x itself without a branch); h in x''s dtype from
        the kernels, and in float32 from the torch path under autocast (LayerNorm's autocast policy), which the
        next Linear casts to bf16 alike.
    """
    # The Triton kernels where they run (rows up to MAX_FUSED_DIM wide); torch otherwise.
    if triton_runs(x) and x.shape[-1] <= MAX_FUSED_DIM:
        return modulated_norm_triton(x, shift, scale, branch, gate, kind, eps, save_output)
    return modulated_norm_torch(x, shift, scale, branch, gate, kind, eps)


def modulated_norm_triton(x, shift, scale, branch, gate, kind: str, eps: float, save_output: bool = False):
    """The Triton kernels on any device they can run on: CUDA, or CPU in the interpreter (tests)."""
    if branch is not None:  # the op's tensors, kept for backward too, as the kernels read them: contiguous, one dtype
        dtype = torch.promote_types(x.dtype, torch.promote_types(branch.dtype, gate.dtype))
        x, branch = x.to(dtype), branch.to(dtype).contiguous()
    x_new, h, _, _ = _modulated_norm_fwd(x.contiguous(), shift, scale, branch, gate, kind == "rmsnorm", eps,
                                         save_output)  # fmt: skip
    return (x if branch is None else x_new), h


def _row_config(dim: int, warps: int) -> tuple[int, int]:
    """(BLOCK_D, num_warps) for a row of `dim` elements; `warps` 0 picks by width."""
    block = triton.next_power_of_2(dim)
    return block, warps or max(1, min(16, block // 512))


if triton is not None:

    @triton.jit
    def _fwd_kernel(X, BR, G, SH, SC, XN, H, MEAN, RSTD, T, D, stride_g, stride_sh, stride_sc, eps,
                    HAS_RES: tl.constexpr, RMS: tl.constexpr, BLOCK_D: tl.constexpr):  # fmt: skip
        row = tl.program_id(0).to(tl.int64)
        b = row // T
        cols = tl.arange(0, BLOCK_D)
        mask = cols < D
        x = tl.load(X + row * D + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_RES:
            branch = tl.load(BR + row * D + cols, mask=mask, other=0.0).to(tl.float32)
            gate = tl.load(G + b * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
            x = (x + gate * branch).to(XN.dtype.element_ty)  # rounded as stored; backward recomputes it alike
            tl.store(XN + row * D + cols, x, mask=mask)
            x = x.to(tl.float32)
        if RMS:
            mean = tl.full([], 0.0, tl.float32)
        else:
            mean = tl.sum(x, axis=0) / D
        centred = tl.where(mask, x - mean, 0.0)
        rstd = 1.0 / tl.sqrt(tl.sum(centred * centred, axis=0) / D + eps)
        shift = tl.load(SH + b * stride_sh + cols, mask=mask, other=0.0).to(tl.float32)
        scale = tl.load(SC + b * stride_sc + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(H + row * D + cols, centred * rstd * (1.0 + scale) + shift, mask=mask)
        tl.store(MEAN + row, mean)
        tl.store(RSTD + row, rstd)

    @triton.jit
    def _bwd_kernel(DH, DOUT, X, SC, MEAN, RSTD, BR, G, DX, DBR, PART, T, D, num_runs, stride_sc, stride_g,
                    HAS_DOUT: tl.constexpr, HAS_RES: tl.constexpr, RECOMPUTE: tl.constexpr, RMS: tl.constexpr,
                    ROWS: tl.constexpr, TILE: tl.constexpr, BLOCK_D: tl.constexpr):  # fmt: skip
        # X holds x, from which x' is recomputed (RECOMPUTE), or x' itself.
        # Program (b, run) walks tokens [run * ROWS, (run + 1) * ROWS) of sample b, TILE rows at a time: the loads
        # of a tile go out together, which keeps enough bytes in flight per SM to reach memory bandwidth.
        b = tl.program_id(0).to(tl.int64)
        run = tl.program_id(1)
        cols = tl.arange(0, BLOCK_D)[None, :]  # (1, BLOCK_D)
        col_mask = cols < D
        scale = tl.load(SC + b * stride_sc + cols, mask=col_mask, other=0.0).to(tl.float32)
        if HAS_RES:
            gate = tl.load(G + b * stride_g + cols, mask=col_mask, other=0.0).to(tl.float32)
        acc_shift = tl.zeros([BLOCK_D], tl.float32)
        acc_scale = tl.zeros([BLOCK_D], tl.float32)
        acc_gate = tl.zeros([BLOCK_D], tl.float32)
        for first in range(0, ROWS, TILE):
            t = run * ROWS + first + tl.arange(0, TILE)[:, None]  # (TILE, 1)
            mask = col_mask & (t < T)
            offsets = (b * T + t) * D + cols  # (TILE, BLOCK_D)
            dh = tl.load(DH + offsets, mask=mask, other=0.0).to(tl.float32)
            x = tl.load(X + offsets, mask=mask, other=0.0).to(tl.float32)
            if HAS_DOUT:
                dout = tl.load(DOUT + offsets, mask=mask, other=0.0).to(tl.float32)
            if HAS_RES:
                branch = tl.load(BR + offsets, mask=mask, other=0.0).to(tl.float32)
                if RECOMPUTE:  # x' again, rounded as the forward stored it: cheaper than keeping it for backward
                    x = (x + gate * branch).to(DX.dtype.element_ty).to(tl.float32)
            mean = tl.load(MEAN + b * T + t, mask=t < T, other=0.0)
            rstd = tl.load(RSTD + b * T + t, mask=t < T, other=0.0)
            xhat = tl.where(mask, (x - mean) * rstd, 0.0)
            acc_shift += tl.sum(dh, axis=0)
            acc_scale += tl.sum(dh * xhat, axis=0)
            dxhat = dh * (1.0 + scale)
            dx = dxhat - xhat * (tl.sum(dxhat * xhat, axis=1)[:, None] / D)
            if not RMS:
                dx -= tl.sum(dxhat, axis=1)[:, None] / D
            dx *= rstd
            if HAS_DOUT:
                dx += dout
            tl.store(DX + offsets, dx, mask=mask)
            if HAS_RES:
                tl.store(DBR + offsets, dx * gate, mask=mask)
                acc_gate += tl.sum(dx * branch, axis=0)
        cols = tl.arange(0, BLOCK_D)
        part = (b * num_runs + run) * D + cols
        plane = tl.num_programs(0).to(tl.int64) * num_runs * D
        tl.store(PART + part, acc_shift, mask=cols < D)
        tl.store(PART + plane + part, acc_scale, mask=cols < D)
        if HAS_RES:
            tl.store(PART + 2 * plane + part, acc_gate, mask=cols < D)

    @triton_op("torchditan::modulated_norm_fwd", mutates_args=())
    def _modulated_norm_fwd(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, branch: torch.Tensor | None,
                            gate: torch.Tensor | None, rms: bool, eps: float, save_output: bool = False
                            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
        """(x', h, mean, rstd); x' is empty without a branch. mean and rstd are (B, T) float32. save_output only
        tells backward what was kept (see modulated_norm)."""
        B, T, D = x.shape
        has_res = branch is not None
        x_new = torch.empty_like(x) if has_res else x.new_empty(0)
        h = torch.empty_like(x)
        mean = x.new_empty((B, T), dtype=torch.float32)
        rstd = x.new_empty((B, T), dtype=torch.float32)
        block, warps = _row_config(D, LAUNCH["fwd_warps"])
        res_args = (branch, gate, x_new) if has_res else (x, x, x)  # unread without HAS_RES
        wrap_triton(_fwd_kernel)[(B * T,)](
            x, res_args[0], res_args[1], shift, scale, res_args[2], h, mean, rstd, T, D,
            gate.stride(0) if has_res else 0, shift.stride(0), scale.stride(0), eps,
            HAS_RES=has_res, RMS=rms, BLOCK_D=block, num_warps=warps,
        )  # fmt: skip
        return x_new, h, mean, rstd

    @triton_op("torchditan::modulated_norm_bwd", mutates_args=())
    def _modulated_norm_bwd(grad_h: torch.Tensor, grad_x_new: torch.Tensor | None, x: torch.Tensor,
                            scale: torch.Tensor, mean: torch.Tensor, rstd: torch.Tensor, branch: torch.Tensor | None,
                            gate: torch.Tensor | None, rms: bool, recompute: bool = True
                            ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
        """(grad x, grad shift, grad scale, grad branch, grad gate); the last two empty without a branch.
        x is the forward's x (x' recomputed from it with the branch) or, with recompute False, x' itself."""
        B, T, D = x.shape
        has_res, has_dout = branch is not None, grad_x_new is not None
        rows, tile = LAUNCH["bwd_rows"], LAUNCH["bwd_tile"]
        if rows % tile:
            raise ValueError(f"kernels.adaln_norm.LAUNCH: bwd_rows {rows} is not a multiple of bwd_tile {tile}")
        num_runs = triton.cdiv(T, rows)
        grad_x = torch.empty_like(x)
        grad_branch = torch.empty_like(x) if has_res else x.new_empty(0)
        partial = x.new_empty((3 if has_res else 2, B, num_runs, D), dtype=torch.float32)
        block, warps = _row_config(D, LAUNCH["bwd_warps"])
        wrap_triton(_bwd_kernel)[(B, num_runs)](
            grad_h.contiguous(), grad_x_new.contiguous() if has_dout else x, x, scale, mean, rstd,
            branch if has_res else x, gate if has_res else scale, grad_x, grad_branch, partial,
            T, D, num_runs, scale.stride(0), gate.stride(0) if has_res else 0,
            HAS_DOUT=has_dout, HAS_RES=has_res, RECOMPUTE=recompute, RMS=rms, ROWS=rows, TILE=tile,
            BLOCK_D=block, num_warps=warps,
        )  # fmt: skip
        # One sum per output: returns of a custom op may not alias each other.
        grad_shift, grad_scale = (partial[i].sum(1).to(scale.dtype) for i in range(2))  # (B, D) each
        grad_gate = partial[2].sum(1).to(gate.dtype) if has_res else scale.new_empty(0)
        return grad_x, grad_shift, grad_scale, grad_branch, grad_gate

    def _setup_context(ctx, inputs, output):
        x, shift, scale, branch, gate, rms, eps, save_output = inputs
        x_new, _, mean, rstd = output
        ctx.rms = rms
        ctx.has_res = branch is not None
        # By default x, not x': backward recomputes x' from x and the branch it reads anyway, so x' need not be kept.
        ctx.recompute = not (save_output and ctx.has_res)
        ctx.save_for_backward(x if ctx.recompute else x_new, scale, mean, rstd, branch, gate)

    def _backward(ctx, grad_x_new, grad_h, grad_mean, grad_rstd):
        x, scale, mean, rstd, branch, gate = ctx.saved_tensors
        grad_out = grad_x_new if ctx.has_res else None
        grad_x, grad_shift, grad_scale, grad_branch, grad_gate = _modulated_norm_bwd(
            grad_h, grad_out, x, scale, mean, rstd, branch, gate, ctx.rms, ctx.recompute
        )
        if not ctx.has_res:
            return grad_x, grad_shift, grad_scale, None, None, None, None, None
        return grad_x, grad_shift, grad_scale, grad_branch, grad_gate, None, None, None

    _modulated_norm_fwd.register_autograd(_backward, setup_context=_setup_context)
