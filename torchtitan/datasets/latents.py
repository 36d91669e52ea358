"""Latent shards written once by `data/<dataset>/prepare.py`, so training never runs the tokenizer.

A prepared folder holds `meta.json` (tokenizer, sizes, classes and the latent normalization) and
`shard-00000.safetensors`, `shard-00001.safetensors`, ... Each shard holds

- `latents`: (N, V, C, h, w) raw tokenizer latents (float16 unless prepared otherwise); V = 2 when the
  horizontally flipped image was encoded too (fast-DiT's augmentation), else 1;
- `labels`: (N,) int64 class indices; `indices`: (N,) positions in the source dataset;
- `images` (prepared with --store-images): (N, 3, H, W) uint8, the images as the tokenizer saw them, unflipped, for
  representation alignment's encoder (192 KiB an image at 256 px: 12x SD-VAE's flipped float16 latents);
- `features` (prepared with --store-features): (N, V, T, D) float16 unless prepared otherwise, the alignment
  encoder's features of each view (torchtitan/alignment/features.py), read in training instead of running it; what
  they are (encoder hash, token grid, dtypes) is meta.json's and each shard's "features" record;
- `stats_count`, `stats_mean`, `stats_m2`: per-channel moments of its latents (float64), so the dataset's
  mean/std come from the shards without reading them twice, and a resumed preparation stays exact;

and in its safetensors metadata what every latent file we write records (`latent_file_metadata`): whether its
latents are normalized and how (`normalization`: shards hold raw latents, mode "none"), and the tokenizer that
encoded them: kind, name, latent channels, downsample, and the sha256 of its encoder and decoder
(`tokenizer_sha256`: the same network in a folder of any name gives the same hash); a shard adds its image size,
index and layout. Resuming a preparation and opening the folder compare shards by these hashes, never by folder
name. The dataset applies the normalization of `meta.json` on access, and the decoder undoes it
(`LatentNormalization`); a run's saved samples (`samples/step-N.safetensors`) record that normalization, so
`cosmos_latent_decoder.py` decodes any of these files by what it says. meta.json records the same hashes, so
training, sampling and `cosmos_latent_decoder.py` refuse a `[latent]` tokenizer other than the one that encoded the
latents (`check_tokenizer_matches`; `latent.allow_tokenizer_mismatch` overrides it). The tokenizer's record, hashes
and that check are in torchtitan/datasets/latent_tokenizer.py.

The flipped copy is picked at random on each access rather than counted as an extra example: an epoch is
one pass over the images, and an image and its mirror are never two "different" examples (which would
double-count an individual under DP-SGD's accounting).

Shards are memory-mapped (safetensors `safe_open`): an access reads one row, the OS page cache keeps what
is hot, and an ImageNet-sized folder needs no RAM of its own. Only the labels are loaded at start.
"""

import bisect
import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.utils.data import Dataset

from torchtitan.datasets.latent_tokenizer import META_FILE, describe_tokenizer, same_tokenizer
from torchtitan.datasets.prefetch import LatentsAndFeatures, LatentsAndImages

SHARD_GLOB = "shard-*.safetensors"
FORMAT = "torchditan-latents/2"
# Still read: shards without hashes or normalization, meta.json with a diffusers hash of the folder's file bytes.
FORMAT_1 = "torchditan-latents/1"
# A file's metadata key for each key of a tokenizer record (meta.json's "tokenizer").
TOKENIZER_METADATA = {"kind": "tokenizer_kind", "name": "tokenizer_name", "latent_channels": "latent_channels",
                      "downsample": "downsample", "encoder_sha256": "encoder_sha256",
                      "decoder_sha256": "decoder_sha256"}  # fmt: skip


FEATURES_METADATA = "features"  # a shard's record of the encoder features it holds (JSON; '' for none)


def features_metadata(record: dict | None) -> str:
    """A shard's FEATURES_METADATA value for the record of its features (meta.json's "features"), '' for none."""
    return json.dumps(record, sort_keys=True) if record else ""


def shard_name(index: int) -> str:
    return f"shard-{index:05d}.safetensors"


@dataclass
class LatentNormalization:
    """Maps raw tokenizer latents to roughly unit-variance model inputs, and back.

    mode "channel": (z - mean[c]) / std[c] with statistics measured over the prepared data;
    mode "scale": z * scale_factor (Stable Diffusion's VAE uses 0.18215);
    mode "none": raw latents (what a shard records of its own).
    """

    mode: str = "channel"
    mean: list[float] = field(default_factory=list)
    std: list[float] = field(default_factory=list)
    scale_factor: float = 1.0

    def __post_init__(self):
        if self.mode not in ("channel", "scale", "none"):
            raise ValueError(f"latent normalization mode {self.mode!r}: must be 'channel', 'scale' or 'none'")
        if self.mode == "scale" and self.scale_factor <= 0:
            raise ValueError(f"latent normalization scale_factor = {self.scale_factor}: must be > 0")

    def _channel_view(self, z: torch.Tensor, values: list[float]) -> torch.Tensor:
        if len(values) != z.shape[-3]:
            raise ValueError(f"latents have {z.shape[-3]} channels but the normalization has {len(values)}")
        return torch.tensor(values, dtype=z.dtype, device=z.device).view(-1, 1, 1)  # broadcasts over (..., C, h, w)

    def normalize(self, z: torch.Tensor) -> torch.Tensor:
        """Raw latents (..., C, h, w) -> model space."""
        if self.mode == "none":
            return z
        if self.mode == "scale":
            return z * self.scale_factor
        return (z - self._channel_view(z, self.mean)) / self._channel_view(z, self.std)

    def denormalize(self, z: torch.Tensor) -> torch.Tensor:
        """Model space (..., C, h, w) -> raw latents, ready for the tokenizer's decoder."""
        if self.mode == "none":
            return z
        if self.mode == "scale":
            return z / self.scale_factor
        return z * self._channel_view(z, self.std) + self._channel_view(z, self.mean)

    def describe(self) -> str:
        if self.mode == "none":
            return "raw tokenizer latents"
        if self.mode == "scale":
            return f"latents scaled as z * {self.scale_factor}"
        return "latents normalized per channel, (z - mean) / std"

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
    if meta.get("format") not in (FORMAT, FORMAT_1):
        raise ValueError(f"{meta_file}: format {meta.get('format')!r}, expected {FORMAT!r}")
    tokenizer = meta.get("tokenizer", {})
    if meta["format"] == FORMAT_1 and tokenizer.get("kind") == "diffusers" and tokenizer.get("decoder_sha256"):
        # Format 1 hashed a diffusers folder's file bytes, which save_pretrained changes: kept for the legacy check.
        tokenizer["decoder_files_sha256"] = tokenizer.pop("decoder_sha256")
    return meta


def normalization_for(meta: dict, scale_factor: float = 0.0, stats_file: str = "") -> LatentNormalization:
    """The folder's stored normalization, a fixed scale when scale_factor > 0 (latent.scale_factor), or the
    per-channel statistics of a LightningDiT latents_stats.pt (latent.stats_file)."""
    if scale_factor > 0:
        return LatentNormalization("scale", scale_factor=scale_factor)
    if stats_file:
        from torchtitan.datasets.latent_stats import read_latent_stats

        return LatentNormalization("channel", *read_latent_stats(stats_file))
    return LatentNormalization.from_dict(meta["normalization"])


def latent_file_metadata(normalization: LatentNormalization, tokenizer: dict | None) -> dict[str, str]:
    """The safetensors metadata every latent file we write carries: how its latents are normalized, and the record
    of the tokenizer that encoded them (`tokenizer_record`), so a decoder needs no flag to decode it right."""
    metadata = {"format": FORMAT, "normalization": json.dumps(normalization.to_dict())}
    if tokenizer is not None:
        metadata |= {key: str(tokenizer.get(field) or "") for field, key in TOKENIZER_METADATA.items()}
    return metadata


def file_tokenizer(metadata: dict) -> dict | None:
    """The tokenizer record (`tokenizer_record`'s keys) a latent file's metadata holds; None when it holds none."""
    if "tokenizer_kind" not in metadata:
        return None
    record = {field: metadata.get(key) or None for field, key in TOKENIZER_METADATA.items()}
    record["latent_channels"], record["downsample"] = int(record["latent_channels"]), int(record["downsample"])
    return record


def file_normalization(metadata: dict) -> LatentNormalization | None:
    """How a latent file's latents are normalized, as its metadata says; None when it does not say."""
    if "normalization" in metadata:
        return LatentNormalization.from_dict(json.loads(metadata["normalization"]))
    if metadata.get("format") == FORMAT_1 and "shard_index" in metadata:
        return LatentNormalization("none")  # a shard of format 1: raw, though it did not say so
    return None


def read_file_metadata(path: str | Path) -> dict[str, str]:
    """A latent file's safetensors metadata ({} for a `.pt` file, which has none)."""
    if Path(path).suffix != ".safetensors":
        return {}
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        return f.metadata() or {}


def model_space_metadata(dataset_path: str, scale_factor: float, stats_file: str = "") -> dict[str, str]:
    """What a file of a latent model's samples records: the normalization of the prepared latents it trained on
    (`dataset_path`, or `scale_factor` > 0 as latent.scale_factor, or latent.stats_file) and their tokenizer; {}
    when neither is known."""
    meta = read_meta(dataset_path) if dataset_path else None
    if meta is None and scale_factor <= 0 and not stats_file:
        return {}
    normalization = normalization_for(meta or {}, scale_factor, stats_file)
    return latent_file_metadata(normalization, meta["tokenizer"] if meta else None)


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
        stats_file: a LightningDiT latents_stats.pt whose per-channel statistics replace the stored ones
            (latent.stats_file).
        images: the input is LatentsAndImages(latent, the uint8 image it encodes, flipped with it): what a
            representation alignment encoder sees; needs a folder prepared with --store-images.
        features: the input is LatentsAndFeatures(latent, the stored encoder features of the same view, as stored):
            what representation alignment reads instead of running its encoder; needs --store-features.
    """

    def __init__(self, path: str | Path, scale_factor: float = 0.0, random_flip: bool = True, stats_file: str = "",
                 images: bool = False, features: bool = False):  # fmt: skip
        self.root = Path(path)
        self.meta = read_meta(self.root)
        self.normalization = normalization_for(self.meta, scale_factor, stats_file)
        self.random_flip = random_flip
        self.images, self.features = images, features
        if images and not self.meta.get("images"):
            raise ValueError(f"{self.root} holds no images beside its latents, which alignment.enable's encoder "
                             "needs: prepare it again with --store-images")  # fmt: skip
        if features and not self.meta.get("features"):
            raise ValueError(f"{self.root} holds no encoder features beside its latents: prepare it again with "
                             "--store-features")  # fmt: skip
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
        want = self.meta["tokenizer"]
        features = features_metadata(self.meta.get("features")) if self.features else None
        for shard in self.shards:
            with safe_open(str(shard), "pt") as f:
                metadata = f.metadata() or {}
            if features is not None and metadata.get(FEATURES_METADATA, "") != features:
                raise ValueError(f"latent shard {shard} holds other encoder features than {self.root / META_FILE} "
                                 "records (shards of different preparations cannot be mixed); prepare the folder "
                                 "again")  # fmt: skip
            got = file_tokenizer(metadata) or {}
            if not same_tokenizer(got, want):
                raise ValueError(
                    f"latent shard {shard} was encoded by tokenizer {describe_tokenizer(got, hashes=True)} but "
                    f"{self.root / META_FILE} (and its other shards) by {describe_tokenizer(want, hashes=True)}: "
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
        latent = self.normalization.normalize(views[view].float())
        shard = bisect.bisect_right(self.offsets, index) - 1
        if self.features:  # the stored features of this very view: a mirrored image's are its own
            features = self._handle(shard).get_slice("features")[index - self.offsets[shard], view]  # (T, D)
            return LatentsAndFeatures(latent, features), self.labels[index]
        if not self.images:
            return latent, self.labels[index]
        image = self._handle(shard).get_slice("images")[index - self.offsets[shard]]  # (3, H, W) uint8
        return LatentsAndImages(latent, image.flip(-1) if view == 1 else image), self.labels[index]
