"""Diffusion objectives (per-sample losses) and samplers with classifier-free guidance.

Models never know which objective trains them: both objectives call model(x_t, t, y).
"""

import torch

from torchtitan.diffusion.ddpm import GaussianDiffusion, ModelFn
from torchtitan.diffusion.rectified_flow import RectifiedFlow

__all__ = ["GaussianDiffusion", "RectifiedFlow", "build_diffusion", "drop_labels", "guided", "sample_images"]


def build_diffusion(diffusion_config, learn_sigma: bool) -> GaussianDiffusion | RectifiedFlow:
    """Builds the objective named by the `[diffusion]` config section (validated: a learned sigma is DDPM's)."""
    if diffusion_config.objective == "ddpm":
        return GaussianDiffusion(diffusion_config.num_timesteps, diffusion_config.noise_schedule, learn_sigma)
    return RectifiedFlow(
        diffusion_config.timestep_sampling, diffusion_config.logit_normal_mean, diffusion_config.logit_normal_std
    )


def drop_labels(y: torch.Tensor, prob: float, null_class: int) -> torch.Tensor:
    """Replaces each label by the null class with probability `prob` (CFG training)."""
    if prob <= 0:
        return y
    drop = torch.rand(y.shape, device=y.device) < prob
    return torch.where(drop, torch.full_like(y, null_class), y)


def guided(model: ModelFn, cfg_scale: float, null_class: int, guide_channels: int) -> ModelFn:
    """Classifier-free guidance: out = uncond + s (cond - uncond) on the first guide_channels.

    The conditional and unconditional halves run as one doubled batch.
    """
    if cfg_scale == 1.0:
        return model

    def fn(x, t, y):
        out = model(torch.cat([x, x]), torch.cat([t, t]), torch.cat([y, torch.full_like(y, null_class)]))
        cond, uncond = out.chunk(2)
        guided_part = uncond[:, :guide_channels] + cfg_scale * (cond[:, :guide_channels] - uncond[:, :guide_channels])
        return torch.cat([guided_part, cond[:, guide_channels:]], dim=1)

    return fn


def sample_images(
    diffusion,
    model: ModelFn,
    noise: torch.Tensor,
    y,
    steps: int,
    sampler: str = "default",
    cfg_scale: float = 1.0,
    null_class: int = 0,
    clip_denoised: bool = False,
) -> torch.Tensor:
    """Runs the objective's sampler ('ddim' for DDPM, 'euler'/'heun' for flow) with optional CFG."""
    if cfg_scale != 1.0 and y is not None:
        model = guided(model, cfg_scale, null_class, noise.shape[1])
    if isinstance(diffusion, GaussianDiffusion):
        if sampler not in ("default", "ddim"):
            raise ValueError(f"sampling.sampler = {sampler!r}: DDPM samples with 'ddim'")
        return diffusion.ddim_sample(model, noise, y, steps, clip_denoised)
    if sampler not in ("default", "euler", "heun"):
        raise ValueError(f"sampling.sampler = {sampler!r}: rectified flow samples with 'euler' or 'heun'")
    return diffusion.sample(model, noise, y, steps, "euler" if sampler == "default" else sampler)
