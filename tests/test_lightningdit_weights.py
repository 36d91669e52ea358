"""hustvl/LightningDiT `.pt` weights into our DiT (torchtitan/models/dit/lightningdit_adapter.py): the model's output,
its Euler ODE samples (with and without guidance), sample.py, scripts/convert_dit.py and a run's start
(`checkpoint.initial_load_format = "lightningdit_pt"`).

The data (tests/data/lightningdit_reference/, written by make_reference_checkpoint.py there) are tiny checkpoints that
the reference's OWN models/lightningdit.py wrote, with its zero-initialized adaLN and final layers and its RMSNorm
weights perturbed and an EMA unlike the model, and the reference's outputs on recorded inputs. No reference code runs
here (timm, einops, fairscale ran when the data was made); with LIGHTNINGDIT_CHECKOUT naming a checkout, one test
makes the data afresh and checks it too. Tolerance: 1e-5 (fp32, CPU); measured 1.2e-7 on outputs of order 1.
"""

import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

import sample
import scripts.convert_dit as convert_dit
from tests.conftest import TINY
from torchtitan.config_manager import parse_args
from torchtitan.diffusion import RectifiedFlow, sample_images
from torchtitan.errors import ConfigError
from torchtitan.models.dit import DiT, DiTArgs, dit_configs
from torchtitan.models.dit.lightningdit_adapter import (
    LIGHTNINGDIT_PT_PICKLE_GLOBALS,
    is_lightningdit_pt,
    read_lightningdit_pt,
)
from torchtitan.tools import safe_pickle

DATA = Path(__file__).parent / "data" / "lightningdit_reference"
CHECKPOINT = DATA / "tiny_lightningdit_train_checkpoint.pt"
PLAIN = DATA / "tiny_lightningdit_plain.pt"
REFERENCE_IO = DATA / "tiny_lightningdit_reference_io.safetensors"
TOLERANCE = 1e-5
# make_reference_checkpoint.py's models on our side: the flavors' LightningDiT options, tiny.
_COMMON = dict(input_size=4, in_channels=8, dim=16, num_heads=2, num_classes=10, learn_sigma=False, multiple_of=1)
TINY_TRAIN = DiTArgs(patch_size=1, depth=2, pos_embed="sincos_rope2d", norm="rmsnorm", mlp="swiglu", qk_norm=True,
                     **_COMMON)  # fmt: skip
TINY_PLAIN = DiTArgs(patch_size=2, depth=1, pos_embed="sincos_rope2d", norm="layernorm", mlp="gelu", **_COMMON)
FLAVOR = "LightningDiT-reference-tiny"  # registered by the tests that go through a config


@pytest.fixture(scope="module")
def committed() -> dict:
    with open(CHECKPOINT, "rb") as f:
        return safe_pickle.torch_load(f, LIGHTNINGDIT_PT_PICKLE_GLOBALS, str(CHECKPOINT), "a LightningDiT checkpoint")


@pytest.fixture
def tiny_flavor(monkeypatch):
    monkeypatch.setitem(dit_configs, FLAVOR, TINY_TRAIN)


def converted(path: Path, args: DiTArgs = TINY_TRAIN) -> DiT:
    model = DiT(args)
    model.init_weights()  # the position buffers; every parameter is then overwritten
    model.load_state_dict(read_lightningdit_pt(path, args), strict=True)
    return model.eval()


def check_outputs(data: Path) -> None:
    """Our DiT on the converted weights gives the reference's outputs (the model reads LightningDiT's own t)."""
    io = load_file(data / REFERENCE_IO.name)
    with torch.no_grad():
        ema = converted(data / CHECKPOINT.name)(io["x"], io["t"], io["y"])
        plain = converted(data / PLAIN.name, TINY_PLAIN)(io["x_plain"], io["t"], io["y"])
    assert (ema - io["out_ema"]).abs().max().item() <= TOLERANCE
    assert (ema - io["out_model"]).abs().max().item() > 1e-3  # the EMA was read, not the live model
    assert (plain - io["out_plain"]).abs().max().item() <= TOLERANCE


def test_train_checkpoint_and_plain_state_dict_reproduce_the_reference(committed):
    """The train.py checkpoint (RoPE, RMSNorm, SwiGLU, QK-norm, patch 1) and a plain state dict of the other
    options (LayerNorm, GELU, adaLN without shifts, a learned sigma, patch 2)."""
    assert committed["opt"] == {} and committed["config"]["transport"]["use_cosine_loss"] is True
    assert committed["ema"]["final_layer.linear.weight"].abs().min() > 0  # nothing hides behind a zero
    assert (committed["ema"]["blocks.0.norm1.weight"] - 1).abs().min() > 0  # RMSNorm weights not at their init
    check_outputs(DATA)


def test_model_entry_as_a_plain_file_reproduces_the_live_model(committed, tmp_path):
    torch.save({"ema": committed["model"]}, tmp_path / "ema_only.pt")  # inference.py's other format
    with torch.no_grad():
        io = load_file(REFERENCE_IO)
        out = converted(tmp_path / "ema_only.pt")(io["x"], io["t"], io["y"])
    assert (out - io["out_model"]).abs().max().item() <= TOLERANCE


def test_euler_ode_samples_are_the_references():
    """Our 'euler' sampler under diffusion.time_input '1-t' integrates the reference's ODE (its transport's Euler
    sampler, its t = 1 - ours), unguided and with guidance on the first 3 channels as its forward_with_cfg."""
    io, model = load_file(REFERENCE_IO), converted(CHECKPOINT)
    flow = RectifiedFlow("logit_normal", time_input="1-t")
    with torch.no_grad():
        plain = sample_images(flow, model, io["ode_noise"], io["ode_y"], 6, "euler")
        cfg = sample_images(flow, model, io["ode_noise"], io["ode_y"], 6, "euler", 4.0, TINY_TRAIN.num_classes,
                            guidance_channels=3)  # fmt: skip
    assert (plain - io["ode_euler"]).abs().max().item() <= TOLERANCE
    assert (cfg - io["ode_cfg"]).abs().max().item() <= TOLERANCE
    assert (io["ode_cfg"] - io["ode_euler"]).abs().max().item() > 1e-3  # the guidance changed the samples


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(pos_embed="sincos"), r"needs model.pos_embed = 'sincos_rope2d' \(the model has 'sincos'\)"),
        (dict(norm="layernorm", qk_norm=False), r"model.norm = 'rmsnorm' .*model.qk_norm = True"),
        (dict(multiple_of=256), r"blocks.0.mlp.fc1.weight \(our name\) has shape \(84, 16\), the model \(512, 16\)"),
        (dict(num_classes=5), r"y_embedder.embedding_table.weight \(our name\) has shape \(11, 16\), the model"),
        (dict(depth=3), r"no weights for \['blocks.2"),
        (dict(depth=1), r"unexpected key 'blocks.1.attn.qkv.weight'"),
        (dict(input_size=8), r"pos_embed has shape \(1, 16, 16\), the model \(1, 64, 16\)"),
    ],
)
def test_another_architecture_is_refused_naming_key_and_shapes(change, message):
    with pytest.raises(ValueError, match=message) as info:
        read_lightningdit_pt(CHECKPOINT, replace(TINY_TRAIN, **change))
    assert str(CHECKPOINT) in str(info.value)


def test_position_tables_must_be_ours_and_layernorm_qk_norm_is_refused(committed, tmp_path):
    for key in ("pos_embed", "feat_rope.freqs_sin"):
        state = dict(committed["ema"])
        state[key] = state[key] + 1e-3
        torch.save(state, tmp_path / "shifted.pt")
        with pytest.raises(ValueError, match=rf"shifted.pt: {key} differs from the table ours computes by 0.001"):
            read_lightningdit_pt(tmp_path / "shifted.pt", TINY_TRAIN)
    state = {**committed["ema"], "blocks.0.attn.q_norm.bias": torch.zeros(8)}
    torch.save(state, tmp_path / "layernorm_qk.pt")
    with pytest.raises(ValueError, match="QK-norm by LayerNorm .* is not supported"):
        read_lightningdit_pt(tmp_path / "layernorm_qk.pt", TINY_TRAIN)


class _RunsCode:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_a_file_naming_code_is_refused_before_it_runs(committed, tmp_path):
    marker, path = tmp_path / "ran", tmp_path / "crafted.pt"
    torch.save({"model": committed["model"], "ema": committed["ema"], "opt": {}, "config": _RunsCode(marker)}, path)
    refusal = rf"{path} refers to (posix|nt|os)\.system, which a LightningDiT checkpoint may not hold"
    with pytest.raises(safe_pickle.UnsafePickleError, match=refusal):
        read_lightningdit_pt(path, TINY_TRAIN)
    assert not marker.exists()


def test_lightningdit_files_are_told_apart_without_unpickling(tmp_path):
    assert is_lightningdit_pt(CHECKPOINT) and is_lightningdit_pt(PLAIN)
    assert not is_lightningdit_pt(Path(__file__).parent / "data" / "dit_reference" / "tiny_dit_train_checkpoint.pt")
    (tmp_path / "junk.pt").write_bytes(b"not a zip")
    assert not is_lightningdit_pt(tmp_path / "junk.pt") and not is_lightningdit_pt(tmp_path / "missing.pt")


def _train_flags(tmp_path: Path) -> list[str]:
    """The debug config on the tiny reference's shapes: its recipe's flow and loss, random latents."""
    return [*TINY, "--job.dump_folder", str(tmp_path / "run"), "--model.flavor", FLAVOR, "--diffusion.objective",
            "rectified_flow", "--diffusion.prediction", "velocity", "--diffusion.timestep_sampling", "logit_normal",
            "--diffusion.time_input", "1-t", "--diffusion.cosine_loss_weight", "1", "--training.dataset", "dummy",
            "--training.steps", "1", "--training.local_batch_size", "2", "--checkpoint.initial_load_path",
            str(CHECKPOINT), "--checkpoint.initial_load_format", "lightningdit_pt"]  # fmt: skip


def test_trainer_starts_from_the_lightningdit_weights_with_ema_equal(tmp_path, tiny_flavor):
    from torchtitan.trainer import Trainer

    expected = read_lightningdit_pt(CHECKPOINT, TINY_TRAIN)
    trainer = Trainer(parse_args(_train_flags(tmp_path)))
    try:
        params = dict(trainer.model.named_parameters())
        assert sorted(params) == sorted(expected)
        shadow = dict(zip(trainer.ema.names, trainer.ema.shadow, strict=True))
        for name, tensor in expected.items():
            assert torch.equal(params[name].detach(), tensor) and torch.equal(shadow[name], tensor), name
    finally:
        trainer.close()


def test_the_initial_format_needs_the_references_flow(tmp_path, tiny_flavor):
    flags = _train_flags(tmp_path)
    at = flags.index("--diffusion.time_input")
    refusal = r"initial_load_format = 'lightningdit_pt' .*set diffusion.time_input = '1-t'"
    with pytest.raises(ConfigError, match=refusal):
        parse_args(flags[:at] + flags[at + 2 :])
    with pytest.raises(ConfigError, match=r"diffusion.time_input = '1-t' in the command line: rectified_flow's"):
        parse_args(["--diffusion.objective", "ddpm", "--diffusion.time_input", "1-t"])
    from torchtitan.components.checkpoint import _foreign_format

    assert "set checkpoint.initial_load_format = 'lightningdit_pt'" in _foreign_format(CHECKPOINT)


def test_sample_py_and_convert_dit_read_the_pt(tmp_path, tiny_flavor, capsys):
    """sample.py draws from the .pt in the reference's flow, decoded through a VA-VAE converted by
    scripts/convert_vavae.py and un-normalized by a LightningDiT latents_stats.pt: its .npz is the composition of
    those steps done here by hand. convert_dit writes the weights with the flow they sample with."""
    from diffusers import AutoencoderKL

    import scripts.convert_vavae as convert_vavae
    from tests.test_convert_vavae import write_tiny_vavae
    from torchtitan.diffusion import sample_noise
    from torchtitan.tools.images import to_uint8_nhwc

    assert convert_vavae.main([str(write_tiny_vavae(tmp_path / "v.ckpt")), str(tmp_path / "vae")]) == 0
    mean, std = torch.randn(1, 8, 1, 1) * 0.1, 0.5 + torch.rand(1, 8, 1, 1)
    torch.save({"mean": mean, "std": std}, tmp_path / "latents_stats.pt")  # LightningDiT's ImgLatentDataset format
    npz = tmp_path / "samples.npz"
    flags = ["--checkpoint", str(CHECKPOINT), "--flavor", FLAVOR, "--num-samples", "3", "--classes", "1,4,9",
             "--steps", "3", "--cfg-scale", "2", "--guidance-channels", "3", "--latent.tokenizer", "diffusers",
             "--latent.checkpoint_dir", str(tmp_path / "vae"), "--latent.stats_file",
             str(tmp_path / "latents_stats.pt")]  # fmt: skip
    assert sample.main([*flags, "--npz", str(npz)]) == 0
    images = np.load(npz)["arr_0"]
    assert images.shape == (3, 8, 8, 3) and images.std() > 0

    noise, _ = sample_noise(0, range(3), 8, 4)
    flow = RectifiedFlow(time_input="1-t")
    with torch.no_grad():
        latents = sample_images(flow, converted(CHECKPOINT), noise, torch.tensor([1, 4, 9]), 3, "euler", 2.0, 10,
                                guidance_channels=3)  # fmt: skip
        vae = AutoencoderKL.from_pretrained(str(tmp_path / "vae")).eval()
        expected = to_uint8_nhwc(vae.decode(latents * std + mean).sample.clamp(-1, 1))
    assert np.abs(images.astype(int) - expected.astype(int)).max() <= 1  # a rounding step apart at most

    out = tmp_path / "tiny.safetensors"
    assert convert_dit.main([str(CHECKPOINT), str(out), "--flavor", FLAVOR]) == 0
    with safe_open(str(out), "pt") as f:
        assert '"time_input": "1-t"' in f.metadata()["diffusion"]
    written, expected_state = load_file(out), read_lightningdit_pt(CHECKPOINT, TINY_TRAIN)
    assert written.keys() == expected_state.keys()
    assert all(torch.equal(written[k], expected_state[k]) for k in written)
    assert [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")] == []


@pytest.mark.skipif(not os.environ.get("LIGHTNINGDIT_CHECKOUT"), reason="set LIGHTNINGDIT_CHECKOUT to a checkout")
def test_against_the_reference_checkout(tmp_path):
    """With LIGHTNINGDIT_CHECKOUT naming a hustvl/LightningDiT clone (and its imports: timm, einops, fairscale,
    torchdiffeq on PYTHONPATH), the reference's own code writes fresh checkpoints and outputs; ours reproduce them."""
    script = DATA / "make_reference_checkpoint.py"
    subprocess.run([sys.executable, str(script), os.environ["LIGHTNINGDIT_CHECKOUT"], "--out", str(tmp_path)],
                   check=True)  # fmt: skip
    check_outputs(tmp_path)
