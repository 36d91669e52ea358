"""Trains a byte-level BPE tokenizer (Hugging Face `tokenizers`) on the train split of a text dataset of the trainer.

The lab of our origin documents trains a 10k BPE before its runs; this is that step, on the data the trainer reads:
the embedded standard library (`--dataset stdlib`, the default) or a folder of .txt/.jsonl files (`--dataset text
--dataset-path FOLDER`), its train split only (the validation split's documents never shape the merges). Writes
OUT/tokenizer.json, with `<|begin_of_text|>` and `<|end_of_text|>`, which `model.tokenizer_path OUT` then reads
(the flavor's vocabulary must hold it: the CS336 sizes have 10,000). Example:

    pip install -e ".[lm]"
    python scripts/train_tokenizer.py --out outputs/tokenizers/stdlib_bpe10k --vocab-size 10000
    python train.py --job.config_file train_configs/llama3_lab.toml --model.flavor small \\
        --model.tokenizer_path outputs/tokenizers/stdlib_bpe10k

An existing tokenizer.json is never overwritten.
"""

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from torchtitan.datasets.text import stdlib_documents, text_folder_documents  # noqa: E402

SPECIAL_TOKENS = ["<|begin_of_text|>", "<|end_of_text|>"]  # the names HFTokenizer finds as BOS and EOS


def train_documents(dataset: str, dataset_path: str | None) -> list[str]:
    """The texts of the dataset's train split, as the trainer's loader reads them."""
    if dataset == "stdlib":
        return [text for _, text in stdlib_documents("train")]
    if not dataset_path:
        raise ValueError("--dataset text needs --dataset-path: a folder of .txt/.jsonl files")
    root = Path(dataset_path).expanduser()
    if not root.is_dir():
        raise FileNotFoundError(f"--dataset-path {dataset_path!r} is not a folder of .txt/.jsonl files")
    texts = [text for _, text in text_folder_documents(root, "train")]
    if not texts:
        raise ValueError(f"--dataset-path {dataset_path!r} has no train documents (.txt/.jsonl files)")
    return texts


def train_tokenizer(texts: list[str], vocab_size: int, out: Path):
    """A byte-level BPE of `vocab_size` tokens (256 bytes, the merges, the two specials) trained on `texts`, saved
    as out/tokenizer.json. Returns the `tokenizers.Tokenizer`."""
    try:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    except ImportError as error:
        raise ImportError('training a BPE needs the `tokenizers` package: pip install -e ".[lm]"') from error
    smallest = 256 + len(SPECIAL_TOKENS)
    if vocab_size < smallest:
        raise ValueError(f"--vocab-size {vocab_size} is below the {smallest} tokens of the bytes and the specials")
    path = out / "tokenizer.json"
    if path.exists():
        raise FileExistsError(f"{path} exists; not overwritten (choose another --out, or remove it)")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # fmt: skip
    tokenizer.train_from_iterator(texts, trainer)
    out.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".json.partial")
    tokenizer.save(str(partial))
    partial.replace(path)  # whole or not at all
    return tokenizer


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="folder to write tokenizer.json into")
    parser.add_argument("--vocab-size", type=int, default=10000, help="tokens in all (bytes, merges, specials)")
    parser.add_argument("--dataset", choices=["stdlib", "text"], default="stdlib", help="the trainer's text dataset")
    parser.add_argument("--dataset-path", default=None, help="with --dataset text: the folder of .txt/.jsonl files")
    args = parser.parse_args(argv)
    try:
        texts = train_documents(args.dataset, args.dataset_path)
        tokenizer = train_tokenizer(texts, args.vocab_size, Path(args.out))
    except (ValueError, FileNotFoundError, FileExistsError, ImportError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(f"wrote {Path(args.out) / 'tokenizer.json'}: {tokenizer.get_vocab_size()} tokens from {len(texts)} "
          f"{args.dataset} train documents")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
