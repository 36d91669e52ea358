"""Class subfolders of images (ImageNet layout), center-cropped and flipped as ADM/DiT do."""

from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torch.utils.data import Dataset

from torchtitan.tools.logging import logger

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".bmp", ".webp", ".JPEG")
# What PIL raises for a file it cannot decode: OSError for a truncated or corrupt stream ("image file is
# truncated", UnidentifiedImageError) and for the read itself, SyntaxError from some format plugins.
UNREADABLE_IMAGE_ERRORS = (OSError, SyntaxError)


class UnreadableImageError(OSError):
    """An image of the folder cannot be read or decoded; the message names the file (train.py prints it as one
    `error:` line, not a traceback).

    A loader worker's exception reaches the main process rebuilt from one string, "Caught ... Original
    Traceback ...", holding the worker's traceback: the message is cut back to this error's own text.
    """

    def __init__(self, message: str):
        marker = f"{type(self).__module__}.{type(self).__qualname__}: "
        if message.startswith("Caught ") and marker in message:  # re-raised from a loader worker
            message = message.rsplit(marker, 1)[1].strip()
        super().__init__(message)


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
    if path.is_file():
        raise ValueError(f"training.dataset_path: {root} is a file, not an image folder (a folder of class "
                         "subfolders of images)")  # fmt: skip
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
    """RGB images (3, size, size) as uint8 with random horizontal flips; the device maps them to [-1, 1]
    (torchtitan.datasets.prefetch), so a batch crosses the loader's workers and PCIe at a quarter of float32's size.

    Args:
        root: the folder of class subfolders.
        image_size: the side of the square center crop.
        random_flip: flip horizontally with probability 1/2.
        skip_unreadable_images: an image that cannot be decoded is logged by name and replaced by the next
            readable one (the next index, wrapping), with its label; `skipped` holds the skipped files.
            Without it, reading such an image raises an `UnreadableImageError` naming the file.

    With loader workers each worker holds its own copy of the dataset: its warnings carry that worker's count,
    and `skipped` of the main process's copy sees only what the main process read.
    """

    def __init__(self, root: str, image_size: int, random_flip: bool = True, skip_unreadable_images: bool = False):
        self.root = root
        self.samples, self.classes = list_image_folder(root)
        self.num_classes = len(self.classes)
        self.image_size = image_size
        self.random_flip = random_flip
        self.skip_unreadable_images = skip_unreadable_images
        self.skipped: set[Path] = set()

    def __len__(self) -> int:
        return len(self.samples)

    def _read(self, path: Path) -> torch.Tensor:
        with Image.open(path) as image:
            image = center_crop_arr(image.convert("RGB"), self.image_size)
        # (H, W, 3) -> (3, H, W) in numpy: torch's strided uint8 copy (permute + contiguous) took 8 ms of a 256 px
        # image's 9 on a 2-core host, numpy's 0.15 ms.
        return torch.from_numpy(np.ascontiguousarray(np.asarray(image).transpose(2, 0, 1)))  # (3, H, W) uint8

    def load(self, index: int) -> torch.Tensor:
        """The center-cropped image (3, H, W), uint8, not flipped.

        Raises:
            UnreadableImageError: the file cannot be read or decoded (truncated, corrupt); the message names it.
        """
        path = self.samples[index][0]
        try:
            return self._read(path)
        except UNREADABLE_IMAGE_ERRORS as err:
            raise UnreadableImageError(
                f"training.dataset_path: image {path} cannot be read ({type(err).__name__}: {err}); "
                "training.dataloader.skip_unreadable_images = true replaces such files by the next readable one"
            ) from err

    def _load_readable(self, index: int) -> tuple[torch.Tensor, int]:
        """The first readable image from `index` on (wrapping) and its index; the unreadable ones are skipped."""
        for offset in range(len(self.samples)):
            candidate = (index + offset) % len(self.samples)
            path = self.samples[candidate][0]
            if path in self.skipped:  # already known unreadable: not decoded (and logged) again
                continue
            try:
                return self._read(path), candidate
            except UNREADABLE_IMAGE_ERRORS as err:
                self.skipped.add(path)
                logger.warning(
                    f"training.dataset_path: skipping unreadable image {path} ({type(err).__name__}: {err}); "
                    f"the next readable image takes its place; {len(self.skipped)} unreadable image(s) skipped so far"
                )
        raise UnreadableImageError(f"training.dataset_path: none of the {len(self.samples)} images under {self.root} "
                                   "can be read")  # fmt: skip

    def __getitem__(self, index: int):
        if self.skip_unreadable_images:
            image, index = self._load_readable(index)
        else:
            image = self.load(index)
        if self.random_flip and torch.rand(()) < 0.5:
            image = torch.from_numpy(image.numpy()[:, :, ::-1].copy())  # as above: numpy's copy, not torch's flip
        return image, self.samples[index][1]
