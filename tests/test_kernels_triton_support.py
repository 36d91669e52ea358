"""Where the converted modules' kernel paths may stand in for a Linear's module call."""

from pathlib import Path

import pytest
import torch
from torch import nn

from tests.test_memory_estimate import INTERPRETED
from torchtitan.dp.testing import rerun_under_triton_interpreter
from torchtitan.kernels import triton_support
from torchtitan.kernels.triton_support import kernel_path_applies, triton_interpreting

pytestmark = pytest.mark.skipif(triton_support.triton is None, reason="triton is not installed")

# The test modules whose kernel tests run only under Triton's interpreter (conftest's `needs_interpreter`), and how
# many of each module's tests must pass in that run (test_dp_noise's statistics, seeding and engine tests run there
# again, on the Philox kernel's noise).
INTERPRETED_MODULES = {
    "test_dp_composition.py": 2, "test_dp_flash_kernels.py": 15, "test_dp_noise.py": 7,
    "test_kernels_adaln_norm.py": 17, "test_kernels_converters.py": 20, "test_kernels_mlp.py": 4,
    "test_kernels_qkv.py": 5, "test_memory_estimate.py": len(INTERPRETED),
}  # fmt: skip


@pytest.mark.skipif(triton_interpreting(), reason="this is the child")
def test_kernels_in_interpreter():
    """Every module above again, in one TRITON_INTERPRET=1 child process, where the kernels run on CPU tensors."""
    here = Path(__file__).parent
    rerun_under_triton_interpreter({str(here / name): least for name, least in INTERPRETED_MODULES.items()})


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
