"""DP-SGD composed with what the trainer applies to the model: torch.compile (CPU inductor), each activation
checkpointing mode, the kernel converters, gradient accumulation and augmult, all through `parallelize_dit` as the
trainer calls it, against torch.func per-sample gradients of the plain model (fp32, relative error < 1e-4).

FSDP-2, HSDP-2x2 and DDP with compile and AC are checked through the trainer in tests/test_parallelisms.py
(`test_dp_gradient_matches_one_process`); the engine alone under each layout in tests/test_dp_distributed.py.
"""

import copy
from dataclasses import replace

import pytest
import torch

from tests.conftest import INTERPRETED_IMAGE_SIZE, ROOT, needs_interpreter
from torchtitan.config_manager import parse_args
from torchtitan.dp import DPEngine
from torchtitan.dp.testing import clipped_mean, per_sample_grads
from torchtitan.kernels.triton_support import triton_interpreting
from torchtitan.models.dit import DiT, dit_configs
from torchtitan.models.dit.parallelize import parallelize_dit
from torchtitan.parallelisms.parallel_dims import ParallelDims

AC = {
    "none": [],
    "full": ["--activation_checkpoint.mode", "full"],
    "op": ["--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "op"],
    "every_2nd": ["--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "2"],
}
COMPILE = ["--compile.enable", "true"]
# The TRITON_INTERPRET=1 child of test_kernels_in_interpreter runs only the kernel-path tests (on 4x4 images).
parent_only = pytest.mark.skipif(triton_interpreting(), reason="runs in the parent process")
pytestmark = pytest.mark.usefixtures("interpreter_launch")
SIZE = INTERPRETED_IMAGE_SIZE


def _plain_dit() -> DiT:
    """The debug DiT (4 blocks, 64 tokens; 4 in the interpreter), every parameter nudged off its init (adaLN-Zero's
    zeros hide gradients)."""
    torch.manual_seed(0)
    model = DiT(replace(dit_configs["debug"], input_size=SIZE))
    model.init_weights()
    torch.manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.02 * torch.randn_like(p))
    return model


def _parallelized(model: DiT, overrides: list[str]) -> DiT:
    """A copy of `model` through parallelize_dit with train_configs/debug_model.toml, DP on, and `overrides`:
    the default converters (fused_norm, fused_mlp, fused_qkv), then AC and compile as the trainer orders them."""
    args = ["--job.config_file", str(ROOT / "train_configs/debug_model.toml"), "--dp.enable", "true", *overrides]
    return parallelize_dit(copy.deepcopy(model), ParallelDims(1, 1, 1, False), parse_args(args))


def _batch(rows: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    images, timesteps = torch.randn(rows, 1, SIZE, SIZE, generator=g), torch.randint(0, 1000, (rows,), generator=g)
    return images, timesteps, torch.arange(rows) % 11


def _loss(out, x, t, y):
    return (out - x).square().mean((1, 2, 3))


def _clipped_reference(model, batch, group: int = 1, batch_size: int | None = None):
    """(clipped mean per parameter, per-sample norms, C): a sample's gradient is the mean over its `group` rows."""
    grads = per_sample_grads(model, _loss, *batch)
    grads = {n: g.unflatten(0, (-1, group)).mean(1) for n, g in grads.items()}
    max_norm = torch.cat([g.flatten(1) for g in grads.values()], 1).norm(dim=1).median().item()  # half get clipped
    clipped, norms = clipped_mean(grads, max_norm, batch_size)
    return clipped, norms, max_norm


def _assert_grads(model, expected: dict, label: str) -> None:
    for name, p in model.named_parameters():
        name = name.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", "")
        err = ((p.grad - expected[name]).norm() / expected[name].norm()).item()
        assert err < 1e-4, f"{label} {name}: relative error {err:.2e}"


def _check_step(overrides: list[str], mode: str, label: str, steps: int = 1) -> None:
    """The debug DiT through parallelize_dit with `overrides`, `steps` private backwards of one batch of 4: norms and
    clipped gradients against torch.func on the plain model."""
    plain, batch = _plain_dit(), _batch(4)
    clipped, norms, max_norm = _clipped_reference(plain, batch)
    model = _parallelized(plain, overrides)
    engine = DPEngine(model, mode, max_norm, 0.0)
    for _ in range(steps):
        model.zero_grad(set_to_none=True)
        torch.testing.assert_close(engine.backward(_loss(model(*batch), *batch)), norms, rtol=1e-4, atol=0)
    _assert_grads(model, clipped, label)


@parent_only
@pytest.mark.parametrize(
    "ac, mode", [(ac, mode) for ac in AC for mode in ("ghost", "bookkeeping") if (ac, mode) != ("op", "ghost")]
)
def test_compiled_and_checkpointed_dit_matches_torch_func(ac, mode):
    """Two steps: the second runs the compiled code the first compiled (and catches state the first left). Ghost
    clipping backpropagates twice, which per-op AC cannot (config validation refuses it)."""
    _check_step([*COMPILE, *AC[ac]], mode, f"compiled, AC {ac}, {mode}", steps=2)


@parent_only
def test_whole_model_compiled_with_ac_matches_torch_func():
    """compile.scope = 'model' around checkpointed blocks: the only graph break is the root's token pre-hook."""
    _check_step([*COMPILE, "--compile.scope", "model", *AC["full"]], "bookkeeping", "model compiled, AC full", steps=2)


@parent_only
@pytest.mark.parametrize("ac", ["op", "every_2nd"])
def test_checkpointed_dit_matches_torch_func(ac):
    """Selective AC without compile (full AC eagerly: tests/test_dp_engine.py)."""
    _check_step(AC[ac], "bookkeeping", f"AC {ac}")


@parent_only
@pytest.mark.parametrize("mode, ac", [("ghost", "every_2nd"), ("bookkeeping", "op")])
def test_augmult_compiled_and_checkpointed(mode, ac):
    """Augmult K = 2 (each sample's K rows consecutive, their losses averaged before clipping), compiled, with AC.
    The engine is not told K (the trainer tells it, `augmult`): book-keeping's compiled graph computes norms for one
    row a sample, which the engine must not use."""
    k, plain = 2, _plain_dit()
    x, t, y = _batch(3)
    g = torch.Generator().manual_seed(5)
    rows = (x.repeat_interleave(k, 0) + 0.3 * torch.randn(3 * k, 1, SIZE, SIZE, generator=g),
            t.repeat_interleave(k) + torch.arange(3 * k), y.repeat_interleave(k))  # fmt: skip
    clipped, norms, max_norm = _clipped_reference(plain, rows, group=k)
    model = _parallelized(plain, [*COMPILE, *AC[ac]])
    engine = DPEngine(model, mode, max_norm, 0.0)
    got = engine.backward(_loss(model(*rows), *rows).unflatten(0, (-1, k)))
    torch.testing.assert_close(got, norms, rtol=1e-4, atol=0)
    _assert_grads(model, clipped, f"augmult {mode}")


@parent_only
@pytest.mark.parametrize("mode", ["ghost", "bookkeeping"])
def test_accumulation_compiled_and_checkpointed(mode):
    """Two micro-batches of 3 into one step of 6: clipped per sample, summed over both, divided by 6 once."""
    plain, batch = _plain_dit(), _batch(6)
    clipped, norms, max_norm = _clipped_reference(plain, batch)
    model = _parallelized(plain, [*COMPILE, *AC["full"]])
    engine = DPEngine(model, mode, max_norm, 0.0, global_batch_size=6)
    for micro in range(2):
        part = tuple(b[micro * 3 : (micro + 1) * 3] for b in batch)
        got = engine.backward(_loss(model(*part), *part), add_noise=micro == 1)
        torch.testing.assert_close(got, norms[micro * 3 : (micro + 1) * 3], rtol=1e-4, atol=0)
    assert engine.step == 1  # the noise and the step counter come once, with the last micro-batch
    _assert_grads(model, clipped, f"accumulation {mode}")


@needs_interpreter
@pytest.mark.parametrize("mode, ac", [("flash_bookkeeping", "op"), ("flash", "full")])
def test_kernel_paths_match_torch_func(mode, ac):
    """Under Triton's interpreter the converters' fused norms and the flash norm kernels run their Triton code (the
    fused MLP and qkv hand their DP-hooked Linears to the module call), with AC."""
    _check_step(AC[ac], mode, f"interpreter {mode}")
