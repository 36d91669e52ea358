"""Rectified flow (Liu et al.; SiT, SD3): x_t = (1 - t) x0 + t eps, the model predicts v = eps - x0.

Time runs from data (t = 0) to noise (t = 1); the model sees t scaled by 1000 so the timestep
embedding has the same range as under DDPM.
"""

import torch

from torchtitan.diffusion.ddpm import ModelFn

TIME_SCALE = 1000.0


class RectifiedFlow:
    """Velocity-prediction loss (one value per sample) and Euler/Heun samplers."""

    def __init__(self, timestep_sampling: str = "uniform", logit_mean: float = 0.0, logit_std: float = 1.0):
        self.timestep_sampling = timestep_sampling
        self.logit_mean, self.logit_std = logit_mean, logit_std

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
        v_pred = model(x_t, t * TIME_SCALE, y).float()[:, : x0.shape[1]]
        loss = (noise - x0 - v_pred).pow(2).flatten(1).mean(1)
        return loss, t

    @torch.no_grad()
    def sample(self, model: ModelFn, noise: torch.Tensor, y, steps: int = 50, method: str = "euler"):
        """Integrates dx/dt = v from t = 1 (noise) to t = 0 with Euler or Heun steps."""
        x = noise.float()
        C = x.shape[1]
        times = torch.linspace(1.0, 0.0, steps + 1).tolist()

        def velocity(x, t):
            t_vec = torch.full((x.shape[0],), t * TIME_SCALE, device=x.device)
            return model(x, t_vec, y).float()[:, :C]

        for t, t_next in zip(times[:-1], times[1:]):
            dt = t_next - t
            v = velocity(x, t)
            if method == "heun" and t_next > 0:
                # Heun: average the slope at both ends (skipped on the last step, as EDM does).
                x_euler = x + dt * v
                v = 0.5 * (v + velocity(x_euler, t_next))
            x = x + dt * v
        return x
