"""Triton where it is installed: the kernels of dp/ and kernels/ import it from here.

Triton is optional (CPU-only installs run the torch paths). Kernels run on CUDA tensors, and on CPU tensors when
Triton runs in its interpreter (tests): TRITON_INTERPRET=1 must be set before triton is first imported, because
triton.jit picks the interpreter or the compiler when it decorates, and triton's own library functions are
decorated at its import.
"""

import os
import types

try:
    import triton
    import triton.language as tl

    # Fixed at import, like triton's own jit functions: setting the variable later changes nothing.
    _knobs = getattr(triton, "knobs", None)  # triton >= 3.4
    _INTERPRETING = bool(_knobs.runtime.interpret) if _knobs else os.environ.get("TRITON_INTERPRET") == "1"
    jit = triton.jit
except ImportError:  # CPU-only installs
    triton, _INTERPRETING = None, False
    tl = types.SimpleNamespace(constexpr=None)  # only the kernels' annotations read it

    def jit(fn):
        return fn


def triton_interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1 when triton was imported)."""
    return _INTERPRETING


def triton_runs(x) -> bool:
    """Whether Triton kernels can run on tensor x: CUDA tensors, or CPU ones in the interpreter (tests)."""
    return triton is not None and (x.is_cuda or _INTERPRETING)


def kernel_path_applies(x, linear) -> bool:
    """Whether a converted module's kernel path may stand in for the module call `linear(x)`.

    Triton must run for x (CUDA tensors, or CPU ones in the interpreter), and `linear` must be a plain nn.Linear
    with a bias that nothing hooks: the kernel paths call its weight and bias, not the module, and DP-SGD's
    per-sample hooks and float8's Linear (a subclass) need the module call.
    """
    from torch import nn

    plain = (type(linear) is nn.Linear and linear.bias is not None and not linear._forward_hooks
             and not linear._forward_pre_hooks)  # fmt: skip
    return plain and triton_runs(x)


def autocast_dtype(x):
    """The dtype autocast would run a matmul of x in: its dtype for x's device where autocast is on, else None.

    The kernel paths stand in for autocast's own casts (a custom op or autograd function is not autocast's).
    """
    import torch

    device = x.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None


def wrap_triton(kernel):
    """How a `torch.library.triton_op` launches `kernel`: through `torch.library.wrap_triton`, so torch.compile
    traces the launch; as it is in the interpreter, where torch 2.11's wrap_triton takes only compiled kernels."""
    if _INTERPRETING:
        return kernel
    from torch.library import wrap_triton as wrap

    return wrap(kernel)
