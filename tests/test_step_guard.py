"""NonFiniteGuard: a non-finite step's update is skipped on the device and the host learns of it one step late."""

import pytest
import torch

from torchtitan.components.step_guard import NonFiniteGuard, NonFiniteStepError


def _step(model, guard, optimizer, step: int, grad: float) -> None:
    """One update of `model` with every gradient element `grad`, through the guard, then the late check."""
    for p in model.parameters():
        p.grad = torch.full_like(p, grad)
    loss_sum = torch.tensor(1.0)
    grad_norm = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])
    with guard.update(step, loss_sum, grad_norm):
        optimizer.step()
    guard.check(late=1)


@pytest.mark.parametrize("name", ["AdamW", "SGD"])
def test_a_non_finite_step_is_skipped_on_the_device_and_named_one_step_late(name):
    """The device path (a fused optimizer, as on CUDA; CPU's fused kernels take found_inf alike): the NaN step
    changes no weight and no Adam step count, the host raises only at the next step's check, naming the NaN step;
    the step after it updates from the unchanged weights, as an unbroken run would have from them."""
    torch.manual_seed(0)
    model, reference = torch.nn.Linear(4, 3), torch.nn.Linear(4, 3)
    reference.load_state_dict(model.state_dict())
    make = {"AdamW": lambda ps: torch.optim.AdamW(ps, lr=0.1, fused=True),
            "SGD": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, fused=True)}[name]  # fmt: skip
    optimizer, reference_optimizer = make(model.parameters()), make(reference.parameters())
    describe = lambda step, loss_sum, grad_norm: f"step {step}: gradient norm {grad_norm.item()}"
    guard = NonFiniteGuard(optimizer, torch.device("cuda"), describe)
    reference_guard = NonFiniteGuard(reference_optimizer, torch.device("cuda"), describe)
    assert guard.on_device
    _step(model, guard, optimizer, 1, 0.5)
    _step(reference, reference_guard, reference_optimizer, 1, 0.5)
    after_first = [p.detach().clone() for p in model.parameters()]
    _step(model, guard, optimizer, 2, float("nan"))  # skipped on the device; not read yet
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), after_first))
    if name == "AdamW":
        assert all(state["step"].item() == 1 for state in optimizer.state.values())
    with pytest.raises(NonFiniteStepError, match=r"^step 2: gradient norm nan$"):
        _step(model, guard, optimizer, 3, 0.25)
    _step(reference, reference_guard, reference_optimizer, 2, 0.25)  # what step 3 applied: from unchanged weights
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), reference.parameters()))
    assert not guard.pending and not hasattr(optimizer, "found_inf")


def test_without_found_inf_the_host_checks_before_the_update():
    """The host path (the foreach optimizers: CPU, SGD on DTensor shards) raises at the step itself, before it."""
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1, foreach=True)
    guard = NonFiniteGuard(optimizer, torch.device("cuda"), lambda step, *_: f"step {step}")
    assert not guard.on_device
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(NonFiniteStepError, match="^step 1$"):
        _step(model, guard, optimizer, 1, float("inf"))
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before)) and not optimizer.state
