"""AdamW from the [optimizer] section (fused on CUDA)."""

import torch
from torch import nn


def build_optimizer(model: nn.Module, optimizer_config, device: torch.device) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]
    implementation = optimizer_config.implementation
    if implementation == "fused" and device.type != "cuda":
        implementation = "foreach"  # fused AdamW is a CUDA kernel here; CPU runs the foreach path
    kwargs = {"fused": True} if implementation == "fused" else {"foreach": implementation == "foreach"}
    return torch.optim.AdamW(
        params,
        lr=optimizer_config.lr,
        betas=(optimizer_config.beta1, optimizer_config.beta2),
        eps=optimizer_config.eps,
        weight_decay=optimizer_config.weight_decay,
        **kwargs,
    )
