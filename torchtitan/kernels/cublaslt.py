"""cuBLASLt matmuls with GELU epilogues, called through ctypes: the MLP's GELU inside its GEMMs, both ways.

PyTorch exposes cuBLASLt's bias + GELU epilogue only without the auxiliary output that training needs
(`torch._addmm_activation`), and not its GELU-gradient epilogue. Here

    gelu_aux_bias(x, w, b)    h = gelu_tanh(x w^T + b), and pre = x w^T + b kept for backward   (GELU_AUX_BIAS)
    matmul_dgelu(g, w, pre)   (g w) * gelu_tanh'(pre): fc2's input gradient taken back through the GELU   (DGELU)

apply the activation, or its derivative, while the GEMM stores its tiles, instead of a second pass over the
(tokens, hidden) activations. cuBLAS's GELU is the tanh approximation (DiT's). The library is the one torch loaded;
nothing is built. DGELU_BGRAD, which would also sum the bias gradient, is not used: on an H100 cuBLASLt ran that sum
as a separate kernel, slower than the GEMM (docs/benchmark_log.md, 2026-11-24, night).

Row-major (M, N) = x (M, K) w^T is, to column-major cuBLAS, D (N, M) = op(w) (N, K) x^T (K, M) with op = transpose:
the epilogue's bias has one value per row of D, i.e. per output feature. Row-major g (M, K) w (K, N) is
D (N, M) = w^T (N, K) g^T (K, M), neither transposed: the auxiliary input pre is laid out as D.
"""

import ctypes
import threading

import torch
from torch import Tensor

from torchtitan.tools.logging import logger

# cublasLt.h / library_types.h (CUDA 12 and 13)
_COMPUTE_32F, _R_32F, _R_16BF, _R_16F = 68, 0, 14, 2
_OP_N, _OP_T = 0, 1
_DESC_TRANSA, _DESC_TRANSB, _DESC_EPILOGUE, _DESC_BIAS_POINTER = 3, 4, 7, 8
_DESC_AUX_POINTER, _DESC_AUX_LD, _DESC_BIAS_DATA_TYPE = 11, 12, 26
_PREF_MAX_WORKSPACE_BYTES = 1
_EPILOGUE_GELU_AUX_BIAS, _EPILOGUE_DGELU = 32 | 128 | 4, 64 | 128
_WORKSPACE_BYTES = 32 * 1024 * 1024
_ALIGNMENT = 256  # bytes: what the heuristic assumes of the operands' pointers unless told otherwise
_DTYPES = {torch.bfloat16: _R_16BF, torch.float16: _R_16F}


class _Unavailable(RuntimeError):
    """cuBLASLt is not loaded, or has no algorithm for this GEMM and epilogue."""


class _HeuristicResult(ctypes.Structure):
    _fields_ = [("algo", ctypes.c_uint64 * 8), ("workspace_size", ctypes.c_size_t), ("state", ctypes.c_int),
                ("waves_count", ctypes.c_float), ("reserved", ctypes.c_int * 4)]  # fmt: skip


class _CublasLt:
    """The loaded library, one handle, workspaces per device, and a plan (descriptors and algorithm) per shape."""

    def __init__(self):
        torch.cuda.current_blas_handle()  # makes torch load cuBLAS, and with it cuBLASLt
        try:  # the copy torch loaded, found by its path (Linux)
            with open("/proc/self/maps") as maps:
                paths = {line.split()[-1] for line in maps if "libcublasLt.so" in line}
        except OSError as e:
            raise _Unavailable(f"cannot list this process's libraries ({e})") from e
        if not paths:
            raise _Unavailable("cuBLASLt is not loaded in this process (torch was built without it?)")
        lib = ctypes.CDLL(sorted(paths)[0])
        vp, i64, u64 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_uint64
        signatures = {
            "cublasLtCreate": [ctypes.POINTER(vp)],
            "cublasLtMatmulDescCreate": [ctypes.POINTER(vp), ctypes.c_int, ctypes.c_int],
            "cublasLtMatmulDescSetAttribute": [vp, ctypes.c_int, vp, ctypes.c_size_t],
            "cublasLtMatrixLayoutCreate": [ctypes.POINTER(vp), ctypes.c_int, u64, u64, i64],
            "cublasLtMatmulPreferenceCreate": [ctypes.POINTER(vp)],
            "cublasLtMatmulPreferenceSetAttribute": [vp, ctypes.c_int, vp, ctypes.c_size_t],
            "cublasLtMatmulAlgoGetHeuristic": [vp, vp, vp, vp, vp, vp, vp, ctypes.c_int,
                                               ctypes.POINTER(_HeuristicResult), ctypes.POINTER(ctypes.c_int)],
            "cublasLtMatmul": [vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, ctypes.c_size_t, vp],
        }  # fmt: skip
        for name, argtypes in signatures.items():
            getattr(lib, name).argtypes, getattr(lib, name).restype = argtypes, ctypes.c_int
        self.lib, self.plans, self.workspaces = lib, {}, {}
        self.handle = vp()
        self.check(lib.cublasLtCreate(ctypes.byref(self.handle)), "cublasLtCreate")
        self.one, self.zero = ctypes.c_float(1.0), ctypes.c_float(0.0)

    @staticmethod
    def check(status: int, what: str) -> None:
        if status != 0:
            raise RuntimeError(f"{what} failed with cuBLAS status {status}")

    def _set(self, desc, attribute: int, value) -> None:
        self.check(self.lib.cublasLtMatmulDescSetAttribute(desc, attribute, ctypes.byref(value), ctypes.sizeof(value)),
                   f"cublasLtMatmulDescSetAttribute({attribute})")  # fmt: skip

    def _layout(self, dtype: int, rows: int, cols: int, ld: int):
        layout = ctypes.c_void_p()
        self.check(self.lib.cublasLtMatrixLayoutCreate(ctypes.byref(layout), dtype, rows, cols, ld), "layout")
        return layout

    def plan(self, key: tuple, trans_a: int, a_shape: tuple, b_shape: tuple, d_shape: tuple, dtype: int,
             epilogue: int, bias: Tensor | None, aux: Tensor):  # fmt: skip
        """Descriptors and the heuristic's first algorithm for column-major D (d_shape) = op(A) B, cached by key
        (as is the lack of one)."""
        if isinstance(self.plans.get(key), str):
            raise _Unavailable(self.plans[key])
        if key not in self.plans:
            desc = ctypes.c_void_p()
            self.check(self.lib.cublasLtMatmulDescCreate(ctypes.byref(desc), _COMPUTE_32F, _R_32F), "desc")
            self._set(desc, _DESC_TRANSA, ctypes.c_int(trans_a))
            self._set(desc, _DESC_TRANSB, ctypes.c_int(_OP_N))
            self._set(desc, _DESC_EPILOGUE, ctypes.c_uint32(epilogue))
            if bias is not None:
                self._set(desc, _DESC_BIAS_DATA_TYPE, ctypes.c_int(dtype))
            self._set(desc, _DESC_AUX_LD, ctypes.c_int64(d_shape[0]))
            layouts = [self._layout(dtype, *shape, shape[0]) for shape in (a_shape, b_shape, d_shape)]
            self._set_pointers(desc, bias, aux)  # the heuristic checks their alignment
            pref = ctypes.c_void_p()
            self.check(self.lib.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)), "preference")
            size = ctypes.c_uint64(_WORKSPACE_BYTES)
            self.check(self.lib.cublasLtMatmulPreferenceSetAttribute(pref, _PREF_MAX_WORKSPACE_BYTES,
                                                                     ctypes.byref(size), 8), "preference")  # fmt: skip
            result, found = _HeuristicResult(), ctypes.c_int(0)
            a, b, d = layouts
            status = self.lib.cublasLtMatmulAlgoGetHeuristic(self.handle, desc, a, b, d, d, pref, 1,
                                                             ctypes.byref(result), ctypes.byref(found))  # fmt: skip
            if status != 0 or found.value == 0:
                self.plans[key] = f"cuBLASLt has no algorithm for epilogue {epilogue} at {key} (status {status})"
                raise _Unavailable(self.plans[key])
            self.plans[key] = (desc, layouts, result)
        return self.plans[key]

    def _set_pointers(self, desc, bias: Tensor | None, aux: Tensor) -> None:
        if bias is not None:
            self._set(desc, _DESC_BIAS_POINTER, ctypes.c_void_p(bias.data_ptr()))
        self._set(desc, _DESC_AUX_POINTER, ctypes.c_void_p(aux.data_ptr()))

    def matmul(self, plan, a: Tensor, b: Tensor, d: Tensor, bias: Tensor | None, aux: Tensor) -> None:
        desc, (la, lb, ld), result = plan
        self._set_pointers(desc, bias, aux)
        device = d.device
        if device not in self.workspaces:
            self.workspaces[device] = torch.empty(_WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        stream = torch.cuda.current_stream(device).cuda_stream
        status = self.lib.cublasLtMatmul(self.handle, desc, ctypes.byref(self.one), a.data_ptr(), la, b.data_ptr(), lb,
                                         ctypes.byref(self.zero), d.data_ptr(), ld, d.data_ptr(), ld,
                                         ctypes.byref(result.algo), self.workspaces[device].data_ptr(),
                                         _WORKSPACE_BYTES, stream)  # fmt: skip
        self.check(status, "cublasLtMatmul")


_lt: _CublasLt | _Unavailable | None = None  # the library, or why it cannot be had
_lt_lock = threading.Lock()


def _library() -> _CublasLt:
    global _lt
    with _lt_lock:
        if _lt is None:
            try:
                _lt = _CublasLt()
            except _Unavailable as e:
                _lt = e
    if isinstance(_lt, _Unavailable):
        raise _lt
    return _lt


def _check_operands(what: str, **tensors: Tensor) -> None:
    """cuBLASLt reads raw pointers: contiguous CUDA tensors, all bf16 or all fp16."""
    for t in tensors.values():
        if not t.is_cuda or not t.is_contiguous() or t.dtype not in _DTYPES:
            raise ValueError(f"cuBLASLt operands must be contiguous CUDA tensors, got {t.dtype} {tuple(t.shape)} "
                             f"on {t.device}, contiguous={t.is_contiguous()}")  # fmt: skip
    if len({t.dtype for t in tensors.values()}) > 1:
        dtypes = ", ".join(f"{name} {t.dtype}" for name, t in tensors.items())
        raise ValueError(f"{what} needs one dtype, got {dtypes}")


def _run_epilogue(name: str, trans_a: int, a: Tensor, b: Tensor, out: Tensor, mnk: tuple[int, int, int],
                  epilogue: int, bias: Tensor | None, aux: Tensor) -> str:  # fmt: skip
    """out = op(a) b with the epilogue, a and b being cuBLAS's A and B (module docstring): "" where cuBLASLt ran it,
    else why it could not (then nothing was written)."""
    # Fresh allocations are aligned; a view at an offset may not be, and the heuristic's algorithm would not run it.
    if any(t.data_ptr() % _ALIGNMENT for t in (a, b, out, bias, aux) if t is not None):
        return f"operands not {_ALIGNMENT}-byte aligned"
    (M, N, K), dtype = mnk, out.dtype
    try:
        lt = _library()
        a_shape = (K, N) if trans_a == _OP_T else (N, K)
        plan = lt.plan((name, M, N, K, dtype, out.device), trans_a, a_shape, (K, M), (N, M), _DTYPES[dtype], epilogue,
                       bias, aux)  # fmt: skip
    except _Unavailable as e:
        return str(e)
    lt.matmul(plan, a, b, out, bias, aux)
    return ""


def gelu_aux_bias(x: Tensor, weight: Tensor, bias: Tensor) -> tuple[Tensor, Tensor]:
    """(gelu_tanh(x w^T + b), x w^T + b) for x (M, K), w (N, K), b (N,), all bf16 or all fp16 (cuBLASLt has no such
    kernel for an fp32 bias with bf16 operands)."""
    _check_operands("gelu_aux_bias", x=x, weight=weight, bias=bias)
    (M, K), N = x.shape, weight.shape[0]
    h, pre = x.new_empty(M, N), x.new_empty(M, N)
    reason = _run_epilogue("gelu_aux_bias", _OP_T, weight, x, h, (M, N, K), _EPILOGUE_GELU_AUX_BIAS, bias, pre)
    if reason:  # the same maths in two passes
        _warn_once(f"gelu_aux_bias: {reason}; running the GEMM and GELU apart")
        pre = torch.nn.functional.linear(x, weight, bias)
        return torch.nn.functional.gelu(pre, approximate="tanh"), pre
    return h, pre


def matmul_dgelu(grad: Tensor, weight: Tensor, pre: Tensor) -> Tensor:
    """(grad @ weight) * gelu_tanh'(pre) for grad (M, K), weight (K, N), pre (M, N), all bf16 or all fp16: the
    gradient of a GELU's input, from that of the Linear (weight (K, N)) that reads the GELU's output."""
    _check_operands("matmul_dgelu", grad=grad, weight=weight, pre=pre)
    (M, K), N = grad.shape, weight.shape[1]
    out = grad.new_empty(M, N)
    reason = _run_epilogue("dgelu", _OP_N, weight, grad, out, (M, N, K), _EPILOGUE_DGELU, None, pre)
    if reason:  # the same maths in two passes
        _warn_once(f"matmul_dgelu: {reason}; running the GEMM and GELU's gradient apart")
        return torch.ops.aten.gelu_backward(grad @ weight, pre, approximate="tanh")
    return out


_warned: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        logger.warning(message)
