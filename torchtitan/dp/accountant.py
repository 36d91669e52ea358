"""Privacy accounting through Opacus's accountants (RDP, PRV): no privacy maths of our own here.

The accountants assume Poisson subsampling: every example joins every step's batch
independently with probability `sample_rate` (sampling.PoissonBatchSampler). With shuffled
fixed-size batches the same numbers are the customary approximation, not a guarantee.
"""

import functools
import logging
import math
import warnings

from opacus.accountants import create_accountant

logger = logging.getLogger(__name__)

ACCOUNTANTS = ("rdp", "prv")
MAX_NOISE_MULTIPLIER = 1e6  # where Opacus's get_noise_multiplier gives up too


class UnreachableEpsilonError(ValueError):
    """No noise multiplier up to MAX_NOISE_MULTIPLIER keeps the run within the target epsilon.

    Attributes:
        target_epsilon, delta, accountant: what was asked.
        smallest: the epsilon the run spends at MAX_NOISE_MULTIPLIER, the least it can reach. Under RDP that is the
            floor of the conversion to (epsilon, delta) as sigma grows, min over Opacus's orders alpha of
            log((alpha - 1) / alpha) - (log(delta) + log(alpha)) / (alpha - 1) (0.10287 at delta 1e-5, from its
            largest order, 63), plus what a history spent.
    """

    def __init__(self, target_epsilon: float, delta: float, accountant: str, smallest: float):
        self.target_epsilon, self.delta, self.accountant, self.smallest = target_epsilon, delta, accountant, smallest
        super().__init__(f"no noise multiplier up to {MAX_NOISE_MULTIPLIER:g} reaches epsilon {target_epsilon:g} "
                         f"at delta {delta:g}; the smallest epsilon this run can reach, the {accountant} accountant's "
                         f"at noise multiplier {MAX_NOISE_MULTIPLIER:g}, is {smallest:.5g}")  # fmt: skip

    @property
    def reachable_target(self) -> float:
        """`smallest` rounded up to 4 decimals: a dp.target_epsilon to suggest."""
        return math.ceil(self.smallest * 1e4) / 1e4


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
    def history(self) -> list[tuple[float, float, int]]:
        """Opacus's record of the steps taken: (noise_multiplier, sample_rate, num_steps) entries."""
        return list(self._accountant.history)

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


@functools.cache  # pure, and seconds with PRV: a process that builds the same run's DP state again pays once
def calibrate_noise_multiplier(
    target_epsilon: float,
    delta: float,
    sample_rate: float,
    steps: int,
    accountant: str = "rdp",
    tolerance: float = 0.01,
) -> float:
    """A noise multiplier with which `steps` steps end at an epsilon (at delta) in [target_epsilon - tolerance,
    target_epsilon] (what Opacus's get_noise_multiplier gives, found in fewer than half of its accountant calls)."""
    return calibrate_remaining_noise_multiplier(target_epsilon, delta, [], sample_rate, steps, accountant, tolerance)


def calibrate_remaining_noise_multiplier(
    target_epsilon: float,
    delta: float,
    history: list[tuple[float, float, int]],
    sample_rate: float,
    steps: int,
    accountant: str = "rdp",
    tolerance: float = 0.01,
    start: float = 1.0,
) -> float:
    """A noise multiplier for `steps` more steps at `sample_rate` after the steps of `history` (Opacus's
    (noise_multiplier, sample_rate, num_steps) entries) with which the whole run ends at an epsilon (at delta) in
    [target_epsilon - tolerance, target_epsilon], as Opacus's get_noise_multiplier is for a run from scratch.

    Searches from `start` (the sigma so far: the answer is usually near it) for a bracket, then narrows it by regula
    falsi (Illinois); the returned sigma is always one the accountant found within the target.

    Raises:
        UnreachableEpsilonError: no noise multiplier up to MAX_NOISE_MULTIPLIER reaches target_epsilon (below the
            accountant's floor, or the history alone spends it, or nearly); it says the smallest epsilon reachable.
    """
    calculator = create_accountant(mechanism=accountant)

    def excess(sigma: float) -> float:  # the whole run's epsilon over the target
        calculator.history = [tuple(h) for h in history] + [(sigma, sample_rate, steps)]
        with warnings.catch_warnings():  # at a large sigma RDP's best order is its largest: Opacus warns, needlessly
            warnings.filterwarnings("ignore", message="Optimal order is the largest alpha")
            return float(calculator.get_epsilon(delta=delta)) - target_epsilon

    # The bracket: low spends more than the target, high does not. MAX_NOISE_MULTIPLIER itself is the last tried.
    low = high = min(float(start), MAX_NOISE_MULTIPLIER) if start > 0 else 1.0
    low_excess = high_excess = excess(high)
    while high_excess > 0:
        if high >= MAX_NOISE_MULTIPLIER:
            raise UnreachableEpsilonError(target_epsilon, delta, accountant, target_epsilon + high_excess)
        low, low_excess, high = high, high_excess, min(2 * high, MAX_NOISE_MULTIPLIER)
        high_excess = excess(high)
    while low_excess <= 0:
        if low_excess >= -tolerance:
            return low
        high, high_excess, low = low, low_excess, low / 2
        low_excess = excess(low)
    # Regula falsi on excess + tolerance / 2 (the middle of the window); Illinois: an end kept twice in a row has its
    # value halved, so a convex excess cannot pin one end.
    f_low, f_high, kept = low_excess + tolerance / 2, high_excess + tolerance / 2, 0
    for _ in range(100):
        if high_excess >= -tolerance:
            return high
        middle = high - f_high * (high - low) / (f_high - f_low)
        if not (math.isfinite(middle) and low < middle < high):
            middle = (low + high) / 2
        middle_excess = excess(middle)
        if middle_excess <= 0:
            high, high_excess, f_high = middle, middle_excess, middle_excess + tolerance / 2
            f_low, kept = (f_low / 2 if kept == -1 else f_low), -1
        else:
            low, f_low = middle, middle_excess + tolerance / 2
            f_high, kept = (f_high / 2 if kept == 1 else f_high), 1
    return high
