"""The loss at fixed timesteps on held-out data while training: a DiT's `[validation]`, beside its FID.

SD3 (Esser et al., 2024) tracks a validation loss at 8 equally spaced timesteps with the same noise every time: a
training loss draws its t and noise afresh, and their spread hides what a few thousand steps change, while with
the times, the noise and the samples fixed only the weights move the number, so one curve compares its
evaluations, and runs with each other. Here, every `validation.loss_freq` steps and at the end:

- the first `validation.loss_num_samples` items of one fixed shuffled order (`sampling.seed`) of the held-out data
  (`torchtitan.datasets.build_held_out_dataset`), never flipped;
- each with its own noise, a function of its position in that order and `sampling.seed` alone (`held_out_noise`),
  the same at every evaluation and on any number of ranks;
- noised at the 8 times of `validation_timesteps` ((k + 1/2) / 8 of the path, k = 0..7), with the true labels;
- the objective's per-sample loss (the alignment term aside: it needs the encoder) averaged over the samples at
  each time: `loss/val_t0` .. `loss/val_t7`, and their mean `loss/val`.

The weights are the EMA's when kept, as the FID's. Positions are dealt to the data-parallel ranks in turn and the
loss sums all-reduced, so 1 or N ranks give the same numbers up to the order of the sums. The cost is 8 forwards of
N samples every I steps against a step's forward and backward (3 forwards) of the global batch B: 8 N / (3 B I) of
training's FLOPs, logged at start (docs/diffusion.md).

A side feature, as the FID: a failure is one warning line and training goes on; every rank joins the reduction,
failed or not (a failure inside an FSDP forward, whose ranks wait for each other there, can still stall).
"""

import contextlib
import math
import time

import torch
import torch.distributed as dist
from torch.utils.data import default_collate

from torchtitan.datasets import build_held_out_dataset
from torchtitan.datasets.loader import held_out_positions
from torchtitan.datasets.prefetch import batch_to_device
from torchtitan.diffusion import IndexedNoise, validation_timesteps
from torchtitan.errors import ConfigError, at
from torchtitan.tools.logging import logger

NUM_TIMESTEPS = 8  # SD3's
_NOISE_STREAM = 1 << 32  # position p's noise: the generator seeded seed * 2**32 + p (seed < 2**32, p < 2**32)


def held_out_noise(seed: int, positions: list[int], shape: tuple[int, ...]) -> torch.Tensor:
    """The noise of held-out positions, (B, *shape) float32 on the CPU: position p's from a generator of its own
    seeded by seed * 2**32 + p, so any rank, batch or program draws the same for it."""
    return IndexedNoise(seed, positions, stride=_NOISE_STREAM).normal((len(positions), *shape))


class HeldOutLoss:
    """The fixed-timestep validation loss of a DiT, every `validation.loss_freq` steps and at the end.

    Args:
        job_config: the resolved config (`[validation]`; `sampling.seed`; `training.local_batch_size`, the batch of
            each forward).
        model_args: the model's args (input shape, classes).
        diffusion: the objective whose per-sample loss is taken.
        device: where the model runs.
        dp_rank, dp_degree: this rank's share of the samples.
        dp_group: a callable giving the data-parallel process group (None: the default group).
        metrics: the MetricsLogger whose sinks (console, metrics.jsonl, TensorBoard, wandb) get the record.
    """

    def __init__(self, job_config, model_args, diffusion, device: torch.device, dp_rank: int, dp_degree: int,
                 dp_group, metrics):  # fmt: skip
        self.config, self.args, self.diffusion, self.device = job_config, model_args, diffusion, device
        self.dp_rank, self.dp_degree, self.dp_group, self.metrics = dp_rank, dp_degree, dp_group, metrics
        self.times = validation_timesteps(diffusion, NUM_TIMESTEPS)  # the objective's t: float, or DDPM's steps
        self.dataset = None
        self.order = None  # dataset index of each position, the first num_samples of a seeded permutation

    def check(self, global_batch: int) -> None:
        """Reads the held-out data on every rank, at start rather than at the first validation thousands of steps
        in, and logs what each validation evaluates and its share of training's FLOPs at `global_batch` samples
        (each of dp.augmult's draws counted) a step.

        Raises:
            ConfigError: on every rank when any rank cannot read the data (the message names the key).
        """
        cfg, v = self.config, self.config.validation
        key = "validation.dataset_path" if v.dataset_path else "training.dataset"
        error = ""
        try:
            self.dataset = build_held_out_dataset(cfg, self.args)
        except (FileNotFoundError, ValueError) as e:
            message = str(e).removeprefix("training.dataset_path: ")  # the readers name the training data's key
            error = f"{at(cfg, key)}: the held-out data of the fixed-timestep loss: {message}"
        failed = self._reduce(torch.tensor([float(bool(error))], device=self.device))[0].item()
        if failed:
            raise ConfigError(error or f"validation: {int(failed)} other rank(s) could not read the held-out data")
        num_samples = min(v.loss_num_samples, len(self.dataset))
        permutation = torch.randperm(len(self.dataset), generator=torch.Generator().manual_seed(cfg.sampling.seed))
        self.order = permutation[:num_samples].tolist()
        share = 100 * NUM_TIMESTEPS * num_samples / (3 * global_batch * v.loss_freq)
        times = ", ".join(f"{t:g}" for t in self.times.tolist())
        taken = "" if num_samples == v.loss_num_samples else f" (validation.loss_num_samples = {v.loss_num_samples})"
        logger.info(f"validation: loss at t = {times} on {num_samples:,} of {len(self.dataset):,} held-out samples"
                    f"{taken} every {v.loss_freq} steps, ~{share:.2f}% of training's FLOPs")  # fmt: skip

    def due(self, step: int, last: bool) -> bool:
        return last or step % self.config.validation.loss_freq == 0

    def _reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        if dist.is_initialized() and self.dp_degree > 1:
            dist.all_reduce(tensor, group=self.dp_group() if self.dp_group is not None else None)
        return tensor

    def run(self, model: torch.nn.Module, ema, step: int, compute_context) -> dict | None:
        """One evaluation with the EMA weights swapped in (if kept): the record logged and returned (on the ranks
        that log; None on the others); a failure is one warning line (None returned), never raised."""
        start = time.perf_counter()
        sums = torch.zeros(2 + NUM_TIMESTEPS, dtype=torch.float64, device=self.device)  # failures, samples, losses
        error = ""
        try:
            with ema.swapped_in() if ema is not None else contextlib.nullcontext():
                self.add_local_losses(sums, model, compute_context)
        except Exception as e:  # noqa: BLE001 (a side feature must not end the run)
            error = f"{type(e).__name__}: {e}"
            logger.warning(f"step {step}: the fixed-timestep validation loss failed on this rank ({error}); "
                           "training goes on")  # fmt: skip
            sums.zero_()
            sums[0] = 1.0
        failed, count, *totals = self._reduce(sums).tolist()
        if failed:
            if not error:  # the failing rank said why
                logger.warning(f"step {step}: the fixed-timestep validation loss failed on {int(failed)} rank(s); "
                               "training goes on")  # fmt: skip
            return None
        if not self.metrics.enabled:
            return None
        record = {f"loss/val_t{k}": total / count for k, total in enumerate(totals)}
        record["loss/val"] = sum(totals) / (count * NUM_TIMESTEPS)
        record["validation/loss_samples"] = int(count)
        record["validation/loss_seconds"] = time.perf_counter() - start
        self.metrics.log(step, record)
        return record

    @torch.no_grad()
    def add_local_losses(self, sums: torch.Tensor, model: torch.nn.Module, compute_context) -> None:
        """This rank's positions through the objective's loss at each fixed time: adds the sample count and each
        time's loss sum to `sums` (failures, samples, loss at t_0 .. t_7)."""
        a, batch_size = self.args, self.config.training.local_batch_size
        shape = (a.in_channels, a.input_size, a.input_size)
        batches = held_out_positions(len(self.order), batch_size, self.dp_rank, self.dp_degree,
                                     math.ceil(len(self.order) / batch_size))  # fmt: skip
        model.eval()
        try:
            for positions, weight in batches:
                x, y = batch_to_device(default_collate([self.dataset[self.order[p]] for p in positions]), self.device)
                y = y if a.num_classes > 0 else None
                noise = held_out_noise(self.config.sampling.seed, positions, shape).to(self.device)
                weight = weight.to(self.device, torch.float64)  # 0 for the padding past the samples' end
                for k, t in enumerate(self.times.tolist()):
                    times = torch.full((len(positions),), t, dtype=self.times.dtype, device=self.device)
                    with compute_context():
                        losses, _ = self.diffusion.training_losses(model, x, y, t=times, noise=noise)
                    sums[2 + k] += (losses.double() * weight).sum()
                sums[1] += weight.sum()
        finally:
            model.train()
