"""scripts/convert_dit.py: a facebookresearch/DiT .pt -> our .safetensors -> a diffusers folder -> ours again, the
weights equal at every hop (bit for bit) and the reference's output reproduced from the converted file."""

import json
from dataclasses import replace

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

import scripts.convert_dit as convert_dit
from tests.test_dit_weights import CHECKPOINT, FLAVOR, REFERENCE_IO, TINY_REFERENCE
from torchtitan.models.dit import DiT, DiTArgs, dit_configs


@pytest.fixture
def tiny_flavor(monkeypatch):
    monkeypatch.setitem(dit_configs, FLAVOR, replace(TINY_REFERENCE, pos_embed="rope2d"))  # as a flavor would be


def test_pt_to_safetensors_to_diffusers_and_back(tiny_flavor, tmp_path, capsys):
    ours = tmp_path / "tiny.safetensors"
    assert convert_dit.main([str(CHECKPOINT), str(ours), "--flavor", FLAVOR]) == 0
    state = load_file(ours)
    with safe_open(str(ours), "pt") as f:
        args = DiTArgs(**json.loads(f.metadata()["model_args"]))
    assert args.pos_embed == "sincos" and args.dim == TINY_REFERENCE.dim
    model = DiT(args)
    model.init_weights()  # the position buffers
    model.load_state_dict(state, strict=True)
    io = load_file(REFERENCE_IO)
    with torch.no_grad():
        out = model.eval()(io["x"], io["t"], io["y"])
    assert (out - io["out_ema"]).abs().max().item() <= 1e-6  # the file's EMA, as the reference computes it

    folder = tmp_path / "pipeline"
    run = tmp_path / "run"  # a run folder: its config.toml and export, as the trainer leaves them
    run.mkdir()
    (run / "config.toml").write_text(f'[model]\nname = "dit"\nflavor = "{FLAVOR}"\npos_embed = "sincos"\n')
    (run / "ema.safetensors").write_bytes(ours.read_bytes())
    assert convert_dit.main([str(run), str(folder), "--to", "diffusers"]) == 0
    assert (folder / "transformer" / "config.json").is_file() and (folder / "scheduler").is_dir()
    back = tmp_path / "back.safetensors"
    assert convert_dit.main([str(folder), str(back)]) == 0
    again = load_file(back)
    assert state.keys() == again.keys() and all(torch.equal(state[k], again[k]) for k in state)

    # Nothing is overwritten; a missing source is one error line.
    assert convert_dit.main([str(CHECKPOINT), str(ours), "--flavor", FLAVOR]) == 2
    assert convert_dit.main([str(tmp_path / "missing.pt"), str(tmp_path / "x.safetensors")]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert errors[0] == f"error: DST: {ours} exists; nothing is overwritten"
    assert "missing.pt does not exist" in errors[1]
