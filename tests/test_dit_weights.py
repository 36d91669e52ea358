"""facebookresearch/DiT `.pt` weights into our DiT (torchtitan/models/dit/state_dict_adapter.py): for sampling
(sample.py) and as a training start (`checkpoint.initial_load_format = "dit_pt"`).

The data (tests/data/dit_reference/, written by make_reference_checkpoint.py there) is a tiny checkpoint that the
reference's OWN models.py wrote in its train.py's format, with its zero-initialized adaLN and output layers
perturbed and an EMA unlike the model, and the reference's output on a recorded input: our model given those
weights reproduces it (fp32, CPU). No timm here: the reference ran when the data was made.
"""

import argparse
import os
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

import sample
from tests.conftest import TINY
from torchtitan.config_manager import parse_args
from torchtitan.diffusion import GaussianDiffusion, guided, sample_images
from torchtitan.errors import ConfigError
from torchtitan.models.dit import DiT, DiTArgs, dit_configs
from torchtitan.models.dit.state_dict_adapter import DIT_PT_PICKLE_GLOBALS, read_dit_pt
from torchtitan.tools import safe_pickle

DATA = Path(__file__).parent / "data" / "dit_reference"
CHECKPOINT = DATA / "tiny_dit_train_checkpoint.pt"
REFERENCE_IO = DATA / "tiny_dit_reference_io.safetensors"
# make_reference_checkpoint.py's TINY on our side.
TINY_REFERENCE = DiTArgs(input_size=8, in_channels=3, patch_size=2, dim=32, depth=2, num_heads=2, num_classes=10,
                         learn_sigma=True, pos_embed="sincos")  # fmt: skip
FLAVOR = "DiT-reference-tiny"  # registered by the tests that go through a config (Trainer, sample.py)


@pytest.fixture(scope="module")
def committed() -> dict:
    """The committed train.py checkpoint, read as sample code may not: through the adapter's own allow-list."""
    with open(CHECKPOINT, "rb") as f:
        return safe_pickle.torch_load(f, DIT_PT_PICKLE_GLOBALS, str(CHECKPOINT), "a DiT checkpoint")


@pytest.fixture
def tiny_flavor(monkeypatch):
    monkeypatch.setitem(dit_configs, FLAVOR, replace(TINY_REFERENCE, pos_embed="rope2d"))  # as a flavor would be


def _output(state_dict: dict, args: DiTArgs = TINY_REFERENCE) -> torch.Tensor:
    model = DiT(args)
    model.init_weights()  # the position buffers; every parameter is then overwritten
    model.load_state_dict(state_dict, strict=True)
    io = load_file(REFERENCE_IO)
    with torch.no_grad():
        return model.eval()(io["x"], io["t"], io["y"])


def test_train_checkpoint_loads_its_ema_and_reproduces_the_reference(committed):
    io = load_file(REFERENCE_IO)
    assert committed["opt"] == {} and isinstance(committed["args"], argparse.Namespace)
    assert not torch.equal(committed["ema"]["blocks.0.adaLN_modulation.1.weight"],
                           committed["model"]["blocks.0.adaLN_modulation.1.weight"])  # fmt: skip
    assert committed["ema"]["final_layer.linear.weight"].abs().min() > 0  # nothing hides behind a zero
    weights = read_dit_pt(CHECKPOINT, TINY_REFERENCE)
    assert "pos_embed" not in weights
    out = _output(weights)
    assert (out - io["out_ema"]).abs().max().item() <= 1e-6
    assert (out - io["out_model"]).abs().max().item() > 1e-3  # the EMA was read, not the live model


def test_plain_state_dict_loads(committed, tmp_path):
    path = tmp_path / "DiT-tiny-256x256.pt"  # as the released files: a plain state dict
    torch.save(committed["model"], path)
    out = _output(read_dit_pt(path, TINY_REFERENCE))
    assert (out - load_file(REFERENCE_IO)["out_model"]).abs().max().item() <= 1e-6


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(num_classes=5), r"y_embedder.embedding_table.weight has shape \(11, 32\), the model \(6, 32\)"),
        (dict(learn_sigma=False), r"final_layer.linear.weight has shape \(24, 32\), the model \(12, 32\)"),
        (dict(input_size=16), r"pos_embed has shape \(1, 16, 32\), the model \(1, 64, 32\)"),
        (dict(depth=3), r"no weights for \['blocks.2"),
        (dict(depth=1), r"unexpected key 'blocks.1.attn.qkv.weight'"),
    ],
)
def test_another_architecture_is_refused_naming_key_and_shapes(change, message):
    with pytest.raises(ValueError, match=message) as info:
        read_dit_pt(CHECKPOINT, replace(TINY_REFERENCE, **change))
    assert str(CHECKPOINT) in str(info.value) and "model.flavor" in str(info.value)
    assert "learn_sigma, num_classes, input_size, in_channels, patch_size" in str(info.value)


def test_position_table_must_be_sincos_and_equal_ours(committed, tmp_path):
    with pytest.raises(ValueError, match="model.pos_embed = 'sincos'.*'rope2d'"):
        read_dit_pt(CHECKPOINT, replace(TINY_REFERENCE, pos_embed="rope2d"))
    shifted = dict(committed["model"])
    shifted["pos_embed"] = shifted["pos_embed"].clone()
    shifted["pos_embed"][0, 3, 5] += 1e-4
    torch.save(shifted, tmp_path / "shifted.pt")
    with pytest.raises(ValueError, match=r"shifted.pt: pos_embed differs from the fixed 2D sin-cos table by 0.0001"):
        read_dit_pt(tmp_path / "shifted.pt", TINY_REFERENCE)


class _RunsCode:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_a_file_naming_code_is_refused_before_it_runs(committed, tmp_path):
    marker, path = tmp_path / "ran", tmp_path / "crafted.pt"
    torch.save({"model": committed["model"], "ema": committed["ema"], "opt": {}, "args": _RunsCode(marker)}, path)
    with open(path, "rb") as f:  # the file does run code when unpickled plainly (not done: only its global named)
        assert b"system" in f.read()
    refusal = (
        rf"{path} refers to (posix|nt|os)\.system, which a DiT checkpoint may not hold \(loading it could run code\)"
    )
    with pytest.raises(safe_pickle.UnsafePickleError, match=refusal):
        read_dit_pt(path, TINY_REFERENCE)
    assert not marker.exists()


def test_sit_files_are_refused_by_name(committed, tmp_path):
    sit_args = argparse.Namespace(model="SiT-XL/2", path_type="Linear", prediction="velocity", loss_weight=None,
                                  sample_eps=None, train_eps=None)  # fmt: skip
    torch.save({"model": committed["model"], "ema": committed["ema"], "opt": {}, "args": sit_args},
               tmp_path / "0400000.pt")  # fmt: skip
    with pytest.raises(ValueError, match=r"0400000.pt: SiT weights .* not supported.*time runs the other way"):
        read_dit_pt(tmp_path / "0400000.pt", TINY_REFERENCE)
    torch.save(committed["model"], tmp_path / "SiT-XL-2-256.pt")
    with pytest.raises(ValueError, match=r"SiT-XL-2-256.pt: SiT weights .* not supported"):
        read_dit_pt(tmp_path / "SiT-XL-2-256.pt", TINY_REFERENCE)


def _train_flags(tmp_path: Path) -> list[str]:
    """The debug config adapted to the tiny reference's shapes: DDPM (its learned sigma), random RGB data."""
    return [*TINY, "--job.dump_folder", str(tmp_path / "run"), "--model.flavor", FLAVOR, "--model.pos_embed",
            "sincos", "--diffusion.objective", "ddpm", "--diffusion.prediction", "epsilon",
            "--diffusion.timestep_sampling", "uniform", "--training.dataset", "dummy", "--training.steps", "1",
            "--training.local_batch_size", "2", "--training.ema_decay", "0.9", "--checkpoint.initial_load_path",
            str(CHECKPOINT), "--checkpoint.initial_load_format", "dit_pt"]  # fmt: skip


def test_trainer_starts_from_the_pt_weights_with_ema_equal(tmp_path, tiny_flavor):
    from torchtitan.trainer import Trainer

    expected = read_dit_pt(CHECKPOINT, TINY_REFERENCE)
    trainer = Trainer(parse_args(_train_flags(tmp_path)))
    try:
        params = dict(trainer.model.named_parameters())
        assert sorted(params) == sorted(expected)
        for name, tensor in expected.items():
            assert torch.equal(params[name].detach(), tensor), name
        shadow = dict(zip(trainer.ema.names, trainer.ema.shadow, strict=True))
        for name, tensor in expected.items():
            assert torch.equal(shadow[name], tensor), name
    finally:
        trainer.close()


def test_config_keys_of_the_initial_format(tmp_path, tiny_flavor):
    # TorchTitan's initial_load_in_hf (tests/test_config_manager.py) asks the DiT for weights it has no reader of.
    with pytest.raises(ConfigError, match=r"checkpoint.initial_load_format = 'hf' in the command line \(as "
                                          r"checkpoint.initial_load_in_hf = 'true'\): model.name 'dit' .*"
                                          r"has no 'hf'"):  # fmt: skip
        parse_args(["--checkpoint.initial_load_in_hf", "true", "--checkpoint.initial_load_path", "x"])
    toml = tmp_path / "old.toml"
    toml.write_text("[checkpoint]\ninitial_load_in_hf = false\n")  # as older runs' resolved config.toml hold it
    assert parse_args(["--job.config_file", str(toml)]).checkpoint.initial_load_format == "dcp"
    with pytest.raises(ConfigError, match=r"checkpoint.initial_load_format = 'dit_pt' .*needs "
                                          r"checkpoint.initial_load_path"):  # fmt: skip
        parse_args(["--checkpoint.initial_load_format", "dit_pt"])
    llama = ["--model.name", "llama3", "--model.flavor", "debugmodel", "--training.dataset", "stdlib",
             "--training.seq_len", "64", "--checkpoint.initial_load_path", "x"]  # fmt: skip
    with pytest.raises(ConfigError, match=r"initial_load_format = 'dit_pt' .*model.name 'llama3' .*has no 'dit_pt' "
                                          r"weights; it reads \['dcp', 'hf'\]"):  # fmt: skip
        parse_args([*llama, "--checkpoint.initial_load_format", "dit_pt"])
    diffusers = parse_args(["--checkpoint.initial_load_format", "diffusers", "--checkpoint.initial_load_path", "x"])
    assert diffusers.checkpoint.initial_load_format == "diffusers"  # a DiT reads diffusers folders
    with pytest.raises(ConfigError, match=r"model.name 'llama3' .*has no 'diffusers' weights"):
        parse_args([*llama, "--checkpoint.initial_load_format", "diffusers"])
    # A file of other shapes: one ConfigError naming the key, the file and the key of the weights.
    flags = [flag if flag != FLAVOR else "debug" for flag in _train_flags(tmp_path)]
    from torchtitan.trainer import Trainer

    with pytest.raises(ConfigError, match=rf"checkpoint.initial_load_path = .*{CHECKPOINT.name}: .* has shape"):
        Trainer(parse_args(flags)).close()


def _error_lines(capsys) -> list[str]:
    return [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]


def test_sample_py_draws_a_grid_from_the_pt(tmp_path, tiny_flavor, capsys):
    out = tmp_path / "grid.png"
    common = ["--checkpoint", str(CHECKPOINT), "--num-samples", "4", "--steps", "2", "--classes", "1,2"]
    assert sample.main([*common, "--flavor", FLAVOR, "--out", str(out)]) == 0
    grid = np.asarray(Image.open(out))
    assert grid.shape == (2 + 2 * 66, 2 + 2 * 66, 3) and grid.std() > 0  # 8 px RGB enlarged to 64, 2 classes
    assert _error_lines(capsys) == []
    assert sample.main([*common, "--flavor", "DiT-XX/2", "--out", str(out)]) == 2
    (error,) = _error_lines(capsys)
    assert error.startswith("error: model.flavor = 'DiT-XX/2' in the command line: known flavors"), error
    assert sample.main([*common, "--flavor", FLAVOR, "--model.num_classes", "5", "--out", str(out)]) == 2
    (error,) = _error_lines(capsys)
    assert "y_embedder.embedding_table.weight has shape (11, 32), the model (6, 32)" in error, error
    assert sample.main([*common, "--out", str(out)]) == 2
    (error,) = _error_lines(capsys)
    assert error.startswith("error: --flavor: a .pt checkpoint has no run config"), error


def _reference_ema() -> DiT:
    model = DiT(TINY_REFERENCE)
    model.init_weights()
    model.load_state_dict(read_dit_pt(CHECKPOINT, TINY_REFERENCE), strict=True)
    return model.eval()


def _max_relative_gap(ours: torch.Tensor, reference: torch.Tensor) -> float:
    """The largest gap over the largest magnitude: an untrained model's samples reach |x| ~ 600, where a float32
    ulp is 6e-5, so an absolute 1e-5 could only be met bit for bit."""
    return ((ours - reference).abs().max() / reference.abs().max()).item()


def test_ddpm_sampler_reproduces_the_references_p_sample_loop():
    """`create_diffusion("7").p_sample_loop` of the reference on its own EMA weights, the global RNG seeded alike:
    our 'ddpm' sampler gives the same samples with the learned-range and the fixed large variance (the model
    reads the original timesteps 999, 832, ..., 0 and the step noise is drawn in the same order; with the
    reference's own model in place of ours the samples were bit-identical when the data was made)."""
    io, model = load_file(REFERENCE_IO), _reference_ema()
    noise, y, seed = io["ddpm_noise"], io["ddpm_y"], int(io["ddpm_seed"])
    for name, learn_sigma in (("ddpm_learned", True), ("ddpm_fixed_large", False)):
        diffusion = GaussianDiffusion(1000, "linear", learn_sigma)
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            out = sample_images(diffusion, model, noise, y, steps=7, sampler="ddpm")
            after = torch.randn(3)
            torch.manual_seed(seed)
            for _ in range(7):  # one draw per step, the last (unused) too
                torch.randn_like(noise)
            assert torch.equal(after, torch.randn(3)), "the step noise was not drawn as the reference draws it"
        assert _max_relative_gap(out, io[name]) <= 1e-5, name
        # A generator seeded alike draws the same step noise as the seeded global RNG.
        generator = torch.Generator().manual_seed(seed)
        out_generator = sample_images(diffusion, model, noise, y, steps=7, sampler="ddpm", generator=generator)
        torch.testing.assert_close(out_generator, out, rtol=0, atol=0)
    assert _max_relative_gap(io["ddpm_learned"], io["ddpm_fixed_large"]) > 1e-3  # the variances differ


def test_guided_ddpm_sampler_is_the_conditional_half_of_the_references_doubled_chain():
    """The reference samples CFG as a doubled chain (conditional half first) through `forward_with_cfg`, drawing
    each step's noise for 2B and keeping the first B. Our sampler run on that doubled batch, the model the
    reference's wrapper around `guided` (which reads only the first half), reproduces it; through sample_images
    the noise is drawn for B, so the samples agree in distribution only."""
    io, model = load_file(REFERENCE_IO), _reference_ema()
    noise, y, seed = io["ddpm_noise"], io["ddpm_y"], int(io["ddpm_seed"])
    scale, null, batch = 4.0, TINY_REFERENCE.num_classes, len(y)
    diffusion = GaussianDiffusion(1000, "linear", learn_sigma=True)
    guided_model = guided(model, scale, null, guide_channels=3)  # = all 3 channels of the tiny model

    def doubled_chain(x, t, labels):
        half = guided_model(x[:batch], t[:batch], labels[:batch])
        return torch.cat([half, half])

    with torch.random.fork_rng():
        torch.manual_seed(seed)
        doubled = torch.cat([y, torch.full_like(y, null)])
        out = diffusion.ddpm_sample(doubled_chain, torch.cat([noise, noise]), doubled, steps=7)[:batch]
        torch.manual_seed(seed)
        single = sample_images(diffusion, model, noise, y, 7, "ddpm", scale, null, guidance_channels=3)
    assert _max_relative_gap(out, io["ddpm_cfg"]) <= 1e-5
    assert _max_relative_gap(io["ddpm_cfg"], io["ddpm_learned"]) > 1e-3  # the guidance did change the samples
    assert _max_relative_gap(single, io["ddpm_cfg"]) > 1e-3  # other step noise from the second step on


def test_sample_py_samples_with_ddpm(tmp_path, tiny_flavor, capsys):
    """A grid, and an .npz whose batches draw their step noise from their own seeded generators: the same file
    whatever the global RNG (so whatever the number of ranks that sample it)."""
    out = tmp_path / "grid.png"
    flags = ["--checkpoint", str(CHECKPOINT), "--flavor", FLAVOR, "--num-samples", "2", "--classes", "1,2"]
    assert sample.main([*flags, "--sampler", "ddpm", "--steps", "7", "--out", str(out)]) == 0
    assert _error_lines(capsys) == [] and np.asarray(Image.open(out)).std() > 0
    npz = [*flags, "--sampler", "ddpm", "--steps", "7", "--batch-size", "1", "--npz"]
    for seed in (0, 1):
        torch.manual_seed(seed)
        assert sample.main([*npz, str(tmp_path / f"global_seed_{seed}.npz")]) == 0
    first, second = (np.load(tmp_path / f"global_seed_{seed}.npz")["arr_0"] for seed in (0, 1))
    assert np.array_equal(first, second) and first.std() > 0
