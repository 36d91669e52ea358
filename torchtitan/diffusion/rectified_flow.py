"""Rectified flow (Liu et al.; SiT, SD3): x_t = (1 - t) x0 + t eps, the model predicts v = eps - x0.

Time runs from data (t = 0) to noise (t = 1); the model sees t scaled by 1000 so the timestep
embedding has the same range as under DDPM. `time_input` gives the model the time of another convention instead:
"t" (REPA's SiT: t in [0, 1]) or "1-t" (SiT's and LightningDiT's transport, whose time runs from noise at 0 to data
at 1; their model predicts data - noise, d x / d(1 - t), so its velocity is negated). Only what the model reads and
the sign of its velocity change: the path, the loss and the samplers stay in our t.

`cosine_loss_weight` adds LightningDiT's velocity direction term (its transport's `use_cosine_loss`): per sample,
the mean over positions of 1 - cos(v_hat, v), the cosine taken over the channels at each position. Its train.py
adds it with weight 1 to the mean squared error.

With prediction "x" the model predicts the clean image x0 and the loss is still taken on the velocity, as JiT
(Li & He, "Back to Basics: Let Denoising Generative Models Denoise", 2025): v = (x_t - x0) / t, with t floored at
`t_min` in that denominator for both the target and the prediction, so the loss is |x0 - x0_hat|^2 / max(t, t_min)^2
and stays finite at t = 0. The samplers integrate the same converted velocity.
"""

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from torchtitan.diffusion.ddpm import ModelFn
from torchtitan.diffusion.noise import IndexedNoise, normal_like

TIME_SCALE = 1000.0
TIME_INPUTS = ("1000t", "t", "1-t")  # diffusion.time_input: what the model reads of our t
# SiT's diffusion coefficients that its own sampler runs on the linear path of a velocity model ("SBDM" is t / (1 - t)
# in our t: infinite at the noise, where it starts; "constant" is a float its step cannot take the square root of;
# "increasing-decreasing" is misspelled in its own table) and its last steps (sampling.sde_diffusion_form,
# sampling.sde_last_step).
SDE_DIFFUSION_FORMS = ("sigma", "linear", "decreasing")
SDE_LAST_STEPS = ("mean", "tweedie", "euler")


@dataclass(frozen=True)
class SDESettings:
    """The SDE sampler's settings, SiT's (willisma/SiT, transport `sample_sde`), in our time (t = 1 the noise).

    diffusion_form: the diffusion coefficient w(t): "sigma" and "linear", norm * t (the noise's coefficient on
        the linear path; SiT's default, and REPA's fixed 2t = 2 w), or "decreasing", (1 - norm cos(pi t))^2 / 4.
    diffusion_norm: its scale (SiT's `diffusion_norm`).
    last_step: "mean", "tweedie" or "euler" (SiT's names; `RectifiedFlow._sde`).
    last_step_size: where the stochastic steps stop and the last step starts (REPA's fixed 0.04, SiT's default).
    """

    diffusion_form: str = "sigma"
    diffusion_norm: float = 1.0
    last_step: str = "mean"
    last_step_size: float = 0.04

    def __post_init__(self) -> None:
        if self.diffusion_form not in SDE_DIFFUSION_FORMS:
            raise ValueError(f"sampling.sde_diffusion_form = {self.diffusion_form!r}: must be one of "
                             f"{list(SDE_DIFFUSION_FORMS)}")  # fmt: skip
        if self.last_step not in SDE_LAST_STEPS:
            raise ValueError(f"sampling.sde_last_step = {self.last_step!r}: must be one of {list(SDE_LAST_STEPS)}")

    def diffusion(self, t: float) -> float:
        """w(t) at our t (SiT's time is 1 - t)."""
        if self.diffusion_form == "decreasing":
            return 0.25 * (self.diffusion_norm * math.cos(math.pi * (1 - t)) + 1) ** 2
        return self.diffusion_norm * t


class RectifiedFlow:
    """Velocity loss (one value per sample) and ODE (Euler, Heun) and SDE samplers; the model predicts v, or x0
    ("x", JiT)."""

    def __init__(self, timestep_sampling: str = "uniform", logit_mean: float = 0.0, logit_std: float = 1.0,
                 prediction: str = "velocity", x_prediction_t_min: float = 0.05, time_input: str = "1000t",
                 cosine_loss_weight: float = 0.0):  # fmt: skip
        if prediction not in ("velocity", "x"):
            raise ValueError(f"rectified flow predicts 'velocity' or 'x', not {prediction!r}")
        if time_input not in TIME_INPUTS:
            raise ValueError(f"diffusion.time_input = {time_input!r}: must be one of {list(TIME_INPUTS)}")
        self.timestep_sampling = timestep_sampling
        self.logit_mean, self.logit_std = logit_mean, logit_std
        self.prediction, self.t_min = prediction, x_prediction_t_min
        self.time_input, self.cosine_loss_weight = time_input, cosine_loss_weight

    def model_time(self, t: torch.Tensor | float) -> torch.Tensor | float:
        """What the model reads as its timestep for our t in [0, 1] (`time_input`), a tensor or a number."""
        if self.time_input == "1000t":
            return t * TIME_SCALE
        return t if self.time_input == "t" else 1 - t

    def velocity(self, out: torch.Tensor, x_t: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """The model's velocity from its output: the output itself, or from x0_hat (x_t - x0_hat) / max(t, t_min).

        Args:
            out: the model's prediction (B, C, H, W).
            x_t: the model's input (B, C, H, W).
            t: times in [0, 1], (B,) or broadcastable to x_t.
        """
        if self.prediction == "velocity":
            return -out if self.time_input == "1-t" else out  # a reversed time's velocity points the other way
        t = t.view(-1, *([1] * (x_t.ndim - 1))) if t.ndim == 1 else t
        return (x_t - out) / t.clamp(min=self.t_min)  # the floor keeps 1/t finite near the data (JiT's t_eps)

    def sample_timesteps(self, batch: int, device: torch.device, generator=None) -> torch.Tensor:
        if self.timestep_sampling == "logit_normal":
            # SD3's logit-normal density puts more weight on the middle of the path.
            z = torch.randn(batch, device=device, generator=generator)
            return torch.sigmoid(self.logit_mean + self.logit_std * z)
        return torch.rand(batch, device=device, generator=generator)

    def training_losses(self, model: ModelFn, x0: torch.Tensor, y, t=None, noise=None):
        """Per-sample loss (B,) and t in [0, 1] (B,).

        Args:
            model: called as model(x_t, 1000 t, y) (or the time of `time_input`) -> (B, C or more, H, W); extra
                channels are ignored.
            x0: clean data (B, C, H, W).
            y: labels (B,) or None.
            t: times in [0, 1] (B,); drawn when None.
            noise: Gaussian noise like x0; drawn when None.
        """
        if t is None:
            t = self.sample_timesteps(x0.shape[0], x0.device)
        if noise is None:
            noise = torch.randn_like(x0)
        x0, noise = x0.float(), noise.float()
        t_b = t.view(-1, *([1] * (x0.ndim - 1)))
        x_t = (1 - t_b) * x0 + t_b * noise
        return self.output_losses(model(x_t, self.model_time(t), y), x0, noise, x_t, t), t

    def output_losses(self, out: torch.Tensor, x0: torch.Tensor, noise: torch.Tensor, x_t: torch.Tensor, t):
        """Per-sample loss (B,) from the model's output (B, C or more, H, W), given x0, noise and x_t in float32 and
        t in [0, 1] (B,): what `compile.components = ["loss"]` compiles (`compile_loss`)."""
        t_b = t.view(-1, *([1] * (x0.ndim - 1)))
        v_pred = self.velocity(out.float()[:, : x0.shape[1]], x_t, t_b)
        # Under x-prediction the target goes through the same floored conversion as the prediction (JiT): below
        # t_min, (x_t - x0) / t_min rather than eps - x0, so a perfect x0_hat costs 0 at every t.
        v = noise - x0 if self.prediction == "velocity" else self.velocity(x0, x_t, t_b)
        loss = (v - v_pred).pow(2).flatten(1).mean(1)
        if self.cosine_loss_weight:  # LightningDiT's direction term; torch's cosine (eps 1e-8), as its transport
            direction = 1 - F.cosine_similarity(v_pred, v, dim=1)  # (B, H, W): over the channels at each position
            loss = loss + self.cosine_loss_weight * direction.flatten(1).mean(1)
        return loss

    def compile_loss(self) -> None:
        """torch.compile `output_losses` (a few fused kernels instead of one eager launch per op)."""
        self.output_losses = torch.compile(self.output_losses)

    @torch.no_grad()
    def sample(self, model: ModelFn, noise: torch.Tensor, y, steps: int = 50, method: str = "euler", *,
               unguided: ModelFn | None = None, guidance_interval: tuple[float, float] = (0.0, 1.0),
               timestep_shift: float = 1.0, sde: SDESettings | None = None,
               generator: torch.Generator | IndexedNoise | None = None) -> torch.Tensor:  # fmt: skip
        """Integrates from t = 1 (noise) to t = 0: the ODE dx/dt = v with Euler or Heun steps, or the SDE (`_sde`).

        Args:
            model: the (guided) model, called as model(x_t, model time, y).
            noise: the starting noise (B, C, H, W).
            y: labels (B,) or None.
            steps: the ODE's steps; the SDE's model evaluations (`_sde`).
            method: "euler", "heun" or "sde".
            unguided: the model without guidance, called at the steps that start outside `guidance_interval`; None:
                `model` at every step.
            guidance_interval: (low, high): `model` at a step whose start t has low <= t <= high, `unguided` at the
                others, for the whole step (Heun's second evaluation too), as REPA's samplers.py decides it. Its
                `guidance_high` is 1 - LightningDiT's `cfg_interval_start` (its time runs the other way).
            timestep_shift: the ODE's grid t_k = 1 - k / steps moved to t_k / (shift + (1 - shift) t_k):
                LightningDiT's `timestep_shift` (below 1: more steps near the noise; SD3's shift is 1 / this).
            sde: the SDE's settings (None: SiT's defaults).
            generator: draws the SDE's step noise (`normal_like`); None: the global RNG, as the references.

        Under x-prediction v is the floored conversion of training, as JiT samples: a step that starts at t < t_min
        moves x only (t - t_next) / t_min of the way towards x0_hat instead of (t - t_next) / t, so a grid with steps
        below t_min ends a little short of it (50 steps, t_min 0.05: 0.36 of the noise left at t = 0.04 remains).
        """
        x = noise.float()
        C = x.shape[1]
        low, high = guidance_interval

        def velocity(x: torch.Tensor, t: float, guide: bool) -> torch.Tensor:
            fn = model if guide or unguided is None else unguided
            out = fn(x, torch.full((x.shape[0],), self.model_time(t), device=x.device), y).float()[:, :C]
            return self.velocity(out, x, torch.full((x.shape[0],), t, device=x.device))

        if method == "sde":
            return self._sde(velocity, x, steps, lambda t: low <= t <= high, sde or SDESettings(), generator)
        times = torch.linspace(1.0, 0.0, steps + 1, dtype=torch.float64)
        times = (times / (timestep_shift + (1 - timestep_shift) * times)).tolist()
        for t, t_next in zip(times[:-1], times[1:]):
            dt = t_next - t
            guide = low <= t <= high
            v = velocity(x, t, guide)
            if method == "heun" and t_next > 0:
                # Heun: average the slope at both ends (skipped on the last step, as EDM does).
                x_euler = x + dt * v
                v = 0.5 * (v + velocity(x_euler, t_next, guide))
            x = x + dt * v
        return x

    def _sde(self, velocity, x: torch.Tensor, steps: int, guide, settings: SDESettings, generator) -> torch.Tensor:
        """Euler-Maruyama on the reverse SDE dx = [v - w(t) score] dt + sqrt(2 w(t)) dW from t = 1 to
        `last_step_size`, then one last step to t = 0, as SiT's transport (`sample_sde`, Euler) and REPA's
        `euler_maruyama_sampler` take them: `steps` model evaluations, steps - 1 of them stochastic on an even grid.

        The score of the linear path is ((t - 1) v - x) / t. The step noise is drawn before each model call, as both
        references draw it. The last step (`last_step`): "mean", the SDE's drift without its noise (REPA's, SiT's
        default); "euler", the ODE's; "tweedie", straight to E[x0 | x_t] = (x + t^2 score) / (1 - t).
        """
        times = torch.linspace(1.0, settings.last_step_size, steps, dtype=torch.float64).tolist()
        for t, t_next in zip(times[:-1], times[1:]):
            dt = t_next - t  # < 0: towards the data
            step_noise = normal_like(x, generator)
            v = velocity(x, t, guide(t))
            w = settings.diffusion(t)
            x = x + dt * (v - w * ((t - 1) * v - x) / t) + math.sqrt(2 * w * -dt) * step_noise
        t = times[-1]
        v = velocity(x, t, guide(t))
        score = ((t - 1) * v - x) / t
        if settings.last_step == "euler":
            return x - t * v
        if settings.last_step == "tweedie":
            return (x + t * t * score) / (1 - t)
        return x - t * (v - settings.diffusion(t) * score)
