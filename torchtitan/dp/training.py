"""The trainer's side of DP-SGD: the `[dp]` config -> engine, accountant, and their checkpointed state (with the
noise multiplier of a resumed run, which keeps it within dp.target_epsilon); the per-sample gradient norm statistics
the logs show (what `dp.max_grad_norm` is tuned by); a DP checkpoint resumed without privacy."""

import contextlib

import torch
import torch.distributed as dist
from torch import nn

from torchtitan.components.checkpoint_reader import read_checkpoint_metadata
from torchtitan.errors import ConfigError, ResumeRefusedError
from torchtitan.tools.logging import logger


class PrivateTraining:
    """Owns the DPEngine and the privacy accountant of a run; `backward()` is the train step's one call.

    Args:
        dp_config: the `[dp]` section.
        model: the parallelized model.
        dataset_size: N, for the sample rate q = global batch / N.
        global_batch: examples per optimizer step over all ranks (expected size under Poisson).
        total_steps: training.steps (calibration of the noise to a target epsilon).
        mesh: the data-parallel DeviceMesh, or None for one process.
        seed: noise seed.
        seq_len: the tokens of a text example (a language model's privacy unit is a window of seq_len tokens),
            checkpointed: a resume with another one is told its privacy unit changed. 0 for images.
    """

    def __init__(self, dp_config, model: nn.Module, dataset_size: int, global_batch: int, total_steps: int, mesh,
                 seed: int, seq_len: int = 0):  # fmt: skip
        from torchtitan.dp import DPEngine, PrivacyAccountant, calibrate_noise_multiplier
        from torchtitan.dp.accountant import UnreachableEpsilonError

        self.config = dp_config
        self.sample_rate = global_batch / dataset_size
        self.seq_len = int(seq_len)
        sigma = dp_config.noise_multiplier
        # The calibrated sigma's log line waits for the first backward: a resume replaces sigma (and logs its own).
        self._sigma_note = None
        if dp_config.target_epsilon > 0:
            try:
                sigma = calibrate_noise_multiplier(dp_config.target_epsilon, dp_config.delta, self.sample_rate,
                                                   total_steps, dp_config.accountant)  # fmt: skip
            except UnreachableEpsilonError as e:
                raise ConfigError(f"dp.target_epsilon = {dp_config.target_epsilon:g}: "
                                  f"{unreachable(e, f'{total_steps} steps at sample rate {self.sample_rate:.3g}')}"
                                  ) from e  # fmt: skip
            self._sigma_note = (f"dp: noise_multiplier {sigma:.4f} reaches epsilon {dp_config.target_epsilon} at "
                                f"delta {dp_config.delta} after {total_steps} steps")  # fmt: skip
        # What sigma is and what it was calibrated for, checkpointed: a resume reuses it, or recalibrates the rest.
        self.calibration = {"noise_multiplier": float(sigma), "target_epsilon": float(dp_config.target_epsilon),
                            "delta": float(dp_config.delta), "total_steps": int(total_steps),
                            "sample_rate": float(self.sample_rate), "accountant": dp_config.accountant,
                            "configured_noise_multiplier": float(dp_config.noise_multiplier)}  # fmt: skip
        self.engine = DPEngine(model, dp_config.mode, dp_config.max_grad_norm, sigma, global_batch_size=global_batch,
                               dp_mesh=mesh, seed=seed, augmult=dp_config.augmult)  # fmt: skip
        self.accountant = PrivacyAccountant(self.sample_rate, sigma, dp_config.accountant, dp_config.sampling)
        # (norms, mask) of each micro-batch since the last metrics(), kept on the device: reading them every step
        # would sync the host with the GPU.
        self._norms: list[tuple[torch.Tensor, torch.Tensor | None]] = []
        # The samples each Poisson step drew on this rank (one micro-batch a step), on the device too: summed over
        # the ranks in metrics(), they count the steps that drew none.
        self._drawn: list[torch.Tensor] = []
        assumption = (
            "Poisson sampling: the accountant's assumption holds"
            if dp_config.sampling == "poisson"
            else "shuffled fixed-size batches: epsilon is the customary approximation, not a guarantee"
        )
        fixed = "" if self._sigma_note else f"sigma {sigma:.4f}, "  # a fixed dp.noise_multiplier is the one used
        logger.info(f"dp: mode {dp_config.mode}, C {dp_config.max_grad_norm}, {fixed}q {self.sample_rate:.3g}, "
                    f"{dp_config.accountant} accountant, {assumption}")  # fmt: skip

    def backward(self, losses: torch.Tensor, mask: torch.Tensor | None, last_micro_batch: bool,
                 on_norms=None) -> None:  # fmt: skip
        """Clipped, noised backward; the noise comes once per optimizer step (with the last micro-batch). Keeps the
        per-sample norms for `metrics()`. `on_norms` is called between the norm pass and the clipped gradients (the
        step's "dp_norms" stage)."""
        if self._sigma_note:  # no checkpoint replaced the calibrated sigma: it is the one used
            logger.info(self._sigma_note)
            self._sigma_note = None
        norms = self.engine.backward(losses, mask=mask, add_noise=last_micro_batch, on_norms=on_norms)
        if norms is not None:  # (B,) per sample, also with augmult's (B, K) losses
            self._norms.append((norms.detach().float(), mask))
        if mask is not None:
            self._drawn.append(mask.sum())

    @property
    def noised(self) -> bool:
        """Whether the gradients the optimizer applies are clipped and noised ("vanilla" is the plain backward)."""
        return self.engine.mode != "vanilla"

    def step_done(self) -> None:
        self.accountant.step()

    def metrics(self, group: dist.ProcessGroup | None = None) -> dict:
        """Epsilon spent so far, and the statistics of the per-sample gradient norms before clipping over every
        sample since the last call (every micro-batch and step, every rank of `group`; Poisson padding left out):
        dp_grad_norm_mean, dp_grad_norm_p95 and dp_clipped_fraction (norm > dp.max_grad_norm); under Poisson
        sampling dp_empty_steps, the steps since the last call that drew no sample on any rank. A collective when
        `group` spans several ranks: every rank calls it at the same step."""
        out = {"dp_epsilon": self.accountant.get_epsilon(self.config.delta)}
        if self._norms:
            norms = torch.cat([n for n, _ in self._norms])  # (micro-batches x B,)
            kept = torch.cat([torch.ones_like(n, dtype=torch.bool) if m is None else m.to(n.device, torch.bool)
                              for n, m in self._norms])  # fmt: skip
            self._norms = []
            out.update(norm_statistics(gather_kept(norms, kept, group), self.config.max_grad_norm))
        if self._drawn:
            drawn = torch.stack(self._drawn)  # (steps,) on this rank
            self._drawn = []
            if group is not None and dist.is_initialized() and dist.get_world_size(group) > 1:
                dist.all_reduce(drawn, group=group)
            out["dp_empty_steps"] = int((drawn == 0).sum())
        return out

    @property
    def noise_multiplier(self) -> float:
        """Sigma of the steps to come (the engine's noise and the accountant's record use the same)."""
        return self.engine.noise_multiplier

    optional_keys = ("calibration", "seq_len")  # checkpoints written before they were recorded resume too

    def state_dict(self) -> dict:
        return {"engine": self.engine.state_dict(), "accountant": self.accountant.state_dict(),
                "calibration": dict(self.calibration), "seq_len": self.seq_len}  # fmt: skip

    def load_state_dict(self, state: dict) -> None:
        """Restores the noise state and the accountant's history, then the noise multiplier of the steps to come:
        the recorded one when what it was calibrated for did not change (a resume is then exact), else one
        calibrated for the remaining steps over the recorded history (resume_noise_multiplier).

        Raises:
            ResumeRefusedError: the checkpoint used another accountant, or the privacy budget cannot be kept.
        """
        if state["accountant"]["accountant"] != self.config.accountant:
            raise ResumeRefusedError(f"dp.accountant: the checkpoint's privacy was accounted with "
                                     f"{state['accountant']['accountant']!r}, this run has "
                                     f"{self.config.accountant!r}")  # fmt: skip
        self.engine.load_state_dict(state["engine"])
        self.accountant.load_state_dict(state["accountant"])
        self._warn_if_the_unit_changed(int(state.get("seq_len", 0)))
        if self.config.target_epsilon > 0:  # a fixed dp.noise_multiplier is used as configured
            self._sigma_note = None  # resume_noise_multiplier logs the sigma the run continues with
            self._set_noise_multiplier(resume_noise_multiplier(state.get("calibration"), self.calibration,
                                                               self.accountant))  # fmt: skip

    def _warn_if_the_unit_changed(self, saved_seq_len: int) -> None:
        """A language model's example, the unit DP-SGD protects, is a window of training.seq_len tokens."""
        if saved_seq_len and self.seq_len and saved_seq_len != self.seq_len:
            logger.warning(f"dp: training.seq_len changed ({saved_seq_len} -> {self.seq_len}), and with it the "
                           f"privacy unit, one example: the {self.accountant.steps} steps done protected windows of "
                           f"{saved_seq_len} tokens, the steps to come protect windows of {self.seq_len}. The logged "
                           "epsilon composes the two as if they protected one unit, which holds for neither window "
                           "length: a window of one length can span two windows of the other, where the guarantee is "
                           "group privacy's (weaker)")  # fmt: skip

    def _set_noise_multiplier(self, sigma: float) -> None:
        self.calibration["noise_multiplier"] = self.engine.noise_multiplier = float(sigma)
        self.accountant.noise_multiplier = float(sigma)


# What a calibrated sigma depends on, and the config key that sets each (for the logs and refusals).
CALIBRATED_FOR = {"target_epsilon": "dp.target_epsilon", "delta": "dp.delta", "total_steps": "training.steps",
                  "sample_rate": "sample rate (global batch / dataset size)"}  # fmt: skip


def resume_noise_multiplier(saved: dict | None, current: dict, accountant) -> float:
    """The noise multiplier for the rest of a resumed run calibrated to dp.target_epsilon.

    Args:
        saved: the checkpoint's calibration record (PrivateTraining.calibration when it was written), or None for
            a checkpoint written before it was kept (recalibrated, as for a changed config).
        current: this run's record, sigma calibrated for the whole run from scratch.
        accountant: the PrivacyAccountant, its history restored.

    Returns:
        The recorded sigma when the record's target, delta, steps and sample rate equal this run's; otherwise a
        sigma for the remaining steps with which the whole run (history included) ends within 0.01 below the target
        (calibrate_remaining_noise_multiplier); the recorded one if no step remains.

    Raises:
        ResumeRefusedError: the steps done already spend the target, or no finite sigma reaches it.
    """
    from torchtitan.dp.accountant import UnreachableEpsilonError, calibrate_remaining_noise_multiplier

    if saved is None:  # written before the record was kept: its last sigma, and the rest recalibrated
        last = accountant.history[-1][0] if accountant.history else current["noise_multiplier"]
        saved, changes = {**current, "noise_multiplier": last}, ["the checkpoint records no calibration"]
    else:
        changes = [f"{name} {saved[key]:g} -> {current[key]:g}" for key, name in CALIBRATED_FOR.items()
                   if saved[key] != current[key]]  # fmt: skip
    if not changes:
        logger.info(f"dp: resumed with the recorded noise_multiplier {saved['noise_multiplier']:.4f} (calibrated for "
                    f"epsilon {saved['target_epsilon']:g} after {saved['total_steps']} steps)")  # fmt: skip
        return saved["noise_multiplier"]
    target, delta, steps = current["target_epsilon"], current["delta"], current["total_steps"]
    done, spent = accountant.steps, accountant.get_epsilon(delta)
    remaining = steps - done
    if remaining <= 0:  # nothing left to train: the recorded sigma stands
        return saved["noise_multiplier"]
    figures = (f"{done} steps done spent epsilon {spent:.4f} at delta {delta:g}, dp.target_epsilon is {target:g}, "
               f"{remaining} of training.steps {steps} remain")  # fmt: skip
    if spent >= target:
        raise ResumeRefusedError(f"dp.target_epsilon: the privacy budget is spent ({figures}); raise "
                                 "dp.target_epsilon or train no further")  # fmt: skip
    try:
        sigma = calibrate_remaining_noise_multiplier(target, delta, accountant.history, current["sample_rate"],
                                                     remaining, current["accountant"],
                                                     start=saved["noise_multiplier"])  # fmt: skip
    except UnreachableEpsilonError as e:
        raise ResumeRefusedError(f"dp.target_epsilon: {unreachable(e, figures)}") from e
    logger.warning(f"dp: resumed with a changed config ({', '.join(changes)}): noise_multiplier "
                   f"{saved['noise_multiplier']:.4f} -> {sigma:.4f} for the remaining {remaining} steps, so that the "
                   f"whole run ends at epsilon {target:g} or below ({done} steps done spent {spent:.4f})")  # fmt: skip
    return sigma


def unreachable(error, figures: str) -> str:
    """Why no noise multiplier reaches dp.target_epsilon (an UnreachableEpsilonError), the run's `figures`, and the
    remedy: the message of a fresh run's refusal and of a resume's."""
    return f"{error} ({figures}); raise dp.target_epsilon to {error.reachable_target:g} or more (or dp.delta)"


def gather_kept(norms: torch.Tensor, kept: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """The norms of the real samples of every rank of `group`. Every rank holds as many rows (Poisson batches are
    padded to one shape), so one all_gather of equal-size tensors moves norms and masks together; the padding is
    dropped after."""
    rows = torch.stack([norms, kept.to(norms.dtype)])  # (2, n): the norms, and 1 for a real sample
    if group is not None and dist.is_initialized() and dist.get_world_size(group) > 1:
        parts = [torch.empty_like(rows) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, rows, group=group)
        rows = torch.cat(parts, dim=1)
    return rows[0][rows[1] > 0]


def norm_statistics(norms: torch.Tensor, max_grad_norm: float) -> dict:
    """Mean, 95th percentile (linear interpolation, as torch.quantile) and the fraction above the clipping norm of
    per-sample gradient norms; {} for none. Sorted by hand: torch.quantile refuses inputs over 2^24 elements."""
    if norms.numel() == 0:
        return {}
    ordered = norms.double().sort().values  # float64: the mean barely depends on the order the ranks' norms come in
    position = 0.95 * (ordered.numel() - 1)
    low, high = ordered[int(position)], ordered[min(int(position) + 1, ordered.numel() - 1)]
    p95 = low + (position - int(position)) * (high - low)
    mean, p95, clipped = torch.stack([ordered.mean(), p95, (ordered > max_grad_norm).double().mean()]).tolist()
    return {"dp_grad_norm_mean": mean, "dp_grad_norm_p95": p95, "dp_clipped_fraction": clipped}


# The refusal of a run with dp.enable false to resume a DP-SGD checkpoint (CheckpointManager's `foreign`).
DP_CHECKPOINT_WITHOUT_DP = (
    "it was written with DP-SGD on (dp.enable true) and this run has dp.enable false: resuming would drop its privacy "
    "accountant and train without privacy. Set dp.enable true to continue privately, or set "
    "dp.continue_without_privacy true to continue without privacy"
)


@contextlib.contextmanager
def resuming_without_privacy(checkpointer, load_step: int):
    """Around `checkpointer.maybe_load()` in a run with dp.enable false and dp.continue_without_privacy: resuming a
    DP-SGD checkpoint drops its privacy accountant (logged), and a Poisson-sampled one's data position, the
    sampler's step, which means nothing to the shuffled loader of a non-private run: that loader stands aside for
    the load and starts its first epoch afresh (logged)."""
    path = checkpointer.newest_complete() if load_step < 0 else checkpointer.folder / f"step-{load_step}"
    keys = []
    if path is not None and (path / ".metadata").is_file():
        keys = list(read_checkpoint_metadata(path).state_dict_metadata)
    if not any(key.startswith("dp.") for key in keys):
        yield
        return
    logger.warning(f"dp.continue_without_privacy: resuming the DP-SGD checkpoint {path} without privacy; its "
                   "privacy accountant is dropped, and what this run trains has no privacy guarantee")  # fmt: skip
    if not any(key.startswith("dataloader_rank") and key.endswith(".step") for key in keys):
        yield  # shuffled batches: the same loader state as a non-private run's
        return
    loader = checkpointer.dataloader
    position = _PoissonPosition()
    checkpointer.dataloader = position
    try:
        yield
    finally:
        checkpointer.dataloader = loader
    if position.step is not None:
        logger.warning(f"dp.continue_without_privacy: the checkpoint's data position is a Poisson sampler's step "
                       f"({position.step}), which shuffled batches cannot continue: the data order starts its "
                       "first epoch afresh")  # fmt: skip


class _PoissonPosition:
    """Takes a Poisson loader's checkpointed state (its sampler's step) in the place of another loader's."""

    def __init__(self):
        self.step = None

    def state_dict(self) -> dict:
        return {"step": 0}

    def load_state_dict(self, state: dict, same_layout: bool = True) -> None:
        self.step = int(state["step"])
