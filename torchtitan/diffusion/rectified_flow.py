"""Rectified flow (Liu et al.; SiT, SD3): x_t = (1 - t) x0 + t eps, the model predicts v = eps - x0.

Time runs from data (t = 0) to noise (t = 1); the model sees t scaled by 1000 so the timestep
embedding has the same range as under DDPM.

With prediction "x" the model predicts the clean image x0 and the loss is still taken on the velocity, as JiT
(Li & He, "Back to Basics: Let Denoising Generative Models Denoise", 2025): v = (x_t - x0) / t, with t floored at
`t_min` in that denominator for both the target and the prediction, so the loss is |x0 - x0_hat|^2 / max(t, t_min)^2
and stays finite at t = 0. The samplers integrate the same converted velocity.
"""

import torch

from torchtitan.diffusion.ddpm import ModelFn

TIME_SCALE = 1000.0


class RectifiedFlow:
    """Velocity loss (one value per sample) and Euler/Heun samplers; the model predicts v, or x0 ("x", JiT)."""

    def __init__(self, timestep_sampling: str = "uniform", logit_mean: float = 0.0, logit_std: float = 1.0,
                 prediction: str = "velocity", x_prediction_t_min: float = 0.05):  # fmt: skip
        if prediction not in ("velocity", "x"):
            raise ValueError(f"rectified flow predicts 'velocity' or 'x', not {prediction!r}")
        self.timestep_sampling = timestep_sampling
        self.logit_mean, self.logit_std = logit_mean, logit_std
        self.prediction, self.t_min = prediction, x_prediction_t_min

    def velocity(self, out: torch.Tensor, x_t: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """The model's velocity from its output: the output itself, or from x0_hat (x_t - x0_hat) / max(t, t_min).

        Args:
            out: the model's prediction (B, C, H, W).
            x_t: the model's input (B, C, H, W).
            t: times in [0, 1], (B,) or broadcastable to x_t.
        """
        if self.prediction == "velocity":
            return out
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
            model: called as model(x_t, 1000 t, y) -> (B, C or more, H, W); extra channels are ignored.
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
        return self.output_losses(model(x_t, t * TIME_SCALE, y), x0, noise, x_t, t), t

    def output_losses(self, out: torch.Tensor, x0: torch.Tensor, noise: torch.Tensor, x_t: torch.Tensor, t):
        """Per-sample loss (B,) from the model's output (B, C or more, H, W), given x0, noise and x_t in float32 and
        t in [0, 1] (B,): what `compile.components = ["loss"]` compiles (`compile_loss`)."""
        t_b = t.view(-1, *([1] * (x0.ndim - 1)))
        v_pred = self.velocity(out.float()[:, : x0.shape[1]], x_t, t_b)
        # Under x-prediction the target goes through the same floored conversion as the prediction (JiT): below
        # t_min, (x_t - x0) / t_min rather than eps - x0, so a perfect x0_hat costs 0 at every t.
        v = noise - x0 if self.prediction == "velocity" else self.velocity(x0, x_t, t_b)
        return (v - v_pred).pow(2).flatten(1).mean(1)

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
            out = model(x, torch.full((x.shape[0],), t * TIME_SCALE, device=x.device), y).float()[:, :C]
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
