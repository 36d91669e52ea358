"""scripts/train_tokenizer.py: a byte-level BPE trained on a dataset's train split only, read back by the trainer's
tokenizer route, refusing bad input without overwriting anything, and trained with for real."""

import math
import subprocess
import sys

import pytest

from tests.conftest import ROOT, read_metrics, run_train
from torchtitan.datasets.text_tokenizers import HFTokenizer, build_text_tokenizer

pytest.importorskip("tokenizers")

sys.path.insert(0, str(ROOT))
from scripts.train_tokenizer import main  # noqa: E402

TRAIN_WORDS = ["alphaword", "betaword", "gammaword", "the", "loader", "packs"]


@pytest.fixture
def corpus(tmp_path):
    """A text folder: train documents of lowercase words; validation/ holds a word of letters the train split lacks."""
    root = tmp_path / "corpus"
    (root / "validation").mkdir(parents=True)
    for i in range(12):
        words = [TRAIN_WORDS[(i + j) % len(TRAIN_WORDS)] for j in range(300)]
        (root / f"doc{i}.txt").write_text(" ".join(words) + f" {i}.\n")
    (root / "validation" / "held_out.txt").write_text(" ".join(["QXJZQXJZ"] * 500))
    return root


def test_trains_on_the_train_split_and_the_trainer_reads_it(corpus, tmp_path, capsys):
    out = tmp_path / "bpe"
    assert main(["--out", str(out), "--vocab-size", "300", "--dataset", "text", "--dataset-path", str(corpus)]) == 0
    assert "train documents" in capsys.readouterr().out
    tokenizer = build_text_tokenizer(str(out))  # the folder resolves to its tokenizer.json
    assert isinstance(tokenizer, HFTokenizer) and 258 < tokenizer.vocab_size <= 300
    assert tokenizer.bos_id is not None and tokenizer.eos_id is not None and tokenizer.bos_id != tokenizer.eos_id
    text = "alphaword betaword the loader"
    ids = tokenizer.encode(text)
    assert len(ids) < len(text.encode()) // 2 and tokenizer.decode(ids) == text  # merges learned, round trip
    held_out = "QXJZQXJZ"
    assert len(tokenizer.encode(held_out)) == len(held_out)  # no merge from the validation split: one token a byte
    # The trainer trains with it (the lab flavor's vocabulary of 10,000 holds it).
    run = tmp_path / "run"
    run_train(["--job.config_file", str(ROOT / "train_configs/llama3_debug.toml"), "--model.flavor", "lab",
               "--model.tokenizer_path", str(out), "--training.dataset", "text", "--training.dataset_path",
               str(corpus), "--training.seq_len", "32", "--training.local_batch_size", "2", "--training.steps", "2",
               "--metrics.log_freq", "1", "--metrics.enable_tensorboard", "false", "--validation.enable", "false",
               "--checkpoint.enable", "false", "--job.dump_folder", str(run)])  # fmt: skip
    losses = [r["loss"] for r in read_metrics(run)]
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses)
    assert abs(losses[0] - math.log(10000)) < 1.0  # the untrained model's loss over the flavor's vocabulary


def test_bad_input_is_refused_and_nothing_is_overwritten(corpus, tmp_path):
    out = tmp_path / "bpe"
    args = ["--out", str(out), "--dataset", "text", "--dataset-path", str(corpus)]
    assert main([*args, "--vocab-size", "300"]) == 0
    before = (out / "tokenizer.json").read_bytes()
    cli = [sys.executable, "scripts/train_tokenizer.py", *args]
    again = subprocess.run([*cli, "--vocab-size", "280"], cwd=ROOT, capture_output=True, text=True)
    assert again.returncode == 2 and "tokenizer.json exists; not overwritten" in again.stderr
    assert (out / "tokenizer.json").read_bytes() == before
    small = subprocess.run([*cli[:3], str(tmp_path / "other"), *cli[4:], "--vocab-size", "100"], cwd=ROOT,
                           capture_output=True, text=True)  # fmt: skip
    assert small.returncode == 2 and "--vocab-size 100" in small.stderr and not (tmp_path / "other").exists()
    assert main(["--out", str(tmp_path / "x"), "--dataset", "text"]) == 2  # no --dataset-path
    assert main(["--out", str(tmp_path / "x"), "--dataset", "text", "--dataset-path", str(tmp_path / "no")]) == 2


def test_default_route_is_the_embedded_stdlib_train_split(tmp_path, capsys):
    from torchtitan.datasets.text import stdlib_documents

    assert main(["--out", str(tmp_path / "bpe"), "--vocab-size", "400"]) == 0
    assert f"from {len(stdlib_documents('train'))} stdlib train documents" in capsys.readouterr().out
    tokenizer = build_text_tokenizer(str(tmp_path / "bpe"))
    text = "def __init__(self):\n        return None\n"
    assert tokenizer.vocab_size == 400 and len(tokenizer.encode(text)) < len(text) // 2
