"""scikit-learn's handwritten digits (1797 real 8x8 images shipped inside the package), upsampled.

The embedded default dataset: no download, trains a tiny DiT on a laptop CPU in minutes. The images are read from
the file scikit-learn ships them in (`sklearn/datasets/data/digits.csv.gz`: 64 pixel values 0..16, then the label,
a row each), found without importing scikit-learn: its import (SciPy's included) took 1.7 s of every run's start.
"""

import gzip
import importlib.util
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import Dataset


def digits_file() -> Path:
    """The digits' CSV inside the installed scikit-learn."""
    spec = importlib.util.find_spec("sklearn")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("training.dataset 'digits' needs scikit-learn, which ships the images: not installed")
    path = Path(next(iter(spec.submodule_search_locations))) / "datasets" / "data" / "digits.csv.gz"
    if not path.is_file():
        raise FileNotFoundError(f"training.dataset 'digits': {path} is missing from the installed scikit-learn")
    return path


def load_digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    """(images (1797, 8, 8) float64 in 0..16, labels (1797,) int64), as sklearn.datasets.load_digits gives them."""
    with gzip.open(digits_file(), "rt") as f:
        table = np.loadtxt(f, delimiter=",")
    return table[:, :-1].reshape(-1, 8, 8), table[:, -1].astype(np.int64)


HELD_OUT = 197  # the last images: the held-out split of a DiT's fixed-timestep loss (1600 train on)
SPLITS = ("all", "train", "validation")


class DigitsDataset(Dataset):
    """1 x size x size images in [-1, 1] with labels 0..9.

    Args:
        image_size: the side the 8 x 8 images are upsampled to.
        split: "all" (1797 images), or "train" (the first 1600) and "validation" (the last 197), what a run with
            a fixed-timestep validation loss trains on and holds out.
    """

    num_classes = 10

    def __init__(self, image_size: int = 16, split: str = "all"):
        if split not in SPLITS:
            raise ValueError(f"digits split {split!r}: must be one of {list(SPLITS)}")
        pixels, labels = load_digits_arrays()
        if split != "all":
            kept = slice(-HELD_OUT, None) if split == "validation" else slice(None, -HELD_OUT)
            pixels, labels = pixels[kept], labels[kept]
        images = torch.tensor(pixels, dtype=torch.float32).unsqueeze(1) / 16.0  # (N, 1, 8, 8) in [0, 1]
        if image_size != 8:
            images = F.interpolate(images, size=(image_size, image_size), mode="bilinear", align_corners=False)
        self.images = (images.clamp(0, 1) * 2 - 1).contiguous()
        self.labels = torch.from_numpy(labels)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int):
        return self.images[index], self.labels[index]
