"""Datasets and the loader: shapes and ranges, ADM's crop, CIFAR-10 pickles, errors naming the path, resume."""

import dataclasses
import importlib.util
import logging
import os
import pickle
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image

from tests.conftest import ROOT
from torchtitan.config_manager import JobConfig
from torchtitan.datasets import DiffusionDataLoader, PoissonDataLoader, build_dataset
from torchtitan.datasets.cifar10 import CIFAR10Dataset, load_cifar10_pickle
from torchtitan.datasets.digits import DigitsDataset, load_digits_arrays
from torchtitan.datasets.imagefolder import ImageFolderDataset, UnreadableImageError, center_crop_arr
from torchtitan.datasets.prefetch import images_to_float
from torchtitan.dp.sampling import PoissonBatchSampler, pad_batch
from torchtitan.models.dit import dit_configs
from torchtitan.tools.logging import logger


def test_digits_are_real_and_normalized():
    data = DigitsDataset(16)
    image, label = data[0]
    assert len(data) == 1797 and image.shape == (1, 16, 16) and label == 0
    assert image.min() >= -1 and image.max() <= 1 and image.std() > 0.3


def test_digits_are_scikit_learns_read_without_importing_it(monkeypatch):
    from sklearn.datasets import load_digits

    pixels, labels = load_digits_arrays()
    reference = load_digits()
    assert np.array_equal(pixels, reference.images) and np.array_equal(labels, reference.target)
    # Every run's start: scikit-learn's import (SciPy's with it) is not part of it.
    code = "import sys; from torchtitan.datasets.digits import DigitsDataset; DigitsDataset(16); print(sorted("
    code += "m for m in ('sklearn', 'scipy') if m in sys.modules))"
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="training.dataset 'digits' needs scikit-learn"):
        DigitsDataset(16)


def make_image_folder(root, sizes=((40, 30), (20, 50)), suffix="png"):
    for cls in ("cat", "dog"):
        (root / cls).mkdir(parents=True)
        for i, size in enumerate(sizes):
            array = np.random.default_rng(i).integers(0, 255, (size[1], size[0], 3), dtype=np.uint8)
            Image.fromarray(array).save(root / cls / f"{i}.{suffix}")
    return root


def test_image_folder_center_crop_and_flip(tmp_path):
    data = ImageFolderDataset(str(make_image_folder(tmp_path / "images")), image_size=16)
    assert data.classes == ["cat", "dog"] and len(data) == 4 and data.num_classes == 2
    image, label = data[2]
    assert image.shape == (3, 16, 16) and image.dtype == torch.uint8 and label == 1
    # The device's mapping to [-1, 1] is the host's old `float() / 127.5 - 1`, to the bit.
    pixels = torch.arange(256, dtype=torch.uint8)
    assert torch.equal(images_to_float(pixels), pixels.float() / 127.5 - 1.0)
    assert images_to_float(pixels)[[0, -1]].tolist() == [-1.0, 1.0]
    # ADM's crop keeps the centre: a 64x32 image with a bright centre column stays bright in the middle.
    array = np.zeros((32, 64, 3), dtype=np.uint8)
    array[:, 31:33] = 255
    cropped = np.asarray(center_crop_arr(Image.fromarray(array), 16))
    assert cropped.shape == (16, 16, 3) and cropped[:, 7:9].mean() > cropped[:, :4].mean()
    torch.manual_seed(0)
    flips = {bool(torch.equal(data[0][0], data.load(0))) for _ in range(20)}
    assert flips == {True, False}  # random horizontal flips


@pytest.mark.parametrize("suffix", ["png", "jpg"])
def test_truncated_image_is_named_or_skipped(tmp_path, suffix, caplog, monkeypatch):
    root = make_image_folder(tmp_path / "images", suffix=suffix)  # cat/0, cat/1, dog/0, dog/1
    bad = root / "dog" / f"1.{suffix}"
    bad.write_bytes(bad.read_bytes()[: bad.stat().st_size // 2])  # a valid file cut in half: index 3
    cfg = JobConfig()
    cfg.training.dataset, cfg.training.dataset_path, cfg.training.image_size = "imagefolder", str(root), 16
    model_args = SimpleNamespace(in_channels=3, input_size=16, num_classes=2)
    data = build_dataset(cfg.training, model_args)
    with pytest.raises(OSError, match=re.escape(str(bad))) as error:
        data[3]
    assert "truncated" in str(error.value.__cause__)  # PIL's own error, chained

    cfg.training.dataloader.skip_unreadable_images = True
    data = build_dataset(cfg.training, model_args)
    # Captured straight from the project logger, once: whether it propagates depends on init_logger having run.
    monkeypatch.setattr(logger, "propagate", False)
    logger.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.WARNING, logger.name):
            image, label = data[3]  # the next index, wrapping: cat/0
            loader = DiffusionDataLoader(
                data, 4, dp_rank=0, dp_world=1, seed=0, dataloader_config=cfg.training.dataloader
            )
            images, labels = next(loader)
    finally:
        logger.removeHandler(caplog.handler)
    first = data.load(0)
    assert label == 0 and (torch.equal(image, first) or torch.equal(image, first.flip(-1)))
    assert images.shape == (4, 3, 16, 16) and sorted(labels.tolist()) == [0, 0, 0, 1]  # full: cat/0 twice
    assert data.skipped == {bad}
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and str(bad) in warnings[0] and "1 unreadable image(s) skipped" in warnings[0]


def test_unreadable_image_met_by_a_loader_worker_is_one_line_naming_it(tmp_path):
    """A worker's error reaches the trainer rebuilt from its traceback text; train.py prints it as one `error:`
    line (UnreadableImageError is in its REFUSED and STOPPED), so its message must be the file's, nothing more."""
    root = make_image_folder(tmp_path / "images")
    bad = root / "dog" / "1.png"
    bad.write_bytes(b"not an image")
    cfg = JobConfig()
    cfg.training.dataloader.num_workers = 1
    data = ImageFolderDataset(str(root), 16)
    loader = DiffusionDataLoader(data, 4, dp_rank=0, dp_world=1, seed=0, dataloader_config=cfg.training.dataloader)
    with pytest.raises(UnreadableImageError) as error:
        next(loader)
    assert str(error.value) == (
        f"training.dataset_path: image {bad} cannot be read (UnidentifiedImageError: cannot identify image file "
        f"'{bad}'); training.dataloader.skip_unreadable_images = true replaces such files by the next readable one"
    )
    # A file given for the folder is named as what it is, not as missing.
    with pytest.raises(ValueError, match=f"{re.escape(str(bad))} is a file, not an image folder"):
        ImageFolderDataset(str(bad), 16)


def test_cifar10_pickles(tmp_path):
    for i in range(1, 6):
        batch = {b"data": np.full((3, 3072), i, dtype=np.uint8), b"labels": [i % 10] * 3}
        with open(tmp_path / f"data_batch_{i}", "wb") as f:
            pickle.dump(batch, f)
    data = CIFAR10Dataset(str(tmp_path), random_flip=False)
    assert len(data) == 15
    image, label = data[3]
    assert image.shape == (3, 32, 32) and label == 2 and image[0, 0, 0] == pytest.approx(2 / 127.5 - 1)


# A batch as CIFAR-10's own files were written (Python 2 cPickle, protocol 2: str is bytes, numpy.core globals),
# holding {"data": a (2, 3) uint8 array 1..6, "labels": [1, 2]}.
PYTHON2_BATCH = (
    b"\x80\x02}q\x00(U\x04dataq\x01cnumpy.core.multiarray\n_reconstruct\nq\x02cnumpy\nndarray\nq\x03K\x00\x85U\x01b"
    b"\x87Rq\x04(K\x01K\x02K\x03\x86cnumpy\ndtype\nq\x05U\x02u1K\x00K\x01\x87Rq\x06(K\x03U\x01|NNNJ\xff\xff\xff\xff"
    b"J\xff\xff\xff\xffK\x00tb\x89U\x06\x01\x02\x03\x04\x05\x06tbU\x06labelsq\x07]q\x08(K\x01K\x02eu."
)


def test_cifar10_reads_the_python2_pickle_format(tmp_path):
    (tmp_path / "data_batch_1").write_bytes(PYTHON2_BATCH)
    with open(tmp_path / "data_batch_1", "rb") as f:
        batch = load_cifar10_pickle(f)
    assert batch[b"data"].dtype == np.uint8 and batch[b"labels"] == [1, 2]
    np.testing.assert_array_equal(batch[b"data"], np.arange(1, 7).reshape(2, 3))


class RunsShell:
    """Unpickled by pickle.load, this runs a shell command (harmless here: it writes a marker file)."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"echo pwned > {self.marker}",)


class Evaluates(RunsShell):
    def __reduce__(self):
        return eval, (f"open({str(self.marker)!r}, 'w').close()",)


EXPLOITS = {f"{os.system.__module__}.system": RunsShell, "builtins.eval": Evaluates}  # os.system is posix.system


@pytest.mark.parametrize("refused", EXPLOITS)
def test_cifar10_refuses_pickles_that_run_code(tmp_path, refused):
    marker = tmp_path / "pwned"
    for i in range(1, 6):
        data = EXPLOITS[refused](marker) if i == 3 else np.zeros((1, 3072), dtype=np.uint8)
        with open(tmp_path / f"data_batch_{i}", "wb") as f:
            pickle.dump({b"data": data, b"labels": [0]}, f)
    with pytest.raises(
        pickle.UnpicklingError,
        match=rf"{re.escape(str(tmp_path / 'data_batch_3'))} refers to {re.escape(refused)}, which a CIFAR-10 python "
        "batch may not hold",
    ):
        CIFAR10Dataset(str(tmp_path))
    assert not marker.exists()

    # The prepare script's label names (batches.meta) go through the same reader.
    spec = importlib.util.spec_from_file_location(
        "cifar10_prepare", Path(__file__).parents[1] / "data/cifar10/prepare.py"
    )
    prepare = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(prepare)
    with open(tmp_path / "batches.meta", "wb") as f:
        pickle.dump({b"label_names": [b"airplane", b"automobile"]}, f)
    assert prepare.class_names(str(tmp_path)) == ["airplane", "automobile"]
    with open(tmp_path / "batches.meta", "wb") as f:
        pickle.dump({b"label_names": EXPLOITS[refused](marker)}, f)
    with pytest.raises(pickle.UnpicklingError, match=rf"batches\.meta refers to {re.escape(refused)}"):
        prepare.class_names(str(tmp_path))
    assert not marker.exists()


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


class _IndexedImages(torch.utils.data.Dataset):
    """uint8 'images' (1, 4, 4) that hold their index (mod 256), label index % 10; with `noise`, an added random
    draw from the global generator stands for a random augmentation (flips)."""

    def __init__(self, length: int = 200, noise: bool = False):
        self.length, self.noise = length, noise

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int):
        image = torch.full((1, 4, 4), index % 256, dtype=torch.uint8)
        if self.noise:
            image += torch.randint(0, 8, (), dtype=torch.uint8)
        return image, index % 10


def _poisson_loader(data, workers: int, num_steps: int = 3) -> PoissonDataLoader:
    sampler = PoissonBatchSampler(len(data), 16 / len(data), num_steps, seed=5, rank=1, world_size=2)
    config = dataclasses.replace(JobConfig().training.dataloader, num_workers=workers, persistent_workers=False)
    return PoissonDataLoader(data, sampler, 8, config)


def test_poisson_loader_workers_yield_the_batches_of_this_process():
    """Whole padded batches built by 2 workers equal those built here, step by step and past the sampler's
    num_steps (the draws go on, as measurements that outrun a config's steps need); the images keep their dtype.
    Starting the iterations draws nothing from the global generator (it would shift a resumed run's noise)."""
    data = _IndexedImages()
    rng = torch.get_rng_state()
    here, workers = _poisson_loader(data, 0), _poisson_loader(data, 2)
    for step in range(5):  # num_steps is 3
        indices, mask = pad_batch(here.batch_sampler.batch(step), here.padded_size)
        images, labels, drawn = next(here)
        assert images.dtype == torch.uint8 and labels.dtype == torch.long and drawn.dtype == torch.bool
        assert torch.equal(images[:, 0, 0, 0], torch.tensor(indices, dtype=torch.uint8))
        assert torch.equal(labels, torch.tensor(indices) % 10) and torch.equal(drawn, mask)
        assert 0 < mask.sum() < len(mask)  # a drawn batch and padding
        assert all(torch.equal(a, b) for a, b in zip((images, labels, drawn), next(workers), strict=True))
    assert here.state_dict() == workers.state_dict() == {"step": 5}
    assert torch.equal(torch.get_rng_state(), rng)


def test_poisson_loader_with_workers_resumes_with_the_next_batch():
    """The saved position is the batches handed out, not the workers' read-ahead; a fresh loader, or this one
    mid-iteration (its prefetched batches dropped), resumes bitwise, random augmentations in the workers too."""
    data = _IndexedImages(noise=True)
    loader = _poisson_loader(data, 2, num_steps=10)
    for _ in range(3):
        next(loader)
    state = loader.state_dict()
    assert state == {"step": 3} and loader.batch_sampler.step == 3  # 2 workers x prefetch 2 read ahead
    expected = [next(loader) for _ in range(2)]
    resumed = _poisson_loader(data, 2, num_steps=10)
    resumed.load_state_dict(state)
    loader.load_state_dict(state)
    for loaded in (resumed, loader):
        for batch in expected:
            assert all(torch.equal(a, b) for a, b in zip(batch, next(loaded), strict=True))
        assert loaded.state_dict() == {"step": 5}
