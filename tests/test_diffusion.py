"""Objectives: per-sample losses against closed forms; samplers recover a known Gaussian target."""

import math

import pytest
import torch

from torchtitan.diffusion import GaussianDiffusion, RectifiedFlow, drop_labels, guided, sample_images


def zero_model(x, t, y):
    return torch.zeros_like(x)


def test_ddpm_loss_closed_form():
    diffusion = GaussianDiffusion(1000, "linear")
    torch.manual_seed(0)
    x0, noise = torch.rand(4, 2, 3, 3) * 2 - 1, torch.randn(4, 2, 3, 3)
    t = torch.tensor([0, 10, 500, 999])
    loss, t_frac = diffusion.training_losses(zero_model, x0, None, t=t, noise=noise)
    torch.testing.assert_close(loss, noise.pow(2).flatten(1).mean(1))  # predicting 0 costs E[eps^2]
    torch.testing.assert_close(t_frac, t.float() / 1000)

    # A model returning x_t: loss = mean((eps - sqrt(a) x0 - sqrt(1 - a) eps)^2), a = prod(1 - beta).
    betas = torch.linspace(1e-4, 0.02, 1000, dtype=torch.float64)
    a = torch.cumprod(1 - betas, 0)[t].float().view(-1, 1, 1, 1)
    expected = (noise - a.sqrt() * x0 - (1 - a).sqrt() * noise).pow(2).flatten(1).mean(1)
    loss, _ = diffusion.training_losses(lambda x, t, y: x, x0, None, t=t, noise=noise)
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)


def test_ddpm_learned_sigma_adds_vb_term():
    diffusion = GaussianDiffusion(1000, "linear", learn_sigma=True)
    x0, noise = torch.rand(3, 1, 4, 4) * 2 - 1, torch.randn(3, 1, 4, 4)
    t = torch.tensor([0, 100, 900])
    perfect = lambda x, t, y: torch.cat([noise, torch.zeros_like(noise)], 1)  # exact epsilon
    loss, _ = diffusion.training_losses(perfect, x0, None, t=t, noise=noise)
    # With the exact epsilon the mean is exact, and the KL term (t > 0) is the variance mismatch only:
    # KL(N(m, s1) || N(m, s2)) per element with s2 the interpolation midpoint, in bits.
    table = diffusion.table
    post_logvar = table["posterior_log_variance_clipped"][t[1:]]
    mid_logvar = 0.5 * (torch.log(table["betas"][t[1:]]) + post_logvar)
    kl_bits = 0.5 * (-1 + mid_logvar - post_logvar + torch.exp(post_logvar - mid_logvar)) / math.log(2)
    torch.testing.assert_close(loss[1:], kl_bits.float(), rtol=1e-3, atol=1e-5)
    assert loss[0] > 0  # t = 0 is the discretized decoder NLL


def float64_ddpm_loss(x0, noise, eps, var_values, t):
    """The learned-sigma DDPM loss (MSE + variational bound in bits), everything in float64 from first principles."""
    x0, noise, eps, var_values = (v.double() for v in (x0, noise, eps, var_values))
    betas = torch.linspace(1e-4, 0.02, 1000, dtype=torch.float64)
    a_all = torch.cumprod(1 - betas, 0)
    a_prev_all = torch.cat([torch.ones(1, dtype=torch.float64), a_all[:-1]])
    post_var = betas * (1 - a_prev_all) / (1 - a_all)
    a, a_prev, beta = (v[t].view(-1, 1, 1, 1) for v in (a_all, a_prev_all, betas))
    post_logvar = torch.log(post_var[t.clamp(min=1)]).view(-1, 1, 1, 1)  # clipped to t = 1's at t = 0
    x_t = a.sqrt() * x0 + (1 - a).sqrt() * noise
    pred_x0 = (x_t - (1 - a).sqrt() * eps) / a.sqrt()
    coef1, coef2 = beta * a_prev.sqrt() / (1 - a), (1 - a_prev) * (1 - beta).sqrt() / (1 - a)
    true_mean, mean = coef1 * x0 + coef2 * x_t, coef1 * pred_x0 + coef2 * x_t
    frac = (var_values + 1) / 2
    logvar = frac * torch.log(beta) + (1 - frac) * post_logvar
    kl = 0.5 * (-1 + logvar - post_logvar + torch.exp(post_logvar - logvar) + (true_mean - mean) ** 2 / logvar.exp())

    def cdf(v):  # ADM's tanh approximation of the normal CDF: part of the loss's definition
        return 0.5 * (1 + torch.tanh(math.sqrt(2 / math.pi) * (v + 0.044715 * v**3)))

    z_plus, z_min = ((x0 - mean + d) * torch.exp(-0.5 * logvar) for d in (1 / 255, -1 / 255))
    log_bin_mass = (cdf(z_plus) - cdf(z_min)).log()  # the 1/127.5-wide bin around x0; the edge bins are open
    log_prob = torch.where(
        x0 < -0.999, cdf(z_plus).log(), torch.where(x0 > 0.999, (1 - cdf(z_min)).log(), log_bin_mass)
    )
    vb = torch.where(t == 0, -log_prob.flatten(1).mean(1), kl.flatten(1).mean(1)) / math.log(2)
    return (noise - eps).pow(2).flatten(1).mean(1) + vb


def test_ddpm_learned_sigma_loss_matches_float64_at_small_t():
    # Near t = 0, 1 - alphas_cumprod is ~1e-4: tables rounded to float32 before that subtraction put the loss
    # 1e-5 to 1e-4 (relative) off this float64 value; float64 tables and a KL formed from the mean and
    # log-variance gaps leave float32 arithmetic's ~1e-7.
    g = torch.Generator().manual_seed(0)
    x0 = torch.rand(4, 3, 8, 8, generator=g) * 2 - 1
    noise = torch.randn(4, 3, 8, 8, generator=g)
    eps = noise + torch.randn(4, 3, 8, 8, generator=g)  # an untrained model; 10 seeds: within 4.1e-7
    var_values = torch.rand(4, 3, 8, 8, generator=g) * 2 - 1
    t = torch.tensor([0, 1, 2, 10])
    diffusion = GaussianDiffusion(1000, "linear", learn_sigma=True)
    loss, _ = diffusion.training_losses(lambda x, t, y: torch.cat([eps, var_values], 1), x0, None, t=t, noise=noise)
    expected = float64_ddpm_loss(x0, noise, eps, var_values, t)
    torch.testing.assert_close(loss.double(), expected, rtol=1e-6, atol=0)


def test_rectified_flow_loss_closed_form():
    flow = RectifiedFlow()
    x0, noise = torch.randn(5, 3, 2, 2), torch.randn(5, 3, 2, 2)
    t = torch.tensor([0.0, 0.25, 0.5, 0.75, 1.0])
    loss, t_out = flow.training_losses(zero_model, x0, None, t=t, noise=noise)
    torch.testing.assert_close(loss, (noise - x0).pow(2).flatten(1).mean(1))
    torch.testing.assert_close(t_out, t)
    # The model sees t scaled to the DDPM range.
    seen = []
    flow.training_losses(lambda x, t, y: seen.append(t) or torch.zeros_like(x), x0, None, t=t, noise=noise)
    torch.testing.assert_close(seen[0], t * 1000)


def test_logit_normal_timesteps_concentrate_in_the_middle():
    torch.manual_seed(0)
    t = RectifiedFlow("logit_normal").sample_timesteps(20000, torch.device("cpu"))
    assert 0 < t.min() and t.max() < 1
    assert abs(t.mean() - 0.5) < 0.01 and ((t > 0.25) & (t < 0.75)).float().mean() > 0.6


MU, STD = 0.7, 0.3  # target data distribution: N(MU, STD^2) per element


def optimal_epsilon(diffusion):
    """E[eps | x_t] for Gaussian data: the exact DDPM denoiser."""

    def fn(x, t, y):
        a = diffusion.table["alphas_cumprod"].float()[t].view(-1, 1, 1, 1)
        return (1 - a).sqrt() * (x - a.sqrt() * MU) / (a * STD**2 + 1 - a)

    return fn


def optimal_velocity(x, t_model, y):
    """E[eps - x0 | x_t] for Gaussian data, x_t = (1 - t) x0 + t eps."""
    t = (t_model / 1000).view(-1, 1, 1, 1)
    var = (1 - t) ** 2 * STD**2 + t**2
    return -MU + (t - (1 - t) * STD**2) / var * (x - (1 - t) * MU)


@pytest.mark.parametrize("sampler", ["ddim", "euler", "heun"])
def test_sampler_recovers_gaussian_target(sampler):
    torch.manual_seed(0)
    noise = torch.randn(4000, 1, 2, 2)
    if sampler == "ddim":
        diffusion = GaussianDiffusion(1000, "linear")
        samples = sample_images(diffusion, optimal_epsilon(diffusion), noise, None, steps=100, sampler="ddim")
    else:
        samples = sample_images(RectifiedFlow(), optimal_velocity, noise, None, steps=100, sampler=sampler)
    assert samples.mean().item() == pytest.approx(MU, abs=0.01)
    assert samples.std().item() == pytest.approx(STD, abs=0.02)


def test_cfg_combines_conditional_and_unconditional():
    def model(x, t, y):  # conditional output = label, unconditional (null = 9) = 0; extra channel kept
        value = torch.where(y == 9, 0.0, y.float()).view(-1, 1, 1, 1)
        return torch.cat([value.expand_as(x), torch.full_like(x, 7.0)], 1)

    fn = guided(model, cfg_scale=3.0, null_class=9, guide_channels=1)
    out = fn(torch.zeros(2, 1, 2, 2), torch.zeros(2), torch.tensor([1, 2]))
    torch.testing.assert_close(out[:, 0, 0, 0], torch.tensor([3.0, 6.0]))  # 0 + 3 * (y - 0)
    torch.testing.assert_close(out[:, 1], torch.full((2, 2, 2), 7.0))


def test_drop_labels_rate():
    torch.manual_seed(0)
    y = drop_labels(torch.zeros(10000, dtype=torch.long), 0.1, null_class=10)
    assert (y == 10).float().mean().item() == pytest.approx(0.1, abs=0.01)
