"""The DiT family's training objective for the Trainer: per-sample diffusion losses with layout-independent noise."""

import torch
from torch import nn

from torchtitan.diffusion import build_diffusion


class DiffusionObjective:
    """DDPM or rectified flow (the `[diffusion]` section) on (images, labels) micro-batches.

    Args:
        diffusion_config: the `[diffusion]` section.
        model_args: the DiT's args (input shape, classes, learned sigma).
        layout: this rank's place in the global batch (torchtitan.train_spec.BatchLayout).
    """

    tokens_per_sample = 0
    reports_perplexity = False

    def __init__(self, diffusion_config, model_args, layout):
        self.diffusion = build_diffusion(diffusion_config, model_args.learn_sigma)
        self.class_dropout_prob = diffusion_config.class_dropout_prob
        self.args, self.layout = model_args, layout

    def step_randomness(self, step: int, micro: int, batch: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Timesteps, noise and label-drop mask of this rank's samples for one micro-batch, K = augmult
        draws per sample (its rows consecutive): (batch K,), (batch K, C, H, W), (batch K,).

        Drawn for the whole global micro-batch from a generator seeded by (seed, step), then sliced
        by rank in the sampler's interleaved order, so a sample gets the same noise whatever the
        number of ranks: 1 process and N processes at the same global batch see the same losses.
        """
        layout, args = self.layout, self.args
        shape = (args.in_channels, args.input_size, args.input_size)
        generator = torch.Generator(layout.device).manual_seed(layout.seed * 1_000_003 + step)
        world_micro, k = batch * layout.dp_degree, layout.augmult
        total = world_micro * layout.grad_accum_steps
        t = self.diffusion.sample_timesteps(total * k, layout.device, generator).view(total, k)
        noise = torch.randn((total, k, *shape), device=layout.device, generator=generator)
        drop = torch.rand(total * k, device=layout.device, generator=generator).view(total, k)
        drop = drop < self.class_dropout_prob
        window = slice(micro * world_micro, (micro + 1) * world_micro)

        def mine(draws: torch.Tensor) -> torch.Tensor:  # this rank's samples of this micro-batch
            return draws[window][layout.dp_rank :: layout.dp_degree].flatten(0, 1)

        return mine(t), mine(noise), mine(drop)

    def losses(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor, step: int, micro: int) -> torch.Tensor:
        """Per-sample losses (B,), or (B, K) with dp.augmult K: each sample's K draws in rows of one forward."""
        t, noise, drop = self.step_randomness(step, micro, x.shape[0])
        k = self.layout.augmult
        if k > 1:
            x, y = x.repeat_interleave(k, 0), y.repeat_interleave(k, 0)
        if self.args.num_classes > 0:
            y = torch.where(drop, torch.full_like(y, self.args.num_classes), y)  # CFG's null class
        else:
            y = None
        losses, _ = self.diffusion.training_losses(model, x, y, t=t, noise=noise)
        return losses.view(-1, k) if k > 1 else losses
