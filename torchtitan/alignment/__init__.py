"""Representation alignment (REPA: Yu et al., "Representation Alignment for Generation", 2025; sihyun-yu/REPA).

The DiT's tokens after block `alignment.depth`, through a small projector per encoder (part of the model:
DiT.projectors), are pulled towards a frozen encoder's features of the clean image by a negative cosine similarity
per token. Here: the encoder (encoder.py, DINOv2 in vit.py, its weights in dinov2_weights.py), the record of its
features stored with prepared latents in its place (features.py), the per-sample loss, and `RepresentationAlignment`,
which the diffusion objective (torchtitan/diffusion/objective.py) holds.
"""

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["RepresentationAlignment", "alignment_losses", "build_alignment", "encoder_architecture"]


def alignment_losses(projected: list[torch.Tensor], targets: list[torch.Tensor]) -> torch.Tensor:
    """Per-sample alignment loss (B,): the negative cosine similarity of each token's projection and the encoder's
    feature, averaged over the tokens, then over the encoders (REPA's SILoss projection loss, per sample).

    Args:
        projected: per encoder, the projected DiT tokens (B, T, D_i).
        targets: per encoder, its features of the clean images (B, T, D_i).
    """
    losses = [
        -(F.normalize(p.float(), dim=-1) * F.normalize(z.float(), dim=-1)).sum(-1).mean(-1)  # (B,)
        for p, z in zip(projected, targets, strict=True)
    ]
    return torch.stack(losses).mean(0)


class RepresentationAlignment:
    """The `[alignment]` section at work: the frozen encoder, the coefficient, and when it stops (HASTE).

    Args:
        encoder: images in [-1, 1] (B, C, H, W) -> features (B, T, D), frozen (None: the batches hold the features,
            stored by prepare.py --store-features, or targets are handed in).
        coefficient: the weight of the alignment loss in each sample's loss (REPA's proj_coeff).
        stop_step: align during the first stop_step optimizer steps only (HASTE); 0: throughout.
    """

    def __init__(self, encoder: nn.Module | None, coefficient: float, stop_step: int = 0):
        self.encoder, self.coefficient, self.stop_step = encoder, coefficient, stop_step

    def active(self, step: int) -> bool:
        """Whether the optimizer step that `step` steps are done before aligns."""
        return self.stop_step == 0 or step < self.stop_step

    def targets(self, images: torch.Tensor | None, features: torch.Tensor | None = None) -> list[torch.Tensor]:
        """The encoder's features of the clean images, one (B, T, D) tensor per encoder, without grad: `features`
        when the batch holds them (stored by prepare.py --store-features; the encoder is not run, nor built), else the
        encoder's on `images`."""
        if features is not None:
            return [features]
        return [self.encoder(images)]

    def losses(self, projected: list[torch.Tensor], targets: list[torch.Tensor] | None):
        """(what alignment adds to each sample's loss (B,), the alignment loss (B,) or None once stopped).

        Added: coefficient x alignment_losses; once stopped (targets None), zero times the projections: the
        projectors still take part in every step, so every layout sees the same parameters receive gradients
        (DDP's reducer and DP-SGD's hooks expect each one each step)."""
        if targets is None:
            return sum(p.float().mean(dim=(1, 2)) for p in projected) * 0.0, None
        alignment = alignment_losses(projected, targets)
        return self.coefficient * alignment, alignment


def encoder_architecture(alignment_config, grid: int):
    """The `[alignment]` encoder's architecture at a DiT's `grid` x `grid` tokens (vit.ViTArgs: its feature width,
    `dim`, is what the projector maps to; its forward FLOPs count in the run's MFU), read from its file.

    Raises:
        FileNotFoundError, ValueError: the file is missing or not the encoder's weights.
    """
    from torchtitan.alignment.dinov2_weights import dinov2_architecture

    return dinov2_architecture(alignment_config.encoder_path, grid)


def build_alignment(job_config, model_args, device: torch.device, stored: bool = False) -> RepresentationAlignment:
    """The run's alignment: its encoder on `device` at the DiT's token grid, bf16 on a bf16 CUDA run, compiled when
    the model is; none at all when the batches hold its `stored` features."""
    from torchtitan.alignment.encoder import build_encoder

    cfg = job_config.alignment
    if stored:
        from torchtitan.tools.logging import logger

        training = job_config.training
        source = repr(training.dataset_path) if training.dataset == "latents" else f"the {training.dataset} data"
        logger.info(f"alignment: the encoder's features stored with {source} (prepare.py --store-features) replace "
                    f"running {cfg.encoder_path!r}, which is not built")  # fmt: skip
        return RepresentationAlignment(None, cfg.coefficient, cfg.stop_step)
    bf16 = device.type == "cuda" and job_config.training.mixed_precision_param == "bfloat16"
    compiled = job_config.compile.enable and "model" in job_config.compile.components
    grid = model_args.input_size // model_args.patch_size
    encoder = build_encoder(cfg, grid, device, bf16, compiled)
    return RepresentationAlignment(encoder, cfg.coefficient, cfg.stop_step)
