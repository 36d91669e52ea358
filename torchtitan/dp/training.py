"""The trainer's side of DP-SGD: the `[dp]` config -> engine, accountant, and their checkpointed state; the
per-sample gradient norm statistics the logs show (what `dp.max_grad_norm` is tuned by)."""

import torch
import torch.distributed as dist
from torch import nn

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
    """

    def __init__(self, dp_config, model: nn.Module, dataset_size: int, global_batch: int, total_steps: int, mesh,
                 seed: int):  # fmt: skip
        from torchtitan.dp import DPEngine, PrivacyAccountant, calibrate_noise_multiplier

        self.config = dp_config
        self.sample_rate = global_batch / dataset_size
        sigma = dp_config.noise_multiplier
        if dp_config.target_epsilon > 0:
            sigma = calibrate_noise_multiplier(dp_config.target_epsilon, dp_config.delta, self.sample_rate,
                                               total_steps, dp_config.accountant)  # fmt: skip
            logger.info(f"dp: noise_multiplier {sigma:.4f} reaches epsilon {dp_config.target_epsilon} at delta "
                        f"{dp_config.delta} after {total_steps} steps")  # fmt: skip
        self.engine = DPEngine(model, dp_config.mode, dp_config.max_grad_norm, sigma, global_batch_size=global_batch,
                               dp_mesh=mesh, seed=seed)  # fmt: skip
        self.accountant = PrivacyAccountant(self.sample_rate, sigma, dp_config.accountant, dp_config.sampling)
        # (norms, mask) of each micro-batch since the last metrics(), kept on the device: reading them every step
        # would sync the host with the GPU.
        self._norms: list[tuple[torch.Tensor, torch.Tensor | None]] = []
        assumption = (
            "Poisson sampling: the accountant's assumption holds"
            if dp_config.sampling == "poisson"
            else "shuffled fixed-size batches: epsilon is the customary approximation, not a guarantee"
        )
        logger.info(f"dp: mode {dp_config.mode}, C {dp_config.max_grad_norm}, sigma {sigma:.4f}, "
                    f"q {self.sample_rate:.3g}, {dp_config.accountant} accountant, {assumption}")  # fmt: skip

    def backward(self, losses: torch.Tensor, mask: torch.Tensor | None, last_micro_batch: bool,
                 on_norms=None) -> None:  # fmt: skip
        """Clipped, noised backward; the noise comes once per optimizer step (with the last micro-batch). Keeps the
        per-sample norms for `metrics()`. `on_norms` is called between the norm pass and the clipped gradients (the
        step's "dp_norms" stage)."""
        norms = self.engine.backward(losses, mask=mask, add_noise=last_micro_batch, on_norms=on_norms)
        if norms is not None:  # (B,) per sample, also with augmult's (B, K) losses
            self._norms.append((norms.detach().float(), mask))

    @property
    def noised(self) -> bool:
        """Whether the gradients the optimizer applies are clipped and noised ("vanilla" is the plain backward)."""
        return self.engine.mode != "vanilla"

    def step_done(self) -> None:
        self.accountant.step()

    def metrics(self, group: dist.ProcessGroup | None = None) -> dict:
        """Epsilon spent so far, and the statistics of the per-sample gradient norms before clipping over every
        sample since the last call (every micro-batch and step, every rank of `group`; Poisson padding left out):
        dp_grad_norm_mean, dp_grad_norm_p95 and dp_clipped_fraction (norm > dp.max_grad_norm). A collective when
        `group` spans several ranks: every rank calls it at the same step."""
        out = {"dp_epsilon": self.accountant.get_epsilon(self.config.delta)}
        if self._norms:
            norms = torch.cat([n for n, _ in self._norms])  # (micro-batches x B,)
            kept = torch.cat([torch.ones_like(n, dtype=torch.bool) if m is None else m.to(n.device, torch.bool)
                              for n, m in self._norms])  # fmt: skip
            self._norms = []
            out.update(norm_statistics(gather_kept(norms, kept, group), self.config.max_grad_norm))
        return out

    def state_dict(self) -> dict:
        return {"engine": self.engine.state_dict(), "accountant": self.accountant.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.engine.load_state_dict(state["engine"])
        self.accountant.load_state_dict(state["accountant"])


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
