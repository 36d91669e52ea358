"""DCP checkpoints found and read without running code from them.

torch's DCP reads a checkpoint's `.metadata` with a plain `pickle.load` (FileSystemReader.read_metadata) and its byte
entries (the non-tensor values of a state dict) with `torch.load(weights_only=False)` (DefaultLoadPlanner.load_bytes):
a crafted checkpoint folder runs code the moment it is loaded. SafeFileSystemReader and SafeLoadPlanner read both
through an allow-list (torchtitan/tools/safe_pickle.py); tensors are already read weights-only by torch. Every load
of a checkpoint goes through `read_checkpoint_metadata` and `load_checkpoint`: resume, `initial_load_path`,
sample.py.
"""

import re
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from torchtitan.tools import safe_pickle
from torchtitan.tools.logging import logger

_STEP_DIR = re.compile(r"^step-(\d+)$")
_DCP_METADATA_CLASSES = ("Metadata", "MetadataIndex", "StorageMeta", "ChunkStorageMetadata", "TensorProperties",
                         "TensorStorageMetadata", "BytesStorageMetadata", "_MEM_FORMAT_ENCODING")  # fmt: skip

# The globals a checkpoint's pickles may name: `.metadata` (DCP's metadata classes, torch sizes, dtypes and layouts,
# the checkpoint's path) and the byte entries (the loader, RNG, LR scheduler and DP states, torch.save'd: plain
# containers and numpy's RNG arrays; bytes in protocol 2 come through _codecs.encode, and a tensor inside a tuple
# through _rebuild_tensor_v2, as torch's own weights-only loader admits). Traced from the checkpoints the trainer
# writes (DiT with EMA, DP-SGD, Llama 3, async saves). Anything else could run code.
CHECKPOINT_PICKLE_GLOBALS = frozenset(
    {
        *(("torch.distributed.checkpoint.metadata", name) for name in _DCP_METADATA_CLASSES),
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch", "Size"),
        *(("torch", name) for name, value in vars(torch).items() if isinstance(value, torch.dtype)),
        ("torch.serialization", "_get_layout"),
        ("torch._utils", "_rebuild_tensor_v2"),
        *((module, name) for module in ("pathlib", "pathlib._local") for name in ("PosixPath", "WindowsPath")),
        ("collections", "OrderedDict"),
        ("builtins", "set"),
        ("builtins", "frozenset"),
        ("_codecs", "encode"),
        *safe_pickle.NUMPY_ARRAY_GLOBALS,
    }
)


class SafeFileSystemReader(FileSystemReader):
    """DCP's file reader, reading `.metadata` through CHECKPOINT_PICKLE_GLOBALS instead of a plain pickle.load."""

    def read_metadata(self, *args, **kwargs) -> Metadata:
        rank = kwargs.get("rank")  # set when DCP reads per-rank metadata (no collectives)
        path = Path(self.path) / (".metadata" if rank is None else f"__{rank}.metadata")
        with open(path, "rb") as f:
            metadata = safe_pickle.load(f, CHECKPOINT_PICKLE_GLOBALS, f"checkpoint {path}", "a checkpoint")
        if not isinstance(metadata, Metadata):
            raise ValueError(f"checkpoint {path} holds a {type(metadata).__name__}, not DCP metadata")
        if getattr(metadata, "storage_meta", None) is None:  # as FileSystemReader.read_metadata does
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, reading byte entries (torch.save'd non-tensor values) through
    CHECKPOINT_PICKLE_GLOBALS instead of `torch.load(weights_only=False)`."""

    def __init__(self, path: Path):
        super().__init__()
        self.path = path

    def load_bytes(self, read_item, value) -> None:
        fqn = read_item.dest_index.fqn
        source = f"checkpoint {self.path} entry '{fqn}'"
        loaded = safe_pickle.torch_load(value, CHECKPOINT_PICKLE_GLOBALS, source, "a checkpoint")
        if not self.flatten_state_dict:
            self.state_dict[fqn] = loaded
            return
        # The entry's place in the nested state dict: flattening derived it from that dict, so the path exists.
        *parents, last = self.mappings[fqn]
        container = self.original_state_dict
        for key in parents:
            container = container[key]
        container[last] = loaded


def read_checkpoint_metadata(path: Path) -> Metadata:
    """The DCP metadata of a checkpoint folder, read safely.

    Raises:
        UnsafePickleError: `.metadata` names a global a checkpoint may not hold (nothing it names was called).
    """
    return SafeFileSystemReader(str(path)).read_metadata()


def load_checkpoint(state: dict, path: Path, no_dist: bool = False) -> None:
    """`dcp.load(state)` from a checkpoint folder through SafeFileSystemReader and SafeLoadPlanner; `no_dist`: this
    rank alone reads it (no collective), as DCP's own argument.

    Raises:
        UnsafePickleError: a pickle of the checkpoint names a global it may not hold; raised as is, not inside
            DCP's CheckpointException, so that callers name it.
    """
    try:
        dcp.load(state, checkpoint_id=str(path), storage_reader=SafeFileSystemReader(str(path)),
                 planner=SafeLoadPlanner(path), no_dist=no_dist)  # fmt: skip
    except CheckpointException as e:
        unsafe = [error for error, _ in e.failures.values() if isinstance(error, safe_pickle.UnsafePickleError)]
        if unsafe:
            raise unsafe[0] from e
        raise


def complete_checkpoints(folder: Path) -> list[tuple[int, Path]]:
    """(step, path) of complete checkpoints, newest first; incomplete ones are reported."""
    if not folder.is_dir():
        return []
    found = []
    for path in folder.iterdir():
        match = _STEP_DIR.match(path.name)
        if not match or not path.is_dir():
            continue
        if not (path / ".metadata").is_file():
            logger.warning(f"checkpoint {path} is incomplete (no .metadata): skipped")
            continue
        found.append((int(match.group(1)), path))
    return sorted(found, reverse=True)


def resume_candidates(checkpoint_config, folder: Path) -> list[tuple[int, Path]]:
    """(step, path) of the checkpoints a resume tries, in order: the complete ones, newest first, or only
    `load_step`'s (none when it names no complete one)."""
    candidates = complete_checkpoints(folder)
    if checkpoint_config.load_step >= 0:
        candidates = [(s, p) for s, p in candidates if s == checkpoint_config.load_step]
    return candidates
