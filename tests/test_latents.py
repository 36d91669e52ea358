"""Latent shards: sharded resumable preparation, the dataset, its errors, and latent training end to end."""

import hashlib
import importlib.util
import os
import pickle
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import sample
from cosmos_latent_decoder import load_tokenizer
from tests.conftest import ROOT, TINY, read_metrics, run_train
from tests.test_cosmos_latent_decoder import make_image_folder, make_jit_tokenizer, make_sd_vae
from torchtitan.datasets import DiffusionDataLoader, build_dataset
from torchtitan.datasets.imagefolder import ImageFolderDataset
from torchtitan.datasets.latent_tokenizer import decoder_sha256
from torchtitan.datasets.latents import LatentNormalization, LatentShardDataset, combine_moments, moments_std, read_meta
from torchtitan.datasets.prefetch import images_to_float
from torchtitan.datasets.prepare_latents import prepare_latents
from torchtitan.job_config import DataLoader as DataLoaderConfig
from torchtitan.job_config import Latent, Training
from torchtitan.models.dit import DiTArgs
from torchtitan.tools.runs import launcher, run_to_end

TINY_LATENT_ARGS = DiTArgs(input_size=4, in_channels=16, patch_size=2, num_classes=3)  # the fixtures' latents


def load_script(path: Path):
    spec = importlib.util.spec_from_file_location(path.stem + "_script", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def prepare_folder(images: Path, tokenizer_dir: Path, out: Path, kind: str = "cosmos_jit", **kwargs) -> bool:
    tokenizer = load_tokenizer(kind, tokenizer_dir)
    source = ImageFolderDataset(str(images), 16, random_flip=False)
    return prepare_latents(source, out, tokenizer, image_size=16, num_classes=source.num_classes,
                           classes=source.classes, shard_size=5, batch_size=4, **kwargs)  # fmt: skip


def torchrun_prepare(args: list[str], nproc: int = 2) -> subprocess.CompletedProcess:
    cmd = [*launcher(nproc), "data/imagenet/prepare.py", *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = run_to_end(cmd, 300, ROOT, env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


def test_interrupted_preparation_resumes_then_trains_and_decodes(tmp_path, capsys):
    """Prepared with the alignment encoder's features too (--store-features), which the resume checks and the
    2-process run aligns to without building the encoder."""
    from tests.test_alignment import write_tiny_dinov2

    images = make_image_folder(tmp_path / "images")
    make_jit_tokenizer(tmp_path / "tok")
    encoder = write_tiny_dinov2(tmp_path / "dinov2_vits14_pretrain.pth", grid=37)
    out = tmp_path / "prepared"
    args = ["--source", str(images), "--image-size", "16", "--checkpoint-dir", str(tmp_path / "tok"),
            "--out", str(out), "--shard-size", "3", "--batch-size", "2", "--num-workers", "0", "--store-features",
            str(encoder), "--features-dtype", "bfloat16"]  # fmt: skip
    # 12 images in 4 shards over 2 ranks (rank r encodes shards r, r + 2); stop after 1 shard per rank.
    first = torchrun_prepare([*args, "--max-shards", "1"])
    done = {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in out.glob("shard-*.safetensors")}
    assert sorted(done) == ["shard-00000.safetensors", "shard-00001.safetensors"]
    assert not (out / "meta.json").exists() and "2 of 4 shards still missing" in first.stderr
    with pytest.raises(FileNotFoundError, match="did not finish"):
        LatentShardDataset(out)
    second = torchrun_prepare(args)
    assert "skipped shard 0" in second.stderr and "encoded shard 0" not in second.stderr
    for name, stamp in done.items():  # finished shards were not written again
        assert ((out / name).stat().st_ino, (out / name).stat().st_mtime_ns) == stamp
    assert len(list(out.glob("shard-*.safetensors"))) == 4 and not list(out.glob("*.tmp"))

    # The shards hold the tokenizer's latents of the center-cropped image and of its mirror.
    dataset = LatentShardDataset(out)
    tokenizer = load_tokenizer("cosmos_jit", tmp_path / "tok")
    source = ImageFolderDataset(str(images), 16, random_flip=False)
    assert len(dataset) == 12 and dataset.num_classes == 3 and dataset.labels.tolist() == [0] * 4 + [1] * 4 + [2] * 4
    for i in (0, 7, 11):
        x = images_to_float(source.load(i))[None]  # the folder's uint8 as the tokenizer takes it, [-1, 1]
        expected = torch.cat([tokenizer.encode(x), tokenizer.encode(x.flip(-1))])
        torch.testing.assert_close(dataset.raw(i).float(), expected, atol=2e-3, rtol=2e-3)  # float16 storage
    assert read_meta(out)["features"]["dtype"] == "bfloat16"
    assert LatentShardDataset(out, features=True)[11][0].features.shape == (4, 64)  # 2 x 2 tokens at patch 2

    run = tmp_path / "run"
    result = run_train([*TINY, "--job.dump_folder", str(run), "--training.steps", "2", "--training.local_batch_size",
                        "2", "--training.dataset", "latents", "--training.dataset_path", str(out),
                        "--model.in_channels", "16", "--model.input_size", "4", "--model.num_classes", "3",
                        "--latent.tokenizer", "cosmos_jit", "--latent.checkpoint_dir", str(tmp_path / "tok"),
                        "--sampling.freq", "2", "--sampling.num_samples", "3", "--sampling.steps", "2",
                        "--checkpoint.enable", "true", "--alignment.enable", "true", "--alignment.encoder_path",
                        str(encoder), "--alignment.depth", "2", "--alignment.projector_dim", "16"],
                       nproc=2)  # fmt: skip
    assert [m["step"] for m in read_metrics(run)] == [1, 2]
    assert all(-1 <= m["loss/alignment"] <= 1 for m in read_metrics(run))
    assert "(prepare.py --store-features) replace running" in result.stderr and "which is not built" in result.stderr
    grid = Image.open(run / "samples" / "step-2.png")
    assert grid.mode == "RGB" and grid.size == (2 + 3 * 66, 2 + 66)  # 3 decoded 16 px images, enlarged to 64
    # sample.py decodes a latent run's samples through the same tokenizer.
    assert sample.main(["--checkpoint", str(run), "--num-samples", "6", "--steps", "2", "--npz",
                        str(tmp_path / "samples.npz")]) == 0  # fmt: skip
    assert np.load(tmp_path / "samples.npz")["arr_0"].shape == (6, 16, 16, 3)
    # A tokenizer other than the shards' is refused before any sampling, naming both sides.
    ci16 = tmp_path / "Cosmos-0.1-Tokenizer-CI16x16"
    make_jit_tokenizer(ci16, downsample=8)
    assert sample.main(["--checkpoint", str(run), "--num-samples", "2", "--steps", "2", "--tokenizer-dir", str(ci16),
                        "--out", str(tmp_path / "x.png")]) == 2  # fmt: skip
    err = capsys.readouterr().err
    assert f"latent.checkpoint_dir = '{ci16}': its decoder (decoder.jit) has sha256" in err  # prepare.py recorded it
    assert f"downsample: the tokenizer in '{ci16}' has 8 but the latents 4" in err and not (tmp_path / "x.png").exists()
    assert sample.main(["--checkpoint", str(run), "--num-samples", "2", "--steps", "2", "--tokenizer-dir", str(ci16),
                        "--out", str(tmp_path / "x.png"), "--allow-tokenizer-mismatch"]) == 0  # fmt: skip
    assert capsys.readouterr().err.count("(allowed: latent.allow_tokenizer_mismatch)") == 1  # said once, not twice
    assert Image.open(tmp_path / "x.png").size == (2 + 2 * 66, 2 + 66)  # 32 px tiles, as asked (64 px shown)


def test_diffusers_autoencoder_flow(tmp_path):
    images = make_image_folder(tmp_path / "images")
    make_sd_vae(tmp_path / "vae")
    out = tmp_path / "prepared"
    assert prepare_folder(images, tmp_path / "vae", out, kind="diffusers", normalization="scale",
                          scale_factor=0.5)  # fmt: skip
    meta = read_meta(out)
    assert meta["tokenizer"]["kind"] == "diffusers" and meta["latent_size"] == 8
    assert meta["normalization"]["mode"] == "scale"
    dataset = LatentShardDataset(out, random_flip=False)
    torch.testing.assert_close(dataset[0][0], dataset.raw(0)[0].float() * 0.5)  # z * scale_factor
    run = tmp_path / "run"
    run_train([*TINY, "--job.dump_folder", str(run), "--training.steps", "2", "--training.local_batch_size", "2",
               "--training.dataset", "latents", "--training.dataset_path", str(out), "--model.in_channels", "4",
               "--model.input_size", "8", "--model.num_classes", "3", "--latent.tokenizer", "diffusers",
               "--latent.checkpoint_dir", str(tmp_path / "vae"), "--sampling.freq", "2",
               "--sampling.num_samples", "3", "--sampling.steps", "2"], nproc=2)  # fmt: skip
    grid = Image.open(run / "samples" / "step-2.png")
    assert grid.mode == "RGB" and grid.size == (2 + 3 * 66, 2 + 66)


@pytest.fixture
def prepared(tmp_path) -> Path:
    make_image_folder(tmp_path / "images")
    make_jit_tokenizer(tmp_path / "tok")
    assert prepare_folder(tmp_path / "images", tmp_path / "tok", tmp_path / "prepared")
    return tmp_path / "prepared"


def test_dataset_normalizes_and_picks_a_view(prepared):
    dataset = LatentShardDataset(prepared)
    raw = torch.stack([dataset.raw(i) for i in range(len(dataset))]).float()  # (N, V=2, C, h, w)
    assert raw.shape == (12, 2, 16, 4, 4)
    per_channel = dataset.normalization.normalize(raw).transpose(0, 2).reshape(16, -1)  # every latent, both views
    torch.testing.assert_close(per_channel.mean(1), torch.zeros(16), atol=1e-5, rtol=0)
    torch.testing.assert_close(per_channel.std(1), torch.ones(16), atol=1e-5, rtol=0)
    torch.manual_seed(0)
    views = set()
    for _ in range(20):
        x, y = dataset[5]
        assert x.dtype == torch.float32 and y.dtype == torch.long and int(y) == 1
        views.add(int(torch.isclose(x, dataset.normalization.normalize(raw[5, 1])).all()))
    assert views == {0, 1}  # both the image and its mirror are drawn
    fixed = LatentShardDataset(prepared, scale_factor=0.25, random_flip=False)
    torch.testing.assert_close(fixed[3][0], raw[3, 0] * 0.25)


def test_moments_combine_exactly():
    data = torch.randn(3, 1000, dtype=torch.float64) * torch.tensor([[1.0], [2.0], [0.5]]) + 3
    parts = [(float(c.shape[1]), c.mean(1), (c - c.mean(1, keepdim=True)).pow(2).sum(1)) for c in data.split(
        [100, 650, 250], dim=1)]  # fmt: skip
    count, mean, m2 = combine_moments(parts)
    torch.testing.assert_close(mean, data.mean(1))
    torch.testing.assert_close(moments_std(count, m2), data.std(1))
    assert count == 1000
    norm = LatentNormalization("channel", [1.0, 2.0], [2.0, 4.0])
    z = torch.randn(5, 2, 3, 3)
    torch.testing.assert_close(norm.denormalize(norm.normalize(z)), z)


def test_loader_shards_and_resumes(prepared):
    dataset = LatentShardDataset(prepared, random_flip=False)
    config = DataLoaderConfig()
    loaders = [DiffusionDataLoader(dataset, 2, rank, 2, seed=0, dataloader_config=config) for rank in range(2)]
    epoch = [y for loader in loaders for _ in range(3) for y in next(loader)[1].tolist()]
    assert sorted(epoch) == sorted(dataset.labels.tolist())  # one epoch over two ranks sees every latent once
    reference = DiffusionDataLoader(dataset, 2, 0, 2, seed=0, dataloader_config=config)
    next(reference)
    resumed = DiffusionDataLoader(dataset, 2, 0, 2, seed=0, dataloader_config=config)
    resumed.load_state_dict(reference.state_dict())
    for _ in range(4):  # across the epoch boundary too
        (xa, ya), (xb, yb) = next(reference), next(resumed)
        assert torch.equal(xa, xb) and torch.equal(ya, yb)


def test_errors_name_what_disagrees(tmp_path, prepared):
    with pytest.raises(FileNotFoundError, match=str(tmp_path / "missing")):
        LatentShardDataset(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match=f"{tmp_path / 'empty'} holds no latent shards"):
        LatentShardDataset(tmp_path / "empty")

    training = Training(dataset="latents", dataset_path=str(prepared))
    latent = Latent(tokenizer="cosmos_jit", checkpoint_dir=str(tmp_path / "tok"))
    with pytest.raises(ValueError, match=r"yields \(16, 4, 4\).*expects \(4, 4, 4\)"):
        build_dataset(training, DiTArgs(input_size=4, in_channels=4, patch_size=2, num_classes=3), latent)

    # A shard of another tokenizer dropped into the folder.
    make_jit_tokenizer(tmp_path / "other_tok", seed=1)
    assert prepare_folder(tmp_path / "images", tmp_path / "other_tok", tmp_path / "other")
    shutil.copy(tmp_path / "other" / "shard-00001.safetensors", prepared / "shard-00001.safetensors")
    with pytest.raises(ValueError, match=r"shard-00001.safetensors was encoded by tokenizer cosmos_jit:other_tok.*"
                       r"by cosmos_jit:tok"):  # fmt: skip
        LatentShardDataset(prepared)
    # Resuming into a folder with another tokenizer's shards is refused, not mixed.
    with pytest.raises(ValueError, match="encoded by tokenizer cosmos_jit:tok .*this run uses cosmos_jit:other_tok"):
        prepare_folder(tmp_path / "images", tmp_path / "other_tok", prepared)
    (prepared / "shard-00002.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"lacks shard\(s\) \['shard-00002.safetensors'\]"):
        LatentShardDataset(prepared)


def write_cifar10(folder: Path, per_batch: int = 3) -> Path:
    """The python-pickle layout of CIFAR-10, with a few random images per batch."""
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for i in range(1, 6):
        batch = {b"data": rng.integers(0, 256, (per_batch, 3072), dtype=np.uint8),
                 b"labels": [int(v) for v in rng.integers(0, 10, per_batch)]}  # fmt: skip
        with open(folder / f"data_batch_{i}", "wb") as f:
            pickle.dump(batch, f)
    with open(folder / "batches.meta", "wb") as f:
        pickle.dump({b"label_names": [f"c{i}".encode() for i in range(10)]}, f)
    return folder


def test_cifar10_prepare_script(tmp_path):
    source = write_cifar10(tmp_path / "cifar-10-batches-py")
    make_jit_tokenizer(tmp_path / "tok", dtype=torch.bfloat16)  # as NVIDIA traces: bf16, here encoded on a CPU
    script = load_script(ROOT / "data" / "cifar10" / "prepare.py")
    args = ["--source", str(tmp_path), "--checkpoint-dir", str(tmp_path / "tok"), "--out", str(tmp_path / "prepared"),
            "--shard-size", "4", "--num-workers", "0", "--no-flip"]  # fmt: skip
    assert script.main(args) == 0
    dataset = LatentShardDataset(tmp_path / "prepared")
    meta = dataset.meta
    assert (meta["num_shards"], meta["image_size"], meta["latent_size"], meta["num_classes"]) == (4, 32, 8, 10)
    assert meta["classes"][:2] == ["c0", "c1"] and not meta["flip"]
    assert len(dataset) == 15 and dataset[0][0].shape == (16, 8, 8) and dataset.raw(0).shape == (1, 16, 8, 8)
    with open(source / "data_batch_1", "rb") as f:
        assert dataset.labels[:3].tolist() == pickle.load(f, encoding="bytes")[b"labels"]


def test_build_dataset_refuses_another_tokenizer(tmp_path, prepared):
    training, args = Training(dataset="latents", dataset_path=str(prepared)), TINY_LATENT_ARGS
    decoder = tmp_path / "tok" / "decoder.jit"
    assert read_meta(prepared)["tokenizer"]["decoder_sha256"] == hashlib.sha256(decoder.read_bytes()).hexdigest()
    dataset = build_dataset(training, args, Latent(tokenizer="cosmos_jit", checkpoint_dir=str(tmp_path / "tok")))
    assert len(dataset) == 12
    shutil.copytree(tmp_path / "tok", tmp_path / "renamed")  # the same weights: a folder's name is no identity
    assert len(build_dataset(training, args, Latent(tokenizer="cosmos_jit", checkpoint_dir=str(tmp_path / "renamed"))))
    ci16 = tmp_path / "Cosmos-0.1-Tokenizer-CI16x16"
    make_jit_tokenizer(ci16, downsample=8)
    for latent, messages in (
        (Latent(tokenizer="cosmos_jit", checkpoint_dir=str(ci16)),
         [f"latent.checkpoint_dir = '{ci16}': its decoder (decoder.jit) has sha256"]),
        (Latent(tokenizer="diffusers", checkpoint_dir=str(tmp_path / "tok")),
         ["latent.tokenizer = 'diffusers' but the latents' tokenizer kind is 'cosmos_jit'"]),
    ):  # fmt: skip
        with pytest.raises(ValueError) as info:
            build_dataset(training, args, latent)
        message = str(info.value)
        assert message.startswith(f"{prepared / 'meta.json'}: the [latent] tokenizer is not the one these latents "
                                  "were encoded with (cosmos_jit:tok (16 channels, downsample 4))")  # fmt: skip
        assert all(m in message for m in messages), message
    # No [latent] tokenizer: the latents train as they are (a latent model then saves its samples as latents).
    assert len(build_dataset(training, args, Latent())) == 12
    allowed = Latent(tokenizer="cosmos_jit", checkpoint_dir=str(ci16), allow_tokenizer_mismatch=True)
    assert len(build_dataset(training, args, allowed)) == 12


def test_prepare_script_errors_are_one_line_naming_the_fault(tmp_path, capsys):
    images = make_image_folder(tmp_path / "images")
    make_jit_tokenizer(tmp_path / "tok")
    (tmp_path / "tok" / "decoder.jit").unlink()  # preparing encodes: decoder.jit is not needed
    script = load_script(ROOT / "data" / "imagenet" / "prepare.py")
    args = ["--source", str(images), "--image-size", "16", "--out", str(tmp_path / "prepared"), "--num-workers", "0"]
    assert script.main([*args, "--checkpoint-dir", str(tmp_path / "tok")]) == 0
    recorded = read_meta(tmp_path / "prepared")["tokenizer"]
    assert recorded["downsample"] == 4 and recorded["decoder_sha256"] is None  # no decoder file to hash
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "encoder.jit").write_bytes(b"half a download")
    for flags, message in (
        (["--checkpoint-dir", str(tmp_path / "nowhere")], f"tokenizer folder '{tmp_path / 'nowhere'}' does not exist"),
        (["--checkpoint-dir", str(broken)], f"{broken / 'encoder.jit'}: torch.jit.load failed"),
        (["--checkpoint-dir", str(tmp_path / "tok"), "--image-size", "18"],
         "image size 18 (--image-size) is not a multiple of the downsample factor 4 of cosmos_jit:tok (16 channels, "
         "downsample 4; encoder float32): use 16 or 20"),
        (["--checkpoint-dir", str(tmp_path / "tok"), "--batch-size", "0"], "--batch-size 0: must be > 0"),
        (["--checkpoint-dir", str(tmp_path / "tok"), "--shard-size", "-1"], "--shard-size -1: must be > 0"),
        (["--checkpoint-dir", str(tmp_path / "tok"), "--store-features", str(tmp_path / "dinov2.pth")],
         f"--store-features {tmp_path / 'dinov2.pth'}: {tmp_path / 'dinov2.pth'} does not exist"),
        (["--checkpoint-dir", str(tmp_path / "tok"), "--store-features", str(tmp_path / "dinov2.pth"),
          "--features-patch-size", "3"], "--features-patch-size 3: the latents are 4 x 4 (--image-size 16 / downsample "
         "4); a DiT's patch size divides their side"),
    ):  # fmt: skip
        assert script.main([*args, *flags]) == 2
        err = capsys.readouterr().err
        last = err.splitlines()[-1]  # after the log lines, if any
        assert last.startswith("error: ") and message in last and "Traceback" not in err, err


def sha256_of(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def as_written_before_hashes(folder: Path) -> None:
    """Rewrites a prepared folder as TorchDiTan wrote it before shards recorded hashes and normalization: shard
    metadata of format 1 without them, and a meta.json of format 1."""
    import json

    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    old_keys = ("tokenizer_kind", "tokenizer_name", "latent_channels", "downsample", "image_size", "shard_index",
                "num_shards", "shard_size", "flip")  # fmt: skip
    for shard in folder.glob("shard-*.safetensors"):
        with safe_open(str(shard), "pt") as f:
            metadata = f.metadata()
        old = {"format": "torchditan-latents/1", **{key: metadata[key] for key in old_keys}}
        save_file(load_file(str(shard)), str(shard), metadata=old)
    if (folder / "meta.json").is_file():
        meta = json.loads((folder / "meta.json").read_text())
        meta["format"] = "torchditan-latents/1"
        del meta["tokenizer"]["encoder_sha256"]
        (folder / "meta.json").write_text(json.dumps(meta))


def test_shards_record_the_tokenizer_hash_and_resume_compares_it(tmp_path):
    """Resuming with other weights in a folder of the same name mixed two tokenizers in one latent folder (shards
    recorded the folder's name); a renamed copy of the same weights was refused. Both compare hashes now."""
    images = make_image_folder(tmp_path / "images")
    make_jit_tokenizer(tmp_path / "a" / "tok")
    make_jit_tokenizer(tmp_path / "b" / "tok", seed=1)  # other weights, the same folder name and shapes
    shutil.copytree(tmp_path / "a" / "tok", tmp_path / "renamed")
    out = tmp_path / "prepared"
    assert not prepare_folder(images, tmp_path / "a" / "tok", out, max_shards=1)  # stopped: 1 of 3 shards
    encoder_a, decoder_a = (sha256_of(tmp_path / "a" / "tok" / f"{part}.jit") for part in ("encoder", "decoder"))
    encoder_b = sha256_of(tmp_path / "b" / "tok" / "encoder.jit")
    with pytest.raises(ValueError) as info:
        prepare_folder(images, tmp_path / "b" / "tok", out)
    assert str(info.value) == (
        f"{out / 'shard-00000.safetensors'} was encoded by tokenizer cosmos_jit:tok (16 channels, downsample 4, "
        f"encoder sha256 {encoder_a[:16]}...), this run uses cosmos_jit:tok (16 channels, downsample 4, encoder "
        f"sha256 {encoder_b[:16]}...): use another --out folder")  # fmt: skip
    assert sorted(p.name for p in out.iterdir()) == ["shard-00000.safetensors"]  # nothing mixed in
    assert prepare_folder(images, tmp_path / "renamed", out)  # the same weights under another name resume
    # prepare_latents hashes the loaded tokenizer's own folder (it was given none: it recorded no hash before).
    recorded = read_meta(out)["tokenizer"]
    assert (recorded["encoder_sha256"], recorded["decoder_sha256"]) == (encoder_a, decoder_a)

    # Training refuses a shard of other weights whose folder had the same name.
    assert prepare_folder(images, tmp_path / "b" / "tok", tmp_path / "prepared_b")
    shutil.copy(tmp_path / "prepared_b" / "shard-00001.safetensors", out / "shard-00001.safetensors")
    with pytest.raises(ValueError) as info:
        LatentShardDataset(out)
    assert str(info.value) == (
        f"latent shard {out / 'shard-00001.safetensors'} was encoded by tokenizer cosmos_jit:tok (16 channels, "
        f"downsample 4, encoder sha256 {encoder_b[:16]}...) but {out / 'meta.json'} (and its other shards) by "
        f"cosmos_jit:renamed (16 channels, downsample 4, encoder sha256 {encoder_a[:16]}...): shards of different "
        "tokenizers cannot be mixed; prepare them into separate folders")  # fmt: skip

    # A folder written before shards recorded hashes is still read (checked by name, as it was written); resuming
    # one cannot be checked, and is refused by name with the remedy.
    old = tmp_path / "prepared_b"
    as_written_before_hashes(old)
    assert len(LatentShardDataset(old)) == 12
    # Its shards are raw latents, though they do not say so: decoded as such, and checked by the meta.json beside.
    import cosmos_latent_decoder

    decode = ["--checkpoint-dir", str(tmp_path / "b" / "tok"), "--latents", str(old / "shard-00001.safetensors"),
              "--out", str(tmp_path / "grid.png")]  # fmt: skip
    assert cosmos_latent_decoder.main(decode) == 0
    assert cosmos_latent_decoder.main([*decode, "--stats", str(old)]) == 2  # would un-normalize raw latents
    assert cosmos_latent_decoder.main([*decode[:1], str(tmp_path / "a" / "tok"), *decode[2:]]) == 2  # other weights
    (old / "meta.json").unlink()
    (old / "shard-00002.safetensors").unlink()
    with pytest.raises(ValueError, match=r"shard-00000.safetensors was written before TorchDiTan recorded the "
                       r"tokenizer's hash in each shard: whether cosmos_jit:tok .* encoded it cannot be checked; "
                       r"encode into another --out folder"):  # fmt: skip
        prepare_folder(images, tmp_path / "b" / "tok", old)


def test_diffusers_hash_covers_the_network_not_the_bookkeeping(tmp_path):
    """sd-vae-ft-ema re-saved with save_pretrained was refused as another tokenizer: its config.json gains
    `_name_or_path`, the `_diffusers_version` of the day, and every default the original did not write."""
    import json

    from diffusers import AutoencoderKL
    from safetensors.torch import load_file, save_file

    make_sd_vae(tmp_path / "vae")
    config = json.loads((tmp_path / "vae" / "config.json").read_text())
    for key in ("_diffusers_version", "force_upcast", "mid_block_add_attention", "latents_mean", "shift_factor"):
        del config[key]  # as an old config.json (sd-vae-ft-ema's: diffusers 0.4) lacks them
    (tmp_path / "vae" / "config.json").write_text(json.dumps(config))
    AutoencoderKL.from_pretrained(str(tmp_path / "vae")).save_pretrained(str(tmp_path / "resaved"))
    resaved = json.loads((tmp_path / "resaved" / "config.json").read_text())
    assert {"_name_or_path", "_diffusers_version", "force_upcast", "mid_block_add_attention"} <= set(resaved)
    original = decoder_sha256("diffusers", tmp_path / "vae")
    assert original is not None and decoder_sha256("diffusers", tmp_path / "resaved") == original

    def variant(name: str, config_change: dict | None = None, weight: str = "") -> str:
        shutil.copytree(tmp_path / "resaved", tmp_path / name)
        if config_change:
            path = tmp_path / name / "config.json"
            path.write_text(json.dumps({**json.loads(path.read_text()), **config_change}))
        if weight:
            path = tmp_path / name / "diffusion_pytorch_model.safetensors"
            weights = load_file(str(path))
            weights[weight] = weights[weight] + 1e-3
            save_file(weights, str(path), metadata={"format": "pt"})
        return decoder_sha256("diffusers", tmp_path / name)

    assert variant("bookkeeping", {"_diffusers_version": "0.1.0", "_name_or_path": "elsewhere"}) == original
    assert variant("act_fn", {"act_fn": "gelu"}) != original  # changes what the network computes
    assert variant("weight", weight="decoder.conv_out.bias") != original

    # A meta.json of format 1 recorded the hash of the folder's file bytes: still checked against that.
    from torchtitan.datasets.latent_tokenizer import check_tokenizer_matches

    files = [tmp_path / "vae" / "config.json", tmp_path / "vae" / "diffusion_pytorch_model.safetensors"]
    tokenizer = {"kind": "diffusers", "name": "AutoencoderKL:vae", "latent_channels": 4, "downsample": 2,
                 "decoder_sha256": hashlib.sha256(b"".join(f.read_bytes() for f in files)).hexdigest()}  # fmt: skip
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "meta.json").write_text(json.dumps({"format": "torchditan-latents/1", "tokenizer": tokenizer}))
    meta = read_meta(tmp_path / "old")
    check_tokenizer_matches(meta, Latent(tokenizer="diffusers", checkpoint_dir=str(tmp_path / "vae")))
    with pytest.raises(ValueError, match=r"latent.checkpoint_dir = '.*weight': its decoder \(config.json, "
                       r"diffusion_pytorch_model.safetensors\) has sha256 .* \(a hash of its files, as format 1 "
                       r"recorded it\)"):  # fmt: skip
        check_tokenizer_matches(meta, Latent(tokenizer="diffusers", checkpoint_dir=str(tmp_path / "weight")))


def test_a_corrupt_meta_json_is_named_with_the_remedy(prepared):
    text = (prepared / "meta.json").read_text()
    (prepared / "meta.json").write_text(text[: len(text) // 2])  # a disk filled up while it was written
    with pytest.raises(ValueError) as info:
        LatentShardDataset(prepared)
    assert str(info.value).startswith(f"{prepared / 'meta.json'} cannot be read (not JSON: ")
    assert str(info.value).endswith("): it is damaged; run prepare.py again with the same options: it rewrites "
                                    "meta.json from the finished shards")  # fmt: skip
    (prepared / "meta.json").write_text("[]")
    with pytest.raises(ValueError, match=rf"{prepared / 'meta.json'} cannot be read \(a list, not a JSON object\)"):
        read_meta(prepared)
