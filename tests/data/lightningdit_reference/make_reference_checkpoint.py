"""Writes tests/data/lightningdit_reference/: tiny checkpoints made by hustvl/LightningDiT's OWN models/lightningdit.py,
and the reference's outputs and transport losses on recorded inputs (tests/test_lightningdit_weights.py and
tests/test_diffusion.py load them).

    # the reference imports timm, einops, fairscale (models/rmsnorm.py), scipy and torchdiffeq (transport/); the
    # tests do not. Leaving the project's venv as it is:
    pip install --no-deps --target /tmp/ref_site timm==1.0.22 einops fairscale torchdiffeq
    PYTHONPATH=/tmp/ref_site python tests/data/lightningdit_reference/make_reference_checkpoint.py \
        /path/to/LightningDiT [--out tests/data/lightningdit_reference]

The reference decorates its forwards with @torch.compile; this script sets TORCHDYNAMO_DISABLE=1 before importing
torch, so they run eagerly (fp32, CPU).

Files:
    tiny_lightningdit_train_checkpoint.pt: {"model", "ema", "opt": {}, "config"}, as train.py saves it (config: its
        YAML as a dict), of TRAIN_CONFIG's model: RoPE, RMSNorm, SwiGLU and QK-norm, patch 1. The zero-initialized
        adaLN and final layers are perturbed so that nothing hides behind a zero, as are the RMSNorm weights (ones
        at init), and the EMA differs from the model.
    tiny_lightningdit_plain.pt: a plain state dict of PLAIN_MODEL: LayerNorm, GELU, RoPE, adaLN without shifts
        (wo_shift) and a learned sigma, patch 2.
    tiny_lightningdit_reference_io.safetensors: x (B, C, H, W), t (B,) in [0, 1] (LightningDiT's time: 1 is data),
        y (B,) labels (one is the null class), and the reference's outputs (eval mode): "out_ema", "out_model" of the
        train checkpoint, "out_plain" of the plain one on "x_plain". The transport loss (`create_transport("Linear",
        "velocity", use_cosine_loss=True, use_lognorm=True).training_losses`) of the EMA weights on data "loss_x1",
        its noise "loss_x0" and times "loss_t" (its sampler's draws replaced by these), labels "loss_y": per sample
        "loss_mse" and "loss_cos", the model's output "loss_pred", and "grad.<name>": the gradient of
        mean(loss_mse + loss_cos) (train.py's loss) with respect to each trainable parameter, in the reference's names.
        Its Euler ODE sampler (ODE_STEPS steps) on the EMA weights: "ode_euler", and "ode_cfg" with guidance
        ODE_CFG_SCALE (see ode_samples).
"""

import argparse
import copy
import os
import sys
from pathlib import Path

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")  # the reference's @torch.compile forwards run eagerly

import torch  # noqa: E402

SIZES = dict(input_size=4, in_channels=8, hidden_size=16, num_heads=2, num_classes=10)
TRAIN_CONFIG = {
    "data": {"image_size": 64, "num_classes": 10, "latent_norm": True, "latent_multiplier": 1.0},
    "vae": {"model_name": "vavae_f16d32", "downsample_ratio": 16},
    "model": {"model_type": "tiny (see SIZES)", "use_qknorm": True, "use_swiglu": True, "use_rope": True,
              "use_rmsnorm": True, "wo_shift": False, "in_chans": 8},
    "train": {"max_steps": 1, "global_batch_size": 4, "global_seed": 0},
    "optimizer": {"lr": 0.0002, "beta2": 0.95},
    "transport": {"path_type": "Linear", "prediction": "velocity", "loss_weight": None, "sample_eps": None,
                  "train_eps": None, "use_cosine_loss": True, "use_lognorm": True},
}  # fmt: skip
TRAIN_MODEL = dict(patch_size=1, depth=2, use_qknorm=True, use_swiglu=True, use_rope=True, use_rmsnorm=True)
PLAIN_MODEL = dict(patch_size=2, depth=1, use_rope=True, wo_shift=True, learn_sigma=True)
ODE_STEPS, ODE_CFG_SCALE = 6, 4.0
CHECKPOINT, PLAIN, REFERENCE_IO = "tiny_lightningdit_train_checkpoint.pt", "tiny_lightningdit_plain.pt", \
    "tiny_lightningdit_reference_io.safetensors"  # fmt: skip


def perturbed(model: torch.nn.Module, generator: torch.Generator, scale: float) -> torch.nn.Module:
    """Adds scale * N(0, 1) to every trainable parameter (pos_embed, frozen, stays the sin-cos table)."""
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(scale * torch.randn(p.shape, generator=generator))
    return model


def transport_losses(ema: torch.nn.Module, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """The reference's training loss (cosine term on, its transport's own code) on recorded data, noise and times,
    and the gradients of train.py's total loss."""
    from transport import create_transport  # the reference's own code

    transport = create_transport("Linear", "velocity", None, None, None, use_cosine_loss=True, use_lognorm=True)
    batch, c, size = 4, SIZES["in_channels"], SIZES["input_size"]
    x1 = torch.randn(batch, c, size, size, generator=generator)
    x0 = torch.randn(batch, c, size, size, generator=generator)
    t = torch.tensor([0.02, 0.35, 0.5, 0.97])
    y = torch.tensor([1, SIZES["num_classes"], 4, 7])
    transport.sample = lambda x, *args: (t, x0, x)  # its draws (numpy's logit-normal, randn_like) replaced by ours
    ema.zero_grad()
    terms = transport.training_losses(ema, x1, dict(y=y))
    (terms["loss"].mean() + terms["cos_loss"].mean()).backward()  # train.py's loss
    grads = {f"grad.{n}": p.grad.clone() for n, p in ema.named_parameters() if p.requires_grad}
    return {"loss_x1": x1, "loss_x0": x0, "loss_t": t, "loss_y": y, "loss_mse": terms["loss"].detach(),
            "loss_cos": terms["cos_loss"].detach(), "loss_pred": terms["pred"].detach(), **grads}  # fmt: skip


def ode_samples(ema: torch.nn.Module, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """The reference's ODE sampler as its inference.py builds it (`Sampler(transport).sample_ode`, Euler, no
    timestep shift), from noise "ode_noise" with labels "ode_y": "ode_euler" without guidance, "ode_cfg" through its
    `forward_with_cfg` (guidance on the first 3 channels, no guidance interval) on the doubled batch, the
    conditional half kept."""
    from transport import Sampler, create_transport  # the reference's own code

    transport = create_transport("Linear", "velocity", None, None, None, use_cosine_loss=True, use_lognorm=True)
    sample = Sampler(transport).sample_ode(sampling_method="euler", num_steps=ODE_STEPS + 1, timestep_shift=0.0)
    batch, c, size = 4, SIZES["in_channels"], SIZES["input_size"]
    noise = torch.randn(batch, c, size, size, generator=generator)
    y = torch.tensor([2, 5, 0, 9])
    null = torch.full_like(y, SIZES["num_classes"])
    with torch.no_grad():
        plain = sample(noise, ema.forward, y=y)[-1]
        guided = sample(torch.cat([noise, noise]), ema.forward_with_cfg, y=torch.cat([y, null]),
                        cfg_scale=ODE_CFG_SCALE, cfg_interval=False, cfg_interval_start=0.0)[-1][:batch]  # fmt: skip
    return {"ode_noise": noise, "ode_y": y, "ode_euler": plain, "ode_cfg": guided}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkout", help="a clone of hustvl/LightningDiT (its models/ and transport/)")
    parser.add_argument("--out", default=str(Path(__file__).parent))
    args = parser.parse_args(argv)
    sys.path.insert(0, str(Path(args.checkout).resolve()))
    from models.lightningdit import LightningDiT  # the reference's own code

    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(1)
    model = perturbed(LightningDiT(**SIZES, **TRAIN_MODEL), generator, 0.05).eval()  # adaLN-Zero, norms broken
    ema = perturbed(copy.deepcopy(model), generator, 0.01).eval()
    plain = perturbed(LightningDiT(**SIZES, **PLAIN_MODEL), generator, 0.05).eval()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.save({"model": model.state_dict(), "ema": ema.state_dict(), "opt": {}, "config": TRAIN_CONFIG},
               out / CHECKPOINT)  # fmt: skip
    torch.save(plain.state_dict(), out / PLAIN)

    batch, c, size = 4, SIZES["in_channels"], SIZES["input_size"]
    x = torch.randn(batch, c, size, size, generator=generator)
    x_plain = torch.randn(batch, c, size, size, generator=generator)
    t = torch.tensor([0.0, 0.25, 0.6, 1.0])
    y = torch.tensor([3, 0, SIZES["num_classes"], 9])  # one null-class label (CFG's unconditional row)
    with torch.no_grad():
        tensors = {"x": x, "t": t, "y": y, "out_ema": ema(x, t, y), "out_model": model(x, t, y),
                   "x_plain": x_plain, "out_plain": plain(x_plain, t, y)}  # fmt: skip
    tensors.update(transport_losses(ema, generator))
    tensors.update(ode_samples(ema, generator))
    from safetensors.torch import save_file

    metadata = {"sizes": repr(SIZES), "train_model": repr(TRAIN_MODEL), "plain_model": repr(PLAIN_MODEL),
                "ode_steps": str(ODE_STEPS), "ode_cfg_scale": str(ODE_CFG_SCALE),
                "torch": torch.__version__}  # fmt: skip
    save_file({k: v.contiguous() for k, v in tensors.items()}, out / REFERENCE_IO, metadata=metadata)
    print(f"wrote {out / CHECKPOINT}, {out / PLAIN} and {out / REFERENCE_IO}")


if __name__ == "__main__":
    main()
