"""Which tokenizer encoded a folder of latents: its record (meta.json's "tokenizer", each latent file's
metadata), the sha256 that identifies each half of it whatever its folder's name, and the check that refuses a
`[latent]` tokenizer other than the one that encoded the latents (torchtitan/datasets/latents.py has the format)."""

import functools
import hashlib
import inspect
import json
from pathlib import Path

import torch

from torchtitan.tools.logging import logger

META_FILE = "meta.json"  # a prepared folder's description (torchtitan/datasets/latents.py)


def tokenizer_record(tokenizer) -> dict:
    """meta.json's "tokenizer" for a loaded tokenizer: kind, name, channels, downsample and the sha256 of each half
    in its folder (None for a half whose files are not there)."""
    folder = tokenizer.checkpoint_dir
    return {
        "kind": tokenizer.kind,
        "name": tokenizer.name,
        "latent_channels": int(tokenizer.latent_channels),
        "downsample": int(tokenizer.downsample),
        "encoder_sha256": tokenizer_sha256(tokenizer.kind, folder, "encoder"),
        "decoder_sha256": tokenizer_sha256(tokenizer.kind, folder, "decoder"),
    }


def describe_tokenizer(record: dict, hashes: bool = False) -> str:
    """`kind:name (C channels, downsample f)`, with the encoder's hash when `hashes` and recorded."""
    sha256 = record.get("encoder_sha256")
    hashed = f", encoder sha256 {sha256[:16]}..." if hashes and sha256 else ""
    return (f"{record.get('kind', '?')}:{record.get('name', '?')} ({record.get('latent_channels', '?')} channels, "
            f"downsample {record.get('downsample', '?')}{hashed})")  # fmt: skip


def same_tokenizer(a: dict, b: dict) -> bool:
    """Whether two tokenizer records name one tokenizer: kind, shapes and the encoder's hash (and the decoder's,
    where both record one); folder names are no identity. Records of format 1 carry no hash: compared by name."""
    if any(str(a.get(key)) != str(b.get(key)) for key in ("kind", "latent_channels", "downsample")):
        return False
    if not (a.get("encoder_sha256") or b.get("encoder_sha256")):
        return a.get("name") == b.get("name")
    decoders = a.get("decoder_sha256"), b.get("decoder_sha256")
    return a.get("encoder_sha256") == b.get("encoder_sha256") and (not all(decoders) or decoders[0] == decoders[1])


def _part_files(kind: str, checkpoint_dir: str | Path, part: str) -> list[Path]:
    folder = Path(checkpoint_dir)
    if kind == "cosmos_jit":
        files = [folder / f"{part}.jit"]
    else:
        from torchtitan.models.dit.diffusers_adapter import diffusers_weight_files

        files = [folder / "config.json", *diffusers_weight_files(folder)]
    return [f for f in files if f.is_file()]


def decoder_files(kind: str, checkpoint_dir: str | Path) -> list[Path]:
    """The files a tokenizer folder decodes with: `decoder.jit` (cosmos_jit), or `config.json` and the weights
    `from_pretrained` reads (diffusers, whose weights hold both halves); only those present."""
    return _part_files(kind, checkpoint_dir, "decoder")


def tokenizer_sha256(kind: str, checkpoint_dir: str | Path, part: str) -> str | None:
    """sha256 of what defines one half of a tokenizer, so the same network in a folder of any name, re-saved or not,
    gives the same hash.

    cosmos_jit: the bytes of `<part>.jit`. diffusers (one network, the same hash for both halves): the weights
    tensor by tensor (name, dtype, shape, values) and the config keys the autoencoder is built from that differ from
    their defaults; not diffusers' bookkeeping (`_name_or_path`, `_diffusers_version`), nor the defaults
    `save_pretrained` writes out. None when the folder lacks those files.
    """
    files = _part_files(kind, checkpoint_dir, part)
    if kind == "diffusers" and (len(files) < 2 or files[0].name != "config.json"):
        return None  # a config alone, or weights alone, builds no network
    if not files:
        return None
    stamps = tuple((str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns) for f in files)
    return _files_sha256(stamps) if kind == "cosmos_jit" else _diffusers_sha256(stamps)


def decoder_sha256(kind: str, checkpoint_dir: str | Path) -> str | None:
    """`tokenizer_sha256` of the decoder: what meta.json records and every decoding checks."""
    return tokenizer_sha256(kind, checkpoint_dir, "decoder")


# Keyed by size and mtime too: a training run checks once at the start and again when it first decodes, and a
# Cosmos decoder is hundreds of MB; a file rewritten in place is read again.
@functools.lru_cache(maxsize=8)
def _files_sha256(stamps: tuple[tuple[str, int, int], ...]) -> str:
    digest = hashlib.sha256()
    for path, _, _ in stamps:
        with open(path, "rb") as f:
            while chunk := f.read(1 << 20):
                digest.update(chunk)
    return digest.hexdigest()


@functools.lru_cache(maxsize=8)
def _diffusers_sha256(stamps: tuple[tuple[str, int, int], ...]) -> str:
    from torchtitan.models.dit.diffusers_adapter import load_weight_files

    config = json.loads(Path(stamps[0][0]).read_text())
    digest = hashlib.sha256(json.dumps(_functional_config(config), sort_keys=True).encode())
    weights = load_weight_files([Path(path) for path, _, _ in stamps[1:]])
    for name in sorted(weights):
        tensor = weights[name].contiguous()
        digest.update(f"{name} {tensor.dtype} {tuple(tensor.shape)};".encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy())
    return digest.hexdigest()


def _functional_config(config: dict) -> dict:
    """The config keys a diffusers autoencoder is built from (its class's __init__ arguments) that differ from their
    defaults, and the class: what `from_pretrained` makes of the config, whoever wrote it."""
    import diffusers

    class_name = config.get("_class_name", "AutoencoderKL")
    vae_class = getattr(diffusers, class_name, None)
    if vae_class is None:  # not a class this diffusers knows: every key but the bookkeeping
        return {"_class_name": class_name, **{k: v for k, v in config.items() if not k.startswith("_")}}
    defaults = {name: p.default for name, p in inspect.signature(vae_class.__init__).parameters.items()}
    return {"_class_name": class_name, **{k: v for k, v in config.items() if k in defaults
                                          and _as_json(v) != _as_json(defaults[k])}}  # fmt: skip


def _as_json(value) -> str | None:
    try:
        return json.dumps(value, sort_keys=True)  # a tuple default and its list in config.json are equal
    except TypeError:  # no default (a required argument), or none JSON can write
        return None


def _legacy_files_sha256(checkpoint_dir: str | Path) -> str | None:
    """Format 1's diffusers hash: the bytes of config.json and of every `diffusion_pytorch_model*` file."""
    folder = Path(checkpoint_dir)
    files = [f for f in [folder / "config.json", *sorted(folder.glob("diffusion_pytorch_model*"))] if f.is_file()]
    stamps = tuple((str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns) for f in files)
    return _files_sha256(stamps) if len(files) > 1 else None


def check_tokenizer_matches(meta: dict, latent_config, tokenizer=None, source: str | Path = "") -> None:
    """Refuses a `[latent]` tokenizer other than the one the prepared latents were encoded with.

    Without this a CI16x16 folder given for CI8x8 latents trains and samples silently, and decodes every latent
    cell to 16 px instead of 8. Compared: `latent.tokenizer` with the stored kind; `decoder_sha256` of
    `latent.checkpoint_dir` with the one recorded (so the same network in a folder of another name matches), when that
    folder holds the decoder; and, once a tokenizer is loaded, its channels and downsample. A record without a hash
    (written before hashes were recorded, or from an encoder-only folder) is checked by kind, channels and
    downsample alone, and a warning says so.

    Args:
        meta: the prepared folder's meta.json (`read_meta`), or `{"tokenizer": record}` of a latent file.
        latent_config: the `[latent]` section (or anything with `tokenizer` and `checkpoint_dir`); its
            `allow_tokenizer_mismatch`, when true, turns a refusal into a warning.
        tokenizer: the loaded tokenizer (`latent_channels`, `downsample`), or None before one is loaded.
        source: the prepared folder (its meta.json is named), or the latent file holding the record.

    Raises:
        ValueError: naming meta.json, the tokenizer folder and each value that disagrees with both sides.
    """
    stored = meta["tokenizer"]
    kind, checkpoint_dir = latent_config.tokenizer, str(latent_config.checkpoint_dir)
    where = Path(source) if Path(source).is_file() else Path(source) / META_FILE
    recorded = stored.get("decoder_sha256") or stored.get("decoder_files_sha256")
    problems = []
    if kind != stored["kind"]:
        problems.append(f"latent.tokenizer = {kind!r} but the latents' tokenizer kind is {stored['kind']!r}")
    elif recorded and checkpoint_dir:
        legacy = not stored.get("decoder_sha256")
        found = _legacy_files_sha256(checkpoint_dir) if legacy else decoder_sha256(kind, checkpoint_dir)
        if found is not None and found != recorded:  # None: no decoder file there, and nothing decodes yet
            files = ", ".join(f.name for f in decoder_files(kind, checkpoint_dir))
            problems.append(f"latent.checkpoint_dir = {checkpoint_dir!r}: its decoder ({files}) has sha256 "
                            f"{found[:16]}... but the latents' tokenizer {recorded[:16]}..."
                            f"{' (a hash of its files, as format 1 recorded it)' if legacy else ''}")  # fmt: skip
    if tokenizer is not None:
        for key, value in (("latent_channels", tokenizer.latent_channels), ("downsample", tokenizer.downsample)):
            if int(value) != int(stored[key]):
                problems.append(f"{key}: the tokenizer in {checkpoint_dir!r} has {value} but the latents {stored[key]}")
    if not problems:
        if tokenizer is not None and not recorded:
            _warn_once(f"{where} records no decoder hash (prepared before TorchDiTan recorded one, or without the "
                       f"decoder file): the tokenizer {checkpoint_dir!r} was checked by kind, latent channels and "
                       "downsample only; other weights of the same shape would decode wrongly")  # fmt: skip
        return
    unhashed = "" if recorded else " (it records no decoder hash: kind, channels and downsample were compared)"
    message = (f"{where}: the [latent] tokenizer is not the one these latents were encoded with "
               f"({describe_tokenizer(stored)}): {'; '.join(problems)}{unhashed}. Point latent.tokenizer and "
               "latent.checkpoint_dir at that tokenizer, prepare the data again with this one, or set "
               "latent.allow_tokenizer_mismatch (--allow-tokenizer-mismatch in sample.py and cosmos_latent_decoder.py) "
               "to decode with it anyway")  # fmt: skip
    if getattr(latent_config, "allow_tokenizer_mismatch", False):
        _warn_once(f"{message} (allowed: latent.allow_tokenizer_mismatch)")
        return
    raise ValueError(message)


@functools.lru_cache(maxsize=32)
def _warn_once(message: str) -> None:
    # A run checks the tokenizer at its start and again as it decodes (sample.py before sampling and at each batch):
    # one warning says it.
    logger.warning(message)
