"""Llama 3 through the very trainer the DiT uses (train.py, one TrainSpec registration): the embedded text trains and
its validation perplexity falls, a resumed run equals an uninterrupted one, the logs speak in tokens, and a Hugging
Face folder is the starting point (`checkpoint.initial_load_in_hf`) with logits equal to transformers' (1e-5)."""

import json

import pytest
import torch

from tests.conftest import ROOT, read_metrics, run_train
from torchtitan.config_manager import ConfigError, parse_args

CONFIG = str(ROOT / "train_configs/llama3_debug.toml")
SHORT = ["--job.config_file", CONFIG, "--training.seq_len", "64", "--training.local_batch_size", "8",
         "--metrics.log_freq", "10", "--metrics.enable_tensorboard", "false",
         "--lr_scheduler.warmup_steps", "5"]  # fmt: skip


def test_embedded_text_trains_and_validation_perplexity_falls(tmp_path):
    run_train([*SHORT, "--job.dump_folder", str(tmp_path), "--training.steps", "60", "--validation.freq", "20",
               "--checkpoint.enable", "false"])  # fmt: skip
    train, validation = read_metrics(tmp_path), read_metrics(tmp_path, validation=True)
    assert [r["step"] for r in validation] == [20, 40, 60]
    perplexity = [r["validation_perplexity"] for r in validation]
    assert perplexity[0] > perplexity[1] > perplexity[2], perplexity
    assert perplexity[-1] < 20 < 258  # from uniform over the bytes to the text's structure
    for r in validation:  # perplexity is exp(mean token loss)
        assert r["validation_perplexity"] == pytest.approx(torch.tensor(r["validation_loss"]).exp().item(), rel=1e-6)
    assert train[0]["tokens_per_second"] == pytest.approx(train[0]["sequences_per_second"] * 64)
    assert "images_per_second" not in train[0]


def test_resumed_run_equals_uninterrupted(tmp_path):
    args = [*SHORT, "--training.steps", "8", "--metrics.log_freq", "1", "--validation.enable", "false",
            "--checkpoint.enable", "true", "--checkpoint.interval", "4"]  # fmt: skip
    run_train([*args, "--job.dump_folder", str(tmp_path / "whole")])
    run_train([*args, "--job.dump_folder", str(tmp_path / "cut"), "--training.steps", "4"])
    run_train([*args, "--job.dump_folder", str(tmp_path / "cut")])  # resumes at step 4: model, Adam, data position
    whole, cut = read_metrics(tmp_path / "whole"), read_metrics(tmp_path / "cut")
    assert [r["step"] for r in cut] == list(range(1, 9))
    assert [r["loss"] for r in cut] == [r["loss"] for r in whole]


def _hf_folder(path, hidden_size: int = 64):
    """A random transformers LlamaForCausalLM of the debugmodel's shape (258 bytes, 2 layers, GQA 4/2), saved."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=258, hidden_size=hidden_size, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, tie_word_embeddings=False,
        attn_implementation="eager",
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(1 + 0.2 * torch.randn_like(param) if "norm" in name else 0.1 * torch.randn_like(param))
    model.save_pretrained(path)
    return model


@pytest.mark.parametrize("ac", ["none", "full"])
def test_trainer_starts_from_a_hugging_face_folder(tmp_path, ac):
    from torchtitan.trainer import Trainer

    hf = _hf_folder(tmp_path / "hf")
    cfg = parse_args([*SHORT, "--job.dump_folder", str(tmp_path / "run"), "--checkpoint.initial_load_path",
                      str(tmp_path / "hf"), "--checkpoint.initial_load_in_hf", "true", "--activation_checkpoint.mode",
                      ac, "--validation.enable", "false"])  # fmt: skip
    trainer = Trainer(cfg)
    try:
        tokens = torch.randint(0, 258, (2, 24), generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            diff = (trainer.model(tokens) - hf(tokens).logits).abs().max().item()
        assert diff < 1e-5, diff
    finally:
        trainer.close()


def test_hugging_face_folder_of_another_shape_is_refused_by_key(tmp_path):
    from torchtitan.trainer import Trainer

    _hf_folder(tmp_path / "hf", hidden_size=32)
    cfg = parse_args([*SHORT, "--job.dump_folder", str(tmp_path / "run"), "--checkpoint.initial_load_path",
                      str(tmp_path / "hf"), "--checkpoint.initial_load_in_hf", "true"])  # fmt: skip
    with pytest.raises(ConfigError, match=r"checkpoint.initial_load_path = .*config.json: dim is 32, the model has 64"):
        Trainer(cfg).close()
    with pytest.raises(ConfigError, match="checkpoint.initial_load_in_hf.*model.name 'dit'.*none"):
        parse_args(["--checkpoint.initial_load_in_hf", "true", "--checkpoint.initial_load_path", "x"])


def test_family_keys_are_refused_by_name():
    for flags, message in [
        (["--training.dataset", "digits"], r"training.dataset = 'digits' .*reads \['stdlib', 'text'"),
        (["--sampling.freq", "10"], "sampling.freq = 10 .*image sample grids are the DiT's"),
        (["--dp.enable", "true", "--dp.augmult", "2"], "dp.augmult = 2 .*no per-sample randomness"),
        (["--model.converters", "fused_norm"], "'fused_norm' is a DiT kernel"),
        (["--training.seq_len", "512"], "training.seq_len 512 is longer than the flavor's max_seq_len 256"),
    ]:
        with pytest.raises(ConfigError, match=message):
            parse_args(["--job.config_file", CONFIG, *flags])
    with pytest.raises(ConfigError, match="validation.enable = True .*model.name 'dit'"):
        parse_args(["--validation.enable", "true"])
    json.dumps(parse_args(["--job.config_file", CONFIG]).to_dict())  # the resolved config serializes
