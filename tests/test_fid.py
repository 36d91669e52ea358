"""FID: pytorch-fid's InceptionV3 with weights from a local file (random here), statistics, the CLI."""

import importlib.util
import json

import numpy as np
import pytest
import torch

from tests.conftest import ROOT
from torchtitan.tools.fid import build_inception, feature_statistics, frechet_distance, inception_features


@pytest.fixture(scope="module")
def inception_weights(tmp_path_factory):
    """A random InceptionV3 state dict with the FID network's keys, its batch norms calibrated on noise.

    Calibrating the running statistics keeps features O(1): with the defaults they grow to ~1e10.
    """
    import torchvision

    torch.manual_seed(0)
    net = torchvision.models.inception_v3(weights=None, aux_logits=False, num_classes=1008, init_weights=False)
    for module in net.modules():
        if isinstance(module, torch.nn.BatchNorm2d):
            module.momentum = None  # a plain average over the calibration batch
    with torch.no_grad():
        net.train()(torch.rand(4, 3, 96, 96) * 2 - 1)  # small: only the statistics' scale matters
    path = tmp_path_factory.mktemp("fid") / "inception.pth"
    torch.save(net.state_dict(), path)
    return path


def image_sets():
    rng = np.random.default_rng(0)
    a = rng.integers(0, 128, (10, 16, 16, 3), dtype=np.uint8)
    b = rng.integers(0, 128, (10, 16, 16, 3), dtype=np.uint8)  # same distribution as a
    shifted = (a.astype(np.int64) + 100).clip(0, 255).astype(np.uint8)  # brighter: another distribution
    return a, b, shifted


def test_fid_of_a_set_with_itself_is_zero_and_grows_with_a_shift(inception_weights):
    model = build_inception(inception_weights, dims=64)  # the first block: fast, and 10 images span more of it
    a, b, shifted = image_sets()
    stats = [feature_statistics(inception_features(model, x, batch_size=5)) for x in (a, b, shifted)]
    same, similar, far = (frechet_distance(*stats[0], *s) for s in stats)
    assert abs(same) < 1e-6 * far
    assert 0 < similar < far


def test_pool3_features(inception_weights):
    model = build_inception(inception_weights)  # the standard FID features: pool3, 2048 per image
    features = inception_features(model, image_sets()[0][:3])
    assert features.shape == (3, 2048) and features.dtype == np.float64 and np.isfinite(features).all()
    stats = feature_statistics(features)
    assert abs(frechet_distance(*stats, *stats)) < 1e-6 * np.trace(stats[1])  # singular 2048 x 2048: still ~0
    with pytest.raises(ValueError, match=r"\(N, H, W, 3\) uint8"):
        inception_features(model, np.zeros((2, 3, 16, 16), dtype=np.uint8))


def test_frechet_distance_closed_form_and_scipy():
    """Diagonal covariances: ||mu1 - mu2||^2 + sum(s1 + s2 - 2 sqrt(s1 s2)); full ones: scipy's sqrtm."""
    from scipy.linalg import sqrtm

    rng = np.random.default_rng(1)
    mu1, mu2 = rng.normal(size=5), rng.normal(size=5)
    s1, s2 = rng.uniform(0.5, 2, 5), rng.uniform(0.5, 2, 5)
    expected = ((mu1 - mu2) ** 2).sum() + (s1 + s2 - 2 * np.sqrt(s1 * s2)).sum()
    assert frechet_distance(mu1, np.diag(s1), mu2, np.diag(s2)) == pytest.approx(expected, rel=1e-9)
    a, b = rng.normal(size=(5, 5)), rng.normal(size=(5, 5))
    sigma1, sigma2 = a @ a.T, b @ b.T
    expected = ((mu1 - mu2) ** 2).sum() + np.trace(sigma1 + sigma2 - 2 * sqrtm(sigma1 @ sigma2).real)
    assert frechet_distance(mu1, sigma1, mu2, sigma2) == pytest.approx(expected, rel=1e-9)
    with pytest.raises(ValueError, match="disagree in size"):
        frechet_distance(mu1, np.diag(s1), mu2[:3], np.diag(s2[:3]))


def test_cli_with_images_or_reference_statistics(inception_weights, tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("evaluate_fid", ROOT / "scripts" / "evaluate_fid.py")
    cli = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cli)
    a, _, shifted = image_sets()
    np.savez(tmp_path / "samples.npz", arr_0=a, arr_1=np.zeros(len(a)))
    np.savez(tmp_path / "other.npz", arr_0=shifted)
    common = ["--inception-weights", str(inception_weights), "--batch-size", "5", "--dims", "64"]
    args = ["--samples", str(tmp_path / "other.npz"), "--reference", str(tmp_path / "samples.npz"), *common]
    assert cli.main([*args, "--save-stats", str(tmp_path / "ref_stats.npz")]) == 0
    from_images = json.loads(capsys.readouterr().out)["fid"]
    # ADM-style reference statistics (mu, sigma) give the same number as the images they came from.
    assert cli.main(["--samples", str(tmp_path / "samples.npz"), "--reference", str(tmp_path / "ref_stats.npz"),
                     *common]) == 0  # fmt: skip
    from_stats = json.loads(capsys.readouterr().out)["fid"]
    assert from_images > 0 and from_stats == pytest.approx(from_images, rel=1e-6)
    assert cli.main(["--samples", str(tmp_path / "samples.npz"), "--reference", str(tmp_path / "samples.npz"),
                     "--inception-weights", str(tmp_path / "none.pth")]) == 2  # fmt: skip
    assert f"{tmp_path / 'none.pth'} does not exist" in capsys.readouterr().err
