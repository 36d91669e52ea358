"""Frechet Inception Distance: pytorch-fid's InceptionV3 (weights from a local file), our Frechet distance.

The network is pytorch-fid's `InceptionV3` built as `use_fid_inception=True`: the port of the TensorFlow
Inception graph that ADM's evaluation suite and the original TTUR code use (pool3, 2048 features), with
its TF-style pooling. Its weights (`pt_inception-2015-12-05-6726825d.pth`) come from `--inception-weights`;
nothing is downloaded. Images are resized to 299 x 299 bilinearly in PyTorch, which differs slightly from
TF's resize: numbers track ADM's evaluator closely but are not bit-identical to it.

The distance is computed here rather than with pytorch-fid 0.3's `calculate_frechet_distance`, which passes
`disp=` to `scipy.linalg.sqrtm`: an argument SciPy 1.18 removed.
"""

from pathlib import Path
from unittest import mock

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

FEATURE_DIMS = (64, 192, 768, 2048)  # pytorch-fid's output blocks; 2048 = pool3, the standard FID


def build_inception(weights: str | Path, device: torch.device | str = "cpu", dims: int = 2048) -> nn.Module:
    """pytorch-fid's FID InceptionV3 (eval mode) with the state dict stored at `weights`.

    Raises:
        FileNotFoundError: the weights file is missing (the message names it).
        ValueError: dims is not one of 64, 192, 768, 2048.
    """
    from pytorch_fid import inception

    path = Path(weights)
    if not path.is_file():
        raise FileNotFoundError(f"--inception-weights: {path} does not exist (pytorch-fid's FID Inception "
                                "weights, pt_inception-2015-12-05-6726825d.pth)")  # fmt: skip
    if dims not in FEATURE_DIMS:
        raise ValueError(f"--dims {dims}: must be one of {FEATURE_DIMS}")
    state = torch.load(path, map_location="cpu", weights_only=True)
    # pytorch-fid fetches these weights by URL while building the network: hand it the local file instead.
    with mock.patch.object(inception, "load_state_dict_from_url", lambda *args, **kwargs: state):
        model = inception.InceptionV3([inception.InceptionV3.BLOCK_INDEX_BY_DIM[dims]], use_fid_inception=True)
    return model.to(device).eval()


@torch.no_grad()
def inception_features(model: nn.Module, images: np.ndarray, batch_size: int = 50, progress: bool = False):
    """(N, H, W, 3) uint8 images -> (N, dims) float64 features."""
    from tqdm import tqdm

    if images.ndim != 4 or images.shape[-1] != 3 or images.dtype != np.uint8:
        raise ValueError(f"images must be (N, H, W, 3) uint8 (ADM's arr_0), got {images.shape} {images.dtype}")
    device = next(model.parameters()).device
    features = []
    for start in tqdm(range(0, len(images), batch_size), desc="inception", disable=not progress):
        batch = torch.from_numpy(images[start : start + batch_size]).to(device)
        x = batch.permute(0, 3, 1, 2).float() / 255.0  # pytorch-fid takes [0, 1] and resizes to 299 itself
        out = model(x)[0]
        if out.shape[-1] != 1:  # the smaller feature blocks are spatial: average them, as pytorch-fid does
            out = F.adaptive_avg_pool2d(out, 1)
        features.append(out.flatten(1).double().cpu())
    return torch.cat(features).numpy()


def feature_statistics(features: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(mu, sigma): mean and covariance of the features (rows are samples)."""
    if len(features) < 2:
        raise ValueError("FID needs at least 2 images per set")
    return features.mean(0), np.cov(features, rowvar=False)


def _psd_sqrt(sigma: np.ndarray) -> np.ndarray:
    """Square root of a symmetric positive semi-definite matrix (tiny negative eigenvalues clipped)."""
    values, vectors = np.linalg.eigh(sigma)
    return (vectors * np.sqrt(values.clip(min=0))) @ vectors.T


def frechet_distance(mu1: np.ndarray, sigma1: np.ndarray, mu2: np.ndarray, sigma2: np.ndarray) -> float:
    """||mu1 - mu2||^2 + tr(sigma1 + sigma2 - 2 (sigma1 sigma2)^(1/2)) between two Gaussians.

    sigma1 sigma2 has the spectrum of (R1 R2)(R1 R2)^T with R = sigma^(1/2), so tr((sigma1 sigma2)^(1/2)) is
    the sum of the singular values of R1 R2. Two symmetric eigendecompositions and an SVD replace a general
    matrix square root: faster (scipy's sqrtm takes ~20 s at 2048 x 2048 on one core) and, on the singular
    covariances of small sets, free of the square-rooted round-off that leaves a set's FID with itself far
    from 0.
    """
    mu1, mu2, sigma1, sigma2 = (np.asarray(a, dtype=np.float64) for a in (mu1, mu2, sigma1, sigma2))
    if mu1.shape != mu2.shape or sigma1.shape != sigma2.shape:
        raise ValueError(f"statistics disagree in size: mu {mu1.shape} vs {mu2.shape} (same --dims for both)")
    trace_sqrt = np.linalg.svd(_psd_sqrt(sigma1) @ _psd_sqrt(sigma2), compute_uv=False).sum()
    diff = mu1 - mu2
    return float(diff @ diff + np.trace(sigma1) + np.trace(sigma2) - 2 * trace_sqrt)


def load_statistics(path: str | Path, model: nn.Module | None, batch_size: int = 50) -> tuple[np.ndarray, ...]:
    """(mu, sigma) of an .npz: stored `mu`/`sigma` (ADM reference batch), else computed from `arr_0` images."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist")
    with np.load(path) as data:
        if "mu" in data.files and "sigma" in data.files:
            return data["mu"], data["sigma"]
        if "arr_0" not in data.files:
            raise ValueError(f"{path} has neither mu/sigma nor arr_0 images (keys: {data.files})")
        images = data["arr_0"]
    if model is None:
        raise ValueError(f"{path} holds images: an Inception network is needed")
    return feature_statistics(inception_features(model, images, batch_size, progress=len(images) > batch_size))
