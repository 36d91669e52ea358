"""DP-SGD through the trainer: epsilon and the per-sample norm statistics logged (against torch.func norms and
torch.quantile), resume exact, FSDP equals one process, clear refusals."""

import math
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from tests.conftest import TINY, read_metrics, run_train
from torchtitan.config_manager import JobConfig
from torchtitan.dp.testing import clipped_mean, per_sample_grads
from torchtitan.dp.training import PrivateTraining, gather_kept, norm_statistics

DP = [*TINY, "--training.steps", "4", "--training.global_batch_size", "16", "--dp.enable", "true",
      "--dp.noise_multiplier", "0.7", "--dp.max_grad_norm", "1.0", "--checkpoint.enable", "true",
      "--checkpoint.interval", "2", "--training.ema_decay", "0"]  # fmt: skip


DP_KEYS = ("loss", "dp_noised_grad_norm", "dp_epsilon", "dp_grad_norm_mean", "dp_grad_norm_p95",
           "dp_clipped_fraction")  # fmt: skip


@pytest.mark.parametrize("optimizer", [[], ["--optimizer.name", "SGD", "--optimizer.momentum", "0.9"]],
                         ids=["adamw", "sgd_momentum"])  # fmt: skip
def test_dp_run_logs_epsilon_and_resumes_exactly(tmp_path, optimizer):
    args = [*DP, "--training.local_batch_size", "16", *optimizer]
    run_train([*args, "--job.dump_folder", str(tmp_path / "full")])
    full = read_metrics(tmp_path / "full")
    eps = [m["dp_epsilon"] for m in full]
    assert all(b > a > 0 for a, b in zip(eps, eps[1:]))  # privacy spent grows every step

    resumed = tmp_path / "resumed"
    run_train([*args, "--job.dump_folder", str(resumed), "--training.steps", "2"])
    run_train([*args, "--job.dump_folder", str(resumed)])
    assert [[m[k] for k in DP_KEYS] for m in read_metrics(resumed)] == [[m[k] for k in DP_KEYS] for m in full]


def test_dp_run_logs_the_per_sample_norms_and_the_noised_grad_norm(tmp_path):
    """Poisson batches (mostly padding here), two steps per log: the statistics' keys in every record, no
    `grad_norm`, and the clipped fraction in closed form at a tiny C (every sample) and a huge one (none)."""
    poisson = [*DP, "--training.local_batch_size", "16", "--dp.sampling", "poisson", "--metrics.log_freq", "2",
               "--checkpoint.enable", "false"]  # fmt: skip
    for max_norm, fraction in (("1e-6", 1.0), ("1e6", 0.0)):
        folder = tmp_path / max_norm
        result = run_train([*poisson, "--dp.max_grad_norm", max_norm, "--job.dump_folder", str(folder)])
        assert "noised_grad_norm" in result.stderr and "sample_norm mean" in result.stderr  # the console line
        metrics = read_metrics(folder)
        assert [m["step"] for m in metrics] == [2, 4]
        for m in metrics:
            assert "grad_norm" not in m  # under DP the logged norm is named for what it is
            assert all(math.isfinite(m[k]) and m[k] > 0 for k in DP_KEYS if k != "dp_clipped_fraction")
            assert m["dp_clipped_fraction"] == fraction


def _linear_norms(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """(B,) norms of each sample's gradient, the loss the mean over its K rows (x: (B, K, 6)), by torch.func."""
    grads = per_sample_grads(model, lambda out, x: out.square().mean((1, 2)), x)
    return clipped_mean(grads, 1.0)[1]


@pytest.mark.parametrize("augmult", [1, 3])
def test_norm_statistics_cover_every_real_sample_since_the_last_log(augmult):
    """Two steps of two micro-batches with Poisson padding, then one more step: each metrics() call summarizes the
    real samples since the previous one, against torch.func's per-sample norms and torch.quantile."""
    torch.manual_seed(0)
    model = nn.Linear(6, 3)
    masks = [None, [1, 1, 0, 0], [1, 0, 1, 1], [0, 1, 1, 1], [1, 1, 1, 0]]
    masks = [m if m is None else torch.tensor(m, dtype=torch.bool) for m in masks]
    inputs = [torch.randn(4, augmult, 6) for _ in masks]
    for x, mask in zip(inputs, masks):  # padding rows 100x larger: counting them would show in every statistic
        if mask is not None:
            x[~mask] *= 100
    reference = [_linear_norms(model, x)[mask if mask is not None else slice(None)] for x, mask in zip(inputs, masks)]
    ordered = torch.cat(reference).sort().values
    dp = JobConfig().dp  # C between two middle norms: about half clipped, none within rounding of C
    dp.mode, dp.max_grad_norm = "ghost", ordered[len(ordered) // 2 - 1 : len(ordered) // 2 + 1].mean().item()
    private = PrivateTraining(dp, model, dataset_size=1000, global_batch=4, total_steps=3, mesh=None, seed=0)

    def train(micro_batches):
        for micro, (x, mask) in enumerate(micro_batches):
            losses = model(x.flatten(0, 1)).square().mean(1)  # (B K,) rows, each sample's K consecutive
            private.backward(losses.view(-1, augmult) if augmult > 1 else losses, mask, micro == len(micro_batches) - 1)
        private.step_done()

    train(list(zip(inputs[0:2], masks[0:2])))
    train(list(zip(inputs[2:4], masks[2:4])))
    windows = [private.metrics()]
    train([(inputs[4], masks[4])])
    windows += [private.metrics(), private.metrics()]
    for got, norms in zip(windows, [torch.cat(reference[:4]), reference[4]]):
        assert got["dp_grad_norm_mean"] == pytest.approx(norms.mean().item(), rel=1e-5)
        assert got["dp_grad_norm_p95"] == pytest.approx(torch.quantile(norms, 0.95).item(), rel=1e-5)
        assert got["dp_clipped_fraction"] == pytest.approx((norms > dp.max_grad_norm).double().mean().item())
    assert windows[0]["dp_clipped_fraction"] not in (0.0, 1.0)
    assert windows[2].keys() == {"dp_epsilon"}  # nothing since the last call: no statistics


def test_norm_statistics_match_torch_quantile():
    torch.manual_seed(0)
    for n in (1, 2, 7, 20, 1001):
        norms = torch.rand(n, dtype=torch.float64) * 3
        got = norm_statistics(norms, max_grad_norm=1.5)
        assert got["dp_grad_norm_p95"] == pytest.approx(torch.quantile(norms, 0.95).item(), rel=1e-12), n
        assert got["dp_grad_norm_mean"] == pytest.approx(norms.mean().item(), rel=1e-12), n
        assert got["dp_clipped_fraction"] == (norms > 1.5).sum().item() / n, n
    assert norm_statistics(torch.zeros(0), 1.0) == {}


def _gather_worker(rank: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        norms = torch.arange(6, dtype=torch.float32) + 10 * rank  # rank 0: 0..5, rank 1: 10..15
        kept = torch.tensor([[1, 1, 1, 0, 0, 0], [1, 0, 1, 1, 1, 0]][rank], dtype=torch.bool)
        got = sorted(gather_kept(norms, kept, dist.group.WORLD).tolist())
        assert got == [0.0, 1.0, 2.0, 10.0, 12.0, 13.0, 14.0], got  # every rank's real samples, padding dropped
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_gather_kept_collects_every_ranks_real_samples():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_gather_worker, args=(port,), nprocs=2)


@pytest.mark.slow
def test_dp_fsdp_matches_one_process(tmp_path):
    """Noise is drawn once per element of the global gradient: the layout does not change it. With augmult,
    each sample's K noise/timestep draws are the same whichever rank holds the sample; the logged norm statistics
    gather both ranks' samples. (Without augmult, and with AC in each mode: the first step's clipped, noised
    gradients against one process in tests/test_parallelisms.py, test_dp_gradient_matches_one_process.)"""
    seed = tmp_path / "seed"
    run_train([*DP, "--job.dump_folder", str(seed), "--checkpoint.create_seed_checkpoint", "true"])
    init = ["--checkpoint.initial_load_path", str(seed / "checkpoint" / "step-0"), "--dp.augmult", "3"]
    run_train([*DP, *init, "--job.dump_folder", str(tmp_path / "one"), "--training.local_batch_size", "16"])
    run_train([*DP, *init, "--job.dump_folder", str(tmp_path / "fsdp"), "--training.local_batch_size", "8"], nproc=2)
    for a, b in zip(read_metrics(tmp_path / "one"), read_metrics(tmp_path / "fsdp")):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)
        assert b["dp_noised_grad_norm"] == pytest.approx(a["dp_noised_grad_norm"], rel=1e-4)
        for key in ("dp_grad_norm_mean", "dp_grad_norm_p95"):  # both ranks' samples, gathered
            assert b[key] == pytest.approx(a[key], rel=1e-4), key
        assert b["dp_clipped_fraction"] == a["dp_clipped_fraction"]


@pytest.mark.parametrize(
    "extra, fragment",
    [
        (["--dp.mode", "ghost", "--activation_checkpoint.mode", "selective"], "per-op selective AC"),
        (["--model.converters", "fused_norm,float8"], "no per-sample gradient"),
        (["--dp.sampling", "poisson", "--training.local_batch_size", "8"], "no gradient accumulation"),
    ],
)
def test_unsupported_dp_combinations_are_refused(tmp_path, extra, fragment):
    result = run_train([*DP, "--training.local_batch_size", "16", "--job.dump_folder", str(tmp_path), *extra],
                       check=False)  # fmt: skip
    assert result.returncode == 2 and fragment in result.stderr
