"""What a model family and the trainer agree on: the TrainSpec a family declares (torchtitan/train_spec.py keeps
the registry), the Objective it trains for and the BatchLayout its objective draws per-sample randomness by.

The ground floor, beside torchtitan/errors.py: the families (torchtitan/models/*) build their TrainSpec from these
without importing the registry, which imports them.
"""

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn


@dataclass(frozen=True)
class BatchLayout:
    """Where this rank's micro-batches sit in the global batch; objectives draw per-sample randomness by it so that
    one process and N processes at the same global batch see the same losses."""

    dp_rank: int
    dp_degree: int
    grad_accum_steps: int
    augmult: int  # dp.augmult K under DP (K rows per sample in one forward), else 1
    seed: int
    device: torch.device


class Objective(Protocol):
    """What a model family trains for: one loss per sample, so DP-SGD and per-sample logging work unchanged."""

    tokens_per_sample: int  # > 0: the logs add tokens/s (language models); 0 for images
    reports_perplexity: bool  # validation logs exp(mean loss) too (next-token prediction)

    def losses(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor, step: int, micro: int) -> torch.Tensor:
        """Per-sample losses (B,) of one micro-batch, or (B, K) with augmult K."""
        ...

    def compile_loss(self) -> None:
        """torch.compile the loss formed from the model's output (`compile.components` lists "loss")."""
        ...


@dataclass
class TrainSpec:
    """One model family.

    Attributes:
        model_args: flavor name -> the model's args dataclass.
        build_model_args_fn: (flavor args copy, job_config) -> args with the config's overrides applied and validated
            (raises ValueError naming the field, or ConfigError naming another key it reads, such as a Hugging Face
            folder's config.json under checkpoint.initial_load_path).
        parallelize_fn: (model, parallel_dims, job_config) -> model, applied on the meta device.
        build_objective_fn: (job_config, model_args, BatchLayout) -> Objective.
        build_dataloader_fn: (job_config, model_args, dp_rank, dp_world, poisson_steps, split) -> an endless,
            stateful loader of (x, y) or, Poisson-sampled, (x, y, mask) micro-batches; split "train" or "validation".
        flops_per_sample_fn: (model_args, job_config) -> training FLOPs of one sample (forward + backward).
        datasets: the `training.dataset` values the family reads.
        has_validation_split: whether its datasets hold out a split for `[validation]`.
        measure_overrides: train.py flags a measurement (torchtitan.measure) adds for this family.
        weight_readers: `checkpoint.initial_load_format` -> (path, model_args) -> the full state dict (our names,
            every key and shape checked) of starting weights in that format, e.g. {"hf": ...} for a Hugging Face
            folder; raises FileNotFoundError or ValueError naming the file. DCP ("dcp") needs no reader.
        arg_keys: model arg -> the config key that sets it, where that is not `model.<arg>` (see config_key).
        sampling_export_fn: (model_args, parameter names) -> (args, names) of an export that only samples (the run's
            ema.safetensors): parts that only train left out (a DiT's alignment projectors); None keeps everything.
    """

    name: str
    model_cls: type[nn.Module]
    model_args: dict[str, Any]
    build_model_args_fn: Callable[[Any, Any], Any]
    parallelize_fn: Callable[..., nn.Module]
    build_objective_fn: Callable[[Any, Any, BatchLayout], Objective]
    build_dataloader_fn: Callable[..., Any]
    flops_per_sample_fn: Callable[[Any, Any], float]
    datasets: tuple[str, ...]
    has_validation_split: bool = False
    measure_overrides: tuple[str, ...] = ()
    weight_readers: dict[str, Callable[[Any, Any], dict]] = dataclasses.field(default_factory=dict)
    arg_keys: dict[str, str] = dataclasses.field(default_factory=dict)
    sampling_export_fn: Callable[[Any, list[str]], tuple[Any, list[str]]] | None = None

    def config_key(self, arg: str) -> str:
        """The config key that sets model arg `arg`, named when a resume would change it: `arg_keys`'s, else
        `model.<arg>` where [model] has that key, else model.flavor (the flavor alone gives it)."""
        from torchtitan.job_config import Model

        if arg in self.arg_keys:
            return self.arg_keys[arg]
        return f"model.{arg}" if arg in Model.__dataclass_fields__ else "model.flavor"
