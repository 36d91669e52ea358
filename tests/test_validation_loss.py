"""A DiT's fixed-timestep validation loss (torchtitan/components/validation_loss.py): the objective's loss at SD3's 8
times with fixed noise, against a hand computation; the same numbers at every evaluation; its held-out data, kept out
of training; refusals at parse time. Its 2-rank run against one process, and its records in metrics.jsonl, are in
tests/test_validation.py (the FID run's)."""

import contextlib
import dataclasses
import math
import shutil
from types import SimpleNamespace

import pytest
import torch

from tests.conftest import TINY
from torchtitan.components.validation_loss import HeldOutLoss
from torchtitan.config_manager import parse_args
from torchtitan.datasets import build_dataset, build_held_out_dataset
from torchtitan.datasets.digits import DigitsDataset
from torchtitan.diffusion import build_diffusion
from torchtitan.errors import ConfigError
from torchtitan.models.dit import DiT, dit_configs

LOSS_FLAGS = ["--validation.enable", "true", "--validation.fid_num_samples", "0"]


class Records:
    """A MetricsLogger's stand-in: the records it was given."""

    enabled = True

    def __init__(self):
        self.records = []

    def log(self, step: int, record: dict) -> None:
        self.records.append((step, record))


def nudged_tiny_dit(seed: int = 0) -> DiT:
    """The debug DiT cut to one block of width 32 (its forward: 8 ms on a busy CPU core, the debug flavor's 280),
    with every parameter moved off its init (adaLN-Zero starts every gate at 0, so the untouched model's output is
    0 whatever its input)."""
    torch.manual_seed(seed)
    model = DiT(dataclasses.replace(dit_configs["debug"], dim=32, depth=1, num_heads=2))
    model.init_weights()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model.train()


def hand_loss(cfg, model, x0: torch.Tensor, y: int, noise: torch.Tensor, k: int) -> float:
    """The objective's loss of one sample at the k-th of 8 times, written out from the papers' formulas."""
    d = cfg.diffusion
    fraction = (k + 0.5) / 8
    if d.objective == "ddpm":  # epsilon prediction, DiT's linear betas: x_t = sqrt(abar) x0 + sqrt(1 - abar) eps
        step = math.floor(fraction * d.num_timesteps)
        abar = torch.cumprod(1 - torch.linspace(1e-4, 0.02, d.num_timesteps, dtype=torch.float64), 0)[step].item()
        x_t = math.sqrt(abar) * x0 + math.sqrt(1 - abar) * noise
        out = model(x_t[None], torch.tensor([step]), torch.tensor([y]))[0]
        return (noise - out).pow(2).mean().item()
    t = fraction  # rectified flow: x_t = (1 - t) x0 + t eps, velocity eps - x0
    x_t = (1 - t) * x0 + t * noise
    model_time = {"1000t": 1000 * t, "t": t, "1-t": 1 - t}[d.time_input]
    out = model(x_t[None], torch.tensor([model_time], dtype=torch.float32), torch.tensor([y]))[0]
    if d.prediction == "x":  # JiT: velocities (x_t - x) / max(t, t_min) of the prediction and of the data
        v_hat, v = (x_t - out) / max(t, d.x_prediction_t_min), (x_t - x0) / max(t, d.x_prediction_t_min)
    else:
        v_hat, v = (-out if d.time_input == "1-t" else out), noise - x0
    return (v - v_hat).pow(2).mean().item()


@pytest.mark.parametrize(
    "objective",
    [
        ["--diffusion.objective", "rectified_flow", "--diffusion.prediction", "velocity"],
        ["--diffusion.objective", "rectified_flow", "--diffusion.time_input", "1-t"],
        ["--diffusion.objective", "rectified_flow", "--diffusion.prediction", "x", "--diffusion.time_input", "t"],
        ["--diffusion.objective", "ddpm", "--diffusion.prediction", "epsilon", "--model.learn_sigma", "false"],
    ],
    ids=["flow", "flow_1-t", "flow_x_t", "ddpm"],
)
def test_fixed_timestep_losses_are_the_objectives_loss_by_hand_and_the_same_each_time(objective):
    """7 held-out digits in batches of 4 (padding in the second): `loss/val_t{k}` is the mean over them of the
    objective's loss at t = (k + 1/2) / 8 with each sample's own noise (a generator seeded sampling.seed * 2**32 +
    its position), computed one sample at a time from the formulas (1e-6 relative: float32 forwards of other batch
    shapes). A second evaluation, after the global RNG moved, gives the very same numbers."""
    cfg = parse_args([*TINY, *LOSS_FLAGS, *objective, "--validation.loss_num_samples", "7", "--sampling.seed", "5",
                      "--training.local_batch_size", "4"])  # fmt: skip
    model = nudged_tiny_dit()
    records = Records()
    held_out = HeldOutLoss(cfg, model.args, build_diffusion(cfg.diffusion, False), torch.device("cpu"), 0, 1, None,
                           records)  # fmt: skip
    held_out.check(global_batch=4)
    first = held_out.run(model, None, 3, contextlib.nullcontext)
    assert model.training  # back in training mode

    data = DigitsDataset(16, "validation")
    order = torch.randperm(len(data), generator=torch.Generator().manual_seed(5))[:7].tolist()
    assert held_out.order == order
    by_hand = [[] for _ in range(8)]
    with torch.no_grad():
        for position, index in enumerate(order):
            x0, y = data[index]
            noise = torch.randn(x0.shape, generator=torch.Generator().manual_seed(5 * 2**32 + position))
            for k in range(8):
                by_hand[k].append(hand_loss(cfg, model, x0, int(y), noise, k))
    expected = [sum(losses) / 7 for losses in by_hand]
    assert [first[f"loss/val_t{k}"] for k in range(8)] == pytest.approx(expected, rel=1e-6)
    assert first["loss/val"] == pytest.approx(sum(expected) / 8, rel=1e-6)
    assert first["validation/loss_samples"] == 7 and records.records[0][0] == 3
    assert len(set(expected)) == 8  # the times differ, and so do their losses

    torch.manual_seed(1234)
    torch.randn(100)
    second = held_out.run(model, None, 4, contextlib.nullcontext)
    assert {k: v for k, v in second.items() if k != "validation/loss_seconds"} == {
        k: v for k, v in first.items() if k != "validation/loss_seconds"
    }


def test_the_ema_weights_are_evaluated_when_kept():
    """With an EMA the loss is the EMA weights' (swapped in, then out), as the FID's."""
    cfg = parse_args([*TINY, *LOSS_FLAGS, "--validation.loss_num_samples", "4", "--training.local_batch_size", "4"])
    live, shadow = nudged_tiny_dit(0), nudged_tiny_dit(1)

    class SwapIn:  # the EMA's swapped_in, over a second model's weights
        @contextlib.contextmanager
        def swapped_in(self):
            saved = {n: p.detach().clone() for n, p in live.named_parameters()}
            live.load_state_dict(shadow.state_dict())
            yield
            live.load_state_dict(saved, strict=False)

    def evaluate(model, ema):
        held_out = HeldOutLoss(cfg, model.args, build_diffusion(cfg.diffusion, False), torch.device("cpu"), 0, 1,
                               None, Records())  # fmt: skip
        held_out.check(global_batch=4)
        return held_out.run(model, ema, 1, contextlib.nullcontext)["loss/val"]

    before = {n: p.detach().clone() for n, p in live.named_parameters()}
    assert evaluate(live, SwapIn()) == evaluate(shadow, None) != evaluate(live, None)
    assert all(torch.equal(p, before[n]) for n, p in live.named_parameters())  # the live weights restored


def test_held_out_data_is_kept_out_of_training_and_named():
    """The digits' last 197 images are held out of training while the loss is on (all 1797 train otherwise); the
    dummy data's held-out items (validation.loss_num_samples of them) come from another pool."""
    on = parse_args([*TINY, *LOSS_FLAGS])
    args = dit_configs["debug"]
    held = build_held_out_dataset(on, args)
    trained = build_dataset(on.training, args, hold_out=True)
    everything = DigitsDataset(16)
    assert (len(held), len(trained), len(build_dataset(on.training, args))) == (197, 1600, 1797)
    assert torch.equal(torch.cat([trained.images, held.images]), everything.images)
    dummy = parse_args([*TINY, *LOSS_FLAGS, "--training.dataset", "dummy"])
    pool = build_held_out_dataset(dummy, args)
    assert len(pool) == 512 and not torch.equal(pool.images, build_dataset(dummy.training, args).images)


def test_cifar10_holds_out_its_test_batch(tmp_path):
    """CIFAR-10's held-out data is its test_batch, unflipped; a folder without one is a ConfigError at start naming
    the key."""
    from tests.test_latents import write_cifar10
    from torchtitan.datasets.cifar10 import CIFAR10Dataset

    folder = write_cifar10(tmp_path / "cifar")
    cfg = parse_args([*TINY, *LOSS_FLAGS, "--training.dataset", "cifar10", "--training.dataset_path", str(folder),
                      "--model.in_channels", "3", "--model.input_size", "32"])  # fmt: skip
    args = dataclasses.replace(dit_configs["debug"], in_channels=3, input_size=32)
    held_out = HeldOutLoss(cfg, args, build_diffusion(cfg.diffusion, False), torch.device("cpu"), 0, 1, None, Records())
    message = (rf"^training.dataset = 'cifar10' in the command line: the held-out data of the fixed-timestep loss: "
               rf"{folder} holds no CIFAR-10 batch test_batch; unpack cifar-10-python.tar.gz there$")  # fmt: skip
    with pytest.raises(ConfigError, match=message):
        held_out.check(global_batch=8)
    shutil.copy(folder / "data_batch_2", folder / "test_batch")
    held = build_held_out_dataset(cfg, args)
    test = CIFAR10Dataset(str(folder), random_flip=False, batches=["data_batch_2"])
    assert len(held) == 3 and all(torch.equal(held[i][0], test[i][0]) for i in range(3) for _ in range(4))


def test_the_config_is_refused_naming_the_key(tmp_path):
    message = (r"validation.dataset_path = '' in the defaults: the fixed-timestep loss of validation.loss_num_samples "
               r"= 512 in the defaults on model.name 'dit' .* needs latent shards prepared from held-out images, "
               r"and training.dataset = 'latents' in the command line holds none out; name them, or set "
               r"validation.loss_num_samples = 0")  # fmt: skip
    with pytest.raises(ConfigError, match=message):
        parse_args([*TINY, *LOSS_FLAGS, "--training.dataset", "latents", "--training.dataset_path", str(tmp_path)])
    with pytest.raises(ConfigError, match=r"validation.dataset_path = '.*' in the command line: training.dataset = "
                                          r"'digits' .* holds out its own data"):  # fmt: skip
        parse_args([*TINY, *LOSS_FLAGS, "--validation.dataset_path", str(tmp_path)])
    missing = str(tmp_path / "none")
    with pytest.raises(
        ConfigError, match=rf"validation.dataset_path = '{missing}' in the command line: no such folder"
    ):
        parse_args([*TINY, *LOSS_FLAGS, "--training.dataset", "imagefolder", "--training.dataset_path",
                    str(tmp_path), "--validation.dataset_path", missing])  # fmt: skip
    with pytest.raises(ConfigError, match=r"validation.enable = True .* both 0 there is nothing to validate"):
        parse_args([*TINY, *LOSS_FLAGS, "--validation.loss_num_samples", "0"])
    with pytest.raises(ConfigError, match=r"validation.loss_freq = 0 in the command line: must be > 0"):
        parse_args([*TINY, *LOSS_FLAGS, "--validation.loss_freq", "0"])
    parse_args([*TINY, *LOSS_FLAGS, "--validation.loss_num_samples", "0", "--validation.enable", "false"])


def test_held_out_latents_take_the_training_latents_normalization(tmp_path):
    """Held-out shards (their own per-channel statistics in meta.json) reach the model normalized as the training
    latents are; shards of another tokenizer, or of other classes, are refused naming both folders."""
    from tests.test_cosmos_latent_decoder import make_image_folder, make_jit_tokenizer
    from tests.test_latents import TINY_LATENT_ARGS, prepare_folder
    from torchtitan.datasets.latents import LatentShardDataset

    make_jit_tokenizer(tmp_path / "tok")
    assert prepare_folder(make_image_folder(tmp_path / "images"), tmp_path / "tok", tmp_path / "train")
    assert prepare_folder(make_image_folder(tmp_path / "val", per_class=2, size=(16, 16)), tmp_path / "tok",
                          tmp_path / "held")  # fmt: skip
    cfg = SimpleNamespace(training=SimpleNamespace(dataset="latents", dataset_path=str(tmp_path / "train"),
                                                   image_size=0),
                          validation=SimpleNamespace(dataset_path=str(tmp_path / "held")),
                          latent=SimpleNamespace(scale_factor=0.0, stats_file=""))  # fmt: skip
    held = build_held_out_dataset(cfg, TINY_LATENT_ARGS)
    train_norm = LatentShardDataset(tmp_path / "train").normalization
    assert train_norm.mean != LatentShardDataset(tmp_path / "held").normalization.mean  # their own would differ
    assert len(held) == 6
    for i in range(len(held)):
        torch.testing.assert_close(held[i][0], train_norm.normalize(held.raw(i)[0].float()))  # never flipped
    make_jit_tokenizer(tmp_path / "other", seed=1)
    assert prepare_folder(tmp_path / "val", tmp_path / "other", tmp_path / "other_held")
    cfg.validation.dataset_path = str(tmp_path / "other_held")
    with pytest.raises(ValueError, match=rf"{tmp_path / 'other_held'} holds latents of cosmos_jit:.* and "
                                         rf"training.dataset_path {tmp_path / 'train'} of cosmos_jit:"):  # fmt: skip
        build_held_out_dataset(cfg, TINY_LATENT_ARGS)
