"""Importing this package registers every built-in model's TrainSpec."""

from torchtitan.models import dit, llama3  # noqa: F401
