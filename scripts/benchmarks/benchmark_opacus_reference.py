"""Opacus ghost clipping on the reference DiT (facebookresearch/DiT's models.py), timed as our benchmark times ours.

The baseline beside `scripts/benchmark.py`'s DP cases: the paper's own model, trained by Opacus (1.6) with ghost
clipping, one GPU, eager. The reference is not part of this repository: `--reference-dit` names a folder holding
its models.py (a checkout of github.com/facebookresearch/DiT; it imports timm for PatchEmbed, Attention and Mlp).

The step is the work a diffusion step gives the model, without the diffusion bookkeeping (noise schedule, the
variational-bound term): random images, timesteps and labels in, the model's forward, a per-sample mean squared
error of the first `in_channels` output channels against a random noise target, the backward, and AdamW (the
trainer's own, fused on CUDA). Under `--mode ghost` Opacus clips each sample's gradient: its loss runs a first
backward that computes the per-sample norms (ghost norms for Linear and Embedding, per-sample gradients for the
Conv2d patch embedding) and a second one on the loss re-weighted by the clipping factors; its optimizer adds the
noise. `--mode none` is the plain step with the same loss, for the cost of privacy on the reference.

As `torchtitan.measure` does for the trainer: bf16 autocast on CUDA over fp32 weights, `--warmup` steps, then
`--steps` steps each timed to a device sync; the median step time, images/s, TFLOP/s and MFU through the trainer's
`ThroughputMeter` with our FLOP count of the same shape, peak memory over the timed steps. Prints one JSON line and
scripts/benchmark.py's table. Example (DiT-L/8 on 256x256 pixels, as train_configs/dit_l8_pixel_dp.toml):

    python scripts/benchmarks/benchmark_opacus_reference.py --reference-dit build/ref_dit --model DiT-L/8 \
        --image-size 256 --in-channels 3 --batch 32 --mode ghost
"""

import argparse
import importlib.util
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from scripts.lib import result_table, warm_summary  # noqa: E402
from torchtitan.components.metrics import ThroughputMeter  # noqa: E402
from torchtitan.components.optimizer import build_optimizer  # noqa: E402
from torchtitan.job_config import Optimizer  # noqa: E402
from torchtitan.models.dit.model import DiTArgs, flops_per_image  # noqa: E402
from torchtitan.tools.utils import peak_memory_gib  # noqa: E402

NUM_CLASSES = 1000  # the reference's default, and train_configs/dit_l8_pixel_dp.toml's
NUM_TIMESTEPS = 1000  # the reference trains on integer timesteps in [0, 1000)
GIB = 1024**3


def load_reference(folder: Path) -> ModuleType:
    """The reference's models.py from `folder`, imported under a name of its own (it is no package of ours).

    Raises:
        FileNotFoundError: `folder` holds no models.py.
    """
    path = Path(folder) / "models.py"
    if not path.is_file():
        raise FileNotFoundError(path)
    spec = importlib.util.spec_from_file_location("reference_dit_models", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def reference_load_error(folder: Path, error: Exception) -> str:
    """The one `error:` line for a reference checkout that `load_reference` (or its diffusion package) could not
    load: a missing file (FileNotFoundError) or a failed import (ImportError: timm, which its models.py imports)."""
    if isinstance(error, FileNotFoundError):
        return (f"error: no reference DiT in {folder}: {error.args[0]} does not exist (--reference-dit: a checkout of "
                "github.com/facebookresearch/DiT)")  # fmt: skip
    return f"error: importing the reference DiT in {folder} failed: {error}"


def reference_args(model: nn.Module, image_size: int) -> DiTArgs:
    """Our DiTArgs of the reference model's shape, for our FLOP count (its sincos position embedding adds none)."""
    dim = model.x_embedder.proj.out_channels
    return DiTArgs(input_size=image_size, in_channels=model.in_channels, patch_size=model.patch_size, dim=dim,
                   depth=len(model.blocks), num_heads=model.num_heads, learn_sigma=model.learn_sigma,
                   mlp_ratio=model.blocks[0].mlp.fc1.out_features / dim)  # fmt: skip


class PerSampleMSE(nn.Module):
    """Mean squared error per sample of the prediction channels (the first `target`'s channels of the output).

    `reduction` is how Opacus asks for one loss per sample: its ghost-clipping loss sets "none" around each call.
    """

    def __init__(self, reduction: str = "mean"):
        super().__init__()
        self.reduction = reduction

    def forward(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        error = output[:, : target.shape[1]].float() - target  # (B, C, H, W); learn_sigma's channels left out
        per_sample = error.square().mean(dim=(1, 2, 3))  # (B,)
        return per_sample if self.reduction == "none" else per_sample.mean()


def random_batch(batch: int, in_channels: int, image_size: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """Noisy inputs (B, C, H, W), timesteps (B,), labels (B,) and the noise target (B, C, H, W)."""
    shape = (batch, in_channels, image_size, image_size)
    t = torch.randint(0, NUM_TIMESTEPS, (batch,), device=device)
    y = torch.randint(0, NUM_CLASSES, (batch,), device=device)
    return torch.randn(shape, device=device), t, y, torch.randn(shape, device=device)


def make_private_ghost(model: nn.Module, optimizer: torch.optim.Optimizer, batch: int, noise_multiplier: float,
                       max_grad_norm: float) -> tuple[nn.Module, torch.optim.Optimizer, Callable]:  # fmt: skip
    """Opacus' ghost clipping around the model, optimizer and loss (fixed batches: no Poisson sampling).

    Opacus reads the expected batch size off a data loader; one of `batch` placeholders gives it `batch`, and the
    steps draw their own data.
    """
    from opacus import PrivacyEngine

    placeholders = torch.utils.data.TensorDataset(torch.zeros(batch, 1))
    loader = torch.utils.data.DataLoader(placeholders, batch_size=batch)
    model, optimizer, loss_fn, _ = PrivacyEngine().make_private(
        module=model, optimizer=optimizer, data_loader=loader, criterion=PerSampleMSE(),
        noise_multiplier=noise_multiplier, max_grad_norm=max_grad_norm, grad_sample_mode="ghost",
        poisson_sampling=False,
    )  # fmt: skip
    return model, optimizer, loss_fn


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, loss_fn: Callable, batch: tuple,
               autocast: bool) -> torch.Tensor:  # fmt: skip
    """One step; returns the batch's mean loss (detached, on the device: no sync here)."""
    x, t, y, target = batch
    with torch.autocast(x.device.type, torch.bfloat16, enabled=autocast):
        output = model(x, t, y)  # (B, C_out, H, W)
    loss = loss_fn(output, target)
    loss.backward()  # ghost: both of Opacus' backward passes
    optimizer.step()  # ghost: noise and the average of the clipped gradients first
    optimizer.zero_grad(set_to_none=True)
    return loss.detach()


def norm_summary(norms: list[torch.Tensor], max_grad_norm: float) -> dict:
    """Mean and largest per-sample gradient norm before clipping, and the fraction clipped (norm > C)."""
    if not norms:
        return {}
    all_norms = torch.cat(norms).double()
    mean, largest, clipped = torch.stack(
        [all_norms.mean(), all_norms.max(), (all_norms > max_grad_norm).double().mean()]
    ).tolist()
    return {"dp_grad_norm_mean": mean, "dp_grad_norm_max": largest, "dp_clipped_fraction": clipped}


def measure(args: argparse.Namespace, reference: ModuleType, device: torch.device) -> dict:
    """Builds the reference model and its step for `args.mode`, then times it (see the module docstring)."""
    model = reference.DiT_models[args.model](input_size=args.image_size, in_channels=args.in_channels,
                                             num_classes=NUM_CLASSES, learn_sigma=args.learn_sigma)  # fmt: skip
    model.to(device).train()
    shape = reference_args(model, args.image_size)
    optimizer = build_optimizer(model, Optimizer(), device)
    loss_fn = PerSampleMSE()
    if args.mode == "ghost":
        model, optimizer, loss_fn = make_private_ghost(model, optimizer, args.batch, args.noise_multiplier,
                                                       args.max_grad_norm)  # fmt: skip
    autocast = device.type == "cuda"

    def step() -> torch.Tensor:
        loss = train_step(model, optimizer, loss_fn, random_batch(args.batch, args.in_channels, args.image_size,
                                                                  device), autocast)  # fmt: skip
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return loss

    start = time.perf_counter()
    for _ in range(args.warmup):
        step()
    warmup_s = time.perf_counter() - start
    meter = ThroughputMeter(device, flops_per_image(shape), args.batch, world_size=1)  # resets the peak memory
    times, norms = [], []
    for _ in range(args.steps):
        start = time.perf_counter()
        loss = step()
        times.append(time.perf_counter() - start)
        if args.mode == "ghost":
            norms.append(model.per_sample_gradient_norms.detach())
    summary = warm_summary(times)
    result = {"name": args.name or f"reference_{args.mode}", "status": "ok", "mode": args.mode, "model": args.model,
              "image_size": args.image_size, "in_channels": args.in_channels, "global_batch": args.batch,
              **meter.rates(summary["step_time_s"]), **summary, "warmup_s": warmup_s, "loss": loss.item(),
              "gflop_per_image": meter.flops_per_sample / 1e9, **peak_memory_gib(device)}  # fmt: skip
    if device.type == "cuda":
        result.update(max_memory_allocated_gib=torch.cuda.max_memory_allocated(device) / GIB,
                      device=torch.cuda.get_device_name(device))  # fmt: skip
    if args.mode == "ghost":
        import opacus

        result.update(norm_summary(norms, args.max_grad_norm), opacus=opacus.__version__,
                      noise_multiplier=args.noise_multiplier, max_grad_norm=args.max_grad_norm)  # fmt: skip
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reference-dit", type=Path, required=True, help="folder holding the reference's models.py")
    parser.add_argument("--model", default="DiT-L/8", help="a key of the reference's DiT_models")
    parser.add_argument("--image-size", type=int, default=256, help="model input size (pixels, or latent cells)")
    parser.add_argument("--in-channels", type=int, default=3, help="3 for pixels, 4 for SD-VAE latents")
    parser.add_argument("--learn-sigma", action=argparse.BooleanOptionalAction, default=False,
                        help="2 x in_channels outputs, as the reference's default (our DP config: off)")  # fmt: skip
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--max-grad-norm", type=float, default=1.0)
    parser.add_argument("--noise-multiplier", type=float, default=1.0)
    parser.add_argument("--mode", choices=["ghost", "none"], default="ghost", help="Opacus ghost clipping, or no DP")
    parser.add_argument("--name", default="", help="the case's name in the table (default: reference_MODE)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    try:
        reference = load_reference(args.reference_dit)
    except FileNotFoundError as missing:
        parser.error(f"no reference DiT: {missing.args[0]} does not exist (--reference-dit: a folder with the "
                     f"models.py of a facebookresearch/DiT checkout)")  # fmt: skip
    if args.model not in reference.DiT_models:
        parser.error(f"--model {args.model!r} is not in the reference's DiT_models: {sorted(reference.DiT_models)}")
    torch.manual_seed(args.seed)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        result = measure(args, reference, device)
    except torch.OutOfMemoryError:
        result = {"name": args.name or f"reference_{args.mode}", "status": "OOM", "mode": args.mode,
                  "global_batch": args.batch}  # fmt: skip
    print(json.dumps(result), flush=True)
    print(result_table([result]))
    return 0 if result["status"] == "ok" else 1


if __name__ == "__main__":
    sys.exit(main())
