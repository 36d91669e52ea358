"""DP-SGD on the Llama 3 family: the engine's rules (Embedding with repeated tokens, RMSNorm, Linear on (B, T, D))
against torch.func per-sample gradients of the plain model (fp32, relative error < 1e-4), through
`parallelize_llama3` as the trainer calls it; tied embeddings refused by name; the trainer's DP step under FSDP-2
(gloo) equal to one process's (noise included: drawn once per element of the global gradient)."""

import copy

import pytest
import torch

from tests.conftest import ROOT
from tests.test_parallelisms import layout_gradients
from torchtitan.config_manager import ConfigError, parse_args
from torchtitan.dp import DPEngine
from torchtitan.dp.testing import clipped_mean, per_sample_grads
from torchtitan.models.llama3 import Llama3, llama3_configs
from torchtitan.models.llama3.parallelize import parallelize_llama3
from torchtitan.parallelisms.parallel_dims import ParallelDims

CONFIG = str(ROOT / "train_configs/llama3_debug.toml")


def _plain(num_labels: int = 0, tie: bool = False) -> Llama3:
    args = copy.deepcopy(llama3_configs["debugmodel"])
    args.num_labels, args.tie_embeddings = num_labels, tie
    torch.manual_seed(0)
    model = Llama3(args)
    model.init_weights()
    return model


def _batch(num_labels: int, rows: int = 4, seq: int = 24):
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 12, (rows, seq), generator=g)  # 12 ids in 24 positions: every row repeats tokens
    labels = torch.randint(0, num_labels, (rows,), generator=g) if num_labels else torch.roll(tokens, -1, 1)
    return tokens, labels


class _TakesLabels(torch.nn.Module):
    """model(tokens, labels) -> model(tokens): per_sample_grads passes the whole batch to the model."""

    def __init__(self, model):
        super().__init__()
        self.llama = model

    def forward(self, tokens, labels):
        return self.llama(tokens)


def _loss(out, tokens, labels):
    if out.dim() == 2:  # classifier logits (B, num_labels)
        return torch.nn.functional.cross_entropy(out, labels, reduction="none")
    return torch.nn.functional.cross_entropy(out.flatten(0, 1), labels.flatten(), reduction="none").view(
        labels.shape).mean(1)  # fmt: skip


@pytest.mark.parametrize("mode", ["ghost", "flash", "bookkeeping", "flash_bookkeeping"])
@pytest.mark.parametrize("head, ac", [("lm", "none"), ("lm", "full"), ("classifier", "full")])
def test_llama3_dp_matches_torch_func(mode, head, ac):
    num_labels = 3 if head == "classifier" else 0
    plain, (tokens, labels) = _plain(num_labels), _batch(num_labels)
    grads = per_sample_grads(_TakesLabels(plain), _loss, tokens, labels)
    grads = {name.removeprefix("llama."): g for name, g in grads.items()}
    max_norm = torch.cat([g.flatten(1) for g in grads.values()], 1).norm(dim=1).median().item()  # half clipped
    clipped, norms = clipped_mean(grads, max_norm)
    config = parse_args(["--job.config_file", CONFIG, "--dp.enable", "true", "--activation_checkpoint.mode", ac])
    model = parallelize_llama3(copy.deepcopy(plain), ParallelDims(1, 1, 1, False), config)
    engine = DPEngine(model, mode, max_norm, 0.0)
    got = engine.backward(_loss(model(tokens), tokens, labels))
    torch.testing.assert_close(got, norms, rtol=1e-4, atol=0)
    for name, p in model.named_parameters():
        name = name.replace("_checkpoint_wrapped_module.", "")
        err = ((p.grad - clipped[name]).norm() / clipped[name].norm()).item()
        assert err < 1e-4, f"{mode}, {head}, AC {ac}: {name} relative error {err:.2e}"


def test_tied_embeddings_are_refused_by_name():
    """The engine names the shared weight; config validation says why and what to do, before anything is built."""
    with pytest.raises(NotImplementedError, match=r"shared between modules: \['tok_embeddings.weight'\]"):
        DPEngine(_plain(tie=True), "flash_bookkeeping", 1.0, 0.0)
    with pytest.raises(ConfigError, match="model.flavor = 'Llama-3.2-1B'.*tied to the token embedding"):
        parse_args(["--job.config_file", CONFIG, "--dp.enable", "true", "--model.flavor", "Llama-3.2-1B"])


@pytest.mark.slow
def test_llama3_dp_step_under_fsdp_matches_one_process(tmp_path):
    """The trainer's first DP step (flash_bookkeeping, noise on, full AC) on FSDP-2 against one process, same global
    batch of 8 windows of the embedded text."""
    dp = ["--job.config_file", CONFIG, "--dp.enable", "true", "--dp.mode", "flash_bookkeeping", "--dp.noise_multiplier",
          "0.5", "--dp.max_grad_norm", "0.05", "--validation.enable", "false", "--checkpoint.enable", "false",
          "--activation_checkpoint.mode", "full", "--training.seq_len", "32"]  # fmt: skip
    one = layout_gradients(tmp_path / "one", 1, {"one": [*dp, "--training.local_batch_size", "8"]})["one"]
    fsdp = ["--parallelism.data_parallel_shard_degree", "2", "--training.local_batch_size", "4"]
    two = layout_gradients(tmp_path / "two", 2, {"fsdp": [*dp, *fsdp]})["fsdp"]
    for name, expected in one["grads"].items():
        error = (two["grads"][name] - expected).norm() / expected.norm()
        assert error < 1e-5, f"FSDP-2: {name} gradient off by {error:.2e} (relative)"
