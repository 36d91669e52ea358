"""Diffusion objectives (per-sample losses) and samplers with classifier-free guidance.

Models never know which objective trains them: both objectives call model(x_t, t, y).
"""

import math

import torch

from torchtitan.diffusion.ddpm import GaussianDiffusion, ModelFn
from torchtitan.diffusion.noise import IndexedNoise, normal_like, sample_noise
from torchtitan.diffusion.rectified_flow import RectifiedFlow, SDESettings

__all__ = [
    "GaussianDiffusion",
    "IndexedNoise",
    "RectifiedFlow",
    "SDESettings",
    "build_diffusion",
    "check_sampler",
    "drop_labels",
    "guided",
    "labels_for",
    "normal_like",
    "sample_images",
    "sample_noise",
    "sampler_options",
    "validation_timesteps",
]


def build_diffusion(diffusion_config, learn_sigma: bool) -> GaussianDiffusion | RectifiedFlow:
    """Builds the objective named by the `[diffusion]` config section (validated: a learned sigma is DDPM's)."""
    if diffusion_config.objective == "ddpm":
        return GaussianDiffusion(diffusion_config.num_timesteps, diffusion_config.noise_schedule, learn_sigma)
    return RectifiedFlow(
        diffusion_config.timestep_sampling,
        diffusion_config.logit_normal_mean,
        diffusion_config.logit_normal_std,
        diffusion_config.prediction,
        diffusion_config.x_prediction_t_min,
        diffusion_config.time_input,
        diffusion_config.cosine_loss_weight,
    )


def drop_labels(y: torch.Tensor, prob: float, null_class: int) -> torch.Tensor:
    """Replaces each label by the null class with probability `prob` (CFG training)."""
    if prob <= 0:
        return y
    drop = torch.rand(y.shape, device=y.device) < prob
    return torch.where(drop, torch.full_like(y, null_class), y)


def guided(model: ModelFn, cfg_scale: float, null_class: int, guide_channels: int) -> ModelFn:
    """Classifier-free guidance: out = uncond + s (cond - uncond) on the first guide_channels, the conditional
    output on the rest.

    The conditional and unconditional halves run as one doubled batch. facebookresearch/DiT's `forward_with_cfg`
    guides only the first 3 of its 4 latent channels "for exact reproducibility" of its published FIDs (its
    comment); guide_channels = 3 reproduces it, guide_channels = C is the standard guidance.
    """
    if cfg_scale == 1.0:
        return model

    def fn(x, t, y):
        out = model(torch.cat([x, x]), torch.cat([t, t]), torch.cat([y, torch.full_like(y, null_class)]))
        cond, uncond = out.chunk(2)
        guided_part = uncond[:, :guide_channels] + cfg_scale * (cond[:, :guide_channels] - uncond[:, :guide_channels])
        return torch.cat([guided_part, cond[:, guide_channels:]], dim=1)

    return fn


def labels_for(num: int, classes: list[int], num_classes: int) -> torch.Tensor | None:
    """Labels of samples 0..num-1 of a sampling run: cycling through `classes` (sample.py's `--classes`; empty: all
    classes, an exactly balanced set as the FID while training takes); None if unconditional."""
    if num_classes == 0:
        if classes:
            raise ValueError(f"--classes {classes}: the model is unconditional (model.num_classes = 0)")
        return None
    classes = classes or list(range(num_classes))
    bad = [c for c in classes if not 0 <= c < num_classes]
    if bad:
        raise ValueError(f"--classes {bad}: the model has classes 0..{num_classes - 1}")
    return torch.tensor(classes)[torch.arange(num) % len(classes)]


def sampler_options(sampling) -> dict:
    """sample_images' keyword arguments that a `[sampling]` section sets besides the sampler, steps and guidance
    scale: the guidance interval, the timestep shift and the SDE's settings (sample grids, the FID while training and
    sample.py sample alike)."""
    return {
        "guidance_interval": (sampling.guidance_low, sampling.guidance_high),
        "timestep_shift": sampling.timestep_shift,
        "sde": SDESettings(
            sampling.sde_diffusion_form,
            sampling.sde_diffusion_norm,
            sampling.sde_last_step,
            sampling.sde_last_step_size,
        ),  # fmt: skip
    }


def check_sampler(diffusion, sampler: str, steps: int, guidance_interval=(0.0, 1.0), timestep_shift: float = 1.0):
    """Raises ValueError, naming the `[sampling]` key, for a sampler or setting the objective cannot sample with."""
    low, high = guidance_interval
    if isinstance(diffusion, GaussianDiffusion):
        if sampler not in ("default", "ddim", "ddpm"):
            raise ValueError(f"sampling.sampler = {sampler!r}: DDPM samples with 'ddim' or 'ddpm'")
        if (low, high) != (0.0, 1.0) or timestep_shift != 1.0:
            raise ValueError(f"sampling.guidance_low, guidance_high = {low}, {high} and sampling.timestep_shift = "
                             f"{timestep_shift}: rectified flow's; DDPM guides every step of its own grid (0, 1 "
                             "and 1)")  # fmt: skip
        return
    if sampler not in ("default", "euler", "heun", "sde"):
        hint = " ('ddim' and 'ddpm' are the DDPM objective's)" if sampler in ("ddim", "ddpm") else ""
        raise ValueError(f"sampling.sampler = {sampler!r}: rectified flow samples with 'euler', 'heun' or "
                         f"'sde'{hint}")  # fmt: skip
    if not 0 <= low < high <= 1:
        raise ValueError(f"sampling.guidance_low, guidance_high = {low}, {high}: must have 0 <= low < high <= 1")
    if not (math.isfinite(timestep_shift) and timestep_shift > 0):
        raise ValueError(f"sampling.timestep_shift = {timestep_shift}: must be a finite number > 0 (1: none)")
    if sampler == "sde" and timestep_shift != 1.0:
        raise ValueError(f"sampling.timestep_shift = {timestep_shift}: the ODE samplers' ('euler', 'heun'); the "
                         "'sde' sampler steps evenly, as SiT's and REPA's")  # fmt: skip
    if sampler == "sde" and steps < 2:
        raise ValueError(f"sampling.steps = {steps}: the 'sde' sampler takes at least 2 (its last step is a "
                         "step of its own)")  # fmt: skip


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
    guidance_channels: int = -1,
    generator: torch.Generator | IndexedNoise | None = None,
    *,
    guidance_interval: tuple[float, float] = (0.0, 1.0),
    timestep_shift: float = 1.0,
    sde: SDESettings | None = None,
) -> torch.Tensor:
    """Runs the objective's sampler ('ddim' or 'ddpm' for DDPM; 'euler', 'heun' or 'sde' for flow) with optional CFG
    on the first `guidance_channels` channels of the model's output (-1: all; 3: facebookresearch/DiT's
    `forward_with_cfg`). `generator` draws the step noise of the stochastic samplers, 'ddpm' and 'sde' (None: the
    global RNG, as the references; `IndexedNoise`: each sample's own, as `sample_noise` returns it). The flow's
    samplers also take a guidance interval, outside of which the steps run the conditional model alone, a timestep
    shift (the ODE's) and the SDE's settings (`RectifiedFlow.sample`)."""
    check_sampler(diffusion, sampler, steps, guidance_interval, timestep_shift)
    unguided = None
    if cfg_scale != 1.0 and y is not None:
        channels = noise.shape[1] if guidance_channels < 0 else guidance_channels
        if not 0 < channels <= noise.shape[1]:
            raise ValueError(f"guidance on {guidance_channels} channels of a {noise.shape[1]}-channel model")
        unguided, model = model, guided(model, cfg_scale, null_class, channels)
    if isinstance(diffusion, GaussianDiffusion):
        if sampler == "ddpm":  # ancestral, over respaced timesteps: the DiT paper's sampler
            return diffusion.ddpm_sample(model, noise, y, steps, clip_denoised, generator)
        return diffusion.ddim_sample(model, noise, y, steps, clip_denoised)
    return diffusion.sample(model, noise, y, steps, "euler" if sampler == "default" else sampler, unguided=unguided,
                            guidance_interval=guidance_interval, timestep_shift=timestep_shift, sde=sde,
                            generator=generator)  # fmt: skip


def validation_timesteps(diffusion, count: int = 8) -> torch.Tensor:
    """`count` equally spaced times of the path for a validation loss at fixed timesteps (SD3's: 8), the midpoints
    of its `count` equal parts, (k + 1/2) / count with 0 the data and 1 the noise, in the objective's own t:
    rectified flow's float32 t, or DDPM's integer step floor((k + 1/2) T / count) (62, 187, ..., 937 of 1000)."""
    midpoints = (torch.arange(count, dtype=torch.float64) + 0.5) / count
    if isinstance(diffusion, GaussianDiffusion):
        return (midpoints * diffusion.num_timesteps).floor().long()
    return midpoints.float()
