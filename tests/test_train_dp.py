"""DP-SGD through the trainer: epsilon and the per-sample norm statistics logged (against torch.func norms and
torch.quantile), resume exact, FSDP equals one process, clear refusals."""

import gc
import json
import math
import os
import re
import shutil
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from tests.conftest import TINY, read_metrics, run_train
from torchtitan.config_manager import ConfigError, JobConfig
from torchtitan.dp.sampling import PoissonBatchSampler
from torchtitan.dp.testing import clipped_mean, per_sample_grads
from torchtitan.dp.training import PrivateTraining, gather_kept, norm_statistics
from torchtitan.errors import ResumeRefusedError
from torchtitan.tools.logging import logger
from torchtitan.trainer import Trainer

DP = [*TINY, "--training.steps", "4", "--training.global_batch_size", "16", "--dp.enable", "true",
      "--dp.noise_multiplier", "0.7", "--dp.max_grad_norm", "1.0", "--checkpoint.enable", "true",
      "--checkpoint.interval", "2", "--training.ema_decay", "0"]  # fmt: skip


DP_KEYS = ("loss", "dp_noised_grad_norm", "dp_epsilon", "dp_grad_norm_mean", "dp_grad_norm_p95",
           "dp_clipped_fraction")  # fmt: skip


@pytest.fixture
def train_in_process():
    """train.py's main() in this process (no interpreter start-up), its global changes undone after: automatic
    garbage collection (the trainer turns it off), the package logger's handlers (on this test's captured stderr)
    and the compiler settings the DP engine changes."""
    import torch._functorch.config
    import torch._inductor.config

    import train

    handlers, level, propagate = logger.handlers[:], logger.level, logger.propagate
    compiler = (torch._functorch.config.donated_buffer, torch._inductor.config.allow_buffer_reuse,
                torch._inductor.config.inplace_buffers)  # fmt: skip
    yield train.main
    gc.enable()
    logger.handlers[:] = handlers
    logger.setLevel(level)
    logger.propagate = propagate
    (torch._functorch.config.donated_buffer, torch._inductor.config.allow_buffer_reuse,
     torch._inductor.config.inplace_buffers) = compiler  # fmt: skip


@pytest.mark.parametrize(
    "variant",
    [[], ["--optimizer.name", "SGD", "--optimizer.momentum", "0.9", "--dp.target_epsilon", "2.0"]],
    ids=["adamw", "sgd_momentum_target_epsilon"],
)
def test_dp_run_logs_epsilon_and_resumes_exactly(tmp_path, variant, train_in_process, capsys):
    """Resumed from the step-2 checkpoint of the same config (what a run killed there leaves), steps 3 and 4 are
    exact; calibrated to a target, the resume reuses the checkpoint's noise multiplier. Resumed with dp.enable false,
    the DP checkpoint is refused by name (with shuffled batches it used to resume silently, without its accountant)."""
    args = [*DP, "--training.local_batch_size", "16", *variant]
    full_run = run_train([*args, "--job.dump_folder", str(tmp_path / "full")])
    full = read_metrics(tmp_path / "full")
    eps = [m["dp_epsilon"] for m in full]
    assert all(b > a > 0 for a, b in zip(eps, eps[1:]))  # privacy spent grows every step

    resumed = tmp_path / "resumed"
    shutil.copytree(tmp_path / "full" / "checkpoint" / "step-2", resumed / "checkpoint" / "step-2")
    second = run_train([*args, "--job.dump_folder", str(resumed)])
    assert [[m[k] for k in DP_KEYS] for m in read_metrics(resumed)] == [[m[k] for k in DP_KEYS] for m in full[2:]]
    if "--dp.target_epsilon" in variant:
        sigma = re.search(r"dp: noise_multiplier (\S+) reaches epsilon 2.0", full_run.stderr).group(1)
        assert f"dp: resumed with the recorded noise_multiplier {sigma} (calibrated for epsilon 2" in second.stderr
        assert 2.0 - 0.01 <= eps[-1] <= 2.0
        return
    capsys.readouterr()
    assert train_in_process([*args, "--job.dump_folder", str(resumed), "--dp.enable", "false"]) == 2
    assert (f"error: checkpoint {resumed / 'checkpoint' / 'step-4'}: it was written with DP-SGD on (dp.enable true) "
            "and this run has dp.enable false") in capsys.readouterr().err  # fmt: skip


def test_dp_run_logs_the_per_sample_norms_and_the_noised_grad_norm(tmp_path, train_in_process, capsys, monkeypatch):
    """Poisson batches (mostly padding here), two steps per log: the statistics' keys in every record, no
    `grad_norm`, and the clipped fraction in closed form at a tiny C (every sample) and a huge one (none). The
    logged loss is the mean over the samples the step drew; in the second run step 2 draws none: its loss is null
    (it was a bare NaN in metrics.jsonl) and the record counts the window's empty steps. Resumed with dp.enable
    false, the checkpoint is refused by name (it used to fail on a missing loader key); with
    dp.continue_without_privacy it trains on without DP."""
    poisson = [*DP, "--training.local_batch_size", "16", "--dp.sampling", "poisson", "--metrics.log_freq", "2"]
    tiny = tmp_path / "1e-6"
    result = run_train([*poisson, "--dp.max_grad_norm", "1e-6", "--checkpoint.enable", "false",
                        "--job.dump_folder", str(tiny)])  # fmt: skip
    assert "noised_grad_norm" in result.stderr and "sample_norm mean" in result.stderr  # the console line

    drawn = {}  # step -> the losses of the samples it drew
    forward_backward = Trainer.forward_backward

    def recording(self, batch, micro=0):
        losses = forward_backward(self, batch, micro)
        drawn[self.step + 1] = losses[batch[2]]
        return losses

    draw = PoissonBatchSampler.batch
    monkeypatch.setattr(Trainer, "forward_backward", recording)
    monkeypatch.setattr(PoissonBatchSampler, "batch", lambda self, step: [] if step == 1 else draw(self, step))
    huge = [*poisson, "--dp.max_grad_norm", "1e6", "--job.dump_folder", str(tmp_path / "1e6")]
    capsys.readouterr()
    assert train_in_process(huge) == 0
    monkeypatch.undo()
    console = re.sub(r"\x1b\[[0-9;]*m", "", capsys.readouterr().err)  # colors off
    assert re.search(r"step +2  empty step: drew no sample, no loss  .*  empty steps 1\n", console)
    for folder, fraction in ((tiny, 1.0), (tmp_path / "1e6", 0.0)):
        lines = (folder / "metrics.jsonl").read_text().splitlines()
        metrics = [json.loads(line, parse_constant=lambda c: pytest.fail(f"{c} in metrics.jsonl")) for line in lines]
        assert [m["step"] for m in metrics] == [2, 4]
        for m in metrics:
            assert "grad_norm" not in m  # under DP the logged norm is named for what it is
            assert all(
                math.isfinite(m[k]) and m[k] > 0 for k in DP_KEYS if k != "dp_clipped_fraction" and m[k] is not None
            )
            assert m["dp_clipped_fraction"] == fraction
    assert [(m["dp_empty_steps"], len(drawn[m["step"]])) for m in metrics] == [(1, 0), (0, len(drawn[4]))]
    assert metrics[0]["loss"] is None  # step 2 drew nothing
    for m in metrics[1:]:  # the mean over the drawn samples, not their sum over the expected batch (16)
        assert m["loss"] == pytest.approx(drawn[m["step"]].mean().item(), rel=1e-6)
        assert len(drawn[m["step"]]) != 16

    capsys.readouterr()
    off = [*huge, "--dp.enable", "false", "--training.steps", "5"]
    assert train_in_process(off) == 2
    assert "it was written with DP-SGD on (dp.enable true) and this run has dp.enable false" in capsys.readouterr().err
    gc.collect()  # the refused Trainer holds the run folder's lock until it is collected
    assert train_in_process([*off, "--dp.continue_without_privacy", "true"]) == 0
    assert "a Poisson sampler's step (4), which shuffled batches cannot continue" in capsys.readouterr().err
    last = read_metrics(tmp_path / "1e6")[-1]
    assert last["step"] == 5 and math.isfinite(last["loss"]) and "grad_norm" in last and "dp_epsilon" not in last


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


def _private(total_steps: int, target_epsilon: float = 2.0, noise_multiplier: float = 1.0, accountant: str = "rdp",
             state: dict | None = None, seq_len: int = 0) -> PrivateTraining:  # fmt: skip
    """A run's PrivateTraining at q = 16 / 1000, resumed from `state` if given (as the checkpoint load does)."""
    dp = JobConfig().dp
    dp.mode, dp.accountant = "ghost", accountant
    dp.target_epsilon, dp.noise_multiplier = target_epsilon, noise_multiplier
    private = PrivateTraining(dp, nn.Linear(2, 1), dataset_size=1000, global_batch=16, total_steps=total_steps,
                              mesh=None, seed=0, seq_len=seq_len)  # fmt: skip
    if state is not None:
        private.load_state_dict(state)
    return private


def _train_in_pieces(pieces: list[tuple[int, int, float]]) -> PrivateTraining:
    """Runs of (training.steps, the step it stops at, dp.target_epsilon), each resumed from the last one's state."""
    private = None
    for total, stop, target in pieces:
        private = _private(total, target, state=None if private is None else private.state_dict())
        assert private.engine.noise_multiplier == private.accountant.noise_multiplier == private.noise_multiplier
        for _ in range(stop - private.accountant.steps):
            private.step_done()
    return private


def test_a_run_resumed_in_pieces_ends_within_its_privacy_budget():
    """Unchanged config: the recorded sigma, so the very epsilon of the unbroken run. Steps or target changed: sigma
    for the remaining steps over the recorded history, so the whole run ends within [target - 0.01, target] (the
    issue's case: 4 steps, then resumed with training.steps 6, ended at 2.028 > 2.0)."""
    unbroken = _train_in_pieces([(6, 6, 2.0)])
    split = _train_in_pieces([(6, 2, 2.0), (6, 5, 2.0), (6, 6, 2.0)])
    assert split.accountant.get_epsilon(1e-5) == unbroken.accountant.get_epsilon(1e-5)
    assert split.accountant.history == unbroken.accountant.history == [(unbroken.noise_multiplier, 0.016, 6)]
    for pieces in ([(4, 4, 2.0), (6, 6, 2.0)], [(6, 3, 2.0), (12, 7, 2.5), (9, 9, 2.5)]):
        private = _train_in_pieces(pieces)
        target = pieces[-1][2]
        assert target - 0.01 <= private.accountant.get_epsilon(1e-5) <= target, pieces
        assert len(private.accountant.history) == len(pieces), pieces  # each piece its own sigma
        assert private.state_dict()["calibration"]["total_steps"] == pieces[-1][0]


def test_resume_reuses_the_recorded_noise_multiplier():
    """The recorded sigma wins over the fresh calibration when nothing it was calibrated for changed (even if they
    differ, e.g. another Opacus); a fixed dp.noise_multiplier is used as configured whatever the checkpoint had."""
    state = _private(6).state_dict()
    state["calibration"]["noise_multiplier"] = 1.2345
    resumed = _private(6, state=state)
    assert resumed.engine.noise_multiplier == resumed.accountant.noise_multiplier == 1.2345
    fixed = _private(8, target_epsilon=0.0, noise_multiplier=0.9, state=state)
    assert fixed.engine.noise_multiplier == fixed.accountant.noise_multiplier == 0.9
    # A checkpoint written before the record was kept: the rest is recalibrated over its history, within target.
    first = _private(6)
    for _ in range(3):
        first.step_done()
    old = first.state_dict()
    del old["calibration"]
    resumed = _private(6, state=old)
    for _ in range(3):
        resumed.step_done()
    assert 2.0 - 0.01 <= resumed.accountant.get_epsilon(1e-5) <= 2.0


def test_resume_past_the_privacy_budget_is_refused():
    spent = _private(4, target_epsilon=0.0, noise_multiplier=0.5)  # 4 steps at sigma 0.5 spend more than 2
    for _ in range(4):
        spent.step_done()
    epsilon = spent.accountant.get_epsilon(1e-5)
    with pytest.raises(ResumeRefusedError) as refused:
        _private(6, target_epsilon=2.0, state=spent.state_dict())
    assert str(refused.value) == (
        f"dp.target_epsilon: the privacy budget is spent (4 steps done spent epsilon {epsilon:.4f} at delta 1e-05, "
        "dp.target_epsilon is 2, 2 of training.steps 6 remain); raise dp.target_epsilon or train no further"
    )
    assert epsilon > 2.0
    with pytest.raises(ResumeRefusedError, match="dp.accountant: the checkpoint's privacy was accounted with 'rdp'"):
        _private(6, target_epsilon=0.0, accountant="prv", state=spent.state_dict())


def test_a_target_epsilon_no_noise_reaches_is_refused_by_name():
    """A fresh run whose dp.target_epsilon no noise multiplier reaches: one error naming the key and the smallest
    epsilon the run can reach (it was a raw ValueError). Under RDP that is the conversion's floor as sigma grows:
    Opacus's largest order, alpha = 63, gives log(62 / 63) - (log(delta) + log(63)) / 62 = 0.10287 at delta 1e-5,
    whatever the steps (the accountant's epsilon at sigma 1e6 is within 1e-8 of it)."""
    floor = math.log(62 / 63) - (math.log(1e-5) + math.log(63)) / 62
    assert f"{floor:.5f}" == "0.10287"
    with pytest.raises(ConfigError) as refused:
        _private(4, target_epsilon=0.01)
    assert str(refused.value) == (
        "dp.target_epsilon = 0.01: no noise multiplier up to 1e+06 reaches epsilon 0.01 at delta 1e-05; the smallest "
        "epsilon this run can reach, the rdp accountant's at noise multiplier 1e+06, is 0.10287 (4 steps at sample "
        "rate 0.016); raise dp.target_epsilon to 0.1029 or more (or dp.delta)"
    )
    assert 0.1029 - 0.01 <= _train_in_pieces([(4, 4, 0.1029)]).accountant.get_epsilon(1e-5) <= 0.1029


def _one_step(private: PrivateTraining) -> None:
    """A clipped, noised backward of the nn.Linear(2, 1) of `_private` on 4 samples, and the step's accounting."""
    model = private.engine.model
    private.backward(model(torch.ones(4, 2)).square().squeeze(1), None, last_micro_batch=True)
    private.step_done()


def test_a_resume_logs_only_the_noise_multiplier_it_uses(caplog):
    """A fresh run logs its calibrated sigma once; a resume logs the sigma it continues with, never the fresh
    calibration first (it logged both: "noise_multiplier 1.1 reaches epsilon 2" and then "1.2 -> 1.3")."""

    def sigmas_logged(build) -> tuple[PrivateTraining, list[str]]:
        caplog.clear()
        with caplog.at_level("INFO", logger=logger.name):
            private = build()
            _one_step(private)
            _one_step(private)
        return private, [r.getMessage() for r in caplog.records if re.search(r"sigma|noise_multiplier", r.getMessage())]

    fresh, logged = sigmas_logged(lambda: _private(6))
    assert logged == [f"dp: noise_multiplier {fresh.noise_multiplier:.4f} reaches epsilon 2.0 at delta 1e-05 after 6 "
                      "steps"]  # fmt: skip
    state = fresh.state_dict()
    resumed, logged = sigmas_logged(lambda: _private(8, state=state))
    assert logged == [f"dp: resumed with a changed config (training.steps 6 -> 8): noise_multiplier "
                      f"{fresh.noise_multiplier:.4f} -> {resumed.noise_multiplier:.4f} for the remaining 6 steps, so "
                      "that the whole run ends at epsilon 2 or below (2 steps done spent "
                      f"{fresh.accountant.get_epsilon(1e-5):.4f})"]  # fmt: skip
    _, logged = sigmas_logged(lambda: _private(8, state=resumed.state_dict()))
    assert logged == [f"dp: resumed with the recorded noise_multiplier {resumed.noise_multiplier:.4f} (calibrated for "
                      "epsilon 2 after 8 steps)"]  # fmt: skip
    _, logged = sigmas_logged(lambda: _private(8, target_epsilon=0.0, noise_multiplier=0.9, state=state))
    assert logged == ["dp: mode ghost, C 1.0, sigma 0.9000, q 0.016, rdp accountant, shuffled fixed-size batches: "
                      "epsilon is the customary approximation, not a guarantee"]  # fmt: skip


def test_a_language_model_resumed_with_another_seq_len_is_told_its_privacy_unit_changed(caplog):
    """The privacy unit of an LM under DP-SGD is one example, a window of training.seq_len tokens: a resume with
    another seq_len changes it, which the warning says (it said only that the data position restarts)."""
    first = _private(6, seq_len=1024)
    for _ in range(2):
        first.step_done()
    with caplog.at_level("WARNING", logger=logger.name):
        _private(6, state=first.state_dict(), seq_len=1024)
        warned = lambda: [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]  # noqa: E731
        assert not [m for m in warned() if m.startswith("dp: ")]  # the same unit: nothing to say
        _private(6, state=first.state_dict(), seq_len=512)
    assert [m for m in warned() if m.startswith("dp: ")] == [
        "dp: training.seq_len changed (1024 -> 512), and with it the privacy unit, one example: the 2 steps done "
        "protected windows of 1024 tokens, the steps to come protect windows of 512. The logged epsilon composes the "
        "two as if they protected one unit, which holds for neither window length: a window of one length can span "
        "two windows of the other, where the guarantee is group privacy's (weaker)"
    ]


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
        # A step is empty when no rank drew a sample: here step 2 only (in step 1 rank 1 drew one, rank 0 none).
        private = _private(3, target_epsilon=0.0)
        for drawn in ([[0, 0], [1, 0]], [[0, 0], [0, 0]], [[1, 1], [1, 0]]):
            mask = torch.tensor(drawn[rank], dtype=torch.bool)
            private.backward(private.engine.model(torch.ones(2, 2)).square().squeeze(1), mask, last_micro_batch=True)
        assert private.metrics(dist.group.WORLD)["dp_empty_steps"] == 1
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
