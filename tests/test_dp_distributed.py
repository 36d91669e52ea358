"""DPEngine under FSDP2, HSDP and DDP on 2 CPU processes (gloo) against single-process torch.func.

Each rank computes the reference on the whole global batch, then checks its own result: the
clipped sum over both ranks' samples plus the noise a single process would draw (noise.py makes
it layout independent), so one draw per element of the global gradient is checked exactly.
"""

import copy
import gc
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed._composable.replicate import replicate
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor

from torchtitan.dp import DP_MODES, DPEngine
from torchtitan.dp import distributed as dpdist
from torchtitan.dp.noise import gaussian_noise
from torchtitan.dp.testing import clipped_mean, per_sample_grads
from torchtitan.models.dit import DiT, DiTArgs

WORLD = 2
LOCAL_BATCH = 3
SIGMA, SEED = 0.01, 11  # noise about as large as the clipped mean: errors in either show


def _tiny_dit() -> DiT:
    torch.manual_seed(0)
    args = DiTArgs(
        input_size=8, in_channels=1, patch_size=2, dim=32, depth=2, num_heads=2, num_classes=10,
        learn_sigma=False, pos_embed="learned", qk_norm=True,
    )  # fmt: skip
    model = DiT(args)
    model.init_weights()
    with torch.no_grad():  # the init zeroes adaLN and the output layer: make every gradient non-zero
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model


def _loss(out, x, t, y):
    return (out - x).square().mean((1, 2, 3))


def _parallelize(model, topology):
    if topology == "ddp":
        return replicate(model), None
    mesh = (
        init_device_mesh("cpu", (WORLD,))
        if topology.startswith("fsdp")
        else init_device_mesh("cpu", (WORLD, 1), mesh_dim_names=("replicate", "shard"))
    )
    for block in model.blocks.values():
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    if topology == "fsdp_sum":  # a custom divide factor: FSDP sums, the engine must scale the loss itself
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_gradient_divide_factor(1.0)
                module.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM
    return model, mesh


def _check_topology(rank, topology, model, batch, refs, ref_norms, max_norm):
    local = tuple(b[rank * LOCAL_BATCH : (rank + 1) * LOCAL_BATCH] for b in batch)
    # fsdp_sum: book-keeping's reduce-scatters in buckets of a few layers, one in flight while the next fills.
    dpdist.BUCKET_BYTES = 16 << 10 if topology == "fsdp_sum" else 256 << 20
    for mode in DP_MODES:
        dp_model, mesh = _parallelize(copy.deepcopy(model), topology)
        engine = DPEngine(dp_model, mode, max_norm, SIGMA, dp_mesh=mesh, seed=SEED)
        ref = refs[mode == "vanilla"]
        for step in range(2):  # a second step catches state left behind by the first (FSDP, DDP reducer)
            for param in dp_model.parameters():
                param.grad = None
            norms = engine.backward(_loss(dp_model(*local), *local))
            if norms is not None:
                expected = ref_norms[rank * LOCAL_BATCH : (rank + 1) * LOCAL_BATCH]
                torch.testing.assert_close(norms, expected, rtol=1e-4, atol=0)
            for name, param in dp_model.named_parameters():
                got = param.grad.full_tensor() if isinstance(param.grad, DTensor) else param.grad
                std = 0.0 if mode == "vanilla" else SIGMA * max_norm / (WORLD * LOCAL_BATCH)
                err = (got - ref[name] - gaussian_noise(ref[name], name, SEED, step, std)).norm() / ref[name].norm()
                assert err < 1e-4, f"{topology} {mode} step {step} {name}: relative error {err:.2e}"


def _check_ema_of_shards(model, topology):
    """Not DP, but FSDP's ranks are here: the EMA, updated on each rank's local shards, is the plain model's
    average (decay 0.75 after the weights step to 2 w + 1)."""
    from torchtitan.components.ema import EMA

    sharded, _ = _parallelize(copy.deepcopy(model), topology)
    ema = EMA(sharded, 0.75)
    start = dict(model.named_parameters())
    with torch.no_grad():
        for p in sharded.parameters():
            p.mul_(2.0).add_(1.0)
    ema.update()
    for name, shadow in zip(ema.names, ema.shadow, strict=True):
        w = start[name].detach()
        torch.testing.assert_close(shadow.full_tensor(), 0.75 * w + 0.25 * (2 * w + 1), rtol=0, atol=1e-6)


def _worker(rank, port, topologies):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        model = _tiny_dit()
        g = torch.Generator().manual_seed(1)
        n = WORLD * LOCAL_BATCH
        batch = (
            torch.randn(n, 1, 8, 8, generator=g),
            torch.randint(0, 1000, (n,), generator=g),
            (2 * torch.arange(n)) % 11,
        )  # labels in both shards of the table
        grads = per_sample_grads(model, _loss, *batch)
        max_norm = torch.cat([v.flatten(1) for v in grads.values()], 1).norm(dim=1).median().item()
        ref, ref_norms = clipped_mean(grads, max_norm)
        vanilla = {k: v.mean(0) for k, v in grads.items()}
        for topology in topologies:
            _check_topology(rank, topology, model, batch, (ref, vanilla), ref_norms, max_norm)
            if topology == "fsdp":
                _check_ema_of_shards(model, topology)
    finally:
        gc.collect()  # the checks' DDP/FSDP state holds process-group handles: free it before teardown (train.py)
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
@pytest.mark.parametrize("topologies", [("fsdp", "fsdp_sum", "hsdp"), ("ddp",)])
def test_distributed_matches_single_process(topologies):
    mp.spawn(_worker, args=(_free_port(), topologies), nprocs=WORLD)
