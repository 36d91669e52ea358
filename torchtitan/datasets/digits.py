"""scikit-learn's handwritten digits (1797 real 8x8 images shipped inside the package), upsampled.

The embedded default dataset: no download, trains a tiny DiT on a laptop CPU in minutes.
"""

import torch
import torch.nn.functional as F
from torch.utils.data import Dataset


class DigitsDataset(Dataset):
    """1 x size x size images in [-1, 1] with labels 0..9."""

    num_classes = 10

    def __init__(self, image_size: int = 16):
        from sklearn.datasets import load_digits

        digits = load_digits()
        images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0  # (N, 1, 8, 8) in [0, 1]
        if image_size != 8:
            images = F.interpolate(images, size=(image_size, image_size), mode="bilinear", align_corners=False)
        self.images = (images.clamp(0, 1) * 2 - 1).contiguous()
        self.labels = torch.tensor(digits.target, dtype=torch.long)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int):
        return self.images[index], self.labels[index]
