"""Privacy accounting through Opacus's accountants (RDP, PRV): no privacy maths of our own here.

The accountants assume Poisson subsampling: every example joins every step's batch
independently with probability `sample_rate` (sampling.PoissonBatchSampler). With shuffled
fixed-size batches the same numbers are the customary approximation, not a guarantee.
"""

import logging

from opacus.accountants import create_accountant
from opacus.accountants.utils import get_noise_multiplier

logger = logging.getLogger(__name__)

ACCOUNTANTS = ("rdp", "prv")


class PrivacyAccountant:
    """(sample_rate, noise_multiplier, steps) -> epsilon at a delta, with an Opacus accountant.

    Args:
        sample_rate: q, the probability that an example joins a step's batch
            (expected batch size / dataset size).
        noise_multiplier: sigma of the DP-SGD steps.
        accountant: "rdp" (Mironov, 2017) or "prv" (Gopi et al., 2021; tighter, slower).
        sampling: "poisson" (what the accountant assumes) or "shuffle" (approximation).
    """

    def __init__(self, sample_rate: float, noise_multiplier: float, accountant: str = "rdp", sampling: str = "poisson"):
        if accountant not in ACCOUNTANTS:
            raise ValueError(f"accountant must be one of {ACCOUNTANTS}, got {accountant!r}")
        if not 0 < sample_rate <= 1:
            raise ValueError(f"sample_rate must be in (0, 1], got {sample_rate}")
        if sampling not in ("poisson", "shuffle"):
            raise ValueError(f"sampling must be 'poisson' or 'shuffle', got {sampling!r}")
        if sampling == "shuffle":
            logger.warning("DP accounting assumes Poisson sampling; with shuffled batches epsilon is an approximation")
        self.sample_rate, self.noise_multiplier = float(sample_rate), float(noise_multiplier)
        self.accountant_name, self.sampling = accountant, sampling
        self._accountant = create_accountant(mechanism=accountant)

    @property
    def steps(self) -> int:
        return sum(entry[2] for entry in self._accountant.history)

    def step(self, num_steps: int = 1) -> None:
        """Records `num_steps` DP-SGD steps at the current sample rate and noise multiplier."""
        history = self._accountant.history
        if history and history[-1][:2] == (self.noise_multiplier, self.sample_rate):
            history[-1] = (self.noise_multiplier, self.sample_rate, history[-1][2] + num_steps)
        else:  # Opacus's history format: (noise_multiplier, sample_rate, num_steps)
            history.append((self.noise_multiplier, self.sample_rate, num_steps))

    def get_epsilon(self, delta: float) -> float:
        """Epsilon spent so far at `delta` (0 before the first step)."""
        if not self._accountant.history:
            return 0.0
        return float(self._accountant.get_epsilon(delta=delta))

    def state_dict(self) -> dict:
        return {"accountant": self.accountant_name, "history": [list(h) for h in self._accountant.history]}

    def load_state_dict(self, state: dict) -> None:
        if state["accountant"] != self.accountant_name:
            raise ValueError(f"checkpoint used the {state['accountant']} accountant, this run {self.accountant_name}")
        self._accountant.history = [tuple(h) for h in state["history"]]


def calibrate_noise_multiplier(
    target_epsilon: float,
    delta: float,
    sample_rate: float,
    steps: int,
    accountant: str = "rdp",
    tolerance: float = 0.01,
) -> float:
    """The smallest noise multiplier (to `tolerance` in epsilon) reaching target_epsilon at delta after `steps`."""
    return float(
        get_noise_multiplier(
            target_epsilon=target_epsilon,
            target_delta=delta,
            sample_rate=sample_rate,
            steps=steps,
            accountant=accountant,
            epsilon_tolerance=tolerance,
        )
    )
