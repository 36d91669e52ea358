"""Image tokenizers for latent diffusion, loaded from a local folder: encode images, decode latents.

Two kinds, one interface (`load_tokenizer`):

- "cosmos_jit": NVIDIA Cosmos continuous image tokenizers (CI8x8, CI16x16) as released, a folder with the
  TorchScript files `encoder.jit` and `decoder.jit`. B x 3 x H x W in [-1, 1] <-> B x 16 x H/f x W/f.
- "diffusers": a diffusers `AutoencoderKLCosmos` or SD-style `AutoencoderKL` folder (`config.json` +
  weights) read with `from_pretrained(<local folder>)`. AutoencoderKL's posterior is a Gaussian; we keep
  its mode (the mean), so a prepared dataset is deterministic and the flip copy carries the augmentation.

Nothing is ever downloaded: get the weights once by hand and point `latent.checkpoint_dir` at them.

CLI, decode a latent file to a PNG grid:

    python cosmos_latent_decoder.py --checkpoint-dir DIR --latents FILE --out grid.png [--kind cosmos_jit]

FILE is `.safetensors` or `.pt` with a tensor under "latents" (or its only tensor), shaped (N, C, h, w),
(C, h, w), or (N, V, C, h, w) as in a prepared shard (view 0, the unflipped image, is decoded). Latents
are raw tokenizer output (what shards store) unless `--stats` names a prepared folder (or its meta.json)
or `--scale-factor` is given: then they are taken as normalized model-space latents (what a latent DiT
samples) and un-normalized first.
"""

import argparse
import functools
import json
import sys
import warnings
from pathlib import Path

import torch

KINDS = ("cosmos_jit", "diffusers")
PROBE_SIZE = 64  # image side used to measure a TorchScript tokenizer's channels and downsample factor


class LatentTokenizer:
    """Common interface: `encode` (images in [-1, 1] -> latents) and `decode` (the inverse).

    Attributes:
        kind: "cosmos_jit" or "diffusers".
        name: identifies the weights (the folder name), stored in every latent shard.
        latent_channels: C of the latents.
        downsample: spatial factor f (H / h).
    """

    kind = ""

    def __init__(self, name: str, device: torch.device, dtype: torch.dtype):
        self.name = name
        self.device = torch.device(device)
        self.dtype = dtype
        self.latent_channels = 0
        self.downsample = 0

    def _encode(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def _decode(self, z: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    @torch.no_grad()
    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """(B, 3, H, W) in [-1, 1] -> (B, C, H/f, W/f) float32 on the tokenizer's device."""
        if x.ndim != 4 or x.shape[1] != 3:
            raise ValueError(f"{self.kind} tokenizer encodes (B, 3, H, W) images, got {tuple(x.shape)}")
        return self._encode(x.to(self.device, self.dtype)).float()

    @torch.no_grad()
    def decode(self, z: torch.Tensor) -> torch.Tensor:
        """(B, C, h, w) raw latents -> (B, 3, h*f, w*f) float32 images clamped to [-1, 1]."""
        if z.ndim != 4 or z.shape[1] != self.latent_channels:
            raise ValueError(f"{self.kind} tokenizer {self.name} decodes (B, {self.latent_channels}, h, w) "
                             f"latents, got {tuple(z.shape)}")  # fmt: skip
        return self._decode(z.to(self.device, self.dtype)).float().clamp(-1, 1)

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
    """Cosmos image tokenizer from its released TorchScript `encoder.jit` / `decoder.jit`."""

    kind = "cosmos_jit"

    def __init__(self, checkpoint_dir: Path, device: torch.device, dtype: torch.dtype):
        super().__init__(checkpoint_dir.name, device, dtype)
        files = {}
        for part in ("encoder", "decoder"):
            path = checkpoint_dir / f"{part}.jit"
            if not path.is_file():
                raise FileNotFoundError(
                    f"latent.checkpoint_dir: {path} is missing (a cosmos_jit tokenizer folder holds "
                    "encoder.jit and decoder.jit, e.g. Cosmos-0.1-Tokenizer-CI8x8)"
                )
            files[part] = path
        self.encoder, self.decoder = (_load_jit(files[part], self.device, dtype) for part in ("encoder", "decoder"))
        # The files carry no config: measure channels and downsample on a small blank image.
        probe = self.encode(torch.zeros(1, 3, PROBE_SIZE, PROBE_SIZE))
        self.latent_channels = probe.shape[1]
        self.downsample = PROBE_SIZE // probe.shape[-1]

    def _encode(self, x: torch.Tensor) -> torch.Tensor:
        out = self.encoder(x)
        return out[0] if isinstance(out, tuple | list) else out  # Cosmos returns (latent, ...) for some kinds

    def _decode(self, z: torch.Tensor) -> torch.Tensor:
        out = self.decoder(z)
        return out[0] if isinstance(out, tuple | list) else out


def _load_jit(path: Path, device: torch.device, dtype: torch.dtype) -> torch.jit.ScriptModule:
    with warnings.catch_warnings():
        # Cosmos ships TorchScript; torch.jit's deprecation notice is not actionable for users of its files.
        warnings.simplefilter("ignore", FutureWarning)
        return torch.jit.load(str(path), map_location=device).to(device, dtype).eval()


class DiffusersTokenizer(LatentTokenizer):
    """diffusers `AutoencoderKLCosmos` (video VAE used on single frames) or SD-style `AutoencoderKL`."""

    kind = "diffusers"

    def __init__(self, checkpoint_dir: Path, device: torch.device, dtype: torch.dtype):
        config_file = checkpoint_dir / "config.json"
        if not config_file.is_file():
            raise FileNotFoundError(f"latent.checkpoint_dir: {config_file} is missing (a diffusers autoencoder "
                                    "folder as written by save_pretrained)")  # fmt: skip
        config = json.loads(config_file.read_text())
        class_name = config.get("_class_name", "AutoencoderKL")
        super().__init__(f"{class_name}:{checkpoint_dir.name}", device, dtype)
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
        if self.video:  # (B, C, T=1, H, W): an image is a one-frame video
            return self.vae.encode(x.unsqueeze(2)).latent_dist.mode().squeeze(2)
        return self.vae.encode(x).latent_dist.mode()  # the Gaussian's mean: deterministic latents

    def _decode(self, z: torch.Tensor) -> torch.Tensor:
        if self.video:
            return self.vae.decode(z.unsqueeze(2)).sample.squeeze(2)
        return self.vae.decode(z).sample


def load_tokenizer(kind: str, checkpoint_dir: str | Path, device="cpu", dtype: torch.dtype = torch.float32):
    """Loads an image tokenizer from a local folder.

    Args:
        kind: "cosmos_jit" (encoder.jit + decoder.jit) or "diffusers" (AutoencoderKL / AutoencoderKLCosmos).
        checkpoint_dir: the local folder.
        device: where it runs; bf16 (`dtype=torch.bfloat16`) is the usual choice on a GPU.
        dtype: compute dtype of the tokenizer (outputs are float32).

    Returns:
        A `LatentTokenizer` with encode(x), decode(z), latent_channels, downsample and name.

    Raises:
        FileNotFoundError: the folder or one of its files is missing (the message names the path).
        ValueError: an unknown kind.
    """
    if kind not in KINDS:
        raise ValueError(f"latent.tokenizer = {kind!r}: must be one of {list(KINDS)}")
    folder = Path(checkpoint_dir)
    if not str(checkpoint_dir) or not folder.is_dir():
        raise FileNotFoundError(f"latent.checkpoint_dir: tokenizer folder {str(checkpoint_dir)!r} does not exist")
    cls = CosmosJITTokenizer if kind == "cosmos_jit" else DiffusersTokenizer
    return cls(folder.resolve(), torch.device(device), dtype)


@functools.lru_cache(maxsize=2)
def _cached_tokenizer(kind: str, checkpoint_dir: str, device: str, dtype: torch.dtype) -> LatentTokenizer:
    return load_tokenizer(kind, checkpoint_dir, device, dtype)


def _normalization(latent_config, dataset_path: str):
    from torchtitan.datasets.latents import normalization_for, read_meta

    if latent_config.scale_factor > 0:
        return normalization_for({}, latent_config.scale_factor)
    return normalization_for(read_meta(dataset_path))


def decode_for_training(job_config, latents: torch.Tensor, batch_size: int = 16) -> torch.Tensor:
    """Model-space latents sampled during training -> images in [-1, 1] (on the latents' device).

    The tokenizer named by `[latent]` is loaded once per process and cached. Latents are un-normalized
    with the statistics stored in `training.dataset_path`'s meta.json, or divided by `latent.scale_factor`
    when it is > 0. On a GPU the tokenizer runs in bf16.
    """
    device = latents.device
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    latent = job_config.latent
    tokenizer = _cached_tokenizer(latent.tokenizer, latent.checkpoint_dir, str(device), dtype)
    raw = _normalization(latent, job_config.training.dataset_path).denormalize(latents.float())
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Decode latents with an image tokenizer to a PNG grid.")
    parser.add_argument("--checkpoint-dir", required=True, help="local tokenizer folder")
    parser.add_argument("--latents", required=True, help=".safetensors or .pt file of latents")
    parser.add_argument("--out", default="grid.png", help="PNG grid to write")
    parser.add_argument("--kind", default="cosmos_jit", choices=KINDS)
    parser.add_argument("--stats", default="", help="prepared folder or meta.json: latents are normalized")
    parser.add_argument("--scale-factor", type=float, default=0.0, help="> 0: latents are z * this")
    parser.add_argument("--max-images", type=int, default=64, help="decode at most this many")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)

    from torchtitan.datasets.latents import normalization_for, read_meta
    from torchtitan.tools.images import save_image_grid

    try:
        z = read_latent_file(args.latents)[: args.max_images]
        if args.scale_factor > 0:
            z = normalization_for({}, args.scale_factor).denormalize(z)
        elif args.stats:
            stats = Path(args.stats)
            z = normalization_for(read_meta(stats.parent if stats.is_file() else stats)).denormalize(z)
        device = torch.device(args.device)
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        tokenizer = load_tokenizer(args.kind, args.checkpoint_dir, device, dtype)
        images = tokenizer.decode_batches(z, args.batch_size)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    path = save_image_grid(images, Path(args.out))
    print(f"decoded {len(images)} latents with {tokenizer.describe()} to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
