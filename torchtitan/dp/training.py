"""The trainer's side of DP-SGD: the `[dp]` config -> engine, accountant, and their checkpointed state."""

import torch
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
        self.last_norms = None
        assumption = (
            "Poisson sampling: the accountant's assumption holds"
            if dp_config.sampling == "poisson"
            else "shuffled fixed-size batches: epsilon is the customary approximation, not a guarantee"
        )
        logger.info(f"dp: mode {dp_config.mode}, C {dp_config.max_grad_norm}, sigma {sigma:.4f}, "
                    f"q {self.sample_rate:.3g}, {dp_config.accountant} accountant, {assumption}")  # fmt: skip

    def backward(self, losses: torch.Tensor, mask: torch.Tensor | None, last_micro_batch: bool,
                 on_norms=None) -> None:  # fmt: skip
        """Clipped, noised backward; the noise comes once per optimizer step (with the last micro-batch).
        `on_norms` is called between the norm pass and the clipped gradients (the step's "dp_norms" stage)."""
        self.last_norms = self.engine.backward(losses, mask=mask, add_noise=last_micro_batch, on_norms=on_norms)

    def step_done(self) -> None:
        self.accountant.step()

    def metrics(self) -> dict:
        out = {"dp_epsilon": self.accountant.get_epsilon(self.config.delta)}
        if self.last_norms is not None:
            norms = self.last_norms.float()
            out["dp_grad_norm_median"] = norms.median().item()
            out["dp_clipped_fraction"] = (norms > self.config.max_grad_norm).float().mean().item()
        return out

    def state_dict(self) -> dict:
        return {"engine": self.engine.state_dict(), "accountant": self.accountant.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.engine.load_state_dict(state["engine"])
        self.accountant.load_state_dict(state["accountant"])
