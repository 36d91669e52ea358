"""Warmup, then constant, then decay over the last `decay_ratio` of the steps (WSD-style)."""

import math

import torch


def lr_factor(step: int, total_steps: int, warmup_steps: int, decay_ratio: float, decay_type: str,
              min_lr_factor: float) -> float:  # fmt: skip
    """Multiplier of the peak lr after `step` optimizer steps (step counts from 0)."""
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    decay_steps = round(total_steps * decay_ratio)
    decay_start = total_steps - decay_steps
    if decay_steps == 0 or step < decay_start:
        return 1.0
    progress = min(1.0, (step - decay_start + 1) / decay_steps)
    if decay_type == "linear":
        shape = 1.0 - progress
    elif decay_type == "sqrt":
        shape = 1.0 - math.sqrt(progress)
    else:
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    return min_lr_factor + (1.0 - min_lr_factor) * shape


def build_lr_scheduler(optimizer: torch.optim.Optimizer, lr_config, total_steps: int):
    def factor(step: int) -> float:
        return lr_factor(step, total_steps, lr_config.warmup_steps, lr_config.decay_ratio, lr_config.decay_type,
                         lr_config.min_lr_factor)  # fmt: skip

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
