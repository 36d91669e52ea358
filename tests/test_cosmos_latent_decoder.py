"""Tokenizer loading (TorchScript Cosmos contract, diffusers autoencoders), decoding CLI, training decode."""

import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image
from torch import nn

import cosmos_latent_decoder as cld
from torchtitan.config_manager import JobConfig
from torchtitan.tools.images import save_image_grid


class TinyEncoder(nn.Module):
    """Cosmos's contract: encoder(x) -> (latent, ...). Space-to-depth by f, then a 1x1 conv."""

    def __init__(self, channels: int, downsample: int):
        super().__init__()
        self.downsample = downsample
        self.proj = nn.Conv2d(3 * downsample * downsample, channels, 1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        z = self.proj(F.pixel_unshuffle(x, self.downsample))
        return z, z.mean()


class TinyDecoder(nn.Module):
    """decoder(z) -> image in [-1, 1]."""

    def __init__(self, channels: int, downsample: int):
        super().__init__()
        self.downsample = downsample
        self.proj = nn.Conv2d(channels, 3 * downsample * downsample, 1)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return torch.tanh(F.pixel_shuffle(self.proj(z), self.downsample))


def make_jit_tokenizer(folder: Path, channels: int = 16, downsample: int = 4, seed: int = 0):
    """Writes encoder.jit / decoder.jit into folder; returns the eager (encoder, decoder) for reference."""
    folder.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    encoder, decoder = TinyEncoder(channels, downsample).eval(), TinyDecoder(channels, downsample).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # Cosmos ships TorchScript, so the tests make TorchScript
        torch.jit.script(encoder).save(str(folder / "encoder.jit"))
        torch.jit.script(decoder).save(str(folder / "decoder.jit"))
    return encoder, decoder


def make_image_folder(root: Path, classes: int = 3, per_class: int = 4, size: tuple = (20, 24)) -> Path:
    """Random RGB PNGs in class subfolders (not square: the center crop matters)."""
    rng = np.random.default_rng(0)
    for c in range(classes):
        (root / f"class{c}").mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            pixels = rng.integers(0, 256, (*size, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(root / f"class{c}" / f"{i}.png")
    return root


def make_sd_vae(folder: Path):
    """A tiny random SD-style AutoencoderKL written with save_pretrained (downsample 2, 4 channels)."""
    from diffusers import AutoencoderKL

    torch.manual_seed(0)
    vae = AutoencoderKL(block_out_channels=(8, 16), down_block_types=("DownEncoderBlock2D",) * 2,
                        up_block_types=("UpDecoderBlock2D",) * 2, layers_per_block=1, latent_channels=4,
                        norm_num_groups=4, sample_size=16).eval()  # fmt: skip
    vae.save_pretrained(str(folder))
    return vae


def test_cosmos_jit_matches_the_modules(tmp_path):
    encoder, decoder = make_jit_tokenizer(tmp_path / "tok")
    tokenizer = cld.load_tokenizer("cosmos_jit", tmp_path / "tok")
    assert (tokenizer.latent_channels, tokenizer.downsample, tokenizer.name) == (16, 4, "tok")
    x = torch.rand(5, 3, 16, 16) * 2 - 1
    z = tokenizer.encode(x)
    with torch.no_grad():
        assert z.shape == (5, 16, 4, 4) and torch.allclose(z, encoder(x)[0], atol=1e-6)  # first item of the tuple
        images = tokenizer.decode(z)
        assert images.shape == (5, 3, 16, 16) and torch.allclose(images, decoder(z), atol=1e-6)
    assert images.abs().max() <= 1
    assert torch.allclose(tokenizer.encode_batches(x, batch_size=2, progress=True), z, atol=1e-6)
    with pytest.raises(ValueError, match=r"decodes \(B, 16, h, w\) latents, got \(1, 4, 4, 4\)"):
        tokenizer.decode(torch.zeros(1, 4, 4, 4))


def test_missing_tokenizer_files_name_the_path(tmp_path):
    with pytest.raises(FileNotFoundError, match=str(tmp_path / "nowhere")):
        cld.load_tokenizer("cosmos_jit", tmp_path / "nowhere")
    make_jit_tokenizer(tmp_path / "tok")
    (tmp_path / "tok" / "encoder.jit").unlink()
    with pytest.raises(FileNotFoundError, match=str(tmp_path / "tok" / "encoder.jit")):
        cld.load_tokenizer("cosmos_jit", tmp_path / "tok")
    with pytest.raises(FileNotFoundError, match=str(tmp_path / "tok" / "config.json")):
        cld.load_tokenizer("diffusers", tmp_path / "tok")
    with pytest.raises(ValueError, match="must be one of"):
        cld.load_tokenizer("vqgan", tmp_path / "tok")


def test_diffusers_autoencoder_kl_uses_the_mode(tmp_path):
    vae = make_sd_vae(tmp_path / "vae")
    tokenizer = cld.load_tokenizer("diffusers", tmp_path / "vae")
    assert (tokenizer.latent_channels, tokenizer.downsample) == (4, 2)
    x = torch.rand(3, 3, 16, 16) * 2 - 1
    z = tokenizer.encode(x)
    with torch.no_grad():
        assert torch.allclose(z, vae.encode(x).latent_dist.mode(), atol=1e-5)  # deterministic: the mean
        assert torch.allclose(tokenizer.decode(z), vae.decode(z).sample.clamp(-1, 1), atol=1e-5)
    assert torch.equal(tokenizer.encode(x), z)


def test_cli_decodes_raw_and_normalized_latent_files(tmp_path, capsys):
    _, decoder = make_jit_tokenizer(tmp_path / "tok")
    z = torch.randn(6, 16, 4, 4)
    with torch.no_grad():
        expected = save_image_grid(decoder(z).clamp(-1, 1), tmp_path / "expected.png")
    from safetensors.torch import save_file

    save_file({"latents": z}, str(tmp_path / "raw.safetensors"))
    torch.save(z * 0.5, tmp_path / "scaled.pt")  # model-space latents with scale factor 0.5
    args = ["--checkpoint-dir", str(tmp_path / "tok"), "--kind", "cosmos_jit"]
    assert cld.main([*args, "--latents", str(tmp_path / "raw.safetensors"), "--out", str(tmp_path / "a.png")]) == 0
    assert cld.main([*args, "--latents", str(tmp_path / "scaled.pt"), "--scale-factor", "0.5",
                     "--out", str(tmp_path / "b.png")]) == 0  # fmt: skip
    want = np.asarray(Image.open(expected))
    for name in ("a.png", "b.png"):
        got = Image.open(tmp_path / name)
        assert got.mode == "RGB"
        assert np.abs(np.asarray(got).astype(int) - want).max() <= 1
    assert cld.main([*args, "--latents", str(tmp_path / "missing.pt")]) == 2
    assert "missing.pt does not exist" in capsys.readouterr().err


def test_decode_for_training_undoes_the_scale_factor(tmp_path):
    _, decoder = make_jit_tokenizer(tmp_path / "tok")
    cfg = JobConfig()
    cfg.latent.tokenizer, cfg.latent.checkpoint_dir, cfg.latent.scale_factor = "cosmos_jit", str(tmp_path / "tok"), 2.0
    z = torch.randn(3, 16, 4, 4)
    images = cld.decode_for_training(cfg, z * 2.0)
    with torch.no_grad():
        assert torch.allclose(images, decoder(z), atol=1e-5)
