"""Writes tests/data/dit_reference/: a tiny checkpoint made by facebookresearch/DiT's OWN models.py, in its train.py's
format, and the reference's output on a recorded input (tests/test_dit_weights.py loads both).

    pip install timm  # the reference's models.py imports PatchEmbed, Attention and Mlp from it; the tests do not
    # (or, leaving the project's venv as it is: pip install --no-deps --target /tmp/timm_site timm==1.0.22 and
    # PYTHONPATH=/tmp/timm_site; the checkout needs models.py and diffusion/)
    python tests/data/dit_reference/make_reference_checkpoint.py /path/to/DiT [--out tests/data/dit_reference]

Files:
    tiny_dit_train_checkpoint.pt: {"model", "ema", "opt": {}, "args": argparse.Namespace(...)}, as train.py saves it
        (state dicts with the reference's fixed sin-cos `pos_embed`). The zero-initialized adaLN and final layers
        are perturbed so that nothing hides behind a zero, and the EMA differs from the model.
    tiny_dit_reference_io.safetensors: x (B, C, H, W), t (B,) integer timesteps, y (B,) labels (one is the null
        class), and the reference's outputs (eval mode, fp32, CPU) of the EMA weights ("out_ema") and of the model's
        ("out_model"). Also the reference's DDPM sampler (`create_diffusion(str(DDPM_STEPS)).p_sample_loop`, its
        sample.py's call, clip_denoised=False) on the EMA weights from noise "ddpm_noise" with labels "ddpm_y",
        the global RNG seeded by "ddpm_seed" before each run: "ddpm_learned" (its learned-range variance),
        "ddpm_fixed_large" (learn_sigma=False, the eps channels only) and "ddpm_cfg" (cfg scale DDPM_CFG_SCALE
        through its `forward_with_cfg` on the doubled batch, the conditional half kept).
The config (TINY below) is DiTArgs(input_size=8, in_channels=3, patch_size=2, dim=32, depth=2, num_heads=2,
num_classes=10, learn_sigma=True, pos_embed="sincos") on our side.
"""

import argparse
import copy
import sys
from pathlib import Path

import torch

TINY = dict(input_size=8, patch_size=2, in_channels=3, hidden_size=32, depth=2, num_heads=2, mlp_ratio=4.0,
            class_dropout_prob=0.1, num_classes=10, learn_sigma=True)  # fmt: skip
CHECKPOINT = "tiny_dit_train_checkpoint.pt"
REFERENCE_IO = "tiny_dit_reference_io.safetensors"
# 7 of 1000 steps: a stride of 166.5, so the respacing's rounding of halves is exercised too.
DDPM_STEPS, DDPM_SEED, DDPM_CFG_SCALE = 7, 1234, 4.0


def perturbed(model: torch.nn.Module, generator: torch.Generator, scale: float) -> torch.nn.Module:
    """Adds scale * N(0, 1) to every trainable parameter (pos_embed, frozen, stays the sin-cos table)."""
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(scale * torch.randn(p.shape, generator=generator))
    return model


def ddpm_samples(ema: torch.nn.Module, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """The reference's ancestral sampler, as its sample.py calls it, with the step noise from the global RNG."""
    from diffusion import create_diffusion  # the reference's own code

    batch, channels, size = 4, TINY["in_channels"], TINY["input_size"]
    noise = torch.randn(batch, channels, size, size, generator=generator)
    y = torch.tensor([3, 0, 7, 9])
    null = torch.full_like(y, TINY["num_classes"])

    def eps_only(x, t, y):  # a learn_sigma=False diffusion reads the model's first C channels only
        return ema(x, t, y)[:, :channels]

    runs = {
        "ddpm_learned": (create_diffusion(str(DDPM_STEPS)), ema.forward, noise, dict(y=y)),
        "ddpm_fixed_large": (create_diffusion(str(DDPM_STEPS), learn_sigma=False), eps_only, noise, dict(y=y)),
        "ddpm_cfg": (create_diffusion(str(DDPM_STEPS)), ema.forward_with_cfg, torch.cat([noise, noise]),
                     dict(y=torch.cat([y, null]), cfg_scale=DDPM_CFG_SCALE)),
    }  # fmt: skip
    samples = {"ddpm_noise": noise, "ddpm_y": y, "ddpm_seed": torch.tensor(DDPM_SEED)}
    for name, (diffusion, fn, z, model_kwargs) in runs.items():
        torch.manual_seed(DDPM_SEED)
        with torch.no_grad():
            x = diffusion.p_sample_loop(fn, z.shape, z, clip_denoised=False, model_kwargs=model_kwargs, device="cpu")
        samples[name] = x[:batch]  # with CFG, the conditional half
    return samples


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dit_checkout", help="a clone of facebookresearch/DiT (its models.py)")
    parser.add_argument("--out", default=str(Path(__file__).parent))
    args = parser.parse_args(argv)
    sys.path.insert(0, str(Path(args.dit_checkout).resolve()))
    from models import DiT  # the reference's own code

    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(1)
    model = perturbed(DiT(**TINY), generator, 0.05).eval()  # breaks the adaLN-Zero and zero output layers
    ema = perturbed(copy.deepcopy(model), generator, 0.01).eval()
    train_args = argparse.Namespace(data_path="unused", results_dir="results", model="tiny (see TINY)",
                                    image_size=8 * TINY["input_size"], num_classes=TINY["num_classes"], epochs=1,
                                    global_batch_size=4, global_seed=0, vae="ema", num_workers=0, log_every=100,
                                    ckpt_every=1)  # fmt: skip
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    checkpoint = {"model": model.state_dict(), "ema": ema.state_dict(), "opt": {}, "args": train_args}
    torch.save(checkpoint, out / CHECKPOINT)

    batch, channels, size = 4, TINY["in_channels"], TINY["input_size"]
    x = torch.randn(batch, channels, size, size, generator=generator)
    t = torch.tensor([0, 17, 500, 999])
    y = torch.tensor([3, 0, TINY["num_classes"], 9])  # one null-class label (CFG's unconditional row)
    with torch.no_grad():
        out_ema, out_model = ema(x, t, y), model(x, t, y)
    from safetensors.torch import save_file

    tensors = {"x": x, "t": t, "y": y, "out_ema": out_ema, "out_model": out_model}
    tensors.update(ddpm_samples(ema, generator))
    save_file(tensors, out / REFERENCE_IO, metadata={"config": repr(TINY), "torch": torch.__version__,
                                                     "ddpm_steps": str(DDPM_STEPS),
                                                     "ddpm_cfg_scale": str(DDPM_CFG_SCALE)})  # fmt: skip
    print(f"wrote {out / CHECKPOINT} and {out / REFERENCE_IO}")


if __name__ == "__main__":
    main()
