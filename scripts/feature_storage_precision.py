"""What storing the alignment encoder's features in float16 or bfloat16 (prepare.py --store-features --features-dtype)
does to the alignment loss and its gradient, against the float32 features the encoder computes, beside what computing
the encoder in bf16 (a bf16 GPU run's encoder, on the fly) does. docs/latent.md quotes its output.

    python scripts/feature_storage_precision.py [--encoder dinov2_vitb14_pretrain.pth] [--images 8]

Without --encoder: DINOv2-B/14's architecture with random weights (seeded), at 224 px, on smooth random images.
Projections: random (the start of training), and the features plus noise at cos 0.9 and 0.99 (late in training,
where the gradient, proportional to sin(projection, feature), is smallest and its relative error largest).
"""

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from torchtitan.alignment import alignment_losses  # noqa: E402
from torchtitan.alignment.dinov2_weights import read_dinov2  # noqa: E402
from torchtitan.alignment.encoder import FrozenEncoder  # noqa: E402
from torchtitan.alignment.vit import VisionTransformer, ViTArgs  # noqa: E402


def random_dinov2_b() -> tuple[ViTArgs, dict[str, torch.Tensor]]:
    """DINOv2-B/14 at 16 x 16 tokens with random weights of a trained one's scales (LayerScale ~0.1, norms ~1)."""
    args = ViTArgs(dim=768, depth=12, num_heads=12, grid=16)
    state = {}
    for name, tensor in VisionTransformer(args).state_dict().items():
        if name.endswith("gamma"):
            state[name] = 0.1 + 0.05 * torch.randn_like(tensor)
        elif "norm" in name and name.endswith("weight"):
            state[name] = 1 + 0.5 * torch.randn_like(tensor)
        else:
            state[name] = (0.1 if name.endswith("bias") else 0.02) * torch.randn_like(tensor)
    return args, state


def projections(z: torch.Tensor) -> dict[str, torch.Tensor]:
    """Random projections, and the features plus isotropic noise at a mean cosine of 0.9 and 0.99."""
    scale = z.norm(dim=-1, keepdim=True) / z.shape[-1] ** 0.5
    return {"random": torch.randn_like(z), "cos 0.9": z + 0.48 * scale * torch.randn_like(z),
            "cos 0.99": z + 0.14 * scale * torch.randn_like(z)}  # fmt: skip


def loss_and_gradient(p: torch.Tensor, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    p = p.detach().requires_grad_(True)
    losses = alignment_losses([p], [z])  # (B,)
    (grad,) = torch.autograd.grad(losses.sum(), p)
    return losses.detach(), grad


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--encoder", default="", help="a DINOv2 .pth or Hugging Face folder (default: random B/14)")
    parser.add_argument("--images", type=int, default=8)
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    vit_args, state = read_dinov2(args.encoder, 16) if args.encoder else random_dinov2_b()
    smooth = torch.nn.functional.interpolate(torch.rand(args.images, 3, 8, 8) * 2 - 1, size=(256, 256), mode="bicubic")
    images = ((smooth.clamp(-1, 1) + 1) * 127.5).round() / 127.5 - 1  # as a stored uint8 image arrives
    z = FrozenEncoder(vit_args, state)(images)  # float32, (B, T, D)
    variants = {"float16 storage": z.half(), "bfloat16 storage": z.bfloat16(),
                "bf16 compute": FrozenEncoder(vit_args, state, bf16=True)(images)}  # fmt: skip
    print("| projection | loss | variant | max abs change of a sample's loss | gradient change / its norm |")
    print("| --- | --- | --- | --- | --- |")
    for name, p in projections(z).items():
        losses, grad = loss_and_gradient(p, z)
        for variant, features in variants.items():
            changed, changed_grad = loss_and_gradient(p, features)
            print(f"| {name} | {losses.mean():.4f} | {variant} | {(changed - losses).abs().max():.1e} | "
                  f"{(changed_grad - grad).norm() / grad.norm():.1e} |")  # fmt: skip


if __name__ == "__main__":
    main()
