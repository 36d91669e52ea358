"""Text tokenizers and datasets: round trips against the reference libraries, exact packing, the stdlib corpus and
its split, text folders and their errors, synthetic classification, and resuming through DiffusionDataLoader."""

import base64
import hashlib
import json
import re
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from tests.conftest import ROOT
from torchtitan.datasets.loader import DiffusionDataLoader
from torchtitan.datasets.text import (
    VALIDATION_EVERY,
    SyntheticClassificationDataset,
    TextPackedDataset,
    build_text_dataset,
    clear_token_cache,
    is_validation_document,
    pack_documents,
    stdlib_files,
    text_folder_documents,
)
from torchtitan.datasets.text_tokenizers import (
    LLAMA3_SPECIAL_TOKENS,
    ByteTokenizer,
    HFTokenizer,
    TiktokenTokenizer,
    build_text_tokenizer,
)

SAMPLE = "Hello wörld: naïve café, 世界 ✓ — tabs\tand\nnew lines 12345."


def make_text(n_lines: int = 200) -> list[str]:
    words = ["the", "loader", "resumes", "tokens", "packing", "window", "naïve", "café", "世界", "shard", "rank"]
    rng = np.random.default_rng(0)
    return [" ".join(rng.choice(words, 8)) + f" {i}." for i in range(n_lines)]


def test_byte_tokenizer_round_trip():
    tokenizer = ByteTokenizer()
    ids = tokenizer.encode(SAMPLE)
    assert ids == list(SAMPLE.encode("utf-8")) and max(ids) < 256 and len(ids) > len(SAMPLE)  # multi-byte chars
    assert tokenizer.decode(ids) == SAMPLE
    assert tokenizer.decode([tokenizer.bos_id, *ids, tokenizer.eos_id]) == SAMPLE  # specials dropped
    assert tokenizer.decode(torch.tensor(ids)) == SAMPLE
    assert tokenizer.decode(list("é".encode())[:1]) == "\ufffd"  # a window cut inside a character
    assert (tokenizer.vocab_size, tokenizer.bos_id, tokenizer.eos_id) == (258, 256, 257)


def train_tiny_bpe(path, vocab_size: int = 300):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator(make_text(), trainer)
    tokenizer.save(str(path))
    return tokenizer


def test_hf_tokenizer_matches_the_tokenizers_library(tmp_path):
    reference = train_tiny_bpe(tmp_path / "tokenizer.json")
    tokenizer = build_text_tokenizer(str(tmp_path))  # the folder resolves to its tokenizer.json
    assert isinstance(tokenizer, HFTokenizer)
    assert tokenizer.vocab_size == reference.get_vocab_size() and 258 < tokenizer.vocab_size <= 300
    assert (tokenizer.bos_id, tokenizer.eos_id) == (reference.token_to_id("<s>"), reference.token_to_id("</s>"))
    text = make_text(3)[1] + " " + SAMPLE
    ids = tokenizer.encode(text)
    assert ids == reference.encode(text).ids and len(ids) < len(text.encode())  # merges were learned and used
    assert tokenizer.decode([tokenizer.bos_id, *ids, tokenizer.eos_id]) == text
    assert tokenizer.encode_batch([text, "x"]) == [ids, reference.encode("x").ids]
    explicit = HFTokenizer(tmp_path / "tokenizer.json", bos_token="</s>", eos_token="<s>")
    assert (explicit.bos_id, explicit.eos_id) == (tokenizer.eos_id, tokenizer.bos_id)
    with pytest.raises(ValueError, match=re.escape("eos_token '<|nope|>' is not a token of")):
        HFTokenizer(tmp_path / "tokenizer.json", eos_token="<|nope|>")


def test_hf_tokenizer_never_reads_special_tokens_out_of_text(tmp_path):
    """A document holding "<|end_of_text|>" (or BOS) as text is encoded as that text's ordinary tokens, with a
    tokenizer of scripts/train_tokenizer.py (specials marked special) and with one whose EOS is a plain added
    token; the EOS id then appears only where packing ends a document."""
    from tokenizers import Tokenizer

    from scripts.train_tokenizer import train_tokenizer

    document = "x = '<|end_of_text|>' + '<|begin_of_text|>'  # both literal"
    train_tokenizer([document, make_text(20)[3]], 300, tmp_path / "trained")
    plain = Tokenizer.from_file(str(tmp_path / "trained" / "tokenizer.json"))
    plain.add_tokens(["<|eos|>"])  # a plain added token, matched in text unless made special
    plain.save(str(tmp_path / "plain.json"))
    for path, eos in ((tmp_path / "trained" / "tokenizer.json", None), (tmp_path / "plain.json", "<|eos|>")):
        tokenizer = HFTokenizer(path, eos_token=eos)
        text = document.replace("<|end_of_text|>", eos or "<|end_of_text|>")
        ids = tokenizer.encode(text)
        assert tokenizer.decode(ids) == text and {tokenizer.bos_id, tokenizer.eos_id}.isdisjoint(ids)
        assert tokenizer.encode_batch([text]) == [ids]
        stream = pack_documents([text, "y"], tokenizer).tolist()
        ends = [i for i, token in enumerate(stream) if token == tokenizer.eos_id]
        assert ends == [len(ids) + 1, len(stream) - 1]  # after BOS + the document, and at the very end


def test_a_broken_tokenizer_json_is_named_by_key_and_file(tmp_path):
    from tokenizers import Tokenizer, models

    from torchtitan.config_manager import parse_args
    from torchtitan.datasets import build_text_dataloader

    whole = Tokenizer(models.BPE()).to_str()
    (tmp_path / "tokenizer.json").write_text(whole)
    cfg = parse_args(["--job.config_file", str(ROOT / "train_configs/llama3_debug.toml"),
                      "--model.tokenizer_path", str(tmp_path)])  # fmt: skip
    for broken in (whole[: len(whole) // 2], "{nonsense", '{"version": "1.0"}'):  # truncated, not JSON, no model
        (tmp_path / "tokenizer.json").write_text(broken)
        message = rf"^model.tokenizer_path: {tmp_path}/tokenizer.json: not a readable Hugging Face tokenizer.json \("
        with pytest.raises(ValueError, match=message):
            build_text_dataloader(cfg, 258, 0, 0, 1, 0, "train")


def write_ranks(path, merges=(b"he", b"ll", b"hell", b"hello")) -> dict[bytes, int]:
    """A tiny but valid tiktoken ranks file: the 256 bytes, then merges (each made of two lower-ranked tokens)."""
    ranks = {bytes([b]): b for b in range(256)}
    ranks.update({token: 256 + i for i, token in enumerate(merges)})
    path.write_text("".join(f"{base64.b64encode(token).decode()} {rank}\n" for token, rank in ranks.items()))
    return ranks


def test_tiktoken_tokenizer_from_a_tiny_ranks_file(tmp_path):
    ranks = write_ranks(tmp_path / "tokenizer.model")
    tokenizer = build_text_tokenizer(str(tmp_path / "tokenizer.model"))
    assert isinstance(tokenizer, TiktokenTokenizer)
    base = len(ranks)  # 260 here; 128000 with Meta's file, giving 128000 / 128001 / 128256
    assert len(LLAMA3_SPECIAL_TOKENS) == 256 and LLAMA3_SPECIAL_TOKENS[9] == "<|eot_id|>"
    assert (tokenizer.bos_id, tokenizer.eos_id, tokenizer.vocab_size) == (base, base + 1, base + 256)
    # Llama 3's regex splits "hello" | " world"; the merges make "hello" one token, " world" stays bytes.
    assert tokenizer.encode("hello world") == [ranks[b"hello"], *b" world"]
    assert tokenizer.encode("hell") == [ranks[b"hell"]]
    # Text that looks like a special token is plain text, and decode drops real specials.
    assert tokenizer.bos_id not in tokenizer.encode("<|begin_of_text|>")
    for text in (SAMPLE, "hello <|end_of_text|> hello", " " * 30_000 + "x"):
        assert tokenizer.decode([tokenizer.bos_id, *tokenizer.encode(text), tokenizer.eos_id]) == text
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "tokenizer.model").write_text("aGU= 256\nnot-base64!! 3\n")
    with pytest.raises(ValueError, match=r"broken/tokenizer.model:2: not a tiktoken rank line"):
        build_text_tokenizer(str(tmp_path / "broken"))


def test_build_text_tokenizer_errors(tmp_path):
    assert isinstance(build_text_tokenizer("bytes"), ByteTokenizer)
    with pytest.raises(FileNotFoundError, match=r"model.tokenizer = '.*missing': no such file"):
        build_text_tokenizer(str(tmp_path / "missing"), key="model.tokenizer")
    with pytest.raises(FileNotFoundError, match="holds no tokenizer.json or tokenizer.model"):
        build_text_tokenizer(str(tmp_path))
    (tmp_path / "vocab.txt").write_text("a\n")
    with pytest.raises(ValueError, match=r"tokenizer = '.*vocab.txt' is not a known tokenizer \(accepted: 'bytes'"):
        build_text_tokenizer(str(tmp_path / "vocab.txt"))


def test_packing_shifts_windows_by_one_with_eos_between_documents():
    tokenizer = ByteTokenizer()
    tokens = pack_documents(["ab", "", "cde"], tokenizer)  # the empty document is skipped
    bos, eos = tokenizer.bos_id, tokenizer.eos_id
    assert tokens.tolist() == [bos, 97, 98, eos, bos, 99, 100, 101, eos] and tokens.dtype == torch.int32
    data = TextPackedDataset(tokens, seq_len=3, vocab_size=258)
    assert len(data) == 2  # 9 tokens = two windows of 4, the last EOS dropped
    inputs, labels = data[0]
    assert inputs.tolist() == [bos, 97, 98] and labels.tolist() == [97, 98, eos]
    assert inputs.dtype == labels.dtype == torch.int64 and inputs.shape == labels.shape == (3,)
    inputs, labels = data[1]
    assert inputs.tolist() == [bos, 99, 100] and labels.tolist() == [99, 100, 101]
    stream = torch.arange(1000)
    data = TextPackedDataset(stream, seq_len=9)
    assert len(data) == 100 and data.vocab_size == 1000
    for i in (0, 57, 99):
        inputs, labels = data[i]
        assert torch.equal(inputs, stream[10 * i : 10 * i + 9]) and torch.equal(labels, inputs + 1)
    with pytest.raises(ValueError, match="8 tokens are fewer than one window of seq_len \\+ 1 = 10"):
        TextPackedDataset(torch.arange(8), seq_len=9)
    with pytest.raises(ValueError, match="token ids reach 999, outside a vocabulary of 258"):
        TextPackedDataset(stream, seq_len=9, vocab_size=258)


def test_stdlib_corpus_is_deterministic_and_split_by_file(tmp_path):
    files = stdlib_files()
    names = [rel for rel, _, _ in files]
    assert not any(re.search(r"(^|/)(test|tests|site-packages)/|_sysconfigdata", rel) for rel in names)
    assert 2e6 < sum(size for *_, size in files) <= 4 * 2**20
    data = {split: build_text_dataset("stdlib", None, None, 128, split) for split in ("train", "validation")}
    clear_token_cache()
    again = build_text_dataset("stdlib", None, ByteTokenizer(), 128, "train", cache_dir=str(tmp_path))
    assert torch.equal(again.windows, data["train"].windows)  # rebuilt from the files: the same tokens
    assert len(list(tmp_path.glob("text-tokens-*.npy"))) == 1
    clear_token_cache()
    cached = build_text_dataset("stdlib", None, ByteTokenizer(), 128, "train", cache_dir=str(tmp_path))
    assert torch.equal(cached.windows, data["train"].windows)  # read back from the disk cache
    # Every file is in exactly one split, one in about VALIDATION_EVERY held out; each byte is one token, plus
    # BOS and EOS per non-empty file.
    held_out = [item for item in files if is_validation_document(item[0])]
    assert 0 < len(held_out) < 3 * len(files) / VALIDATION_EVERY
    for split, split_files in (("validation", held_out), ("train", [f for f in files if f not in held_out])):
        texts = [path.read_text("utf-8") for _, path, _ in split_files]
        expected = sum(len(text.encode()) + 2 for text in texts if text)
        assert data[split].num_tokens == expected and data[split].vocab_size == 258
        assert str(len(split_files)) + " files" in data[split].describe()
    assert data["train"].num_tokens > 2e6 and data["validation"].num_tokens > 2e4
    assert (data["train"][0][0] == 256).any()  # windows start inside documents too, BOS appear in the stream


def write_folder(root, n_txt: int = 40, n_lines: int = 40):
    root.mkdir()
    for i in range(n_txt):
        (root / f"doc{i:02d}.txt").write_text(f"text file {i} é\n")
    lines = [json.dumps({"text": f"json line {i} ✓", "meta": i}) for i in range(n_lines)]
    (root / "sub").mkdir()
    (root / "sub" / "data.jsonl").write_text("\n".join(lines[:20]) + "\n\n" + "\n".join(lines[20:]) + "\n")
    (root / ".hidden.txt").write_text("never read")
    (root / "notes.md").write_text("not a text file")


def test_text_folder_of_txt_and_jsonl(tmp_path):
    root = tmp_path / "corpus"
    write_folder(root)
    splits = {split: text_folder_documents(root, split) for split in ("train", "validation")}
    keys = {split: [key for key, _ in documents] for split, documents in splits.items()}
    lines = [*range(1, 21), *range(22, 42)]  # line 21 is blank: skipped, yet counted
    everything = {f"doc{i:02d}.txt" for i in range(40)} | {f"sub/data.jsonl:{n}" for n in lines}
    train, validation = set(keys["train"]), set(keys["validation"])
    assert train | validation == everything and not train & validation
    assert validation and all(is_validation_document(key) for key in validation)
    assert dict(splits["train"] + splits["validation"])["sub/data.jsonl:22"] == "json line 20 ✓"
    tokenizer = ByteTokenizer()
    for split, documents in splits.items():
        data = build_text_dataset("text", str(root), tokenizer, 4, split)
        expected = pack_documents([text for _, text in documents], tokenizer)
        assert data.num_tokens == len(expected)
        assert torch.equal(data.windows.flatten(), expected[: data.windows.numel()])
        assert data.vocab_size == 258 and f"text ({split})" in data.describe()
    # An explicit validation/ subfolder replaces the hash rule.
    (root / "validation").mkdir()
    (root / "validation" / "held.txt").write_text("held out")
    assert text_folder_documents(root, "validation") == [("validation/held.txt", "held out")]
    assert len(text_folder_documents(root, "train")) == 80


def test_text_folder_errors_name_the_key_file_and_line(tmp_path):
    with pytest.raises(ValueError, match="training.dataset = 'text' needs training.dataset_path"):
        build_text_dataset("text", None, None, 8)
    with pytest.raises(FileNotFoundError, match=r"training.dataset_path = '.*nowhere' does not exist"):
        build_text_dataset("text", str(tmp_path / "nowhere"), None, 8)
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "a.csv").write_text("x")
    with pytest.raises(FileNotFoundError, match=r"'.*empty' holds no .txt or .jsonl files"):
        build_text_dataset("text", str(tmp_path / "empty"), None, 8)
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "a.jsonl").write_text('{"text": "fine"}\n{"text": "broken\n')
    with pytest.raises(ValueError, match=r"bad/a.jsonl:2: not valid JSON"):
        build_text_dataset("text", str(bad), None, 8)
    (bad / "a.jsonl").write_text('{"text": "fine"}\n{"body": "no text"}\n')
    with pytest.raises(ValueError, match=r"bad/a.jsonl:2: each line needs a 'text' field, found keys \['body'\]"):
        build_text_dataset("text", str(bad), None, 8)
    (bad / "a.jsonl").write_text('{"text": "a\u2028b"}\r\n{"text": 3}\n', encoding="utf-8")  # raw U+2028 is JSON
    with pytest.raises(ValueError, match=r"bad/a.jsonl:2: 'text' must be a string"):
        build_text_dataset("text", str(bad), None, 8)
    (bad / "a.jsonl").unlink()
    (bad / "b.txt").write_bytes(b"\xff\xfe")
    with pytest.raises(ValueError, match=r"bad/b.txt: not UTF-8"):
        build_text_dataset("text", str(bad), None, 8)
    (bad / "b.txt").write_text("short")  # train split: BOS + 5 bytes + EOS = 7 tokens
    assert not is_validation_document("b.txt")
    with pytest.raises(ValueError, match=r"the train split has 7 tokens, fewer than one window of training.seq_len"):
        build_text_dataset("text", str(bad), None, 8)
    with pytest.raises(ValueError, match=r"has no validation documents \(one document in 20"):
        build_text_dataset("text", str(bad), None, 8, "validation")
    with pytest.raises(ValueError, match="training.dataset = 'books' is not a known text dataset"):
        build_text_dataset("books", None, None, 8)
    with pytest.raises(ValueError, match="training.seq_len = 0 must be >= 1"):
        build_text_dataset("stdlib", None, None, 0)


def test_synthetic_classification_is_deterministic_per_index():
    data = SyntheticClassificationDataset(num_samples=10**6, seq_len=100, vocab_size=1000, num_labels=3, seed=7)
    assert len(data) == 10**6  # 10^8 tokens, none materialized
    inputs, label = data[123_456]
    assert inputs.shape == (100,) and inputs.dtype == torch.int64 and label.shape == () and label.dtype == torch.int64
    twin = SyntheticClassificationDataset(10**6, 100, 1000, 3, seed=7)
    assert torch.equal(twin[123_456][0], inputs) and twin[123_456][1] == label
    assert not torch.equal(data[0][0], data[1][0])
    assert not torch.equal(SyntheticClassificationDataset(10**6, 100, 1000, 3, seed=8)[123_456][0], inputs)
    labels = torch.stack([data[i][1] for i in range(300)])
    assert set(labels.tolist()) == {0, 1, 2}
    tokens = torch.cat([data[i][0] for i in range(50)])
    assert tokens.min() >= 0 and tokens.max() < 1000 and tokens.unique().numel() > 900
    validation = build_text_dataset("synthetic_classification", None, ByteTokenizer(), 100, "validation",
                                    num_samples=10, num_labels=3, seed=7)  # fmt: skip
    assert validation.vocab_size == 258 and not torch.equal(validation[0][0], data[0][0])
    assert "10 random sequences of 100 tokens, vocab 258, 3 labels" in validation.describe()
    with pytest.raises(ValueError, match="needs a tokenizer or a vocab_size"):
        build_text_dataset("synthetic_classification", None, None, 8)
    with pytest.raises(IndexError):
        data[10**6]


def loader_config():
    return SimpleNamespace(num_workers=0, persistent_workers=False, pin_memory=False, prefetch_factor=None)


def test_packed_windows_shuffle_shard_and_resume_with_the_diffusion_loader():
    data = TextPackedDataset(torch.arange(24 * 5, dtype=torch.int32), seq_len=4)  # 24 windows, item i starts at 5i
    window_ids = lambda batch: (batch[0][:, 0] // 5).tolist()
    ranks = [DiffusionDataLoader(data, 4, rank, 2, seed=3, dataloader_config=loader_config()) for rank in (0, 1)]
    epoch = [[i for _ in range(3) for i in window_ids(next(loader))] for loader in ranks]
    assert sorted(epoch[0] + epoch[1]) == list(range(24)) and epoch[0] != sorted(epoch[0])  # sharded, shuffled

    loader = DiffusionDataLoader(data, 4, 0, 1, seed=3, dataloader_config=loader_config())
    for _ in range(8):  # into the second epoch (6 batches each)
        next(loader)
    state = loader.state_dict()
    expected = [next(loader) for _ in range(6)]  # crosses into the third epoch too
    resumed = DiffusionDataLoader(data, 4, 0, 1, seed=3, dataloader_config=loader_config())
    resumed.load_state_dict(state)
    for (inputs, labels), (want_inputs, want_labels) in zip((next(resumed) for _ in range(6)), expected):
        assert torch.equal(inputs, want_inputs) and torch.equal(labels, want_labels)
        assert torch.equal(labels[:, :-1], inputs[:, 1:])


def test_a_saved_position_past_a_smaller_datasets_epoch_restarts_it(caplog):
    """A position saved on a larger dataset (batch 20 of 25) is past the end of a 10-batch epoch: the epoch restarts
    from its start, with a warning, instead of the sampler's raw StopIteration."""
    from torchtitan.tools.logging import logger

    windows = lambda n: TextPackedDataset(torch.arange(n * 5, dtype=torch.int32), seq_len=4)
    larger = DiffusionDataLoader(windows(100), 4, 0, 1, seed=3, dataloader_config=loader_config())
    for _ in range(20):
        next(larger)
    smaller, fresh = (DiffusionDataLoader(windows(40), 4, 0, 1, 3, loader_config()) for _ in range(2))
    logger.addHandler(caplog.handler)  # the project logger does not propagate to the root logger
    try:
        smaller.load_state_dict(larger.state_dict())
    finally:
        logger.removeHandler(caplog.handler)
    assert "past the end of epoch 0 of this dataset (40 samples, 10 batches per rank)" in caplog.text
    for _ in range(12):  # the whole epoch 0, into epoch 1
        assert torch.equal(next(smaller)[0], next(fresh)[0])


def test_validation_batches_read_each_item_once_over_the_ranks():
    """37 items, 3 ranks, batches of 4: 13 items for the largest share, so 4 batches on every rank; each item
    once (weight 1), the rest padding (weight 0); a cap of 2 batches reads 2 x 4 items per rank."""
    from torchtitan.datasets.loader import validation_batches

    data = TextPackedDataset(torch.arange(37 * 3, dtype=torch.int32), seq_len=2)  # item i starts at 3i
    seen, counts = [], []
    for rank in range(3):
        batches = list(validation_batches(data, 4, rank, 3, seed=1, max_batches=50))
        counts.append(len(batches))
        for inputs, labels, weight in batches:
            assert inputs.shape == labels.shape == (4, 2) and weight.dtype == torch.float32
            seen += (inputs[weight == 1, 0] // 3).tolist()
            assert weight.tolist() == sorted(weight.tolist(), reverse=True)  # padding at the end
    assert counts == [4, 4, 4] and sorted(seen) == list(range(37))
    again = [b[0] for b in validation_batches(data, 4, 0, 3, seed=1, max_batches=2)]
    assert len(again) == 2 and all(w.sum() == 4 for *_, w in validation_batches(data, 4, 0, 3, 1, 2))
    assert torch.equal(torch.cat(again), torch.cat([b[0] for b in validation_batches(data, 4, 0, 3, 1, 50)][:2]))


def test_data_record_refuses_a_new_tokenizer_and_restarts_the_position_on_new_data(tmp_path, caplog):
    """The checkpoint's data record: another tokenizer (fingerprint, vocabulary, BOS/EOS) or latent tokenizer is
    refused naming the key; another seq_len, dataset path or number of samples resumes with a warning and a restarted
    data position; a moved tokenizer file of the same content, and fields of later versions, change nothing."""
    from torchtitan.datasets.record import DataRecord, data_record
    from torchtitan.errors import ResumeRefusedError
    from torchtitan.tools.logging import logger

    config = lambda dataset: SimpleNamespace(training=SimpleNamespace(dataset=dataset, dataset_path=str(tmp_path)))
    windows = TextPackedDataset(torch.arange(100), 4, 258, tokenizer_identity=ByteTokenizer().identity())
    record = data_record(config("text"), windows)
    assert record == {"dataset": "text", "dataset_path": str(tmp_path.resolve()), "samples": 20, "seq_len": 4,
                      "tokenizer": "bytes", "tokenizer_fingerprint": "bytes", "vocab_size": 258, "bos_id": 256,
                      "eos_id": 257}  # fmt: skip
    saved = DataRecord(record).state_dict()
    assert saved == {"json": json.dumps(record, sort_keys=True)}  # one plain string

    def resume(**changes) -> DataRecord:
        current = DataRecord({**record, **changes})
        current.load_state_dict(saved)
        return current

    assert resume().keeps_data_position and resume(tokenizer="/moved/bytes").keeps_data_position
    DataRecord(record).load_state_dict({"json": json.dumps({**record, "from_a_later_version": 1})})
    other = dict(tokenizer="t.json", tokenizer_fingerprint="ab" * 20, vocab_size=300, bos_id=0, eos_id=1)
    refusal = (r"^model.tokenizer_path: the checkpoint was trained with the tokenizer bytes \(sha1 bytes, 258 "
               r"tokens, BOS 256, EOS 257\), this run has t.json \(sha1 abababababab, 300 tokens, BOS 0, EOS 1\) "
               r"\(changed: tokenizer_fingerprint, vocab_size, bos_id, eos_id\): its token ids would stand for other "
               r"text")  # fmt: skip
    with pytest.raises(ResumeRefusedError, match=refusal):
        resume(**other)
    with pytest.raises(ResumeRefusedError, match=r"\(changed: eos_id\)"):
        resume(eos_id=3)
    logger.addHandler(caplog.handler)  # the project logger does not propagate to the root logger
    try:
        for changes, logged in [
            ({"seq_len": 8, "samples": 11}, "changed data: training.seq_len (seq_len: 4 -> 8). The weights carry"),
            ({"dataset_path": "/x"}, f"changed data: training.dataset_path (dataset_path: {tmp_path.resolve()} -> /x)"),
            ({"samples": 15}, "changed data: the data read (20 -> 15 samples). The weights carry over"),
        ]:
            caplog.clear()
            assert not resume(**changes).keeps_data_position and logged in caplog.text
    finally:
        logger.removeHandler(caplog.handler)

    latents = torch.utils.data.TensorDataset(torch.zeros(3, 4, 8, 8), torch.zeros(3))
    latents.meta = {"tokenizer": {"kind": "cosmos_jit", "name": "Cosmos-0.1-Tokenizer-CI8x8"}}
    record = data_record(config("latents"), latents)
    assert record == {"dataset": "latents", "dataset_path": str(tmp_path.resolve()), "samples": 3,
                      "sample_shape": [4, 8, 8],
                      "latent_tokenizer": "cosmos_jit:Cosmos-0.1-Tokenizer-CI8x8"}  # fmt: skip
    saved = DataRecord(record).state_dict()
    with pytest.raises(ResumeRefusedError, match=r"^training.dataset_path: .* latents of the image tokenizer "
                                                 r"cosmos_jit:Cosmos-0.1-Tokenizer-CI8x8, this run's latents are "
                                                 r"diffusers:AutoencoderKL:sd's"):  # fmt: skip
        resume(latent_tokenizer="diffusers:AutoencoderKL:sd")
    assert "dataset_path" not in data_record(config("digits"), latents)  # a dataset that reads no folder


def test_token_cache_key_follows_the_tokenizer_file(tmp_path):
    root = tmp_path / "corpus"
    write_folder(root)
    write_ranks(tmp_path / "tokenizer.model")
    first = build_text_dataset("text", str(root), build_text_tokenizer(str(tmp_path / "tokenizer.model")), 4)
    write_ranks(tmp_path / "tokenizer.model", merges=(b"te", b"tex", b"text"))  # same path, other merges
    tokenizer = build_text_tokenizer(str(tmp_path / "tokenizer.model"))
    second = build_text_dataset("text", str(root), tokenizer, 4)
    assert second.num_tokens < first.num_tokens  # "text" is now one token: not a stale cache
    assert hashlib.sha1((tmp_path / "tokenizer.model").read_bytes()).hexdigest() == tokenizer.fingerprint
