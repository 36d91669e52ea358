"""The DiT family's training objective for the Trainer: per-sample diffusion losses with layout-independent noise."""

import torch
import torch.distributed as dist
from torch import nn

from torchtitan.diffusion import build_diffusion


def draw_weights(values: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Each draw's weight (B K,) for per-draw values (B K,): 1, or its sample's Poisson mask (B,) for each of its K
    draws (padding counts nowhere)."""
    if mask is None:
        return torch.ones_like(values)
    return mask.double().repeat_interleave(values.numel() // mask.numel())


class LossByTimestep:
    """minRF's diagnostic: the mean per-sample loss in each of `num_bins` equal bins of t in [0, 1] (rectified flow's
    t; DDPM's t / num_timesteps), over the samples since the last log, logged as `loss/t_bin_k`.

    Sums and counts stay on the device (adding a micro-batch is a few kernels and no host sync); `metrics` sums them
    over the data-parallel ranks, as the loss is, so the bins are exact over the global batch whatever the layout.
    Each of dp.augmult's K draws counts with its own t; Poisson padding (mask 0) counts nowhere.
    """

    def __init__(self, device: torch.device, num_bins: int = 10):
        self.num_bins = num_bins
        # Inner edges k / n, each correctly rounded to float32 as DDPM's t / T is: t = 100 / 1000 meets edge 1 / 10
        # as the same float and falls in bin 1 (a float32 product t * n can round below the edge).
        self.edges = (torch.arange(1, num_bins, dtype=torch.float32) / num_bins).to(device)
        self.totals = torch.zeros(2, num_bins, dtype=torch.float64, device=device)  # loss sums, sample counts

    def add(self, t: torch.Tensor, losses: torch.Tensor, mask: torch.Tensor | None = None) -> None:
        """Adds one micro-batch.

        Args:
            t: the draws' times in [0, 1], (B K,) with a sample's K draws consecutive.
            losses: the draws' losses, (B K,) or (B, K).
            mask: (B,) 1 for a real sample, 0 for Poisson padding; None: all real.
        """
        losses = losses.detach().double().reshape(-1)  # (B K,)
        weight = draw_weights(losses, mask)
        bins = torch.bucketize(t.detach().float().reshape(-1), self.edges, right=True)  # (B K,) in [0, n)
        self.totals[0].index_add_(0, bins, losses * weight)
        self.totals[1].index_add_(0, bins, weight)

    def metrics(self, group=None) -> dict[str, float]:
        """`loss/t_bin_k` of every bin that any rank's samples fell in since the last call (a collective over
        `group` when distributed); starts the next interval."""
        totals = self.totals.clone()
        self.totals.zero_()
        if dist.is_initialized():
            dist.all_reduce(totals, group=group)
        sums, counts = totals.tolist()
        return {f"loss/t_bin_{k}": s / c for k, (s, c) in enumerate(zip(sums, counts)) if c > 0}


class MeanLoss:
    """The mean of a per-sample value over the samples since the last log, logged as `name` (`loss/alignment`):
    sums on the device, summed over the data-parallel ranks at the log step, Poisson padding (mask 0) left out."""

    def __init__(self, name: str, device: torch.device):
        self.name = name
        self.totals = torch.zeros(2, dtype=torch.float64, device=device)  # sum, samples

    def add(self, values: torch.Tensor | None, mask: torch.Tensor | None = None) -> None:
        """Adds one micro-batch's values (B K,) (None: nothing this micro-batch); `mask` (B,) as LossByTimestep's."""
        if values is None:
            return
        values = values.detach().double().reshape(-1)
        weight = draw_weights(values, mask)
        self.totals += torch.stack([(values * weight).sum(), weight.sum()])

    def metrics(self, group=None) -> dict[str, float]:
        """{name: mean} when any sample counted since the last call (a collective when distributed)."""
        totals = self.totals.clone()
        self.totals.zero_()
        if dist.is_initialized():
            dist.all_reduce(totals, group=group)
        total, count = totals.tolist()
        return {self.name: total / count} if count > 0 else {}


class DiffusionObjective:
    """DDPM or rectified flow (the `[diffusion]` section) on (images, labels) micro-batches, with representation
    alignment (`[alignment]`, torchtitan/alignment/) added to each sample's loss when the model has projectors.

    Args:
        diffusion_config: the `[diffusion]` section.
        model_args: the DiT's args (input shape, classes, learned sigma, alignment projectors).
        layout: this rank's place in the global batch (torchtitan.protocols.BatchLayout).
        alignment: the run's RepresentationAlignment (its encoder sees the clean images); None without projectors.
    """

    tokens_per_sample = 0
    reports_perplexity = False

    def __init__(self, diffusion_config, model_args, layout, alignment=None):
        self.diffusion = build_diffusion(diffusion_config, model_args.learn_sigma)
        self.class_dropout_prob = diffusion_config.class_dropout_prob
        self.args, self.layout, self.alignment = model_args, layout, alignment
        self.loss_by_timestep = LossByTimestep(layout.device)  # the trainer adds each micro-batch's `take_draws()`
        self.last_draws: tuple[torch.Tensor, torch.Tensor] | None = None  # t in [0, 1], losses (B K,), detached
        # REPA's projection loss (its proj_loss: without the coefficient), per sample; the trainer adds
        # `take_alignment()` with the Poisson mask and logs it beside the loss.
        self.alignment_loss = MeanLoss("loss/alignment", layout.device) if model_args.align_depth else None
        self.last_alignment: torch.Tensor | None = None

    def compile_loss(self) -> None:
        self.diffusion.compile_loss()

    def take_draws(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The last micro-batch's times in [0, 1] and losses, detached, let go here: nothing the loss binning needs
        stays alive through the backward (DDPM's t / T is a tensor of its own)."""
        draws, self.last_draws = self.last_draws, None
        return draws

    def take_alignment(self) -> torch.Tensor | None:
        """The last micro-batch's alignment losses (B K,), detached, let go here; None when it did not align."""
        values, self.last_alignment = self.last_alignment, None
        return values

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
        """Per-sample losses (B,), or (B, K) with dp.augmult K: each sample's K draws in rows of one forward.

        x: images, or latents with the images they encode (datasets.prefetch.LatentsAndImages) for the alignment's
        encoder on a latent run, or with that encoder's stored features of them (LatentsAndFeatures)."""
        images, features = x, None  # a pixel run's encoder sees its inputs
        if hasattr(x, "latents"):
            x, images, features = x.latents, getattr(x, "images", None), getattr(x, "features", None)
        t, noise, drop = self.step_randomness(step, micro, x.shape[0])
        k = self.layout.augmult
        targets = None  # the encoder's features of the clean images, once per image (not per draw)
        if self.alignment is not None and self.alignment.active(step):
            targets = [z.repeat_interleave(k, 0) if k > 1 else z for z in self.alignment.targets(images, features)]
        if k > 1:
            x, y = x.repeat_interleave(k, 0), y.repeat_interleave(k, 0)
        if self.args.num_classes > 0:
            y = torch.where(drop, torch.full_like(y, self.args.num_classes), y)  # CFG's null class
        else:
            y = None
        losses = self.draw_losses(model, x, y, t, noise, targets)
        return losses.view(-1, k) if k > 1 else losses

    def draw_losses(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor | None, t: torch.Tensor,
                    noise: torch.Tensor, targets: list[torch.Tensor] | None = None) -> torch.Tensor:  # fmt: skip
        """Each draw's loss (B K,) from its clean image, label, time in [0, 1] and noise: the diffusion loss, plus
        the alignment's with projectors (`targets`: the encoder's features, one (B K, T, D) per encoder; None once
        alignment.stop_step has passed). Keeps the draws for `take_draws` and `take_alignment`."""
        if not self.args.align_depth:
            losses, t_fraction = self.diffusion.training_losses(model, x, y, t=t, noise=noise)
            self.last_draws = (t_fraction.detach(), losses.detach())
            return losses
        projected = []

        def model_with_projections(x_t, t_model, labels):  # the objectives call model(x_t, t, y) for the output
            out, projected[:] = model(x_t, t_model, labels, aligned=True)
            return out

        losses, t_fraction = self.diffusion.training_losses(model_with_projections, x, y, t=t, noise=noise)
        self.last_draws = (t_fraction.detach(), losses.detach())  # loss/t_bin_k: the diffusion loss alone
        added, alignment = self.alignment.losses(projected, targets)
        self.last_alignment = alignment.detach() if alignment is not None else None
        return losses + added
