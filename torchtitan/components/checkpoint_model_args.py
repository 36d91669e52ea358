"""What a checkpoint records of the model that built it, read before a model is built.

Every checkpoint holds the model args that built its weights (entry "model_args", one JSON string): a resume whose
model would differ is refused naming the config key (CheckpointManager), and a family whose args come from outside
its flavor (Llama's numerics from a Hugging Face config.json) builds them from the record of the checkpoint it starts
from (`starting_checkpoint`), so a resume needs neither the import keys nor the folder they named.
"""

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

from torch.distributed.checkpoint.api import CheckpointException

from torchtitan.components.checkpoint_reader import load_checkpoint, read_checkpoint_metadata, resume_candidates

MODEL_ARGS = "model_args"  # the entry recording the model args that built a checkpoint's weights


def model_args_record(args) -> dict:
    """A model's args (a dataclass) as a checkpoint records them: plain JSON values."""
    return json.loads(json.dumps(dataclasses.asdict(args)))


def read_model_args(path: Path) -> dict | None:
    """The model args a checkpoint records (model_args_record), or None for one written before checkpoints
    recorded them. This rank alone reads the one entry.

    Raises:
        whatever reading a damaged or unsafe checkpoint raises (UnsafePickleError, CheckpointException, ...).
    """
    if f"{MODEL_ARGS}.json" not in read_checkpoint_metadata(path).state_dict_metadata:
        return None
    state = {MODEL_ARGS: {"json": ""}}
    load_checkpoint(state, path, no_dist=True)
    return json.loads(state[MODEL_ARGS]["json"])


@dataclass
class StartingCheckpoint:
    """A checkpoint a run starts from, and the model args it records."""

    path: Path
    model_args: dict


def starting_checkpoint(checkpoint_config, dump_folder: Path) -> StartingCheckpoint | None:
    """The checkpoint a run will start from, read before the model is built: the first readable one a resume tries
    (checkpoint.enable), else a DCP checkpoint.initial_load_path. None for a fresh run, and for a checkpoint
    written before checkpoints recorded model args."""
    candidates = resume_candidates(checkpoint_config, dump_folder / checkpoint_config.folder)
    if checkpoint_config.enable and candidates:
        for _, path in candidates:
            try:
                args = read_model_args(path)
            except (Exception, CheckpointException):  # noqa: BLE001 (the resume names it when it skips it)
                continue
            return StartingCheckpoint(path, args) if args is not None else None
        return None
    path = Path(checkpoint_config.initial_load_path or "")
    if checkpoint_config.initial_load_format != "dcp" or not (path / ".metadata").is_file():
        return None
    try:
        args = read_model_args(path)
    except (Exception, CheckpointException):  # noqa: BLE001 (maybe_load names it)
        return None
    return StartingCheckpoint(path, args) if args is not None else None
