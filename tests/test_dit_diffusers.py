"""Our DiT to a diffusers DiTTransformer2DModel folder and back (torchtitan/models/dit/diffusers_adapter.py)."""

import dataclasses
import json
import re
from types import SimpleNamespace

import pytest
import torch

from torchtitan.diffusion.ddpm import GaussianDiffusion
from torchtitan.models.dit import DiT, DiTArgs
from torchtitan.models.dit.diffusers_adapter import (
    from_diffusers,
    read_diffusers_folder,
    read_diffusers_weights,
    save_diffusers_folder,
    scheduler_config,
    to_diffusers,
    use_reference_timestep_frequencies,
)
from torchtitan.models.dit.model import sincos_pos_embed_2d

diffusers = pytest.importorskip("diffusers")

TINY = DiTArgs(input_size=8, in_channels=3, patch_size=2, dim=32, depth=2, num_heads=4, num_classes=5,
               learn_sigma=True, pos_embed="sincos")  # fmt: skip


def tiny_dit(args: DiTArgs = TINY, seed: int = 0) -> DiT:
    """A tiny DiT whose every weight is random and non-zero: DiT's initialization plus noise, which breaks
    adaLN-Zero's and the final layer's zeros, so no mapping error hides behind a zero."""
    torch.manual_seed(seed)
    model = DiT(dataclasses.replace(args))
    model.init_weights()
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.1)
    return model.eval()


def inputs(args: DiTArgs = TINY, batch: int = 4):
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(batch, args.in_channels, args.input_size, args.input_size, generator=generator)
    t = torch.tensor([0, 17, 500, 999])[:batch]
    y = torch.tensor([0, 3, args.num_classes, 1])[:batch]  # the null class too
    return x, t, y


def test_export_matches_diffusers_dit(tmp_path):
    """Loaded by diffusers' own from_pretrained, the export computes our output to 1e-5 once its timestep
    projections use DiT's frequencies (k / half); measured 4.8e-7. Without that change diffusers divides by
    half - 1, and on this tiny model (outputs up to 2.1) the output differs by up to 0.59 (at t = 999; 1.2e-2 at
    t = 17, none at t = 0, where every frequency gives cos 1, sin 0): diffusers 0.42.1, CPU, fp32."""
    model = tiny_dit()
    folder = save_diffusers_folder(model.state_dict(), model.args, tmp_path / "dit")
    transformer = diffusers.DiTTransformer2DModel.from_pretrained(str(folder), subfolder="transformer").eval()
    # diffusers computes its sin-cos table itself: for sample_size = input_size it is ours.
    table = sincos_pos_embed_2d(TINY.dim, TINY.input_size // TINY.patch_size)
    torch.testing.assert_close(transformer.pos_embed.pos_embed[0], table, rtol=0, atol=1e-7)
    x, t, y = inputs()
    with torch.no_grad():
        ours = model(x, t, y)
        as_shipped = transformer(x, timestep=t, class_labels=y).sample
        assert use_reference_timestep_frequencies(transformer) == TINY.depth  # one Timesteps per block
        theirs = transformer(x, timestep=t, class_labels=y).sample
    assert theirs.shape == ours.shape == (4, 2 * TINY.in_channels, TINY.input_size, TINY.input_size)
    gap = (as_shipped - ours).abs().max().item()
    print(f"max |diffusers - ours| with diffusers' downscale_freq_shift=1: {gap:.3g}")
    assert 1e-3 < gap < 1.0, f"the frequency shift should show, and only it: max difference {gap:.3g}"
    torch.testing.assert_close(theirs, ours, rtol=0, atol=1e-5)
    # And what diffusers itself writes reads back as our weights.
    transformer.save_pretrained(str(tmp_path / "saved"))
    back, args = read_diffusers_folder(tmp_path / "saved")
    assert args == model.args and all(torch.equal(back[key], value) for key, value in model.state_dict().items())


def test_import_reads_diffusers_default_norm_eps_as_dits():
    """A config without norm_eps (diffusers' default 1e-5, on the norm before each MLP only) is read with DiT's 1e-6,
    and says so."""
    model = tiny_dit()
    weights, config = to_diffusers(model.state_dict(), model.args)
    del config["norm_eps"]
    with pytest.warns(UserWarning, match="norm_eps=1e-05"):
        _, args = from_diffusers(weights, config)
    assert args.norm_eps == 1e-6


def test_round_trip_is_bit_for_bit(tmp_path):
    model = tiny_dit(dataclasses.replace(TINY, learn_sigma=False))
    for dtype in (torch.float32, torch.bfloat16):
        state_dict = {key: value.to(dtype) for key, value in model.state_dict().items()}
        save_diffusers_folder(state_dict, model.args, tmp_path / str(dtype))
        back, args = read_diffusers_folder(tmp_path / str(dtype))
        assert args == model.args
        assert back.keys() == state_dict.keys()
        for key, value in state_dict.items():
            assert back[key].dtype == dtype and torch.equal(back[key], value), key
    config = json.loads((tmp_path / "torch.float32" / "transformer" / "config.json").read_text())
    assert config["out_channels"] == TINY.in_channels and config["norm_eps"] == 1e-6
    # checkpoint.initial_load_format = "diffusers": the same weights, for a model of the folder's args only.
    weights = read_diffusers_weights(tmp_path / "torch.float32", model.args)
    assert all(torch.equal(weights[key], value) for key, value in model.state_dict().items())
    other = dataclasses.replace(model.args, depth=3, pos_embed="rope2d")
    with pytest.raises(ValueError, match=r"model.depth = 3 \(the folder's: 2\); model.pos_embed = 'rope2d' \(the "
                                         r"folder's: 'sincos'\)"):  # fmt: skip
        read_diffusers_weights(tmp_path / "torch.float32", other)


def test_import_refuses_blocks_with_their_own_embedders():
    model = tiny_dit()
    weights, config = to_diffusers(model.state_dict(), model.args)
    key = "transformer_blocks.1.norm1.emb.class_embedder.embedding_table.weight"
    weights[key] = weights[key] + 1e-3
    with pytest.raises(ValueError, match=f"block 1 .*{re.escape(key)}"):
        from_diffusers(weights, config)


def test_mismatched_shapes_are_refused_by_name():
    model = tiny_dit()
    with pytest.raises(ValueError, match=r"final_layer\.linear\.weight has shape"):
        to_diffusers(model.state_dict(), dataclasses.replace(TINY, learn_sigma=False))
    weights, config = to_diffusers(model.state_dict(), model.args)
    with pytest.raises(ValueError, match=r"y_embedder\.embedding_table\.weight has shape"):
        from_diffusers(weights, {**config, "num_embeds_ada_norm": 7})


@pytest.mark.parametrize(
    "field, value",
    [("pos_embed", "rope2d"), ("pos_embed", "learned"), ("norm", "rmsnorm"), ("mlp", "swiglu"), ("qk_norm", True),
     ("attn_window", 1), ("num_classes", 0), ("mlp_ratio", 2.0)],
)  # fmt: skip
def test_export_refuses_what_diffusers_cannot_express(field, value):
    args = dataclasses.replace(TINY, **{field: value})
    with pytest.raises(ValueError, match=rf"{field}={value!r}"):
        to_diffusers(DiT(args).state_dict(), args)


def test_export_refuses_rectified_flow(tmp_path):
    model = tiny_dit()
    with pytest.raises(ValueError, match="objective='rectified_flow'"):
        save_diffusers_folder(model.state_dict(), model.args, tmp_path / "dit", objective="rectified_flow")
    assert not (tmp_path / "dit").exists()  # checked before anything is written


@pytest.mark.parametrize("schedule, steps", [("linear", 1000), ("linear", 250), ("cosine", 1000)])
def test_scheduler_betas_are_our_ddpm_schedule(schedule, steps):
    ours = GaussianDiffusion(steps, schedule).table["betas"]
    for name in ("ddpm", "ddim"):
        config = scheduler_config(name, noise_schedule=schedule, num_timesteps=steps)
        scheduler = getattr(diffusers, config["_class_name"]).from_config(config)
        torch.testing.assert_close(scheduler.betas.double(), ours, rtol=1e-6, atol=1e-9)
        scheduler.set_timesteps(50)
        if name == "ddpm":  # DDPM steps along our DDIM sampler's timesteps
            assert scheduler.timesteps.tolist() == torch.linspace(steps - 1, 0, 50).round().long().tolist()
        else:  # DDIM steps t -> t - T // 50: its timesteps must be that far apart, from T - 1
            assert scheduler.timesteps.tolist() == list(range(steps - 1, -1, -(steps // 50)))


def test_dit_pipeline_samples_as_our_ddim(tmp_path):
    """DiTPipeline loads the folder (with a VAE passed in) and, in one DDIM step (the one step count where its
    timesteps are ours, short of T), makes our sampler's latents: betas, pipeline wiring and the learned-sigma split
    agree. The VAE's decode is replaced by one that keeps the latents: its GroupNorms would hide a scale error."""
    model = tiny_dit()
    folder = save_diffusers_folder(model.state_dict(), model.args, tmp_path / "dit", scheduler="ddim")
    vae = diffusers.AutoencoderKL(block_out_channels=(8,), down_block_types=("DownEncoderBlock2D",),
                                  up_block_types=("UpDecoderBlock2D",), layers_per_block=1,
                                  latent_channels=TINY.in_channels, norm_num_groups=4, sample_size=8)  # fmt: skip
    decoded = []
    vae.decode = lambda z: decoded.append(z) or SimpleNamespace(sample=torch.zeros_like(z))
    pipe = diffusers.DiTPipeline.from_pretrained(str(folder), vae=vae)
    assert isinstance(pipe.scheduler, diffusers.DDIMScheduler) and pipe.scheduler.config.clip_sample is False
    use_reference_timestep_frequencies(pipe.transformer)
    pipe.set_progress_bar_config(disable=True)
    labels = [0, 3]
    pipe(labels, guidance_scale=1.0, generator=torch.manual_seed(7), num_inference_steps=1, output_type="pt")
    theirs = decoded[0] * vae.config.scaling_factor
    noise = torch.randn(2, TINY.in_channels, TINY.input_size, TINY.input_size, generator=torch.manual_seed(7))
    with torch.no_grad():
        ours = GaussianDiffusion(1000, "linear", learn_sigma=True).ddim_sample(model, noise, torch.tensor(labels), 1)
    # One step from t = 999 divides by sqrt(alpha_bar) = 0.0064: latents of a few hundred, compared relatively.
    gap = ((theirs - ours).abs().max() / ours.abs().max()).item()
    assert gap < 1e-6, f"relative gap {gap:.3g}"
