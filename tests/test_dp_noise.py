"""DP noise: statistics, seeding, layout independence, and exact resume through the engine; both ways of
drawing it (torch generator blocks here, the Philox Triton kernel of CUDA in Triton's interpreter)."""

import math

import pytest
import torch
from torch import nn

from torchtitan.dp import DPEngine
from torchtitan.dp import noise as dpnoise
from torchtitan.dp.flash_kernels import triton_interpreting
from torchtitan.dp.testing import clipped_mean, per_sample_grads, rerun_under_triton_interpreter


def test_interpreter_reruns_are_for_machines_without_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(pytest.skip.Exception, match="CUDA is here"):
        rerun_under_triton_interpreter({__file__: 7})


def test_noise_statistics():
    param = torch.empty(300, 500)
    values = dpnoise.gaussian_noise(param, "w", seed=0, step=0, std=2.0)
    n = values.numel()
    assert abs(values.mean().item()) < 5 * 2.0 / math.sqrt(n)
    assert abs(values.std().item() / 2.0 - 1) < 0.01
    assert abs((values / 2).pow(4).mean().item() - 3) < 0.1  # Gaussian kurtosis
    other = dpnoise.gaussian_noise(param, "w", seed=0, step=1, std=2.0)
    assert abs(torch.corrcoef(torch.stack([values.flatten(), other.flatten()]))[0, 1].item()) < 0.02


def test_noise_is_a_function_of_seed_step_and_name():
    param = torch.empty(7, 3)
    same = dpnoise.gaussian_noise(param, "a.weight", 1, 5, 1.0)
    assert torch.equal(same, dpnoise.gaussian_noise(param, "a.weight", 1, 5, 1.0))
    for changed in [("b.weight", 1, 5), ("a.weight", 2, 5), ("a.weight", 1, 6)]:
        assert not torch.equal(same, dpnoise.gaussian_noise(param, *changed, 1.0))


@pytest.mark.skipif(not (triton_interpreting() or torch.cuda.is_available()), reason="the Philox kernel's test")
@pytest.mark.parametrize("shape", [(37, 5), (37,), (4, 6, 5)])
def test_shards_add_the_slice_of_the_whole(monkeypatch, shape):
    """The kernel's noise on a range of rows (an FSDP shard), or on any other region, is that region of the
    whole tensor's noise."""
    device = "cpu" if triton_interpreting() else "cuda"
    param, full = torch.empty(shape, device=device), torch.zeros(shape, device=device)
    dpnoise.add_gaussian_noise_(full, param, "p", 3, 4, 0.5)
    assert (full != 0).all()  # every element got a draw
    columns = [slice(0, n) for n in shape[1:]]
    regions = [
        (slice(0, 1), *columns),
        (slice(1, shape[0]), *columns),
        (slice(shape[0] // 3, shape[0] // 2 + 1), *columns),
    ]
    if len(shape) > 1:  # a column shard: not a range of the global element order
        regions.append((slice(2, min(30, shape[0])), slice(1, 3), *columns[1:]))
    for region in regions:
        monkeypatch.setattr(dpnoise, "local_region", lambda param, region=region: region)  # as for a shard
        part = torch.zeros([s.stop - s.start for s in region], device=device)
        dpnoise.add_gaussian_noise_(part, param, "p", 3, 4, 0.5)
        assert torch.equal(part, full[region])
    monkeypatch.undo()
    assert dpnoise.gaussian_noise(torch.empty((), device=device), "scalar", 0, 0, 1.0).shape == ()


@pytest.mark.skipif(triton_interpreting(), reason="the torch path: CPU without the interpreter")
@pytest.mark.parametrize("shape", [(37, 5), (37,), (), (4, 6, 5)])
def test_any_region_equals_the_slice_of_the_whole(monkeypatch, shape):
    monkeypatch.setattr(dpnoise, "_BLOCK_NUMEL", 16)  # many blocks on a small tensor
    param, full = torch.empty(shape), torch.zeros(shape)
    dpnoise.add_gaussian_noise_(full, param, "p", 3, 4, 1.0)
    g = torch.Generator().manual_seed(0)
    for _ in range(10):
        region = []
        for n in shape:
            lo = int(torch.randint(0, n, (1,), generator=g))
            region.append(slice(lo, int(torch.randint(lo + 1, n + 1, (1,), generator=g))))
        monkeypatch.setattr(dpnoise, "local_region", lambda param, region=tuple(region): region)  # as for a shard
        part = torch.zeros([s.stop - s.start for s in region])
        dpnoise.add_gaussian_noise_(part, param, "p", 3, 4, 1.0)
        expected = full[tuple(region)] if shape else full
        assert torch.equal(part, expected)


def _engine_step(model, engine, x):
    for p in model.parameters():
        p.grad = None
    engine.backward(model(x).square().mean(1))
    return [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("mode", ["ghost", "bookkeeping"])
def test_engine_noise_scale_and_exact_resume(mode):
    torch.manual_seed(0)
    model = nn.Linear(64, 64)
    x = torch.randn(8, 64)
    clipped, _ = clipped_mean(per_sample_grads(model, lambda out, x: out.square().mean(1), x), 0.1)
    sigma, max_norm = 2.0, 0.1
    engine = DPEngine(model, mode, max_norm, sigma, seed=5)
    first = _engine_step(model, engine, x)
    noise = first[0] - clipped["weight"]
    assert abs(noise.std().item() / (sigma * max_norm / 8) - 1) < 0.03
    second = _engine_step(model, engine, x)
    state = engine.state_dict()
    third = _engine_step(model, engine, x)
    assert not torch.equal(first[0], second[0])
    # A new engine restored from the state dict draws what the running one drew next.
    resumed = DPEngine(nn.Linear(64, 64), mode, max_norm, sigma, seed=0)
    resumed.model.load_state_dict(model.state_dict())
    resumed.load_state_dict(state)
    assert all(torch.equal(a, b) for a, b in zip(_engine_step(resumed.model, resumed, x), third))


@pytest.mark.skipif(not (triton_interpreting() or torch.cuda.is_available()), reason="the Philox kernel's test")
def test_one_launch_for_many_tensors_adds_what_each_alone_adds(monkeypatch):
    """add_gaussian_noise_many_ (one kernel for all tensors) equals add_gaussian_noise_ tensor by tensor, for
    whole tensors, a row shard that starts mid-block, a column shard (which goes alone), and mixed dtypes."""
    device = "cpu" if triton_interpreting() else "cuda"
    shapes = {"a": (37, 5), "b": (3,), "c": (), "d": (4, 6, 5), "e": (1500, 7), "f": (9, 4)}
    params = {name: torch.empty(shape, device=device) for name, shape in shapes.items()}
    regions = {id(params["e"]): (slice(700, 1431), slice(0, 7)), id(params["f"]): (slice(1, 8), slice(1, 3))}
    monkeypatch.setattr(dpnoise, "local_region",
                        lambda p: regions.get(id(p), tuple(slice(0, n) for n in p.shape)))  # fmt: skip
    alone, together = [], []
    for name, param in params.items():
        local = [s.stop - s.start for s in dpnoise.local_region(param)]
        base = torch.randn(local, device=device).to(torch.bfloat16 if name == "d" else torch.float32)
        one = base.clone()
        dpnoise.add_gaussian_noise_(one, param, name, 3, 4, 0.5)
        assert not torch.equal(one, base), name
        alone.append(one)
        together.append((base.clone(), param, name))
    dpnoise.add_gaussian_noise_many_(together, 3, 4, 0.5)
    for one, (many, _, name) in zip(alone, together):
        assert torch.equal(one, many), name
