"""Image tokenizers for latent diffusion, loaded from a local folder: encode images, decode latents.

Two kinds, one interface (`load_tokenizer`):

- "cosmos_jit": NVIDIA Cosmos continuous image tokenizers (CI8x8, CI16x16) as released, a folder with the
  TorchScript files `encoder.jit` and `decoder.jit`. B x 3 x H x W in [-1, 1] <-> B x 16 x H/f x W/f.
  NVIDIA exports them with `torch.jit.trace` on CUDA in bf16, which freezes the Haar patcher's
  `.to(x.dtype)` casts as bf16 constants: each file therefore runs in the dtype of its saved weights on any
  device (inputs are cast to it, outputs back to float32), never cast to another dtype.
  Discrete (DI) tokenizers are refused: their latents are integer indices, not what a DiT denoises.
- "diffusers": a diffusers `AutoencoderKLCosmos` or SD-style `AutoencoderKL` folder (`config.json` +
  weights) read with `from_pretrained(<local folder>)`. AutoencoderKL's posterior is a Gaussian; we keep
  its mode (the mean), so a prepared dataset is deterministic and the flip copy carries the augmentation.

Nothing is ever downloaded: get the weights once by hand and point `latent.checkpoint_dir` at them.
A command loads only the half it uses (`parts`): preparation encodes, decoding and sampling decode.

The command-line decoder is `cosmos_latent_decoder.py` at the repository root.
"""

import functools
import json
import re
import warnings
from pathlib import Path

import torch

KINDS = ("cosmos_jit", "diffusers")
PARTS = ("encoder", "decoder")
PROBE_SIZE = 64  # image side encoded to measure a TorchScript tokenizer's channels and downsample factor
PROBE_LATENT_SIZE = 4  # latent side decoded when only the decoder is loaded
# Cosmos names its folders by family: CI (continuous image), DI (discrete image), CV / DV (video).
DISCRETE_IMAGE_NAME = re.compile(r"\bDI\d+x\d+")
VIDEO_NAME = re.compile(r"\b[CD]V\d+x\d+x\d+")


class LatentTokenizer:
    """Common interface: `encode` (images in [-1, 1] -> latents) and `decode` (the inverse).

    Attributes:
        kind: "cosmos_jit" or "diffusers".
        name: the folder name, for people: latent files record it, but the hashes of the folder's networks
            (`latents.tokenizer_record`) identify the weights.
        checkpoint_dir: the folder it was loaded from.
        parts: the halves loaded ("encoder", "decoder"); calling the other one raises.
        latent_channels: C of the latents.
        downsample: spatial factor f (H / h).
    """

    kind = ""

    def __init__(self, name: str, checkpoint_dir: Path, device: torch.device, dtype: torch.dtype,
                 parts: tuple[str, ...]):  # fmt: skip
        unknown = [part for part in parts if part not in PARTS]
        if unknown or not parts:
            raise ValueError(f"tokenizer parts {tuple(parts)}: must be one or both of {PARTS}")
        self.name = name
        self.checkpoint_dir = checkpoint_dir
        self.device = torch.device(device)
        self.dtype = dtype
        self.parts = tuple(parts)
        self.latent_channels = 0
        self.downsample = 0

    def _encode(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def _decode(self, z: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def _require(self, part: str) -> None:
        if part not in self.parts:
            raise ValueError(f"{self.kind} tokenizer {self.name} was loaded with parts={self.parts}, without its "
                             f"{part}: load it with parts including {part!r}")  # fmt: skip

    @torch.no_grad()
    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """(B, 3, H, W) in [-1, 1] -> (B, C, H/f, W/f) float32 on the tokenizer's device.

        H and W must be multiples of f: a partial latent cell would decode to a larger image than the one encoded
        (NVIDIA's wrapper pads to a multiple of 16 and crops the reconstruction back, which latents cannot undo).
        """
        self._require("encoder")
        if x.ndim != 4 or x.shape[1] != 3:
            raise ValueError(f"{self.kind} tokenizer encodes (B, 3, H, W) images, got {tuple(x.shape)}")
        f = self.downsample
        if x.shape[-2] % f or x.shape[-1] % f:
            raise ValueError(f"{self.describe()} encodes images whose sides are multiples of {f}, got "
                             f"{x.shape[-2]} x {x.shape[-1]}: crop or resize them to a multiple of {f}")  # fmt: skip
        return self._encode(x.to(self.device)).float()

    @torch.no_grad()
    def decode(self, z: torch.Tensor) -> torch.Tensor:
        """(B, C, h, w) raw latents -> (B, 3, h*f, w*f) float32 images clamped to [-1, 1]."""
        self._require("decoder")
        if z.ndim != 4 or z.shape[1] != self.latent_channels:
            raise ValueError(f"{self.kind} tokenizer {self.name} decodes (B, {self.latent_channels}, h, w) "
                             f"latents, got {tuple(z.shape)}")  # fmt: skip
        return self._decode(z.to(self.device)).float().clamp(-1, 1)

    def encode_batches(self, x: torch.Tensor, batch_size: int = 32, progress: bool | None = None) -> torch.Tensor:
        """`encode` in batches (with a progress bar for long inputs); the result lands on the CPU."""
        return _batched(self.encode, x, batch_size, progress, "encode")

    def decode_batches(self, z: torch.Tensor, batch_size: int = 32, progress: bool | None = None) -> torch.Tensor:
        """`decode` in batches (with a progress bar for long inputs); the result lands on the CPU."""
        return _batched(self.decode, z, batch_size, progress, "decode")

    def describe(self) -> str:
        return f"{self.kind}:{self.name} ({self.latent_channels} channels, downsample {self.downsample})"


def _batched(fn, x: torch.Tensor, batch_size: int, progress: bool | None, what: str) -> torch.Tensor:
    from tqdm import tqdm

    chunks = x.split(batch_size)
    show = len(chunks) > 4 if progress is None else progress
    return torch.cat([fn(chunk).cpu() for chunk in tqdm(chunks, desc=what, disable=not show)])


class CosmosJITTokenizer(LatentTokenizer):
    """Cosmos image tokenizer from its released TorchScript `encoder.jit` / `decoder.jit`.

    Each file runs in the dtype of its saved weights (`self.run_dtypes`): a traced file's casts are frozen
    constants, so casting its weights to another dtype makes its convolutions see mixed input and weight dtypes.
    """

    kind = "cosmos_jit"

    def __init__(self, checkpoint_dir: Path, device: torch.device, dtype: torch.dtype, parts: tuple[str, ...]):
        refuse_unsupported_cosmos(checkpoint_dir)
        super().__init__(checkpoint_dir.name, checkpoint_dir, device, dtype, parts)
        self.files, self.run_dtypes = {}, {}
        self.encoder = self.decoder = None
        for part in self.parts:
            path = checkpoint_dir / f"{part}.jit"
            if not path.is_file():
                raise FileNotFoundError(
                    f"latent.checkpoint_dir: {path} is missing (a cosmos_jit tokenizer folder holds "
                    "encoder.jit and decoder.jit, e.g. Cosmos-0.1-Tokenizer-CI8x8)"
                )
            module = _load_jit(path, self.device)
            self.files[part], self.run_dtypes[part] = path, _saved_dtype(module, dtype)
            setattr(self, part, module)
        self._measure()

    def _measure(self) -> None:
        """The files carry no config: channels and downsample come from running the loaded half on zeros."""
        if self.encoder is not None:
            z = self._run("encoder", torch.zeros(1, 3, PROBE_SIZE, PROBE_SIZE, device=self.device))
            if z.ndim != 4 or not z.is_floating_point():
                raise ValueError(
                    f"{self.files['encoder']}: encodes a {PROBE_SIZE} x {PROBE_SIZE} image to a {z.dtype} tensor of "
                    f"shape {tuple(z.shape)}, not (1, C, h, w) float latents: a discrete tokenizer (its latents are "
                    "integer indices) is not supported; use a continuous one (Cosmos CI8x8, CI16x16)"
                )
            self.latent_channels, self.downsample = z.shape[1], PROBE_SIZE // z.shape[-1]
        if self.decoder is None:
            return
        channels = self.latent_channels or _input_channels(self.decoder, self.files["decoder"])
        size = PROBE_LATENT_SIZE
        image = self._run("decoder", torch.zeros(1, channels, size, size, device=self.device))
        if image.ndim != 4 or image.shape[1] != 3 or image.shape[-1] % size:
            raise ValueError(f"{self.files['decoder']}: decodes a (1, {channels}, {size}, {size}) latent to shape "
                             f"{tuple(image.shape)}, not (1, 3, {size} f, {size} f) images")  # fmt: skip
        downsample = image.shape[-1] // size
        if self.downsample and downsample != self.downsample:
            raise ValueError(f"{self.files['encoder']} downsamples by {self.downsample} but "
                             f"{self.files['decoder']} upsamples by {downsample}: not one tokenizer")  # fmt: skip
        self.latent_channels, self.downsample = channels, downsample

    def _run(self, part: str, x: torch.Tensor) -> torch.Tensor:
        module = self.encoder if part == "encoder" else self.decoder
        try:
            out = module(x.to(self.run_dtypes[part]))
        except (RuntimeError, torch.jit.Error) as e:
            raise RuntimeError(f"{self.files[part]}: {e}") from e
        return out[0] if isinstance(out, tuple | list) else out  # Cosmos returns (latent, ...) for some kinds

    def _encode(self, x: torch.Tensor) -> torch.Tensor:
        return self._run("encoder", x)

    def _decode(self, z: torch.Tensor) -> torch.Tensor:
        return self._run("decoder", z)

    def describe(self) -> str:
        dtypes = ", ".join(f"{part} {str(dtype).removeprefix('torch.')}" for part, dtype in self.run_dtypes.items())
        return f"{self.kind}:{self.name} ({self.latent_channels} channels, downsample {self.downsample}; {dtypes})"


def refuse_unsupported_cosmos(checkpoint_dir: Path) -> None:
    """Raises ValueError for a Cosmos discrete image (DI) or video (CV, DV) tokenizer folder, named as NVIDIA does."""
    if DISCRETE_IMAGE_NAME.search(checkpoint_dir.name):
        raise ValueError(f"latent.checkpoint_dir: {checkpoint_dir} is a discrete Cosmos tokenizer (DI): its encoder "
                         "returns integer indices and its decoder takes them; discrete tokenizers are not "
                         "supported, continuous ones are (Cosmos-0.1-Tokenizer-CI8x8, CI16x16)")  # fmt: skip
    if VIDEO_NAME.search(checkpoint_dir.name):
        raise ValueError(f"latent.checkpoint_dir: {checkpoint_dir} is a Cosmos video tokenizer (CV / DV): it encodes "
                         "(B, 3, T, H, W) clips; use a continuous image tokenizer (CI8x8, CI16x16)")  # fmt: skip


def _load_jit(path: Path, device: torch.device) -> torch.jit.ScriptModule:
    with warnings.catch_warnings():
        # Cosmos ships TorchScript; torch.jit's deprecation notice is not actionable for users of its files.
        warnings.simplefilter("ignore", FutureWarning)
        try:
            return torch.jit.load(str(path), map_location=device).eval()
        except (RuntimeError, torch.jit.Error) as e:
            raise RuntimeError(f"{path}: torch.jit.load failed, not a whole TorchScript file: {e}") from e


def _saved_dtype(module: torch.jit.ScriptModule, fallback: torch.dtype) -> torch.dtype:
    """The dtype of a module's first floating-point weight (or buffer); `fallback` when it has none."""
    for tensor in (*module.parameters(), *module.buffers()):
        if tensor.is_floating_point():
            return tensor.dtype
    return fallback


def _input_channels(decoder: torch.jit.ScriptModule, path: Path) -> int:
    """C of a decoder's input: its first convolution's in_channels (Cosmos's first is post_quant_conv)."""
    for weight in decoder.parameters():
        if weight.ndim == 4:  # (out, in, kh, kw); a decoder's input convolution is never grouped
            return weight.shape[1]
    raise ValueError(f"{path}: holds no convolution weight to read its latent channels from; load the encoder "
                     "too (parts=('encoder', 'decoder'))")  # fmt: skip


class DiffusersTokenizer(LatentTokenizer):
    """diffusers `AutoencoderKLCosmos` (video VAE used on single frames) or SD-style `AutoencoderKL`.

    One weights file holds both halves, so both are always read; `parts` still says which may be called.
    """

    kind = "diffusers"

    def __init__(self, checkpoint_dir: Path, device: torch.device, dtype: torch.dtype, parts: tuple[str, ...]):
        config_file = checkpoint_dir / "config.json"
        if not config_file.is_file():
            raise FileNotFoundError(f"latent.checkpoint_dir: {config_file} is missing (a diffusers autoencoder "
                                    "folder as written by save_pretrained)")  # fmt: skip
        config = json.loads(config_file.read_text())
        class_name = config.get("_class_name", "AutoencoderKL")
        super().__init__(f"{class_name}:{checkpoint_dir.name}", checkpoint_dir, device, dtype, parts)
        import diffusers

        if class_name not in ("AutoencoderKL", "AutoencoderKLCosmos"):
            raise ValueError(f"{config_file}: _class_name {class_name!r}; supported: AutoencoderKL, "
                             "AutoencoderKLCosmos")  # fmt: skip
        self.video = class_name == "AutoencoderKLCosmos"
        vae_class = getattr(diffusers, class_name)
        self.vae = vae_class.from_pretrained(str(checkpoint_dir), local_files_only=True, torch_dtype=dtype)
        self.vae = self.vae.to(self.device).eval()
        self.latent_channels = int(config.get("latent_channels", 4))
        if self.video:
            self.downsample = int(config.get("spatial_compression_ratio", 8))
        else:
            self.downsample = 2 ** (len(config.get("block_out_channels", [0])) - 1)

    def _encode(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(self.dtype)
        if self.video:  # (B, C, T=1, H, W): an image is a one-frame video
            return self.vae.encode(x.unsqueeze(2)).latent_dist.mode().squeeze(2)
        return self.vae.encode(x).latent_dist.mode()  # the Gaussian's mean: deterministic latents

    def _decode(self, z: torch.Tensor) -> torch.Tensor:
        z = z.to(self.dtype)
        if self.video:
            return self.vae.decode(z.unsqueeze(2)).sample.squeeze(2)
        return self.vae.decode(z).sample


def load_tokenizer(kind: str, checkpoint_dir: str | Path, device="cpu", dtype: torch.dtype = torch.float32,
                   parts: tuple[str, ...] = PARTS) -> LatentTokenizer:  # fmt: skip
    """Loads an image tokenizer from a local folder.

    Args:
        kind: "cosmos_jit" (encoder.jit + decoder.jit) or "diffusers" (AutoencoderKL / AutoencoderKLCosmos).
        checkpoint_dir: the local folder.
        device: where it runs.
        dtype: compute dtype of a diffusers autoencoder (bf16 is the usual choice on a GPU). A cosmos_jit file
            runs in the dtype of its saved weights whatever this says (its traced casts are frozen); this is
            only its fallback for a file without floating-point weights.
        parts: the halves to load: ("encoder",) to prepare data, ("decoder",) to decode, or both. A
            cosmos_jit folder needs only the files of these halves.

    Returns:
        A `LatentTokenizer` with encode(x), decode(z), latent_channels, downsample and name; outputs are float32.

    Raises:
        FileNotFoundError: the folder or one of its files is missing (the message names the path).
        ValueError: an unknown kind or part, or a tokenizer of an unsupported family (discrete, video).
        RuntimeError: a TorchScript file does not load or run (the message names the file).
    """
    if kind not in KINDS:
        raise ValueError(f"latent.tokenizer = {kind!r}: must be one of {list(KINDS)}")
    folder = Path(checkpoint_dir)
    if not str(checkpoint_dir) or not folder.is_dir():
        raise FileNotFoundError(f"latent.checkpoint_dir: tokenizer folder {str(checkpoint_dir)!r} does not exist")
    cls = CosmosJITTokenizer if kind == "cosmos_jit" else DiffusersTokenizer
    return cls(folder.resolve(), torch.device(device), dtype, tuple(parts))


@functools.lru_cache(maxsize=2)
def _cached_decoder(kind: str, checkpoint_dir: str, device: str, dtype: torch.dtype) -> LatentTokenizer:
    return load_tokenizer(kind, checkpoint_dir, device, dtype, parts=("decoder",))


def _prepared_meta(dataset_path: str, required: bool) -> dict | None:
    """meta.json of the prepared latents, or None when it is not needed (scale_factor > 0) and not there."""
    from torchtitan.datasets.latents import META_FILE, read_meta

    if required or (dataset_path and (Path(dataset_path) / META_FILE).is_file()):
        return read_meta(dataset_path)
    return None


def load_training_decoder(job_config, device: torch.device | str) -> LatentTokenizer:
    """The `[latent]` tokenizer's decoder, checked against the prepared latents it will decode; cached.

    Loaded once per process (decoder only; bf16 on a GPU for a diffusers autoencoder). When
    `training.dataset_path` holds a meta.json, the tokenizer must be the one it names
    (`check_tokenizer_matches`: kind, decoder hash, channels, downsample).

    Raises:
        ValueError: the tokenizer is not the one the latents were encoded with (the message names both).
        FileNotFoundError: the tokenizer folder, or meta.json when the normalization needs it, is missing.
    """
    return _checked_decoder(job_config, torch.device(device))[0]


def _checked_decoder(job_config, device: torch.device) -> tuple[LatentTokenizer, dict | None]:
    """(the cached decoder, the prepared latents' meta.json or None): see `load_training_decoder`."""
    from torchtitan.datasets.latent_tokenizer import check_tokenizer_matches

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    latent, dataset_path = job_config.latent, job_config.training.dataset_path
    tokenizer = _cached_decoder(latent.tokenizer, latent.checkpoint_dir, str(device), dtype)
    meta = _prepared_meta(dataset_path, required=latent.scale_factor <= 0 and not latent.stats_file)
    if meta is not None:
        check_tokenizer_matches(meta, latent, tokenizer, source=dataset_path)
    return tokenizer, meta


def decode_for_training(job_config, latents: torch.Tensor, batch_size: int = 16) -> torch.Tensor:
    """Model-space latents sampled during training -> images in [-1, 1] (on the latents' device).

    The decoder named by `[latent]` is loaded once per process and cached (`load_training_decoder`, which
    refuses a tokenizer other than the prepared latents'). Latents are un-normalized with the statistics
    stored in `training.dataset_path`'s meta.json, or divided by `latent.scale_factor` when it is > 0, or with the
    statistics of `latent.stats_file` (a LightningDiT latents_stats.pt) when it is set.
    """
    from torchtitan.datasets.latents import normalization_for

    device = latents.device
    tokenizer, meta = _checked_decoder(job_config, device)
    latent = job_config.latent
    raw = normalization_for(meta or {}, latent.scale_factor, latent.stats_file).denormalize(latents.float())
    return torch.cat([tokenizer.decode(chunk) for chunk in raw.split(batch_size)]).to(device)


def read_latent_file(path: str | Path) -> torch.Tensor:
    """(N, C, h, w) float32 latents from a .safetensors or .pt file (see the module docstring)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"--latents: {path} does not exist")
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        data = load_file(str(path))
    else:
        data = torch.load(path, map_location="cpu", weights_only=True)
    if isinstance(data, dict):
        tensors = {k: v for k, v in data.items() if isinstance(v, torch.Tensor)}
        if "latents" in tensors:
            z = tensors["latents"]
        elif len(tensors) == 1:
            z = next(iter(tensors.values()))
        else:
            raise ValueError(f"{path} holds tensors {sorted(tensors)}: name the latents 'latents'")
    else:
        z = data
    if z.ndim == 3:
        z = z.unsqueeze(0)
    elif z.ndim == 5:
        z = z[:, 0]  # a prepared shard: (N, V, C, h, w), view 0 is the unflipped image
    if z.ndim != 4:
        raise ValueError(f"{path}: latents of shape {tuple(z.shape)}; expected (N, C, h, w)")
    return z.float()
