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


def apply_configured_hyperparameters(optimizer: torch.optim.Optimizer, lr_scheduler, optimizer_config) -> list[str]:
    """Puts the config's lr, betas, eps and weight decay back after a checkpoint restored the saved ones.

    A resumed run trains with what its config.toml records: the restored optimizer and LR scheduler states carry
    the hyperparameters of the run that wrote them, which would otherwise win silently. The schedule's position
    (its step) is kept; the peak lr it scales is the configured one. Returns a line per value that changed.
    """
    wanted = {
        "lr": optimizer_config.lr,
        "betas": (optimizer_config.beta1, optimizer_config.beta2),
        "eps": optimizer_config.eps,
        "weight_decay": optimizer_config.weight_decay,
    }
    keys = {"lr": "optimizer.lr", "betas": "optimizer.beta1/beta2", "eps": "optimizer.eps",
            "weight_decay": "optimizer.weight_decay"}  # fmt: skip
    changes = []
    for index, group in enumerate(optimizer.param_groups):
        saved = {"lr": group.get("initial_lr", group["lr"]), "betas": tuple(group["betas"]), "eps": group["eps"],
                 "weight_decay": group["weight_decay"]}  # fmt: skip
        for name, value in wanted.items():
            if saved[name] != value:
                changes.append(f"{keys[name]}: {saved[name]} in the checkpoint, {value} in the config (applied)")
        group["betas"], group["eps"], group["weight_decay"] = wanted["betas"], wanted["eps"], wanted["weight_decay"]
        group["initial_lr"] = wanted["lr"]
        lr_scheduler.base_lrs[index] = wanted["lr"]
    # The lr of the current position of the schedule, from the configured peak (LambdaLR's own formula).
    for group, base, factor in zip(optimizer.param_groups, lr_scheduler.base_lrs, lr_scheduler.lr_lambdas):
        group["lr"] = base * factor(lr_scheduler.last_epoch)
    return sorted(set(changes))
