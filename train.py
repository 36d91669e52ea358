"""TorchDiTan trainer: build everything from the config, then loop over train_step().

torchrun --nproc_per_node=N train.py --job.config_file train_configs/X.toml [--section.key value ...]
"""

import contextlib
import gc
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.attention import SDPBackend, sdpa_kernel

from torchtitan.components.checkpoint import (
    CheckpointLoadError,
    CheckpointManager,
    CheckpointSaveError,
    NonFiniteStateError,
)
from torchtitan.components.ema import EMA
from torchtitan.components.lr_scheduler import build_lr_scheduler
from torchtitan.components.metrics import MetricsLogger, ThroughputMeter
from torchtitan.components.optimizer import apply_configured_hyperparameters, build_optimizer
from torchtitan.components.profiling import Profiler
from torchtitan.components.run_lock import RunFolderLockedError, acquire_run_lock
from torchtitan.config_manager import ConfigError, JobConfig, check_batch_sizes, parse_args, to_toml
from torchtitan.config_validation import at
from torchtitan.datasets import build_dataloader
from torchtitan.diffusion import build_diffusion, sample_images
from torchtitan.dp.training import PrivateTraining, check_dp_config
from torchtitan.parallelisms.parallel_dims import ParallelDims
from torchtitan.parallelisms.utils import full_tensor_random_init, torch_dtype
from torchtitan.tools.batch_size_finder import resolve_local_batch_size
from torchtitan.tools.images import save_image_grid
from torchtitan.tools.logging import init_logger, logger
from torchtitan.tools.memory_breakdown import build_memory_breakdown
from torchtitan.tools.utils import (
    GarbageCollection,
    get_device,
    rank0_error,
    set_determinism,
    settle_sdpa_priority,
)
from torchtitan.train_spec import build_model_args, get_train_spec

SDPA_BACKENDS = {
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "math": SDPBackend.MATH,
}


def init_distributed(device: torch.device, world_size: int) -> None:
    """Joins the process group (torchrun's env); a single process gets a 1-rank group of its own."""
    if dist.is_initialized():
        return
    backend = "nccl" if device.type == "cuda" else "gloo"
    if world_size == 1 and "MASTER_ADDR" not in os.environ:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    else:
        dist.init_process_group(backend)


class NonFiniteStepError(RuntimeError):
    """A step's loss or gradient norm is NaN or inf; the run stops before applying it."""


class Trainer:
    """Holds what the loop needs; `__init__` builds it all in a fixed order."""

    def __init__(self, job_config: JobConfig):
        self.job_config = cfg = job_config
        self.device = get_device()
        self.world_size = int(os.environ.get("WORLD_SIZE", "1"))
        self.rank = int(os.environ.get("RANK", "0"))
        p = cfg.parallelism
        self.parallel_dims = ParallelDims(p.data_parallel_replicate_degree, p.data_parallel_shard_degree,
                                          self.world_size, p.fsdp_single_device)  # fmt: skip
        if self.parallel_dims.fsdp_enabled or self.world_size > 1:
            init_distributed(self.device, self.world_size)
        self.parallel_dims.build_mesh(self.device.type)
        self.dp_rank, self.dp_degree = self.parallel_dims.dp_rank(), self.parallel_dims.dp_degree
        # "auto" becomes a number before the model and data exist (one process: fresh-process probes).
        cfg.training.local_batch_size = resolve_local_batch_size(cfg, self.world_size, self.dp_degree,
                                                                 self.device.type)  # fmt: skip
        self.grad_accum_steps = check_batch_sizes(cfg, self.dp_degree)
        dp_refusal = check_dp_config(cfg)
        if dp_refusal is None and cfg.dp.enable and cfg.dp.sampling == "poisson" and self.grad_accum_steps > 1:
            dp_refusal = (f"{at(cfg, 'dp.sampling')} draws one batch per step: no gradient accumulation "
                          f"({at(cfg, 'training.global_batch_size')})")  # fmt: skip
        if dp_refusal:
            raise ConfigError(dp_refusal)
        self.global_batch = cfg.training.local_batch_size * self.dp_degree * self.grad_accum_steps
        self.dump_folder = Path(cfg.job.dump_folder)
        self.run_lock = acquire_run_lock(self.dump_folder, self.rank)  # before anything reads or writes the folder
        if self.device.type == "cpu" and cfg.training.mixed_precision_param != "float32":
            cfg.training.mixed_precision_param = "float32"  # bf16 matmuls on CPU are slow and not what GPUs do
            logger.info("CPU run: training.mixed_precision_param set to float32")
        set_determinism(cfg.debug.seed, cfg.debug.deterministic)
        self.gc = GarbageCollection(cfg.training.gc_freq)

        self.augmult = cfg.dp.augmult if cfg.dp.enable else 1
        self.train_spec = get_train_spec(cfg.model.name)
        self.model_args = build_model_args(self.train_spec, cfg.model)
        self.model = self.build_model()
        self.diffusion = build_diffusion(cfg.diffusion, self.model_args.learn_sigma)
        poisson_steps = cfg.training.steps if cfg.dp.enable and cfg.dp.sampling == "poisson" else 0
        self.dataloader = build_dataloader(cfg.training, self.model_args, self.dp_rank, self.dp_degree,
                                           cfg.debug.seed, poisson_steps, cfg.latent)  # fmt: skip
        self.private = None
        if cfg.dp.enable:
            self.private = PrivateTraining(cfg.dp, self.model, len(self.dataloader.dataset), self.global_batch,
                                           cfg.training.steps, self.parallel_dims.mesh, cfg.debug.seed)  # fmt: skip
        self.optimizer = build_optimizer(self.model, cfg.optimizer, self.device)
        self.lr_scheduler = build_lr_scheduler(self.optimizer, cfg.lr_scheduler, cfg.training.steps)
        self.ema = EMA(self.model, cfg.training.ema_decay, cfg.training.ema_warmup) if cfg.training.ema_decay else None
        extra = {"dp": self.private} if self.private else None
        self.checkpointer = CheckpointManager(cfg.checkpoint, self.dump_folder, self.model, self.optimizer,
                                              self.lr_scheduler, self.ema, self.dataloader, self.rank,
                                              self.world_size, extra)  # fmt: skip
        self.step = self.checkpointer.maybe_load()
        if self.step > 0:  # the config's optimizer settings win over the checkpoint's
            for change in apply_configured_hyperparameters(self.optimizer, self.lr_scheduler, cfg.optimizer):
                logger.warning(f"resumed with a changed config: {change}")
        self.latent_space = cfg.training.dataset == "latents" or self.model_args.in_channels not in (1, 3)
        if self.latent_space and cfg.sampling.freq > 0:
            self.check_sample_decoder()
        self.metrics = MetricsLogger(cfg, self.dump_folder, self.rank)
        # An image costs K forward/backward passes with augmult: MFU counts them, images/s counts images.
        flops = self.train_spec.flops_per_image_fn(self.model_args) * self.augmult
        self.meter = ThroughputMeter(self.device, flops, self.global_batch, self.world_size)
        self.profiler = Profiler(cfg.profiling, self.dump_folder, self.rank, self.device)
        self.breakdown = build_memory_breakdown(cfg.profiling, self.model, self.optimizer, self.device, self.ema,
                                                self.private, self.dump_folder, self.rank)  # fmt: skip
        self.autocast = self.device.type == "cuda" and not self.parallel_dims.fsdp_enabled
        self.autocast = self.autocast and cfg.training.mixed_precision_param == "bfloat16"
        settle_sdpa_priority(self.device)  # before any priority of ours: PyTorch's first call would override it
        self.sdpa_backends = [SDPA_BACKENDS[name] for name in cfg.model.sdpa_backends]
        logger.info(f"attention: SDPA backends in priority order {cfg.model.sdpa_backends}")
        self.write_config()
        logger.info(
            f"{cfg.model.flavor}: {sum(p.numel() for p in self.model.parameters()):,} parameters, "
            f"{flops / 1e9:.2f} GFLOP/image (train), {self.parallel_dims.mode} over {self.world_size} rank(s), "
            f"global batch {self.global_batch} = {cfg.training.local_batch_size} x {self.dp_degree} "
            f"x {self.grad_accum_steps} accumulation, device {self.device}"
        )

    def build_model(self) -> torch.nn.Module:
        """Meta-device build, parallelize, then materialize and init_weights() on the device (sharded)."""
        with torch.device("meta"):
            model = self.train_spec.model_cls(self.model_args)
        model = self.train_spec.parallelize_fn(model, self.parallel_dims, self.job_config)
        model.to_empty(device=self.device)
        with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []):
            torch.manual_seed(self.job_config.debug.seed)
            with full_tensor_random_init():  # the same weights as one process, whatever the layout
                model.init_weights()
        model.train()
        return model

    def check_sample_decoder(self) -> None:
        """A latent model's sample grids need the `[latent]` tokenizer: without one, samples are saved as latents
        (said now); with one, rank 0 loads its decoder and checks it against the latents now, not at the first
        grid thousands of steps in."""
        cfg = self.job_config
        if not cfg.latent.tokenizer:
            logger.warning("sampling.freq > 0 on a latent model with no [latent] tokenizer: samples are saved as "
                           "latents (samples/step-N.safetensors); set latent.tokenizer and latent.checkpoint_dir "
                           "for image grids, or decode them later with cosmos_latent_decoder.py")  # fmt: skip
            return
        error = ""
        if self.rank == 0:  # only rank 0 decodes grids
            from cosmos_latent_decoder import load_training_decoder

            try:
                load_training_decoder(cfg, self.device)
            except (FileNotFoundError, ValueError, RuntimeError) as e:
                error = f"[latent] tokenizer for the sample grids (sampling.freq = {cfg.sampling.freq}): {e}"
        if error := rank0_error(error):
            raise ConfigError(error)

    def write_config(self) -> None:
        name = self.job_config.job.save_config_file
        if self.rank == 0 and name:
            self.dump_folder.mkdir(parents=True, exist_ok=True)
            (self.dump_folder / name).write_text(to_toml(self.job_config))
        if self.job_config.job.print_config:
            logger.info("resolved config:\n" + to_toml(self.job_config))

    def step_randomness(self, step: int, micro: int, batch: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Timesteps, noise and label-drop mask of this rank's samples for one micro-batch, K = augmult
        draws per sample (its rows consecutive): (batch K,), (batch K, C, H, W), (batch K,).

        Drawn for the whole global micro-batch from a generator seeded by (seed, step), then sliced
        by rank in the sampler's interleaved order, so a sample gets the same noise whatever the
        number of ranks: 1 process and N processes at the same global batch see the same losses.
        """
        shape = (self.model_args.in_channels, self.model_args.input_size, self.model_args.input_size)
        generator = torch.Generator(self.device).manual_seed(self.job_config.debug.seed * 1_000_003 + step)
        world_micro, k = batch * self.dp_degree, self.augmult
        total = world_micro * self.grad_accum_steps
        t = self.diffusion.sample_timesteps(total * k, self.device, generator).view(total, k)
        noise = torch.randn((total, k, *shape), device=self.device, generator=generator)
        drop = torch.rand(total * k, device=self.device, generator=generator).view(total, k)
        drop = drop < self.job_config.diffusion.class_dropout_prob
        window = slice(micro * world_micro, (micro + 1) * world_micro)

        def mine(draws: torch.Tensor) -> torch.Tensor:  # this rank's samples of this micro-batch
            return draws[window][self.dp_rank :: self.dp_degree].flatten(0, 1)

        return mine(t), mine(noise), mine(drop)

    def forward_losses(self, x: torch.Tensor, y: torch.Tensor, step: int, micro: int):
        """Per-sample losses (B,), or (B, K) with dp.augmult K: each sample's K draws in rows of one forward."""
        t, noise, drop = self.step_randomness(step, micro, x.shape[0])
        if self.augmult > 1:
            x, y = x.repeat_interleave(self.augmult, 0), y.repeat_interleave(self.augmult, 0)
        if self.model_args.num_classes > 0:
            y = torch.where(drop, torch.full_like(y, self.model_args.num_classes), y)  # CFG's null class
        else:
            y = None
        with self.compute_context():
            losses, t_frac = self.diffusion.training_losses(self.model, x, y, t=t, noise=noise)
        if self.augmult > 1:
            losses = losses.view(-1, self.augmult)
        return losses, t_frac

    @contextlib.contextmanager
    def compute_context(self):
        """bf16 autocast (single device / DDP) and the attention-kernel priority, around a forward."""
        with torch.autocast(self.device.type, torch.bfloat16, enabled=self.autocast), self.attention_context():
            yield

    def attention_context(self):
        """The SDPA kernel priority. Backward needs it too: activation checkpointing recomputes attention there,
        and a recompute that picked another kernel than forward did would save different tensors (an error)."""
        return sdpa_kernel(self.sdpa_backends, set_priority=True)

    def forward_backward(self, x: torch.Tensor, y: torch.Tensor, mask: torch.Tensor | None, micro: int) -> torch.Tensor:
        """Forward and backward of one micro-batch of this rank, adding into every `p.grad`; returns the per-sample
        losses, detached ((B,); the mean of K draws with dp.augmult K)."""
        step = self.step  # the step being taken, counted from 0
        with self.breakdown.maybe_track(step):
            losses, _ = self.forward_losses(x, y, step, micro)
        self.breakdown.maybe_record("forward", step)
        with self.breakdown.maybe_track(step), self.attention_context():
            if self.private is not None:
                self.private.backward(losses, mask, last_micro_batch=micro == self.grad_accum_steps - 1)
            else:
                # Sum over this rank / global batch: the data-parallel mean (DDP/FSDP) then gives the global mean.
                (losses.sum() * self.dp_degree / self.global_batch).backward()
        self.breakdown.maybe_record("backward", step)
        return losses.detach().mean(1) if losses.dim() == 2 else losses.detach()

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """This rank's next micro-batch on the device: images, labels and the Poisson padding mask (or None)."""
        data_start = time.perf_counter()
        x, y, *mask = next(self.dataloader)  # a mask marks the padding of Poisson-sampled batches
        x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
        mask = mask[0].to(self.device) if mask else None
        self.meter.data_time += time.perf_counter() - data_start
        return x, y, mask

    def grad_norm(self) -> torch.Tensor:
        """The global L2 norm of the gradients the optimizer is about to apply (FSDP shards gathered, DDP's all-reduced
        ones as they are: every rank gets the same value)."""
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        norm = torch.nn.utils.get_total_norm(grads, foreach=True)
        return norm.full_tensor() if hasattr(norm, "full_tensor") else norm

    def train_step(self) -> dict:
        """One optimizer step over grad_accum_steps micro-batches; returns tensors for logging.

        Raises:
            NonFiniteStepError: the loss or the gradient norm is NaN or inf; the update is not applied.
        """
        loss_sum = torch.zeros((), device=self.device)
        for micro in range(self.grad_accum_steps):
            x, y, mask = self.next_batch()
            losses = self.forward_backward(x, y, mask, micro)
            loss_sum += (losses if mask is None else losses * mask).sum()
        grad_norm = self.grad_norm()
        self.check_finite(loss_sum, grad_norm)  # before anything changes the weights
        max_norm = self.job_config.training.max_norm if self.private is None else 0.0  # DP clips per sample instead
        if max_norm > 0:
            params = [p for p in self.model.parameters() if p.grad is not None]
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, grad_norm, foreach=True)
        lr = self.optimizer.param_groups[0]["lr"]  # the lr this update applies
        self.optimizer.step()
        self.breakdown.maybe_record("optimizer_step", self.step)
        self.lr_scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.breakdown.maybe_record("zero_grad", self.step)
        if getattr(self.model, "float8_fsdp_all_gather", False):
            from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

            precompute_float8_dynamic_scale_for_fsdp(self.model)  # one all-reduce for every weight's scale
        if self.ema is not None:
            self.ema.update()
        if self.private is not None:
            self.private.step_done()
        return {"loss_sum": loss_sum, "grad_norm": grad_norm, "lr": lr}

    def check_finite(self, loss_sum: torch.Tensor, grad_norm: torch.Tensor) -> None:
        """Stops the run before a non-finite update; the gradient norm is global, so every rank stops alike (a NaN
        loss anywhere makes it NaN). One sync with the GPU per step, which also bounds how far the CPU runs ahead."""
        if bool(torch.isfinite(grad_norm)) and bool(torch.isfinite(loss_sum)):
            return
        step = self.step + 1
        newest = self.checkpointer.newest_complete()
        raise NonFiniteStepError(
            f"step {step}: this rank's mean loss is {loss_sum.item() * self.dp_degree / self.global_batch:.4g} and the "
            f"gradient norm {grad_norm.item():.4g}: the run stops before applying this update"
            f"{f'; the newest checkpoint is {newest}' if newest else ''}. Lower optimizer.lr, set "
            "training.max_norm > 0, or check the data"
        )

    def logs_at(self, steps_done: int) -> bool:
        """Whether the metrics are logged once `steps_done` steps are done (every log_freq steps, and the last)."""
        return steps_done % self.job_config.metrics.log_freq == 0 or steps_done == self.job_config.training.steps

    def log(self, out: dict) -> None:
        loss_sum = out["loss_sum"].clone()
        if dist.is_initialized():
            dist.all_reduce(loss_sum, group=self.parallel_dims.dp_group())
        metrics = {"loss": loss_sum.item() / self.global_batch, "grad_norm": out["grad_norm"].item(), "lr": out["lr"]}
        metrics.update(self.meter.summary())
        if self.private is not None:
            metrics.update(self.private.metrics())
        self.metrics.log(self.step, metrics)
        self.meter.reset()

    @torch.no_grad()
    def generate_samples(self, num_samples: int, seed: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A grid's worth of samples from fixed noise and fixed classes (EMA weights if kept), and their labels."""
        args, s = self.model_args, self.job_config.sampling
        generator = torch.Generator().manual_seed(seed)
        noise = torch.randn(num_samples, args.in_channels, args.input_size, args.input_size, generator=generator)
        y = torch.arange(num_samples) % args.num_classes if args.num_classes > 0 else None
        noise, y = noise.to(self.device), (y.to(self.device) if y is not None else None)
        with self.compute_context():
            samples = sample_images(self.diffusion, self.model, noise, y, s.steps, s.sampler, s.cfg_scale,
                                    args.num_classes, clip_denoised=not self.latent_space)  # fmt: skip
        return samples, y

    def save_samples(self) -> None:
        """Writes samples/step-N.png (decoded through the tokenizer for latent models), or the latents as
        samples/step-N.safetensors when a latent model has no tokenizer. A side feature: a failure is logged as an
        error and training goes on."""
        try:
            s = self.job_config.sampling
            with self.ema.swapped_in() if self.ema is not None else contextlib.nullcontext():
                samples, labels = self.generate_samples(s.num_samples, s.seed)
            if self.rank == 0:
                self.write_samples(samples, labels)
        except Exception as e:  # noqa: BLE001 (any failure here must not end the run)
            logger.exception(f"step {self.step}: writing samples failed ({type(e).__name__}: {e}); training goes on")
            if self.device.type == "cuda":
                torch.cuda.empty_cache()

    def write_samples(self, samples: torch.Tensor, labels: torch.Tensor | None) -> None:
        folder = self.dump_folder / "samples"
        if self.latent_space and not self.job_config.latent.tokenizer:
            from safetensors.torch import save_file

            folder.mkdir(parents=True, exist_ok=True)
            tensors = {"latents": samples.float().cpu().contiguous()}
            if labels is not None:
                tensors["labels"] = labels.cpu()
            path = folder / f"step-{self.step}.safetensors"
            save_file(tensors, str(path))
            logger.info(f"wrote sampled latents {path}")
            return
        if self.latent_space:  # only rank 0 writes the grid, so only it decodes
            from cosmos_latent_decoder import decode_for_training

            samples = decode_for_training(self.job_config, samples)
        classes = self.model_args.num_classes
        nrow = classes if classes and len(samples) % classes == 0 else 0  # one class per column
        path = save_image_grid(samples, folder / f"step-{self.step}.png", nrow)
        logger.info(f"wrote samples {path}")
        self.metrics.log_image(self.step, path)

    def train(self) -> None:
        cfg = self.job_config
        if cfg.checkpoint.create_seed_checkpoint:
            if self.world_size != 1:
                raise ValueError("checkpoint.create_seed_checkpoint runs on one process (no torchrun)")
            self.checkpointer.save(0, last=True, model_only=True)
            logger.info("wrote the seed checkpoint (step 0); exiting")
            return
        logger.info(f"training from step {self.step} to {cfg.training.steps}")
        self.meter.reset()
        while self.step < cfg.training.steps:
            out = self.train_step()
            self.step += 1
            self.meter.steps += 1
            self.gc.run(self.step)
            last = self.step == cfg.training.steps
            if self.logs_at(self.step):
                self.log(out)
            if self.checkpointer.should_save(self.step, last):  # before the samples: a failing side feature
                self.checkpointer.save(self.step, last=last)  # never costs the step's checkpoint
            if cfg.sampling.freq > 0 and (self.step % cfg.sampling.freq == 0 or last):
                self.save_samples()
            self.profiler.step(self.step)
        self.checkpointer.wait()
        if cfg.checkpoint.enable:
            self.export_weights()
        logger.info("training done")

    def export_weights(self) -> None:
        """ema.safetensors at the end of training: a side feature (the checkpoints hold the same weights), so a
        failure is logged as an error and the run still ends well."""
        try:
            self.checkpointer.export_ema(self.dump_folder / "ema.safetensors", self.model_args,
                                         torch_dtype(self.job_config.checkpoint.export_dtype))  # fmt: skip
        except Exception as e:  # noqa: BLE001
            logger.exception(f"exporting ema.safetensors failed ({type(e).__name__}: {e}); the checkpoints hold "
                             "the weights")  # fmt: skip

    def close(self) -> None:
        self.profiler.close()
        self.metrics.close()
        if self.run_lock is not None:
            self.run_lock.release()
        if dist.is_initialized():
            dist.barrier()  # every rank reaches teardown before gloo/NCCL is destroyed (avoids an abort at exit)
            dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    init_logger()
    try:
        job_config = parse_args(argv)
        trainer = Trainer(job_config)
    except (ConfigError, FileNotFoundError, ValueError) as e:
        logger.error(f"config error: {e}")
        print(f"error: {e}", file=sys.stderr)
        return 2
    except (RunFolderLockedError, CheckpointLoadError) as e:
        logger.error(str(e))
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        trainer.train()
    except (NonFiniteStepError, NonFiniteStateError, CheckpointSaveError) as e:
        logger.error(str(e))
        print(f"error: {e}", file=sys.stderr)
        return 1
    except torch.OutOfMemoryError:
        trainer.profiler.dump_snapshot("oom")
        raise
    finally:
        trainer.close()
        # The trainer's modules and FSDP/DDP state form reference cycles (and GarbageCollection turned automatic
        # collection off) that hold the process groups' C++ objects: free them now, while the interpreter is whole,
        # not during its finalization, where gloo's teardown can abort the process ("terminate called").
        del trainer
        gc.collect()
    return 0


if __name__ == "__main__":
    sys.exit(main())
