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
their labels as `arr_1`, the format of ADM's evaluation suite (plus `settings`, what they were sampled with).
Labels cycle through the classes (`--classes`, or all of them: an exactly balanced set;
`torchtitan.diffusion.labels_for`, as the FID while training). Sample i's noise, its starting noise and any step
noise of a stochastic sampler, comes from a generator seeded by (seed, i) alone (`torchtitan.diffusion.sample_noise`),
so 1, 2 or 4 ranks and any `--batch-size` give the same images (on a GPU, to the rounding of other batch shapes).

The samples go in shards of `--shard-size` (OUT.shards/shard-0000k.npz, each written whole or not at all, each
recording the settings it was sampled with); under torchrun rank r samples shards r, r + world, ... A killed run
(a job's time limit) continues when the same command runs again, on any number of ranks: finished shards are kept,
the rest sampled, and the file is the one an uninterrupted run writes. A run whose settings differ from a shard's
(checkpoint, seed, sampler, steps, guidance, classes, precision, ...: every flag but --batch-size, --compile and
--decode-batch-size) is refused with one `error:` line naming the file and the flag. Rank 0 then streams the shards
into OUT and removes them; an existing OUT is never overwritten (with the same settings the command does nothing).

FID-50K on 4 GPUs, then ADM's five numbers (docs/latent.md):

    torchrun --nproc_per_node=4 sample.py --checkpoint RUN --num-samples 50000 --sampler heun --steps 25 \
        --cfg-scale 1.5 --compile --npz samples.npz && \
    python scripts/evaluate_fid.py --samples samples.npz --reference VIRTUAL_imagenet256_labeled.npz \
        --inception-weights pt_inception-2015-12-05-6726825d.pth
"""

import argparse
import datetime
import json
import math
import os
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from torchtitan.config_manager import JobConfig
from torchtitan.config_validation import value_problem
from torchtitan.diffusion import (
    build_diffusion,
    check_sampler,
    labels_for,
    sample_images,
    sample_noise,
    sampler_options,
)
from torchtitan.models.dit.weights import load_model, resolve_checkpoint
from torchtitan.tools.images import save_image_grid, to_uint8_nhwc
from torchtitan.tools.logging import init_logger, logger
from torchtitan.tools.sample_shards import ShardedSamples

# Flags each --npz shard does not record (`sampling_settings`): how fast samples come, which a resumed run may change,
# where they go, and --checkpoint, recorded as the weights it resolves to.
UNRECORDED_FLAGS = ("batch_size", "compile", "decode_batch_size", "npz", "out", "checkpoint")

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
        self.precision = resolve_precision(args.precision, cfg, device)
        self.decode_batch_size = args.decode_batch_size
        if cfg.latent.tokenizer:
            from torchtitan.datasets.tokenizers import load_training_decoder

            # Before any sampling: a tokenizer other than the prepared latents' is refused now, not after a batch.
            load_training_decoder(cfg, device)

    @torch.no_grad()
    def batch(self, indices: list[int] | range, labels: torch.Tensor | None) -> torch.Tensor:
        """Samples `indices` of the run: each sample's noise its own (`sample_noise`), whatever its batch or rank."""
        a = self.model_args
        noise, generator = sample_noise(self.seed, indices, a.in_channels, a.input_size)
        noise = noise.to(self.device)
        y = labels.to(self.device) if labels is not None else None
        latent = bool(self.cfg.latent.tokenizer)
        with torch.autocast(self.device.type, torch.bfloat16, enabled=self.precision == "bf16"):
            x = sample_images(self.diffusion, self.model, noise, y, self.steps, self.sampler, self.cfg_scale,
                              a.num_classes, clip_denoised=not latent,
                              guidance_channels=self.guidance_channels, generator=generator,
                              **self.options)  # fmt: skip
        if latent:
            from torchtitan.datasets.tokenizers import decode_for_training

            x = decode_for_training(self.cfg, x, self.decode_batch_size)
        return x.float().clamp(-1, 1)


def resolve_precision(flag: str, cfg: JobConfig, device: torch.device) -> str:
    """--precision auto: bf16 autocast on a GPU when the run trained in bf16 (training.mixed_precision_param; a
    .pt's config has the default, bfloat16), fp32 otherwise."""
    if flag != "auto":
        return flag
    trained_bf16 = cfg.training.mixed_precision_param == "bfloat16"
    return "bf16" if device.type == "cuda" and trained_bf16 else "fp32"


def write_grid(sampler: Sampler, args, classes: list[int]) -> Path:
    labels = labels_for(args.num_samples, classes, sampler.model_args.num_classes)
    images = []
    for start in range(0, args.num_samples, args.batch_size):
        indices = range(start, min(start + args.batch_size, args.num_samples))
        images.append(sampler.batch(indices, labels[start : indices.stop] if labels is not None else None).cpu())
    columns = len(classes) or sampler.model_args.num_classes
    nrow = columns if columns and args.num_samples % columns == 0 else 0  # one class per column
    return save_image_grid(torch.cat(images), Path(args.out), nrow)


def sampling_settings(args: argparse.Namespace, weights: Path, sampler: Sampler) -> dict:
    """What the samples are a function of, as each shard records it: every flag but UNRECORDED_FLAGS, with the values
    the sampler resolved for those left to the run's [sampling] (a flag left out and the same value given are one
    setting), the weights (path, and size and modification time of a file: a re-exported ema.safetensors is other
    weights) and the precision."""
    settings = {f"--{k.replace('_', '-')}": v for k, v in sorted(vars(args).items())
                if k not in UNRECORDED_FLAGS and k not in SAMPLING_FLAGS}  # fmt: skip
    settings |= {"--steps": sampler.steps, "--sampler": sampler.sampler, "--cfg-scale": sampler.cfg_scale,
                 "--guidance-channels": sampler.guidance_channels}  # fmt: skip
    options = dict(sampler.options)
    if options.get("sde") is not None:
        options["sde"] = asdict(options["sde"])
    settings["sampler_options"] = json.loads(json.dumps(options))
    precision = sampler.precision
    settings["weights"] = str(weights.resolve())
    if weights.is_file():
        stat = weights.stat()
        settings["weights_bytes_mtime_ns"] = [stat.st_size, stat.st_mtime_ns]
    settings["precision"] = precision
    return settings


def sample_shards(sampler: Sampler, shards: ShardedSamples, pending: list[int], labels: torch.Tensor | None,
                  batch_size: int, progress: bool) -> None:  # fmt: skip
    """Samples the shards `pending`, in order, writing each once its last sample is done. Batches run across shard
    boundaries, all of `batch_size` samples (the last padded with copies of its last): one shape to compile."""
    from tqdm import tqdm

    arr_1 = (labels if labels is not None else torch.zeros(shards.num_samples, dtype=torch.int64)).numpy()
    order = [i for k in pending for i in shards.indices(k)]  # the samples, shard by shard
    images, written = [], 0  # images of the shards pending[written:], in order
    starts = range(0, len(order), batch_size)
    for n, start in enumerate(tqdm(starts, desc="sampling", disable=not progress)):
        batch = order[start : start + batch_size]
        padded = batch + batch[-1:] * (batch_size - len(batch))
        x = sampler.batch(padded, labels[padded] if labels is not None else None)
        images.extend(to_uint8_nhwc(x[: len(batch)]))  # on the host: the batch is done
        if n == 0:
            first_done = time.perf_counter()  # the first batch holds compilation and warm-up
        while written < len(pending) and len(images) >= len(shards.indices(pending[written])):
            size = len(shards.indices(pending[written]))
            shards.write(pending[written], np.stack(images[:size]), arr_1[shards.indices(pending[written])])
            images, written = images[size:], written + 1
    if len(starts) > 1:  # this rank's rate once warm, images through the decoder to uint8
        count, seconds = len(order) - batch_size, time.perf_counter() - first_done
        logger.info(f"sampling: {count} images after the first batch in {seconds:.2f} s: "
                    f"{count / seconds:.2f} images/s")  # fmt: skip


def write_npz(sampler: Sampler, args, classes: list[int], rank: int, world: int, weights: Path) -> Path | None:
    """Samples the shards of `--npz` this rank owns (shard k: rank k % world) that are not written yet, then rank 0
    assembles the file (torchtitan/tools/sample_shards.py)."""
    shards = ShardedSamples(Path(args.npz), args.num_samples, args.shard_size,
                            sampling_settings(args, weights, sampler))  # fmt: skip
    if shards.assembled():
        shards.remove_leftovers()
        logger.info(f"{shards.out} already holds these samples")
        return shards.out if rank == 0 else None
    labels = labels_for(args.num_samples, classes, sampler.model_args.num_classes)
    done = shards.done()
    if done and rank == 0:
        logger.info(f"resuming: {len(done)} of {shards.num_shards} shards in {shards.folder} are done")
    pending = [k for k in range(rank, shards.num_shards, world) if k not in done]
    batch_size = min(args.batch_size, args.num_samples)  # the same on every rank: one shape to compile
    sample_shards(sampler, shards, pending, labels, batch_size, progress=rank == 0)
    if dist.is_initialized():
        dist.barrier()  # every shard is written
    return shards.assemble() if rank == 0 else None


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
    parser.add_argument("--batch-size", type=int, default=256, help="samples a batch, a rank (guidance doubles it)")
    parser.add_argument("--compile", action="store_true",
                        help="torch.compile the model (pays off over many batches: 50,000 FID samples)")  # fmt: skip
    parser.add_argument("--precision", default="auto", choices=("auto", "bf16", "fp32"),
                        help="the model under bf16 autocast or in fp32 (auto: bf16 on a GPU when the run trained in "
                             "bf16, training.mixed_precision_param)")  # fmt: skip
    parser.add_argument("--decode-batch-size", type=int, default=64,
                        help="latents a decoder call (bf16 on a GPU)")  # fmt: skip
    parser.add_argument("--shard-size", type=int, default=500,
                        help="--npz: samples a shard; a killed run resumes from its whole shards")  # fmt: skip
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
    for flag in ("num_samples", "batch_size", "steps", "decode_batch_size", "shard_size"):
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
        # One barrier, after each rank's shards: the ranks' shares may end minutes apart (a resumed run's above all).
        dist.init_process_group("gloo", timeout=datetime.timedelta(hours=6))
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
        if args.npz:
            path = write_npz(sampler, args, classes, rank, world, weights)
        else:
            path = write_grid(sampler, args, classes)
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
