"""Datasets and the loader: shapes and ranges, ADM's crop, CIFAR-10 pickles, errors naming the path, resume."""

import pickle

import numpy as np
import pytest
import torch
from PIL import Image

from torchtitan.config_manager import JobConfig
from torchtitan.datasets import DiffusionDataLoader, build_dataset
from torchtitan.datasets.cifar10 import CIFAR10Dataset
from torchtitan.datasets.digits import DigitsDataset
from torchtitan.datasets.imagefolder import ImageFolderDataset, center_crop_arr
from torchtitan.models.dit import dit_configs


def test_digits_are_real_and_normalized():
    data = DigitsDataset(16)
    image, label = data[0]
    assert len(data) == 1797 and image.shape == (1, 16, 16) and label == 0
    assert image.min() >= -1 and image.max() <= 1 and image.std() > 0.3


def make_image_folder(root, sizes=((40, 30), (20, 50))):
    for cls in ("cat", "dog"):
        (root / cls).mkdir(parents=True)
        for i, size in enumerate(sizes):
            array = np.random.default_rng(i).integers(0, 255, (size[1], size[0], 3), dtype=np.uint8)
            Image.fromarray(array).save(root / cls / f"{i}.png")
    return root


def test_image_folder_center_crop_and_flip(tmp_path):
    data = ImageFolderDataset(str(make_image_folder(tmp_path / "images")), image_size=16)
    assert data.classes == ["cat", "dog"] and len(data) == 4 and data.num_classes == 2
    image, label = data[2]
    assert image.shape == (3, 16, 16) and label == 1 and -1 <= image.min() and image.max() <= 1
    # ADM's crop keeps the centre: a 64x32 image with a bright centre column stays bright in the middle.
    array = np.zeros((32, 64, 3), dtype=np.uint8)
    array[:, 31:33] = 255
    cropped = np.asarray(center_crop_arr(Image.fromarray(array), 16))
    assert cropped.shape == (16, 16, 3) and cropped[:, 7:9].mean() > cropped[:, :4].mean()
    torch.manual_seed(0)
    flips = {bool(torch.equal(data[0][0], data.load(0))) for _ in range(20)}
    assert flips == {True, False}  # random horizontal flips


def test_cifar10_pickles(tmp_path):
    for i in range(1, 6):
        batch = {b"data": np.full((3, 3072), i, dtype=np.uint8), b"labels": [i % 10] * 3}
        with open(tmp_path / f"data_batch_{i}", "wb") as f:
            pickle.dump(batch, f)
    data = CIFAR10Dataset(str(tmp_path), random_flip=False)
    assert len(data) == 15
    image, label = data[3]
    assert image.shape == (3, 32, 32) and label == 2 and image[0, 0, 0] == pytest.approx(2 / 127.5 - 1)


@pytest.mark.parametrize("name", ["imagefolder", "cifar10"])
def test_missing_or_empty_path_is_named(tmp_path, name):
    cfg = JobConfig()
    cfg.training.dataset = name
    cfg.training.dataset_path = str(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match=str(tmp_path / "nope")):
        build_dataset(cfg.training, dit_configs["DiT-S/2"])
    (tmp_path / "empty" / "cls").mkdir(parents=True)
    cfg.training.dataset_path = str(tmp_path / "empty")
    with pytest.raises(FileNotFoundError, match="empty"):
        build_dataset(cfg.training, dit_configs["DiT-S/2"])


def test_dataset_model_mismatch_is_named():
    cfg = JobConfig()  # digits: 1 x 16 x 16, 10 classes
    with pytest.raises(ValueError, match="model.in_channels"):
        build_dataset(cfg.training, dit_configs["DiT-S/2"])


def test_loader_resumes_with_the_next_batch():
    data = DigitsDataset(8)
    cfg = JobConfig().training.dataloader
    loader = DiffusionDataLoader(data, 64, dp_rank=1, dp_world=2, seed=3, dataloader_config=cfg)
    for _ in range(20):  # crosses an epoch boundary (898 samples per rank: 14 batches an epoch)
        next(loader)
    state = loader.state_dict()
    expected = [next(loader)[1] for _ in range(5)]
    resumed = DiffusionDataLoader(data, 64, dp_rank=1, dp_world=2, seed=3, dataloader_config=cfg)
    resumed.load_state_dict(state)
    assert state["epoch"] == 1
    assert all(torch.equal(a, next(resumed)[1]) for a in expected)
