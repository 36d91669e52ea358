"""Every shipped train_configs/*.toml is valid and trains two steps, through the same code paths at a tiny size,
with a sample grid and a checkpoint at the same step (CPU).

The tiny variant keeps each config's choices (objective, positions, norm, MLP, QK-norm, learned sigma, patch size,
compile, activation checkpointing, DP, EMA, tokenizer, gradient accumulation) and shrinks the rest: the debug
flavor's width and depth, a few tokens, local files made here in place of the datasets and tokenizers.
"""

import dataclasses
import tomllib
from pathlib import Path

import pytest
from safetensors.torch import load_file

from tests.conftest import ROOT, read_metrics, run_train
from tests.test_alignment import write_tiny_dinov2
from tests.test_cosmos_latent_decoder import make_image_folder, make_jit_tokenizer
from tests.test_latents import prepare_folder, write_cifar10
from torchtitan.config_manager import parse_args
from torchtitan.train_spec import build_model_args, get_train_spec

CONFIGS = sorted((ROOT / "train_configs").glob("*.toml"))
CLASSES = 3  # of the image folder the latents are prepared from


@pytest.fixture(scope="module")
def local_data(tmp_path_factory) -> dict[str, Path]:
    """Stand-ins for what the configs point at: CIFAR-10 batches, and latents of 16, 4 and 32 channels, prepared
    by tokenizers in folders named as the configs name theirs (the latents record it)."""
    root = tmp_path_factory.mktemp("data")
    images = make_image_folder(root / "images", classes=CLASSES)
    data = {"cifar10": write_cifar10(root / "cifar-10-batches-py", per_batch=4)}
    for channels, folder in ((16, "Cosmos-0.1-Tokenizer-CI8x8"), (4, "sd-vae")):
        make_jit_tokenizer(root / folder, channels=channels, downsample=4)
        # The 4-channel latents keep their images, which an [alignment] config's encoder sees (--store-images).
        assert prepare_folder(images, root / folder, root / f"latents{channels}", store_images=channels == 4)
        data[f"latents{channels}"], data[f"tokenizer{channels}"] = root / f"latents{channels}", root / folder
    # 32 channels (VA-VAE's) from a tiny diffusers AutoencoderKL, the kind scripts/convert_vavae.py writes.
    make_diffusers_vae(root / "vavae_diffusers", channels=32)
    assert prepare_folder(images, root / "vavae_diffusers", root / "latents32", kind="diffusers")
    data["latents32"], data["tokenizer32"] = root / "latents32", root / "vavae_diffusers"
    data["encoder"] = write_tiny_dinov2(root / "dinov2_vitb14_pretrain.pth", grid=37)  # [alignment]'s, 64 wide
    return data


def encoder_args(config: Path, data: dict[str, Path]) -> list[str]:
    """An [alignment] config's encoder replaced by the tiny one (its file is read when the config is)."""
    with open(config, "rb") as f:
        aligns = tomllib.load(f).get("alignment", {}).get("enable", False)
    return ["--alignment.encoder_path", str(data["encoder"])] if aligns else []


def make_diffusers_vae(folder: Path, channels: int) -> None:
    """A tiny random diffusers AutoencoderKL of downsample 4 (16 px images -> 4 x 4 latents)."""
    import torch
    from diffusers import AutoencoderKL

    torch.manual_seed(0)
    AutoencoderKL(block_out_channels=(8, 8, 8), down_block_types=("DownEncoderBlock2D",) * 3,
                  up_block_types=("UpDecoderBlock2D",) * 3, layers_per_block=1, latent_channels=channels,
                  norm_num_groups=4, sample_size=16).save_pretrained(str(folder))  # fmt: skip


def tiny_args(config: Path, data: dict[str, Path], dump_folder: Path) -> list[str]:
    cfg = parse_args(["--job.config_file", str(config), *encoder_args(config, data)])
    args = build_model_args(get_train_spec(cfg.model.name), cfg)
    if cfg.model.name == "llama3":  # the debug flavor on a few short windows; a validation at the last step
        return ["--job.config_file", str(config), "--job.dump_folder", str(dump_folder), "--model.flavor",
                "debugmodel", "--training.seq_len", "16", "--training.local_batch_size", "2", "--training.steps", "2",
                "--metrics.log_freq", "1", "--checkpoint.enable", "true", "--checkpoint.interval", "2",
                "--validation.enable", "true", "--validation.steps", "1"]  # fmt: skip
    keep = {name: getattr(args, name) for name in ("norm", "mlp", "qk_norm", "pos_embed", "learn_sigma", "patch_size",
                                                   "in_channels")}  # fmt: skip
    out = ["--job.config_file", str(config), "--job.dump_folder", str(dump_folder), "--model.flavor", "debug"]
    if cfg.alignment.enable:  # a block of the debug flavor's 4, a narrow projector
        out += [*encoder_args(config, data), "--alignment.depth", "2", "--alignment.projector_dim", "32"]
    out += [f"--model.{name}={str(v).lower() if isinstance(v, bool) else v}" for name, v in keep.items()]
    if cfg.training.dataset == "latents":
        latents = f"latents{args.in_channels}"
        out += ["--training.dataset_path", str(data[latents]), "--model.input_size", "4", "--model.num_classes",
                str(CLASSES)]  # fmt: skip
        if cfg.latent.tokenizer:
            out += ["--latent.checkpoint_dir", str(data[f"tokenizer{args.in_channels}"])]
    elif cfg.training.dataset == "cifar10":
        out += ["--training.dataset_path", str(data["cifar10"])]
    elif cfg.training.dataset == "dummy":
        out += ["--model.input_size", str(4 * args.patch_size)]
    accumulation = cfg.training.global_batch_size > 0  # kept: 2 micro-batches of 2
    out += ["--training.local_batch_size", "2", "--training.global_batch_size", "4" if accumulation else "-1"]
    out += ["--training.steps", "2", "--training.dataloader.num_workers", "0", "--metrics.log_freq", "1",
            "--sampling.freq", "2", "--sampling.num_samples", "2", "--sampling.steps", "2", "--checkpoint.enable",
            "true", "--checkpoint.interval", "2"]  # fmt: skip
    return out


def test_the_tiny_variant_keeps_each_config_s_choices(local_data, tmp_path):
    for config in CONFIGS:
        full = parse_args(["--job.config_file", str(config), *encoder_args(config, local_data)])
        tiny = parse_args(tiny_args(config, local_data, tmp_path))
        spec = get_train_spec(full.model.name)
        a, b = build_model_args(spec, full), build_model_args(spec, tiny)
        changed = {f.name for f in dataclasses.fields(a) if getattr(a, f.name) != getattr(b, f.name)}
        shape = {"dim", "depth", "num_heads", "input_size", "num_classes", "multiple_of"}  # DiT
        shape |= {"align_depth", "align_projector_dim"}  # REPA's block 8 of 28, 2048 wide: in the debug flavor
        shape |= {"n_layers", "n_heads", "n_kv_heads", "vocab_size", "ffn_dim", "rope_theta", "rope_scaling",
                  "max_seq_len", "tie_embeddings"}  # Llama 3: the flavor (debugmodel) # fmt: skip
        assert changed <= shape, (config.name, changed)
        for section in ("diffusion", "compile", "activation_checkpoint", "dp", "quantize", "parallelism"):
            assert getattr(full, section) == getattr(tiny, section), (config.name, section)
        assert (full.alignment.enable, full.alignment.coefficient) == (
            tiny.alignment.enable,
            tiny.alignment.coefficient,
        )


@pytest.mark.slow
@pytest.mark.parametrize("config", CONFIGS, ids=[c.stem for c in CONFIGS])
def test_every_shipped_config_trains_samples_and_checkpoints(local_data, tmp_path, config):
    out = tmp_path / "run"
    result = run_train(tiny_args(config, local_data, out), timeout=900)
    assert [m["step"] for m in read_metrics(out)] == [1, 2]
    assert (out / "checkpoint" / "step-2" / ".metadata").is_file()
    cfg = parse_args(["--job.config_file", str(config), *encoder_args(config, local_data)])
    if cfg.model.name == "llama3":  # no images: a validation record instead
        assert "validation_loss" in read_metrics(out, validation=True)[-1]
        assert "ERROR" not in result.stderr, result.stderr[-3000:]
        return
    images_are_latents = cfg.training.dataset == "latents" or cfg.model.in_channels not in (0, 1, 3)
    if images_are_latents and not cfg.latent.tokenizer:  # saved as latents, said once at the start
        assert "samples are saved as latents" in result.stderr
        assert load_file(out / "samples" / "step-2.safetensors")["latents"].shape[0] == 2
    else:
        assert (out / "samples" / "step-2.png").is_file()
    assert result.stderr.index("saved checkpoint") < result.stderr.index("wrote sample")  # the step's checkpoint first
    assert "ERROR" not in result.stderr, result.stderr[-3000:]


@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: p.stem)
def test_every_shipped_config_states_the_hardware_it_fits(config):
    """Its header says what it fits on ("# Fits: ..."), with the measured or estimated memory behind it."""
    header = config.read_text().split("[job]")[0]
    assert "# Fits: " in header, f"{config.name}: no '# Fits:' line before [job]"
