"""Objectives: per-sample losses against closed forms; samplers recover a known Gaussian target."""

import math

import pytest
import torch

from torchtitan.config_manager import ConfigError, parse_args
from torchtitan.diffusion import (
    GaussianDiffusion,
    RectifiedFlow,
    SDESettings,
    drop_labels,
    guided,
    labels_for,
    sample_images,
)
from torchtitan.diffusion.ddpm import space_timesteps
from torchtitan.diffusion.objective import LossByTimestep


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


def test_compiled_ddpm_loss_matches_eager_with_gradients():
    # compile.components "loss": the learned-sigma loss through torch.compile, its value and its gradients with
    # respect to both halves of the model's output, against the eager loss (checked against float64 above). Inductor
    # fuses the ops and may reorder float32 arithmetic: 1e-6 on values, 1e-5 on gradients.
    g = torch.Generator().manual_seed(1)
    x0, noise = torch.rand(4, 3, 8, 8, generator=g) * 2 - 1, torch.randn(4, 3, 8, 8, generator=g)
    out = torch.cat([noise + torch.randn(4, 3, 8, 8, generator=g), torch.rand(4, 3, 8, 8, generator=g) * 2 - 1], 1)
    t = torch.tensor([0, 1, 400, 999])
    results = []
    for compiled in (False, True):
        diffusion = GaussianDiffusion(1000, "linear", learn_sigma=True)
        if compiled:
            diffusion.compile_loss()
        leaf = out.clone().requires_grad_()
        loss, _ = diffusion.training_losses(lambda x, t, y, leaf=leaf: leaf * 1.0, x0, None, t=t, noise=noise)
        (grad,) = torch.autograd.grad((loss * torch.arange(1.0, 5.0)).sum(), leaf)
        results.append((loss.detach(), grad))
    (eager_loss, eager_grad), (loss, grad) = results
    assert eager_grad[:, 3:].abs().sum() > 0  # the variance half gets the bound's gradient
    torch.testing.assert_close(loss, eager_loss, rtol=1e-6, atol=0)
    torch.testing.assert_close(grad, eager_grad, rtol=1e-5, atol=1e-8)


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


@pytest.mark.parametrize(
    "options",
    [
        dict(sampler="sde"),
        dict(sampler="sde", sde=SDESettings(last_step="tweedie")),
        dict(sampler="sde", sde=SDESettings("decreasing", 1.0, "euler", 0.1)),
        dict(sampler="heun", timestep_shift=0.3),
        dict(sampler="euler", timestep_shift=3.0),
    ],
)
def test_sde_and_shifted_grids_recover_gaussian_target(options):
    """With the exact velocity of Gaussian data the SDE (each last step, two diffusion forms) and the ODE on a shifted
    grid end on the data's distribution (4000 samples, 100 steps: measured within 0.003 of the mean and 0.008 of the
    standard deviation)."""
    noise = torch.randn(4000, 1, 2, 2, generator=torch.Generator().manual_seed(0))
    generator = torch.Generator().manual_seed(1)
    samples = sample_images(RectifiedFlow(), optimal_velocity, noise, None, steps=100, generator=generator, **options)
    assert samples.mean().item() == pytest.approx(MU, abs=0.01)
    assert samples.std().item() == pytest.approx(STD, abs=0.02)


def test_sde_step_noise_comes_from_the_generator():
    """A generator draws the SDE's step noise (sample.py's batches, each with its own): the same generator state gives
    the same samples whatever the global RNG, another gives others."""
    noise = torch.randn(4, 1, 2, 2, generator=torch.Generator().manual_seed(0))
    runs = []
    for global_seed, seed in ((0, 5), (1, 5), (0, 6)):
        torch.manual_seed(global_seed)
        generator = torch.Generator().manual_seed(seed)
        runs.append(sample_images(RectifiedFlow(), optimal_velocity, noise, None, 6, "sde", generator=generator))
    assert torch.equal(runs[0], runs[1]) and (runs[0] - runs[2]).abs().max() > 1e-2


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


def test_labels_cycle_through_the_classes():
    # The FID while training takes every class in turn, as `sample.py --npz` does without --classes, so that the
    # logged FID is the one of that .npz; these labels are also those of earlier runs' FIDs.
    balanced = labels_for(10, [], num_classes=4)
    assert balanced.dtype == torch.int64 and balanced.tolist() == (torch.arange(10) % 4).tolist()
    assert labels_for(5, [7, 2], num_classes=10).tolist() == [7, 2, 7, 2, 7]
    assert labels_for(3, [], num_classes=0) is None
    with pytest.raises(ValueError, match=r"--classes \[4, -1\]: the model has classes 0..3"):
        labels_for(3, [1, 4, -1], num_classes=4)


def test_x_prediction_loss_closed_form():
    # JiT's loss: both velocities through the floored 1 / t, so it is |x0 - x_hat|^2 / max(t, t_min)^2 per element.
    flow = RectifiedFlow(prediction="x", x_prediction_t_min=0.05)
    g = torch.Generator().manual_seed(0)
    x0, noise = torch.randn(5, 3, 2, 2, generator=g), torch.randn(5, 3, 2, 2, generator=g)
    t = torch.tensor([0.0, 0.02, 0.05, 0.5, 1.0])
    stand_in = lambda x, t, y: 0.5 * x + 0.1  # an x0_hat that depends on the input
    loss, t_out = flow.training_losses(stand_in, x0, None, t=t, noise=noise)
    x_t = (1 - t.view(-1, 1, 1, 1)) * x0 + t.view(-1, 1, 1, 1) * noise
    floor = torch.tensor([0.05, 0.05, 0.05, 0.5, 1.0]).view(-1, 1, 1, 1)
    expected = ((x0 - (0.5 * x_t + 0.1)) / floor).pow(2).flatten(1).mean(1)
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(t_out, t)
    # Above the floor the target is the velocity eps - x0 itself: a model whose x0_hat implies v_hat = eps - x0 + 1
    # costs exactly 1 there.
    shifted = lambda x, t_model, y: x - (t_model / 1000).view(-1, 1, 1, 1) * (noise - x0 + 1)
    loss, _ = flow.training_losses(shifted, x0, None, t=t, noise=noise)
    torch.testing.assert_close(loss[3:], torch.ones(2), rtol=1e-5, atol=1e-5)
    perfect, _ = flow.training_losses(lambda x, t, y: x0, x0, None, t=t, noise=noise)
    assert perfect.abs().max() < 1e-10  # the true x0 costs 0 at every t, t = 0 included


@pytest.mark.parametrize("sampler", ["euler", "heun"])
def test_x_prediction_sampler_lands_on_a_point_mass(sampler):
    # An oracle x0_hat (the data is one point) makes v_hat = (x_t - x*) / t exact: steps starting at t >= t_min
    # follow the straight path, so a grid that stays at or above t_min ends on the data.
    target = torch.tensor([0.3, -0.7, 0.9, 0.1]).view(1, 1, 2, 2)
    oracle = lambda x, t, y: target.expand_as(x)
    flow = RectifiedFlow(prediction="x", x_prediction_t_min=0.05)
    noise = torch.randn(8, 1, 2, 2, generator=torch.Generator().manual_seed(0))
    samples = sample_images(flow, oracle, noise, None, steps=10, sampler=sampler)  # t = 1, 0.9, ..., 0.1
    torch.testing.assert_close(samples, target.expand_as(noise), rtol=0, atol=1e-6)
    if sampler == "euler":
        # 50 steps: from t = 0.04 and 0.02 the floored 1 / t moves x 0.4 of the way instead of all of it, leaving
        # 0.04 x 0.6 x 0.6 = 0.0144 of the noise (JiT's sampler does the same).
        samples = sample_images(flow, oracle, noise, None, steps=50, sampler="euler")
        torch.testing.assert_close(samples, target + 0.0144 * (noise - target), rtol=0, atol=1e-6)


def test_x_prediction_is_refused_for_ddpm():
    with pytest.raises(ConfigError) as err:
        parse_args(["--diffusion.objective", "ddpm", "--diffusion.prediction", "x"])
    assert str(err.value) == ("diffusion.prediction = 'x' in the command line: diffusion.objective 'ddpm' (in the "
                              "command line) predicts 'epsilon'; x-prediction (JiT) is rectified_flow's")  # fmt: skip
    cfg = parse_args(["--diffusion.objective", "rectified_flow", "--diffusion.prediction", "x"])
    assert cfg.diffusion.x_prediction_t_min == 0.05
    with pytest.raises(
        ConfigError, match=r"diffusion.x_prediction_t_min = 0.0 in the command line: must be in \(0, 1\)"
    ):
        parse_args(["--diffusion.objective", "rectified_flow", "--diffusion.prediction", "x",
                    "--diffusion.x_prediction_t_min", "0"])  # fmt: skip


def stand_in_dit(x, t, y):
    """Eps and learned-sigma channels (2C) that depend on x and the label: the null class (10) gives other values."""
    w = (y.float() + 1).view(-1, 1, 1, 1)
    return torch.cat([x * w + w, x - w], 1)


def reference_forward_with_cfg(model, x, t, y, cfg_scale):
    """facebookresearch/DiT's forward_with_cfg as published: a doubled batch (conditional half first) whose first
    half's input is used for both; guidance on the first 3 channels; the rest (channel 3, the variance) kept."""
    half = x[: len(x) // 2]
    model_out = model(torch.cat([half, half]), t, y)
    eps, rest = model_out[:, :3], model_out[:, 3:]
    cond_eps, uncond_eps = torch.split(eps, len(eps) // 2, dim=0)
    half_eps = uncond_eps + cfg_scale * (cond_eps - uncond_eps)
    return torch.cat([torch.cat([half_eps, half_eps]), rest], dim=1)


def test_guidance_on_three_channels_matches_facebookresearch_dit():
    g = torch.Generator().manual_seed(0)
    x, t, y = torch.randn(2, 4, 2, 2, generator=g), torch.tensor([999, 999]), torch.tensor([1, 2])
    null = torch.full_like(y, 10)
    reference = reference_forward_with_cfg(stand_in_dit, torch.cat([x, x]), torch.cat([t, t]), torch.cat([y, null]),
                                           4.0)[:2]  # fmt: skip
    ours = guided(stand_in_dit, 4.0, null_class=10, guide_channels=3)(x, t, y)
    torch.testing.assert_close(ours, reference, rtol=0, atol=0)
    cond, uncond = stand_in_dit(x, t, y), stand_in_dit(x, t, null)
    all_channels = guided(stand_in_dit, 4.0, null_class=10, guide_channels=4)(x, t, y)
    torch.testing.assert_close(all_channels[:, :4], uncond[:, :4] + 4.0 * (cond[:, :4] - uncond[:, :4]))
    assert not torch.allclose(all_channels[:, 3], ours[:, 3])  # channel 3: guided vs the conditional output

    # Through the sampler: one DDIM step from t = 999 to data, x0 = (x - sqrt(1 - a) eps) / sqrt(a).
    diffusion = GaussianDiffusion(1000, "linear", learn_sigma=True)
    a = diffusion.table["alphas_cumprod"][999].item()
    for channels, eps in ((3, ours[:, :4]), (-1, all_channels[:, :4])):
        out = sample_images(diffusion, stand_in_dit, x, y, steps=1, sampler="ddim", cfg_scale=4.0, null_class=10,
                            guidance_channels=channels)  # fmt: skip
        torch.testing.assert_close(out, (x - math.sqrt(1 - a) * eps) / math.sqrt(a), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="guidance on 5 channels of a 4-channel model"):
        sample_images(diffusion, stand_in_dit, x, y, steps=1, cfg_scale=4.0, null_class=10, guidance_channels=5)


def test_loss_by_timestep_bins_by_hand():
    bins = LossByTimestep(torch.device("cpu"), num_bins=10)
    # DDPM's t / T: 99 / 1000 is bin 0, 100 / 1000 (on the edge 1 / 10) bin 1, 999 / 1000 bin 9.
    bins.add(torch.tensor([0, 99, 100, 999, 500]) / 1000, torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0]))
    # Two samples with K = 2 draws each (rows of a sample consecutive); the second is Poisson padding.
    bins.add(torch.tensor([0.15, 0.17, 0.35, 1.0]), torch.tensor([[10.0, 20.0], [30.0, 40.0]]), torch.tensor([1, 0]))
    bins.add(torch.tensor([1.0]), torch.tensor([6.0]))  # rectified flow's t = 1 lands in the last bin
    assert bins.metrics() == {
        "loss/t_bin_0": (1 + 2) / 2,
        "loss/t_bin_1": (3 + 10 + 20) / 3,
        "loss/t_bin_5": 5.0,
        "loss/t_bin_9": (4 + 6) / 2,
    }  # bin 3 held only padding: left out, as the bins no sample fell in
    assert bins.metrics() == {}  # each log starts a new interval


def test_respaced_timesteps_are_improved_diffusions():
    """space_timesteps(1000, "250") of improved-diffusion: k * 999 / 249, accumulated, rounded half to even."""
    kept = space_timesteps(1000, 250)
    assert len(kept) == 250 and kept[:4] == [0, 4, 8, 12] and kept[-1] == 999
    assert (kept[62], kept[124], kept[125]) == (249, 497, 502)  # 248.75, 497.49, 501.51 by hand
    # A stride of 166.5: the halves 166.5, 499.5, 832.5 round to even, as Python's round in the reference.
    assert space_timesteps(1000, 7) == [0, 166, 333, 500, 666, 832, 999]
    assert space_timesteps(1000, 1) == [0] and space_timesteps(10, 10) == list(range(10))
    with pytest.raises(ValueError, match="cannot respace 1000 timesteps into 1001 steps"):
        space_timesteps(1000, 1001)


def test_ddpm_sampler_one_step_is_the_x0_prediction_at_t_0():
    """With one kept timestep (0) the chain is a single step without noise: x0 = (x - sqrt(1 - a_0) eps) / sqrt(a_0)."""
    diffusion = GaussianDiffusion(1000, "linear", learn_sigma=True)
    x = torch.randn(2, 4, 2, 2, generator=torch.Generator().manual_seed(0))
    seen = []

    def model(x, t, y):
        seen.append(t.tolist())
        return torch.cat([0.5 * x, torch.zeros_like(x)], 1)

    out = sample_images(diffusion, model, x, None, steps=1, sampler="ddpm")
    a = diffusion.table["alphas_cumprod"][0].item()
    torch.testing.assert_close(out, (x - math.sqrt(1 - a) * 0.5 * x) / math.sqrt(a), rtol=1e-6, atol=1e-6)
    seen.clear()
    sample_images(diffusion, model, x, None, steps=7, sampler="ddpm")
    assert seen == [[t, t] for t in (999, 832, 666, 500, 333, 166, 0)]  # the ORIGINAL timesteps, descending


def test_ddpm_sampler_is_ddpms_only():
    x = torch.zeros(1, 1, 2, 2)
    with pytest.raises(ValueError, match=r"sampling.sampler = 'euler': DDPM samples with 'ddim' or 'ddpm'"):
        sample_images(GaussianDiffusion(), zero_model, x, None, steps=2, sampler="euler")
    refusal = r"sampling.sampler = 'ddpm': rectified flow samples with 'euler', 'heun' or 'sde' \('ddim' and 'ddpm' are"
    with pytest.raises(ValueError, match=refusal):
        sample_images(RectifiedFlow(), zero_model, x, None, steps=2, sampler="ddpm")
    assert parse_args(["--diffusion.objective", "ddpm", "--sampling.sampler", "ddpm"]).sampling.sampler == "ddpm"
    refusal = r"sampling.sampler = 'ddpm' in the command line: .*'rectified_flow' .*samples with \['default', 'euler'"
    with pytest.raises(ConfigError, match=refusal):
        parse_args(["--diffusion.objective", "rectified_flow", "--sampling.sampler", "ddpm"])


def test_cosine_loss_and_its_gradients_equal_lightningdits_transport():
    """LightningDiT's transport loss (use_cosine_loss, its own code when the data was made) on recorded data, noise and
    times of its own convention (t = 1 data) and its train.py's total mean(mse + cos): our per-sample loss under
    cosine_loss_weight 1 and time_input '1-t' (our t = 1 - its) equals mse + cos per sample, and the gradient of the
    mean, taken through the weight conversion back to every parameter of the reference (its RMSNorm weights, its
    permuted q/k rows), equals the reference's: 1e-5 (measured 1e-7)."""
    from safetensors.torch import load_file
    from torch.func import functional_call

    from tests.test_lightningdit_weights import CHECKPOINT, REFERENCE_IO, TINY_TRAIN
    from torchtitan.models.dit import DiT
    from torchtitan.models.dit.lightningdit_adapter import LIGHTNINGDIT_PT_PICKLE_GLOBALS, from_lightningdit
    from torchtitan.tools import safe_pickle

    io = load_file(REFERENCE_IO)
    with open(CHECKPOINT, "rb") as f:
        reference = safe_pickle.torch_load(f, LIGHTNINGDIT_PT_PICKLE_GLOBALS, str(CHECKPOINT), "a checkpoint")["ema"]
    leaves = {k: v.clone().requires_grad_(f"grad.{k}" in io) for k, v in reference.items()}
    model = DiT(TINY_TRAIN)
    model.init_weights()  # the position buffers
    weights = from_lightningdit(leaves, TINY_TRAIN)  # differentiable in the reference's tensors
    flow = RectifiedFlow("logit_normal", time_input="1-t", cosine_loss_weight=1.0)
    loss, _ = flow.training_losses(lambda *a: functional_call(model.eval(), weights, a), io["loss_x1"], io["loss_y"],
                                   t=1 - io["loss_t"], noise=io["loss_x0"])  # fmt: skip
    assert (loss - (io["loss_mse"] + io["loss_cos"])).abs().max().item() <= 1e-5
    assert io["loss_cos"].min() > 0.1  # the direction term is a sizeable part of each loss
    loss.mean().backward()
    trained = [k for k, v in leaves.items() if v.requires_grad]
    assert len(trained) == sum(k.startswith("grad.") for k in io) > 30
    for name in trained:
        assert (leaves[name].grad - io[f"grad.{name}"]).abs().max().item() <= 1e-5, name
    # Without the direction term the loss is the reference's mse alone.
    mse, _ = RectifiedFlow(time_input="1-t").training_losses(lambda *a: functional_call(model, weights, a),
                                                             io["loss_x1"], io["loss_y"], t=1 - io["loss_t"],
                                                             noise=io["loss_x0"])  # fmt: skip
    assert (mse - io["loss_mse"]).abs().max().item() <= 1e-5


def test_cosine_loss_closed_form_and_time_inputs():
    """The direction term: per sample, the mean over positions of 1 - cos over channels, weighted; the model reads
    1000 t, t or 1 - t, and under '1-t' its output is a velocity of the reversed time (negated)."""
    torch.manual_seed(0)
    x0, noise, out = torch.randn(3, 4, 2, 2), torch.randn(3, 4, 2, 2), torch.randn(3, 4, 2, 2)
    t = torch.tensor([0.1, 0.5, 0.9])
    v = noise - x0
    cos = (out * v).sum(1) / (out.norm(dim=1) * v.norm(dim=1))
    expected = (v - out).pow(2).flatten(1).mean(1) + 0.5 * (1 - cos).flatten(1).mean(1)
    loss, _ = RectifiedFlow(cosine_loss_weight=0.5).training_losses(lambda x, s, y: out, x0, None, t=t, noise=noise)
    torch.testing.assert_close(loss, expected)
    reversed_loss, _ = RectifiedFlow(cosine_loss_weight=0.5, time_input="1-t").training_losses(
        lambda x, s, y: -out, x0, None, t=t, noise=noise
    )
    torch.testing.assert_close(reversed_loss, expected)  # -out in the reversed time is out in ours
    seen = []
    for time_input in ("1000t", "t", "1-t"):
        RectifiedFlow(time_input=time_input).training_losses(lambda x, s, y: seen.append(s) or x, x0, None, t=t,
                                                             noise=noise)  # fmt: skip
    for read, expected_t in zip(seen, (t * 1000, t, 1 - t), strict=True):
        torch.testing.assert_close(read, expected_t)
    with pytest.raises(ConfigError, match=r"diffusion.cosine_loss_weight = 1.0 in the command line: rectified_flow's"):
        parse_args(["--diffusion.objective", "ddpm", "--diffusion.cosine_loss_weight", "1"])


def test_logit_normal_timesteps_are_lightningdits_in_either_direction():
    """LightningDiT's use_lognorm draws its t as sigmoid(N(0, 1)) with t = 1 data; ours (mean 0, std 1) draws
    sigmoid(z) with t = 1 noise. The density is symmetric about 1/2, so 1 - ours has the same law: both match the
    closed-form CDF P(t <= x) = Phi(logit x)."""
    generator = torch.Generator().manual_seed(0)
    t = RectifiedFlow("logit_normal").sample_timesteps(200000, torch.device("cpu"), generator).double()
    x = torch.tensor([0.05, 0.2, 0.35, 0.5, 0.65, 0.8, 0.95], dtype=torch.float64)
    cdf = 0.5 * (1 + torch.erf(torch.log(x / (1 - x)) / math.sqrt(2)))
    for draws in (t, 1 - t):
        empirical = (draws[:, None] <= x).double().mean(0)
        assert (empirical - cdf).abs().max() < 0.005  # 200,000 draws: the CDF's standard error is at most 0.0011
