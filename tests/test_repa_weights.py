"""REPA (sihyun-yu/REPA) checkpoints into our DiT (torchtitan/models/dit/repa_adapter.py), and our objective against
REPA's SILoss on them: the denoising and projection losses and every gradient.

The data (tests/data/repa_reference/, written by make_reference_checkpoint.py there) is a tiny checkpoint that REPA's
OWN models/sit.py wrote in its train.py's format (SiT with projectors; zero-initialized layers perturbed, an EMA unlike
the model), and what REPA's loss.py computed on its EMA with recorded inputs, times and noise. No timm here: the
reference ran when the data was made. With REPA_REFERENCE naming a REPA checkout (and timm importable), one more test
runs REPA's own code on fresh inputs.
"""

import argparse
import json
import os
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

import sample
from scripts import convert_dit
from torchtitan.alignment import RepresentationAlignment
from torchtitan.diffusion import sample_images
from torchtitan.diffusion.objective import DiffusionObjective
from torchtitan.job_config import Diffusion
from torchtitan.models.dit import DiT, DiTArgs, dit_configs
from torchtitan.models.dit.repa_adapter import from_repa, is_repa_pt, read_repa_pt
from torchtitan.models.dit.state_dict_adapter import DIT_PT_PICKLE_GLOBALS, read_dit_pt
from torchtitan.models.dit.weights import load_model, resolve_checkpoint
from torchtitan.protocols import BatchLayout
from torchtitan.tools import safe_pickle

DATA = Path(__file__).parent / "data" / "repa_reference"
CHECKPOINT = DATA / "tiny_repa_train_checkpoint.pt"
REFERENCE_IO = DATA / "tiny_repa_reference_io.safetensors"
PROJ_COEFF = 0.5
# make_reference_checkpoint.py's SIT on our side: a SiT flavor's shapes, projectors to the 64-wide encoder.
TINY_SIT = replace(dit_configs["SiT-S/2"], input_size=32, in_channels=4, dim=16, depth=3, num_heads=2, num_classes=10)
TINY_ALIGNED = replace(TINY_SIT, align_depth=2, align_dims=(64,), align_projector_dim=24)
FLAVOR = "SiT-reference-tiny"


@pytest.fixture(scope="module")
def committed() -> dict:
    with open(CHECKPOINT, "rb") as f:
        return safe_pickle.torch_load(f, DIT_PT_PICKLE_GLOBALS, str(CHECKPOINT), "a REPA checkpoint")


@pytest.fixture
def tiny_flavor(monkeypatch):
    monkeypatch.setitem(dit_configs, FLAVOR, TINY_SIT)


def _model(state: dict, args: DiTArgs = TINY_ALIGNED) -> DiT:
    model = DiT(args)
    model.init_weights()
    model.load_state_dict(state, strict=True)
    return model


def _our_losses(model: DiT, io: dict, zs: torch.Tensor) -> tuple[torch.Tensor, DiffusionObjective]:
    diffusion = Diffusion(objective="rectified_flow", prediction="velocity", time_input="t")
    layout = BatchLayout(0, 1, 1, 1, 0, torch.device("cpu"))
    objective = DiffusionObjective(diffusion, model.args, layout, RepresentationAlignment(None, PROJ_COEFF))
    return objective.draw_losses(model, io["x"], io["y"], io["t"], io["noise"], [zs]), objective


def test_losses_and_gradients_equal_repas_siloss():
    """REPA's SILoss on its EMA SiT (linear path, v-prediction; t = 0 the data, time_input "t": read as it is) and
    train.py's `loss.mean() + proj_coeff * proj_loss.mean()`: our per-sample losses, summed as the trainer does,
    give the same denoising losses, projection loss and loss, and the same gradient for every parameter, projectors
    included (fp32, CPU, 1e-5; measured: 0 for the losses, 7e-9 for the gradients)."""
    io = load_file(REFERENCE_IO)
    model = _model(read_repa_pt(CHECKPOINT, TINY_ALIGNED))
    losses, objective = _our_losses(model, io, io["zs"])
    torch.testing.assert_close(objective.take_draws()[1], io["denoising_loss"], rtol=0, atol=1e-5)
    torch.testing.assert_close(objective.take_alignment().mean(), io["proj_loss"], rtol=0, atol=1e-5)
    torch.testing.assert_close(losses.mean(), io["loss"], rtol=0, atol=1e-5)
    losses.mean().backward()
    grads = {name.removeprefix("grad."): g for name, g in io.items() if name.startswith("grad.")}
    assert sorted(grads) == sorted(name for name, _ in model.named_parameters())  # REPA's names are ours
    for name, p in model.named_parameters():
        assert grads[name].abs().max() > 0, name  # nothing hides behind a zero
        torch.testing.assert_close(p.grad, grads[name], rtol=0, atol=1e-5, msg=name)


def test_train_checkpoint_gives_its_ema_and_the_plain_state_dict_loads(committed, tmp_path):
    assert committed["opt"] == {} and isinstance(committed["args"], argparse.Namespace)
    ema = read_repa_pt(CHECKPOINT, TINY_ALIGNED)
    assert torch.equal(ema["projectors.0.4.weight"], committed["ema"]["projectors.0.4.weight"])
    assert not torch.equal(ema["blocks.0.attn.qkv.weight"], committed["model"]["blocks.0.attn.qkv.weight"])
    torch.save(committed["ema"], tmp_path / "last.pt")  # the released last.pt: a plain state dict
    plain = read_repa_pt(tmp_path / "last.pt", TINY_ALIGNED)
    assert all(torch.equal(plain[name], ema[name]) for name in ema)
    legacy = {k.replace("blocks.2.", "decoder_blocks.0."): v for k, v in committed["ema"].items()}  # --legacy files
    torch.save(legacy, tmp_path / "legacy.pt")
    assert all(torch.equal(read_repa_pt(tmp_path / "legacy.pt", TINY_ALIGNED)[name], ema[name]) for name in ema)


def test_without_alignment_the_projectors_are_left_out(committed):
    """Sampling (and a run that does not align) takes the SiT alone."""
    state = read_repa_pt(CHECKPOINT, TINY_SIT)
    assert not any(name.startswith("projectors.") for name in state)
    out, (projected,) = _model(read_repa_pt(CHECKPOINT, TINY_ALIGNED)).eval()(
        torch.randn(2, 4, 32, 32), torch.tensor([10.0, 900.0]), torch.tensor([1, 10]), aligned=True
    )
    assert projected.shape == (2, 256, 64)
    plain = _model(state, TINY_SIT).eval()(torch.randn(2, 4, 32, 32), torch.tensor([1.0, 2.0]), torch.tensor([1, 2]))
    assert isinstance(plain, torch.Tensor)


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(align_depth=3), r"its projectors read block 2 \(its encoder_depth\), the run's alignment.depth is 3"),
        (dict(align_dims=(32,)), r"projectors.0.4.bias has shape \(64,\), the run's \(32,\)"),
        (dict(align_dims=(64, 64)), r"it has projectors \['0'\], the run one per encoder \(2\): projectors.1.0.bias"),
        (
            dict(align_projector_dim=8),
            r"projectors.0.0.bias has shape \(24,\), the run's \(8,\): set alignment.projector_dim",
        ),
        (dict(num_classes=5), r"y_embedder.embedding_table.weight has shape \(11, 16\), the model \(6, 16\)"),
    ],
)
def test_another_model_or_alignment_is_refused_naming_it(change, message):
    with pytest.raises(ValueError, match=message) as info:
        read_repa_pt(CHECKPOINT, replace(TINY_ALIGNED, **change))
    assert str(CHECKPOINT) in str(info.value)


def test_each_reader_sends_the_other_format_on(committed, tmp_path):
    with pytest.raises(ValueError, match=r"a REPA checkpoint .*initial_load_format = 'repa_pt' and a SiT-\*"):
        read_dit_pt(CHECKPOINT, TINY_SIT)
    torch.save({k: v for k, v in committed["ema"].items() if not k.startswith("projectors.")}, tmp_path / "dit.pt")
    with pytest.raises(ValueError, match=r"dit.pt: no REPA checkpoint .*'dit_pt'"):
        read_repa_pt(tmp_path / "dit.pt", TINY_SIT)
    assert is_repa_pt(CHECKPOINT) and not is_repa_pt(tmp_path / "dit.pt")  # told apart without unpickling
    cosine = dict(committed, args=argparse.Namespace(**{**vars(committed["args"]), "path_type": "cosine"}))
    torch.save(cosine, tmp_path / "cosine.pt")
    with pytest.raises(ValueError, match=r"cosine.pt: trained on REPA's 'cosine' path; ours is its 'linear' one"):
        read_repa_pt(tmp_path / "cosine.pt", TINY_SIT)


def test_from_repa_state_dict_in_memory(committed):
    state = from_repa(committed["model"], TINY_ALIGNED, "model")
    assert torch.equal(state["projectors.0.2.bias"], committed["model"]["projectors.0.2.bias"])


def test_sample_py_samples_as_repas_euler_sampler(tiny_flavor):
    """sample.py's reading of the REPA file (a SiT flavor: rectified flow, the projectors left out) and its sampler
    give REPA's samplers.euler_sampler's samples, Euler and Heun (4 steps, no guidance; REPA integrates in
    float64, we in float32: relative 1e-5)."""
    io = load_file(REFERENCE_IO)
    cfg, weights = resolve_checkpoint(CHECKPOINT, "", FLAVOR, [])
    assert (cfg.diffusion.objective, cfg.diffusion.time_input, cfg.alignment.enable) == ("rectified_flow", "t", False)
    model, args = load_model(cfg, weights, torch.device("cpu"))
    assert model.projectors is None
    for sampler in ("euler", "heun"):
        flags = sample.parse(["--checkpoint", str(CHECKPOINT), "--steps", "4", "--sampler", sampler, "--cfg-scale", "1",
                              "--guidance-channels", "-1"])  # fmt: skip
        diffusion = sample.Sampler(cfg, model, args, torch.device("cpu"), flags).diffusion
        with torch.no_grad():
            x = sample_images(diffusion, model, io["sample_noise"], io["y"], 4, sampler)
        gap = ((x - io[sampler]).abs().max() / io[sampler].abs().max()).item()
        assert gap <= 1e-5, (sampler, gap)


def test_convert_dit_writes_the_repa_pt_without_projectors(tmp_path, tiny_flavor):
    dst = tmp_path / "repa.safetensors"
    assert convert_dit.main([str(CHECKPOINT), str(dst), "--flavor", FLAVOR]) == 0
    weights = load_file(dst)
    expected = read_repa_pt(CHECKPOINT, TINY_SIT)
    assert sorted(weights) == sorted(expected) and all(torch.equal(weights[k], expected[k]) for k in expected)
    with safe_open(str(dst), "pt") as f:
        recorded = DiTArgs.from_dict(json.loads(f.metadata()["model_args"]))
    assert recorded == TINY_SIT


@pytest.mark.skipif(not os.environ.get("REPA_REFERENCE"), reason="REPA_REFERENCE names no sihyun-yu/REPA checkout")
def test_repas_own_code_on_fresh_inputs():
    """REPA's SiT (its load_state_dict of the committed EMA) and SILoss, run here on new inputs, times and noise."""
    pytest.importorskip("timm")
    sys.path.insert(0, os.environ["REPA_REFERENCE"])
    from loss import SILoss
    from models.sit import SiT

    with open(CHECKPOINT, "rb") as f:
        checkpoint = safe_pickle.torch_load(f, DIT_PT_PICKLE_GLOBALS, str(CHECKPOINT), "a REPA checkpoint")
    reference = SiT(input_size=32, patch_size=2, in_channels=4, hidden_size=16, decoder_hidden_size=16, depth=3,
                    num_heads=2, encoder_depth=2, num_classes=10, class_dropout_prob=0.1, z_dims=[64],
                    projector_dim=24, qk_norm=False, fused_attn=True)  # fmt: skip
    reference.load_state_dict(checkpoint["ema"])
    reference.eval()
    g = torch.Generator().manual_seed(7)
    io = {"x": torch.randn(3, 4, 32, 32, generator=g), "y": torch.tensor([0, 9, 10])}
    zs = torch.randn(3, 256, 64, generator=g)
    torch.manual_seed(11)
    denoising, proj = SILoss()(reference, io["x"], dict(y=io["y"]), zs=[zs])
    (denoising.mean() + PROJ_COEFF * proj.mean()).backward()
    torch.manual_seed(11)
    io["t"] = torch.rand((3, 1, 1, 1)).flatten()
    io["noise"] = torch.randn_like(io["x"])
    model = _model(read_repa_pt(CHECKPOINT, TINY_ALIGNED))
    losses, objective = _our_losses(model, io, zs)
    torch.testing.assert_close(objective.take_draws()[1], denoising.detach(), rtol=0, atol=1e-5)
    torch.testing.assert_close(objective.take_alignment().mean(), proj.detach(), rtol=0, atol=1e-5)
    losses.mean().backward()
    theirs = dict(reference.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, theirs[name].grad, rtol=0, atol=1e-5, msg=name)


def test_trainer_starts_from_the_repa_pt_with_its_projectors(tmp_path, tiny_flavor):
    """checkpoint.initial_load_format = "repa_pt" with [alignment] of REPA's shapes (the committed 64-wide DINOv2,
    block 2, 24 wide): the model and its EMA start at REPA's EMA weights, projectors included."""
    from tests.conftest import TINY
    from torchtitan.config_manager import parse_args
    from torchtitan.trainer import Trainer

    flags = [*TINY, "--job.dump_folder", str(tmp_path / "run"), "--model.flavor", FLAVOR, "--diffusion.objective",
             "rectified_flow", "--diffusion.prediction", "velocity", "--diffusion.time_input", "t",
             "--training.dataset", "dummy",
             "--training.local_batch_size", "2", "--training.ema_decay", "0.9", "--alignment.enable", "true",
             "--alignment.encoder_path", str(DATA / "tiny_dinov2_reg.pth"), "--alignment.depth", "2",
             "--alignment.projector_dim", "24", "--checkpoint.initial_load_path", str(CHECKPOINT),
             "--checkpoint.initial_load_format", "repa_pt"]  # fmt: skip
    expected = read_repa_pt(CHECKPOINT, TINY_ALIGNED)
    trainer = Trainer(parse_args(flags))
    try:
        params = {name: p.detach() for name, p in trainer.model.named_parameters()}
        assert sorted(params) == sorted(expected) and "projectors.0.4.weight" in params
        shadow = dict(zip(trainer.ema.names, trainer.ema.shadow, strict=True))
        for name, tensor in expected.items():
            assert torch.equal(params[name], tensor) and torch.equal(shadow[name], tensor), name
    finally:
        trainer.close()


def test_repa_pt_needs_its_sits_flow():
    from torchtitan.config_manager import parse_args
    from torchtitan.errors import ConfigError

    with pytest.raises(ConfigError, match=r"initial_load_format = 'repa_pt' .*REPA's SiT predicts velocity in our "
                                          r"time, read in \[0, 1\]; set .*diffusion.time_input = 't'"):  # fmt: skip
        parse_args(["--checkpoint.initial_load_path", str(CHECKPOINT), "--checkpoint.initial_load_format", "repa_pt"])
