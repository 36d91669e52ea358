"""torchtitan/diffusion/noise.py: a sample's noise, starting and step noise alike, is a function of its index alone."""

import pytest
import torch

from torchtitan.diffusion import GaussianDiffusion, normal_like, sample_noise


def test_a_samples_noise_is_the_same_in_any_batch():
    """Sample i's starting noise is the same alone, in order among others, or in another batch's order; seeds and
    indices give other noise."""
    together, _ = sample_noise(3, range(5), 2, 4)
    assert together.shape == (5, 2, 4, 4)
    for i in range(5):
        assert torch.equal(sample_noise(3, [i], 2, 4)[0][0], together[i])
    shuffled, _ = sample_noise(3, [4, 0, 2], 2, 4)
    assert torch.equal(shuffled, together[[4, 0, 2]])
    assert not torch.equal(sample_noise(4, range(5), 2, 4)[0], together)  # another seed
    assert not torch.equal(together[0], together[1])


def test_stochastic_step_noise_is_each_samples_own():
    """Ancestral DDPM draws noise at every step: with the generators `sample_noise` returns, sample i ends where it
    ends alone (bitwise, fp32 on the CPU), and the step noise matters (other generators, other samples)."""
    diffusion = GaussianDiffusion(100, "linear", learn_sigma=False)

    def model(x, t, y):  # an epsilon prediction that depends on x and t
        return 0.3 * x + 1e-3 * t[:, None, None, None]

    def run(seed, indices):
        noise, generators = sample_noise(seed, indices, 2, 4)
        return diffusion.ddpm_sample(model, noise, None, steps=5, generator=generators)

    batch = run(0, range(4))
    for i in range(4):
        assert torch.equal(run(0, [i])[0], batch[i])
    assert torch.equal(run(0, [3, 1]), batch[[3, 1]])
    noise, _ = sample_noise(0, range(4), 2, 4)
    _, other_generators = sample_noise(1, range(4), 2, 4)  # the same start, other step noise
    other = diffusion.ddpm_sample(model, noise, None, steps=5, generator=other_generators)
    assert (other - batch).abs().max() > 1e-2
    with pytest.raises(ValueError, match="noise for 3 rows from 4 samples' generators"):
        normal_like(torch.zeros(3, 2), other_generators)
