"""Writes tests/data/repa_reference/: a tiny REPA checkpoint made by sihyun-yu/REPA's OWN code (models/sit.py's SiT
with its projectors, in its train.py's checkpoint format), a tiny DINOv2 state dict made by facebookresearch/dinov2's
own DinoVisionTransformer (the official .pth format), and what REPA computes with them (tests/test_repa.py).

    pip install --no-deps --target /tmp/timm_site timm==1.0.22   # REPA's sit.py and train.py import timm
    PYTHONPATH=/tmp/timm_site python tests/data/repa_reference/make_reference_checkpoint.py /path/to/REPA \\
        /path/to/dinov2 [--out tests/data/repa_reference]

REPA's train.py imports accelerate and wandb at its top; neither is used by what is called here
(`preprocess_raw_image`), so empty stand-ins are put in their place when they are not installed.

The encoder's features are REPA's, step by step as its train.py and utils.py take them: DinoVisionTransformer as
torch.hub builds dinov2_vit*14_reg (patch 14, LayerScale, registers; smaller widths), its position table resampled by
timm's `resample_abs_pos_embed` to 16 x 16 patches (utils.load_encoders), the uint8 images through train.py's
`preprocess_raw_image(x, "dinov2-vit-b")`, then `forward_features(x)["x_norm_patchtokens"]`. The losses are SILoss's
(loss.py, path "linear", prediction "v", uniform times) on the SiT's EMA in eval mode (no label dropout), the global
RNG seeded by "seed" before the call (it draws the times, then the noise), and the gradients those of train.py's
`loss.mean() + proj_coeff * proj_loss.mean()`.

Files:
    tiny_repa_train_checkpoint.pt: {"model", "ema", "opt": {}, "args": argparse.Namespace(...), "steps"}, as train.py
        saves it. The zero-initialized adaLN and output layers are perturbed, and the EMA differs from the model.
    tiny_dinov2_reg.pth: the DINOv2 state dict (its 20 x 20 position table as published tables are: 37 x 37).
    tiny_repa_reference_io.safetensors: "images" (B, 3, 32, 32) uint8, enlarged 8x by nearest neighbours to the
        256 px REPA sees; "zs" the encoder's features (B, 256, 64); "x" latents (B, 4, 32, 32); "y" labels (one the
        null class); "t" (B,) and "noise" as SILoss drew them; "denoising_loss" (B,), "proj_loss" (scalar) and
        "loss" (the backward's scalar); "grad.<REPA name>" for every parameter of the EMA SiT; "euler" and "heun",
        REPA's samplers.euler_sampler (4 steps, no guidance, in float64 as it integrates) from "sample_noise".
"""

import argparse
import copy
import sys
import types
from pathlib import Path

import torch

SIT = dict(input_size=32, patch_size=2, in_channels=4, hidden_size=16, decoder_hidden_size=16, depth=3, num_heads=2,
           encoder_depth=2, num_classes=10, class_dropout_prob=0.1, z_dims=[64], projector_dim=24)  # fmt: skip
DINO = dict(img_size=280, patch_size=14, embed_dim=64, depth=1, num_heads=1, mlp_ratio=1, init_values=1.0,
            ffn_layer="mlp", block_chunks=0, num_register_tokens=4, interpolate_antialias=False,
            interpolate_offset=0.1)  # fmt: skip
GRID, PROJ_COEFF, SEED, BATCH, SAMPLE_STEPS = 16, 0.5, 1234, 2, 4
CHECKPOINT, ENCODER, REFERENCE_IO = (
    "tiny_repa_train_checkpoint.pt",
    "tiny_dinov2_reg.pth",
    "tiny_repa_reference_io.safetensors",
)


def stand_ins() -> None:
    """Empty accelerate and wandb modules, for train.py's imports (only preprocess_raw_image is called)."""
    import importlib.util
    import logging

    from diffusers.models import AutoencoderKL  # noqa: F401  (first: diffusers looks accelerate up once, at import)

    if importlib.util.find_spec("accelerate") is None:
        accelerate = types.ModuleType("accelerate")
        accelerate.Accelerator = object
        logging_module = types.ModuleType("accelerate.logging")
        logging_module.get_logger = logging.getLogger
        utils = types.ModuleType("accelerate.utils")
        utils.ProjectConfiguration = utils.set_seed = None
        sys.modules.update({"accelerate": accelerate, "accelerate.logging": logging_module, "accelerate.utils": utils})
    if importlib.util.find_spec("wandb") is None:
        sys.modules["wandb"] = types.ModuleType("wandb")


def perturbed(model: torch.nn.Module, generator: torch.Generator, scale: float) -> torch.nn.Module:
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(scale * torch.randn(p.shape, generator=generator))
    return model


def encoder_features(dinov2_checkout: Path, images: torch.Tensor, generator: torch.Generator, out: Path):
    sys.path.insert(0, str(dinov2_checkout))
    import timm
    from dinov2.layers import MemEffAttention, NestedTensorBlock
    from dinov2.models.vision_transformer import DinoVisionTransformer

    from train import preprocess_raw_image  # REPA's own

    encoder = DinoVisionTransformer(block_fn=lambda *a, **k: NestedTensorBlock(*a, attn_class=MemEffAttention, **k),
                                    **DINO)  # fmt: skip
    perturbed(encoder, generator, 0.2)  # LayerScale 1.0 and the tokens 0 at init: made random
    state = {k: v for k, v in encoder.state_dict().items()}  # what the official .pth holds (head: Identity)
    torch.save(state, out / ENCODER)
    # utils.load_encoders: the head dropped, the position table resampled to 16 * (resolution // 256) patches.
    encoder.pos_embed.data = timm.layers.pos_embed.resample_abs_pos_embed(encoder.pos_embed.data, [GRID, GRID])
    encoder.eval()
    with torch.no_grad():
        x = preprocess_raw_image(images, "dinov2-vit-b")
        return encoder.forward_features(x)["x_norm_patchtokens"]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("repa_checkout", help="a clone of sihyun-yu/REPA (models/sit.py, loss.py, train.py)")
    parser.add_argument("dinov2_checkout", help="a clone of facebookresearch/dinov2")
    parser.add_argument("--out", default=str(Path(__file__).parent))
    args = parser.parse_args(argv)
    stand_ins()
    sys.path.insert(0, str(Path(args.repa_checkout).resolve()))
    from loss import SILoss  # REPA's own
    from models.sit import SiT

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(1)
    small = torch.randint(0, 256, (BATCH, 3, 32, 32), generator=generator, dtype=torch.uint8)
    images = small.repeat_interleave(8, 2).repeat_interleave(8, 3).float()  # REPA's raw_image: 0..255 at 256 px
    zs = encoder_features(Path(args.dinov2_checkout).resolve(), images, generator, out)

    torch.manual_seed(0)
    model = perturbed(SiT(**SIT, qk_norm=False, fused_attn=True), generator, 0.05)
    ema = perturbed(copy.deepcopy(model), generator, 0.01).eval()
    train_args = argparse.Namespace(model="tiny (see SIT)", num_classes=SIT["num_classes"], encoder_depth=2,
                                    fused_attn=True, qk_norm=False, resolution=256, batch_size=BATCH,
                                    path_type="linear", prediction="v", cfg_prob=0.1, enc_type="dinov2-vit-b",
                                    proj_coeff=PROJ_COEFF, weighting="uniform", legacy=False)  # fmt: skip
    torch.save({"model": model.state_dict(), "ema": ema.state_dict(), "opt": {}, "args": train_args, "steps": 1},
               out / CHECKPOINT)  # fmt: skip

    x = torch.randn(BATCH, SIT["in_channels"], SIT["input_size"], SIT["input_size"], generator=generator)
    y = torch.tensor([3, SIT["num_classes"]])  # one null-class label
    loss_fn = SILoss(prediction="v", path_type="linear", weighting="uniform")
    torch.manual_seed(SEED)
    denoising, proj = loss_fn(ema, x, dict(y=y), zs=[zs])
    loss = denoising.mean() + PROJ_COEFF * proj.mean()
    loss.backward()
    torch.manual_seed(SEED)  # the draws SILoss made: times, then noise
    t = torch.rand((BATCH, 1, 1, 1)).flatten()
    noise = torch.randn_like(x)
    tensors = {"images": small, "zs": zs, "x": x, "y": y, "t": t, "noise": noise, "denoising_loss": denoising.detach(),
               "proj_loss": proj.detach(), "loss": loss.detach()}  # fmt: skip
    tensors.update({f"grad.{name}": p.grad for name, p in ema.named_parameters() if p.grad is not None})
    from samplers import euler_sampler  # REPA's own ODE sampler (its generate.py's --mode ode), without guidance

    sample_noise = torch.randn(BATCH, SIT["in_channels"], SIT["input_size"], SIT["input_size"], generator=generator)
    tensors["sample_noise"] = sample_noise
    for name, heun in (("euler", False), ("heun", True)):
        tensors[name] = euler_sampler(ema, sample_noise, y, num_steps=SAMPLE_STEPS, heun=heun).float()
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in tensors.items()}, out / REFERENCE_IO,
              metadata={"sit": repr(SIT), "dinov2": repr(DINO), "proj_coeff": str(PROJ_COEFF),
                        "torch": torch.__version__})  # fmt: skip
    print(f"wrote {out / CHECKPOINT}, {out / ENCODER} and {out / REFERENCE_IO}")


if __name__ == "__main__":
    main()
