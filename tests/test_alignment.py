"""Representation alignment (torchtitan/alignment/): the DINOv2 encoder against facebookresearch/dinov2 as REPA runs
it (committed features, tests/data/repa_reference/) and against transformers' Dinov2Model (random weights), the
per-sample loss in closed form, HASTE's stop, and DP-SGD's per-sample gradients with the projectors.

SiLoss's losses and gradients on REPA's own checkpoint: tests/test_repa_weights.py.
"""

import copy
import json
import os
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from torchtitan.alignment import RepresentationAlignment, alignment_losses
from torchtitan.alignment.dinov2_weights import dinov2_architecture, dinov2_sha256, read_dinov2, resample_positions
from torchtitan.alignment.encoder import FrozenEncoder
from torchtitan.alignment.vit import VisionTransformer, ViTArgs
from torchtitan.tools import safe_pickle

DATA = Path(__file__).parent / "data" / "repa_reference"
ENCODER = DATA / "tiny_dinov2_reg.pth"
REFERENCE_IO = DATA / "tiny_repa_reference_io.safetensors"


def write_tiny_dinov2(path: Path, dim: int = 64, depth: int = 1, grid: int = 6, registers: int = 0,
                      seed: int = 0) -> Path:  # fmt: skip
    """A random DINOv2 state dict in the official .pth's names (its mask token too), for runs that align on CPU."""
    torch.manual_seed(seed)
    model = VisionTransformer(ViTArgs(dim=dim, depth=depth, num_heads=dim // 64, grid=grid, mlp_ratio=1.0,
                                      num_register_tokens=registers))  # fmt: skip
    state = {name: 0.2 * torch.randn_like(tensor) for name, tensor in model.state_dict().items()}
    state["mask_token"] = torch.zeros(1, dim)
    torch.save(state, path)
    return path


def _reference_images() -> torch.Tensor:
    """The committed uint8 images enlarged 8x by nearest neighbours (256 px, as REPA saw them), in [-1, 1]."""
    small = load_file(REFERENCE_IO)["images"]
    return small.repeat_interleave(8, 2).repeat_interleave(8, 3).float() / 127.5 - 1


def test_encoder_reproduces_repas_dinov2_features():
    """facebookresearch/dinov2's DinoVisionTransformer (4 registers) on REPA's preprocessing (x / 255, ImageNet
    normalization, bicubic to 224 px) with its 20 x 20 table resampled to 16 x 16 by timm (antialiased), recorded
    when the data was made: ours from the official .pth gives the same x_norm_patchtokens (fp32, CPU). The gap is
    the float rounding of x / 127.5 - 1 against x / 255 through the bicubic resize (features of magnitude ~4)."""
    args, state = read_dinov2(ENCODER, grid=16)
    assert (args.dim, args.depth, args.num_heads, args.num_register_tokens, args.image_size) == (64, 1, 1, 4, 224)
    features = FrozenEncoder(args, state)(_reference_images())
    expected = load_file(REFERENCE_IO)["zs"]
    assert features.shape == expected.shape == (2, 256, 64)
    assert (features - expected).abs().max().item() <= 1e-5


def test_position_table_resampling_is_antialiased_bicubic():
    table = torch.randn(1, 1 + 20 * 20, 8)
    out = resample_positions(table, 16)
    assert out.shape == (1, 257, 8) and torch.equal(out[:, 0], table[:, 0])
    plain = torch.nn.functional.interpolate(table[:, 1:].reshape(1, 20, 20, 8).permute(0, 3, 1, 2), size=(16, 16),
                                            mode="bicubic")  # fmt: skip
    assert (out[:, 1:] - plain.permute(0, 2, 3, 1).reshape(1, 256, 8)).abs().max() > 1e-3  # antialiasing matters
    assert resample_positions(table, 20) is table


def _hf_model(swiglu: bool, registers: int, grid: int = 4):
    transformers = pytest.importorskip("transformers")
    kwargs = dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=2, image_size=14 * grid, patch_size=14,
                  use_swiglu_ffn=swiglu, layerscale_value=0.7)  # fmt: skip
    if registers:
        config = transformers.Dinov2WithRegistersConfig(num_register_tokens=registers, **kwargs)
        model = transformers.Dinov2WithRegistersModel(config)
    else:
        model = transformers.Dinov2Model(transformers.Dinov2Config(**kwargs))
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))  # LayerScale, tokens and biases off their init
    return model.eval()


@pytest.mark.parametrize("swiglu, registers", [(False, 0), (True, 0), (False, 4)])
def test_hugging_face_folder_equals_transformers_dinov2(tmp_path, swiglu, registers):
    """A Dinov2Model (or Dinov2WithRegistersModel) folder as transformers saves it, read without transformers: our
    patch tokens equal its last_hidden_state's (random weights, fp32, at its own size: no interpolation); its weights'
    hash (what stored features record) is that of the same weights in an official .pth."""
    model = _hf_model(swiglu, registers)
    model.save_pretrained(tmp_path / "hf")
    args, state = read_dinov2(tmp_path / "hf", grid=4)
    assert (args.mlp, args.num_register_tokens, args.num_heads) == ("swiglu" if swiglu else "gelu", registers, 2)
    assert dinov2_architecture(tmp_path / "hf", 4) == args
    vit = VisionTransformer(args)
    vit.load_state_dict(state, strict=True)
    x = torch.randn(2, 3, 56, 56)
    with torch.no_grad():
        ours = vit.forward_features(x)["x_norm_patchtokens"]
        theirs = model(pixel_values=x).last_hidden_state[:, 1 + registers :]
    assert (ours - theirs).abs().max().item() <= 1e-5
    torch.save(state, tmp_path / "official.pth")  # the same network in the official format: the same identity
    assert dinov2_sha256(tmp_path / "official.pth") == dinov2_sha256(tmp_path / "hf")


def test_official_pth_and_its_architecture(tmp_path):
    path = write_tiny_dinov2(tmp_path / "dinov2_vitb14_pretrain.pth", dim=128, depth=2, grid=5, registers=4)
    args = dinov2_architecture(path, 3)
    assert args == ViTArgs(dim=128, depth=2, num_heads=2, grid=3, mlp_ratio=1.0, num_register_tokens=4)
    args, state = read_dinov2(path, 3)
    assert "mask_token" not in state and state["pos_embed"].shape == (1, 10, 128)


def test_bad_files_are_refused_by_name(tmp_path):
    with pytest.raises(FileNotFoundError, match="missing.pth does not exist"):
        read_dinov2(tmp_path / "missing.pth", 16)
    torch.save({"weight": torch.zeros(2)}, tmp_path / "other.pth")
    with pytest.raises(ValueError, match=r"other.pth: no cls_token / patch_embed.proj.weight: not a DINOv2"):
        read_dinov2(tmp_path / "other.pth", 16)
    (tmp_path / "junk.pth").write_bytes(b"not a torch file")
    with pytest.raises(ValueError, match=r"junk.pth: not a readable torch.save file"):
        read_dinov2(tmp_path / "junk.pth", 16)

    class RunsCode:
        def __reduce__(self):
            return os.system, ("true",)

    torch.save({"cls_token": RunsCode()}, tmp_path / "crafted.pth")
    with pytest.raises(safe_pickle.UnsafePickleError, match=r"crafted.pth refers to .*system, which a DINOv2"):
        read_dinov2(tmp_path / "crafted.pth", 16)
    (tmp_path / "folder").mkdir()
    (tmp_path / "folder" / "config.json").write_text(json.dumps({"model_type": "vit"}))
    with pytest.raises(ValueError, match=r"model_type 'vit', not a DINOv2"):
        read_dinov2(tmp_path / "folder", 16)


def test_preprocessing_is_repas():
    """[-1, 1] images -> [0, 1], ImageNet's mean and std, bicubic to patch x grid; grey repeated to RGB."""
    args = ViTArgs(dim=64, depth=1, num_heads=1, grid=2)
    encoder = FrozenEncoder(args, VisionTransformer(args).state_dict())
    grey = torch.full((1, 1, 8, 8), 0.5)  # 0.75 in [0, 1]
    out = encoder.preprocess(grey)
    assert out.shape == (1, 3, 28, 28)
    expected = (0.75 - torch.tensor([0.485, 0.456, 0.406])) / torch.tensor([0.229, 0.224, 0.225])
    torch.testing.assert_close(out[0, :, 5, 7], expected, rtol=1e-6, atol=1e-6)
    assert not any(p.requires_grad for p in encoder.parameters()) and not encoder.train().training


def test_alignment_loss_in_closed_form():
    """-cos per token, averaged over the tokens, then the encoders; the widths of each side are free."""
    a = torch.tensor([[[1.0, 0.0], [0.0, 2.0]], [[3.0, 3.0], [1.0, 0.0]]])  # (B=2, T=2, 2)
    z = torch.tensor([[[5.0, 0.0], [1.0, 0.0]], [[-1.0, -1.0], [1.0, 1.0]]])
    expected = torch.tensor([(-1.0 + 0.0) / 2, (1.0 - 2**-0.5) / 2])
    torch.testing.assert_close(alignment_losses([a], [z]), expected)
    torch.testing.assert_close(alignment_losses([a, a], [z, -z]), torch.zeros(2))  # averaged over encoders


def test_stopped_alignment_adds_zero_but_keeps_the_projectors_in_the_graph():
    alignment = RepresentationAlignment(None, coefficient=0.5, stop_step=10)
    assert alignment.active(9) and not alignment.active(10) and RepresentationAlignment(None, 0.5).active(10**9)
    projected = [torch.randn(3, 4, 5, requires_grad=True)]
    added, logged = alignment.losses(projected, None)
    assert logged is None and torch.equal(added, torch.zeros(3))
    added.sum().backward()
    assert torch.equal(projected[0].grad, torch.zeros(3, 4, 5))  # a gradient (of zeros) reaches the projector
    added, logged = alignment.losses(projected, [torch.randn(3, 4, 5)])
    torch.testing.assert_close(added, 0.5 * logged)


def test_dp_sgd_clips_the_aligned_per_sample_gradients():
    """The debug DiT with projectors, each sample's loss its denoising term plus its alignment term: DP-SGD's
    clipped gradients (ghost and book-keeping) equal torch.func's per-sample ones, the projectors' included."""
    from torchtitan.dp import DPEngine
    from torchtitan.dp.testing import clipped_mean, per_sample_grads
    from torchtitan.models.dit import DiT, dit_configs

    torch.manual_seed(0)
    dit = DiT(replace(dit_configs["debug"], input_size=8, align_depth=2, align_dims=(24,), align_projector_dim=16))
    dit.init_weights()
    with torch.no_grad():
        for p in dit.parameters():
            p.add_(0.02 * torch.randn_like(p))

    class Aligned(torch.nn.Module):
        def __init__(self, model):
            super().__init__()
            self.model = model

        def forward(self, x, t, y, z):
            out, projected = self.model(x, t, y, aligned=True)
            return (out - x).square().mean((1, 2, 3)) + 0.5 * alignment_losses(projected, [z])

    g = torch.Generator().manual_seed(1)
    batch = (torch.randn(4, 1, 8, 8, generator=g), torch.rand(4, generator=g) * 1000, torch.arange(4),
             torch.randn(4, 16, 24, generator=g))  # fmt: skip
    grads = per_sample_grads(Aligned(dit), lambda losses, *b: losses, *batch)
    grads = {name.removeprefix("model."): grad for name, grad in grads.items()}
    assert grads["projectors.0.4.weight"].abs().max() > 0
    max_norm = torch.cat([g.flatten(1) for g in grads.values()], 1).norm(dim=1).median().item()
    clipped, norms = clipped_mean(grads, max_norm)
    for mode in ("ghost", "bookkeeping"):
        model = copy.deepcopy(dit)
        engine = DPEngine(model, mode, max_norm, 0.0)
        torch.testing.assert_close(engine.backward(Aligned(model)(*batch)), norms, rtol=1e-4, atol=0)
        for name, p in model.named_parameters():
            err = ((p.grad - clipped[name]).norm() / clipped[name].norm()).item()
            assert err < 1e-4, f"{mode} {name}: {err:.2e}"


def test_latents_prepared_with_their_images(tmp_path):
    """prepare --store-images keeps each image (uint8, as the tokenizer saw it) beside its latents; the dataset hands
    them on with the latent they encode (the mirrored one with the mirrored latent); a folder without them is
    refused for alignment, naming the flag."""
    from tests.test_cosmos_latent_decoder import make_image_folder, make_jit_tokenizer
    from tests.test_latents import prepare_folder
    from torchtitan.datasets.imagefolder import ImageFolderDataset
    from torchtitan.datasets.latents import LatentShardDataset
    from torchtitan.datasets.prefetch import LatentsAndImages, batch_to_device

    images = make_image_folder(tmp_path / "images", classes=2, per_class=3)
    make_jit_tokenizer(tmp_path / "tok", channels=4, downsample=4)
    assert prepare_folder(images, tmp_path / "tok", tmp_path / "with", store_images=True)
    assert prepare_folder(images, tmp_path / "tok", tmp_path / "without")
    source = ImageFolderDataset(str(images), 16, random_flip=False)
    dataset = LatentShardDataset(tmp_path / "with", images=True, random_flip=False)
    (latent, image), label = dataset[4]
    assert image.dtype == torch.uint8 and torch.equal(image, source[4][0]) and label == source[4][1]
    assert torch.equal(latent, LatentShardDataset(tmp_path / "without", random_flip=False)[4][0])
    torch.manual_seed(0)
    flipping = LatentShardDataset(tmp_path / "with", images=True)
    seen = set()
    for _ in range(8):
        (latent, image), _ = flipping[4]
        flipped = not torch.equal(image, source[4][0])
        assert torch.equal(image, source[4][0].flip(-1) if flipped else source[4][0])
        assert torch.equal(latent, dataset.normalization.normalize(dataset.raw(4)[int(flipped)].float()))
        seen.add(flipped)
    assert seen == {False, True}
    batch = batch_to_device((LatentsAndImages(latent[None], image[None]), torch.tensor([1])), torch.device("cpu"))
    assert batch[0].images.dtype == torch.float32 and batch[0].images.min() >= -1
    with pytest.raises(ValueError, match=r"without holds no images beside its latents.*--store-images"):
        LatentShardDataset(tmp_path / "without", images=True)


def test_debug_model_aligns_on_cpu_stops_and_exports_without_projectors(tmp_path):
    """train_configs/debug_model.toml with a tiny generated DINOv2 (2 steps, HASTE's stop after the first): the
    first step logs loss/alignment and the second does not; the checkpoint holds the projectors in the model and its
    EMA, and ema.safetensors, for sampling, does not."""
    from tests.conftest import TINY, read_metrics, run_train
    from torchtitan.components.checkpoint_reader import read_checkpoint_metadata

    encoder = write_tiny_dinov2(tmp_path / "dinov2_vits14_pretrain.pth", grid=37)
    out = tmp_path / "run"
    run_train([*TINY, "--job.dump_folder", str(out), "--alignment.enable", "true", "--alignment.encoder_path",
               str(encoder), "--alignment.depth", "2", "--alignment.projector_dim", "32", "--alignment.stop_step",
               "1", "--training.steps", "2", "--training.local_batch_size", "4", "--checkpoint.enable", "true",
               "--checkpoint.interval", "2"])  # fmt: skip
    records = read_metrics(out)
    assert "loss/alignment" in records[0] and "loss/alignment" not in records[1]
    assert -1 <= records[0]["loss/alignment"] <= 1
    keys = read_checkpoint_metadata(out / "checkpoint" / "step-2").state_dict_metadata
    assert "model.projectors.0.4.weight" in keys and "ema.projectors.0.4.weight" in keys
    export = load_file(out / "ema.safetensors")
    assert export and not any(name.startswith("projectors.") for name in export)
    from torchtitan.models.dit.weights import load_model, resolve_checkpoint

    for source in (out, out / "checkpoint" / "step-2"):  # the export, and the DCP checkpoint's EMA: no encoder needed
        encoder.unlink(missing_ok=True)
        model, args = load_model(*resolve_checkpoint(source), torch.device("cpu"))
        assert model.projectors is None and args.align_depth == 0


# Stored features (prepare.py --store-features): 6 images of 16 px, 4 x 4 latents of 4 channels, the debug DiT's
# patch 2: a 2 x 2 token grid, the encoder at 28 px.
FEATURE_DTYPES = {"float32": 0.0, "float16": 2.0**-11, "bfloat16": 2.0**-8}  # each dtype's unit roundoff


@pytest.fixture(scope="module")
def aligned_latents(tmp_path_factory) -> dict[str, Path]:
    """Latents prepared with their images and the tiny encoder's features in each storage dtype; with images alone."""
    from tests.test_cosmos_latent_decoder import make_image_folder, make_jit_tokenizer
    from tests.test_latents import prepare_folder

    root = tmp_path_factory.mktemp("aligned")
    images = make_image_folder(root / "images", classes=2, per_class=3)
    make_jit_tokenizer(root / "tok", channels=4, downsample=4)
    data = {"encoder": write_tiny_dinov2(root / "dinov2_vits14_pretrain.pth", grid=37), "tok": root / "tok"}
    for dtype in [*FEATURE_DTYPES, "images"]:
        features = {} if dtype == "images" else {"store_features": str(data["encoder"]), "features_dtype": dtype}
        assert prepare_folder(images, root / "tok", root / dtype, store_images=True, **features)
        data[dtype] = root / dtype
    return data


def _aligning_args(data: dict, folder: str, *extra: str) -> list[str]:
    """The debug config aligning on the latents of `folder` (a block of its 4, a narrow projector)."""
    from tests.conftest import TINY

    return [*TINY, "--training.dataset", "latents", "--training.dataset_path", str(data[folder]),
            "--model.in_channels", "4", "--model.input_size", "4", "--model.num_classes", "2",
            "--alignment.enable", "true", "--alignment.encoder_path", str(data["encoder"]), "--alignment.depth", "2",
            "--alignment.projector_dim", "16", "--training.local_batch_size", "2",
            "--training.dataloader.num_workers", "0", *extra]  # fmt: skip


def test_prepared_features_are_the_encoders_of_each_view(aligned_latents):
    """prepare --store-features keeps the encoder's features of each view, computed from the uint8 image
    --store-images keeps: the dataset hands on those of the view its latent is, equal to what the encoder computes on
    the fly from that view's image (float32 stored: 1e-5, the float noise of another batch's matmuls). A mirror's
    features are not the token grid of the image's mirrored (a ViT's patch embedding and position table are not
    symmetric), so both are stored: T x D values a view, 2 x 4 x 64 x 4 bytes an image here."""
    from safetensors import safe_open

    from torchtitan.alignment.dinov2_weights import dinov2_sha256
    from torchtitan.datasets.latents import LatentShardDataset, read_meta
    from torchtitan.datasets.prefetch import images_to_float

    folder = aligned_latents["float32"]
    record = read_meta(folder)["features"]
    assert record == {"encoder": "dinov2", "encoder_file": "dinov2_vits14_pretrain.pth", "dim": 64, "depth": 1,
                      "encoder_sha256": dinov2_sha256(aligned_latents["encoder"]), "grid": 2, "image_size": 28,
                      "compute_dtype": "float32", "dtype": "float32"}  # fmt: skip
    encoder = FrozenEncoder(*read_dinov2(aligned_latents["encoder"], 2))
    with_images = LatentShardDataset(folder, images=True)
    with_features = LatentShardDataset(folder, features=True)
    views = set()
    for index in range(len(with_features)):
        for seed in (0, 1, 2):
            torch.manual_seed(seed)
            (latent, image), _ = with_images[index]
            torch.manual_seed(seed)  # the same view drawn
            (same_latent, features), _ = with_features[index]
            assert torch.equal(latent, same_latent) and features.dtype == torch.float32
            torch.testing.assert_close(features, encoder(images_to_float(image[None]))[0], rtol=0, atol=1e-5)
            views.add(
                int(not torch.equal(latent, with_images.normalization.normalize(with_images.raw(index)[0].float())))
            )
    assert views == {0, 1}
    with safe_open(str(folder / "shard-00000.safetensors"), "pt") as f:
        stored = f.get_tensor("features")  # (n, V, T, D)
    assert stored.shape == (5, 2, 4, 64) and stored.nbytes == 5 * 2 * 4 * 64 * 4
    grid_mirrored = stored[:, 0].view(5, 2, 2, 64).flip(2).reshape(5, 4, 64)
    assert (stored[:, 1] - grid_mirrored).abs().max() > 0.1


@pytest.mark.parametrize("dtype", FEATURE_DTYPES)
def test_stored_features_give_the_on_the_fly_losses_and_gradients(aligned_latents, dtype):
    """The objective on latents with their stored features (the encoder never runs) against the same latents with
    their images through the encoder: the same per-sample losses (B, K) and alignment losses, and the same gradient
    for every parameter, the projector's included; under dp.augmult's K = 2 draws, the second micro-batch of two, with
    flipped views in the batch. Tolerances by the stored dtype's unit roundoff u (0 for float32, 2^-11 float16, 2^-8
    bfloat16): the cosine of a token moves by at most 2u, so each alignment loss by 2u (+ 1e-5 of float noise); each
    gradient by 4u of its norm (its alignment share moves by 2u / sin(projection, feature), near 1 here)."""
    from torch.utils.data import default_collate

    from torchtitan.datasets.latents import LatentShardDataset
    from torchtitan.datasets.prefetch import batch_to_device
    from torchtitan.diffusion.objective import DiffusionObjective
    from torchtitan.job_config import Diffusion
    from torchtitan.models.dit import DiT, dit_configs
    from torchtitan.protocols import BatchLayout

    cpu = torch.device("cpu")
    args = replace(dit_configs["debug"], in_channels=4, input_size=4, num_classes=2, align_depth=2, align_dims=(64,),
                   align_projector_dim=16)  # fmt: skip
    torch.manual_seed(0)
    model = DiT(args)
    model.init_weights()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))  # zero-inits broken: nothing hides behind a zero
    encoder = FrozenEncoder(*read_dinov2(aligned_latents["encoder"], 2))
    layout = BatchLayout(0, 1, 2, 2, 0, cpu)  # 2 micro-batches of accumulation, K = 2 draws a sample
    results = []
    for stored, alignment in (
        (False, RepresentationAlignment(encoder, 0.5)),
        (True, RepresentationAlignment(None, 0.5)),
    ):
        dataset = LatentShardDataset(aligned_latents[dtype], images=not stored, features=stored)
        torch.manual_seed(3)  # the same views for both
        x, y = batch_to_device(default_collate([dataset[i] for i in range(6)]), cpu)
        objective = DiffusionObjective(Diffusion(objective="rectified_flow", prediction="velocity"), args, layout,
                                       alignment)  # fmt: skip
        model.zero_grad()
        losses = objective.losses(model, x, y, step=0, micro=1)
        losses.sum().backward()
        results.append((losses.detach(), objective.take_alignment(), {n: p.grad.clone() for n, p in
                                                                      model.named_parameters()}))  # fmt: skip
    (losses, alignment, grads), (stored_losses, stored_alignment, stored_grads) = results
    u = FEATURE_DTYPES[dtype]
    assert losses.shape == (6, 2) and alignment.shape == (12,)
    torch.testing.assert_close(stored_alignment, alignment, rtol=0, atol=2 * u + 1e-5)
    torch.testing.assert_close(stored_losses, losses, rtol=0, atol=0.5 * 2 * u + 1e-5)  # coefficient 0.5
    for name, grad in grads.items():
        assert grad.norm() > 0, name
        assert (stored_grads[name] - grad).norm() <= (4 * u + 1e-5) * grad.norm(), name


def test_stored_features_are_read_and_the_encoder_never_built(aligned_latents, monkeypatch):
    """alignment.features 'auto' on latents prepared with features: the loader hands them on (float16, as stored),
    the objective aligns to them with no encoder (building one fails here), and the FLOPs count no encoder forward.
    'encoder' builds it and feeds it the stored images; the dummy data with 'stored' makes random features."""
    import torchtitan.alignment.encoder as encoder_module
    from torchtitan.config_manager import parse_args
    from torchtitan.datasets.prefetch import LatentsAndFeatures, LatentsAndImages, batch_to_device
    from torchtitan.models.dit import DiT, flops_per_image
    from torchtitan.protocols import BatchLayout
    from torchtitan.train_spec import build_model_args, get_train_spec

    spec, layout = get_train_spec("dit"), BatchLayout(0, 1, 1, 1, 0, torch.device("cpu"))

    def build(*extra: str):
        cfg = parse_args(_aligning_args(aligned_latents, "float16", *extra))
        args = build_model_args(spec, cfg)
        loader = spec.build_dataloader_fn(cfg, args, 0, 1, 0, "train")
        return cfg, args, spec.build_objective_fn(cfg, args, layout), next(loader)

    cfg, args, objective, (x, y) = build("--alignment.features", "encoder")
    assert isinstance(objective.alignment.encoder, FrozenEncoder) and isinstance(x, LatentsAndImages)
    encoder_flops = read_dinov2(aligned_latents["encoder"], 2)[0].forward_flops()
    assert spec.flops_per_sample_fn(args, cfg) == flops_per_image(args) + encoder_flops

    def refused(*_args, **_kwargs):
        raise AssertionError("the encoder was built")

    monkeypatch.setattr(encoder_module, "build_encoder", refused)
    monkeypatch.setattr(FrozenEncoder, "forward", refused)
    cfg, args, objective, (x, y) = build()  # alignment.features = "auto"
    assert objective.alignment.encoder is None and cfg.alignment.features == "auto"
    assert isinstance(x, LatentsAndFeatures) and x.features.dtype == torch.float16 and x.features.shape == (2, 4, 64)
    assert spec.flops_per_sample_fn(args, cfg) == flops_per_image(args)
    model = DiT(args)
    model.init_weights()
    objective.losses(model, *batch_to_device((x, y), torch.device("cpu")), step=0, micro=0).sum().backward()
    assert objective.take_alignment().shape == (2,) and model.projectors[0][4].weight.grad.abs().max() > 0
    cfg, args, objective, (x, y) = build("--training.dataset", "dummy", "--alignment.features", "stored")
    assert objective.alignment.encoder is None and x.features.dtype == torch.float16 and x.features.shape == (2, 4, 64)


def test_features_of_another_encoder_or_grid_are_refused(aligned_latents, tmp_path, capsys):
    """Stored features that are not what the run's encoder computes at its DiT's token grid are refused at the config,
    one `error:` line naming the key at fault and the meta.json; so is 'stored' without features, and a resumed
    preparation with another encoder. The same weights under another file name are the same encoder."""
    import shutil

    import train
    from tests.test_latents import prepare_folder
    from torchtitan.config_manager import ConfigError, parse_args

    meta = aligned_latents["float16"] / "meta.json"
    other = write_tiny_dinov2(tmp_path / "dinov2_other.pth", grid=37, seed=1)
    for extra, message in (
        (["--alignment.encoder_path", str(other)],
         rf"alignment.encoder_path = '{other}' in the command line: {meta} holds encoder features this run cannot "
         r"align to: they are the features of 'dinov2_vits14_pretrain.pth' \(DINOv2 64 wide, 1 blocks, sha256 .*\), "
         rf"this run's encoder '{other}' has sha256 .*--store-features {other} --features-patch-size 2; or set "
         r"alignment.features = 'encoder' to encode its stored images"),
        (["--model.patch_size", "1"], rf"model.patch_size = 1 in the command line: {meta} .*: they are 2 x 2 tokens "
         r"\(28 px into the encoder\), this run's DiT has 4 x 4"),
    ):  # fmt: skip
        with pytest.raises(ConfigError, match=message):
            parse_args(_aligning_args(aligned_latents, "float16", *extra))
    assert train.main(_aligning_args(aligned_latents, "float16", "--alignment.encoder_path", str(other))) == 2
    err = capsys.readouterr().err
    assert err.count("error: ") == 1 and "error: alignment.encoder_path" in err and "Traceback" not in err
    assert parse_args(_aligning_args(aligned_latents, "float16", "--alignment.features", "encoder",
                                     "--alignment.encoder_path", str(other)))  # fmt: skip
    renamed = shutil.copy(aligned_latents["encoder"], tmp_path / "renamed.pth")
    assert parse_args(_aligning_args(aligned_latents, "float16", "--alignment.encoder_path", str(renamed)))
    with pytest.raises(ConfigError, match=rf"alignment.features = 'stored' in the command line: "
                       rf"{aligned_latents['images'] / 'meta.json'} records no encoder features"):  # fmt: skip
        parse_args(_aligning_args(aligned_latents, "images", "--alignment.features", "stored"))
    with pytest.raises(ConfigError, match=r"alignment.features with training.dataset in the command line: features"):
        parse_args(_aligning_args(aligned_latents, "images", "--alignment.features", "stored", "--training.dataset",
                                  "digits", "--model.in_channels", "1"))  # fmt: skip
    images = aligned_latents["float16"].parent / "images"
    with pytest.raises(ValueError, match=r"shard-00000.safetensors holds \{.*dinov2_vits14_pretrain.pth.*\}, this "
                       r"run stores \{.*dinov2_other.pth.*\} \(--store-features"):  # fmt: skip
        prepare_folder(images, aligned_latents["tok"], aligned_latents["float16"], store_images=True,
                       store_features=str(other))  # fmt: skip


def test_feature_storage_precision_script(capsys):
    """scripts/feature_storage_precision.py (docs/latent.md's figures) on the committed tiny DINOv2: one row per
    projection and variant; float16 storage changes the gradient less than bfloat16 storage, which changes it less
    than computing the encoder in bf16."""
    from scripts import feature_storage_precision

    feature_storage_precision.main(["--encoder", str(ENCODER), "--images", "2"])
    rows = [line.split(" | ") for line in capsys.readouterr().out.splitlines()[2:]]
    assert [(r[0].strip("| "), r[2]) for r in rows[:3]] == [
        ("random", "float16 storage"),
        ("random", "bfloat16 storage"),
        ("random", "bf16 compute"),
    ]
    assert len(rows) == 9
    for first in range(0, 9, 3):
        grads = [float(r[4].strip(" |")) for r in rows[first : first + 3]]
        assert 0 < grads[0] < grads[1] < grads[2] < 0.1, grads
