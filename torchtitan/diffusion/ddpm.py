"""DDPM with epsilon prediction (Ho et al.), optional learned variance (iDDPM), DDIM and ancestral DDPM sampling.

Follows DiT's setup: linear betas over 1000 steps; with learned sigma the model also outputs
the log-variance interpolation and the loss adds the variational bound term with a frozen mean.
"""

import functools
import math
from collections.abc import Callable

import torch

from torchtitan.diffusion.noise import IndexedNoise, normal_like

ModelFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]


def _betas(schedule: str, num_timesteps: int) -> torch.Tensor:
    if schedule == "linear":
        scale = 1000 / num_timesteps  # keeps the schedule's endpoints for other step counts, as ADM
        return torch.linspace(scale * 1e-4, scale * 0.02, num_timesteps, dtype=torch.float64)
    # Cosine schedule (Nichol & Dhariwal), betas capped at 0.999.
    steps = torch.arange(num_timesteps + 1, dtype=torch.float64) / num_timesteps
    alpha_bar = torch.cos((steps + 0.008) / 1.008 * math.pi / 2) ** 2
    return (1 - alpha_bar[1:] / alpha_bar[:-1]).clamp(max=0.999)


def _normal_kl(mean_gap, logvar_gap, logvar2):
    """KL(N(mean1, e^logvar1) || N(mean2, e^logvar2)) from mean_gap = mean1 - mean2, logvar_gap = logvar2 - logvar1.

    ADM's normal_kl, rearranged for float32: -1 + d + exp(-d) is about d^2 / 2, and summing it from two rounded
    log-variances (about -9 at small t) leaves few digits of a result near 0.01; expm1 and a gap formed
    directly keep them.
    """
    return 0.5 * (logvar_gap + torch.expm1(-logvar_gap) + mean_gap**2 * torch.exp(-logvar2))


def _discretized_gaussian_log_likelihood(x, means, log_scales):
    """Log-likelihood of data in [-1, 1] discretized to 256 bins (ADM's decoder term at t = 0)."""

    def cdf(v):  # fast approximation of the standard normal CDF
        return 0.5 * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (v + 0.044715 * v**3)))

    centered = x - means
    inv_stdv = torch.exp(-log_scales)
    cdf_plus = cdf(inv_stdv * (centered + 1.0 / 255.0))
    cdf_min = cdf(inv_stdv * (centered - 1.0 / 255.0))
    log_cdf_plus = torch.log(cdf_plus.clamp(min=1e-12))
    log_one_minus_cdf_min = torch.log((1.0 - cdf_min).clamp(min=1e-12))
    log_probs = torch.where(
        x < -0.999,
        log_cdf_plus,
        torch.where(x > 0.999, log_one_minus_cdf_min, torch.log((cdf_plus - cdf_min).clamp(min=1e-12))),
    )
    return log_probs


def _tables(betas: torch.Tensor) -> dict[str, torch.Tensor]:
    """The schedule's float64 tables from its betas (the full chain's, or a respaced one's)."""
    alphas_cumprod = torch.cumprod(1.0 - betas, dim=0)
    alphas_cumprod_prev = torch.cat([torch.ones(1, dtype=torch.float64), alphas_cumprod[:-1]])
    posterior_variance = betas * (1.0 - alphas_cumprod_prev) / (1.0 - alphas_cumprod)
    # Every table is built here in float64 and cast to float32 only at use, as DiT's gaussian_diffusion.py
    # does with numpy float64 arrays: near t = 0, 1 - alphas_cumprod is about 1e-4, so forming it (or its
    # square root) from a float32 alphas_cumprod loses about 3 digits, and the loss with the variational
    # bound was off from a float64 computation by 1e-5 to 1e-4 relative at t <= 2.
    posterior_log_variance_clipped = torch.log(torch.cat([posterior_variance[1:2], posterior_variance[1:]]))
    return {
        "betas": betas,
        "log_betas": torch.log(betas),
        "alphas_cumprod": alphas_cumprod,
        "alphas_cumprod_prev": alphas_cumprod_prev,
        "sqrt_alphas_cumprod": alphas_cumprod.sqrt(),
        "sqrt_one_minus_alphas_cumprod": (1.0 - alphas_cumprod).sqrt(),
        "sqrt_recip_alphas_cumprod": (1.0 / alphas_cumprod).sqrt(),
        "sqrt_recipm1_alphas_cumprod": (1.0 / alphas_cumprod - 1.0).sqrt(),
        "posterior_variance": posterior_variance,
        # The posterior variance is 0 at t = 0: its log is clipped to the t = 1 value (ADM).
        "posterior_log_variance_clipped": posterior_log_variance_clipped,
        # The span of iDDPM's learned log-variance, from the posterior's up to log(beta).
        "log_variance_range": torch.log(betas) - posterior_log_variance_clipped,
        # ADM's fixed "large" variance beta_t, with the posterior's at t = 0 for a better decoder likelihood.
        "fixed_large_log_variance": torch.log(torch.cat([posterior_variance[1:2], betas[1:]])),
        "posterior_mean_coef1": betas * alphas_cumprod_prev.sqrt() / (1.0 - alphas_cumprod),
        "posterior_mean_coef2": (1.0 - alphas_cumprod_prev) * (1.0 - betas).sqrt() / (1.0 - alphas_cumprod),
    }


def space_timesteps(num_timesteps: int, steps: int) -> list[int]:
    """The `steps` timesteps of a respaced chain, ascending: improved-diffusion's `space_timesteps(T, str(steps))`.

    A fractional stride (T - 1) / (steps - 1) from 0, accumulated and rounded as that code does (Python's round,
    half to even), so the kept timesteps, and the model's inputs, are the reference's: 0, 4, 8, ..., 999 for 250
    of 1000. Its multi-section and "ddimN" forms are left out: the DiT paper's sampler uses one section.
    """
    if not 0 < steps <= num_timesteps:
        raise ValueError(f"cannot respace {num_timesteps} timesteps into {steps} steps")
    stride = (num_timesteps - 1) / (steps - 1) if steps > 1 else 1
    kept, position = [], 0.0
    for _ in range(steps):
        kept.append(round(position))
        position += stride
    return kept


class GaussianDiffusion:
    """DDPM training loss (one value per sample), DDIM and ancestral DDPM sampling."""

    def __init__(self, num_timesteps: int = 1000, schedule: str = "linear", learn_sigma: bool = False):
        self.num_timesteps = num_timesteps
        self.learn_sigma = learn_sigma
        self.table = _tables(_betas(schedule, num_timesteps))
        # float32 copies per device, made once: casting before or after the gather gives the same values.
        self._device_tables: dict[torch.device, dict[str, torch.Tensor]] = {}

    def _gather(self, name: str, t: torch.Tensor, ndim: int) -> torch.Tensor:
        """table[name][t] as float32 on t's device, shaped (B, 1, ..., 1) to broadcast."""
        if t.device not in self._device_tables:
            self._device_tables[t.device] = {k: v.float().to(t.device) for k, v in self.table.items()}
        return self._device_tables[t.device][name][t].view(-1, *([1] * (ndim - 1)))

    def sample_timesteps(self, batch: int, device: torch.device, generator=None) -> torch.Tensor:
        return torch.randint(0, self.num_timesteps, (batch,), device=device, generator=generator)

    def training_losses(self, model: ModelFn, x0: torch.Tensor, y, t=None, noise=None):
        """Per-sample loss (B,) and the timestep as a fraction of the schedule (B,).

        Args:
            model: called as model(x_t, t, y) -> (B, C or 2C, H, W).
            x0: clean data (B, C, H, W).
            y: labels (B,) or None.
            t: integer timesteps (B,); drawn uniformly when None.
            noise: the Gaussian noise (B, C, H, W); drawn when None.
        """
        if t is None:
            t = self.sample_timesteps(x0.shape[0], x0.device)
        if noise is None:
            noise = torch.randn_like(x0)
        x0, noise = x0.float(), noise.float()
        nd = x0.ndim
        x_t = (
            self._gather("sqrt_alphas_cumprod", t, nd) * x0
            + self._gather("sqrt_one_minus_alphas_cumprod", t, nd) * noise
        )
        return self.output_losses(model(x_t, t, y), x0, noise, x_t, t), t.float() / self.num_timesteps

    def output_losses(self, out: torch.Tensor, x0: torch.Tensor, noise: torch.Tensor, x_t: torch.Tensor, t):
        """Per-sample loss (B,) from the model's output (B, C or 2C, H, W), given x0, noise and x_t in float32 and
        the timesteps (B,): what `compile.components = ["loss"]` compiles (`compile_loss`)."""
        out = out.float()
        C = x0.shape[1]
        eps_pred = out[:, :C]
        loss = (noise - eps_pred).pow(2).flatten(1).mean(1)  # (B,)
        if self.learn_sigma:
            # Variational bound on the variance only: the mean's gradient flows through the MSE alone.
            loss = loss + self._vb_term(eps_pred.detach(), out[:, C:], x0, x_t, t)
        return loss

    def compile_loss(self) -> None:
        """torch.compile `output_losses`: the variational bound's ~40 elementwise ops, forward and backward, become
        a few fused kernels instead of one eager launch each (host time at small batches). The schedule's tables
        on the device are read, not built, inside the graph: `training_losses` gathers x_t's coefficients first."""
        self.output_losses = torch.compile(self.output_losses)

    def _p_mean(
        self, eps: torch.Tensor, x_t: torch.Tensor, coef: Callable[[str], torch.Tensor], clip_denoised: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The mean of the model's p(x_{t-1} | x_t) and the x0 prediction it comes from, as the `mean` and
        `pred_xstart` of facebookresearch/DiT's `p_mean_variance`: x0 = sqrt(1 / a_t) x_t - sqrt(1 / a_t - 1) eps,
        then the mean of the posterior q(x_{t-1} | x_t, x0), coef1 x0 + coef2 x_t.

        The variance stays with the callers, whose float32 forms of iDDPM's learned interpolation differ on
        purpose: the sampler rounds frac log(beta) + (1 - frac) log(posterior variance) as the reference does, for
        the reference's samples (tests/test_dit_weights.py); the loss forms its gap above the posterior's
        log-variance directly (`_vb_term`), which keeps the KL's digits.

        Args:
            eps: predicted noise (B, C, H, W), float32.
            x_t: the noisy input (B, C, H, W), float32.
            coef: a table's name -> its float32 value at this step, broadcastable to x_t: (B, 1, ..., 1) gathered
                at t for the loss, a scalar of the respaced chain for the sampler.
            clip_denoised: clamp the x0 prediction to [-1, 1] before the mean is formed from it.

        Returns:
            The mean and the x0 prediction, each (B, C, H, W).
        """
        pred_x0 = coef("sqrt_recip_alphas_cumprod") * x_t - coef("sqrt_recipm1_alphas_cumprod") * eps
        if clip_denoised:
            pred_x0 = pred_x0.clamp(-1, 1)
        mean = coef("posterior_mean_coef1") * pred_x0 + coef("posterior_mean_coef2") * x_t
        return mean, pred_x0

    def _vb_term(self, eps, var_values, x0, x_t, t):
        """The variational bound in bits per dimension (B,), as iDDPM's L_vlb.

        KL(q(x_{t-1} | x_t, x0) || p(x_{t-1} | x_t)) for t > 0, the discretized decoder NLL at t = 0.
        """
        coef = functools.cache(functools.partial(self._gather, t=t, ndim=x0.ndim))  # (B, 1, ..., 1), each once
        mean, pred_x0 = self._p_mean(eps, x_t, coef)
        # The model outputs [-1, 1]; its log-variance is that fraction of the way from the posterior's to
        # log(beta) (iDDPM), so its gap above the posterior's is formed directly, without cancellation.
        logvar_gap = (var_values + 1) / 2 * coef("log_variance_range")
        logvar = coef("posterior_log_variance_clipped") + logvar_gap
        # The true and the model's posterior means share coef2 x_t: they differ by exactly coef1 (x0 - pred_x0).
        mean_gap = coef("posterior_mean_coef1") * (x0 - pred_x0)
        kl = _normal_kl(mean_gap, logvar_gap, logvar).flatten(1).mean(1) / math.log(2.0)
        nll = -_discretized_gaussian_log_likelihood(x0, mean, 0.5 * logvar).flatten(1).mean(1) / math.log(2.0)
        return torch.where(t == 0, nll, kl)

    @torch.no_grad()
    def ddim_sample(self, model: ModelFn, noise: torch.Tensor, y, steps: int = 50, clip_denoised: bool = False):
        """Deterministic DDIM (eta = 0) from noise over `steps` evenly spaced timesteps."""
        x = noise.float()
        C = x.shape[1]
        timesteps = torch.linspace(self.num_timesteps - 1, 0, steps).round().long().unique_consecutive()
        ac_all = self.table["alphas_cumprod"]  # float64: the step coefficients below are Python floats
        for i, t_int in enumerate(timesteps.tolist()):
            t = torch.full((x.shape[0],), t_int, device=x.device, dtype=torch.long)
            eps = model(x, t, y).float()[:, :C]
            a_t = ac_all[t_int].item()
            a_prev = ac_all[timesteps[i + 1]].item() if i + 1 < len(timesteps) else 1.0
            x0 = (x - math.sqrt(1 - a_t) * eps) / math.sqrt(a_t)
            if clip_denoised:
                x0 = x0.clamp(-1, 1)
                eps = (x - math.sqrt(a_t) * x0) / math.sqrt(1 - a_t)
            x = math.sqrt(a_prev) * x0 + math.sqrt(1 - a_prev) * eps
        return x

    @torch.no_grad()
    def ddpm_sample(
        self,
        model: ModelFn,
        noise: torch.Tensor,
        y,
        steps: int = 250,
        clip_denoised: bool = False,
        generator: torch.Generator | IndexedNoise | None = None,
    ):
        """Ancestral DDPM over `steps` respaced timesteps: the DiT paper's sampler (its FIDs use 250 steps).

        As facebookresearch/DiT's `create_diffusion(str(steps)).p_sample_loop`: the respaced chain's betas are
        1 - alphas_cumprod[t_i] / alphas_cumprod[t_{i-1}] at the kept timesteps (from 1 at the first), the model
        sees each step's ORIGINAL timestep, and its variance is iDDPM's learned range (from the model's last C
        channels) under learn_sigma, else the fixed large variance (the reference's default). The step noise is
        drawn after each model call, on the last step too, which adds none: from the same RNG state the samples
        are the reference's. `generator` (a CPU torch generator, or each sample's own: `IndexedNoise`) draws it instead
        of the global RNG, so a batch need not depend on what ran before it.

        Classifier-free guidance (`guided`) doubles the batch inside the model call, so the step noise is drawn
        for B samples; the reference's `forward_with_cfg` runs on a doubled chain and draws it for 2B, keeping the
        first half. The two agree in distribution, not draw for draw (tests/test_dit_weights.py reproduces the
        reference's draws by running this sampler on its doubled batch).
        """
        x = noise.float()
        C = x.shape[1]
        kept = space_timesteps(self.num_timesteps, steps)
        alphas_cumprod = self.table["alphas_cumprod"][kept]
        betas = 1.0 - alphas_cumprod / torch.cat([torch.ones(1, dtype=torch.float64), alphas_cumprod[:-1]])
        # float64 tables of the respaced chain, cast to float32 scalars per step as the reference's are.
        table = {k: v.float().to(x.device) for k, v in _tables(betas).items()}
        for i in reversed(range(len(kept))):
            t = torch.full((x.shape[0],), kept[i], device=x.device, dtype=torch.long)
            out = model(x, t, y).float()
            mean, _ = self._p_mean(out[:, :C], x, lambda name, i=i: table[name][i], clip_denoised)
            step_noise = normal_like(x, generator)
            if i == 0:  # the last step adds no noise (a one-step chain has no variance table to read)
                x = mean
                continue
            if self.learn_sigma:
                frac = (out[:, C:] + 1) / 2  # the model's [-1, 1] -> [posterior's log variance, log beta]
                log_variance = frac * table["log_betas"][i] + (1 - frac) * table["posterior_log_variance_clipped"][i]
            else:
                log_variance = table["fixed_large_log_variance"][i]
            x = mean + torch.exp(0.5 * log_variance) * step_noise
        return x
