"""What the labs share (scripts/run_attention_lab.py, scripts/run_memory_lab.py): a grid of named variants, each a
list of train.py flags, chosen on the command line; the line a dry run prints; the cells of a results table."""

import shlex
from pathlib import Path

from scripts.lib.runner import train_command, words
from torchtitan.tools.runs import Run


def select_variants(grid: dict[str, list[str]], wanted: str) -> dict[str, list[str]]:
    """The variants of `grid` that `wanted` names (space or comma separated; "" keeps them all), in the grid's order.

    Raises:
        SystemExit: `wanted` names a variant the grid does not have (the message lists the known ones).
    """
    if not wanted:
        return grid
    names = words(wanted)
    unknown = sorted(set(names) - set(grid))
    if unknown:
        raise SystemExit(f"unknown variants {unknown}; known: {list(grid)}")
    return {name: overrides for name, overrides in grid.items() if name in names}


def command_line(run: Run, run_dir: Path) -> str:
    """The shell line of a run, its environment first (`VAR=value python train.py ...`): what a dry run prints."""
    env = [f"{key}={shlex.quote(value)}" for key, value in run.env.items()]
    return " ".join([*env, shlex.join(train_command(run, run_dir))])


def cell(value, fmt: str = "{}", missing: str = "") -> str:
    """A table cell: `value` through `fmt`, or `missing` where the run did not measure it (None)."""
    return missing if value is None else fmt.format(value)
