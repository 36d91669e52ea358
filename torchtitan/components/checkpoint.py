"""Distributed checkpoints (torch.distributed.checkpoint) that are never visible before they are whole.

A checkpoint is written to `step-N.tmp/` and renamed to `step-N/` by rank 0 only after every rank
finished writing (DCP writes `.metadata` last). A folder without `.metadata`, or one that fails to
load, is reported and skipped; the newest complete checkpoint is never deleted before a newer one
is complete.
"""

import json
import re
import shutil
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from torchtitan.tools.logging import logger
from torchtitan.tools.utils import rng_state, set_rng_state

_STEP_DIR = re.compile(r"^step-(\d+)$")


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


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


class CheckpointManager:
    """Saves and restores model, EMA, optimizer, LR scheduler, dataloader, RNG states and step."""

    def __init__(self, checkpoint_config, dump_folder: Path, model: nn.Module, optimizer, lr_scheduler, ema,
                 dataloader, rank: int, extra: dict | None = None):  # fmt: skip
        """`extra`: name -> object with state_dict()/load_state_dict(), the same on every rank (e.g. DP state)."""
        self.config = checkpoint_config
        self.extra = extra or {}
        self.folder = dump_folder / checkpoint_config.folder
        self.model, self.optimizer, self.lr_scheduler = model, optimizer, lr_scheduler
        self.ema, self.dataloader = ema, dataloader
        self.rank = rank
        self.pending = None  # (future, staging path, final path) of an async save
        self.async_group = None
        if checkpoint_config.enable and checkpoint_config.async_mode == "async" and dist.is_initialized():
            # Async saves collect on their own group so they never interleave with training collectives.
            self.async_group = dist.new_group(backend="gloo")

    # ---- state -------------------------------------------------------------------------------
    def _state(self, model_only: bool = False) -> dict:
        options = StateDictOptions(strict=True)
        state = {"model": get_model_state_dict(self.model, options=options)}
        if self.ema is not None:
            state["ema"] = self.ema.state_dict()
        if model_only:
            return state
        state["optimizer"] = get_optimizer_state_dict(self.model, self.optimizer, options=options)
        state["lr_scheduler"] = self.lr_scheduler.state_dict()
        for name, obj in self.extra.items():
            state[name] = obj.state_dict()
        # Per-rank states under per-rank keys: each rank writes and reads only its own.
        state[f"dataloader_rank{self.rank}"] = self.dataloader.state_dict()
        state[f"rng_rank{self.rank}"] = rng_state()
        return state

    # ---- save --------------------------------------------------------------------------------
    def should_save(self, step: int, last: bool) -> bool:
        return self.config.enable and (last or step % self.config.interval == 0)

    def save(self, step: int, last: bool = False, model_only: bool = False) -> None:
        self.wait()
        final = self.folder / f"step-{step}"
        staging = self.folder / f"step-{step}.tmp"
        if self.rank == 0:
            shutil.rmtree(staging, ignore_errors=True)  # a leftover of a run killed mid-save
            staging.mkdir(parents=True, exist_ok=True)
        _barrier()
        state = self._state(model_only=model_only or (last and self.config.last_save_model_only))
        state["step"] = step
        start = time.perf_counter()
        if self.async_group is not None and not last:
            future = dcp.async_save(state, checkpoint_id=str(staging), process_group=self.async_group)
            self.pending = (future, staging, final, start)
            return
        dcp.save(state, checkpoint_id=str(staging))
        self._publish(staging, final, start)

    def wait(self) -> None:
        """Finishes a pending async save (publishing it) before anything else touches the folder."""
        if self.pending is None:
            return
        future, staging, final, start = self.pending
        self.pending = None
        future.result()
        self._publish(staging, final, start)

    def _publish(self, staging: Path, final: Path, start: float) -> None:
        _barrier()  # every rank's files are written
        if self.rank == 0:
            if not (staging / ".metadata").is_file():
                raise RuntimeError(f"checkpoint {staging} has no .metadata after saving; not published")
            if final.exists():  # re-saving a step after resuming from an older one: swap, then drop the old
                old = final.with_name(final.name + ".old")
                shutil.rmtree(old, ignore_errors=True)
                final.rename(old)
                staging.rename(final)
                shutil.rmtree(old, ignore_errors=True)
            else:
                staging.rename(final)
            logger.info(f"saved checkpoint {final} in {time.perf_counter() - start:.2f}s")
            self._purge()
        _barrier()

    def _purge(self) -> None:
        k = self.config.keep_latest_k
        if k <= 0:
            return
        for _, path in complete_checkpoints(self.folder)[k:]:
            shutil.rmtree(path, ignore_errors=True)
            logger.info(f"removed old checkpoint {path} (keep_latest_k = {k})")

    # ---- load --------------------------------------------------------------------------------
    def maybe_load(self) -> int:
        """Restores the newest complete checkpoint (or checkpoint.load_step); returns the step to resume at."""
        if not self.config.enable:
            return 0
        candidates = complete_checkpoints(self.folder)
        if self.config.load_step >= 0:
            candidates = [(s, p) for s, p in candidates if s == self.config.load_step]
            if not candidates:
                raise FileNotFoundError(f"checkpoint.load_step = {self.config.load_step}: no complete checkpoint "
                                        f"step-{self.config.load_step} in {self.folder}")  # fmt: skip
        for step, path in candidates:
            try:
                self._load(path, model_only=False)
            except Exception as e:  # a corrupt checkpoint is reported and skipped, never half-applied
                logger.warning(f"checkpoint {path} could not be loaded ({type(e).__name__}: {e}): skipped")
                continue
            logger.info(f"resumed from {path} at step {step}")
            return step
        if self.config.initial_load_path:
            path = Path(self.config.initial_load_path)
            if not (path / ".metadata").is_file():
                raise FileNotFoundError(f"checkpoint.initial_load_path: {path} is not a complete checkpoint")
            self._load(path, model_only=True)
            logger.info(f"initialized model from {path}")
        return 0

    def _load(self, path: Path, model_only: bool) -> None:
        metadata = dcp.FileSystemReader(str(path)).read_metadata()
        keys = {key.split(".", 1)[0] for key in metadata.state_dict_metadata}
        has_full_state = f"dataloader_rank{self.rank}" in keys and "optimizer" in keys
        state = self._state(model_only=model_only or not has_full_state)
        if "ema" in state and "ema" not in keys:
            del state["ema"]
        for name in self.extra:
            if name in state and name not in keys:
                raise ValueError(f"checkpoint {path} has no '{name}' state (written by a run without it)")
        if not model_only:
            state["step"] = 0
        dcp.load(state, checkpoint_id=str(path))
        set_model_state_dict(self.model, state["model"], options=StateDictOptions(strict=True))
        if "ema" in state:
            self.ema.load_state_dict(state["ema"])
        if model_only or not has_full_state:
            return
        set_optimizer_state_dict(self.model, self.optimizer, state["optimizer"])
        self.lr_scheduler.load_state_dict(state["lr_scheduler"])
        self.dataloader.load_state_dict(state[f"dataloader_rank{self.rank}"])
        set_rng_state(state[f"rng_rank{self.rank}"])
        for name, obj in self.extra.items():
            obj.load_state_dict(state[name])

    # ---- export ------------------------------------------------------------------------------
    def export_ema(self, path: Path, model_args, dtype: torch.dtype) -> None:
        """Writes the EMA weights (or the live ones without EMA) as one safetensors file, atomically."""
        from safetensors.torch import save_file

        source = self.ema.state_dict() if self.ema is not None else get_model_state_dict(self.model)
        tensors = {}
        for name, tensor in source.items():
            if name == "num_updates":
                continue
            full = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor  # gathers FSDP shards
            if self.rank == 0:  # one parameter at a time, so no rank ever holds the whole model on its GPU
                tensors[name] = full.detach().to("cpu", dtype).contiguous()
            del full
        if self.rank == 0:
            tmp = path.with_suffix(".tmp")
            save_file(tensors, str(tmp), metadata={"model_args": json.dumps(model_args.__dict__)})
            tmp.replace(path)
            logger.info(f"exported {'EMA' if self.ema is not None else 'model'} weights to {path}")
        _barrier()
