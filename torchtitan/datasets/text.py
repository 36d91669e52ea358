"""Text datasets for the language models: packed next-token windows, and synthetic sequence classification.

Three sources, chosen by `training.dataset` (see `build_text_dataset`):
- "stdlib", the embedded default: the Python standard library's own `.py` sources, read from the running
  interpreter's `sysconfig.get_paths()["stdlib"]` (no download, like the digits for the DiT). Test folders,
  site-packages and the install-specific `_sysconfigdata*` / `config-*` files are left out; the rest is taken in a
  fixed pseudo-random order (SHA-1 of the relative path) until `max_bytes`, so a small cap still samples the
  whole library. The text depends only on the Python version.
- "text": a folder (`training.dataset_path`) of `.txt` files (one document each) and `.jsonl` files (one document
  per line, in its "text" field), searched recursively, hidden paths skipped.
- "synthetic_classification": random token ids with a random label per sequence, for speed and memory studies
  (the labels carry no signal).

Train/validation split, by document and deterministic: a document is held out for validation when the SHA-1 of
its key (a file's path relative to the root; `path:line` for a `.jsonl` line) is 0 modulo `VALIDATION_EVERY`
(20), i.e. about one document in twenty. A text folder with a `validation/` subfolder uses it instead: files
under `validation/` are the validation split, all others the train split.

Packing: each document becomes BOS + tokens + EOS, the documents are concatenated into one stream, and the stream is
cut into whole windows of seq_len + 1 tokens (the tail shorter than a window is dropped). Window i gives
(input_ids, labels) = (window[:-1], window[1:]). Windows are fixed-size map-style items, so `DiffusionDataLoader`
shuffles, shards by rank and resumes them like images.
"""

import hashlib
import json
import os
import sys
import sysconfig
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from torchtitan.datasets.text_tokenizers import ByteTokenizer, TextTokenizer

__all__ = [
    "DEFAULT_STDLIB_MAX_BYTES",
    "VALIDATION_EVERY",
    "SyntheticClassificationDataset",
    "TextPackedDataset",
    "build_text_dataset",
    "clear_token_cache",
    "is_validation_document",
    "pack_documents",
    "stdlib_files",
    "text_folder_documents",
]

DEFAULT_STDLIB_MAX_BYTES = 4 * 2**20  # 4 MiB of source: about 4M byte tokens, packed in well under a second
VALIDATION_EVERY = 20
SPLITS = ("train", "validation")
TEXT_SUFFIXES = (".txt", ".jsonl")
_STDLIB_EXCLUDED_DIRS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}
_CACHE_FORMAT = 2  # bump when packing changes, so caches on disk are not reused (2: special-token text is text)

# Packed token streams of this process, keyed by source + tokenizer + split: a second build (the validation
# loader, a test) costs nothing. Entries are never written to.
_TOKEN_CACHE: dict[str, torch.Tensor] = {}


def clear_token_cache() -> None:
    """Forgets this process's packed token streams (the next build reads and tokenizes again)."""
    _TOKEN_CACHE.clear()


def is_validation_document(key: str) -> bool:
    """Whether the document with this key (relative path, or `path:line`) belongs to the validation split."""
    digest = hashlib.sha1(key.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") % VALIDATION_EVERY == 0


def _split_of(key: str) -> str:
    return "validation" if is_validation_document(key) else "train"


class TextPackedDataset(Dataset):
    """Fixed windows of a packed token stream: item i -> (input_ids (seq_len,), labels (seq_len,)), both int64.

    Args:
        tokens: the packed stream, a 1-D integer tensor or array (kept as given, int32 saves memory).
        seq_len: tokens per training sequence; each window holds seq_len + 1 tokens.
        vocab_size: the tokenizer's vocabulary size (checked against the tokens); None: largest id + 1.
        description: what the tokens are, for `describe()`.
        tokenizer_identity: the tokenizer's `identity()`, kept as `tokenizer_identity` for the checkpoints' data
            record (None: unknown).

    Raises:
        ValueError: the stream is not 1-D, seq_len < 1, an id is outside the vocabulary, or the stream is shorter
            than one window.
    """

    def __init__(self, tokens, seq_len: int, vocab_size: int | None = None, description: str = "packed text",
                 tokenizer_identity: dict | None = None):  # fmt: skip
        tokens = torch.as_tensor(tokens)
        if tokens.ndim != 1 or tokens.is_floating_point():
            raise ValueError(f"tokens must be a 1-D integer stream, got shape {tuple(tokens.shape)} {tokens.dtype}")
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        window = seq_len + 1
        self.num_windows = tokens.numel() // window
        if self.num_windows == 0:
            raise ValueError(
                f"{description}: {tokens.numel()} tokens are fewer than one window of seq_len + 1 = {window}"
            )
        largest = int(tokens.max())
        if vocab_size is not None and (largest >= vocab_size or int(tokens.min()) < 0):
            raise ValueError(f"{description}: token ids reach {largest}, outside a vocabulary of {vocab_size}")
        self.seq_len = seq_len
        self.num_tokens = tokens.numel()
        self.vocab_size = vocab_size if vocab_size is not None else largest + 1
        self.description = description
        self.tokenizer_identity = tokenizer_identity
        self.windows = tokens[: self.num_windows * window].view(self.num_windows, window)  # a view: no copy

    def __len__(self) -> int:
        return self.num_windows

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        window = self.windows[index].long()  # (seq_len + 1,)
        return window[:-1], window[1:]

    def describe(self) -> str:
        return (
            f"{self.description}: {self.num_tokens:,} tokens, {self.num_windows:,} windows of seq_len "
            f"{self.seq_len} + 1, vocab {self.vocab_size:,}"
        )


class SyntheticClassificationDataset(Dataset):
    """Random token ids with a random label per sequence: item i -> (input_ids (seq_len,), label ()), int64.

    Each item is drawn from its own generator seeded by (seed, split, index), so an item is the same whatever
    the order, rank or worker that asks for it, and nothing of size num_samples x seq_len is ever held.

    Args:
        num_samples: number of sequences.
        seq_len: tokens per sequence.
        vocab_size: ids are drawn uniformly in [0, vocab_size).
        num_labels: labels are drawn uniformly in [0, num_labels).
        seed: a non-negative integer.
        split: "train" or "validation" (another stream of sequences for the same seed).
    """

    def __init__(
        self, num_samples: int, seq_len: int, vocab_size: int, num_labels: int, seed: int = 0, split: str = "train"
    ):
        for name, value in (("num_samples", num_samples), ("seq_len", seq_len), ("vocab_size", vocab_size),
                            ("num_labels", num_labels)):  # fmt: skip
            if value < 1:
                raise ValueError(f"synthetic_classification: {name} must be >= 1, got {value}")
        if seed < 0:
            raise ValueError(f"synthetic_classification: seed must be >= 0, got {seed}")
        if split not in SPLITS:
            raise ValueError(f"synthetic_classification: split must be one of {SPLITS}, got {split!r}")
        self.num_samples, self.seq_len, self.vocab_size, self.num_labels = num_samples, seq_len, vocab_size, num_labels
        self.seed, self.split = seed, split

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= index < self.num_samples:
            raise IndexError(f"index {index} out of range for {self.num_samples} samples")
        rng = np.random.default_rng([self.seed, SPLITS.index(self.split), index])
        input_ids = torch.from_numpy(rng.integers(0, self.vocab_size, self.seq_len, dtype=np.int64))
        label = torch.tensor(int(rng.integers(self.num_labels)), dtype=torch.long)
        return input_ids, label

    def describe(self) -> str:
        return (
            f"synthetic_classification ({self.split}): {self.num_samples:,} random sequences of {self.seq_len} "
            f"tokens, vocab {self.vocab_size:,}, {self.num_labels} labels, seed {self.seed}"
        )


def pack_documents(texts: Sequence[str], tokenizer: TextTokenizer, chunk: int = 256) -> torch.Tensor:
    """One int32 stream: BOS (when the tokenizer has one) + tokens + EOS for each non-empty text, in order.

    Texts are encoded `chunk` at a time so Python's lists of ids never hold the whole corpus at once.

    Raises:
        ValueError: the tokenizer has no EOS token (documents could not be told apart).
    """
    if tokenizer.eos_id is None:
        raise ValueError(f"tokenizer {tokenizer.name} has no EOS token to end documents; name one (eos_token)")
    if tokenizer.vocab_size > np.iinfo(np.int32).max:
        raise ValueError(f"tokenizer {tokenizer.name}: vocab_size {tokenizer.vocab_size} does not fit in int32")
    bos = [] if tokenizer.bos_id is None else [tokenizer.bos_id]
    texts = [text for text in texts if text]
    pieces = []
    for start in range(0, len(texts), chunk):
        for ids in tokenizer.encode_batch(texts[start : start + chunk]):
            pieces.append(np.array(bos + ids + [tokenizer.eos_id], dtype=np.int32))
    return torch.from_numpy(np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int32))


def _tokenizer_key(tokenizer: TextTokenizer) -> list:
    # BOS/EOS too: the same file read with other special tokens packs differently.
    return [tokenizer.fingerprint, tokenizer.bos_id, tokenizer.eos_id]


def _cached_stream(key: dict, build: Callable[[], torch.Tensor], cache_dir: str | None) -> torch.Tensor:
    """The packed stream for `key` from this process's memory, else from `cache_dir` (when given), else built."""
    digest = hashlib.sha1(json.dumps({**key, "format": _CACHE_FORMAT}, sort_keys=True).encode()).hexdigest()[:24]
    if digest in _TOKEN_CACHE:
        return _TOKEN_CACHE[digest]
    file = Path(cache_dir) / f"text-tokens-{digest}.npy" if cache_dir else None
    if file is not None and file.is_file():
        tokens = torch.from_numpy(np.load(file))
    else:
        tokens = build()
        if file is not None:
            file.parent.mkdir(parents=True, exist_ok=True)
            partial = file.with_name(f"{file.stem}.{os.getpid()}.tmp.npy")  # ranks may write at once: rename whole
            np.save(partial, tokens.numpy())
            os.replace(partial, file)
    _TOKEN_CACHE[digest] = tokens
    return tokens


def stdlib_files(max_bytes: int = DEFAULT_STDLIB_MAX_BYTES) -> list[tuple[str, Path, int]]:
    """The embedded corpus's files: (path relative to the stdlib, path, size in bytes), at most max_bytes in all.

    Both splits come from this one selection, so the cap never moves a file from one split to the other.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    candidates = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in _STDLIB_EXCLUDED_DIRS and not d.startswith("config-"))
        for file_name in files:
            if file_name.endswith(".py") and not file_name.startswith("_sysconfigdata"):
                path = Path(folder) / file_name
                candidates.append((path.relative_to(root).as_posix(), path, path.stat().st_size))
    # A fixed pseudo-random order (salted apart from the split's hash) so that a cap samples the whole library.
    candidates.sort(key=lambda item: hashlib.sha1(f"order:{item[0]}".encode()).hexdigest())
    selected, total = [], 0
    for item in candidates:
        if total + item[2] > max_bytes:
            break
        selected.append(item)
        total += item[2]
    return selected


def stdlib_split_files(split: str, max_bytes: int = DEFAULT_STDLIB_MAX_BYTES) -> list[tuple[str, Path, int]]:
    """`stdlib_files` of one split ("train" or "validation")."""
    return [item for item in stdlib_files(max_bytes) if _split_of(item[0]) == split]


def stdlib_documents(split: str, max_bytes: int = DEFAULT_STDLIB_MAX_BYTES) -> list[tuple[str, str]]:
    """(key, text) of the embedded corpus's documents of one split, as `training.dataset = "stdlib"` reads them."""
    return _read_stdlib(stdlib_split_files(split, max_bytes))


def _read_stdlib(files: list[tuple[str, Path, int]]) -> list[tuple[str, str]]:
    return [(rel, path.read_bytes().decode("utf-8", errors="replace")) for rel, path, _ in files]


def _stdlib_dataset(tokenizer: TextTokenizer, split: str, max_bytes: int, cache_dir: str | None):
    files = stdlib_split_files(split, max_bytes)
    key = {"source": "stdlib", "python": sys.version, "files": [(rel, size) for rel, _, size in files],
           "tokenizer": _tokenizer_key(tokenizer), "split": split}  # fmt: skip
    read = lambda: [text for _, text in _read_stdlib(files)]
    tokens = _cached_stream(key, lambda: pack_documents(read(), tokenizer), cache_dir)
    version = ".".join(map(str, sys.version_info[:3]))
    description = (
        f"stdlib ({split}): Python {version} standard library, {len(files)} files, "
        f"{sum(size for *_, size in files):,} bytes, tokenizer {tokenizer.name}"
    )
    return tokens, description


def _read_jsonl(path: Path, rel: str) -> list[tuple[str, str]]:
    documents = []
    # split("\n"), not splitlines(): JSON strings may hold raw U+2028 and other characters splitlines() cuts at.
    for number, line in enumerate(_read_utf8(path).split("\n"), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise ValueError(f"{path}:{number}: not valid JSON ({error.msg} at column {error.colno})") from error
        if not isinstance(record, dict) or "text" not in record:
            found = f"keys {sorted(record)}" if isinstance(record, dict) else f"a {type(record).__name__}"
            raise ValueError(f"{path}:{number}: each line needs a 'text' field, found {found}")
        if not isinstance(record["text"], str):
            raise ValueError(f"{path}:{number}: 'text' must be a string, found a {type(record['text']).__name__}")
        documents.append((f"{rel}:{number}", record["text"]))
    return documents


def _read_utf8(path: Path) -> str:
    try:
        return path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as error:
        raise ValueError(f"{path}: not UTF-8 text ({error})") from error


def _text_files(root: Path) -> list[tuple[str, Path]]:
    """(relative path, path) of the .txt/.jsonl files under root, sorted, hidden files and folders skipped."""
    files = []
    for path in root.rglob("*"):
        rel = path.relative_to(root)
        if path.suffix in TEXT_SUFFIXES and path.is_file() and not any(p.startswith(".") for p in rel.parts):
            files.append((rel.as_posix(), path))
    return sorted(files)


def text_folder_documents(root: str | Path, split: str) -> list[tuple[str, str]]:
    """(key, text) of the documents of one split of a text folder (see the module docstring for the rule).

    Raises:
        ValueError: a `.jsonl` line is broken JSON or lacks a string "text" field, or a file is not UTF-8 (the
            message names the file and line).
    """
    root = Path(root)
    explicit = (root / "validation").is_dir()
    documents = []
    for rel, path in _text_files(root):
        if explicit and (rel.startswith("validation/") != (split == "validation")):
            continue
        file_documents = _read_jsonl(path, rel) if path.suffix == ".jsonl" else [(rel, _read_utf8(path))]
        documents.extend(doc for doc in file_documents if explicit or _split_of(doc[0]) == split)
    return documents


def _folder_dataset(root_value, tokenizer: TextTokenizer, split: str, cache_dir: str | None):
    if not root_value:
        raise ValueError("training.dataset = 'text' needs training.dataset_path: a folder of .txt/.jsonl files")
    root = Path(root_value).expanduser()
    if not root.exists():
        raise FileNotFoundError(f"training.dataset_path = {str(root_value)!r} does not exist")
    if not root.is_dir():
        raise ValueError(f"training.dataset_path = {str(root_value)!r} is not a folder of .txt/.jsonl files")
    files = _text_files(root)
    if not files:
        raise FileNotFoundError(f"training.dataset_path = {str(root_value)!r} holds no .txt or .jsonl files")
    stats = [(rel, path.stat().st_size, path.stat().st_mtime_ns) for rel, path in files]
    key = {"source": "text", "root": str(root.resolve()), "files": stats, "tokenizer": _tokenizer_key(tokenizer),
           "split": split}  # fmt: skip
    build = lambda: pack_documents([text for _, text in text_folder_documents(root, split)], tokenizer)
    tokens = _cached_stream(key, build, cache_dir)
    if tokens.numel() == 0:
        if (root / "validation").is_dir():
            rule = "its validation/ subfolder"
        else:
            rule = f"one document in {VALIDATION_EVERY} by a hash of its name; add documents or a validation/ subfolder"
        raise ValueError(f"training.dataset_path = {str(root_value)!r} has no {split} documents ({rule})")
    description = f"text ({split}): {root}, {len(files)} files, tokenizer {tokenizer.name}"
    return tokens, description


def build_text_dataset(
    name: str,
    path: str | None,
    tokenizer: TextTokenizer | None,
    seq_len: int,
    split: str = "train",
    *,
    max_bytes: int = DEFAULT_STDLIB_MAX_BYTES,
    cache_dir: str | None = None,
    num_samples: int = 10_000,
    num_labels: int = 2,
    vocab_size: int | None = None,
    seed: int = 0,
) -> Dataset:
    """The text dataset named by `training.dataset`, for one split.

    Args:
        name: "stdlib" (embedded), "text" (a folder at `path`) or "synthetic_classification".
        path: `training.dataset_path`; only "text" reads it.
        tokenizer: the text tokenizer; None: bytes (for "synthetic_classification": `vocab_size` instead).
        seq_len: `training.seq_len`, tokens per sequence.
        split: "train" or "validation".
        max_bytes: "stdlib" only, the corpus's size cap in bytes of source (both splits together).
        cache_dir: a folder where packed token streams are saved and reused across processes; None: memory only.
        num_samples, num_labels, vocab_size, seed: "synthetic_classification" only; vocab_size defaults to the
            tokenizer's.

    Returns:
        A map-style dataset with `vocab_size` and `describe()`: `TextPackedDataset` (input_ids, labels) for "stdlib"
        and "text", `SyntheticClassificationDataset` (input_ids, label) for "synthetic_classification".

    Raises:
        FileNotFoundError: the folder is missing or holds no .txt/.jsonl files (the message names the path).
        ValueError: an unknown name or split, seq_len < 1, a broken file, an empty split, or fewer tokens than one
            window (the message names the config key and value).
    """
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    if seq_len < 1:
        raise ValueError(f"training.seq_len = {seq_len} must be >= 1")
    if name == "synthetic_classification":
        vocab_size = vocab_size or (tokenizer.vocab_size if tokenizer is not None else None)
        if vocab_size is None:
            raise ValueError("training.dataset = 'synthetic_classification' needs a tokenizer or a vocab_size")
        return SyntheticClassificationDataset(num_samples, seq_len, vocab_size, num_labels, seed, split)
    tokenizer = tokenizer or ByteTokenizer()
    if name == "stdlib":
        tokens, description = _stdlib_dataset(tokenizer, split, max_bytes, cache_dir)
        where = f"training.dataset = 'stdlib' (max_bytes {max_bytes:,})"
    elif name == "text":
        tokens, description = _folder_dataset(path, tokenizer, split, cache_dir)
        where = f"training.dataset_path = {str(path)!r}"
    else:
        raise ValueError(
            f"training.dataset = {name!r} is not a known text dataset (stdlib, text, synthetic_classification)"
        )
    if tokens.numel() < seq_len + 1:
        raise ValueError(
            f"{where}: the {split} split has {tokens.numel():,} tokens, fewer than one window of "
            f"training.seq_len + 1 = {seq_len + 1}; lower training.seq_len or add text"
        )
    return TextPackedDataset(tokens, seq_len, tokenizer.vocab_size, description, tokenizer.identity())
