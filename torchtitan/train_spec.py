"""TrainSpec registry: model name -> model class, flavors, parallelize function, objective, data, FLOP formula.

`train.py` and the Trainer look a model family up here by `model.name` and never import a model class, a loss or a
dataset themselves: a second family (Llama 3) is a second entry of torchtitan/models' TRAIN_SPECS, not a change to the
training step. The families build their TrainSpec from torchtitan/protocols.py, below this module: imports point down.
"""

import dataclasses
from typing import Any

from torchtitan.errors import ConfigError
from torchtitan.protocols import TrainSpec


def get_train_spec(name: str) -> TrainSpec:
    """The TrainSpec of the family `model.name` names.

    Raises:
        ValueError: no family of that name, naming the known ones.
    """
    # Imported here, not at the top: parsing a config reads the registry only when it needs a family's args.
    from torchtitan.models import TRAIN_SPECS

    specs = {spec.name: spec for spec in TRAIN_SPECS}
    if name not in specs:
        raise ValueError(f"model.name {name!r} is not registered; known: {sorted(specs)}")
    return specs[name]


def build_model_args(spec: TrainSpec, job_config) -> Any:
    """The flavor's args (a fresh copy: overrides never leak into the registry) with the config's overrides.

    Raises:
        ValueError: the args are invalid, prefixed with the flavor; ConfigError (a ValueError) as the family raised
            it, naming its key.
    """
    flavor = job_config.model.flavor
    try:
        return spec.build_model_args_fn(dataclasses.replace(spec.model_args[flavor]), job_config)
    except ConfigError:
        raise  # names its own key (a Hugging Face folder's config.json: checkpoint.initial_load_path)
    except ValueError as e:
        raise ValueError(f"[model] flavor {flavor!r} with overrides: {e}") from e
