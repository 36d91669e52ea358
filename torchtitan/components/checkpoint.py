"""Distributed checkpoints (torch.distributed.checkpoint) that are never visible before they are whole, never
destroyed by a run that could not use them, and never hold non-finite values.

A checkpoint is written to `step-N.tmp/` and renamed to `step-N/` by rank 0 only after every rank finished writing
(DCP writes `.metadata` last). On resume, a folder without `.metadata`, or one that fails to load (a damaged file,
another model, non-finite values), is reported by name and the next older one is tried; when checkpoints exist and
none loads, the run refuses to start rather than train from scratch over them. Checkpoints newer than the one a run
resumed from (a branch from `load_step`, or ones that failed to load) are moved aside, so a plain restart continues
this run and pruning never weighs them against its new checkpoints.

Every checkpoint records the model args that built its weights (torchtitan/components/checkpoint_model_args.py): a
resume whose model would differ is refused naming the config key.
"""

import errno
import json
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor

from torchtitan.components.checkpoint_model_args import MODEL_ARGS, model_args_record, read_model_args
from torchtitan.components.checkpoint_reader import (
    complete_checkpoints,
    load_checkpoint,
    read_checkpoint_metadata,
    resume_candidates,
)
from torchtitan.components.optimizer import written_by
from torchtitan.errors import CheckpointLoadError, ResumeRefusedError
from torchtitan.tools.logging import logger
from torchtitan.tools.utils import rng_state, set_rng_state

SET_ASIDE = "set_aside"  # sub-folder of the checkpoint folder for checkpoints a run moved out of its way


class CheckpointSaveError(RuntimeError):
    """A checkpoint could not be written; the partial folder is removed, older checkpoints are kept."""


class NonFiniteStateError(RuntimeError):
    """The training state holds NaN or inf values; it is neither saved nor exported."""


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _foreign_format(path: Path) -> str:
    """What a checkpoint.initial_load_path that is no DCP checkpoint looks like, and the format key to set; ''
    when it looks like none we read."""
    if (path / "model_index.json").is_file() or (path / "transformer" / "config.json").is_file():
        return "a diffusers pipeline folder (model_index.json): set checkpoint.initial_load_format = 'diffusers'"
    if (path / "config.json").is_file():
        return "a Hugging Face model folder (config.json): set checkpoint.initial_load_format = 'hf'"
    if path.suffix in (".pt", ".pth") and path.is_file():
        from torchtitan.models.dit.lightningdit_adapter import is_lightningdit_pt

        if is_lightningdit_pt(path):
            return "a LightningDiT .pt file: set checkpoint.initial_load_format = 'lightningdit_pt'"
        return "a facebookresearch/DiT .pt file: set checkpoint.initial_load_format = 'dit_pt'"
    return ""


def _tensors(state, prefix: str = ""):
    """(name, tensor) of every tensor in a nested state dict."""
    if isinstance(state, torch.Tensor):
        yield prefix, state
    elif isinstance(state, dict):
        for key, value in state.items():
            yield from _tensors(value, f"{prefix}.{key}" if prefix else str(key))
    elif isinstance(state, list | tuple):
        for index, value in enumerate(state):
            yield from _tensors(value, f"{prefix}.{index}")


def nonfinite_entries(state: dict) -> list[str]:
    """Names of the floating-point tensors in `state` holding NaN or inf on any rank (a collective under torchrun)."""
    locals_ = {}
    for name, tensor in _tensors(state):
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        if local.is_floating_point():
            locals_[name] = local
    if not locals_:
        return []
    # One flag per tensor, gathered on a GPU when there is one (NCCL reduces CUDA tensors only).
    device = next((t.device for t in locals_.values() if t.is_cuda), torch.device("cpu"))
    flags = torch.stack([torch.logical_not(torch.isfinite(t).all()).to(device) for t in locals_.values()]).float()
    names = list(locals_)
    if dist.is_initialized():
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    return [name for name, bad in zip(names, flags.tolist()) if bad]


def _describe_failure(error: BaseException) -> str:
    """One line for an exception, or for each rank's exception inside DCP's CheckpointException."""
    if isinstance(error, CheckpointException):
        parts = {f"{type(e).__name__}: {e}" for e, _ in error.failures.values()}
        return "; ".join(sorted(parts)) or "CheckpointException"
    return f"{type(error).__name__}: {error}"


def _save_failure_reason(error: BaseException, folder: Path, newest: Path | None) -> str:
    """Why a save failed, in words: the disk is full (ENOSPC or a quota), or a write was cut short (torch's writer
    says only "unexpected pos" then: the disk is full when less space is left than the newest checkpoint takes)."""
    errors, no_space, cut_short = [error], False, False
    if isinstance(error, CheckpointException):
        errors += [e for e, _ in error.failures.values()]
    for e in errors:
        while e is not None:
            no_space |= isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT)
            no_space |= "No space left" in str(e)
            cut_short |= "unexpected pos" in str(e) or "file write failed" in str(e)
            e = e.__cause__ or e.__context__
    free = shutil.disk_usage(folder).free
    needed = sum(f.stat().st_size for f in newest.iterdir()) if newest is not None else 0
    where = f"{free / 1024**2:.1f} MiB free in {folder}"
    if no_space or (cut_short and free < needed):
        return f"the disk is full ({where})"
    if cut_short:
        detail = _describe_failure(error)
        return f"a write was cut short: out of space, a quota or a file-size limit ({where}; {detail})"
    return _describe_failure(error)


def _check_optimizer(saved_keys, optimizer) -> None:
    """Raises ValueError, naming optimizer.name, when the checkpoint's optimizer is not the configured one."""
    current = type(optimizer).__name__
    group_keys = {k.rsplit(".", 1)[-1] for k in saved_keys if k.startswith("optimizer.param_groups.")}
    other = written_by(group_keys) - {current}
    if other:
        name = min(other)
        raise ValueError(f"it was written with optimizer.name = {name!r}, this run has {current!r}: resume with "
                         f"{name!r}, or start a new dump_folder from it (checkpoint.initial_load_path loads the "
                         "weights only)")  # fmt: skip


class CheckpointManager:
    """Saves and restores model, EMA, optimizer, LR scheduler, dataloader, RNG states and step.

    Shared by every rank: model, EMA, optimizer (DCP reshards them), LR scheduler, step and `extra`. Per rank:
    the data-loader position and the RNG states, under rank-suffixed keys. Resumed with another number of ranks,
    every rank loads the shared state; the data loaders restart the epoch in progress from its start (rank 0's
    epoch; a position inside an epoch has no meaning for another split of the data), and a rank with no saved RNG
    state keeps its freshly seeded one.
    """

    def __init__(self, checkpoint_config, dump_folder: Path, model: nn.Module, optimizer, lr_scheduler, ema,
                 dataloader, rank: int, world_size: int = 1, extra: dict | None = None,
                 foreign: dict[str, str] | None = None, model_args=None,
                 arg_key: Callable[[str], str] | None = None):  # fmt: skip
        """`extra`: name -> object with state_dict()/load_state_dict(), the same on every rank (e.g. DP state); one
        with `optional_in_checkpoint = True` is skipped when a checkpoint lacks it (written before it existed), and
        the top-level entries of its state named in `optional_keys` are left out when a checkpoint lacks them.
        Extras load before the optimizer and the data loader; one whose `keeps_data_position` is False after its
        load_state_dict (the data changed) makes the loaders restart the saved epoch from its start.
        `foreign`: top-level checkpoint keys this run would drop, each with the refusal to raise
        (ResumeRefusedError) when a full checkpoint holds it.
        `model_args`: the args that built the model (a dataclass), recorded in every checkpoint; a resume from a
        checkpoint recording others is refused (ResumeRefusedError), naming `arg_key(arg)`, the config key that
        sets a differing arg (default: model.flavor)."""
        self.config = checkpoint_config
        self.model_args = model_args
        self.arg_key = arg_key or (lambda arg: "model.flavor")
        self.extra = extra or {}
        self.foreign = foreign or {}
        self.folder = dump_folder / checkpoint_config.folder
        self.model, self.optimizer, self.lr_scheduler = model, optimizer, lr_scheduler
        self.ema, self.dataloader = ema, dataloader
        self.rank, self.world_size = rank, world_size
        self.resumed_from: Path | None = None  # never pruned by this run
        self.pending = None  # (future, staging path, final path, start time) of an async save
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
        if self.model_args is not None:  # one JSON string: a load takes the keys it holds, whatever they are
            state[MODEL_ARGS] = {"json": json.dumps(model_args_record(self.model_args), sort_keys=True)}
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

    def newest_complete(self) -> Path | None:
        found = complete_checkpoints(self.folder) if self.config.enable else []
        return found[0][1] if found else None

    # ---- save --------------------------------------------------------------------------------
    def should_save(self, step: int, last: bool) -> bool:
        return self.config.enable and (last or step % self.config.interval == 0)

    def save(self, step: int, last: bool = False, model_only: bool = False) -> None:
        """Writes step-N (never a non-finite state); raises CheckpointSaveError, keeping older checkpoints."""
        self.wait()
        state = self._state(model_only=model_only or (last and self.config.last_save_model_only))
        bad = nonfinite_entries(state)
        if bad:
            raise NonFiniteStateError(f"step {step}: not saving a checkpoint: non-finite values in {bad[:5]}"
                                      f"{' ...' if len(bad) > 5 else ''}")  # fmt: skip
        state["step"] = step
        final = self.folder / f"step-{step}"
        staging = self.folder / f"step-{step}.tmp"
        if self.rank == 0:
            shutil.rmtree(staging, ignore_errors=True)  # a leftover of a run killed mid-save
            staging.mkdir(parents=True, exist_ok=True)
        _barrier()
        start = time.perf_counter()
        if self.async_group is not None and not last:
            future = dcp.async_save(state, checkpoint_id=str(staging), process_group=self.async_group)
            self.pending = (future, staging, final, start)
            return
        self._guarded(lambda: dcp.save(state, checkpoint_id=str(staging)), staging)
        self._publish(staging, final, start)

    def wait(self) -> None:
        """Finishes a pending async save (publishing it) before anything else touches the folder."""
        if self.pending is None:
            return
        future, staging, final, start = self.pending
        self.pending = None
        self._guarded(future.result, staging)
        self._publish(staging, final, start)

    def _guarded(self, write, staging: Path) -> None:
        """Runs a write; on failure removes the partial folder and raises CheckpointSaveError saying why."""
        try:
            write()
        except (Exception, CheckpointException) as e:
            if self.rank == 0:
                shutil.rmtree(staging, ignore_errors=True)
            newest = self.newest_complete()
            kept = f"the newest complete checkpoint is {newest}" if newest else "there is no older checkpoint"
            reason = _save_failure_reason(e, self.folder, newest)
            raise CheckpointSaveError(f"checkpoint {staging.name[: -len('.tmp')]} could not be written: {reason}. "
                                      f"Removed the partial {staging}; {kept}.") from e  # fmt: skip

    def _publish(self, staging: Path, final: Path, start: float) -> None:
        _barrier()  # every rank's files are written
        if self.rank == 0:
            if not (staging / ".metadata").is_file():
                shutil.rmtree(staging, ignore_errors=True)
                raise CheckpointSaveError(f"checkpoint {staging} has no .metadata after saving; removed it")
            if final.exists():  # re-saving a step after resuming from an older one: swap, then drop the old
                old = final.with_name(final.name + ".old")
                shutil.rmtree(old, ignore_errors=True)
                final.rename(old)
                staging.rename(final)
                shutil.rmtree(old, ignore_errors=True)
            else:
                staging.rename(final)
            logger.info(f"saved checkpoint {final} in {time.perf_counter() - start:.2f}s")
            self._purge(keep={final, self.resumed_from})
        _barrier()

    def _purge(self, keep: set) -> None:
        """Drops all but the newest keep_latest_k complete checkpoints, never one in `keep`."""
        k = self.config.keep_latest_k
        if k <= 0:
            return
        for _, path in complete_checkpoints(self.folder)[k:]:
            if path in keep:
                continue
            shutil.rmtree(path, ignore_errors=True)
            logger.info(f"removed old checkpoint {path} (keep_latest_k = {k})")

    # ---- load --------------------------------------------------------------------------------
    def maybe_load(self) -> int:
        """Restores the newest loadable checkpoint (or checkpoint.load_step); returns the step to resume at. With
        none to resume (or checkpoint.enable false), the weights of a DCP checkpoint.initial_load_path: starting
        weights are independent of saving.

        Raises:
            CheckpointLoadError: checkpoints exist and none loads (each is named with its reason), or
                `load_step` names one that does not exist or does not load, or initial_load_path does not load.
        """
        step = self._resume() if self.config.enable else None
        if step is not None:
            return step
        if self.config.initial_load_path and self.config.initial_load_format == "dcp":  # others: the Trainer's
            path = Path(self.config.initial_load_path)
            if not (path / ".metadata").is_file():
                looks = _foreign_format(path)
                raise CheckpointLoadError(f"checkpoint.initial_load_path: {path} is not a DCP checkpoint (no .metadata)"
                                          f"{f'; it looks like {looks}' if looks else ''}")  # fmt: skip
            error = self._try_load(path, model_only=True)
            if error is not None:
                raise CheckpointLoadError(f"checkpoint.initial_load_path: {path} could not be loaded ({error})")
            logger.info(f"initialized model from {path}")
        return 0

    def _resume(self) -> int | None:
        """The step of the checkpoint this run resumed from, or None when the run has none of its own."""
        candidates = resume_candidates(self.config, self.folder)
        if self.config.load_step >= 0 and not candidates:
            raise CheckpointLoadError(f"checkpoint.load_step = {self.config.load_step}: no complete checkpoint "
                                      f"step-{self.config.load_step} in {self.folder}")  # fmt: skip
        failures = []
        for step, path in candidates:
            error = self._try_load(path)
            if error is not None:
                logger.warning(f"checkpoint {path} could not be loaded ({error}): skipped")
                failures.append(f"{path}: {error}")
                continue
            logger.info(f"resumed from {path} at step {step}")
            self.resumed_from = path
            self._set_aside_newer_than(step)
            return step
        if failures:
            raise CheckpointLoadError(
                "checkpoints exist but none could be loaded, so the run does not start (it would train from scratch "
                "and its pruning and saves would remove them):\n  " + "\n  ".join(failures)
            )
        return None

    def _try_load(self, path: Path, model_only: bool = False) -> str | None:
        """Loads a checkpoint; returns why it could not be (the same answer on every rank), or None."""
        error = None
        try:
            self._load(path, model_only)
        except ResumeRefusedError:
            raise  # about the configuration, not this checkpoint: the same on every rank
        except (Exception, CheckpointException) as e:  # DCP's CheckpointException is not an Exception
            error = _describe_failure(e).splitlines()[0]
        if dist.is_initialized():  # a failure on one rank fails the checkpoint for all
            failed = torch.tensor([float(error is not None)], device=self._device())
            dist.all_reduce(failed, op=dist.ReduceOp.MAX)
            if failed.item() and error is None:
                error = "it failed to load on another rank"
        return error

    def _device(self) -> torch.device:
        param = next(self.model.parameters())
        return param.device if param.device.type != "meta" else torch.device("cpu")

    def _set_aside_newer_than(self, step: int) -> None:
        """Moves complete checkpoints newer than `step` into set_aside/: a restart continues from this run's."""
        newer = [p for s, p in complete_checkpoints(self.folder) if s > step]
        if newer and self.rank == 0:
            stamp = time.strftime("%Y%m%d-%H%M%S")
            for path in newer:
                target = self.folder / SET_ASIDE / f"{path.name}.{stamp}"
                target.parent.mkdir(exist_ok=True)
                path.rename(target)
            names = ", ".join(p.name for p in newer)
            logger.warning(f"resumed from step {step} while newer checkpoints exist ({names}): moved them to "
                           f"{self.folder / SET_ASIDE}, so that a restart continues this run")  # fmt: skip
        _barrier()

    def _check_model_args(self, path: Path) -> None:
        """Raises ResumeRefusedError naming the config key of the first arg (one a key sets directly first) whose
        value the checkpoint records otherwise, and both values."""
        saved, ours = read_model_args(path), model_args_record(self.model_args)
        differ = [arg for arg in ours if saved is not None and arg in saved and saved[arg] != ours[arg]]
        if not differ:
            return
        arg = min(differ, key=lambda a: self.arg_key(a) == "model.flavor")  # the first of those a key sets directly
        raise ResumeRefusedError(f"checkpoint {path}: {self.arg_key(arg)}: it was built with {arg} {saved[arg]!r}, "
                                 f"this run's config gives {ours[arg]!r}: resume with the checkpoint's, or start a "
                                 "new job.dump_folder from its weights (checkpoint.initial_load_path)")  # fmt: skip

    def _load(self, path: Path, model_only: bool) -> None:
        metadata = read_checkpoint_metadata(path)
        keys = {key.split(".", 1)[0] for key in metadata.state_dict_metadata}
        full = not model_only and "optimizer" in keys  # a model-only checkpoint gives weights, no training state
        if not model_only and MODEL_ARGS in keys and self.model_args is not None:  # a resume: the same model
            self._check_model_args(path)
        if full:
            _check_optimizer(metadata.state_dict_metadata, self.optimizer)
        state = self._state(model_only=not full)
        for name in ("ema", MODEL_ARGS):  # a seed checkpoint has no EMA; older ones no model args
            if name in state and name not in keys:
                del state[name]
        refused = sorted(keys & self.foreign.keys()) if full else []
        if refused:
            raise ResumeRefusedError(f"checkpoint {path}: {self.foreign[refused[0]]}")
        for name, obj in self.extra.items():
            if name in state and name not in keys:
                if getattr(obj, "optional_in_checkpoint", False):
                    del state[name]
                    continue
                raise ValueError(f"checkpoint has no '{name}' state (written by a run without it)")
            for key in getattr(obj, "optional_keys", ()) if name in state else ():  # entries added since
                if not any(k.startswith(f"{name}.{key}") for k in metadata.state_dict_metadata):
                    del state[name][key]
        if full:
            state.pop(f"dataloader_rank{self.rank}")
            state.pop(f"rng_rank{self.rank}")
            saved_ranks = sorted(int(k[len("dataloader_rank") :]) for k in keys if k.startswith("dataloader_rank"))
            same_layout = len(saved_ranks) == self.world_size
            loader_key = f"dataloader_rank{self.rank}" if same_layout else f"dataloader_rank{saved_ranks[0]}"
            state[loader_key] = self.dataloader.state_dict()
            rng_key = f"rng_rank{self.rank}" if f"rng_rank{self.rank}" in keys else None
            if rng_key is not None:
                state[rng_key] = rng_state()
            state["step"] = 0
        load_checkpoint(state, path)
        bad = nonfinite_entries({k: state[k] for k in ("model", "ema", "optimizer") if k in state})
        if bad:
            raise ValueError(f"non-finite values in {bad[:5]}{' ...' if len(bad) > 5 else ''}")
        set_model_state_dict(self.model, state["model"], options=StateDictOptions(strict=True))
        if "ema" in state:
            self.ema.load_state_dict(state["ema"])
        elif self.ema is not None:  # a checkpoint without EMA (a seed checkpoint): the average starts at its weights
            self.ema.reset_to_model()
        if not full:
            return
        for name, obj in self.extra.items():  # first: one may refuse the resume, or void the saved data position
            if name in state:
                obj.load_state_dict(state[name])
        position_holds = all(getattr(obj, "keeps_data_position", True) for obj in self.extra.values())
        set_optimizer_state_dict(self.model, self.optimizer, state["optimizer"])
        self.lr_scheduler.load_state_dict(state["lr_scheduler"])
        self.dataloader.load_state_dict(state[loader_key], same_layout=same_layout and position_holds)
        if not same_layout:
            logger.warning(f"checkpoint {path} was written by {len(saved_ranks)} rank(s), this run has "
                           f"{self.world_size}: the data order restarts the epoch in progress")  # fmt: skip
        if rng_key is not None:
            set_rng_state(state[rng_key])

    # ---- export ------------------------------------------------------------------------------
    def export_ema(self, path: Path, model_args, dtype: torch.dtype, sampling_export=None) -> None:
        """Writes the EMA weights (or the live ones without EMA) as one safetensors file, atomically; never
        non-finite ones (NonFiniteStateError). `sampling_export`: the family's TrainSpec.sampling_export_fn, which
        leaves out what only trains (the export is for sampling)."""
        from safetensors.torch import save_file

        source = self.ema.state_dict() if self.ema is not None else get_model_state_dict(self.model)
        source = {name: tensor for name, tensor in source.items() if name != "num_updates"}
        if sampling_export is not None:  # the same names on every rank: each gathers its shards below
            model_args, kept = sampling_export(model_args, list(source))
            source = {name: source[name] for name in kept}
        bad = nonfinite_entries(source)
        if bad:
            raise NonFiniteStateError(f"not exporting {path}: non-finite values in {bad[:5]}")
        tensors = {}
        for name, tensor in source.items():
            full = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor  # gathers FSDP shards
            if self.rank == 0:  # one parameter at a time, so no rank ever holds the whole model on its GPU
                tensors[name] = full.detach().to("cpu", dtype).contiguous()
            del full
        if self.rank == 0:
            tmp = path.with_suffix(".tmp")
            save_file(tensors, str(tmp), metadata={MODEL_ARGS: json.dumps(model_args_record(model_args))})
            tmp.replace(path)
            logger.info(f"exported {'EMA' if self.ema is not None else 'model'} weights to {path}")
        _barrier()
