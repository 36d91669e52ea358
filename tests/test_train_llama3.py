"""Llama 3 through the very trainer the DiT uses (train.py, one TrainSpec registration): the embedded text trains and
its validation perplexity falls, a resumed run equals an uninterrupted one, the logs speak in tokens, and a Hugging
Face folder is the starting point (`checkpoint.initial_load_format 'hf'`) with logits equal to transformers' (1e-5)."""

import importlib.util
import json
import logging
from dataclasses import replace

import pytest
import torch

from tests.conftest import ROOT, read_metrics, run_train
from torchtitan.config_manager import ConfigError, parse_args
from torchtitan.models.llama3.model import RopeScaling

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


def _text_folder(root, documents: int):
    """Train documents, and a validation/ subfolder of 10 windows of seq_len 16 (+ 1) in bytes."""
    (root / "validation").mkdir(parents=True)
    for i in range(documents):
        (root / f"doc{i}.txt").write_text(f"document {i}: " + "the loader packs windows. " * 20)
    (root / "validation" / "held.txt").write_text("held-out text, read once. " * 7)  # 184 tokens with BOS, EOS
    return root


def _text_args(tmp_path, data, *extra: str) -> list[str]:
    return ["--job.config_file", CONFIG, "--job.dump_folder", str(tmp_path / "run"), "--training.dataset", "text",
            "--training.dataset_path", str(data), "--training.local_batch_size", "4", "--validation.steps", "50",
            "--metrics.enable_tensorboard", "false", *extra]  # fmt: skip


def test_validation_reads_the_split_once_and_a_resume_checks_the_data(tmp_path, monkeypatch, caplog, capsys):
    """Trainers built in-process, no step taken. Validation with validation.steps past the held-out split's end
    counts each window once (against the mean over the split). Its checkpoint, resumed on a smaller copy of the
    data with another training.seq_len, warns naming both keys and restarts the data position (the weights carry
    over), and under DP that the privacy unit, a window of seq_len tokens, changed; resumed with another tokenizer,
    train.py refuses in one error line naming model.tokenizer_path."""
    import torch.nn.functional as F

    from scripts.train_tokenizer import train_tokenizer
    from torchtitan.datasets.loader import DiffusionDataLoader
    from torchtitan.tools.logging import logger
    from torchtitan.trainer import Trainer

    data, smaller = _text_folder(tmp_path / "data", 12), _text_folder(tmp_path / "smaller", 6)
    private = ["--dp.enable", "true", "--dp.noise_multiplier", "1.0"]  # the privacy unit is a window: told it changed
    logger.addHandler(caplog.handler)  # the project logger does not propagate to the root logger
    try:
        with caplog.at_level(logging.INFO, logger.name):
            trainer = Trainer(parse_args(_text_args(tmp_path, data, "--training.seq_len", "16", *private)))
            try:
                with torch.no_grad():  # far from the near-uniform start, so that each window has a loss of its own
                    for param in trainer.model.parameters():
                        param.normal_(0, 0.5)
                metrics = trainer.validate()
                windows = trainer.validation_loader.dataset
                x, y = (torch.stack(column) for column in zip(*(windows[i] for i in range(len(windows)))))
                with torch.no_grad():
                    losses = F.cross_entropy(trainer.model(x).flatten(0, 1), y.flatten(), reduction="none")
                per_window = losses.view(len(windows), -1).double().mean(1)
                for _ in range(3):  # a data position inside the epoch, for the checkpoint
                    next(trainer.dataloader)
                trainer.checkpointer.save(3)
            finally:
                trainer.close()
            assert len(windows) == 10 and abs(per_window[:8].mean() - per_window.mean()) > 1e-3  # a miscount shows
            assert metrics["validation_loss"] == pytest.approx(per_window.mean().item(), rel=1e-6)
            used = "validation: 3 batch(es) of 4 per rank, 10 of the split's 10 samples, each once; validation.steps"
            assert f"{used} = 50 reaches past its end" in caplog.text

            resumed = Trainer(parse_args(_text_args(tmp_path, smaller, "--training.seq_len", "8", *private)))
            try:
                assert resumed.step == 3
                fresh = DiffusionDataLoader(
                    resumed.dataloader.dataset, 4, 0, 1, 0, resumed.job_config.training.dataloader
                )
                assert torch.equal(next(resumed.dataloader)[0], next(fresh)[0])  # epoch 0 from its start
            finally:
                resumed.close()
    finally:
        logger.removeHandler(caplog.handler)
    assert (f"resumed on changed data: training.dataset_path (dataset_path: {data} -> {smaller}); training.seq_len "
            "(seq_len: 16 -> 8). The weights carry over") in caplog.text  # fmt: skip
    assert (
        "dp: training.seq_len changed (16 -> 8), and with it the privacy unit, one example: the 0 steps done "
        "protected windows of 16 tokens, the steps to come protect windows of 8."
    ) in caplog.text

    train_tokenizer(["a tokenizer of bytes with other ids"], 258, tmp_path / "bpe")  # the model's 258 rows
    spec = importlib.util.spec_from_file_location("train", ROOT / "train.py")
    train = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(train)
    monkeypatch.setattr(train, "init_logger", lambda: None)  # keep the project logger as the other tests see it
    capsys.readouterr()
    bpe = str(tmp_path / "bpe" / "tokenizer.json")
    assert train.main(_text_args(tmp_path, data, "--training.seq_len", "16", *private, "--model.tokenizer_path",
                                 bpe)) == 2  # fmt: skip
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("error: model.tokenizer_path: the checkpoint was trained with the tokenizer bytes "), last
    assert f"this run has {bpe} (sha1 " in last and "would stand for other text" in last


# debugmodel: head dim 16, RoPE theta 1e4, wavelengths 6.3, 20, 63, 199 ... 19869 tokens. Llama 3.1's scaling from an
# original context of 64 tokens (high-frequency cut 64 / 4 = 16) keeps the first, interpolates the next two and slows
# the rest by 8: over 24 tokens the slowed ones turn by other angles (0.76 rad unscaled, 0.09 scaled at 199 tokens).
SCALED_ROPE = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}  # fmt: skip
# A config.json value that differs from the debugmodel flavor's: (LlamaConfig arguments, our field, its value).
HF_NUMERICS = {
    "rms_norm_eps": ({"rms_norm_eps": 1e-6}, "norm_eps", 1e-6),  # transformers' default; ours is 1e-5
    "rope_theta": ({"rope_parameters": {"rope_type": "default", "rope_theta": 5e5}}, "rope_theta", 5e5),
    "rope_scaling": ({"rope_parameters": SCALED_ROPE}, "rope_scaling", RopeScaling(8.0, 1.0, 4.0, 64)),
    "max_position_embeddings": ({"max_position_embeddings": 128}, "max_seq_len", 128),
}


def _hf_folder(path, hidden_size: int = 64, num_labels: int = 0, **config):
    """A random transformers LlamaForCausalLM (LlamaForSequenceClassification with num_labels) of the debugmodel's
    shape (258 bytes, 2 layers, GQA 4/2) and numerics, `config` overriding LlamaConfig's arguments, saved."""
    transformers = pytest.importorskip("transformers")
    values = dict(vocab_size=258, hidden_size=hidden_size, intermediate_size=192, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5,
                  rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, tie_word_embeddings=False,
                  pad_token_id=0, num_labels=max(num_labels, 2))  # fmt: skip
    config = transformers.LlamaConfig(**{**values, **config}, attn_implementation="eager")
    cls = transformers.LlamaForSequenceClassification if num_labels else transformers.LlamaForCausalLM
    torch.manual_seed(0)
    model = cls(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(1 + 0.2 * torch.randn_like(param) if "norm" in name else 0.1 * torch.randn_like(param))
    model.save_pretrained(path)
    return model


def _hf_args(folder, *flags) -> list[str]:
    """Flags that start a debugmodel run from the Hugging Face folder `folder`."""
    return [*SHORT, "--job.dump_folder", str(folder.parent / "run"), "--checkpoint.initial_load_format", "hf",
            "--checkpoint.initial_load_path", str(folder), *flags]  # fmt: skip


def _tokens(seq_len: int = 24) -> torch.Tensor:
    return torch.randint(1, 258, (2, seq_len), generator=torch.Generator().manual_seed(1))  # no pad id 0


@pytest.mark.parametrize("ac", ["none", "full"])
def test_trainer_starts_from_a_hugging_face_folder(tmp_path, ac):
    """The model takes config.json's numerics; with ac "none", its checkpoint then resumes with them (the
    checkpoint records them), without the import keys, or with them and the folder gone."""
    from torchtitan.trainer import Trainer

    # Every numeric of config.json differs from the flavor's: the Trainer builds the model from config.json's.
    numerics = dict(rms_norm_eps=1e-6, max_position_embeddings=128, rope_parameters={**SCALED_ROPE, "rope_theta": 5e5})
    hf = _hf_folder(tmp_path / "hf", **numerics)
    trainer = Trainer(parse_args(_hf_args(tmp_path / "hf", "--activation_checkpoint.mode", ac,
                                          "--validation.enable", "false", "--checkpoint.enable", "true")))  # fmt: skip
    try:
        args = trainer.model_args
        assert (args.norm_eps, args.rope_theta, args.max_seq_len) == (1e-6, 5e5, 128)
        assert args.rope_scaling == RopeScaling(8.0, 1.0, 4.0, 64)
        with torch.no_grad():
            diff = (trainer.model(_tokens()) - hf(_tokens()).logits).abs().max().item()
        assert diff < 1e-5, diff
        if ac == "none":  # a folder that turns bad before the weights are read: one message naming key and file
            trainer.checkpointer.save(1)
            weights = tmp_path / "hf" / "model.safetensors"
            weights.write_bytes(weights.read_bytes()[:1000])
            with pytest.raises(ConfigError, match=r"checkpoint.initial_load_path = .*model.safetensors: not a "
                                                  r"readable safetensors file"):  # fmt: skip
                trainer.load_initial_weights(str(tmp_path / "hf"), "hf")
    finally:
        trainer.close()
    if ac == "none":
        _resume_takes_the_recorded_numerics(tmp_path, hf, args)


def _resume_takes_the_recorded_numerics(tmp_path, hf, args) -> None:
    """The checkpoint of a run started from `hf` (built with `args`) resumes with config.json's numerics: without the
    import keys (the flavor's numerics would be others), and with them though the folder is gone; a new run from
    its weights (checkpoint.initial_load_path) takes them too."""
    import shutil

    from torchtitan.train_spec import build_model_args, get_train_spec
    from torchtitan.trainer import Trainer

    shutil.rmtree(tmp_path / "hf")
    resume = [*SHORT, "--job.dump_folder", str(tmp_path / "run"), "--validation.enable", "false",
              "--checkpoint.enable", "true"]  # fmt: skip
    resumed = Trainer(parse_args(resume))
    try:
        assert resumed.step == 1 and resumed.model_args == args
        with torch.no_grad():
            diff = (resumed.model(_tokens()) - hf(_tokens()).logits).abs().max().item()
        assert diff < 1e-5, diff
    finally:
        resumed.close()
    spec = get_train_spec("llama3")
    kept = parse_args(_hf_args(tmp_path / "hf", "--validation.enable", "false", "--checkpoint.enable", "true"))
    assert build_model_args(spec, kept) == args
    step1 = str(tmp_path / "run" / "checkpoint" / "step-1")  # a new run from its weights: the same numerics
    new = parse_args([*SHORT, "--job.dump_folder", str(tmp_path / "new"), "--checkpoint.initial_load_path", step1])
    assert build_model_args(spec, new) == args


@pytest.mark.parametrize("case", [*HF_NUMERICS, "rms_norm_eps-classifier"])
def test_hugging_face_config_numerics_build_the_model(tmp_path, case, caplog):
    """Each numeric config.json gives (not the flavor) builds the model, as the Trainer does it (build_model_args),
    with logits equal to transformers' (1e-5); the flavor's value would give others."""
    from torchtitan.models.llama3 import Llama3, llama3_configs
    from torchtitan.models.llama3.state_dict_adapter import read_hf_folder
    from torchtitan.tools.logging import logger
    from torchtitan.train_spec import build_model_args, get_train_spec

    hf_key, num_labels = case.removesuffix("-classifier"), 3 if case.endswith("-classifier") else 0
    hf_config, field, value = HF_NUMERICS[hf_key]
    hf = _hf_folder(tmp_path / "hf", num_labels=num_labels, **hf_config)
    logger.addHandler(caplog.handler)  # the project logger does not propagate to the root logger
    try:
        with caplog.at_level(logging.INFO, logger.name):
            classifier = ["--model.num_classes", "3", "--training.dataset", "synthetic_classification"]
            cfg = parse_args(_hf_args(tmp_path / "hf", *(classifier if num_labels else [])))
    finally:
        logger.removeHandler(caplog.handler)
    assert f"config.json's {hf_key} {value}" in caplog.text
    args = build_model_args(get_train_spec("llama3"), cfg)
    flavor = replace(llama3_configs["debugmodel"], num_labels=num_labels)
    assert getattr(args, field) == value != getattr(flavor, field)
    assert replace(args, **{field: getattr(flavor, field)}) == flavor  # nothing else changed
    model = Llama3(args)
    model.load_state_dict(read_hf_folder(tmp_path / "hf", args))
    flavors_model = Llama3(flavor)
    flavors_model.load_state_dict(model.state_dict())
    with torch.no_grad():
        ours, theirs, flavors = model(_tokens()), hf(_tokens()).logits, flavors_model(_tokens())
    assert (ours - theirs).abs().max().item() <= 1e-5
    if field != "max_seq_len":
        assert (flavors - theirs).abs().max().item() > 1e-3
        return
    # max_position_embeddings changes no logit (transformers' llama3 scaling reads its own original context, which
    # save_pretrained always writes): it is the RoPE table's length, the longest sequence the model takes.
    assert torch.equal(flavors, ours)
    with pytest.raises(ValueError, match="sequence length 129 exceeds max_seq_len 128"):
        model(_tokens(129))
    with pytest.raises(ConfigError, match="seq_len 200 is longer than config.json's max_position_embeddings 128"):
        parse_args(_hf_args(tmp_path / "hf", "--training.seq_len", "200"))


def test_special_ids_that_differ_from_config_json_are_warned_with_both(tmp_path, caplog):
    """The tokenizer packs each document as BOS + text + EOS; a config.json whose bos_token_id / eos_token_id are
    other ids (here LlamaConfig's defaults 1 and 2, which save_pretrained writes) gets a warning naming both files
    and all four ids; ids that agree (one of a list, as instruct models give several EOS) get none."""
    from torchtitan.tools.logging import logger
    from torchtitan.train_spec import build_model_args, get_train_spec

    spec = get_train_spec("llama3")
    logger.addHandler(caplog.handler)  # the project logger does not propagate to the root logger
    try:
        for name, ids in (("other", {}), ("same", {"bos_token_id": 256, "eos_token_id": [2, 257]})):
            _hf_folder(tmp_path / name, **ids)
            cfg = parse_args(_hf_args(tmp_path / name))
            with caplog.at_level(logging.WARNING, logger.name):
                spec.build_dataloader_fn(cfg, build_model_args(spec, cfg), 0, 1, 0, "train").close()
    finally:
        logger.removeHandler(caplog.handler)
    # A set: the record reaches caplog twice where the logger also propagates (no init_logger in this process).
    warnings = {r.getMessage() for r in caplog.records if r.name == logger.name and r.levelno == logging.WARNING}
    assert warnings == {
        f"{tmp_path / 'other' / 'config.json'} has bos_token_id 1 and eos_token_id 2, but model.tokenizer_path "
        "'bytes' packs each document as BOS 256 + text + EOS 257: the weights learned other ids for a document's "
        "start and end. Train with the tokenizer they were trained with (model.tokenizer_path), or correct "
        "config.json"
    }


def test_bad_hugging_face_folder_is_one_error_line(tmp_path, monkeypatch, capsys):
    """config.json is read when the config is validated: another shape or another model family is refused there,
    naming checkpoint.initial_load_path and the file, and train.py ends in one error line with status 2."""
    _hf_folder(tmp_path / "hf", hidden_size=32)
    at_path = rf"checkpoint.initial_load_path = '{tmp_path / 'hf'}' in the command line: {tmp_path / 'hf'}"
    with pytest.raises(ConfigError, match=rf"^{at_path}/config.json: dim \(hidden_size\) is 32, the flavor has 64$"):
        parse_args(_hf_args(tmp_path / "hf"))
    gpt2 = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_embd": 64, "n_layer": 2, "vocab_size": 258}
    (tmp_path / "hf" / "config.json").write_text(json.dumps(gpt2))
    with pytest.raises(ConfigError, match=rf"^{at_path}/config.json: not a Llama config \(model_type 'gpt2'"):
        parse_args(_hf_args(tmp_path / "hf"))
    spec = importlib.util.spec_from_file_location("train", ROOT / "train.py")
    train = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(train)
    monkeypatch.setattr(train, "init_logger", lambda: None)  # keep the project logger as the other tests see it
    assert train.main(_hf_args(tmp_path / "hf")) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith(f"error: checkpoint.initial_load_path = '{tmp_path / 'hf'}'"), last
    assert "config.json: not a Llama config (model_type 'gpt2', architectures ['GPT2LMHeadModel'])" in last
    formats = r"\['dcp', 'dit_pt', 'repa_pt', 'diffusers', 'lightningdit_pt'\]"
    refusal = r"checkpoint.initial_load_format.*model.name 'dit'.*no 'hf' weights.*" + formats
    with pytest.raises(ConfigError, match=refusal):
        parse_args(["--checkpoint.initial_load_format", "hf", "--checkpoint.initial_load_path", "x"])


def test_family_keys_are_refused_by_name():
    for flags, message in [
        (["--training.dataset", "digits"], r"training.dataset = 'digits' .*reads \['stdlib', 'text'"),
        (["--sampling.freq", "10"], "sampling.freq = 10 .*image sample grids are the DiT's"),
        (["--dp.enable", "true", "--dp.augmult", "2"], "dp.augmult = 2 .*no per-sample randomness"),
        (["--model.converters", "fused_norm"], "'fused_norm' is a DiT kernel"),
        (["--training.seq_len", "512"], "training.seq_len 512 is longer than the flavor's max_seq_len 256"),
        (["--model.num_classes", "2"], "model.num_classes = 2 .*training.dataset = 'stdlib' .*is unlabelled text"),
        (
            ["--model.num_classes", "2", "--training.dataset", "text", "--training.dataset_path", "x"],
            "model.num_classes = 2 .*training.dataset = 'text' .*is unlabelled text",
        ),
    ]:
        with pytest.raises(ConfigError, match=message):
            parse_args(["--job.config_file", CONFIG, *flags])
    with pytest.raises(ConfigError, match="validation.enable = True .*model.name 'dit'"):
        parse_args(["--validation.enable", "true"])
    json.dumps(parse_args(["--job.config_file", CONFIG]).to_dict())  # the resolved config serializes
