"""Writes tests/data/vavae_reference/: the encode and decode of a tiny VA-VAE built from hustvl/LightningDiT's OWN
tokenizer/autoencoder.py (its AutoencoderKL with a small Encoder and Decoder of the same classes), which
tests/test_convert_vavae.py compares with the diffusers folder scripts/convert_vavae.py makes of it.

    PYTHONPATH=/tmp/ref_site python tests/data/vavae_reference/make_reference.py /path/to/LightningDiT \
        [--out tests/data/vavae_reference]

(the reference's tokenizer/autoencoder.py imports requests, tqdm, numpy, PIL and torchvision, which the project's
venv has.) The weights are not committed: `tiny_weights(shapes, SEED)` draws them from a seed, in the reference's
own names and shapes, which the io file records; the test draws them again the same way (importing this file) and
writes them as the Lightning checkpoint LightningDiT's VA-VAE is, with loss and foundation-model entries beside.

File tiny_vavae_reference_io.safetensors: "images" (B, 3, 16, 16) in [-1, 1] and the reference's posterior mean
("latent_mean", what prepare.py keeps) and log-variance ("latent_logvar") of them; "latents" (B, 8, 8, 8) and
the reference's decode of them ("decoded"). Metadata "shapes": the state dict's [name, shape] list, "seed".
TINY is f2 (channel multipliers 1, 2: a shortcut convolution where the width changes), one resnet per encoder level,
attention in the lowest-resolution level (as VA-VAE's f16, where it is the 16 x 16 level) and in the middles.
"""

import argparse
import json
import math
import sys
from pathlib import Path

import torch

TINY = dict(ch=32, ch_mult=(1, 2), num_res_blocks=1, attn_resolutions=(8,), resolution=16, z_channels=8)
SEED = 20250101
REFERENCE_IO = "tiny_vavae_reference_io.safetensors"


def tiny_weights(shapes: list[tuple[str, list[int]]], seed: int) -> dict[str, torch.Tensor]:
    """Weights for each (name, shape), drawn in order from one generator: convolutions N(0, 1 / fan_in), norm
    weights 1 + N(0, 0.1^2), biases N(0, 0.05^2), so activations stay of order 1 through the tiny network."""
    generator = torch.Generator().manual_seed(seed)
    weights = {}
    for name, shape in shapes:
        noise = torch.randn(shape, generator=generator)
        if len(shape) > 1:
            weights[name] = noise / math.sqrt(math.prod(shape[1:]))
        elif "norm" in name and name.endswith("weight"):
            weights[name] = 1 + 0.1 * noise
        else:
            weights[name] = 0.05 * noise
    return weights


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkout", help="a clone of hustvl/LightningDiT (its tokenizer/autoencoder.py)")
    parser.add_argument("--out", default=str(Path(__file__).parent))
    args = parser.parse_args(argv)
    sys.path.insert(0, str(Path(args.checkout).resolve()))
    from tokenizer.autoencoder import AutoencoderKL, Decoder, Encoder  # the reference's own code

    vae = AutoencoderKL(embed_dim=TINY["z_channels"], ch_mult=TINY["ch_mult"])  # VA-VAE's class, then made tiny
    vae.encoder, vae.decoder = Encoder(**TINY), Decoder(**TINY)
    shapes = [(name, list(t.shape)) for name, t in vae.state_dict().items()]
    vae.load_state_dict(tiny_weights(shapes, SEED), strict=True)
    vae.eval()
    generator = torch.Generator().manual_seed(1)
    images = torch.rand(2, 3, TINY["resolution"], TINY["resolution"], generator=generator) * 2 - 1
    latents = torch.randn(2, TINY["z_channels"], 8, 8, generator=generator)
    with torch.no_grad():
        posterior = vae.encode(images)
        tensors = {"images": images, "latent_mean": posterior.mode(), "latent_logvar": posterior.logvar,
                   "latents": latents, "decoded": vae.decode(latents)}  # fmt: skip
    from safetensors.torch import save_file

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    metadata = {"shapes": json.dumps(shapes), "seed": str(SEED), "tiny": repr(TINY), "torch": torch.__version__}
    save_file({k: v.contiguous() for k, v in tensors.items()}, out / REFERENCE_IO, metadata=metadata)
    print(f"wrote {out / REFERENCE_IO}")


if __name__ == "__main__":
    main()
