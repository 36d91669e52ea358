"""Latent shards written once by `data/<dataset>/prepare.py`, so training never runs the tokenizer.

A prepared folder holds `meta.json` (tokenizer, sizes, classes and the latent normalization) and
`shard-00000.safetensors`, `shard-00001.safetensors`, ... Each shard holds

- `latents`: (N, V, C, h, w) raw tokenizer latents (float16 unless prepared otherwise); V = 2 when the
  horizontally flipped image was encoded too (fast-DiT's augmentation), else 1;
- `labels`: (N,) int64 class indices; `indices`: (N,) positions in the source dataset;
- `stats_count`, `stats_mean`, `stats_m2`: per-channel moments of its latents (float64), so the dataset's
  mean/std come from the shards without reading them twice, and a resumed preparation stays exact;

and in its safetensors metadata the tokenizer's kind, name, latent channels and downsample factor, the
image size and its shard index. Shards are raw latents: the dataset applies the normalization of
`meta.json` on access, and the decoder undoes it (`LatentNormalization`). meta.json also records the sha256 of
the tokenizer's decoder files (`decoder_sha256`), so training, sampling and `cosmos_latent_decoder.py` refuse a
`[latent]` tokenizer other than the one that encoded the latents, whatever its folder is called
(`check_tokenizer_matches`; `latent.allow_tokenizer_mismatch` overrides it).

The flipped copy is picked at random on each access rather than counted as an extra example: an epoch is
one pass over the images, and an image and its mirror are never two "different" examples (which would
double-count an individual under DP-SGD's accounting).

Shards are memory-mapped (safetensors `safe_open`): an access reads one row, the OS page cache keeps what
is hot, and an ImageNet-sized folder needs no RAM of its own. Only the labels are loaded at start.
"""

import bisect
import functools
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.utils.data import Dataset

from torchtitan.tools.logging import logger

META_FILE = "meta.json"
SHARD_GLOB = "shard-*.safetensors"
FORMAT = "torchditan-latents/1"
# Metadata keys that must agree between every shard of one folder (and with meta.json).
TOKENIZER_KEYS = ("tokenizer_kind", "tokenizer_name", "latent_channels", "downsample")
TOKENIZER_META_KEYS = ("kind", "name", "latent_channels", "downsample")  # the same, in meta.json's "tokenizer"


def shard_name(index: int) -> str:
    return f"shard-{index:05d}.safetensors"


@dataclass
class LatentNormalization:
    """Maps raw tokenizer latents to roughly unit-variance model inputs, and back.

    mode "channel": (z - mean[c]) / std[c] with statistics measured over the prepared data;
    mode "scale": z * scale_factor (Stable Diffusion's VAE uses 0.18215).
    """

    mode: str = "channel"
    mean: list[float] = field(default_factory=list)
    std: list[float] = field(default_factory=list)
    scale_factor: float = 1.0

    def __post_init__(self):
        if self.mode not in ("channel", "scale"):
            raise ValueError(f"latent normalization mode {self.mode!r}: must be 'channel' or 'scale'")
        if self.mode == "scale" and self.scale_factor <= 0:
            raise ValueError(f"latent normalization scale_factor = {self.scale_factor}: must be > 0")

    def _channel_view(self, z: torch.Tensor, values: list[float]) -> torch.Tensor:
        if len(values) != z.shape[-3]:
            raise ValueError(f"latents have {z.shape[-3]} channels but the normalization has {len(values)}")
        return torch.tensor(values, dtype=z.dtype, device=z.device).view(-1, 1, 1)  # broadcasts over (..., C, h, w)

    def normalize(self, z: torch.Tensor) -> torch.Tensor:
        """Raw latents (..., C, h, w) -> model space."""
        if self.mode == "scale":
            return z * self.scale_factor
        return (z - self._channel_view(z, self.mean)) / self._channel_view(z, self.std)

    def denormalize(self, z: torch.Tensor) -> torch.Tensor:
        """Model space (..., C, h, w) -> raw latents, ready for the tokenizer's decoder."""
        if self.mode == "scale":
            return z / self.scale_factor
        return z * self._channel_view(z, self.std) + self._channel_view(z, self.mean)

    def to_dict(self) -> dict:
        return {"mode": self.mode, "mean": self.mean, "std": self.std, "scale_factor": self.scale_factor}

    @classmethod
    def from_dict(cls, data: dict) -> "LatentNormalization":
        return cls(data["mode"], list(data.get("mean", [])), list(data.get("std", [])), data.get("scale_factor", 1.0))


def read_meta(path: str | Path) -> dict:
    """The prepared folder's meta.json; raises naming the folder when it is missing or unfinished, and the file
    when it is damaged."""
    root = Path(path)
    if not root.is_dir():
        raise FileNotFoundError(f"training.dataset_path: latent folder {root} does not exist")
    meta_file = root / META_FILE
    if not meta_file.is_file():
        shards = sorted(root.glob(SHARD_GLOB))
        if not shards:
            raise FileNotFoundError(f"training.dataset_path: {root} holds no latent shards ({SHARD_GLOB}) "
                                    "and no meta.json; prepare it with data/<dataset>/prepare.py")  # fmt: skip
        raise FileNotFoundError(f"training.dataset_path: {root} has {len(shards)} shard(s) but no {META_FILE}: "
                                "its preparation did not finish; run prepare.py again, it resumes")  # fmt: skip
    try:
        meta = json.loads(meta_file.read_text())
        problem = "" if isinstance(meta, dict) else f"a {type(meta).__name__}, not a JSON object"
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        problem = f"not JSON: {e}"
    if problem:
        raise ValueError(f"{meta_file} cannot be read ({problem}): it is damaged; run prepare.py again with the same "
                         f"options: it rewrites {META_FILE} from the finished shards")  # fmt: skip
    if meta.get("format") != FORMAT:
        raise ValueError(f"{meta_file}: format {meta.get('format')!r}, expected {FORMAT!r}")
    return meta


def normalization_for(meta: dict, scale_factor: float = 0.0) -> LatentNormalization:
    """The folder's stored normalization, or a fixed scale when scale_factor > 0 (latent.scale_factor)."""
    if scale_factor > 0:
        return LatentNormalization("scale", scale_factor=scale_factor)
    return LatentNormalization.from_dict(meta["normalization"])


def shard_tokenizer(metadata: dict) -> tuple:
    """The (kind, name, channels, downsample) tuple a shard was encoded with."""
    return tuple(str(metadata.get(key, "?")) for key in TOKENIZER_KEYS)


def describe_tokenizer(key: tuple) -> str:
    kind, name, channels, downsample = key
    return f"{kind}:{name} ({channels} channels, downsample {downsample})"


def decoder_files(kind: str, checkpoint_dir: str | Path) -> list[Path]:
    """The files a tokenizer folder decodes with: `decoder.jit` (cosmos_jit), or `config.json` and the
    `diffusion_pytorch_model*` weights (diffusers, whose one weights file holds both halves); only those present."""
    folder = Path(checkpoint_dir)
    if kind == "cosmos_jit":
        files = [folder / "decoder.jit"]
    else:
        files = [folder / "config.json", *sorted(folder.glob("diffusion_pytorch_model*"))]
    return [f for f in files if f.is_file()]


def decoder_sha256(kind: str, checkpoint_dir: str | Path) -> str | None:
    """sha256 over the contents of `decoder_files`, in order: the same weights in any folder give the same hash.

    None when the folder holds no decoder file (an encoder-only folder, or none at all).
    """
    files = decoder_files(kind, checkpoint_dir)
    if not [f for f in files if f.name != "config.json"]:  # a diffusers config.json alone decodes nothing
        return None
    stamps = tuple((str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns) for f in files)
    return _sha256_of(stamps)


@functools.lru_cache(maxsize=8)
def _sha256_of(stamps: tuple[tuple[str, int, int], ...]) -> str:
    # Keyed by size and mtime too: a training run checks once at the start and again when it first decodes, and a
    # Cosmos decoder is hundreds of MB; a file rewritten in place is read again.
    digest = hashlib.sha256()
    for path, _, _ in stamps:
        with open(path, "rb") as f:
            while chunk := f.read(1 << 20):
                digest.update(chunk)
    return digest.hexdigest()


def check_tokenizer_matches(meta: dict, latent_config, tokenizer=None, source: str | Path = "") -> None:
    """Refuses a `[latent]` tokenizer other than the one the prepared latents were encoded with.

    Without this a CI16x16 folder given for CI8x8 latents trains and samples silently, and decodes every latent
    cell to 16 px instead of 8. Compared: `latent.tokenizer` with the stored kind; the sha256 of the decoder files
    of `latent.checkpoint_dir` with the one meta.json records (so the same weights in a folder of another name
    match), when that folder holds them; and, once a tokenizer is loaded, its channels and downsample. A meta.json
    written before hashes were recorded is checked by kind, channels and downsample alone, and a warning says so.

    Args:
        meta: the prepared folder's meta.json (`read_meta`).
        latent_config: the `[latent]` section (or anything with `tokenizer` and `checkpoint_dir`); its
            `allow_tokenizer_mismatch`, when true, turns a refusal into a warning.
        tokenizer: the loaded tokenizer (`latent_channels`, `downsample`), or None before one is loaded.
        source: the prepared folder, named in the message.

    Raises:
        ValueError: naming meta.json, the tokenizer folder and each value that disagrees with both sides.
    """
    stored = meta["tokenizer"]
    kind, checkpoint_dir = latent_config.tokenizer, str(latent_config.checkpoint_dir)
    where = Path(source) / META_FILE if source else Path(META_FILE)
    recorded = stored.get("decoder_sha256")
    problems = []
    if kind != stored["kind"]:
        problems.append(f"latent.tokenizer = {kind!r} but the latents' tokenizer kind is {stored['kind']!r}")
    elif recorded and checkpoint_dir:
        found = decoder_sha256(kind, checkpoint_dir)
        if found is not None and found != recorded:  # None: no decoder file there, and nothing decodes yet
            files = ", ".join(f.name for f in decoder_files(kind, checkpoint_dir))
            problems.append(f"latent.checkpoint_dir = {checkpoint_dir!r}: its decoder ({files}) has sha256 "
                            f"{found[:16]}... but the latents' tokenizer {recorded[:16]}...")  # fmt: skip
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
               f"({describe_tokenizer(tuple(stored[k] for k in TOKENIZER_META_KEYS))}): {'; '.join(problems)}"
               f"{unhashed}. Point latent.tokenizer and latent.checkpoint_dir at that tokenizer, prepare the data "
               "again with this one, or set latent.allow_tokenizer_mismatch (--allow-tokenizer-mismatch in sample.py "
               "and cosmos_latent_decoder.py) to decode with it anyway")  # fmt: skip
    if getattr(latent_config, "allow_tokenizer_mismatch", False):
        _warn_once(f"{message} (allowed: latent.allow_tokenizer_mismatch)")
        return
    raise ValueError(message)


@functools.lru_cache(maxsize=32)
def _warn_once(message: str) -> None:
    # A run checks the tokenizer at its start and again as it decodes (sample.py before sampling and at each batch):
    # one warning says it.
    logger.warning(message)


def combine_moments(parts: list[tuple[float, torch.Tensor, torch.Tensor]]) -> tuple[float, torch.Tensor, torch.Tensor]:
    """Merges per-part (count, mean, M2) of each channel into one (Chan et al.'s parallel variance)."""
    count, mean, m2 = 0.0, None, None
    for n_b, mean_b, m2_b in parts:
        if n_b == 0:
            continue
        if mean is None:
            count, mean, m2 = n_b, mean_b.clone(), m2_b.clone()
            continue
        delta = mean_b - mean
        total = count + n_b
        mean = mean + delta * n_b / total
        m2 = m2 + m2_b + delta.pow(2) * count * n_b / total
        count = total
    if mean is None:
        raise ValueError("no latents to measure statistics over")
    return count, mean, m2


def moments_std(count: float, m2: torch.Tensor) -> torch.Tensor:
    """Unbiased standard deviation from a count and M2 (the sum of squared deviations)."""
    return (m2 / max(count - 1, 1)).sqrt()


class LatentShardDataset(Dataset):
    """(latent (C, h, w) float32 normalized, label int64) pairs from a prepared latent folder.

    Args:
        path: folder written by prepare.py (meta.json + shards).
        scale_factor: > 0 replaces the stored normalization with `z * scale_factor` (latent.scale_factor).
        random_flip: pick the original or the flipped latent at random (when both were encoded).
    """

    def __init__(self, path: str | Path, scale_factor: float = 0.0, random_flip: bool = True):
        self.root = Path(path)
        self.meta = read_meta(self.root)
        self.normalization = normalization_for(self.meta, scale_factor)
        self.random_flip = random_flip
        self.shards = sorted(self.root.glob(SHARD_GLOB))
        self._check_shards()
        labels, sizes = [], []
        from safetensors import safe_open

        for shard in self.shards:
            with safe_open(str(shard), "pt") as f:
                labels.append(f.get_tensor("labels").long())
                sizes.append(f.get_slice("latents").get_shape()[0])
                self.views = f.get_slice("latents").get_shape()[1]
        self.labels = torch.cat(labels)
        self.offsets = [0]
        for size in sizes:
            self.offsets.append(self.offsets[-1] + size)
        self.num_classes = int(self.meta["num_classes"])
        self._handles = {}  # shard index -> open safe_open handle (per process: not pickled to workers)

    def _check_shards(self) -> None:
        from safetensors import safe_open

        expected = [self.root / shard_name(i) for i in range(int(self.meta["num_shards"]))]
        missing = [p.name for p in expected if not p.is_file()]
        if not self.shards or missing:
            raise FileNotFoundError(f"training.dataset_path: {self.root} lacks shard(s) {missing[:5]} of "
                                    f"{len(expected)} listed in {META_FILE}; run prepare.py again")  # fmt: skip
        tokenizer = self.meta["tokenizer"]
        want = tuple(str(tokenizer[k]) for k in TOKENIZER_META_KEYS)
        for shard in self.shards:
            with safe_open(str(shard), "pt") as f:
                got = shard_tokenizer(f.metadata() or {})
            if got != want:
                raise ValueError(
                    f"latent shard {shard} was encoded by tokenizer {describe_tokenizer(got)} but "
                    f"{self.root / META_FILE} (and its other shards) by {describe_tokenizer(want)}: "
                    "shards of different tokenizers cannot be mixed; prepare them into separate folders"
                )

    @property
    def latent_shape(self) -> tuple[int, int, int]:
        size = int(self.meta["latent_size"])
        return int(self.meta["tokenizer"]["latent_channels"]), size, size

    def describe(self) -> str:
        """One line naming the tokenizer and latent shape, for error messages and logs."""
        c, h, w = self.latent_shape
        tokenizer = self.meta["tokenizer"]
        return (f"{self.root}: {tokenizer['kind']}:{tokenizer['name']} latents {c} x {h} x {w} "
                f"(set model.in_channels = {c}, model.input_size = {h})")  # fmt: skip

    def __len__(self) -> int:
        return self.offsets[-1]

    def __getstate__(self):
        state = self.__dict__.copy()
        state["_handles"] = {}  # mmap handles stay in the process that opened them
        return state

    def _handle(self, shard: int):
        if shard not in self._handles:
            from safetensors import safe_open

            self._handles[shard] = safe_open(str(self.shards[shard]), "pt")
        return self._handles[shard]

    def raw(self, index: int) -> torch.Tensor:
        """The stored latents (V, C, h, w) of one image, as written by the tokenizer."""
        if not 0 <= index < len(self):
            raise IndexError(f"index {index} out of range for {len(self)} latents")
        shard = bisect.bisect_right(self.offsets, index) - 1
        return self._handle(shard).get_slice("latents")[index - self.offsets[shard]]

    def __getitem__(self, index: int):
        views = self.raw(index)
        view = int(torch.randint(views.shape[0], ())) if self.random_flip and views.shape[0] > 1 else 0
        return self.normalization.normalize(views[view].float()), self.labels[index]
