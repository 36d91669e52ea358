"""The speed reference: facebookresearch/DiT's own training step, timed as `torchtitan.measure` times ours.

The reference is not part of this repository: `--reference-dit` names a checkout of github.com/facebookresearch/DiT
(its models.py, which imports timm, and its `diffusion` package), imported from there without installing anything.
The step is its train.py's: `create_diffusion(timestep_respacing="")` (1000 steps, linear schedule, learned sigma:
MSE plus the variational-bound term), integer timesteps drawn in [0, num_timesteps), `diffusion.training_losses`,
the mean loss, `opt.zero_grad(); loss.backward(); opt.step()` with AdamW(lr=1e-4, weight_decay=0), then its
`update_ema` (decay 0.9999): a Python loop over the parameters, kept as it is because that loop is part of what the
reference pays each step. The model is DDP-wrapped on every world size (a single GPU is a world of one, as the
reference runs under torchrun), each rank takes `--batch` latents (the reference's global_batch_size //
world_size), TF32 is on as the reference's train.py sets it, and the model keeps its defaults (in_channels 4,
learn_sigma, class dropout 0.1). Data loading and the VAE encoding are left out, as our measurement leaves them
out: random latents (B, 4, image_size // 8, image_size // 8) and random labels in [0, 1000).

What this benchmark adds to the reference, each with an option to take it away: bf16 autocast around the forward
and the loss (`--no-autocast`; CUDA only, CPU runs fp32 as our trainer does there) and `torch.compile`
(`--no-compile`). Where compile goes is a choice the reference leaves open, so both are offered:
- `--compile-order before-ddp` (the default): `DDP(torch.compile(model))`. One backward graph hands every gradient
  over at its end, so the all-reduce overlaps little of the backward; on one GPU there is nothing to overlap.
- `--compile-order after-ddp`: `torch.compile(DDP(model))`. Dynamo's DDPOptimizer splits the graph at DDP's
  buckets, so each bucket's all-reduce starts while the backward goes on.
A comparison takes the faster of the two on the machine. `update_ema` reads the plain model either way, whose
parameter names carry no `_orig_mod.` prefix.

Timing as `torchtitan.measure.measure_steps`: `--warmup` steps (compilation), then `--steps` steps each timed to a
device sync (their median, through `warm_summary`), then as many back to back with one sync at the end
(`streamed_step_time_s`). Images/s are global (batch x world size / step time); TFLOP/s and MFU per GPU through the
trainer's `ThroughputMeter` with our FLOP count of the same shape, so MFU compares with ours. Rank 0 prints one
`MEASURE_RESULT {json}` line and scripts/benchmark.py's table. Examples (DiT-XL/2 at 256px: 32x32 latents):

    python scripts/benchmarks/benchmark_reference.py --reference-dit build/ref_dit --batch 32
    torchrun --nproc_per_node 8 scripts/benchmarks/benchmark_reference.py --reference-dit build/ref_dit --batch 32
"""

import argparse
import contextlib
import copy
import importlib.util
import json
import os
import sys
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType, SimpleNamespace

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from scripts.benchmarks.benchmark_opacus_reference import (  # noqa: E402
    NUM_CLASSES,
    load_reference,
    reference_args,
    reference_load_error,
)
from scripts.lib import result_table, warm_summary  # noqa: E402
from torchtitan.components.metrics import ThroughputMeter  # noqa: E402
from torchtitan.models.dit.model import flops_per_image  # noqa: E402
from torchtitan.tools.runs import RESULT_PREFIX  # noqa: E402
from torchtitan.tools.utils import get_device, peak_memory_gib  # noqa: E402
from torchtitan.trainer import init_distributed  # noqa: E402

# Our repository has torchtitan/diffusion but no top-level `diffusion`; the reference's package still gets a name
# that nothing else can hold.
DIFFUSION_PACKAGE = "reference_dit_diffusion"
VAE_DOWNSAMPLE = 8  # the reference's latent_size = image_size // 8


def load_reference_diffusion(folder: Path) -> ModuleType:
    """The reference's `diffusion` package from `folder`, imported as `DIFFUSION_PACKAGE`.

    Its modules import each other relatively (`from .respace import ...`), which resolves through `sys.modules`
    under the package's name: no folder goes on `sys.path`.

    Raises:
        FileNotFoundError: `folder` holds no diffusion/__init__.py.
    """
    init = Path(folder) / "diffusion" / "__init__.py"
    if not init.is_file():
        raise FileNotFoundError(init)
    for name in [n for n in sys.modules if n == DIFFUSION_PACKAGE or n.startswith(DIFFUSION_PACKAGE + ".")]:
        del sys.modules[name]  # an earlier load, maybe of another folder, would otherwise serve its submodules
    spec = importlib.util.spec_from_file_location(
        DIFFUSION_PACKAGE, init, submodule_search_locations=[str(init.parent)]
    )
    package = importlib.util.module_from_spec(spec)
    sys.modules[DIFFUSION_PACKAGE] = package
    spec.loader.exec_module(package)
    return package


@torch.no_grad()
def update_ema(ema_model: nn.Module, model: nn.Module, decay: float = 0.9999) -> None:
    """The reference's update_ema (its train.py), unchanged: one in-place update per parameter, from Python."""
    ema_params = OrderedDict(ema_model.named_parameters())
    model_params = OrderedDict(model.named_parameters())
    for name, param in model_params.items():
        ema_params[name].mul_(decay).add_(param.data, alpha=1 - decay)


@dataclass
class ReferenceRun:
    """What the reference's training loop holds: the DDP-wrapped (maybe compiled) model, the plain model under
    it, its EMA copy, AdamW and the diffusion."""

    model: nn.Module
    plain: nn.Module
    ema: nn.Module
    optimizer: torch.optim.Optimizer
    diffusion: object


def build_reference_run(reference: ModuleType, diffusion: ModuleType, model_name: str, latent_size: int,
                        device: torch.device, compile_model: bool,
                        compile_order: str = "before-ddp") -> ReferenceRun:  # fmt: skip
    """The reference's setup (its train.py, in its order), with the model compiled before or after DDP
    (`compile_order`) when `compile_model`.

    Needs the process group (`distributed()`).
    """
    plain = reference.DiT_models[model_name](input_size=latent_size, num_classes=NUM_CLASSES)
    ema = copy.deepcopy(plain).to(device).requires_grad_(False)
    plain.to(device)
    device_ids = [device.index] if device.type == "cuda" else None
    if compile_model and compile_order == "after-ddp":
        model = torch.compile(DDP(plain, device_ids=device_ids))
    else:
        model = DDP(torch.compile(plain) if compile_model else plain, device_ids=device_ids)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0)
    # DDP gave every rank rank 0's weights; each rank's EMA copy was taken before, from its own seed.
    update_ema(ema, plain, decay=0)
    model.train()  # class dropout on, as in training
    ema.eval()
    return ReferenceRun(model, plain, ema, optimizer, diffusion.create_diffusion(timestep_respacing=""))


def train_step(run: ReferenceRun, x: torch.Tensor, y: torch.Tensor, autocast: bool) -> torch.Tensor:
    """The reference's step on latents `x` (B, C, H, W) and labels `y` (B,); returns the mean loss (detached, on
    the device: no sync here)."""
    t = torch.randint(0, run.diffusion.num_timesteps, (x.shape[0],), device=x.device)
    with torch.autocast(x.device.type, torch.bfloat16, enabled=autocast):
        loss = run.diffusion.training_losses(run.model, x, t, dict(y=y))["loss"].mean()
    run.optimizer.zero_grad()
    loss.backward()
    run.optimizer.step()
    update_ema(run.ema, run.plain)
    return loss.detach()


def random_latents(batch: int, channels: int, size: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Latents (B, C, size, size) and class labels (B,), drawn on the device (no host copy to time)."""
    x = torch.randn(batch, channels, size, size, device=device)
    return x, torch.randint(0, NUM_CLASSES, (batch,), device=device)


@contextlib.contextmanager
def distributed(device: torch.device):
    """This process in torchrun's process group, or in a world of one; the group is left on exit."""
    init_distributed(device, int(os.environ.get("WORLD_SIZE", "1")))
    try:
        yield
        dist.barrier()  # every rank done before the group goes (an abort at exit otherwise)
    finally:
        dist.destroy_process_group()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_steps(step: Callable[[], dict[str, torch.Tensor]], warmup: int, steps: int, device: torch.device,
               flops_per_image: float, images_per_step: int, profile: bool = False) -> dict:  # fmt: skip
    """Times `step` as `torchtitan.measure.measure_steps` times ours (see the module docstring): `warmup` steps,
    then `steps` each timed to a device sync, then `steps` back to back with one sync at the end.

    Args:
        step: one training step; returns its named losses (detached, on the device: no sync inside).
        flops_per_image: our FLOP count of one training image, for TFLOP/s and MFU.
        images_per_step: images of one step over all ranks.
        profile: then profile 3 steps as scripts/benchmark.py does (CUDA only).

    Returns:
        The timing half of a result: rates, the timed steps' summary, `streamed_step_time_s`, `warmup_s`, the last
        step's losses (this rank's), `gflop_per_image`, the peak memory over the timed steps and, on CUDA, the device.
    """
    start = time.perf_counter()
    for _ in range(warmup):
        step()
    _sync(device)
    warmup_s = time.perf_counter() - start
    meter = ThroughputMeter(device, flops_per_image, images_per_step, dist.get_world_size())  # resets the peak memory
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        losses = step()
        _sync(device)
        times.append(time.perf_counter() - start)
    summary = warm_summary(times)
    start = time.perf_counter()  # back to back, as training runs them: the host may queue ahead of the GPU
    for _ in range(steps):
        losses = step()
    _sync(device)
    streamed_s = (time.perf_counter() - start) / steps
    result = {**meter.rates(summary["step_time_s"]), **summary, "streamed_step_time_s": streamed_s,
              "warmup_s": warmup_s, **{name: value.item() for name, value in losses.items()},
              "gflop_per_image": meter.flops_per_sample / 1e9, **peak_memory_gib(device)}  # fmt: skip
    if device.type == "cuda":
        result["device"] = torch.cuda.get_device_name(device)
    if profile and device.type == "cuda":
        from torchtitan.measure import print_profile

        print_profile(SimpleNamespace(train_step=step, device=device))  # it needs only these two of a Trainer
    return result


def measure(args: argparse.Namespace, reference: ModuleType, diffusion: ModuleType, device: torch.device) -> dict:
    """Builds the reference's training and times its step (see the module docstring)."""
    world_size = dist.get_world_size()
    torch.manual_seed(args.seed * world_size + dist.get_rank())  # the reference's seed per rank
    latent_size = args.image_size // VAE_DOWNSAMPLE
    run = build_reference_run(reference, diffusion, args.model, latent_size, device, args.compile, args.compile_order)
    autocast = args.autocast and device.type == "cuda"

    def step() -> dict[str, torch.Tensor]:
        x, y = random_latents(args.batch, run.plain.in_channels, latent_size, device)
        return {"loss": train_step(run, x, y, autocast)}  # this rank's mean

    head = {"name": args.name, "status": "ok", "model": args.model, "image_size": args.image_size,
            "latent_size": latent_size, "in_channels": run.plain.in_channels, "batch": args.batch,
            "world_size": world_size, "global_batch": args.batch * world_size, "compile": args.compile,
            "compile_order": args.compile_order if args.compile else None, "autocast": autocast}  # fmt: skip
    flops = flops_per_image(reference_args(run.plain, latent_size))
    return {**head, **time_steps(step, args.warmup, args.steps, device, flops, args.batch * world_size, args.profile)}


def measure_and_report(args: argparse.Namespace, measure_rank: Callable[[], dict], device: torch.device) -> int:
    """Runs `measure_rank` on every rank of the process group (or a world of one); rank 0 prints the
    `MEASURE_RESULT` line and the table, and writes `args.json_out`. An out-of-memory error is a result ("OOM"),
    not a crash.

    Returns:
        The exit status: 0 when measured, 1 otherwise.
    """
    with distributed(device):
        try:
            result = measure_rank()
        except torch.OutOfMemoryError:
            result = {"name": args.name, "status": "OOM", "batch": args.batch,
                      "global_batch": args.batch * dist.get_world_size()}  # fmt: skip
        rank = dist.get_rank()
    if rank == 0:
        print(RESULT_PREFIX + json.dumps(result), flush=True)
        print(result_table([result]), flush=True)
        if args.json_out:
            args.json_out.write_text(json.dumps(result) + "\n")
    return 0 if result["status"] == "ok" else 1


def add_measure_args(parser: argparse.ArgumentParser, name: str) -> None:
    """The options every reference harness shares: steps before and of timing, the profile, the result's file, the
    case's name and the reference's global seed."""
    parser.add_argument("--warmup", type=int, default=3, help="steps before timing (compilation)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps")
    parser.add_argument("--profile", action="store_true", help="then profile 3 steps as scripts/benchmark.py does "
                        "(CUDA): the top kernels, the GPU's waits, the host's ops")  # fmt: skip
    parser.add_argument("--json-out", type=Path, help="also write the result to this file (rank 0)")
    parser.add_argument("--name", default=name, help="the case's name in the table")
    parser.add_argument("--seed", type=int, default=0, help="the reference's global seed")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reference-dit", type=Path, required=True,
                        help="a facebookresearch/DiT checkout (its models.py and diffusion/)")  # fmt: skip
    parser.add_argument("--model", default="DiT-XL/2", help="a key of the reference's DiT_models")
    parser.add_argument("--image-size", type=int, default=256, help="pixels; the latents are image_size // 8")
    parser.add_argument("--batch", type=int, default=32, help="latents per rank (per GPU)")
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True,
                        help="torch.compile the model")  # fmt: skip
    parser.add_argument("--compile-order", choices=["before-ddp", "after-ddp"], default="before-ddp",
                        help="DDP(compile(model)) or compile(DDP(model))")  # fmt: skip
    parser.add_argument("--autocast", action=argparse.BooleanOptionalAction, default=True,
                        help="bf16 autocast over the forward and the loss (CUDA)")  # fmt: skip
    add_measure_args(parser, "reference_dit")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        reference = load_reference(args.reference_dit)
        diffusion = load_reference_diffusion(args.reference_dit)
    except (FileNotFoundError, ImportError) as e:
        print(reference_load_error(args.reference_dit, e), file=sys.stderr)
        return 2
    if args.model not in reference.DiT_models:
        print(f"error: --model {args.model!r} is not in the reference's DiT_models: {sorted(reference.DiT_models)}",
              file=sys.stderr)  # fmt: skip
        return 2
    # As the reference's train.py: TF32 matmuls and convolutions (whatever autocast leaves in fp32).
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    device = get_device()
    return measure_and_report(args, lambda: measure(args, reference, diffusion, device), device)


if __name__ == "__main__":
    sys.exit(main())
