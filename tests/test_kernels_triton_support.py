"""Where the converted modules' kernel paths may stand in for a Linear's module call."""

import pytest
import torch
from torch import nn

from torchtitan.kernels import triton_support
from torchtitan.kernels.triton_support import kernel_path_applies, triton_interpreting

pytestmark = pytest.mark.skipif(triton_support.triton is None, reason="triton is not installed")


def test_the_module_path_stays_where_the_linear_is_hooked_or_swapped(monkeypatch):
    # The kernel paths call the Linear's weight, not the module: DP-SGD's per-sample hooks and float8's Linear
    # need the module call.
    monkeypatch.setattr(triton_support, "_INTERPRETING", True)  # as if CPU tensors could run the kernels
    x, linear = torch.randn(2, 4, 8), nn.Linear(8, 16)
    assert kernel_path_applies(x, linear)
    handle = linear.register_forward_hook(lambda *args: None)
    assert not kernel_path_applies(x, linear)
    handle.remove()
    linear.register_forward_pre_hook(lambda *args: None)
    assert not kernel_path_applies(x, linear)

    class Swapped(nn.Linear):  # e.g. torchao's Float8Linear
        pass

    assert not kernel_path_applies(x, Swapped(8, 16))
    assert not kernel_path_applies(x, nn.Linear(8, 16, bias=False))


@pytest.mark.skipif(triton_interpreting(), reason="the interpreter runs CPU tensors through the kernels")
def test_cpu_tensors_keep_the_module_path():
    assert not kernel_path_applies(torch.randn(2, 4, 8), nn.Linear(8, 16))
