"""LightningDiT's latents_stats.pt as the latent normalization (`latent.stats_file`): read safely, applied by the
dataset as LightningDiT's ImgLatentDataset applies it, undone before decoding, recorded in sampled-latent files."""

import json
import os
from pathlib import Path

import pytest
import torch

from tests.test_latents import prepared  # noqa: F401 (a fixture: a tiny prepared folder of 16-channel latents)
from torchtitan.config_manager import ConfigError, parse_args
from torchtitan.datasets.latent_stats import read_latent_stats
from torchtitan.datasets.latents import LatentShardDataset, model_space_metadata
from torchtitan.tools import safe_pickle


def write_stats(path: Path, channels: int = 16, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A latents_stats.pt as LightningDiT's ImgLatentDataset saves it: {"mean", "std"}, each (1, C, 1, 1)."""
    generator = torch.Generator().manual_seed(seed)
    mean = torch.randn(1, channels, 1, 1, generator=generator)
    std = 0.5 + torch.rand(1, channels, 1, 1, generator=generator)
    torch.save({"mean": mean, "std": std}, path)
    return mean, std


def test_dataset_normalizes_as_lightningdit_and_decoding_undoes_it(prepared, tmp_path):  # noqa: F811
    mean, std = write_stats(tmp_path / "latents_stats.pt")
    dataset = LatentShardDataset(prepared, random_flip=False, stats_file=str(tmp_path / "latents_stats.pt"))
    raw = dataset.raw(3)[0].float()  # (C, h, w)
    lightningdit = ((raw[None] - mean) / std)[0]  # its ImgLatentDataset: (feature - mean) / std, multiplier 1
    torch.testing.assert_close(dataset[3][0], lightningdit, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(dataset.normalization.denormalize(dataset[3][0]), raw, rtol=1e-6, atol=1e-5)

    cfg = parse_args(["--training.dataset", "latents", "--training.dataset_path", str(prepared), "--model.in_channels",
                      "16", "--model.input_size", "4", "--model.num_classes", "3", "--latent.tokenizer", "cosmos_jit",
                      "--latent.checkpoint_dir", str(prepared.parent / "tok"), "--latent.stats_file",
                      str(tmp_path / "latents_stats.pt")])  # fmt: skip
    from torchtitan.datasets.tokenizers import decode_for_training, load_tokenizer

    model_space = torch.stack([dataset[i][0] for i in range(2)])
    images = decode_for_training(cfg, model_space)
    expected = load_tokenizer("cosmos_jit", prepared.parent / "tok").decode(model_space * std + mean)
    torch.testing.assert_close(images, expected, rtol=0, atol=1e-5)
    # Sampled latents record the normalization they are in, so cosmos_latent_decoder.py decodes them right.
    metadata = model_space_metadata(str(prepared), 0.0, str(tmp_path / "latents_stats.pt"))
    recorded = json.loads(metadata["normalization"])
    assert recorded["mode"] == "channel" and recorded["std"] == pytest.approx(std.flatten().tolist())


class _RunsCode:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_bad_statistics_files_are_refused_naming_them(tmp_path):
    marker = tmp_path / "ran"
    torch.save({"mean": torch.zeros(1, 4, 1, 1), "std": _RunsCode(marker)}, tmp_path / "crafted.pt")
    with pytest.raises(safe_pickle.UnsafePickleError, match=r"crafted.pt refers to (posix|nt|os)\.system"):
        read_latent_stats(tmp_path / "crafted.pt")
    assert not marker.exists()
    cases = {"keys.pt": {"mu": torch.zeros(4)}, "shapes.pt": {"mean": torch.zeros(4), "std": torch.ones(3)},
             "zero.pt": {"mean": torch.zeros(4), "std": torch.zeros(4)}}  # fmt: skip
    for name, content in cases.items():
        torch.save(content, tmp_path / name)
        with pytest.raises(ValueError, match=rf"latent.stats_file = '.*{name}': "):
            read_latent_stats(tmp_path / name)
    with pytest.raises(FileNotFoundError, match="no such file"):
        read_latent_stats(tmp_path / "missing.pt")
    with pytest.raises(ConfigError, match=r"latent.stats_file = '.*missing.pt' in the command line: no such file"):
        parse_args(["--latent.stats_file", str(tmp_path / "missing.pt")])
    write_stats(tmp_path / "ok.pt", 4)
    with pytest.raises(ConfigError, match=r"latent.stats_file with latent.scale_factor in the command line: two"):
        parse_args(["--latent.stats_file", str(tmp_path / "ok.pt"), "--latent.scale_factor", "0.5"])
