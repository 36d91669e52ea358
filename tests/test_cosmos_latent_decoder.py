"""Tokenizer loading (TorchScript Cosmos contract, diffusers autoencoders), decoding CLI, training decode."""

import json
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
from torchtitan.datasets.latent_tokenizer import decoder_files, decoder_sha256
from torchtitan.tools.images import save_image_grid


def haar_filters(wavelets: torch.Tensor, signs: torch.Tensor, groups: int, dtype: torch.dtype):
    """Cosmos's low- and high-pass Haar filters, cast to the input's dtype with `.to(dtype=...)` as its patcher
    does: torch.jit.trace freezes that cast as a constant of the dtype the file was traced in."""
    low = wavelets.flip(0).reshape(1, 1, -1).repeat(groups, 1, 1).to(dtype=dtype)
    high = (wavelets * signs).reshape(1, 1, -1).repeat(groups, 1, 1).to(dtype=dtype)
    return low, high


class HaarPatcher(nn.Module):
    """One level of Cosmos's Haar patcher (modules/patching.py): (B, 3, H, W) -> (B, 12, H/2, W/2)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("wavelets", torch.tensor([0.7071067811865476] * 2), persistent=False)
        self.register_buffer("signs", torch.tensor([1.0, -1.0]), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g = x.shape[1]
        low, high = haar_filters(self.wavelets, self.signs, g, x.dtype)
        xl = F.conv2d(x, low.unsqueeze(2), groups=g, stride=(1, 2))
        xh = F.conv2d(x, high.unsqueeze(2), groups=g, stride=(1, 2))
        bands = [F.conv2d(a, h.unsqueeze(3), groups=g, stride=(2, 1)) for a in (xl, xh) for h in (low, high)]
        return torch.cat(bands, dim=1) / 2  # LL, LH, HL, HH


class HaarUnPatcher(nn.Module):
    """Its inverse: (B, 12, h, w) -> (B, 3, 2h, 2w), transposed convolutions with the same frozen casts."""

    def __init__(self):
        super().__init__()
        self.register_buffer("wavelets", torch.tensor([0.7071067811865476] * 2), persistent=False)
        self.register_buffer("signs", torch.tensor([1.0, -1.0]), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g = x.shape[1] // 4
        low, high = haar_filters(self.wavelets, self.signs, g, x.dtype)
        ll, lh, hl, hh = torch.chunk(x, 4, dim=1)
        yl = F.conv_transpose2d(ll, low.unsqueeze(3), groups=g, stride=(2, 1))
        yl = yl + F.conv_transpose2d(lh, high.unsqueeze(3), groups=g, stride=(2, 1))
        yh = F.conv_transpose2d(hl, low.unsqueeze(3), groups=g, stride=(2, 1))
        yh = yh + F.conv_transpose2d(hh, high.unsqueeze(3), groups=g, stride=(2, 1))
        y = F.conv_transpose2d(yl, low.unsqueeze(2), groups=g, stride=(1, 2))
        return (y + F.conv_transpose2d(yh, high.unsqueeze(2), groups=g, stride=(1, 2))) * 2


class TinyEncoder(nn.Module):
    """Cosmos's contract: encoder(x) -> (latent, ...). The Haar patcher (f = 2), then a strided conv."""

    def __init__(self, channels: int, downsample: int, discrete: bool = False):
        super().__init__()
        self.discrete = discrete
        self.patcher = HaarPatcher()
        self.proj = nn.Conv2d(12, channels, downsample // 2, stride=downsample // 2)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        z = self.proj(self.patcher(x))
        if self.discrete:  # a DI tokenizer's contract: (indices (B, h, w) int64, codes)
            return z.argmax(1), z
        return z, z.mean()


class TinyDecoder(nn.Module):
    """decoder(z) -> image in [-1, 1]: a 1x1 conv (as post_quant_conv), depth-to-space, the Haar unpatcher."""

    def __init__(self, channels: int, downsample: int):
        super().__init__()
        self.upsample = downsample // 2
        self.proj = nn.Conv2d(channels, 12 * self.upsample**2, 1)
        self.unpatcher = HaarUnPatcher()

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.unpatcher(F.pixel_shuffle(self.proj(z), self.upsample)))


def make_jit_tokenizer(folder: Path, channels: int = 16, downsample: int = 4, seed: int = 0,
                       dtype: torch.dtype = torch.float32, discrete: bool = False):  # fmt: skip
    """Writes encoder.jit / decoder.jit into folder as NVIDIA does: `torch.jit.trace` in `dtype` (their networks
    cannot be scripted), which freezes the Haar casts. Returns the eager (encoder, decoder), in `dtype`."""
    folder.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    encoder = TinyEncoder(channels, downsample, discrete).to(dtype).eval()
    decoder = TinyDecoder(channels, downsample).to(dtype).eval()
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")  # Cosmos ships TorchScript, so the tests make TorchScript; tracer notes
        image, latent = torch.zeros(1, 3, 16, 16, dtype=dtype), torch.zeros(1, channels, 2, 2, dtype=dtype)
        torch.jit.save(torch.jit.trace(encoder, image), str(folder / "encoder.jit"))
        torch.jit.save(torch.jit.trace(decoder, latent), str(folder / "decoder.jit"))
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
    # What meta.json's decoder hash covers: the config and the weights (one file holds both halves).
    files = [f.name for f in decoder_files("diffusers", tmp_path / "vae")]
    assert files == ["config.json", "diffusion_pytorch_model.safetensors"]
    assert decoder_sha256("diffusers", tmp_path / "vae") is not None


def png(path: Path) -> np.ndarray:
    return np.asarray(Image.open(path)).astype(int)


def decoded_grid(decoder: nn.Module, raw: torch.Tensor, path: Path) -> np.ndarray:
    """The grid the decoder CLI must write for these raw latents: the tokenizer's own decode."""
    with torch.no_grad():
        return png(save_image_grid(decoder(raw).clamp(-1, 1), path))


def test_cli_asks_how_an_unrecorded_file_is_normalized(tmp_path, capsys):
    """A file that records nothing (written by other code) was taken as raw; --allow-tokenizer-mismatch, the
    remedy the error offered, then decoded a run's normalized samples as raw. The user must say which they are."""
    _, decoder = make_jit_tokenizer(tmp_path / "tok")
    z = torch.randn(6, 16, 4, 4)
    want = decoded_grid(decoder, z, tmp_path / "expected.png")
    from safetensors.torch import save_file

    save_file({"latents": z}, str(tmp_path / "raw.safetensors"))
    torch.save(z * 0.5, tmp_path / "scaled.pt")  # model-space latents with scale factor 0.5
    args = ["--checkpoint-dir", str(tmp_path / "tok"), "--kind", "cosmos_jit", "--out", str(tmp_path / "a.png")]
    unrecorded = (f"error: --latents {tmp_path / 'raw.safetensors'} does not record how its latents are normalized "
                  "(a file of other code, or of TorchDiTan before its files recorded it): say it with --raw (raw "
                  "tokenizer latents, as a prepared shard holds), --stats PREPARED_FOLDER (a latent DiT's samples, "
                  "normalized with the meta.json of the folder it trained on: its training.dataset_path) or "
                  "--scale-factor S (latents scaled by S)")  # fmt: skip
    for flags in ((), ("--allow-tokenizer-mismatch",)):
        assert cld.main([*args, "--latents", str(tmp_path / "raw.safetensors"), *flags]) == 2
        assert capsys.readouterr().err.splitlines() == [unrecorded]
    assert cld.main([*args, "--latents", str(tmp_path / "raw.safetensors"), "--raw", "--scale-factor", "2"]) == 2
    assert capsys.readouterr().err.splitlines() == ["error: --raw and --scale-factor: give one of --raw, --stats, "
                                                    "--scale-factor"]  # fmt: skip
    # No meta.json beside the files records their tokenizer: refused, unless the user takes it on.
    assert cld.main([*args, "--latents", str(tmp_path / "raw.safetensors"), "--raw"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"error: --latents {tmp_path / 'raw.safetensors'}: neither it nor a meta.json beside it records the tokenizer "
        f"that encoded these latents, so --checkpoint-dir {tmp_path / 'tok'} cannot be checked against it: give "
        "--allow-tokenizer-mismatch to decode unchecked"]  # fmt: skip
    assert not (tmp_path / "a.png").exists()
    args.append("--allow-tokenizer-mismatch")
    assert cld.main([*args, "--latents", str(tmp_path / "raw.safetensors"), "--raw"]) == 0
    assert "the tokenizer is not checked" in capsys.readouterr().err
    assert np.abs(png(tmp_path / "a.png") - want).max() <= 1  # 1/255: the grid's rounding
    assert Image.open(tmp_path / "a.png").mode == "RGB"
    assert cld.main([*args, "--latents", str(tmp_path / "scaled.pt"), "--scale-factor", "0.5"]) == 0
    assert np.abs(png(tmp_path / "a.png") - want).max() <= 1
    assert cld.main([*args, "--latents", str(tmp_path / "missing.pt"), "--raw"]) == 2
    assert "missing.pt does not exist" in capsys.readouterr().err


def test_cli_decodes_shards_and_run_samples_by_what_each_file_records(tmp_path, capsys):
    """Both remedies the decoder's error offered gave wrong images: `--stats PREPARED_FOLDER` un-normalized a shard's
    raw latents a second time (69.6/255 mean error), `--allow-tokenizer-mismatch` decoded a run's normalized samples
    as raw (23.5/255). Shards and a run's saved samples record their normalization and tokenizer, and the decoder
    follows the file, whatever flag is given. Tolerance: 1/255 per pixel (the grid's rounding to uint8)."""
    import shutil

    from safetensors.torch import load_file

    from torchtitan.components.sampling import SampleWriter
    from torchtitan.datasets.latents import read_meta
    from torchtitan.datasets.prepare_latents import prepare_latents
    from torchtitan.models.dit import DiTArgs

    _, decoder = make_jit_tokenizer(tmp_path / "tok")
    _, other_decoder = make_jit_tokenizer(tmp_path / "other", seed=1)  # the same shapes, other weights
    torch.manual_seed(0)
    images = [(torch.rand(3, 16, 16) * 2 - 1, i % 2) for i in range(6)]
    prepared = tmp_path / "prepared"
    assert prepare_latents(images, prepared, cld.load_tokenizer("cosmos_jit", tmp_path / "tok"), image_size=16,
                           num_classes=2, shard_size=3, batch_size=3)  # fmt: skip
    (tmp_path / "copy").mkdir()
    shard = Path(shutil.copy(prepared / "shard-00000.safetensors", tmp_path / "copy"))  # no meta.json beside it
    out = tmp_path / "grid.png"

    def decode(latents: Path, tokenizer: Path, *flags: str) -> tuple[int, list[str]]:
        out.unlink(missing_ok=True)
        code = cld.main(["--checkpoint-dir", str(tokenizer), "--latents", str(latents), "--out", str(out), *flags])
        return code, capsys.readouterr().err.splitlines()

    want = decoded_grid(decoder, load_file(str(shard))["latents"][:, 0].float(), tmp_path / "want_shard.png")
    assert decode(shard, tmp_path / "tok")[0] == 0 and np.abs(png(out) - want).max() <= 1
    for flags in (("--stats", str(prepared)), ("--scale-factor", "0.5"), ("--raw",)):
        code, err = decode(shard, tmp_path / "tok", *flags)
        assert (code, err[-1]) == (2, f"error: --latents {shard} records raw tokenizer latents: {flags[0]} says how "
                                      "a file that records nothing is normalized; drop it")  # fmt: skip
        assert not out.exists()

    # A latent run without a tokenizer saves its samples as model-space latents (samples/step-N.safetensors).
    cfg = JobConfig()
    cfg.training.dataset, cfg.training.dataset_path = "latents", str(prepared)
    model_args = DiTArgs(input_size=4, in_channels=16, patch_size=2, num_classes=2)
    writer = SampleWriter(cfg, model_args, None, torch.device("cpu"), 0, tmp_path / "run", None)
    samples = torch.randn(4, 16, 4, 4)
    writer._save(samples, torch.tensor([0, 1, 0, 1]), 3)
    sampled = tmp_path / "run" / "samples" / "step-3.safetensors"
    stats = read_meta(prepared)["normalization"]
    raw = samples * torch.tensor(stats["std"]).view(-1, 1, 1) + torch.tensor(stats["mean"]).view(-1, 1, 1)
    want = decoded_grid(decoder, raw, tmp_path / "want_samples.png")
    for flags in ((), ("--allow-tokenizer-mismatch",)):
        assert decode(sampled, tmp_path / "tok", *flags)[0] == 0 and np.abs(png(out) - want).max() <= 1
    code, err = decode(sampled, tmp_path / "other")
    assert code == 2 and err[-1].startswith(f"error: {sampled}: the [latent] tokenizer is not the one these latents "
                                            "were encoded with (cosmos_jit:tok (16 channels, downsample 4")  # fmt: skip
    # Decoding with another tokenizer on purpose still un-normalizes as the file says.
    assert decode(sampled, tmp_path / "other", "--allow-tokenizer-mismatch")[0] == 0
    assert np.abs(png(out) - decoded_grid(other_decoder, raw, tmp_path / "want_other.png")).max() <= 1
    code, err = decode(sampled, tmp_path / "tok", "--raw")
    assert (code, err[-1]) == (2, f"error: --latents {sampled} records latents normalized per channel, (z - mean) / "
                                  "std: --raw says how a file that records nothing is normalized; drop it")  # fmt: skip


def test_decode_for_training_undoes_the_scale_factor(tmp_path):
    _, decoder = make_jit_tokenizer(tmp_path / "tok")
    cfg = JobConfig()
    cfg.latent.tokenizer, cfg.latent.checkpoint_dir, cfg.latent.scale_factor = "cosmos_jit", str(tmp_path / "tok"), 2.0
    z = torch.randn(3, 16, 4, 4)
    images = cld.decode_for_training(cfg, z * 2.0)
    with torch.no_grad():
        assert torch.allclose(images, decoder(z), atol=1e-5)


@pytest.mark.parametrize("saved", [torch.bfloat16, torch.float32], ids=["traced_bf16", "traced_fp32"])
@pytest.mark.parametrize("requested", [torch.float32, torch.bfloat16], ids=["asked_fp32", "asked_bf16"])
def test_traced_files_run_in_their_saved_dtype(tmp_path, saved, requested):
    """NVIDIA traces in bf16 on CUDA: casting such a file to float32 (or a float32 trace to bf16) makes its frozen
    Haar casts feed convolutions of another dtype. Each file must run as saved, whatever dtype is asked for."""
    encoder, decoder = make_jit_tokenizer(tmp_path / "tok", dtype=saved)
    tokenizer = cld.load_tokenizer("cosmos_jit", tmp_path / "tok", "cpu", requested)
    assert (tokenizer.latent_channels, tokenizer.downsample) == (16, 4)
    assert tokenizer.run_dtypes == {"encoder": saved, "decoder": saved}
    name = str(saved).removeprefix("torch.")
    assert tokenizer.describe() == f"cosmos_jit:tok (16 channels, downsample 4; encoder {name}, decoder {name})"
    x = torch.rand(3, 3, 32, 16) * 2 - 1
    z = tokenizer.encode(x)
    images = tokenizer.decode(z)
    assert z.dtype == images.dtype == torch.float32
    assert z.shape == (3, 16, 8, 4) and images.shape == (3, 3, 32, 16)
    with torch.no_grad():  # the saved dtype's arithmetic, not a cast module's
        torch.testing.assert_close(z, encoder(x.to(saved))[0].float(), atol=1e-6, rtol=0)
        torch.testing.assert_close(images, decoder(z.to(saved)).float().clamp(-1, 1), atol=1e-6, rtol=0)


def test_loads_only_the_half_a_command_needs(tmp_path):
    encoder, decoder = make_jit_tokenizer(tmp_path / "tok", channels=8, dtype=torch.bfloat16)
    (tmp_path / "tok" / "encoder.jit").unlink()
    # Decoding alone: channels from the first convolution, downsample from decoding a zero latent.
    tokenizer = cld.load_tokenizer("cosmos_jit", tmp_path / "tok", parts=("decoder",))
    assert (tokenizer.latent_channels, tokenizer.downsample, tokenizer.encoder) == (8, 4, None)
    z = torch.randn(2, 8, 3, 5)
    with torch.no_grad():
        torch.testing.assert_close(tokenizer.decode(z), decoder(z.bfloat16()).float().clamp(-1, 1), atol=1e-6, rtol=0)
    with pytest.raises(ValueError, match=r"loaded with parts=\('decoder',\), without its encoder"):
        tokenizer.encode(torch.zeros(1, 3, 16, 16))
    with pytest.raises(FileNotFoundError, match=str(tmp_path / "tok" / "encoder.jit")):
        cld.load_tokenizer("cosmos_jit", tmp_path / "tok")  # both halves need both files

    make_jit_tokenizer(tmp_path / "enc", channels=8, downsample=8)
    (tmp_path / "enc" / "decoder.jit").unlink()
    tokenizer = cld.load_tokenizer("cosmos_jit", tmp_path / "enc", parts=("encoder",))
    assert (tokenizer.latent_channels, tokenizer.downsample, tokenizer.decoder) == (8, 8, None)
    assert tokenizer.encode(torch.zeros(2, 3, 16, 24)).shape == (2, 8, 2, 3)
    with pytest.raises(ValueError, match="without its decoder"):
        tokenizer.decode(torch.zeros(1, 8, 2, 2))
    with pytest.raises(ValueError, match=r"parts \('vae',\): must be one or both of"):
        cld.load_tokenizer("cosmos_jit", tmp_path / "enc", parts=("vae",))


def test_torchscript_errors_name_the_file(tmp_path):
    make_jit_tokenizer(tmp_path / "tok")
    (tmp_path / "tok" / "decoder.jit").write_bytes(b"not a zip archive")  # an interrupted download
    with pytest.raises(RuntimeError, match=f"{tmp_path / 'tok' / 'decoder.jit'}: torch.jit.load failed") as info:
        cld.load_tokenizer("cosmos_jit", tmp_path / "tok")
    assert "PytorchStreamReader" in str(info.value.__cause__)  # chained from torch's own error
    # Two halves of different tokenizers: the decoder fails inside TorchScript on the encoder's 16 channels.
    make_jit_tokenizer(tmp_path / "other", channels=4)
    (tmp_path / "tok" / "decoder.jit").write_bytes((tmp_path / "other" / "decoder.jit").read_bytes())
    with pytest.raises(RuntimeError, match=f"^{tmp_path / 'tok' / 'decoder.jit'}: ") as info:
        cld.load_tokenizer("cosmos_jit", tmp_path / "tok")
    assert "expected input[1, 16, 4, 4] to have 4 channels" in str(info.value)
    assert info.value.__cause__ is not None


@pytest.mark.parametrize("folder", ["Cosmos-0.1-Tokenizer-DI8x8", "Cosmos-1.0-Tokenizer-DI16x16"])
def test_discrete_tokenizers_are_refused_by_name(tmp_path, folder):
    make_jit_tokenizer(tmp_path / folder)
    with pytest.raises(ValueError, match=f"{folder} is a discrete Cosmos tokenizer.*continuous ones are"):
        cld.load_tokenizer("cosmos_jit", tmp_path / folder, parts=("decoder",))
    make_jit_tokenizer(tmp_path / "Cosmos-0.1-Tokenizer-CV4x8x8")
    with pytest.raises(ValueError, match="CV4x8x8 is a Cosmos video tokenizer"):
        cld.load_tokenizer("cosmos_jit", tmp_path / "Cosmos-0.1-Tokenizer-CV4x8x8")


def test_discrete_tokenizers_are_refused_by_their_integer_latents(tmp_path):
    make_jit_tokenizer(tmp_path / "renamed", discrete=True)  # a DI encoder in a folder named otherwise
    with pytest.raises(ValueError, match=r"encoder.jit: encodes a 64 x 64 image to a torch.int64 tensor of shape "
                       r"\(1, 16, 16\).*discrete tokenizer .* is not supported"):  # fmt: skip
        cld.load_tokenizer("cosmos_jit", tmp_path / "renamed", parts=("encoder",))


def test_encode_refuses_sides_that_are_not_multiples_of_the_downsample(tmp_path):
    make_jit_tokenizer(tmp_path / "tok", downsample=8)
    tokenizer = cld.load_tokenizer("cosmos_jit", tmp_path / "tok", parts=("encoder",))
    assert tokenizer.encode(torch.zeros(1, 3, 24, 16)).shape == (1, 16, 3, 2)
    with pytest.raises(ValueError, match="encodes images whose sides are multiples of 8, got 20 x 16"):
        tokenizer.encode(torch.zeros(1, 3, 20, 16))  # would silently give a 3 x 2 latent of a 24 x 16 image


def write_meta(folder: Path, name: str, channels: int = 16, downsample: int = 4, sha256: str | None = None) -> Path:
    """A prepared folder's meta.json (no shards: meta.json alone names the tokenizer and the statistics); without
    `sha256` it is one written before the decoder's hash was recorded."""
    from torchtitan.datasets.latents import FORMAT

    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = {"kind": "cosmos_jit", "name": name, "latent_channels": channels, "downsample": downsample}
    if sha256 is not None:
        tokenizer["decoder_sha256"] = sha256
    normalization = {"mode": "channel", "mean": [0.5] * channels, "std": [2.0] * channels, "scale_factor": 1.0}
    (folder / "meta.json").write_text(json.dumps({"format": FORMAT, "tokenizer": tokenizer,
                                                  "normalization": normalization}))  # fmt: skip
    return folder


def test_decode_for_training_loads_the_decoder_and_checks_the_latents(tmp_path):
    _, decoder = make_jit_tokenizer(tmp_path / "tok", dtype=torch.bfloat16)
    (tmp_path / "tok" / "encoder.jit").unlink()  # decoding needs only decoder.jit
    cfg = JobConfig()
    cfg.latent.tokenizer, cfg.latent.checkpoint_dir = "cosmos_jit", str(tmp_path / "tok")
    cfg.training.dataset_path = str(write_meta(tmp_path / "prepared", "tok"))
    z = torch.randn(3, 16, 4, 4)
    images = cld.decode_for_training(cfg, (z - 0.5) / 2.0)  # model space: (z - mean) / std
    with torch.no_grad():
        torch.testing.assert_close(images, decoder(z.bfloat16()).float().clamp(-1, 1), atol=1e-6, rtol=0)
    # A tokenizer folder of the same name whose decoder upsamples by 8 (a CI16x16 given for CI8x8 latents, say).
    make_jit_tokenizer(tmp_path / "elsewhere" / "tok", downsample=8)
    cfg.latent.checkpoint_dir = str(tmp_path / "elsewhere" / "tok")
    with pytest.raises(ValueError, match=r"prepared/meta.json: the \[latent\] tokenizer is not the one .*"
                       r"downsample: the tokenizer in '.*elsewhere/tok' has 8 but the latents 4"):  # fmt: skip
        cld.decode_for_training(cfg, z)
    cfg.training.dataset_path = str(write_meta(tmp_path / "prepared_ci16", "Cosmos-0.1-Tokenizer-CI16x16", 16, 16))
    with pytest.raises(ValueError, match=r"prepared_ci16/meta.json: .*downsample: the tokenizer in '.*elsewhere/tok' "
                       r"has 8 but the latents 16 \(it records no decoder hash: kind, channels and downsample were "
                       r"compared\)"):  # fmt: skip
        cld.decode_for_training(cfg, z)


def test_cli_checks_its_arguments_and_the_stats_tokenizer(tmp_path, capsys):
    make_jit_tokenizer(tmp_path / "tok")
    torch.save(torch.randn(2, 16, 4, 4), tmp_path / "z.pt")
    args = ["--checkpoint-dir", str(tmp_path / "tok"), "--latents", str(tmp_path / "z.pt"), "--out",
            str(tmp_path / "grid.png")]  # fmt: skip
    for flags, message in ((["--max-images", "0"], "--max-images 0: must be > 0"),
                           (["--batch-size", "-1"], "--batch-size -1: must be > 0"),
                           (["--scale-factor", "nan"], "--scale-factor nan: must be a finite number >= 0"),
                           (["--stats", str(write_meta(tmp_path / "other", "other", downsample=8))],
                            f"{tmp_path / 'other' / 'meta.json'}: the [latent] tokenizer is not the one these latents "
                            "were encoded with (cosmos_jit:other (16 channels, downsample 8)): downsample: the "
                            f"tokenizer in '{tmp_path / 'tok'}' has 4 but the latents 8")):  # fmt: skip
        assert cld.main([*args, *flags]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and message in err and "Traceback" not in err
        assert not (tmp_path / "grid.png").exists()


def test_cli_checks_the_tokenizer_by_its_decoder_hash_whatever_its_folder(tmp_path, capsys):
    """CI8x8 latents decoded by a CI16x16 decoder gave 128 px tiles for 64 px images, exit status 0. The decoder
    CLI reads the meta.json beside the latents always, and compares the decoder file's hash, not folder names."""
    import shutil

    make_jit_tokenizer(tmp_path / "tok")
    prepared = write_meta(tmp_path / "prepared", "tok", sha256=decoder_sha256("cosmos_jit", tmp_path / "tok"))
    torch.save(torch.randn(2, 16, 4, 4), prepared / "z.pt")
    out = tmp_path / "grid.png"

    def decode(folder: Path, *flags: str) -> tuple[int, list[str]]:
        code = cld.main(["--checkpoint-dir", str(folder), "--latents", str(prepared / "z.pt"), "--out", str(out),
                         "--raw", *flags])  # fmt: skip
        return code, capsys.readouterr().err.splitlines()

    shutil.copytree(tmp_path / "tok", tmp_path / "renamed")  # the same weights under another name
    assert decode(tmp_path / "renamed")[0] == 0 and out.is_file()
    out.unlink()
    ci16 = tmp_path / "Cosmos-0.1-Tokenizer-CI16x16"
    make_jit_tokenizer(ci16, downsample=8)
    other_weights = tmp_path / "tok_retrained"
    make_jit_tokenizer(other_weights, seed=1)  # same shape: only the hash tells it apart
    for folder, extra in ((ci16, f"; downsample: the tokenizer in '{ci16}' has 8 but the latents 4"),
                          (other_weights, "")):  # fmt: skip
        code, err = decode(folder)
        recorded, found = decoder_sha256("cosmos_jit", tmp_path / "tok"), decoder_sha256("cosmos_jit", folder)
        assert code == 2 and len(err) == 1 and not out.exists(), err
        assert err[0].startswith(f"error: {prepared / 'meta.json'}: the [latent] tokenizer is not the one these "
                                 f"latents were encoded with (cosmos_jit:tok (16 channels, downsample 4)): "
                                 f"latent.checkpoint_dir = '{folder}': its decoder (decoder.jit) has sha256 "
                                 f"{found[:16]}... but the latents' tokenizer {recorded[:16]}...{extra}. ")  # fmt: skip
    code, err = decode(other_weights, "--allow-tokenizer-mismatch")
    assert code == 0 and out.is_file() and "(allowed: latent.allow_tokenizer_mismatch)" in err[-1]


def test_an_allowed_tokenizer_mismatch_is_said_once(tmp_path, capsys):
    """sample.py checks the tokenizer before sampling and again as it decodes: the warning came twice (and once a
    batch more under --npz)."""
    from torchtitan.tools.logging import init_logger

    make_jit_tokenizer(tmp_path / "tok")
    make_jit_tokenizer(tmp_path / "other", seed=1)
    cfg = JobConfig()
    cfg.latent.tokenizer, cfg.latent.checkpoint_dir = "cosmos_jit", str(tmp_path / "other")
    cfg.latent.allow_tokenizer_mismatch = True
    sha256 = decoder_sha256("cosmos_jit", tmp_path / "tok")
    cfg.training.dataset_path = str(write_meta(tmp_path / "prepared", "tok", sha256=sha256))
    init_logger()
    cld.load_training_decoder(cfg, "cpu")  # as sample.py's Sampler does before sampling
    for _ in range(2):  # then each batch
        cld.decode_for_training(cfg, torch.zeros(2, 16, 4, 4))
    assert capsys.readouterr().err.count("(allowed: latent.allow_tokenizer_mismatch)") == 1
