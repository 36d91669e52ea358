"""scripts/convert_vavae.py: an LDM-style (LightningDiT VA-VAE) autoencoder checkpoint -> a diffusers AutoencoderKL
folder that encodes and decodes as the reference's own module does, and that prepare.py's diffusers route loads.

The data (tests/data/vavae_reference/, written by make_reference.py there with hustvl/LightningDiT's own
tokenizer/autoencoder.py) holds the reference's encode and decode of a tiny VA-VAE whose weights are drawn from a seed
(`tiny_weights`, the same draw here): only the outputs are committed. No reference code runs here.

Tolerance: 1e-5 of the largest output magnitude (fp32, CPU). The two implementations order their sums differently
(diffusers' attention is SDPA on linear layers, the reference's bmm and softmax on 1x1 convolutions): the gap
measured when the data was made is 1.5e-6 of it.
"""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

import scripts.convert_vavae as convert_vavae
from torchtitan.tools import safe_pickle

pytest.importorskip("diffusers")
DATA = Path(__file__).parent / "data" / "vavae_reference"
REFERENCE_IO = DATA / "tiny_vavae_reference_io.safetensors"
RELATIVE_TOLERANCE = 1e-5


def _maker():
    spec = importlib.util.spec_from_file_location("make_vavae_reference", DATA / "make_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def write_tiny_vavae(path: Path, io_file: Path = REFERENCE_IO) -> Path:
    """The tiny VA-VAE as LightningDiT's Lightning checkpoint holds it: `state_dict` with the autoencoder and the
    entries of its losses and foundation model, beside Lightning's counters."""
    with safe_open(str(io_file), "pt") as f:
        metadata = f.metadata()
    weights = _maker().tiny_weights(json.loads(metadata["shapes"]), int(metadata["seed"]))
    others = {"loss.logvar": torch.zeros(()), "loss.discriminator.main.0.weight": torch.ones(4, 3, 4, 4),
              "foundation_model.model.cls_token": torch.ones(1, 1, 8),
              "linear_proj.weight": torch.ones(8, 8)}  # fmt: skip
    torch.save({"state_dict": {**weights, **others}, "epoch": 3, "global_step": 30}, path)
    return path


@pytest.fixture(scope="module")
def tiny_vavae_folder(tmp_path_factory) -> Path:
    """The tiny VA-VAE converted into a diffusers folder (shared by the tests that decode through it)."""
    root = tmp_path_factory.mktemp("vavae")
    assert convert_vavae.main([str(write_tiny_vavae(root / "tiny_vavae.ckpt")), str(root / "vavae_diffusers")]) == 0
    return root / "vavae_diffusers"


def _gap(ours: torch.Tensor, reference: torch.Tensor) -> float:
    return ((ours - reference).abs().max() / reference.abs().max()).item()


def check_reproduces_reference(folder: Path, io_file: Path = REFERENCE_IO) -> None:
    from diffusers import AutoencoderKL

    io = load_file(io_file)
    vae = AutoencoderKL.from_pretrained(str(folder)).eval()
    with torch.no_grad():
        posterior = vae.encode(io["images"]).latent_dist
        decoded = vae.decode(io["latents"]).sample
    assert _gap(posterior.mean, io["latent_mean"]) <= RELATIVE_TOLERANCE
    assert _gap(posterior.logvar, io["latent_logvar"]) <= RELATIVE_TOLERANCE
    assert _gap(decoded, io["decoded"]) <= RELATIVE_TOLERANCE


def test_converted_folder_encodes_and_decodes_as_the_reference(tiny_vavae_folder):
    check_reproduces_reference(tiny_vavae_folder)
    config = json.loads((tiny_vavae_folder / "config.json").read_text())
    assert config["down_block_types"] == ["DownEncoderBlock2D", "AttnDownEncoderBlock2D"]  # attention where LDM's is
    assert config["up_block_types"] == ["AttnUpDecoderBlock2D", "UpDecoderBlock2D"]
    assert config["latent_channels"] == 8 and config["block_out_channels"] == [32, 64]


def test_prepare_routes_diffusers_tokenizer_loads_it(tiny_vavae_folder):
    """prepare.py --tokenizer diffusers loads the folder through load_tokenizer and keeps the posterior's mean
    (LightningDiT's extract_features.py draws a sample of the posterior instead: docs/latent.md says so)."""
    from torchtitan.datasets.tokenizers import load_tokenizer

    io = load_file(REFERENCE_IO)
    tokenizer = load_tokenizer("diffusers", tiny_vavae_folder)
    assert (tokenizer.latent_channels, tokenizer.downsample) == (8, 2)
    assert _gap(tokenizer.encode(io["images"]), io["latent_mean"]) <= RELATIVE_TOLERANCE
    assert _gap(tokenizer.decode(io["latents"]), io["decoded"].clamp(-1, 1)) <= RELATIVE_TOLERANCE  # images: clamped


def test_errors_are_one_line_naming_the_file(tmp_path, capsys):
    dst = tmp_path / "out"
    dst.mkdir()
    assert convert_vavae.main([str(tmp_path / "missing.ckpt"), str(tmp_path / "x")]) == 2
    assert convert_vavae.main([str(write_tiny_vavae(tmp_path / "v.ckpt")), str(dst)]) == 2
    torch.save({"state_dict": {"decoder.conv_in.weight": torch.ones(1)}}, tmp_path / "other.ckpt")
    assert convert_vavae.main([str(tmp_path / "other.ckpt"), str(tmp_path / "y")]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert "missing.ckpt does not exist" in errors[0]
    assert errors[1] == f"error: DST: {dst} exists; nothing is overwritten"
    assert "other.ckpt: no LDM autoencoder in it" in errors[2]


class _RunsCode:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_a_checkpoint_naming_code_is_refused_before_it_runs(tmp_path):
    marker, path = tmp_path / "ran", tmp_path / "crafted.ckpt"
    torch.save({"state_dict": {}, "hyper_parameters": _RunsCode(marker)}, path)
    with pytest.raises(safe_pickle.UnsafePickleError, match=r"crafted.ckpt refers to (posix|nt|os)\.system"):
        convert_vavae.read_ldm_state_dict(path)
    assert not marker.exists()


@pytest.mark.skipif(not os.environ.get("LIGHTNINGDIT_CHECKOUT"), reason="set LIGHTNINGDIT_CHECKOUT to a checkout")
def test_against_the_reference_checkout(tmp_path):
    """With LIGHTNINGDIT_CHECKOUT naming a hustvl/LightningDiT clone (its tokenizer/ importable), the reference's own
    module writes fresh outputs and the converted folder reproduces them."""
    checkout = os.environ["LIGHTNINGDIT_CHECKOUT"]
    subprocess.run([sys.executable, str(DATA / "make_reference.py"), checkout, "--out", str(tmp_path)], check=True)
    io_file = tmp_path / REFERENCE_IO.name
    write_tiny_vavae(tmp_path / "v.ckpt", io_file)
    assert convert_vavae.main([str(tmp_path / "v.ckpt"), str(tmp_path / "folder")]) == 0
    check_reproduces_reference(tmp_path / "folder", io_file)
