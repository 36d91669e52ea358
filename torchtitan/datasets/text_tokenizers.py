"""Text tokenizers for the language models: UTF-8 bytes, a Hugging Face `tokenizer.json`, Llama 3's `tokenizer.model`.

All three share one small interface (`TextTokenizer`): `encode(text) -> list[int]` with no special tokens added
and none read out of the text (a literal "<|end_of_text|>" is ordinary text; packing adds BOS/EOS itself),
`decode(ids) -> str` that drops special tokens, and `vocab_size`, `bos_id`, `eos_id`. Nothing here touches the
network: the files are read from a local path.

This module is the *text* tokenizer; `torchtitan/datasets/tokenizers.py` loads the Cosmos *image* tokenizer.
"""

import base64
import hashlib
import re
from pathlib import Path

__all__ = ["ByteTokenizer", "HFTokenizer", "TextTokenizer", "TiktokenTokenizer", "build_text_tokenizer"]


class TextTokenizer:
    """The interface the text datasets and the trainer rely on.

    Attributes:
        name: where it comes from ("bytes" or the file's path), for logs and `describe()`.
        fingerprint: changes whenever the token ids could change (the file's content hash); keys token caches.
        vocab_size: number of embedding rows the model needs (every id < vocab_size).
        bos_id: the begin-of-sequence id, or None when the tokenizer has none.
        eos_id: the end-of-sequence id (separates packed documents), or None when the tokenizer has none.
    """

    name: str
    fingerprint: str
    vocab_size: int
    bos_id: int | None
    eos_id: int | None

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, without BOS/EOS."""
        raise NotImplementedError

    def decode(self, ids) -> str:
        """Text of `ids` (a list or a 1-D tensor); special tokens are dropped."""
        raise NotImplementedError

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """`encode` over many texts; subclasses backed by Rust override it to use several threads."""
        return [self.encode(text) for text in texts]

    def identity(self) -> dict:
        """What makes its token ids mean what they mean, in plain values (checkpoints record it)."""
        return {"tokenizer": self.name, "tokenizer_fingerprint": self.fingerprint, "vocab_size": self.vocab_size,
                "bos_id": self.bos_id, "eos_id": self.eos_id}  # fmt: skip

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r}, vocab_size={self.vocab_size})"


class ByteTokenizer(TextTokenizer):
    """UTF-8 bytes as ids 0..255, BOS = 256, EOS = 257: no file, no merges, any text round-trips."""

    name = fingerprint = "bytes"
    vocab_size = 258
    bos_id = 256
    eos_id = 257

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        ids = ids.tolist() if hasattr(ids, "tolist") else ids
        # A window may cut a multi-byte character in two: replace the broken ends rather than raise.
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


# Tried in order when the file names no BOS/EOS explicitly (Llama 3, Llama 2/Mistral, BERT-likes, Gemma, GPT-2).
_BOS_CANDIDATES = ("<|begin_of_text|>", "<s>", "[BOS]", "<bos>", "<|startoftext|>")
_EOS_CANDIDATES = ("<|end_of_text|>", "</s>", "[EOS]", "<eos>", "<|endoftext|>")


def _file_fingerprint(path: Path) -> str:
    return hashlib.sha1(path.read_bytes()).hexdigest()


class HFTokenizer(TextTokenizer):
    """A Hugging Face `tokenizers` file (`tokenizer.json`), read locally.

    Args:
        path: the `tokenizer.json` file.
        bos_token: the BOS token's text; None looks for a usual one (<|begin_of_text|>, <s>, [BOS], ...).
        eos_token: the EOS token's text; None looks for a usual one (<|end_of_text|>, </s>, [EOS], ...).

    Text is never parsed for special tokens: a document holding the literal text of one (say `<|end_of_text|>`)
    is encoded as the ordinary tokens of that text, as tiktoken's `encode_ordinary` does, so only packing puts
    BOS/EOS ids in the stream. The BOS/EOS tokens are made special for this when the file lists them as plain
    added tokens; other plain added tokens are vocabulary and stay parsed.

    Raises:
        ImportError: the `tokenizers` package is not installed.
        ValueError: the file is not a readable tokenizer.json (truncated, not JSON, not a tokenizer; the message
            names it), or an explicitly named BOS/EOS token is not in the file.
    """

    def __init__(self, path: str | Path, bos_token: str | None = None, eos_token: str | None = None):
        try:
            from tokenizers import Tokenizer
        except ImportError as error:
            raise ImportError(f"reading {path} needs the `tokenizers` package: pip install tokenizers") from error
        path = Path(path)
        self.name = str(path)
        self.fingerprint = _file_fingerprint(path)
        try:
            self._tokenizer = Tokenizer.from_file(str(path))
        except Exception as error:  # the Rust parser raises a bare Exception ("expected ident at line 1 ...")
            raise ValueError(f"{path}: not a readable Hugging Face tokenizer.json ({error})") from error
        self.vocab_size = self._tokenizer.get_vocab_size(with_added_tokens=True)
        self.bos_id = self._special_id(bos_token, _BOS_CANDIDATES, "bos_token")
        self.eos_id = self._special_id(eos_token, _EOS_CANDIDATES, "eos_token")
        self._encode_specials_as_text()

    def _encode_specials_as_text(self) -> None:
        """Special tokens in a text become its ordinary tokens; BOS/EOS listed as plain added tokens become special
        first (a plain added token is matched in text whatever `encode_special_tokens` says)."""
        from tokenizers import AddedToken

        added = self._tokenizer.get_added_tokens_decoder()  # id -> AddedToken
        plain = [added[i].content for i in (self.bos_id, self.eos_id) if i in added and not added[i].special]
        if plain:  # the ids stay the same: the tokens are already in the vocabulary
            self._tokenizer.add_special_tokens([AddedToken(text, special=True, normalized=False) for text in plain])
        self._tokenizer.encode_special_tokens = True

    def _special_id(self, token: str | None, candidates: tuple[str, ...], argument: str) -> int | None:
        if token is not None:
            token_id = self._tokenizer.token_to_id(token)
            if token_id is None:
                raise ValueError(f"{argument} {token!r} is not a token of {self.name}")
            return token_id
        for candidate in candidates:
            token_id = self._tokenizer.token_to_id(candidate)
            if token_id is not None:
                return token_id
        return None

    def encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [encoding.ids for encoding in self._tokenizer.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids) -> str:
        ids = ids.tolist() if hasattr(ids, "tolist") else list(ids)
        return self._tokenizer.decode(ids, skip_special_tokens=True)


# Llama 3's pre-tokenizer regex and special tokens, as in meta-llama/llama3's tokenizer.py.
LLAMA3_PAT_STR = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
LLAMA3_NUM_RESERVED_SPECIAL_TOKENS = 256
LLAMA3_SPECIAL_TOKENS = [
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|reserved_special_token_0|>",
    "<|reserved_special_token_1|>",
    "<|reserved_special_token_2|>",
    "<|reserved_special_token_3|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|reserved_special_token_4|>",
    "<|eot_id|>",  # end of turn
] + [f"<|reserved_special_token_{i}|>" for i in range(5, LLAMA3_NUM_RESERVED_SPECIAL_TOKENS - 5)]

# tiktoken's Rust encoder slows down badly on huge inputs and on very long runs of (non-)whitespace; Llama 3
# cuts both, with these limits.
_TIKTOKEN_MAX_ENCODE_CHARS = 400_000
_MAX_NO_WHITESPACE_CHARS = 25_000


def load_tiktoken_ranks(path: str | Path) -> dict[bytes, int]:
    """A tiktoken BPE ranks file (`<base64 token> <rank>` per line), as `tiktoken.load.load_tiktoken_bpe` reads it.

    Parsed here because `load_tiktoken_bpe` copies even local files into a cache in the temp folder keyed by
    the path alone, so a file rewritten at the same path would be read stale.

    Raises:
        ValueError: a line is not `<base64> <integer>` (the message names the file and line).
    """
    ranks = {}
    for number, line in enumerate(Path(path).read_bytes().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            token, rank = line.split()
            ranks[base64.b64decode(token, validate=True)] = int(rank)
        except ValueError as error:
            raise ValueError(f"{path}:{number}: not a tiktoken rank line ('<base64> <rank>'): {line[:80]!r}") from error
    return ranks


def _split_long_runs(text: str, max_run: int):
    """Pieces of `text` in which no run of only whitespace or only non-whitespace exceeds `max_run` characters."""
    # The usual case, no long run, costs one linear regex scan (the lookbehinds try each run once, at its start).
    if not re.search(rf"(?<!\s)\s{{{max_run + 1}}}|(?<!\S)\S{{{max_run + 1}}}", text):
        yield text
        return
    start, run, run_is_space = 0, 0, None
    for i, char in enumerate(text):
        is_space = char.isspace()
        run = run + 1 if is_space == run_is_space else 1
        run_is_space = is_space
        if run > max_run:
            yield text[start:i]
            start, run = i, 1
    yield text[start:]


class TiktokenTokenizer(TextTokenizer):
    """Llama 3's tokenizer: a local `tokenizer.model` (tiktoken BPE ranks) with Llama 3's regex and 256 specials.

    With Meta's file: 128,000 BPE tokens, <|begin_of_text|> = 128000, <|end_of_text|> = 128001, vocab 128,256.
    Text that looks like a special token is encoded as plain text: only packing inserts BOS/EOS.

    Raises:
        ImportError: the `tiktoken` package is not installed.
    """

    def __init__(self, path: str | Path):
        try:
            import tiktoken
        except ImportError as error:
            raise ImportError(f"reading {path} needs the `tiktoken` package: pip install tiktoken") from error
        path = Path(path)
        self.name = str(path)
        self.fingerprint = _file_fingerprint(path)
        ranks = load_tiktoken_ranks(path)
        self.num_base_tokens = len(ranks)
        special = {token: self.num_base_tokens + i for i, token in enumerate(LLAMA3_SPECIAL_TOKENS)}
        self._encoding = tiktoken.Encoding(
            name=path.name, pat_str=LLAMA3_PAT_STR, mergeable_ranks=ranks, special_tokens=special
        )
        self.vocab_size = self.num_base_tokens + len(special)
        self.bos_id = special["<|begin_of_text|>"]
        self.eos_id = special["<|end_of_text|>"]

    def encode(self, text: str) -> list[int]:
        ids = []
        for start in range(0, len(text), _TIKTOKEN_MAX_ENCODE_CHARS):
            for piece in _split_long_runs(text[start : start + _TIKTOKEN_MAX_ENCODE_CHARS], _MAX_NO_WHITESPACE_CHARS):
                ids.extend(self._encoding.encode_ordinary(piece))
        return ids

    def decode(self, ids) -> str:
        ids = ids.tolist() if hasattr(ids, "tolist") else ids
        return self._encoding.decode([i for i in ids if i < self.num_base_tokens])


def build_text_tokenizer(name_or_path: str, key: str = "tokenizer") -> TextTokenizer:
    """The tokenizer named by a config value.

    Args:
        name_or_path: "bytes"; a `tokenizer.json` file or a folder holding one (Hugging Face); a `tokenizer.model`
            file or a folder holding one (Llama 3, tiktoken). A folder with both uses `tokenizer.json`.
        key: the config key the value came from, named in errors.

    Raises:
        FileNotFoundError: the path does not exist, or a folder holds neither file.
        ValueError: the value is none of the accepted forms, or the file is broken (truncated, not a tokenizer; the
            message names the key and the file).
    """
    if name_or_path == "bytes":
        return ByteTokenizer()
    accepted = "'bytes', a tokenizer.json (Hugging Face) or tokenizer.model (Llama 3 tiktoken) file, or their folder"
    path = Path(name_or_path).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"{key} = {name_or_path!r}: no such file or folder (accepted: {accepted})")
    if path.is_dir():
        for file_name in ("tokenizer.json", "tokenizer.model"):
            if (path / file_name).is_file():
                return build_text_tokenizer(str(path / file_name), key)
        raise FileNotFoundError(f"{key} = {name_or_path!r}: the folder holds no tokenizer.json or tokenizer.model")
    if path.name in ("tokenizer.json", "tokenizer.model"):
        try:
            return HFTokenizer(path) if path.name == "tokenizer.json" else TiktokenTokenizer(path)
        except ValueError as error:  # a broken file: its message names it
            raise ValueError(f"{key}: {error}") from error
    raise ValueError(f"{key} = {name_or_path!r} is not a known tokenizer (accepted: {accepted})")
