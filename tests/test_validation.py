"""A DiT's [validation]: FID (and Inception Score) of EMA samples while training over 2 ranks, against the route a user
takes by hand in one process (sample.py --npz, then scripts/evaluate_fid.py); the ranks' split and reduction;
refusals at start; failures that leave the run alive; latent models' decoded samples.

The Inception network has random weights and runs its first block (fid_dims 64), whose batch norms are calibrated on
noise so features stay O(1): pool3 takes ~1 s an image on 2 busy CPU cores, and the 2048 x 2048 Frechet distance a
minute.
"""

import importlib.util
import json
import logging
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import sample
from tests.conftest import ROOT, TINY, run_train
from torchtitan.components import validation
from torchtitan.components.validation import ADM_SPLIT_SIZE, FeatureSums, FIDValidator, rank_batches
from torchtitan.config_manager import parse_args
from torchtitan.errors import ConfigError
from torchtitan.tools.adm_metrics import class_probabilities
from torchtitan.tools.fid import build_inception, feature_statistics, frechet_distance, inception_features
from torchtitan.tools.images import to_uint8_nhwc

DIMS = 64


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """{"weights": a random FID Inception state dict, "reference": an .npz of mu/sigma (DIMS features) of 24 digits
    as ADM's uint8 images, "features": those images' features}."""
    import torchvision

    from torchtitan.datasets.digits import DigitsDataset

    folder = tmp_path_factory.mktemp("fid")
    torch.manual_seed(0)
    net = torchvision.models.inception_v3(weights=None, aux_logits=False, num_classes=1008, init_weights=False)
    for module in net.modules():
        if isinstance(module, torch.nn.BatchNorm2d):
            module.momentum = None  # a plain average over the calibration batch
    first_block = torch.nn.Sequential(net.Conv2d_1a_3x3, net.Conv2d_2a_3x3, net.Conv2d_2b_3x3)  # fid_dims 64's
    with torch.no_grad():
        first_block.train()(torch.rand(2, 3, 299, 299) * 2 - 1)  # the size pytorch-fid resizes to
    torch.save(net.state_dict(), folder / "inception.pth")
    images = to_uint8_nhwc(DigitsDataset(16).images[:24])
    features = inception_features(build_inception(folder / "inception.pth", dims=DIMS), images)
    np.savez(folder / "reference.npz", **dict(zip(("mu", "sigma"), feature_statistics(features))))
    return {"weights": folder / "inception.pth", "reference": folder / "reference.npz", "features": features}


def fid_flags(files, *extra: str) -> list[str]:
    return [*TINY, "--validation.enable", "true", "--validation.freq", "1", "--validation.fid_dims", str(DIMS),
            "--validation.fid_reference", str(files["reference"]), "--validation.inception_weights",
            str(files["weights"]), "--validation.fid_num_samples", "6", "--validation.fid_batch_size", "4",
            "--validation.fid_sampling_steps", "2", "--validation.loss_num_samples", "6", "--validation.loss_freq", "1",
            "--training.steps", "2", *extra]  # fmt: skip


@pytest.fixture
def log_lines():
    """The torchtitan logger's lines (it does not propagate to pytest's capture)."""
    lines = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(f"{record.levelname} {record.getMessage()}")
    logger = logging.getLogger("torchtitan")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    yield lines
    logger.removeHandler(handler)
    logger.setLevel(level)


def fid_records(folder) -> list[dict]:
    records = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if "validation/fid" in r]


def test_logged_fid_over_two_ranks_is_what_sample_py_and_evaluate_fid_give(files, tmp_path, capsys):
    """A 2-rank DDP run (gloo) logs FID at every step; the route of docs/latent.md (sample.py --npz in one process,
    then scripts/evaluate_fid.py) on its exported EMA weights gives the number it logged at its last step. 5 samples
    in batches of 2: rank 0 samples batches 0 and 2, rank 1 batch 1 and a padding pass (a DDP or FSDP forward is a
    collective; FSDP costs this test 10 s more on 2 CPU cores and gave the same FID by hand).

    The same run logs the fixed-timestep loss of 11 held-out digits at every step (rank 0 evaluates 6 of them, rank
    1 5, each in one padded batch of 8), which one process gives on the exported EMA weights (2 batches)."""
    run = tmp_path / "run"
    flags = fid_flags(files, "--job.dump_folder", str(run), "--checkpoint.enable", "true", "--training.ema_decay",
                      "0.5", "--sampling.seed", "3", "--validation.fid_cfg_scale", "1.5",
                      "--validation.fid_num_samples", "5", "--validation.fid_batch_size", "2",
                      "--metrics.enable_tensorboard", "true", "--validation.loss_num_samples", "11",
                      "--parallelism.data_parallel_replicate_degree", "2",
                      "--parallelism.data_parallel_shard_degree", "1")  # fmt: skip
    result = run_train(flags, nproc=2)
    records = fid_records(run)
    assert [r["step"] for r in records] == [1, 2]
    assert records[0]["validation/fid"] != records[1]["validation/fid"]  # the EMA moved
    assert all(r["validation/fid_seconds"] > 0 and r["validation/fid_images_per_second"] > 0 for r in records)
    assert "validation/inception_score" not in records[1]  # 64 features have no logits
    line = [s for s in (result.stdout + result.stderr).splitlines() if "validation fid" in s][-1]
    assert f"fid {records[1]['validation/fid']:.4f}" in line and "5 samples in" in line and "images/s)" in line

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run / "tb")).Reload()
    assert [e.value for e in events.Scalars("validation/fid")] == pytest.approx([r["validation/fid"] for r in records])
    assert_fixed_timestep_loss_is_one_process(flags, run, events, result.stdout + result.stderr)

    # By hand: the exported EMA weights through sample.py --npz, then scripts/evaluate_fid.py.
    assert sample.main(["--checkpoint", str(run), "--npz", str(tmp_path / "samples.npz"), "--num-samples", "5",
                        "--batch-size", "2", "--seed", "3", "--steps", "2", "--cfg-scale", "1.5"]) == 0  # fmt: skip
    spec = importlib.util.spec_from_file_location("evaluate_fid", ROOT / "scripts" / "evaluate_fid.py")
    cli = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cli)
    capsys.readouterr()
    assert cli.main(["--samples", str(tmp_path / "samples.npz"), "--reference", str(files["reference"]),
                     "--inception-weights", str(files["weights"]), "--dims", str(DIMS)]) == 0  # fmt: skip
    by_hand = json.loads(capsys.readouterr().out)["fid"]
    # The same uint8 images: only the sums' order differs (np.cov centres first; the run sums about mu_ref, by rank).
    assert records[1]["validation/fid"] == pytest.approx(by_hand, rel=1e-6)


def assert_fixed_timestep_loss_is_one_process(flags: list[str], run, events, output: str) -> None:
    """The run's `loss/val_t0..7` and `loss/val` at steps 1 and 2 in metrics.jsonl, TensorBoard and on the console;
    at step 2 those of the exported EMA weights in one process (1e-6 relative: the ranks' float32 forwards see
    other batches, and the sums add in another order)."""
    import contextlib

    from torchtitan.components.validation_loss import HeldOutLoss
    from torchtitan.diffusion import build_diffusion
    from torchtitan.models.dit.weights import load_model

    keys = [f"loss/val_t{k}" for k in range(8)] + ["loss/val"]
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    logged = [r for r in records if "loss/val" in r]
    assert [r["step"] for r in logged] == [1, 2] and all(r["validation/loss_samples"] == 11 for r in logged)
    assert logged[0]["loss/val"] != logged[1]["loss/val"]  # the EMA moved
    assert [e.value for e in events.Scalars("loss/val_t3")] == pytest.approx([r["loss/val_t3"] for r in logged])
    line = [s for s in output.splitlines() if "validation loss" in s][-1]
    assert f"validation loss {logged[1]['loss/val']:.4f}" in line and "11 samples in" in line
    assert f"at t_0..t_7 {logged[1]['loss/val_t0']:.4f} {logged[1]['loss/val_t1']:.4f}" in line
    cfg = parse_args(flags)
    model, args = load_model(cfg, run / "ema.safetensors", torch.device("cpu"))

    class Records:
        enabled = True
        log = staticmethod(lambda step, record: None)

    one = HeldOutLoss(cfg, args, build_diffusion(cfg.diffusion, args.learn_sigma), torch.device("cpu"), 0, 1, None,
                      Records())  # fmt: skip
    one.check(global_batch=16)
    by_hand = one.run(model.train(), None, 2, contextlib.nullcontext)
    assert [logged[1][k] for k in keys] == pytest.approx([by_hand[k] for k in keys], rel=1e-6)


def test_reference_images_against_their_own_statistics():
    """Sums over two 'ranks' give np.cov's statistics, and the reference images' FID against their own is ~0."""
    rng = np.random.default_rng(0)
    features = rng.normal(3.0, 1.0, (40, 8)) @ rng.normal(size=(8, 8))
    mu, sigma = feature_statistics(features)
    parts = [FeatureSums(8, 40, shift=mu + 0.5) for _ in range(2)]
    parts[0].add(features[:25])
    parts[1].add(features[25:], first_index=25)
    total = FeatureSums(8, 40, shift=mu + 0.5)
    assert total.load_tensor(sum(p.to_tensor(False, torch.device("cpu")) for p in parts)) == 0
    got_mu, got_sigma = total.statistics()
    np.testing.assert_allclose(got_mu, mu, rtol=1e-12)
    np.testing.assert_allclose(got_sigma, sigma, rtol=1e-10, atol=1e-12)
    assert abs(frechet_distance(got_mu, got_sigma, mu, sigma)) < 1e-9 * np.trace(sigma)
    failed = FeatureSums(8, 40).to_tensor(True, torch.device("cpu"))
    assert total.load_tensor(failed + parts[0].to_tensor(False, torch.device("cpu"))) == 1  # one rank failed


def test_reference_digits_fid_with_themselves_is_zero(files):
    """The reference file's images, summed as the run sums its samples: FID ~0 against the file."""
    features = files["features"]
    sums = FeatureSums(DIMS, len(features))
    sums.add(features)
    with np.load(files["reference"]) as ref:
        mu, sigma = ref["mu"], ref["sigma"]
    half = frechet_distance(*feature_statistics(features[::2]), mu, sigma)  # a subset: near, yet not the same
    assert half > 0 and abs(frechet_distance(*sums.statistics(), mu, sigma)) < 1e-6 * half


def adm_inception_score(preds: np.ndarray, split_size: int = ADM_SPLIT_SIZE) -> float:
    """ADM's evaluator (guided-diffusion evaluations/evaluator.py, compute_inception_score), from its softmax."""
    scores = []
    for i in range(0, len(preds), split_size):
        part = preds[i : i + split_size]
        kl = part * (np.log(part) - np.log(np.expand_dims(np.mean(part, 0), 0)))
        scores.append(np.exp(np.mean(np.sum(kl, 1))))
    return float(np.mean(scores))


def test_inception_score_closed_forms_and_adm():
    classes = 10
    same = FeatureSums(2, 6, classes)
    same.add(np.zeros((6, 2)), np.full((6, classes), 1 / classes))
    assert same.inception_score() == pytest.approx(1.0)  # every p(y|x) the marginal: KL 0
    distinct = FeatureSums(2, 6, classes)
    distinct.add(np.zeros((6, 2)), np.eye(classes)[:6])
    assert distinct.inception_score() == pytest.approx(6.0)  # one-hot on 6 classes: exp(log 6)
    # 12,000 samples: ADM's three splits of 5000, 5000 and 2000, the samples dealt to two ranks in batches of 700.
    rng = np.random.default_rng(0)
    preds = class_probabilities(rng.normal(0, 3, (12_000, classes)), np.eye(classes))  # softmax of the logits
    ranks = [FeatureSums(1, len(preds), classes) for _ in range(2)]
    for b, start in enumerate(range(0, len(preds), 700)):
        ranks[b % 2].add(np.zeros((len(preds[start : start + 700]), 1)), preds[start : start + 700], start)
    total = FeatureSums(1, len(preds), classes)
    total.load_tensor(sum(r.to_tensor(False, torch.device("cpu")) for r in ranks))
    assert total.split_count.tolist() == [5000, 5000, 2000]
    assert total.inception_score() == pytest.approx(adm_inception_score(preds), rel=1e-10)


def test_rank_batches_deal_every_batch_once_with_equal_passes():
    for num, batch, world in ((6, 4, 1), (6, 4, 2), (7, 3, 2), (10, 2, 3), (1, 8, 4)):
        dealt = [rank_batches(num, batch, rank, world) for rank in range(world)]
        assert len({len(d) for d in dealt}) == 1  # as many sampler passes on every rank
        real = sorted(b for d in dealt for b in d if b is not None)
        assert [b[0] for b in real] == list(range(len(real)))
        assert sum(b[2] for b in real) == num and all(b[1] == b[0] * batch for b in real)


def test_logits_of_the_inception_score_come_from_the_weights_file(files, tmp_path):
    """pool3 (2048) takes the weights' fc.weight, ADM's softmax layer; a smaller block has no Inception Score."""
    np.savez(tmp_path / "ref2048.npz", mu=np.zeros(2048), sigma=np.eye(2048))
    cfg = parse_args(fid_flags(files, "--validation.fid_dims", "2048", "--validation.fid_reference",
                               str(tmp_path / "ref2048.npz")))  # fmt: skip
    v = FIDValidator(cfg, SimpleNamespace(in_channels=1), None, torch.device("cpu"), 0, 1, None, None)
    v.check()
    expected = torch.load(files["weights"], weights_only=True)["fc.weight"].double().numpy()
    assert v.logits_weight.shape == (1008, 2048) and np.array_equal(v.logits_weight, expected)
    wrong_dims = parse_args(fid_flags(files, "--validation.fid_reference", str(tmp_path / "ref2048.npz")))
    v = FIDValidator(wrong_dims, SimpleNamespace(in_channels=1), None, torch.device("cpu"), 0, 1, None, None)
    with pytest.raises(ConfigError, match=r"validation.fid_reference = .*ref2048.npz.*: holds statistics of \(2048,\) "
                                          r"features, and validation.fid_dims = 64"):  # fmt: skip
        v.check()


def test_missing_files_are_refused_at_start_naming_the_key(files, tmp_path):
    missing = str(tmp_path / "none.npz")
    message = rf"validation.fid_reference = '{missing}' in the command line: no such file; validation.enable = True "
    with pytest.raises(ConfigError, match=message + r"in the command line on model.name 'dit' .*computes the FID"):
        parse_args(fid_flags(files, "--validation.fid_reference", missing))
    with pytest.raises(ConfigError, match=r"^validation.inception_weights = '' in the command line: .*needs "
                                          r"pytorch-fid's FID Inception weights"):  # fmt: skip
        parse_args(fid_flags(files, "--validation.inception_weights", ""))
    with pytest.raises(ConfigError, match=r"validation.fid_dims = 100 .*must be one of \[64, 192, 768, 2048\]"):
        parse_args(fid_flags(files, "--validation.fid_dims", "100"))
    parse_args(fid_flags(files, "--validation.enable", "false", "--validation.fid_reference", ""))  # off: not needed


def test_a_latent_run_trains_through_failing_validations_and_scores_decoded_images(files, tmp_path, monkeypatch,
                                                                                  log_lines):  # fmt: skip
    """A latent DiT (4 x 8 x 8, decoded by a random TorchScript tokenizer as Cosmos ships them, downsample 2): NaN
    features at the first validation and an error at the second are a warning line each and the run trains on; the
    third scores the decoded 16 x 16 RGB images; the fixed-timestep loss of the held-out latents is logged at every
    step all along. Without a tokenizer the config is refused, naming the key."""
    from tests.test_cosmos_latent_decoder import make_jit_tokenizer
    from torchtitan.trainer import Trainer

    latent = ["--training.dataset", "dummy", "--model.in_channels", "4", "--model.input_size", "8",
              "--training.steps", "3", "--validation.fid_num_samples", "3"]  # fmt: skip
    message = r"latent.tokenizer = '' in the defaults: validation.enable = True .*needs images, and this latent model"
    with pytest.raises(ConfigError, match=message + r"'s samples need a \[latent\] tokenizer"):
        parse_args(fid_flags(files, *latent))
    seen = []

    def failing_twice(model, images, batch_size=50, progress=False):
        seen.append(images.shape)
        if len(seen) == 1:
            return np.full((len(images), DIMS), np.nan)
        if len(seen) == 2:
            raise RuntimeError("CUDA out of memory (simulated)")
        return inception_features(model, images, batch_size)

    monkeypatch.setattr(validation, "inception_features", failing_twice)
    make_jit_tokenizer(tmp_path / "tokenizer", channels=4, downsample=2)
    run = tmp_path / "run"
    trainer = Trainer(parse_args(fid_flags(files, *latent, "--job.dump_folder", str(run), "--latent.tokenizer",
                                           "cosmos_jit", "--latent.checkpoint_dir", str(tmp_path / "tokenizer"),
                                           "--latent.scale_factor", "0.5")))  # fmt: skip
    try:
        trainer.train()
    finally:
        trainer.close()
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == [1, 2, 3]
    # The fixed-timestep loss of the held-out latents (dummy items of another pool) at every step, whatever the FID.
    assert [r["step"] for r in records if "loss/val" in r] == [1, 2, 3]
    warnings = [line for line in log_lines if line.startswith("WARNING") and "FID validation failed" in line]
    assert len(warnings) == 2
    assert "step 1: " in warnings[0] and "not finite" in warnings[0]
    assert "step 2: " in warnings[1] and "RuntimeError: CUDA out of memory (simulated)" in warnings[1]
    assert seen == [(3, 16, 16, 3)] * 3
    (record,) = fid_records(run)
    assert record["step"] == 3 and np.isfinite(record["validation/fid"]) and record["validation/fid"] > 0
