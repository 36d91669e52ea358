"""The [optimizer] section: SGD's updates against their closed form, and a resumed run's hyperparameters."""

import pytest
import torch

from torchtitan.components.lr_scheduler import build_lr_scheduler
from torchtitan.components.optimizer import apply_configured_hyperparameters, build_optimizer
from torchtitan.config_manager import parse_args


def _config(*flags: str):
    return parse_args(["--lr_scheduler.warmup_steps", "0", *flags])


@pytest.mark.parametrize("implementation", ["foreach", "for-loop"])
def test_sgd_with_momentum_and_weight_decay_follows_its_closed_form(implementation):
    lr, momentum, decay = 0.1, 0.9, 0.01
    cfg = _config("--optimizer.name", "SGD", "--optimizer.lr", str(lr), "--optimizer.momentum", str(momentum),
                  "--optimizer.weight_decay", str(decay), "--optimizer.implementation", implementation)  # fmt: skip
    model = torch.nn.Linear(3, 2)
    optimizer = build_optimizer(model, cfg.optimizer, torch.device("cpu"))
    assert type(optimizer) is torch.optim.SGD
    w0 = model.weight.detach().clone()
    g1, g2 = torch.randn(2, 2, 3)
    model.weight.grad = g1.clone()
    optimizer.step()
    d1 = g1 + decay * w0  # the first step's buffer is the decayed gradient itself
    w1 = w0 - lr * d1
    model.weight.grad = g2.clone()
    optimizer.step()
    w2 = w1 - lr * (momentum * d1 + g2 + decay * w1)
    torch.testing.assert_close(model.weight.detach(), w2, rtol=1e-6, atol=1e-7)


def test_plain_sgd_keeps_no_state():
    model = torch.nn.Linear(3, 2)
    optimizer = build_optimizer(model, _config("--optimizer.name", "SGD").optimizer, torch.device("cpu"))
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    optimizer.step()
    assert all(t is None for state in optimizer.state.values() for t in state.values())


def test_a_resumed_sgd_run_takes_the_configured_momentum_and_says_so():
    model = torch.nn.Linear(3, 2)
    saved = _config("--optimizer.name", "SGD", "--optimizer.momentum", "0.9")
    optimizer = build_optimizer(model, saved.optimizer, torch.device("cpu"))
    scheduler = build_lr_scheduler(optimizer, saved.lr_scheduler, 10)
    wanted = _config("--optimizer.name", "SGD", "--optimizer.momentum", "0.5", "--optimizer.lr", "2e-4")
    changes = apply_configured_hyperparameters(optimizer, scheduler, wanted.optimizer)
    assert changes == ["optimizer.lr: 0.0001 in the checkpoint, 0.0002 in the config (applied)",
                       "optimizer.momentum: 0.9 in the checkpoint, 0.5 in the config (applied)"]  # fmt: skip
    assert optimizer.param_groups[0]["momentum"] == 0.5
    assert optimizer.param_groups[0]["lr"] == pytest.approx(2e-4)
    assert apply_configured_hyperparameters(optimizer, scheduler, wanted.optimizer) == []


@pytest.mark.parametrize("name", ["SGD", "AdamW"])
def test_fused_sgd_steps_aside_for_fsdp_shards(name):
    """On CUDA `implementation = "fused"` picks the fused kernels, except SGD's on DTensor shards (FSDP), which
    DTensor cannot run (no sharding rule in torch 2.11): there SGD takes the foreach path."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    cfg = _config("--optimizer.name", name).optimizer
    cuda = torch.device("cuda")  # only read for the choice: nothing is built on it
    assert build_optimizer(torch.nn.Linear(3, 2), cfg, cuda).defaults["fused"] is True
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        model = torch.nn.Linear(4, 2)
        fully_shard(model, mesh=init_device_mesh("cpu", (2,)))
        defaults = build_optimizer(model, cfg, cuda).defaults
    finally:
        dist.destroy_process_group()
    assert (defaults["fused"], defaults["foreach"]) == ((None, True) if name == "SGD" else (True, None))
