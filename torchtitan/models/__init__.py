"""Importing this package registers every built-in model's TrainSpec."""

from torchtitan.models import dit  # noqa: F401
