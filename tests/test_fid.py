"""ADM's evaluation: pytorch-fid's InceptionV3 with weights from a local file (random here), TF's preprocessing, the
five metrics against closed forms and hand-computed cases, ADM's .npz format, the CLI."""

import importlib.util
import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tests.conftest import ROOT
from torchtitan.tools.adm_metrics import (
    class_probabilities,
    evaluate,
    inception_score,
    pairwise_distances,
    precision_recall,
)
from torchtitan.tools.fid import (
    EvalBatch,
    adm_features,
    build_inception,
    feature_statistics,
    frechet_distance,
    inception_features,
    read_eval_batch,
    tf_preprocess,
)


@pytest.fixture(scope="module")
def inception_weights(tmp_path_factory):
    """A random InceptionV3 state dict with the FID network's keys, its batch norms calibrated on noise (features
    O(1e5), where the defaults give ~1e10), a small softmax weight (an unsaturated Inception Score) and a large bias,
    which ADM's score leaves out: scripts/benchmarks/benchmark_fid50k.py's stand-in."""
    from scripts.benchmarks.benchmark_fid50k import write_random_inception

    return write_random_inception(tmp_path_factory.mktemp("fid") / "inception.pth")


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
    cli = load_cli()
    a, _, shifted = image_sets()
    np.savez(tmp_path / "samples.npz", arr_0=a, arr_1=np.zeros(len(a)))
    np.savez(tmp_path / "other.npz", arr_0=shifted)
    common = ["--inception-weights", str(inception_weights), "--batch-size", "5", "--dims", "64"]
    args = ["--samples", str(tmp_path / "other.npz"), "--reference", str(tmp_path / "samples.npz"), *common]
    assert cli.main([*args, "--save-stats", str(tmp_path / "ref_stats.npz")]) == 0
    result = json.loads(capsys.readouterr().out)
    from_images = result["fid"]
    assert result["settings"] is None  # not sample.py's file
    # ADM-style reference statistics (mu, sigma) give the same number as the images they came from.
    assert cli.main(["--samples", str(tmp_path / "samples.npz"), "--reference", str(tmp_path / "ref_stats.npz"),
                     *common]) == 0  # fmt: skip
    from_stats = json.loads(capsys.readouterr().out)["fid"]
    assert from_images > 0 and from_stats == pytest.approx(from_images, rel=1e-6)
    assert cli.main(["--samples", str(tmp_path / "samples.npz"), "--reference", str(tmp_path / "samples.npz"),
                     "--inception-weights", str(tmp_path / "none.pth")]) == 2  # fmt: skip
    assert f"{tmp_path / 'none.pth'} does not exist" in capsys.readouterr().err


@pytest.fixture(scope="module")
def network(inception_weights):
    return build_inception(inception_weights)  # pool_3 (2048): ADM's features


def load_cli():
    spec = importlib.util.spec_from_file_location("evaluate_fid", ROOT / "scripts" / "evaluate_fid.py")
    cli = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cli)
    return cli


def test_tf_preprocess_is_the_graphs_legacy_resize_and_scaling():
    """The graph's ResizeBilinear (align_corners = half_pixel_centers = False), then (x - 128) / 128.

    The rows are TensorFlow 2.21's tf.raw_ops.ResizeBilinear of [0, 10, 20, 40] and [0, 50, 100, 200, 150] to 6
    (by hand: output i samples input i * in/out, with no half-pixel offset). Bilinear is separable and its weights
    sum to 1, so an image a[h] + b[w] resizes to the sum of the resized rows.
    """
    a, b = np.array([0, 10, 20, 40]), np.array([0, 50, 100, 200, 150])
    a6 = np.array([0, 20 / 3, 40 / 3, 20, 100 / 3, 40])
    b6 = np.array([0, 41.666664123535156, 83.33332824707031, 150, 183.33334350585938, 150])
    image = np.repeat((a[:, None] + b[None, :])[None, :, :, None], 3, axis=3).astype(np.uint8)  # (1, 4, 5, 3)
    got = tf_preprocess(torch.from_numpy(image), size=6)
    expected = (a6[:, None] + b6[None, :] - 128) / 128
    assert got.shape == (1, 3, 6, 6) and got.dtype == torch.float32
    np.testing.assert_allclose(got[0].numpy(), np.broadcast_to(expected, (3, 6, 6)), rtol=0, atol=1e-6)
    # pytorch-fid's half-pixel resize is another image (at 256 -> 299: 6.9 grey levels apart on average).
    half_pixel = F.interpolate(torch.from_numpy(image).permute(0, 3, 1, 2).float(), size=(6, 6), mode="bilinear")
    assert ((half_pixel - 128) / 128 - got).abs().max() > 0.05
    pixels = torch.tensor([[[[0, 128, 255]]]], dtype=torch.uint8)  # (1, 1, 1, 3): Sub 128, Mul 1/128
    assert tf_preprocess(pixels, size=1).flatten().tolist() == [-1.0, 0.0, 0.9921875]


def test_one_pass_gives_pool3_and_mixed_6_conv_in_tf_order(network, inception_weights):
    """pool_3 is the 2048 block's output; the spatial features are Mixed_6d's 1 x 1 branch (TF's mixed_6/conv, after
    its ReLU), first 7 channels, flattened (h, w, c) as TF's NHWC tensor: 2023 per image, float64."""
    images = image_sets()[0][:2]
    pool, spatial = adm_features(network, images, batch_size=1)
    assert pool.shape == (2, 2048) and spatial.shape == (2, 2023) and pool.dtype == spatial.dtype == np.float64
    np.testing.assert_array_equal(pool, inception_features(network, images, batch_size=1))
    with torch.no_grad():
        x = network.blocks[1](network.blocks[0](tf_preprocess(torch.from_numpy(images))))
        x = network.blocks[2][:6](x)  # Mixed_5b .. Mixed_6c: the input of mixed_6
        branch = torch.relu(network.blocks[2][6].branch1x1.bn(network.blocks[2][6].branch1x1.conv(x)))
    assert branch.shape == (2, 192, 17, 17)
    expected = branch[:, :7].permute(0, 2, 3, 1).reshape(2, -1).double().numpy()  # (N, 17 * 17 * 7), NHWC
    np.testing.assert_allclose(spatial, expected, rtol=1e-5, atol=1e-6)
    assert spatial[1].reshape(17, 17, 7)[3, 5, 2] == pytest.approx(float(branch[1, 2, 3, 5]), rel=1e-5)
    state = torch.load(inception_weights, weights_only=True)
    assert torch.equal(network.logits_weight, state["fc.weight"].double())  # the graph's softmax/logits weight
    with pytest.raises(ValueError, match=r"pool_3 network \(--dims 2048\)"):
        adm_features(build_inception(inception_weights, dims=64), images)


def test_inception_score_closed_forms():
    """Uniform predictions: 1. One-hot over C balanced classes: C. Two classes predicted (a, 1 - a) and (1 - a, a):
    exp(a log 2a + (1 - a) log 2(1 - a)). Splits are scored apart and averaged, as ADM's 5000-sample splits."""
    assert inception_score(np.full((10, 7), 1 / 7)) == pytest.approx(1.0, abs=1e-12)
    assert inception_score(np.eye(5)[np.arange(20) % 5]) == pytest.approx(5.0, rel=1e-12)
    a = 0.9
    two = np.array([[a, 1 - a], [1 - a, a]] * 3)
    assert inception_score(two) == pytest.approx(np.exp(a * np.log(2 * a) + (1 - a) * np.log(2 * (1 - a))), rel=1e-12)
    one_class, four_classes = np.eye(4)[[0, 0, 0, 0]], np.eye(4)[[0, 1, 2, 3]]
    assert inception_score(np.concatenate([one_class, four_classes]), split_size=4) == pytest.approx(2.5, rel=1e-12)
    assert inception_score(np.concatenate([one_class, four_classes]), split_size=8) == pytest.approx(
        np.exp(-(5 / 8) * np.log(5 / 8) - 3 * (1 / 8) * np.log(1 / 8)), rel=1e-12)  # fmt: skip
    # Logits from pool_3 features and the softmax weight, without bias: saturated rows are exactly one-hot.
    pool, weight = 1000.0 * np.eye(3)[np.arange(30) % 3], np.eye(3)
    np.testing.assert_array_equal(class_probabilities(pool, weight), np.eye(3)[np.arange(30) % 3])
    assert inception_score(class_probabilities(pool, weight)) == pytest.approx(3.0, rel=1e-12)
    # A denormal probability whose split mean would round to 0 in linear space: still KL ~ 0, IS 1.
    assert inception_score(np.array([[1.0, 5e-324]] + [[1.0, 0.0]] * 4)) == pytest.approx(1.0, abs=1e-12)


def line_points(*xs: float) -> np.ndarray:
    """Points on a line in 3 dimensions (small integers: float16 distances are exact)."""
    return np.array([[x, 0.0, 0.0] for x in xs])


def test_precision_recall_of_known_manifolds():
    """k = 3: a point's ball reaches its 3rd neighbour, itself being the 0th; a point on a ball's edge is inside.

    Samples {0, 1, 2, 3} on a line have squared radii 9, 4, 4, 9. Against the reference {0, ..., 7}: every sample is a
    reference point (precision 1); reference 4, 5 and 6 (at 1, 4 and 9 from the sample 3) are inside its ball, 7 (16)
    is not: recall 7/8. Swapped, the numbers swap.
    """
    cloud = np.random.default_rng(0).normal(size=(20, 8))
    for precision in ("adm", "float64"):
        assert precision_recall(cloud, cloud, precision=precision) == (1.0, 1.0)
        assert precision_recall(cloud, cloud + 100.0, precision=precision) == (0.0, 0.0)  # far apart
        reference, samples = line_points(*range(8)), line_points(0, 1, 2, 3)
        assert precision_recall(reference, samples, precision=precision) == (1.0, 0.875)
        assert precision_recall(samples, reference, precision=precision) == (0.875, 1.0)
        # Blocks of 3 rows and columns (ADM's are 10000): the same numbers.
        assert precision_recall(reference, samples, batch_size=3, precision=precision) == (1.0, 0.875)
    with pytest.raises(ValueError, match="more than k = 3 samples images, got 3"):
        precision_recall(reference, samples[:3])


def test_precision_recall_distances_round_as_adms_float16():
    """ADM's DistanceBlock computes |u|^2 - 2 u.v + |v|^2 in float16, and a whole block in float32 when a float16
    value of it overflows. -30.004 rounds to -30 in float16, so its squared distance to 0 (900.24) equals the
    sample 0's radius (900: the samples 0, 10, 20, 30) and counts as inside, where float64 says outside."""
    samples, reference = line_points(0, 10, 20, 30), line_points(-30.004, 100, 104, 108)
    assert precision_recall(reference, samples) == (1.0, 0.25)
    assert precision_recall(reference, samples, precision="float64") == (1.0, 0.0)
    u, v = torch.tensor([[30.004]]), torch.tensor([[0.0], [1000.0]])
    assert pairwise_distances(u, v[:1]).item() == 900.0  # float16
    # 1000^2 overflows float16, so this block is float32: its other distance is no longer rounded.
    assert pairwise_distances(u, v)[0, 0].item() == pytest.approx(900.24, abs=1e-3)
    # Coordinates in the thousands overflow every block: the float32 fallback gives the exact answers.
    assert precision_recall(1000 * line_points(*range(8)), 1000 * line_points(0, 1, 2, 3)) == (1.0, 0.875)


def gaussian_batch(path: str, mu: np.ndarray, sigma: np.ndarray, mu_s: np.ndarray, sigma_s: np.ndarray) -> EvalBatch:
    return EvalBatch(path, None, None, (mu, sigma), (mu_s, sigma_s))


def test_fid_and_sfid_of_known_gaussians():
    """Stored statistics: FID from mu/sigma and sFID from mu_s/sigma_s, each the closed form for diagonal
    covariances; IS, precision and recall need images, and say so."""
    rng = np.random.default_rng(2)
    mu1, mu2, s1, s2 = rng.normal(size=5), rng.normal(size=5), rng.uniform(0.5, 2, 5), rng.uniform(0.5, 2, 5)
    m1, m2, t1, t2 = rng.normal(size=3), rng.normal(size=3), rng.uniform(0.5, 2, 3), rng.uniform(0.5, 2, 3)
    samples = gaussian_batch("samples.npz", mu1, np.diag(s1), m1, np.diag(t1))
    reference = gaussian_batch("ref.npz", mu2, np.diag(s2), m2, np.diag(t2))
    values, reasons = evaluate(samples, reference, None)
    fid = ((mu1 - mu2) ** 2).sum() + (s1 + s2 - 2 * np.sqrt(s1 * s2)).sum()
    sfid = ((m1 - m2) ** 2).sum() + (t1 + t2 - 2 * np.sqrt(t1 * t2)).sum()
    assert values["fid"] == pytest.approx(fid, rel=1e-9) and values["sfid"] == pytest.approx(sfid, rel=1e-9)
    assert values["inception_score"] is values["precision"] is values["recall"] is None
    assert reasons["recall"] == "needs samples.npz's arr_0 images through the pool_3 network (--dims 2048)"
    old_stats = EvalBatch("old_stats.npz", None, None, (mu2, np.diag(s2)), None)  # mu/sigma only
    values, reasons = evaluate(samples, old_stats, None)
    assert values["fid"] == pytest.approx(fid, rel=1e-9) and values["sfid"] is None
    assert reasons["sfid"] == "needs mu_s/sigma_s, or arr_0 images through the pool_3 network, in old_stats.npz"


def adm_reference(path, images: np.ndarray, **stats) -> None:
    """A stand-in for VIRTUAL_imagenet256_labeled.npz: arr_0 images, arr_1 labels, and the given statistics."""
    np.savez(path, arr_0=images, arr_1=np.arange(len(images)) % 1000, **stats)


def test_reference_batch_reader_and_its_errors(network, tmp_path):
    """ADM's keys: arr_0 (N, H, W, 3) uint8, mu/sigma (2048), mu_s/sigma_s (2023); stored statistics are used as
    stored, the images run only when asked. Bad files get one message naming the file and the key."""
    images = image_sets()[0][:4]
    mu, mu_s = np.linspace(0, 1, 2048), np.linspace(1, 2, 2023)
    ref = tmp_path / "VIRTUAL_ref.npz"
    adm_reference(ref, images, mu=mu, sigma=np.eye(2048), mu_s=mu_s, sigma_s=2 * np.eye(2023))
    stored = read_eval_batch(ref, network, images=False)
    assert stored.pool is None and stored.spatial is None  # no pass: the statistics are there
    np.testing.assert_array_equal(stored.statistics[0], mu)
    np.testing.assert_array_equal(stored.spatial_statistics[1], 2 * np.eye(2023))
    with_images = read_eval_batch(ref, network, batch_size=2)
    assert with_images.pool.shape == (4, 2048) and with_images.spatial.shape == (4, 2023)
    np.testing.assert_array_equal(with_images.spatial_statistics[0], mu_s)  # still the stored ones
    computed = tmp_path / "images_only.npz"
    np.savez(computed, arr_0=images)
    from_images = read_eval_batch(computed, network, batch_size=2)
    np.testing.assert_allclose(from_images.spatial_statistics[1], np.cov(with_images.spatial, rowvar=False))

    shape_only = SimpleNamespace(feature_dims=2048)  # the checks below fail before any Inception pass
    cases = {
        "mu_only.npz": ({"mu": mu}, r"mu_only.npz: has mu but no sigma"),
        "sigma_s_only.npz": ({"mu": mu, "sigma": np.eye(2048), "sigma_s": np.eye(3)}, r": has sigma_s but no mu_s"),
        "small_mu.npz": ({"mu": mu[:64], "sigma": np.eye(64)}, r"small_mu.npz: mu has shape \(64,\), expected \(2048"),
        "nan.npz": ({"mu": mu * np.nan, "sigma": np.eye(2048)}, r"nan.npz: mu holds non-finite values"),
        "float_images.npz": ({"arr_0": images / 255.0}, r"float_images.npz: arr_0 must be \(N, H, W, 3\) uint8"),
        "chw.npz": ({"arr_0": images.transpose(0, 3, 1, 2)}, r"chw.npz: arr_0 must be .* got \(4, 3, 16, 16\)"),
        "one.npz": ({"arr_0": images[:1]}, r"one.npz: arr_0 holds 1 image\(s\); FID needs at least 2"),
        "labels.npz": ({"arr_1": np.arange(3)}, r"labels.npz: has neither arr_0 images nor mu/sigma .*'arr_1'"),
        "pickled.npz": ({"arr_0": np.array([{"a": 1}], dtype=object)}, r"pickled.npz: arr_0 cannot be read"),
    }
    for name, (arrays, message) in cases.items():
        np.savez(tmp_path / name, **arrays)
        with pytest.raises(ValueError, match=message):
            read_eval_batch(tmp_path / name, shape_only)
    (tmp_path / "text.npz").write_text("not a zip")
    with pytest.raises(ValueError, match=r"text.npz: not an .npz file"):
        read_eval_batch(tmp_path / "text.npz", shape_only)
    np.save(tmp_path / "single.npy", images)
    with pytest.raises(ValueError, match=r"single.npy: a single .npy array"):
        read_eval_batch(tmp_path / "single.npy", shape_only)
    with pytest.raises(FileNotFoundError, match=r"none.npz does not exist"):
        read_eval_batch(tmp_path / "none.npz", shape_only)


def test_cli_prints_adms_five_numbers(network, inception_weights, tmp_path, capsys):
    """Samples against an ADM-format reference holding the same images and statistics shifted by known amounts:
    FID = 2048 * 1^2, sFID = 2023 * 0.5^2 (same covariances), precision = recall = 1 (the same points), and the
    Inception Score of the samples' own softmax(pool_3 @ W). Five lines on stderr, one JSON line on stdout."""
    images = image_sets()[0][:5]
    pool, spatial = adm_features(network, images)
    (mu, sigma), (mu_s, sigma_s) = feature_statistics(pool), feature_statistics(spatial)
    adm_reference(tmp_path / "ref.npz", images, mu=mu + 1.0, sigma=sigma, mu_s=mu_s + 0.5, sigma_s=sigma_s)
    settings = {"--sampler": "heun", "--steps": 25, "weights": "run/ema.safetensors"}  # as sample.py --npz records
    np.savez(tmp_path / "samples.npz", arr_0=images, arr_1=np.arange(5), settings=np.array(json.dumps(settings)))
    logits = pool @ network.logits_weight.numpy().T  # no bias
    p = np.exp(logits - logits.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    score = np.exp(np.mean(np.sum(p * (np.log(p) - np.log(p.mean(0))), 1)))  # improved-gan's formula, one split
    assert 1.01 < score < 5

    cli = load_cli()
    common = ["--inception-weights", str(inception_weights), "--batch-size", "3"]
    stats = tmp_path / "sample_stats.npz"
    args = ["--samples", str(tmp_path / "samples.npz"), "--reference", str(tmp_path / "ref.npz"), *common]
    assert cli.main([*args, "--save-stats", str(stats)]) == 0
    out, err = capsys.readouterr()
    result = json.loads(out)
    trace = np.trace(sigma)
    assert result["fid"] == pytest.approx(2048.0, abs=1e-6 * trace)
    assert result["sfid"] == pytest.approx(2023 * 0.25, abs=1e-6 * np.trace(sigma_s))
    assert result["inception_score"] == pytest.approx(score, rel=1e-9)
    assert (result["precision"], result["recall"], result["num_samples"], result["dims"]) == (1.0, 1.0, 5, 2048)
    assert result["settings"] == settings and result["inception_seconds"] > 0  # what the samples were drawn with
    lines = [line for line in err.splitlines() if ": " in line and not line.startswith("inception")]
    assert [line.split(": ")[0] for line in lines] == ["Inception Score", "FID", "sFID", "Precision", "Recall"]
    assert f"Recall: {result['recall']}" in err and f"FID: {result['fid']}" in err
    with np.load(stats) as saved:  # ADM's keys, so the file serves as a reference
        assert sorted(saved.files) == ["mu", "mu_s", "sigma", "sigma_s"]
        np.testing.assert_allclose(saved["mu_s"], mu_s, rtol=1e-5, atol=1e-6)

    bad = tmp_path / "bad_ref.npz"
    np.savez(bad, arr_0=images, mu=mu, sigma=sigma[:5, :5])
    assert cli.main(["--samples", str(tmp_path / "samples.npz"), "--reference", str(bad), *common]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err == f"error: {bad}: sigma has shape (5, 5), expected (2048, 2048)\n"
    assert cli.main(["--samples", str(tmp_path / "none.npz"), "--reference", str(bad), *common]) == 2
    assert capsys.readouterr().err == f"error: {tmp_path / 'none.npz'} does not exist\n"
