"""Frechet Inception Distance: the TensorFlow Inception graph ADM's evaluator runs, as pytorch-fid ports it.

The network is pytorch-fid's `InceptionV3` built as `use_fid_inception=True`: the port of TensorFlow's
`inception-2015-12-05` graph (`classify_image_graph_def.pb`) that ADM's evaluation suite (openai/guided-diffusion
`evaluations/evaluator.py`) and the original TTUR code use, with its TF-style pooling. Its weights
(`pt_inception-2015-12-05-6726825d.pth`) come from a local file; nothing is downloaded.

ADM feeds float images in [0, 255] to the graph's `ExpandDims:0`, after which the graph itself resizes them to
299 x 299 (`ResizeBilinear`, TF1's legacy sampling: no half-pixel offset) and maps them to (x - 128) / 128. We do the
same (`tf_preprocess`; it matches TensorFlow 2.21's ResizeBilinear to 4e-6 grey levels on 256 -> 299) rather than
what pytorch-fid does (half-pixel bilinear, then 2x - 1 on [0, 1]): on random 256 x 256 images pytorch-fid's 299
x 299 input is 6.9 grey levels from the graph's on average, 32 at most. One pass gives ADM's two feature sets:
`pool_3` (2048: FID, IS, precision and recall) and the first 7 channels of `mixed_6/conv` (sFID), the ReLU output of
Mixed_6d's 1 x 1 branch (TF's mixed = Mixed_5b, ..., mixed_6 = Mixed_6d), 17 x 17 x 7 flattened in TF's (h, w, c)
order so that its statistics compare with ADM's stored `mu_s`/`sigma_s`. Convolutions run in true fp32 (no TF32),
and features and statistics are float64.

What is left between these features and the graph's is the float32 arithmetic of the convolutions (cuDNN or the
CPU against TensorFlow's kernels), if pytorch-fid's port holds the graph's weights exactly. Measuring it needs
TensorFlow and `classify_image_graph_def.pb` (not reachable here): the same images through both, compared feature
for feature (pool_3 and mixed_6/conv), and ADM's published sample batch (admnet_guided_upsampled_imagenet256.npz)
scored by both against VIRTUAL_imagenet256_labeled.npz (its README: IS 215.84, FID 3.943, sFID 6.140, precision
0.8265, recall 0.5309).

The distance is computed here rather than with pytorch-fid 0.3's `calculate_frechet_distance`, which passes
`disp=` to `scipy.linalg.sqrtm`: an argument SciPy 1.18 removed.
"""

import contextlib
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

FEATURE_DIMS = (64, 192, 768, 2048)  # pytorch-fid's output blocks; 2048 = pool3, the standard FID
INCEPTION_SIZE = 299  # the graph's ResizeBilinear/size
MIXED_6 = 6  # TF's mixed_6 is torchvision's Mixed_6d, the 7th module of pytorch-fid's block 2
SPATIAL_CHANNELS = 7  # ADM's evaluator keeps mixed_6/conv[..., :7]: 17 * 17 * 7 = 2023 features
SPATIAL_DIMS = 17 * 17 * SPATIAL_CHANNELS


def build_inception(weights: str | Path, device: torch.device | str = "cpu", dims: int = 2048) -> nn.Module:
    """pytorch-fid's FID InceptionV3 (eval mode) with the state dict stored at `weights`.

    The network takes TF-preprocessed 299 x 299 input (`tf_preprocess`). It keeps the state dict's `fc.weight`
    (1008 x 2048, the graph's `softmax/logits` weight, which ADM's Inception Score applies to pool_3) as
    `model.logits_weight`, and its block's size as `model.feature_dims`.

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
        model = inception.InceptionV3([inception.InceptionV3.BLOCK_INDEX_BY_DIM[dims]], resize_input=False,
                                      normalize_input=False, use_fid_inception=True)  # fmt: skip
    model.logits_weight = state["fc.weight"].double()  # the load above checked that the key is there
    model.feature_dims = dims
    return model.to(device).eval()


def _legacy_bilinear_taps(in_size: int, out_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """TF1 ResizeBilinear's source taps with align_corners = half_pixel_centers = False: output i samples input
    i * (in / out) in float32 (no half-pixel offset), between floor and min(ceil, in - 1)."""
    scale = np.float32(in_size) / np.float32(out_size)
    position = torch.arange(out_size, dtype=torch.float32) * torch.tensor(scale, dtype=torch.float32)
    lower = position.floor()
    upper = position.ceil().clamp(max=in_size - 1)
    return lower.long(), upper.long(), position - lower


def tf_preprocess(images: torch.Tensor, size: int = INCEPTION_SIZE) -> torch.Tensor:
    """(B, H, W, 3) uint8 -> (B, 3, size, size) float32, as the Inception graph's own nodes after `ExpandDims`.

    ResizeBilinear interpolates along the width first, then the height, in float32 (TF's kernel order); then
    Sub 128 and Mul 1/128. pytorch-fid instead samples at half-pixel centres and maps [0, 255] to [-1, 1].
    """
    x = images.permute(0, 3, 1, 2).float()  # (B, 3, H, W)
    y0, y1, y_lerp = (t.to(x.device) for t in _legacy_bilinear_taps(x.shape[2], size))
    x0, x1, x_lerp = (t.to(x.device) for t in _legacy_bilinear_taps(x.shape[3], size))
    left, right = x[..., x0], x[..., x1]  # (B, 3, H, size)
    rows = left + (right - left) * x_lerp
    top, bottom = rows[:, :, y0], rows[:, :, y1]  # (B, 3, size, size)
    resized = top + (bottom - top) * y_lerp[:, None]
    return (resized - 128.0) * 0.0078125


@contextlib.contextmanager
def exact_fp32():
    """True fp32 convolutions and matmuls on CUDA (no TF32): the graph's arithmetic, the same features on any GPU."""
    conv, matmul = torch.backends.cudnn.conv.fp32_precision, torch.backends.cuda.matmul.fp32_precision
    torch.backends.cudnn.conv.fp32_precision = torch.backends.cuda.matmul.fp32_precision = "ieee"
    try:
        yield
    finally:
        torch.backends.cudnn.conv.fp32_precision, torch.backends.cuda.matmul.fp32_precision = conv, matmul


def _check_images(images: np.ndarray, name: str = "images") -> None:
    if images.ndim != 4 or images.shape[-1] != 3 or images.dtype != np.uint8:
        raise ValueError(f"{name} must be (N, H, W, 3) uint8 images (ADM's arr_0), got {images.shape} {images.dtype}")


@torch.no_grad()
def _passes(model: nn.Module, images: np.ndarray, batch_size: int, progress: bool, spatial: bool):
    """Yields each batch's (block features, mixed_6/conv[..., :7] or None), both (B, -1) float64 on the CPU."""
    from tqdm import tqdm

    _check_images(images)
    captured = []
    hook = None
    if spatial:  # the 1 x 1 branch's ReLU output is TF's mixed_6/conv; Mixed_6d's forward is pytorch-fid's own
        hook = model.blocks[2][MIXED_6].branch1x1.register_forward_hook(lambda m, i, out: captured.append(out))
    device = next(model.parameters()).device
    try:
        for start in tqdm(range(0, len(images), batch_size), desc="inception", disable=not progress):
            x = tf_preprocess(torch.from_numpy(images[start : start + batch_size]).to(device))
            with exact_fp32():  # around the forward alone: the caller's code runs between batches
                out = model(x)[0]
            if out.shape[-1] != 1:  # the smaller feature blocks are spatial: average them, as pytorch-fid does
                out = F.adaptive_avg_pool2d(out, 1)
            cut = None
            if spatial:  # (B, 192, 17, 17) -> TF's NHWC order, first 7 channels
                cut = captured.pop()[:, :SPATIAL_CHANNELS].permute(0, 2, 3, 1).flatten(1).double().cpu()
            yield out.flatten(1).double().cpu(), cut
    finally:
        if hook is not None:
            hook.remove()


def inception_features(model: nn.Module, images: np.ndarray, batch_size: int = 50, progress: bool = False):
    """(N, H, W, 3) uint8 images -> (N, dims) float64 features of the model's block (pool_3 at 2048)."""
    return torch.cat([pool for pool, _ in _passes(model, images, batch_size, progress, False)]).numpy()


def adm_features(model: nn.Module, images: np.ndarray, batch_size: int = 50, progress: bool = False):
    """One Inception pass, ADM's two feature sets: ((N, 2048) pool_3, (N, 2023) mixed_6/conv[..., :7]), float64.

    Raises:
        ValueError: the model is not the 2048 (pool_3) network, or the images are not (N, H, W, 3) uint8.
    """
    if getattr(model, "feature_dims", None) != 2048:
        raise ValueError("ADM's features need the pool_3 network (--dims 2048)")
    outputs = list(_passes(model, images, batch_size, progress, True))
    return torch.cat([p for p, _ in outputs]).numpy(), torch.cat([s for _, s in outputs]).numpy()


def feature_statistics(features: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(mu, sigma): mean and covariance of the features (rows are samples)."""
    if len(features) < 2:
        raise ValueError("FID needs at least 2 images per set")
    return features.mean(0), np.cov(features, rowvar=False)


def _psd_factor(sigma: np.ndarray) -> torch.Tensor:
    """F with F F^T = sigma (symmetric positive semi-definite), of sigma's numerical rank in columns.

    LAPACK's pivoted Cholesky (dpstrf) stops where the remaining pivots fall below n * eps * max(diag): the
    directions it drops hold no more than that much variance each.
    """
    from scipy.linalg import lapack

    lower, pivots, rank, info = lapack.dpstrf(sigma, lower=1)
    if info < 0:
        raise ValueError(f"the covariance is not a square float matrix (LAPACK dpstrf info {info})")
    factor = np.zeros((len(sigma), rank))
    factor[pivots - 1] = np.tril(lower)[:, :rank]  # P^T sigma P = L L^T, so sigma = (P L)(P L)^T
    return torch.from_numpy(factor)


def frechet_distance(mu1: np.ndarray, sigma1: np.ndarray, mu2: np.ndarray, sigma2: np.ndarray) -> float:
    """||mu1 - mu2||^2 + tr(sigma1 + sigma2 - 2 (sigma1 sigma2)^(1/2)) between two Gaussians.

    For any factors sigma1 = F1 F1^T and sigma2 = F2 F2^T, sigma1 sigma2 has the non-zero spectrum of
    (F1^T F2)(F1^T F2)^T, so tr((sigma1 sigma2)^(1/2)) is the sum of the singular values of F1^T F2. Pivoted
    Cholesky factors and one SVD replace a general matrix square root: faster (at 2048 on 2 cores: scipy's
    sqrtm ~20 s, symmetric square roots by eigendecomposition 6-26 s, this 2.3-5 s, and well under a second
    for the low-rank covariances of small sets), with no square-rooted round-off, which would leave a set's
    FID with itself far from 0.
    """
    mu1, mu2, sigma1, sigma2 = (np.asarray(a, dtype=np.float64) for a in (mu1, mu2, sigma1, sigma2))
    if mu1.shape != mu2.shape or sigma1.shape != sigma2.shape:
        raise ValueError(f"statistics disagree in size: mu {mu1.shape} vs {mu2.shape} (same --dims for both)")
    cross = _psd_factor(sigma1).T @ _psd_factor(sigma2)  # (rank1, rank2)
    trace_sqrt = torch.linalg.svdvals(cross).sum().item() if cross.numel() else 0.0
    diff = mu1 - mu2
    return float(diff @ diff + np.trace(sigma1) + np.trace(sigma2) - 2 * trace_sqrt)


STATISTICS_KEYS = {"pool": ("mu", "sigma"), "spatial": ("mu_s", "sigma_s")}  # as ADM's reference batches store them


@dataclass
class EvalBatch:
    """What one ADM .npz gives the evaluation (evaluator.py's read_activations and read_statistics).

    Attributes:
        path: the file.
        pool: (N, dims) float64 features of its `arr_0` images (pool_3 at 2048); None when they were not needed
            or the file holds statistics only.
        spatial: (N, 2023) float64 mixed_6/conv[..., :7] features (the 2048 network only), or None.
        statistics: (mu, sigma), stored in the file, else those of `pool`.
        spatial_statistics: (mu_s, sigma_s), stored, else those of `spatial`; None below 2048.
    """

    path: Path
    pool: np.ndarray | None
    spatial: np.ndarray | None
    statistics: tuple[np.ndarray, np.ndarray]
    spatial_statistics: tuple[np.ndarray, np.ndarray] | None


def _array(data, path: Path, key: str) -> np.ndarray:
    try:
        return data[key]
    except ValueError as e:  # an object array: np.load refuses to unpickle it (allow_pickle=False)
        raise ValueError(f"{path}: {key} cannot be read ({e})") from e


def _stored_pair(data, path: Path, keys: tuple[str, str], dims: int | None) -> tuple[np.ndarray, ...] | None:
    """A stored (mean, covariance) pair as float64, or None when neither key is there; checked against dims."""
    present = [k for k in keys if k in data.files]
    if not present:
        return None
    if len(present) == 1:
        missing = next(k for k in keys if k not in present)
        raise ValueError(f"{path}: has {present[0]} but no {missing} (statistics are stored as {keys[0]}/{keys[1]})")
    pair = tuple(_array(data, path, k).astype(np.float64) for k in keys)
    for key, value, shape in zip(keys, pair, ((dims,), (dims, dims)), strict=True):
        if dims is not None and value.shape != shape:
            raise ValueError(f"{path}: {key} has shape {value.shape}, expected {shape}")
        if not np.isfinite(value).all():
            raise ValueError(f"{path}: {key} holds non-finite values")
    return pair


def read_eval_batch(path: str | Path, model: nn.Module | None, batch_size: int = 50, images: bool = True,
                    progress: bool = False, check_shapes: bool = True) -> EvalBatch:  # fmt: skip
    """An ADM .npz (samples or a reference batch such as VIRTUAL_imagenet256_labeled.npz) as features and statistics.

    ADM's files hold `arr_0` (N, H, W, 3) uint8 images and, for reference batches, the statistics of the whole
    dataset: `mu`/`sigma` (pool_3) and `mu_s`/`sigma_s` (spatial). Stored statistics are used as stored; the images
    go through the network when `images` is set (precision, recall and IS need their features) or when statistics
    are missing.

    Args:
        path: the .npz.
        model: `build_inception`'s network (None: statistics-only files).
        batch_size: images per Inception batch.
        images: run `arr_0` through the network even when statistics are stored.
        progress: a progress bar on stderr.
        check_shapes: refuse stored statistics whose size is not the network's.

    Raises:
        FileNotFoundError: no such file.
        ValueError: not an .npz, a key missing or of the wrong shape or type (the message names file and key).
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist")
    dims = getattr(model, "feature_dims", None)
    try:
        data = np.load(path)  # allow_pickle=False: nothing in the file is ever unpickled
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: not an .npz file ({e})") from e
    if not isinstance(data, np.lib.npyio.NpzFile):
        raise ValueError(f"{path}: a single .npy array, not an .npz with arr_0 (and mu/sigma)")
    with data:
        statistics = _stored_pair(data, path, STATISTICS_KEYS["pool"], dims if check_shapes else None)
        spatial_statistics = None
        if dims == 2048:
            spatial_statistics = _stored_pair(data, path, STATISTICS_KEYS["spatial"], SPATIAL_DIMS)
        if "arr_0" not in data.files:
            if statistics is None:
                raise ValueError(f"{path}: has neither arr_0 images nor mu/sigma statistics (keys: {data.files})")
            return EvalBatch(path, None, None, statistics, spatial_statistics)
        missing = statistics is None or (dims == 2048 and spatial_statistics is None)
        if not (images or missing):
            return EvalBatch(path, None, None, statistics, spatial_statistics)
        pixels = _array(data, path, "arr_0")
    _check_images(pixels, f"{path}: arr_0")
    if len(pixels) < 2:
        raise ValueError(f"{path}: arr_0 holds {len(pixels)} image(s); FID needs at least 2")
    if model is None:
        raise ValueError(f"{path} holds images: an Inception network is needed")
    progress = progress and len(pixels) > batch_size
    if dims == 2048:
        pool, spatial = adm_features(model, pixels, batch_size, progress)
        spatial_statistics = spatial_statistics or feature_statistics(spatial)
    else:
        pool, spatial = inception_features(model, pixels, batch_size, progress), None
    return EvalBatch(path, pool, spatial, statistics or feature_statistics(pool), spatial_statistics)


def load_statistics(path: str | Path, model: nn.Module | None, batch_size: int = 50) -> tuple[np.ndarray, ...]:
    """(mu, sigma) of an .npz: stored `mu`/`sigma` (ADM reference batch), else computed from `arr_0` images.

    Stored statistics are returned whatever their size: the caller names its own setting when they disagree.
    """
    return read_eval_batch(path, model, batch_size, images=False, progress=True, check_shapes=False).statistics
