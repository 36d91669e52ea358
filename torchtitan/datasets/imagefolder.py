"""Class subfolders of images (ImageNet layout), center-cropped and flipped as ADM/DiT do."""

from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torch.utils.data import Dataset

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".bmp", ".webp", ".JPEG")


def center_crop_arr(image: Image.Image, image_size: int) -> Image.Image:
    """ADM's center crop: halve with BOX while large, resize with BICUBIC, then crop the center."""
    while min(*image.size) >= 2 * image_size:
        image = image.resize(tuple(x // 2 for x in image.size), resample=Image.BOX)
    scale = image_size / min(*image.size)
    image = image.resize(tuple(round(x * scale) for x in image.size), resample=Image.BICUBIC)
    arr = np.array(image)
    top, left = (arr.shape[0] - image_size) // 2, (arr.shape[1] - image_size) // 2
    return Image.fromarray(arr[top : top + image_size, left : left + image_size])


def list_image_folder(root: str) -> tuple[list[tuple[Path, int]], list[str]]:
    """(path, class index) pairs and the sorted class names; raises naming the path if none."""
    path = Path(root)
    if not path.is_dir():
        raise FileNotFoundError(f"training.dataset_path: image folder {root} does not exist")
    classes = sorted(p.name for p in path.iterdir() if p.is_dir())
    samples = [
        (file, index)
        for index, name in enumerate(classes)
        for file in sorted((path / name).rglob("*"))
        if file.suffix in IMAGE_EXTENSIONS
    ]
    if not samples:
        raise FileNotFoundError(f"training.dataset_path: no images in class subfolders of {root}")
    return samples, classes


class ImageFolderDataset(Dataset):
    """RGB images (3, size, size) in [-1, 1] with random horizontal flips."""

    def __init__(self, root: str, image_size: int, random_flip: bool = True):
        self.samples, self.classes = list_image_folder(root)
        self.num_classes = len(self.classes)
        self.image_size = image_size
        self.random_flip = random_flip

    def __len__(self) -> int:
        return len(self.samples)

    def load(self, index: int) -> torch.Tensor:
        """The center-cropped image (3, H, W) in [-1, 1], not flipped."""
        with Image.open(self.samples[index][0]) as image:
            image = center_crop_arr(image.convert("RGB"), self.image_size)
        return torch.from_numpy(np.asarray(image).copy()).permute(2, 0, 1).float() / 127.5 - 1.0

    def __getitem__(self, index: int):
        image = self.load(index)
        if self.random_flip and torch.rand(()) < 0.5:
            image = image.flip(-1)
        return image, self.samples[index][1]
