"""The Trainer: builds everything from a JobConfig in a fixed order, and takes training steps.

`forward_backward(batch)` is one micro-batch's forward and backward; `train_step()` one optimizer step over the
micro-batches; `train()` the loop (logging, checkpoints, samples). train.py, scripts/benchmark.py
(`torchtitan.measure`), the memory breakdown and the max-batch finder all drive this one step.

Observers see the step's stages (the memory breakdown is one): each has `track(step)`, a context around forward
and backward, and `stage(name, step)`, called after "forward", "backward", "optimizer_step" and "zero_grad"; steps
count from 1, as the metrics log them.
"""

import contextlib
import math
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.attention import SDPBackend, sdpa_kernel

from torchtitan.components.checkpoint import CheckpointManager
from torchtitan.components.ema import EMA
from torchtitan.components.lr_scheduler import build_lr_scheduler
from torchtitan.components.metrics import MetricsLogger, ThroughputMeter
from torchtitan.components.optimizer import apply_configured_hyperparameters, build_optimizer
from torchtitan.components.profiling import Profiler
from torchtitan.components.run_lock import acquire_run_lock
from torchtitan.components.sampling import SampleWriter
from torchtitan.components.step_guard import NonFiniteGuard
from torchtitan.components.validation import FIDValidator
from torchtitan.components.validation_loss import HeldOutLoss
from torchtitan.config_manager import JobConfig, check_batch_sizes, to_toml
from torchtitan.config_validation import validate_layout
from torchtitan.datasets.prefetch import DevicePrefetcher, batch_to_device
from torchtitan.datasets.record import DataRecord, data_record
from torchtitan.dp.training import DP_CHECKPOINT_WITHOUT_DP, PrivateTraining, resuming_without_privacy
from torchtitan.errors import ConfigError, at
from torchtitan.parallelisms.parallel_dims import ParallelDims
from torchtitan.parallelisms.utils import full_tensor_random_init, torch_dtype
from torchtitan.protocols import BatchLayout
from torchtitan.tools.batch_size_finder import resolve_local_batch_size
from torchtitan.tools.logging import logger
from torchtitan.tools.memory_estimate import check_memory
from torchtitan.tools.utils import GarbageCollection, get_device, set_determinism, settle_sdpa_priority
from torchtitan.train_spec import build_model_args, get_train_spec

SDPA_BACKENDS = {
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "math": SDPBackend.MATH,
}
STAGES = ("forward", "backward", "optimizer_step", "zero_grad")


def init_distributed(device: torch.device, world_size: int) -> None:
    """Joins the process group (torchrun's env); a single process gets a 1-rank group of its own."""
    if dist.is_initialized():
        return
    backend = "nccl" if device.type == "cuda" else "gloo"
    if world_size == 1 and "MASTER_ADDR" not in os.environ:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    else:
        dist.init_process_group(backend)


class Trainer:
    """Holds what the loop needs; `__init__` builds it all in a fixed order."""

    def __init__(self, job_config: JobConfig):
        self.job_config = cfg = job_config
        self.device = get_device()
        self.world_size = int(os.environ.get("WORLD_SIZE", "1"))
        self.rank = int(os.environ.get("RANK", "0"))
        self._build_layout()
        self.dump_folder = Path(cfg.job.dump_folder)
        self.run_lock = acquire_run_lock(self.dump_folder, self.rank)  # before anything reads or writes the folder
        if self.device.type == "cpu" and cfg.training.mixed_precision_param != "float32":
            cfg.training.mixed_precision_param = "float32"  # bf16 matmuls on CPU are slow and not what GPUs do
            logger.info("CPU run: training.mixed_precision_param set to float32")
        set_determinism(cfg.debug.seed, cfg.debug.deterministic)
        self.gc = GarbageCollection(cfg.training.gc_freq)
        self.augmult = cfg.dp.augmult if cfg.dp.enable else 1
        self.train_spec = get_train_spec(cfg.model.name)
        self.model_args = build_model_args(self.train_spec, cfg)
        check_memory(cfg, self.model_args, self.world_size, self.device)  # a CPU too small kills without a word
        self.model = self.build_model()
        layout = BatchLayout(self.dp_rank, self.dp_degree, self.grad_accum_steps, self.augmult, cfg.debug.seed,
                             self.device)  # fmt: skip
        self.objective = self.train_spec.build_objective_fn(cfg, self.model_args, layout)
        if cfg.compile.enable and "loss" in cfg.compile.components:
            self.objective.compile_loss()
        self.loss_bins = getattr(self.objective, "loss_by_timestep", None)  # diffusion: loss/t_bin_k, as minRF
        self.alignment_loss = getattr(self.objective, "alignment_loss", None)  # REPA's: loss/alignment
        poisson_steps = cfg.training.steps if cfg.dp.enable and cfg.dp.sampling == "poisson" else 0
        self.dataloader = DevicePrefetcher(self.build_dataloader(poisson_steps, "train"), self.device)
        held_out = cfg.validation.enable and self.train_spec.has_validation_split  # else a DiT's FID (below)
        self.validation_loader = self.build_dataloader(0, "validation") if held_out else None
        self._validation_logged = False  # the pass's size is logged once: it is the same every time
        self.private = None
        if cfg.dp.enable:
            self.private = PrivateTraining(cfg.dp, self.model, len(self.dataloader.dataset), self.global_batch,
                                           cfg.training.steps, self.parallel_dims.mesh, cfg.debug.seed,
                                           seq_len=getattr(self.dataloader.dataset, "seq_len", 0))  # fmt: skip
        self._build_training_state()
        # After the checkpoint load: records an earlier run logged past the step this one starts from are dropped.
        self.metrics = MetricsLogger(cfg, self.dump_folder, self.rank, start_step=self.step)
        self.samples = None  # image grids during training: for the diffusion objectives
        if getattr(self.objective, "diffusion", None) is not None:
            self.samples = SampleWriter(cfg, self.model_args, self.objective.diffusion, self.device, self.rank,
                                        self.dump_folder, self.metrics)  # fmt: skip
            self.samples.check()
        self.fid, self.held_out_loss = self._build_dit_validation()
        # A sample costs K forward/backward passes with augmult: MFU counts them, images/s counts images.
        flops = self.train_spec.flops_per_sample_fn(self.model_args, cfg) * self.augmult
        self.meter = ThroughputMeter(self.device, flops, self.global_batch, self.world_size,
                                     self.objective.tokens_per_sample)  # fmt: skip
        self.profiler = Profiler(cfg.profiling, self.dump_folder, self.rank, self.device)
        self.observers = []
        if cfg.profiling.enable_memory_breakdown:
            from torchtitan.tools.memory_breakdown import MemoryBreakdownObserver

            self.observers.append(MemoryBreakdownObserver.for_trainer(self, cfg.profiling.memory_breakdown_steps))
        self.autocast = self.device.type == "cuda" and not self.parallel_dims.fsdp_enabled
        self.autocast = self.autocast and cfg.training.mixed_precision_param == "bfloat16"
        settle_sdpa_priority(self.device)  # before any priority of ours: PyTorch's first call would override it
        self.sdpa_backends = [SDPA_BACKENDS[name] for name in cfg.model.sdpa_backends]
        logger.info(f"attention: SDPA backends in priority order {cfg.model.sdpa_backends}")
        self.write_config()
        logger.info(
            f"{cfg.model.flavor}: {sum(p.numel() for p in self.model.parameters()):,} parameters, "
            f"{flops / 1e9:.2f} GFLOP/sample (train), {self.parallel_dims.mode} over {self.world_size} rank(s), "
            f"global batch {self.global_batch} = {cfg.training.local_batch_size} x {self.dp_degree} "
            f"x {self.grad_accum_steps} accumulation, device {self.device}"
        )

    def _build_layout(self) -> None:
        """Data-parallel degrees, the process group and mesh, and the batch sizes (with "auto" resolved)."""
        cfg = self.job_config
        validate_layout(cfg, self.world_size, self.device.type)
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
        self.global_batch = cfg.training.local_batch_size * self.dp_degree * self.grad_accum_steps

    def _build_training_state(self) -> None:
        """Optimizer, LR schedule, EMA and checkpoints; resumes from the newest loadable checkpoint."""
        cfg = self.job_config
        self.optimizer = build_optimizer(self.model, cfg.optimizer, self.device)
        self.lr_scheduler = build_lr_scheduler(self.optimizer, cfg.lr_scheduler, cfg.training.steps)
        self.ema = EMA(self.model, cfg.training.ema_decay, cfg.training.ema_warmup) if cfg.training.ema_decay else None
        # The data's meaning (tokenizer, seq_len, dataset): a resume that would make it meaningless is refused.
        extra = {"data": DataRecord(data_record(cfg, self.dataloader.dataset))}
        if self.private:
            extra["dp"] = self.private
        # A DP checkpoint resumed with dp.enable false is refused unless asked for (it would drop the accountant).
        foreign = None if cfg.dp.enable or cfg.dp.continue_without_privacy else {"dp": DP_CHECKPOINT_WITHOUT_DP}
        self.checkpointer = CheckpointManager(cfg.checkpoint, self.dump_folder, self.model, self.optimizer,
                                              self.lr_scheduler, self.ema, self.dataloader, self.rank,
                                              self.world_size, extra, foreign, self.model_args,
                                              self.train_spec.config_key)  # fmt: skip
        resuming = contextlib.nullcontext()
        if not cfg.dp.enable and cfg.dp.continue_without_privacy:
            resuming = resuming_without_privacy(self.checkpointer, cfg.checkpoint.load_step)
        with resuming:
            self.step = self.checkpointer.maybe_load()
        self.guard = NonFiniteGuard(self.optimizer, self.device, self.describe_nonfinite)
        if self.step == 0 and cfg.checkpoint.initial_load_format != "dcp":  # DCP: the checkpointer loaded it
            self.load_initial_weights(cfg.checkpoint.initial_load_path, cfg.checkpoint.initial_load_format)
        if self.step > 0:  # the config's optimizer settings win over the checkpoint's
            for change in apply_configured_hyperparameters(self.optimizer, self.lr_scheduler, cfg.optimizer):
                logger.warning(f"resumed with a changed config: {change}")

    def _build_dit_validation(self) -> tuple[FIDValidator | None, HeldOutLoss | None]:
        """A DiT's [validation]: the FID of EMA samples (components/validation.py) and the loss at fixed timesteps
        on held-out data (components/validation_loss.py), each as configured and checked now; None otherwise."""
        cfg, v = self.job_config, self.job_config.validation
        if self.samples is None or not v.enable:
            return None, None
        shared = (self.objective.diffusion, self.device, self.dp_rank, self.dp_degree, self.parallel_dims.dp_group,
                  self.metrics)  # fmt: skip
        fid = FIDValidator(cfg, self.model_args, *shared) if v.fid_num_samples > 0 else None
        held_out = HeldOutLoss(cfg, self.model_args, *shared) if v.loss_num_samples > 0 else None
        if fid is not None:
            fid.check()
        if held_out is not None:
            held_out.check(self.global_batch * self.augmult)
        return fid, held_out

    def build_dataloader(self, poisson_steps: int, split: str):
        """This rank's loader of the config's dataset ("train" or the held-out "validation" split)."""
        cfg = self.job_config
        try:
            return self.train_spec.build_dataloader_fn(cfg, self.model_args, self.dp_rank, self.dp_degree,
                                                       poisson_steps, split)  # fmt: skip
        except (FileNotFoundError, ValueError) as e:  # the data the config names is missing or does not fit it
            raise ConfigError(f"{at(cfg, 'training.dataset')}: {e}") from e

    def load_initial_weights(self, path: str, load_format: str) -> None:
        """The starting weights (model only; the EMA starts at them) from a file or folder in a format of the
        family's `weight_readers` (a Hugging Face folder, a facebookresearch/DiT `.pt`), on every rank, whatever the
        layout: each rank reads the full tensors and keeps its shards."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        try:
            state = self.train_spec.weight_readers[load_format](path, self.model_args)
        except (FileNotFoundError, ValueError) as e:
            raise ConfigError(f"{at(self.job_config, 'checkpoint.initial_load_path')}: {e}") from e
        set_model_state_dict(self.model, state, options=StateDictOptions(full_state_dict=True, strict=True))
        if self.ema is not None:
            self.ema.reset_to_model()
        logger.info(f"initialized model from {path} (checkpoint.initial_load_format {load_format!r})")

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

    def write_config(self) -> None:
        name = self.job_config.job.save_config_file
        if self.rank == 0 and name:
            self.dump_folder.mkdir(parents=True, exist_ok=True)
            (self.dump_folder / name).write_text(to_toml(self.job_config))
        if self.job_config.job.print_config:
            logger.info("resolved config:\n" + to_toml(self.job_config))

    def forward_losses(self, x: torch.Tensor, y: torch.Tensor, step: int, micro: int) -> torch.Tensor:
        """The objective's per-sample losses of one micro-batch, (B,) or (B, K) with dp.augmult K, under the compute
        context (autocast, attention priority)."""
        with self.compute_context():
            return self.objective.losses(self.model, x, y, step, micro)

    @contextlib.contextmanager
    def compute_context(self):
        """bf16 autocast (single device / DDP) and the attention-kernel priority, around a forward."""
        with torch.autocast(self.device.type, torch.bfloat16, enabled=self.autocast), self.attention_context():
            yield

    def attention_context(self):
        """The SDPA kernel priority. Backward needs it too: activation checkpointing recomputes attention there,
        and a recompute that picked another kernel than forward did would save different tensors (an error)."""
        return sdpa_kernel(self.sdpa_backends, set_priority=True)

    def tracked(self):
        """Every observer's `track`, around a forward or a backward of the step being taken."""
        stack = contextlib.ExitStack()
        for observer in self.observers:
            stack.enter_context(observer.track(self.step + 1))
        return stack

    def stage(self, name: str) -> None:
        for observer in self.observers:
            observer.stage(name, self.step + 1)

    def forward_backward(self, batch: tuple, micro: int = 0) -> torch.Tensor:
        """Forward and backward of one micro-batch (images, labels, Poisson padding mask or None) of this rank,
        adding into every `p.grad`; returns the per-sample losses, detached ((B,); the mean of K draws with
        dp.augmult K)."""
        x, y, mask = batch
        with self.tracked():
            losses = self.forward_losses(x, y, self.step, micro)
        if self.loss_bins is not None:  # on the device, read at log steps; the draws' times are let go before backward
            self.loss_bins.add(*self.objective.take_draws(), mask)
        if self.alignment_loss is not None:
            self.alignment_loss.add(self.objective.take_alignment(), mask)
        self.stage("forward")
        with self.tracked(), self.attention_context():
            if self.private is not None:
                self.private.backward(
                    losses,
                    mask,
                    last_micro_batch=micro == self.grad_accum_steps - 1,
                    on_norms=(lambda: self.stage("dp_norms")) if self.observers else None,
                )
            else:
                # Sum over this rank / global batch: the data-parallel mean (DDP/FSDP) then gives the global mean.
                (losses.sum() * self.dp_degree / self.global_batch).backward()
        losses = losses.detach().mean(1) if losses.dim() == 2 else losses.detach()
        self.stage("backward")
        return losses

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """This rank's next micro-batch on the device: images, labels and the Poisson padding mask (or None)."""
        data_start = time.perf_counter()
        x, y, *mask = next(self.dataloader)  # a mask marks the padding of Poisson-sampled batches
        self.meter.data_time += time.perf_counter() - data_start
        return x, y, mask[0] if mask else None

    def prefetch_batch(self) -> None:
        """Loads the next micro-batch and starts its copy to the device, once this one's work is queued (the host
        loads while the GPU computes); not after the run's last micro-batch."""
        data_start = time.perf_counter()
        self.dataloader.prefetch()
        self.meter.data_time += time.perf_counter() - data_start

    def optimized_params(self) -> list[torch.Tensor]:
        """The parameters the optimizer updates, from its groups: no walk over the module tree each step (about
        300 modules for DiT-XL/2, twice a step, host time a short step cannot spare)."""
        return [p for group in self.optimizer.param_groups for p in group["params"]]

    def grad_norm(self) -> torch.Tensor:
        """The global L2 norm of the gradients the optimizer is about to apply (FSDP shards gathered, DDP's all-reduced
        ones as they are: every rank gets the same value)."""
        grads = [p.grad for p in self.optimized_params() if p.grad is not None]
        norm = torch.nn.utils.get_total_norm(grads, foreach=True)
        return norm.full_tensor() if hasattr(norm, "full_tensor") else norm

    def train_step(self) -> dict:
        """One optimizer step over grad_accum_steps micro-batches; returns tensors for logging.

        No host sync: a non-finite step's update is skipped on the device (NonFiniteGuard), and the host reads the
        previous step's flag, which the GPU has finished while this step was queued.

        Raises:
            NonFiniteStepError: the loss or the gradient norm of this step (host path) or the step before (device
                path) is NaN or inf; that update was not applied.
        """
        if self.job_config.compile.enable and self.job_config.compile.mode == "reduce-overhead":
            torch.compiler.cudagraph_mark_step_begin()  # the last step's graph outputs are no longer read
        loss_sum = torch.zeros((), device=self.device)
        loss_count = torch.zeros((), device=self.device)  # samples drawn: a Poisson batch's vary (on the device)
        for micro in range(self.grad_accum_steps):
            batch = self.next_batch()
            losses = self.forward_backward(batch, micro)
            if self.step + 1 < self.job_config.training.steps or micro + 1 < self.grad_accum_steps:
                self.prefetch_batch()
            mask = batch[2]
            loss_sum += (losses if mask is None else losses * mask).sum()
            loss_count += losses.shape[0] if mask is None else mask.sum()
        grad_norm = self.grad_norm()
        max_norm = self.job_config.training.max_norm if self.private is None else 0.0  # DP clips per sample instead
        if max_norm > 0:
            params = [p for p in self.optimized_params() if p.grad is not None]
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, grad_norm, foreach=True)
        lr = self.optimizer.param_groups[0]["lr"]  # the lr this update applies
        with self.guard.update(self.step + 1, loss_sum, grad_norm):
            self.optimizer.step()
        self.stage("optimizer_step")
        self.lr_scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        if getattr(self.model, "float8_fsdp_all_gather", False):
            from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

            precompute_float8_dynamic_scale_for_fsdp(self.model)  # one all-reduce for every weight's scale
        if self.ema is not None:
            self.ema.update()
        self.stage("zero_grad")
        if self.private is not None:
            self.private.step_done()
        self.step += 1
        self.guard.check(late=1)  # the CPU stays at most one step ahead of the GPU
        return {"loss_sum": loss_sum, "loss_count": loss_count, "grad_norm": grad_norm, "lr": lr}

    def describe_nonfinite(self, step: int, loss_sum: torch.Tensor, grad_norm: torch.Tensor) -> str:
        """NonFiniteGuard's message; the gradient norm is global, so every rank stops alike (a NaN loss anywhere
        makes it NaN)."""
        newest = self.checkpointer.newest_complete()
        return (
            f"step {step}: this rank's mean loss is {loss_sum.item() * self.dp_degree / self.global_batch:.4g} and the "
            f"gradient norm {grad_norm.item():.4g}: the run stops and this update was not applied"
            f"{f'; the newest checkpoint is {newest}' if newest else ''}. Lower optimizer.lr, set "
            "training.max_norm > 0, or check the data"
        )

    def logs_at(self, steps_done: int) -> bool:
        """Whether the metrics are logged once `steps_done` steps are done (every log_freq steps, and the last)."""
        return steps_done % self.job_config.metrics.log_freq == 0 or steps_done == self.job_config.training.steps

    def log(self, out: dict) -> None:
        """The step's metrics. Under DP the gradient norm is the noised one the optimizer applies
        (`dp_noised_grad_norm`), and the per-sample norms before clipping are summarized over every sample since the
        last log (PrivateTraining.metrics: a collective over the data-parallel ranks). The loss is the mean over the
        samples the step drew (under Poisson sampling their number varies; None if it drew none, an empty step,
        which the record shows as such and counts in dp_empty_steps); a diffusion model's
        `loss/t_bin_k` bin it by timestep over every sample since the last log (LossByTimestep, also a collective),
        and with representation alignment `loss/alignment` is the mean alignment loss (without its coefficient)."""
        totals = torch.stack([out["loss_sum"], out["loss_count"]])  # one all_reduce for both
        if dist.is_initialized():
            dist.all_reduce(totals, group=self.parallel_dims.dp_group())
        loss_sum, loss_count = totals.tolist()
        loss = loss_sum / loss_count if loss_count else None
        grad_norm_key = "dp_noised_grad_norm" if self.private is not None and self.private.noised else "grad_norm"
        metrics = {"loss": loss, grad_norm_key: out["grad_norm"].item(), "lr": out["lr"]}
        metrics.update(self.meter.summary())
        for meter in (self.loss_bins, self.alignment_loss):
            metrics.update(meter.metrics(self.parallel_dims.dp_group()) if meter is not None else {})
        if self.private is not None:
            metrics.update(self.private.metrics(self.parallel_dims.dp_group()))
        self.metrics.log(self.step, metrics)
        self.meter.reset()

    def train(self) -> None:
        cfg = self.job_config
        if cfg.checkpoint.create_seed_checkpoint:
            self.checkpointer.save(0, last=True, model_only=True)
            logger.info("wrote the seed checkpoint (step 0); exiting")
            return
        logger.info(f"training from step {self.step} to {cfg.training.steps}")
        self.meter.reset()
        while self.step < cfg.training.steps:
            out = self.train_step()
            self.meter.steps += 1
            self.gc.run(self.step)
            last = self.step == cfg.training.steps
            log, save = self.logs_at(self.step), self.checkpointer.should_save(self.step, last)
            # An LM's held-out loss or a DiT's FID; a DiT's fixed-timestep loss keeps its own interval.
            validate = (self.fid is not None or self.validation_loader is not None) and (
                self.step % cfg.validation.freq == 0 or last)  # fmt: skip
            held_out = self.held_out_loss is not None and self.held_out_loss.due(self.step, last)
            sample = self.samples is not None and self.samples.due(self.step, last)
            if last or log or save or validate or held_out or sample:
                self.guard.check()  # no state is logged, saved, sampled or exported after a non-finite step
            if log:
                self.log(out)
            if save:  # before the samples: a failing side feature never costs the step's checkpoint
                self.checkpointer.save(self.step, last=last)
            if held_out:
                self.held_out_loss.run(self.model, self.ema, self.step, self.compute_context)
            if validate:
                self.validate()
            if sample:
                self.samples.write(self.model, self.ema, self.step, self.compute_context)
            self.profiler.step(self.step)
        self.checkpointer.wait()
        if cfg.checkpoint.enable:
            self.export_weights()
        logger.info("training done")

    def validate(self) -> dict:
        """Mean loss over at most `validation.steps` held-out micro-batches per rank, each held-out sample counted
        once (the pass stops at the end of the split; the same samples each time), over the data-parallel ranks,
        and its perplexity for language models; logged as `validation_loss` (`validation_perplexity`). Weights are
        the trained ones (not the EMA). A DiT's validation is the FID of EMA samples instead (FIDValidator.run; its
        fixed-timestep loss is HeldOutLoss.run's)."""
        if self.fid is not None:
            return self.fid.run(self.model, self.ema, self.step, self.compute_context)
        from torchtitan.datasets.loader import validation_batches

        dataset, steps = self.validation_loader.dataset, self.job_config.validation.steps
        batch_size = self.job_config.training.local_batch_size
        totals = torch.zeros(2, device=self.device, dtype=torch.float64)  # loss sum, samples
        batches = 0
        self.model.eval()
        try:
            with torch.no_grad():
                for x, y, weight in validation_batches(dataset, batch_size, self.dp_rank, self.dp_degree,
                                                       self.job_config.debug.seed, steps):  # fmt: skip
                    x, y = batch_to_device((x, y), self.device)
                    losses = self.forward_losses(x, y, self.step, 0)
                    losses = losses.mean(1) if losses.dim() == 2 else losses  # (B,): a sequence's mean token loss
                    weight = weight.to(self.device, torch.float64)  # 0 for the padding past the split's end
                    totals += torch.stack([(losses.double() * weight).sum(), weight.sum()])
                    batches += 1
        finally:
            self.model.train()
        if dist.is_initialized():
            dist.all_reduce(totals, group=self.parallel_dims.dp_group())
        if not self._validation_logged:
            self._validation_logged = True
            ended = f"; validation.steps = {steps} reaches past its end" if batches < steps else ""
            logger.info(f"validation: {batches} batch(es) of {batch_size} per rank, {int(totals[1].item()):,} of "
                        f"the split's {len(dataset):,} samples, each once{ended}")  # fmt: skip
        loss = (totals[0] / totals[1]).item()
        metrics = {"validation_loss": loss}
        if self.objective.reports_perplexity:
            metrics["validation_perplexity"] = math.exp(min(loss, 700.0))
        self.metrics.log(self.step, metrics)
        return metrics

    def export_weights(self) -> None:
        """ema.safetensors at the end of training: a side feature (the checkpoints hold the same weights), so a
        failure is logged as an error and the run still ends well."""
        try:
            self.checkpointer.export_ema(self.dump_folder / "ema.safetensors", self.model_args,
                                         torch_dtype(self.job_config.checkpoint.export_dtype),
                                         self.train_spec.sampling_export_fn)  # fmt: skip
        except Exception as e:  # noqa: BLE001
            logger.exception(f"exporting ema.safetensors failed ({type(e).__name__}: {e}); the checkpoints hold "
                             "the weights")  # fmt: skip

    def close(self, together: bool = True) -> None:
        """Releases workers, writers and the run folder; with `together` (every rank got here at the same step:
        the run finished, or stopped on a decision all ranks share) also the process group. Otherwise a rank failed
        alone and the others are inside a collective it will never join: no barrier, no teardown of NCCL (either
        would wait for them); the process exits and torchrun stops the rest. One process has no one to wait for."""
        self.dataloader.close()  # its worker processes, persistent ones included
        self.profiler.close()
        self.metrics.close()
        if self.run_lock is not None:
            self.run_lock.release()
        if dist.is_initialized() and (together or dist.get_world_size() == 1):
            dist.barrier()  # every rank reaches teardown before gloo/NCCL is destroyed (avoids an abort at exit)
            dist.destroy_process_group()
