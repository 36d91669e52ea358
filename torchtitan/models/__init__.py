"""The built-in model families: each package's TrainSpec, which torchtitan/train_spec.py looks up by model.name."""

from torchtitan.models import dit, llama3

TRAIN_SPECS = (dit.TRAIN_SPEC, llama3.TRAIN_SPEC)
