"""TrainSpec registry: model name -> model class, flavors, parallelize function, FLOP formula.

`train.py` looks a model up here by `model.name` and never imports a model class itself.
"""

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn


@dataclass
class TrainSpec:
    name: str
    model_cls: type[nn.Module]
    model_args: dict[str, Any]  # flavor name -> model args dataclass
    parallelize_fn: Callable[..., nn.Module]
    flops_per_image_fn: Callable[[Any], float]


_registry: dict[str, TrainSpec] = {}


def register_train_spec(spec: TrainSpec) -> None:
    if spec.name in _registry:
        raise ValueError(f"TrainSpec {spec.name!r} is already registered")
    _registry[spec.name] = spec


def get_train_spec(name: str) -> TrainSpec:
    import torchtitan.models  # noqa: F401  (registers the built-in models)

    if name not in _registry:
        raise ValueError(f"model.name {name!r} is not registered; known: {sorted(_registry)}")
    return _registry[name]


def build_model_args(spec: TrainSpec, model_config) -> Any:
    """The flavor's args with the `[model]` overrides applied (0, -1 and None keep the flavor's value)."""
    import dataclasses

    args = dataclasses.replace(spec.model_args[model_config.flavor])
    for name in ("input_size", "in_channels", "patch_size"):
        if getattr(model_config, name) > 0:
            setattr(args, name, getattr(model_config, name))
    if model_config.num_classes >= 0:
        args.num_classes = model_config.num_classes
    if model_config.attn_window >= 0:
        args.attn_window = model_config.attn_window
    for name in ("pos_embed", "norm", "mlp", "qk_norm", "learn_sigma"):
        if getattr(model_config, name) is not None:  # False overrides a flavor's True
            setattr(args, name, getattr(model_config, name))
    try:
        args.validate()
    except ValueError as e:
        raise ValueError(f"[model] flavor {model_config.flavor!r} with overrides: {e}") from e
    return args
