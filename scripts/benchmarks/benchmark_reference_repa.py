"""The speed reference for representation alignment: sihyun-yu/REPA's own training step, timed as
scripts/benchmarks/benchmark_reference.py times facebookresearch/DiT's (the same warm-up, timed and streamed steps,
the same result line and table).

The reference is not part of this repository: `--reference-repa` names a checkout of github.com/sihyun-yu/REPA; its
models/sit.py (which imports timm) and loss.py are imported from there by path, nothing installed. The step is the
body of its train.py's loop, as its train.py runs it under accelerate:
- the model: `SiT_models[--model]` (SiT-XL/2) with `z_dims` from the encoder, `encoder_depth` 8, projector_dim 2048,
  `use_cfg` (class dropout 0.1), fused attention, no qk-norm; its EMA copy; AdamW (lr 1e-4, betas (0.9, 0.999), no
  weight decay, eps 1e-8); the loss `SILoss(prediction="v", path_type="linear", weighting="uniform")` with the
  SD-VAE's latent scale 0.18215;
- the encoder: DINOv2-B. REPA reads it through torch.hub, which needs the network, so it is built here as timm's
  `vit_base_patch14_dinov2` architecture with random weights (the same compute), at 224 pixels per 256 of the image
  (REPA resizes the position embedding to that grid), presented as the hub model: `forward_features(x)` returns
  {"x_norm_patchtokens": (B, N, 768)}, `head` is an Identity. Eval mode, run under `torch.no_grad()`, not compiled;
  every rank builds the same one;
- each step: random uint8 images (B, 3, R, R) and VAE moments (B, 8, R/8, R/8) drawn on the device (data loading and
  the VAE are left out, as our measurement leaves them out), random labels; under no_grad the latents sampled from
  the moments and the images preprocessed as REPA's train.py does for DINOv2 (x / 255, ImageNet's mean and std,
  bicubic resize to 224 * (R // 256)) and encoded under accelerate's autocast; then `loss, proj_loss =
  loss_fn(model, x, dict(y=labels), zs=zs)`, `loss.mean() + proj_coeff * proj_loss.mean()` (proj_coeff 0.5), divided
  by accelerate's gradient accumulation steps (1), backward, `clip_grad_norm_(max 1.0)`, the optimizer step,
  `zero_grad(set_to_none=True)` and REPA's `update_ema` (a Python loop over the parameters, decay 0.9999);
- then its log of the step (`--step-logs`, on): loss, projection loss and gradient norm each gathered over the ranks
  and read on the host, three device syncs a step as REPA's loop pays them. Its progress bar and wandb are left out.

Precision as accelerate applies `--mixed-precision` (default bf16): the model's forward runs under autocast and its
outputs come back in float32 (the loss's own arithmetic stays float32), the encoder runs under autocast; fp16 adds
accelerate's GradScaler (scaled backward, unscaled before clipping, the scaler's step and update); "no" is float32.
TF32 is on (`--allow-tf32`, as REPA's README runs it). As accelerate does, the model is wrapped in DDP when there
is more than one process and not on a single GPU (`--ddp` forces it on a world of one, as torchrun's launch would).
`--compile` (off by default, as REPA runs) is `torch.compile(model)` before DDP.

FLOPs: our `flops_per_image` of the same SiT as a DiT (patch, width, depth, heads, no learned sigma), so MFU compares
with ours; the encoder's forward and the projector are NOT counted, so the MFU understates the work done (DINOv2-B
and the projector add about 8% of SiT-XL/2's training FLOPs). Rank 0 prints one `MEASURE_RESULT {json}` line and
scripts/benchmark.py's table. Examples (SiT-XL/2 at 256px, 32 images a GPU; `timm` installed):

    python scripts/benchmarks/benchmark_reference_repa.py --reference-repa build/ref_repa --batch 32
    python scripts/benchmarks/benchmark_reference_repa.py --reference-repa build/ref_repa --batch 64 --compile
    torchrun --nproc_per_node 8 scripts/benchmarks/benchmark_reference_repa.py --reference-repa build/ref_repa \
        --batch 32
"""

import argparse
import contextlib
import copy
import importlib.util
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from scripts.benchmarks.benchmark_reference import add_measure_args, measure_and_report, time_steps, update_ema  # noqa: E402
from torchtitan.models.dit.model import DiTArgs, flops_per_image  # noqa: E402
from torchtitan.tools.utils import get_device  # noqa: E402

NUM_CLASSES = 1000
VAE_DOWNSAMPLE = 8  # REPA's latent_size = resolution // 8
LATENT_CHANNELS = 4  # SD-VAE's; the moments hold a mean and a std of as many channels each
LATENTS_SCALE = 0.18215  # SD-VAE's, as REPA's train.py sets latents_scale (its latents_bias is 0)
ENCODER_PIXELS_PER_256 = 224  # REPA resizes each 256 pixels of the image to DINOv2's 224 (16 patches of 14)
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
GRADIENT_ACCUMULATION_STEPS = 1  # REPA's default; accelerate's backward divides the loss by it
PRECISIONS = {"no": None, "bf16": torch.bfloat16, "fp16": torch.float16}
REPA_FILES = ("models/sit.py", "loss.py")


def load_repa(folder: Path) -> tuple[ModuleType, ModuleType]:
    """REPA's models/sit.py and loss.py from the checkout `folder`, each imported under a name of its own.

    Raises:
        FileNotFoundError: one of the two files is missing (named).
        ImportError: a module they import is missing (models/sit.py imports timm).
    """
    modules = []
    for relative in REPA_FILES:
        path = Path(folder) / relative
        if not path.is_file():
            raise FileNotFoundError(path)
        spec = importlib.util.spec_from_file_location("reference_repa_" + path.stem, path)
        module = importlib.util.module_from_spec(spec)
        # Registered by its name: torch.compile (2.11) resolves a traced function's globals by importing its module,
        # and --compile failed on the GPU machine with "No module named 'reference_repa_sit'" (2026-11-28 (k)).
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
        modules.append(module)
    return modules[0], modules[1]


def load_error(folder: Path, error: Exception) -> str:
    """The one `error:` line for a checkout that `load_repa` could not load, or an encoder `build_encoder` could not
    build: a missing file, or a missing package (timm) named with how to install it."""
    if isinstance(error, FileNotFoundError):
        return (f"error: no REPA checkout in {folder}: {error.args[0]} does not exist (--reference-repa: a checkout of "
                "github.com/sihyun-yu/REPA)")  # fmt: skip
    if isinstance(error, ModuleNotFoundError) and error.name:
        return (f"error: REPA's step needs the package {error.name}, which is not installed (pip install "
                f"{error.name}; it is no dependency of ours)")  # fmt: skip
    return f"error: importing REPA from {folder} failed: {error}"


class HubStyleDinov2(nn.Module):
    """A timm DINOv2 as torch.hub's DINOv2 answers REPA: `forward_features` returns the final-normed patch tokens
    under "x_norm_patchtokens" (the class token left out), `embed_dim` is the feature width."""

    def __init__(self, vit: nn.Module):
        super().__init__()
        self.vit = vit
        self.embed_dim = vit.embed_dim
        self.head = nn.Identity()  # as REPA sets it; forward_features never reaches it

    def forward_features(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        tokens = self.vit.forward_features(x)  # (B, prefix + N, D), after the final norm
        return {"x_norm_patchtokens": tokens[:, self.vit.num_prefix_tokens :]}


def build_encoder(image_size: int) -> nn.Module:
    """DINOv2-B (timm's `vit_base_patch14_dinov2`) with random weights, for images of `image_size` pixels, on the CPU.

    Raises:
        ModuleNotFoundError: timm is not installed.
    """
    import timm  # only the real encoder needs it; tests inject a stand-in instead

    vit = timm.create_model("vit_base_patch14_dinov2", pretrained=False, num_classes=0,
                            img_size=encoder_image_size(image_size))  # fmt: skip
    return HubStyleDinov2(vit)


def encoder_image_size(image_size: int) -> int:
    """The encoder's input size for images of `image_size` pixels: REPA's bicubic resize target."""
    return ENCODER_PIXELS_PER_256 * (image_size // 256)


def preprocess_raw_image(raw: torch.Tensor) -> torch.Tensor:
    """REPA's preprocessing for DINOv2: uint8 images (B, 3, R, R) to [0, 1], normalized by ImageNet's mean and std,
    then resized (bicubic) to 224 * (R // 256). The mean and std tensors are made per call, as torchvision's
    Normalize (which REPA calls) makes them."""
    x = raw / 255.0
    mean = torch.as_tensor(IMAGENET_MEAN, dtype=x.dtype, device=x.device).view(-1, 1, 1)
    std = torch.as_tensor(IMAGENET_STD, dtype=x.dtype, device=x.device).view(-1, 1, 1)
    x = (x - mean) / std
    return F.interpolate(x, encoder_image_size(raw.shape[-1]), mode="bicubic")


def sample_posterior(moments: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """REPA's latents from VAE moments (B, 2C, h, w): mean + std * noise, then scaled and shifted."""
    mean, std = moments.chunk(2, dim=1)
    return (mean + std * torch.randn_like(mean)) * scale + bias


class MixedPrecisionForward(nn.Module):
    """The model's forward as accelerate's `prepare` leaves it under mixed precision: run under autocast, its half
    precision outputs (in tuples and lists too) handed back in float32."""

    def __init__(self, module: nn.Module, dtype: torch.dtype):
        super().__init__()
        self.module, self.dtype = module, dtype

    def forward(self, x: torch.Tensor, *args, **kwargs):
        with torch.autocast(x.device.type, self.dtype):
            return _to_float32(self.module(x, *args, **kwargs))


def _to_float32(value):
    if isinstance(value, (tuple, list)):
        return type(value)(_to_float32(v) for v in value)
    if isinstance(value, torch.Tensor) and value.dtype in (torch.float16, torch.bfloat16):
        return value.float()
    return value


@dataclass
class RepaRun:
    """What REPA's training loop holds: the model as the step calls it (maybe autocast-wrapped, compiled and
    DDP-wrapped), the plain SiT under it, its EMA copy, AdamW, fp16's GradScaler, SILoss and the encoder."""

    model: nn.Module
    plain: nn.Module
    ema: nn.Module
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler | None
    loss_fn: object
    encoder: nn.Module
    autocast_dtype: torch.dtype | None


def build_repa_run(sit: ModuleType, loss: ModuleType, encoder: nn.Module, model_name: str, latent_size: int,
                   device: torch.device, encoder_depth: int = 8, precision: str = "bf16", compile_model: bool = False,
                   ddp: bool | None = None) -> RepaRun:  # fmt: skip
    """REPA's setup (its train.py, in its order, then accelerate's `prepare`). `ddp` None: DDP when the process group
    has more than one rank, as accelerate decides. Needs the process group (`distributed()`)."""
    encoder = encoder.to(device).eval()
    plain = sit.SiT_models[model_name](input_size=latent_size, num_classes=NUM_CLASSES, use_cfg=True,
                                       z_dims=[encoder.embed_dim], encoder_depth=encoder_depth, projector_dim=2048,
                                       fused_attn=True, qk_norm=False).to(device)  # fmt: skip
    ema = copy.deepcopy(plain).to(device).requires_grad_(False)
    scale = torch.full((1, LATENT_CHANNELS, 1, 1), LATENTS_SCALE, device=device)
    bias = torch.zeros(1, LATENT_CHANNELS, 1, 1, device=device)
    loss_fn = loss.SILoss(prediction="v", path_type="linear", weighting="uniform", encoders=[encoder],
                          accelerator=None, latents_scale=scale, latents_bias=bias)  # fmt: skip
    optimizer = torch.optim.AdamW(plain.parameters(), lr=1e-4, betas=(0.9, 0.999), weight_decay=0.0, eps=1e-8)
    update_ema(ema, plain, decay=0)  # REPA's update_ema: it strips "module." from names, and the plain model has none
    plain.train()  # class dropout on
    ema.eval()
    dtype = PRECISIONS[precision]
    model = plain if dtype is None else MixedPrecisionForward(plain, dtype)
    model = torch.compile(model) if compile_model else model
    if dist.get_world_size() > 1 if ddp is None else ddp:
        model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    scaler = torch.amp.GradScaler(device.type) if precision == "fp16" else None
    return RepaRun(model, plain, ema, optimizer, scaler, loss_fn, encoder, dtype)


def logged_mean(value: torch.Tensor) -> float:
    """REPA's log of a scalar: accelerate's gather over the ranks (none on a single process), the mean, read on the
    host (a device sync)."""
    world_size = dist.get_world_size()
    if world_size > 1:
        value = value.detach().reshape(1)
        if dist.get_backend() == "gloo":  # accelerate's way on gloo, which has no all_gather_into_tensor
            parts = [torch.empty_like(value) for _ in range(world_size)]
            dist.all_gather(parts, value)
            value = torch.cat(parts)
        else:
            gathered = torch.empty(world_size, dtype=value.dtype, device=value.device)
            dist.all_gather_into_tensor(gathered, value)
            value = gathered
    return value.mean().detach().item()


def train_step(run: RepaRun, raw_image: torch.Tensor, moments: torch.Tensor, labels: torch.Tensor,
               proj_coeff: float = 0.5, step_logs: bool = False) -> dict[str, torch.Tensor]:  # fmt: skip
    """REPA's step on uint8 images (B, 3, R, R), VAE moments (B, 8, R/8, R/8) and labels (B,). Returns the mean
    denoising loss, the mean projection loss and the gradient norm before clipping (detached, on the device)."""
    dtype = run.autocast_dtype
    with torch.no_grad():
        x = sample_posterior(moments, run.loss_fn.latents_scale, run.loss_fn.latents_bias)
        with torch.autocast(raw_image.device.type, dtype) if dtype else contextlib.nullcontext():
            zs = [run.encoder.forward_features(preprocess_raw_image(raw_image))["x_norm_patchtokens"]]
    loss, proj_loss = run.loss_fn(run.model, x, dict(y=labels), zs=zs)
    loss_mean, proj_loss_mean = loss.mean(), proj_loss.mean()
    total = (loss_mean + proj_loss_mean * proj_coeff) / GRADIENT_ACCUMULATION_STEPS
    if run.scaler is None:
        total.backward()
    else:
        run.scaler.scale(total).backward()
        run.scaler.unscale_(run.optimizer)  # accelerate's clip_grad_norm_ unscales first
    grad_norm = torch.nn.utils.clip_grad_norm_(run.model.parameters(), 1.0)
    if run.scaler is None:
        run.optimizer.step()
    else:
        run.scaler.step(run.optimizer)
        run.scaler.update()
    run.optimizer.zero_grad(set_to_none=True)
    update_ema(run.ema, run.plain)
    if step_logs:
        for value in (loss_mean, proj_loss_mean, grad_norm):
            logged_mean(value)
    return {"loss": loss_mean.detach(), "proj_loss": proj_loss_mean.detach(), "grad_norm": grad_norm.detach()}


def random_inputs(batch: int, image_size: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """uint8 images (B, 3, R, R), VAE moments (B, 8, R/8, R/8) and labels (B,), drawn on the device."""
    raw = torch.randint(0, 256, (batch, 3, image_size, image_size), dtype=torch.uint8, device=device)
    latent = image_size // VAE_DOWNSAMPLE
    moments = torch.randn(batch, 2 * LATENT_CHANNELS, latent, latent, device=device)
    return raw, moments, torch.randint(0, NUM_CLASSES, (batch,), device=device)


def sit_args(model: nn.Module, latent_size: int) -> DiTArgs:
    """Our DiTArgs of the SiT's shape, for our FLOP count (a SiT predicts no sigma: out_channels = in_channels)."""
    dim = model.x_embedder.proj.out_channels
    return DiTArgs(input_size=latent_size, in_channels=model.in_channels, patch_size=model.patch_size, dim=dim,
                   depth=len(model.blocks), num_heads=model.num_heads, learn_sigma=False,
                   mlp_ratio=model.blocks[0].mlp.fc1.out_features / dim)  # fmt: skip


def measure(args: argparse.Namespace, sit: ModuleType, loss: ModuleType, encoder: nn.Module,
            device: torch.device) -> dict:  # fmt: skip
    """Builds REPA's training and times its step (see the module docstring)."""
    world_size = dist.get_world_size()
    torch.manual_seed(args.seed + dist.get_rank())  # REPA's set_seed(seed + process_index)
    latent_size = args.image_size // VAE_DOWNSAMPLE
    run = build_repa_run(sit, loss, encoder, args.model, latent_size, device, args.encoder_depth,
                         args.mixed_precision, args.compile, args.ddp)  # fmt: skip

    def step() -> dict[str, torch.Tensor]:
        raw, moments, y = random_inputs(args.batch, args.image_size, device)
        return train_step(run, raw, moments, y, args.proj_coeff, args.step_logs)

    head = {"name": args.name, "status": "ok", "model": args.model, "image_size": args.image_size,
            "latent_size": latent_size, "encoder": "dinov2-vit-b (timm vit_base_patch14_dinov2, random weights)",
            "encoder_image_size": encoder_image_size(args.image_size), "encoder_depth": args.encoder_depth,
            "proj_coeff": args.proj_coeff, "batch": args.batch, "world_size": world_size,
            "global_batch": args.batch * world_size, "ddp": isinstance(run.model, DDP), "compile": args.compile,
            "mixed_precision": args.mixed_precision, "allow_tf32": args.allow_tf32,
            "step_logs": args.step_logs}  # fmt: skip
    flops = flops_per_image(sit_args(run.plain, latent_size))  # the encoder and the projector are not counted
    return {**head, **time_steps(step, args.warmup, args.steps, device, flops, args.batch * world_size, args.profile)}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reference-repa", type=Path, required=True,
                        help="a sihyun-yu/REPA checkout (its models/sit.py and loss.py)")  # fmt: skip
    parser.add_argument("--model", default="SiT-XL/2", help="a key of REPA's SiT_models")
    parser.add_argument("--image-size", type=int, default=256, help="pixels, a multiple of 256 (REPA: 256 or 512)")
    parser.add_argument("--batch", type=int, default=32, help="images per rank (per GPU)")
    parser.add_argument("--encoder-depth", type=int, default=8, help="the block whose tokens align (REPA's 8)")
    parser.add_argument("--proj-coeff", type=float, default=0.5, help="the projection loss's weight (REPA's 0.5)")
    parser.add_argument("--mixed-precision", choices=sorted(PRECISIONS), default="bf16",
                        help="accelerate's mixed precision (fp16 adds its GradScaler)")  # fmt: skip
    parser.add_argument("--allow-tf32", action=argparse.BooleanOptionalAction, default=True,
                        help="TF32 matmuls and convolutions, as REPA's README runs it")  # fmt: skip
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=False,
                        help="torch.compile the model, before DDP (REPA runs without)")  # fmt: skip
    parser.add_argument("--ddp", action=argparse.BooleanOptionalAction, default=None,
                        help="wrap in DDP; default: with more than one process, as accelerate does")  # fmt: skip
    parser.add_argument("--step-logs", action=argparse.BooleanOptionalAction, default=True,
                        help="REPA's per-step log: three gathers over the ranks, each read on the host")  # fmt: skip
    add_measure_args(parser, "reference_repa")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.image_size < 256 or args.image_size % 256:
        print(f"error: --image-size {args.image_size} is not a multiple of 256 (REPA trains at 256 or 512)",
              file=sys.stderr)  # fmt: skip
        return 2
    try:
        sit, loss = load_repa(args.reference_repa)
        torch.manual_seed(args.seed)  # every rank the same encoder, as REPA's ranks load the same weights
        encoder = build_encoder(args.image_size)
    except (FileNotFoundError, ImportError) as e:
        print(load_error(args.reference_repa, e), file=sys.stderr)
        return 2
    if args.model not in sit.SiT_models:
        print(f"error: --model {args.model!r} is not in REPA's SiT_models: {sorted(sit.SiT_models)}", file=sys.stderr)
        return 2
    torch.backends.cuda.matmul.allow_tf32 = args.allow_tf32
    torch.backends.cudnn.allow_tf32 = args.allow_tf32
    device = get_device()
    return measure_and_report(args, lambda: measure(args, sit, loss, encoder, device), device)


if __name__ == "__main__":
    sys.exit(main())
