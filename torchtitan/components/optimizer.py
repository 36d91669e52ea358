"""The optimizer of the [optimizer] section: AdamW or SGD (fused on CUDA)."""

import torch
from torch import nn
from torch.distributed.tensor import DTensor


def build_optimizer(model: nn.Module, optimizer_config, device: torch.device) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]
    implementation = optimizer_config.implementation
    if implementation == "fused" and device.type != "cuda":
        implementation = "foreach"  # the fused kernels are CUDA's here; CPU runs the foreach path
    if implementation == "fused" and optimizer_config.name == "SGD" and any(isinstance(p, DTensor) for p in params):
        implementation = "foreach"  # DTensor has no sharding rule for fused SGD's kernel (torch 2.11): FSDP's shards
    kwargs = {"fused": True} if implementation == "fused" else {"foreach": implementation == "foreach"}
    kwargs.update(lr=optimizer_config.lr, **_hyperparameters(optimizer_config))
    if optimizer_config.name == "SGD":
        return torch.optim.SGD(params, **kwargs)
    return torch.optim.AdamW(params, **kwargs)


# Per optimizer.name: each param-group hyperparameter besides lr, and the [optimizer] fields it comes from.
HYPERPARAMETERS = {
    "AdamW": {"betas": ("beta1", "beta2"), "eps": ("eps",), "weight_decay": ("weight_decay",)},
    "SGD": {"momentum": ("momentum",), "weight_decay": ("weight_decay",)},
}


def _hyperparameters(optimizer_config) -> dict:
    """The param-group values of optimizer.name's optimizer (lr aside), from the config."""
    values = {}
    for group_key, fields in HYPERPARAMETERS[optimizer_config.name].items():
        found = tuple(getattr(optimizer_config, field) for field in fields)
        values[group_key] = found if len(found) > 1 else found[0]
    return values


def foreign_fields(name: str) -> list[str]:
    """The [optimizer] fields that only the other optimizers read."""
    own = {field for fields in HYPERPARAMETERS[name].values() for field in fields}
    return sorted({f for other in HYPERPARAMETERS.values() for fields in other.values() for f in fields} - own)


def written_by(group_keys) -> set[str]:
    """The optimizer names whose own param-group hyperparameters (ones no other name has) are among `group_keys`."""
    names = set()
    for name, keys in HYPERPARAMETERS.items():
        others = {k for other, o in HYPERPARAMETERS.items() if other != name for k in o}
        if (set(keys) - others) & set(group_keys):
            names.add(name)
    return names


def apply_configured_hyperparameters(optimizer: torch.optim.Optimizer, lr_scheduler, optimizer_config) -> list[str]:
    """Puts the config's lr and the other hyperparameters (AdamW: betas, eps, weight decay; SGD: momentum, weight
    decay) back after a checkpoint restored the saved ones.

    A resumed run trains with what its config.toml records: the restored optimizer and LR scheduler states carry
    the hyperparameters of the run that wrote them, which would otherwise win silently. The schedule's position
    (its step) is kept; the peak lr it scales is the configured one. Returns a line per value that changed.
    """
    wanted = {"lr": optimizer_config.lr, **_hyperparameters(optimizer_config)}
    keys = {"lr": "optimizer.lr"}
    for group_key, fields in HYPERPARAMETERS[optimizer_config.name].items():
        keys[group_key] = "optimizer." + "/".join(fields)
    changes = []
    for index, group in enumerate(optimizer.param_groups):
        saved = {name: group[name] for name in wanted}
        saved["lr"] = group.get("initial_lr", group["lr"])
        for name, value in wanted.items():
            if (tuple(saved[name]) if name == "betas" else saved[name]) != value:
                changes.append(f"{keys[name]}: {saved[name]} in the checkpoint, {value} in the config (applied)")
            group[name] = value
        group["initial_lr"] = wanted["lr"]
        lr_scheduler.base_lrs[index] = wanted["lr"]
    # The lr of the current position of the schedule, from the configured peak (LambdaLR's own formula).
    for group, base, factor in zip(optimizer.param_groups, lr_scheduler.base_lrs, lr_scheduler.lr_lambdas):
        group["lr"] = base * factor(lr_scheduler.last_epoch)
    return sorted(set(changes))
