"""Privacy accounting (Opacus's accountants through our wrapper) and Poisson sampling."""

import pytest
import torch
from opacus.accountants import PRVAccountant, RDPAccountant
from opacus.accountants.utils import get_noise_multiplier

from torchtitan.dp import PoissonBatchSampler, PrivacyAccountant, calibrate_noise_multiplier, pad_batch
from torchtitan.dp.accountant import calibrate_remaining_noise_multiplier


@pytest.mark.parametrize("name, opacus_cls, steps", [("rdp", RDPAccountant, 300), ("prv", PRVAccountant, 30)])
def test_epsilon_equals_opacus(name, opacus_cls, steps):
    ours, theirs = PrivacyAccountant(0.01, 1.1, accountant=name), opacus_cls()
    assert ours.get_epsilon(1e-5) == 0.0
    ours.step(steps - 10)
    for _ in range(10):
        ours.step()
    for _ in range(steps):
        theirs.step(noise_multiplier=1.1, sample_rate=0.01)
    assert ours.steps == steps
    assert ours.get_epsilon(1e-5) == pytest.approx(theirs.get_epsilon(delta=1e-5), rel=1e-9)


def test_calibration_round_trips():
    sigma = calibrate_noise_multiplier(target_epsilon=3.0, delta=1e-5, sample_rate=0.02, steps=400)
    accountant = PrivacyAccountant(0.02, sigma)
    accountant.step(400)
    assert 3.0 - 0.02 <= accountant.get_epsilon(1e-5) <= 3.0


def test_calibration_over_a_history_ends_within_the_target():
    """The remaining steps' sigma after a history of other sigmas and sample rates: Opacus's accountant puts the whole
    run in [target - 0.01, target]. With no history it is Opacus's get_noise_multiplier, to its bisection's precision
    (both land in the same window)."""
    history = [(1.2, 0.02, 150), (0.9, 0.01, 100)]
    sigma = calibrate_remaining_noise_multiplier(3.0, 1e-5, history, 0.02, 150, start=1.2)
    theirs = RDPAccountant()
    theirs.history = [*history, (sigma, 0.02, 150)]
    assert 3.0 - 0.01 <= theirs.get_epsilon(1e-5) <= 3.0
    scratch = get_noise_multiplier(target_epsilon=3.0, target_delta=1e-5, sample_rate=0.02, steps=400)
    assert calibrate_noise_multiplier(3.0, 1e-5, 0.02, 400) == pytest.approx(scratch, rel=0.01)


def test_state_dict_round_trips():
    accountant = PrivacyAccountant(0.01, 1.0)
    accountant.step(50)
    restored = PrivacyAccountant(0.01, 1.0)
    restored.load_state_dict(accountant.state_dict())
    assert restored.steps == 50 and restored.get_epsilon(1e-5) == accountant.get_epsilon(1e-5)
    with pytest.raises(ValueError, match="accountant"):
        PrivacyAccountant(0.01, 1.0, accountant="prv").load_state_dict(accountant.state_dict())


def test_poisson_sampler():
    n, q, steps = 1000, 0.05, 200
    ranks = [PoissonBatchSampler(n, q, steps, seed=3, rank=r, world_size=2) for r in range(2)]
    batches = [list(s) for s in ranks]
    sizes = [len(a) + len(b) for a, b in zip(*batches)]
    assert abs(sum(sizes) / steps - q * n) < 4 * (q * n / steps) ** 0.5  # mean of Binomial(n, q)
    assert len(set(sizes)) > 1  # the batch size varies, as Poisson sampling must
    for a, b in zip(*batches):
        assert not set(a) & set(b)  # the ranks split one global batch
    # Resume: a sampler restored mid-way continues with the same batches.
    restored = PoissonBatchSampler(n, q, steps, seed=3, rank=1, world_size=2)
    restored.load_state_dict({"step": 150})
    assert list(restored) == batches[1][150:]


def test_pad_batch():
    indices, mask = pad_batch([4, 9], 4)
    assert indices == [4, 9, 0, 0] and mask.tolist() == [True, True, False, False]
    with pytest.raises(ValueError, match="does not fit"):
        pad_batch([1, 2, 3], 2)
    assert mask.dtype == torch.bool
