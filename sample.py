"""Images from a trained checkpoint: a PNG grid, or an ADM-format .npz for FID.

    python sample.py --checkpoint outputs/RUN [--num-samples 16 --classes 1,2,3 --cfg-scale 4 --sampler ddim
                     --guidance-channels 3 --steps 50 --seed 0 --out grid.png]
    torchrun --nproc_per_node=8 sample.py --checkpoint outputs/RUN --num-samples 50000 --npz samples.npz

`--checkpoint` is a run folder (its `config.toml`; the weights of `ema.safetensors` when the run exported
them, else the newest complete DCP checkpoint under its checkpoint folder), a DCP step folder
(`RUN/checkpoint/step-N`) or an exported `.safetensors` file. From a DCP checkpoint the EMA weights are
loaded when it has them, else the live model's. A facebookresearch/DiT `.pt` file (a released state dict
or its train.py's checkpoint, whose EMA is taken) needs no run folder: `--flavor` names its shapes and
`--section.key value` config overrides adjust them (`--model.learn_sigma false`, `--model.input_size 64`)
or set the rest (`--latent.tokenizer`, ...); its fixed sin-cos positions set `model.pos_embed = "sincos"`:

    python sample.py --checkpoint DiT-XL-2-256x256.pt --flavor DiT-XL/2 [--model.KEY V ...] --out grid.png

(its outputs are the reference's SD-VAE latents: a grid needs a `--latent.*` decoder). A hustvl/LightningDiT
`.pt` (told apart by its keys) samples the same way with a LightningDiT-* flavor, in its transport's flow (t = 1 is
data: `diffusion.time_input = "1-t"`, set for it), decoded through the VA-VAE converted by scripts/convert_vavae.py
and un-normalized with its latents_stats.pt (docs/latent.md, "Reaching FID 2 sooner"):

    python sample.py --checkpoint lightningdit-xl-imagenet256-64ep.pt --flavor LightningDiT-XL/1 \
        --latent.tokenizer diffusers --latent.checkpoint_dir vavae_diffusers \
        --latent.stats_file latents_stats.pt --cfg-scale 10 --guidance-channels 3 --steps 250 --out grid.png

A REPA `.pt` (SiT with alignment projectors, told apart by its keys) takes a SiT-* `--flavor` and samples in its
SiT's flow (`diffusion.time_input = "t"`, set for it); the projectors are left out, as from every checkpoint (they
only train).

Weights load into a
plain single-process model (torchtitan/models/dit/weights.py reads every format): DCP reads every shard itself,
so no process group is needed. Latent models are
decoded through the run's `[latent]` tokenizer (its decoder alone), un-normalized with the statistics stored
beside the run's prepared data; a tokenizer other than the one those latents were encoded with is refused
before sampling (`--allow-tokenizer-mismatch` decodes anyway).
Arguments that cannot give images (`--cfg-scale nan`, `--num-samples 0`, ...) exit with code 2 and one
`error:` line naming the flag; so do a run of another model than a DiT, and a checkpoint whose pickles name
code (read through an allow-list, docs/checkpoint.md: nothing it names runs).

With `--npz`, N samples are written as `arr_0` (N, H, W, 3) uint8 (grey images repeated to RGB) and
their labels as `arr_1`, the format of ADM's evaluation suite. Under torchrun each rank generates every
world_size-th batch and rank 0 assembles them in order. Batch b's noise comes from a generator seeded by
(seed, b), so the samples do not depend on the number of ranks. Labels cycle through the classes
(`--classes`, or all of them: an exactly balanced set; `torchtitan.diffusion.labels_for`, as the FID while training).
"""

import argparse
import math
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from torchtitan.config_manager import JobConfig
from torchtitan.config_validation import value_problem
from torchtitan.diffusion import batch_noise, build_diffusion, check_sampler, labels_for, sample_images, sampler_options
from torchtitan.models.dit.weights import load_model, resolve_checkpoint
from torchtitan.tools.images import save_image_grid, to_uint8_nhwc
from torchtitan.tools.logging import init_logger, logger

# Flags that stand for the [sampling] key of the same name (over the run's config).
SAMPLING_FLAGS = ("guidance_low", "guidance_high", "timestep_shift", "sde_diffusion_form", "sde_diffusion_norm",
                  "sde_last_step", "sde_last_step_size")  # fmt: skip


class Sampler:
    """Generates batches of images from a loaded model: noise -> sampler -> (decode) -> [-1, 1]."""

    def __init__(self, cfg: JobConfig, model, model_args, device: torch.device, args: argparse.Namespace):
        self.cfg, self.model, self.model_args, self.device = cfg, model, model_args, device
        self.diffusion = build_diffusion(cfg.diffusion, model_args.learn_sigma)
        self.steps = cfg.sampling.steps if args.steps is None else args.steps
        self.sampler = args.sampler or cfg.sampling.sampler
        self.cfg_scale = cfg.sampling.cfg_scale if args.cfg_scale is None else args.cfg_scale
        self.guidance_channels = args.guidance_channels
        if self.guidance_channels is None:
            self.guidance_channels = cfg.sampling.guidance_channels
        if self.guidance_channels > model_args.in_channels:
            raise ValueError(f"--guidance-channels {self.guidance_channels}: the model has {model_args.in_channels} "
                             "channel(s)")  # fmt: skip
        given = {key: getattr(args, key, None) for key in SAMPLING_FLAGS}  # the flags over the run's [sampling]
        self.options = sampler_options(replace(cfg.sampling, **{k: v for k, v in given.items() if v is not None}))
        check_sampler(self.diffusion, self.sampler, self.steps, self.options["guidance_interval"],
                      self.options["timestep_shift"])  # fmt: skip
        self.seed = args.seed
        self.autocast = device.type == "cuda"
        if cfg.latent.tokenizer:
            from torchtitan.datasets.tokenizers import load_training_decoder

            # Before any sampling: a tokenizer other than the prepared latents' is refused now, not after a batch.
            load_training_decoder(cfg, device)

    @torch.no_grad()
    def batch(self, index: int, labels: torch.Tensor | None, size: int) -> torch.Tensor:
        """Batch `index` of the run: its own seeded noise, so it is the same on any rank."""
        a = self.model_args
        noise, generator = batch_noise(self.seed, index, size, a.in_channels, a.input_size)
        noise = noise.to(self.device)
        y = labels.to(self.device) if labels is not None else None
        latent = bool(self.cfg.latent.tokenizer)
        with torch.autocast(self.device.type, torch.bfloat16, enabled=self.autocast):
            x = sample_images(self.diffusion, self.model, noise, y, self.steps, self.sampler, self.cfg_scale,
                              a.num_classes, clip_denoised=not latent,
                              guidance_channels=self.guidance_channels, generator=generator,
                              **self.options)  # fmt: skip
        if latent:
            from torchtitan.datasets.tokenizers import decode_for_training

            x = decode_for_training(self.cfg, x)
        return x.float().clamp(-1, 1)


def write_grid(sampler: Sampler, args, classes: list[int]) -> Path:
    labels = labels_for(args.num_samples, classes, sampler.model_args.num_classes)
    images = []
    for b, start in enumerate(range(0, args.num_samples, args.batch_size)):
        size = min(args.batch_size, args.num_samples - start)
        images.append(sampler.batch(b, labels[start : start + size] if labels is not None else None, size).cpu())
    columns = len(classes) or sampler.model_args.num_classes
    nrow = columns if columns and args.num_samples % columns == 0 else 0  # one class per column
    return save_image_grid(torch.cat(images), Path(args.out), nrow)


def write_npz(sampler: Sampler, args, classes: list[int], rank: int, world: int) -> Path | None:
    """Each rank samples every world-th batch into a part file; rank 0 assembles them in order."""
    from tqdm import tqdm

    out = Path(args.npz)
    out.parent.mkdir(parents=True, exist_ok=True)
    labels = labels_for(args.num_samples, classes, sampler.model_args.num_classes)
    starts = list(range(0, args.num_samples, args.batch_size))
    parts = {}
    mine = range(rank, len(starts), world)
    for b in tqdm(mine, desc="sampling", disable=rank != 0):
        size = min(args.batch_size, args.num_samples - starts[b])
        y = labels[starts[b] : starts[b] + size] if labels is not None else None
        parts[f"batch_{b}"] = to_uint8_nhwc(sampler.batch(b, y, size))  # on the host: the batch is done
        if b == mine[0]:
            first_done = time.perf_counter()  # the first batch holds compilation and warm-up
    if len(mine) > 1:  # this rank's rate once warm, images through the decoder to uint8
        images, seconds = sum(len(parts[f"batch_{b}"]) for b in mine[1:]), time.perf_counter() - first_done
        logger.info(f"sampling: {images} images after the first batch in {seconds:.2f} s: "
                    f"{images / seconds:.2f} images/s")  # fmt: skip
    part_file = out.with_name(f"{out.name}.part{rank}.npz")
    np.savez(part_file, **parts)
    if dist.is_initialized():
        dist.barrier()
    if rank != 0:
        return None
    batches = {}
    for r in range(world):
        part = out.with_name(f"{out.name}.part{r}.npz")
        with np.load(part) as data:
            batches.update({int(k.split("_")[1]): data[k] for k in data.files})
        part.unlink()
    images = np.concatenate([batches[b] for b in range(len(starts))])
    label_array = labels.numpy() if labels is not None else np.zeros(len(images), dtype=np.int64)
    tmp = out.with_name(out.name + ".tmp")
    with open(tmp, "wb") as f:
        np.savez(f, arr_0=images, arr_1=label_array)
    os.replace(tmp, out)
    return out


def parse(argv: list[str] | None) -> argparse.Namespace:
    """The flags; `--section.key value` config overrides (for a .pt checkpoint) are left in `overrides`."""
    parser = argparse.ArgumentParser(description="Sample images from a TorchDiTan checkpoint.")
    parser.add_argument("--checkpoint", required=True,
                        help="run folder, DCP step folder, .safetensors export, facebookresearch/DiT, REPA or "
                             "LightningDiT .pt")  # fmt: skip
    parser.add_argument("--config", default="", help="config.toml (default: the run's)")
    parser.add_argument("--flavor", default="", help="a .pt checkpoint's flavor, e.g. DiT-XL/2, LightningDiT-XL/1")
    parser.add_argument("--num-samples", type=int, default=16)
    parser.add_argument("--classes", default="", help="comma-separated class indices, cycled over the samples")
    parser.add_argument("--cfg-scale", type=float, default=None, help="default: the run's sampling.cfg_scale")
    parser.add_argument("--guidance-channels", type=int, default=None,
                        help="guide the first N output channels (-1: all; 3: facebookresearch/DiT's sample.py; "
                             "default: the run's sampling.guidance_channels)")  # fmt: skip
    parser.add_argument("--sampler", default="", choices=("", "default", "ddim", "ddpm", "euler", "heun", "sde"),
                        help="default: the run's sampling.sampler")  # fmt: skip
    flow = parser.add_argument_group("rectified flow's samplers (default: the run's [sampling] key of the same name)")
    flow.add_argument("--guidance-low", type=float, help="guide only the steps starting at t >= this (1: noise)")
    flow.add_argument(
        "--guidance-high",
        type=float,
        help="... and t <= this (REPA's FIDs: 0.7; LightningDiT's cfg_interval_start s: 1 - s)",
    )
    flow.add_argument("--timestep-shift", type=float, help="the ODE's grid shift, LightningDiT's (its configs: 0.3)")
    flow.add_argument("--sde-diffusion-form", help="'sigma', 'linear' or 'decreasing' (SiT's)")
    flow.add_argument("--sde-diffusion-norm", type=float, help="the SDE's diffusion scale (SiT's)")
    flow.add_argument("--sde-last-step", help="'mean', 'tweedie' or 'euler' (SiT's)")
    flow.add_argument("--sde-last-step-size", type=float, help="where the SDE's last step starts (0.04)")
    parser.add_argument("--steps", type=int, default=None, help="sampler steps (default: the run's sampling.steps)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--compile", action="store_true",
                        help="torch.compile the model (pays off over many batches: 50,000 FID samples)")  # fmt: skip
    parser.add_argument("--out", default="samples.png", help="PNG grid")
    parser.add_argument("--npz", default="", help="write an ADM-format .npz of all samples instead of a grid")
    parser.add_argument("--tokenizer-dir", default="", help="override latent.checkpoint_dir")
    parser.add_argument("--latent-stats", default="", help="override the prepared folder holding meta.json")
    parser.add_argument(
        "--allow-tokenizer-mismatch",
        action="store_true",
        help="decode even if meta.json records another tokenizer (latent.allow_tokenizer_mismatch)",
    )
    args, rest = parser.parse_known_args(argv)
    # Config overrides look like train.py's (--model.learn_sigma false); anything else is a mistyped flag.
    flags = [arg for arg in rest if arg.startswith("-")]
    unknown = [arg for arg in flags if not (arg.startswith("--") and "." in arg.partition("=")[0])]
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    args.overrides = rest
    return args


def parse_classes(text: str) -> list[int]:
    """`--classes "1,2,3"` -> [1, 2, 3]; raises naming the flag."""
    try:
        return [int(c) for c in text.split(",") if c.strip()]
    except ValueError:
        raise ValueError(f"--classes {text!r}: must be comma-separated class indices, e.g. 1,2,3") from None


def check_args(args: argparse.Namespace) -> None:
    """Raises ValueError naming the flag of an argument that cannot give images (a NaN guidance scale gives a
    black grid, zero samples an empty one)."""
    for flag in ("num_samples", "batch_size", "steps"):
        value = getattr(args, flag)
        if value is not None and value <= 0:
            raise ValueError(f"--{flag.replace('_', '-')} {value}: must be > 0")
    if args.cfg_scale is not None and not math.isfinite(args.cfg_scale):
        raise ValueError(f"--cfg-scale {args.cfg_scale}: must be a finite number (1: no guidance)")
    if args.guidance_channels is not None and not (args.guidance_channels == -1 or args.guidance_channels >= 1):
        raise ValueError(f"--guidance-channels {args.guidance_channels}: must be -1 (all) or >= 1")
    for key in SAMPLING_FLAGS:  # checked as the config's keys are
        value = getattr(args, key)
        if value is not None and (problem := value_problem(f"sampling.{key}", value)):
            raise ValueError(f"--{key.replace('_', '-')} {value}: {problem}")


def main(argv: list[str] | None = None) -> int:
    init_logger()
    args = parse(argv)
    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    try:
        check_args(args)
        classes = parse_classes(args.classes)
        if world > 1 and not args.npz:
            raise ValueError(f"{world} ranks write one grid: several ranks only make sense with --npz")
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if world > 1:
        dist.init_process_group("gloo")  # barriers only; samples travel through part files
    device = torch.device("cpu")
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    try:
        cfg, weights = resolve_checkpoint(Path(args.checkpoint), args.config, args.flavor, args.overrides)
        cfg.latent.checkpoint_dir = args.tokenizer_dir or cfg.latent.checkpoint_dir
        cfg.training.dataset_path = args.latent_stats or cfg.training.dataset_path
        cfg.latent.allow_tokenizer_mismatch = args.allow_tokenizer_mismatch or cfg.latent.allow_tokenizer_mismatch
        model, model_args = load_model(cfg, weights, device)
        if args.compile:
            model = torch.compile(model)
        sampler = Sampler(cfg, model, model_args, device, args)
        path = write_npz(sampler, args, classes, rank, world) if args.npz else write_grid(sampler, args, classes)
    except (FileNotFoundError, ValueError, RuntimeError) as e:  # RuntimeError: a tokenizer file, named
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    if path is not None:
        logger.info(f"wrote {args.num_samples} samples to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
