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

import torch
import torch.nn.functional as F

from torchtitan.diffusion.ddpm import ModelFn

TIME_SCALE = 1000.0
TIME_INPUTS = ("1000t", "t", "1-t")  # diffusion.time_input: what the model reads of our t


class RectifiedFlow:
    """Velocity loss (one value per sample) and Euler/Heun samplers; the model predicts v, or x0 ("x", JiT)."""

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
    def sample(self, model: ModelFn, noise: torch.Tensor, y, steps: int = 50, method: str = "euler"):
        """Integrates dx/dt = v from t = 1 (noise) to t = 0 with Euler or Heun steps.

        Under x-prediction v is the floored conversion of training, as JiT samples: a step that starts at t < t_min
        moves x only (t - t_next) / t_min of the way towards x0_hat instead of (t - t_next) / t, so a grid with steps
        below t_min ends a little short of it (50 steps, t_min 0.05: 0.36 of the noise left at t = 0.04 remains).
        """
        x = noise.float()
        C = x.shape[1]
        times = torch.linspace(1.0, 0.0, steps + 1).tolist()

        def velocity(x, t):
            out = model(x, torch.full((x.shape[0],), self.model_time(t), device=x.device), y).float()[:, :C]
            return self.velocity(out, x, torch.full((x.shape[0],), t, device=x.device))

        for t, t_next in zip(times[:-1], times[1:]):
            dt = t_next - t
            v = velocity(x, t)
            if method == "heun" and t_next > 0:
                # Heun: average the slope at both ends (skipped on the last step, as EDM does).
                x_euler = x + dt * v
                v = 0.5 * (v + velocity(x_euler, t_next))
            x = x + dt * v
        return x
