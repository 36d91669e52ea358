"""Where a training step's memory goes: parameters, gradients, optimizer states, EMA, DP buffers, activations.

At each stage of a step (after init, forward, backward, optimizer step, zero_grad) a `MemoryBreakdown`
records the bytes held by each part and writes them to the run folder as JSON and a stacked-bar PNG:

    python -m torchtitan.measure --memory-breakdown [--forward-only] --job.config_file train_configs/debug_model.toml

or in a training run with `[profiling] enable_memory_breakdown = true` (the trainer calls `MemoryBreakdownObserver` at
the stages of its step).

Tensor-owned parts are counted from the tensors themselves, one count per storage (FSDP's DTensor shards
count their local, padded storage). Activations are what the step's forward and backward keep alive:
- on CUDA, the bytes requested from the caching allocator since the step began (`track()`) and still held,
  less the tensor-owned parts (so they also hold FSDP's gathered parameters and autocast's weight copies);
  compiled code allocates through the same allocator, so this sees what a TorchDispatchMode cannot. "other" is
  the rest of `torch.cuda.memory_allocated()`: the allocator's rounding of every block (a 25 MiB tensor can hold
  a 26 MiB block), and what was allocated before the step and is no part (cuBLAS's workspaces, 32 MiB for each
  thread that runs a matmul on an H100; the batch). Counting those as activations put the CS336 sizes' estimate
  20% under at context 128 (docs/benchmarks.md);
- on CPU, where no allocator keeps count, the storages created by ops during forward and backward that are
  still alive (a TorchDispatchMode sees every op, including what selective checkpointing caches), minus the
  tensor-owned parts. This is exact for eager models, which makes the breakdown testable on CPU. "other" is 0.
The bytes that autograd saves for backward (saved_tensors_hooks, unique storages) are recorded beside them.
"""

import contextlib
import json
import weakref
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

PARTS = ("parameters", "gradients", "optimizer_states", "ema", "buffers", "fsdp_gathered", "dp_buffers", "activations",
         "other")  # fmt: skip
_COLORS = dict(zip(PARTS, ("#4c72b0", "#dd8452", "#55a868", "#8172b3", "#937860", "#8c8c8c", "#da8bc3", "#c44e52",
                           "#cccccc")))  # fmt: skip


def _local(t: torch.Tensor) -> torch.Tensor:
    """The plain tensor that owns the memory: a DTensor's local shard, else the tensor."""
    return getattr(t, "_local_tensor", t)


def _storage(t: torch.Tensor):
    """The untyped storage of a tensor, or None for tensors without one (e.g. some subclasses)."""
    try:
        return _local(t).untyped_storage()
    except (RuntimeError, NotImplementedError, TypeError):
        return None


def _key(storage) -> tuple:
    # The data pointer identifies a live allocation; meta storages all sit at 0, so add the id.
    ptr = storage.data_ptr()
    return (storage.device.type, ptr if ptr else id(storage))


def storage_sizes(tensors: Iterable[torch.Tensor], device_type: str | None = None) -> dict[tuple, int]:
    """{storage key: bytes} of the distinct storages behind `tensors` (views of one storage count once).

    Args:
        tensors: tensors or DTensors (their local shards count); None entries are skipped.
        device_type: keep only storages on this device type (e.g. "cuda"); None keeps all.
    """
    sizes = {}
    for t in tensors:
        s = None if t is None else _storage(t)
        if s is not None and (device_type is None or s.device.type == device_type):
            sizes.setdefault(_key(s), s.nbytes())
    return sizes


def storage_bytes(tensors: Iterable[torch.Tensor], device_type: str | None = None) -> int:
    """Bytes of the distinct storages behind `tensors`; see storage_sizes()."""
    return sum(storage_sizes(tensors, device_type).values())


def fsdp_parameters(model: torch.nn.Module) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(sharded parameters, all-gather outputs) of the model's fully_shard-ed modules; ([], []) without FSDP.

    FSDP2 swaps a module's parameters for unsharded views of its all-gather outputs between all-gather and
    reshard; the outputs' storages are resized to 0 bytes when resharded, so counting them now gives the
    gathered bytes held now. (Reads FSDP2 internals; anything unexpected counts as no FSDP.)
    """
    sharded, gathered = [], []
    for module in model.modules():
        get_state = getattr(module, "_get_fsdp_state", None)
        if get_state is None:
            continue
        for group in getattr(get_state(), "_fsdp_param_groups", None) or []:
            for fsdp_param in group.fsdp_params:
                sharded.append(fsdp_param.sharded_param)
                gathered.extend(getattr(fsdp_param, "all_gather_outputs", None) or [])
    return sharded, gathered


def optimizer_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Every tensor in the optimizer's state (AdamW: exp_avg, exp_avg_sq and the step counters)."""
    return [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]


def _requested_bytes(device: torch.device) -> int:
    """Bytes that callers asked the CUDA caching allocator for and still hold (before its rounding to blocks)."""
    return torch.cuda.memory_stats(device)["requested_bytes.all.current"]


class LiveTensorTracker(TorchDispatchMode):
    """Follows every storage that an op creates while active; `alive()` lists those not yet freed.

    Storages are held by weak reference, so tracking never keeps memory alive. `peak` is the largest
    total of tracked live bytes seen since the last `reset_peak()`.
    """

    def __init__(self):
        super().__init__()
        self.storages: dict[tuple, weakref.ref] = {}
        self.live_bytes = 0
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._track(t)
        return out

    def _track(self, t: torch.Tensor) -> None:
        s = _storage(t)
        if s is None or s.nbytes() == 0:
            return
        key = _key(s)
        old = self.storages.get(key)
        if old is not None and old() is not None:
            return  # a view of a storage already followed
        nbytes = s.nbytes()
        self.live_bytes += nbytes
        self.peak = max(self.peak, self.live_bytes)

        def freed(_, key=key, nbytes=nbytes):
            self.live_bytes -= nbytes
            if self.storages.get(key) is ref:
                del self.storages[key]

        ref = weakref.ref(s, freed)
        self.storages[key] = ref

    def alive(self) -> list:
        return [s for s in (ref() for ref in list(self.storages.values())) if s is not None]

    def reset_peak(self) -> None:
        self.peak = self.live_bytes


class SavedTensorCounter:
    """saved_tensors_hooks that remember (weakly) the storages autograd saves for backward."""

    def __init__(self):
        self.storages: dict[tuple, weakref.ref] = {}

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        s = _storage(t)
        if s is not None:
            self.storages[_key(s)] = weakref.ref(s)
        return t

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def alive_bytes(self, exclude: set) -> int:
        live = [(k, ref()) for k, ref in list(self.storages.items())]
        return sum(s.nbytes() for k, s in live if s is not None and k not in exclude)


class MemoryBreakdown:
    """Records, per stage, the bytes of each part of a training step's memory.

    Args:
        model: the (possibly parallelized) model.
        optimizer: its optimizer (states appear after the first step).
        device: the training device.
        ema: the EMA object (its `shadow` tensors), or None.
        dp_buffer_bytes: optional callable giving the DP engine's buffers, as a byte count or as tensors.
            Tensors are excluded from activations by storage; a byte count is subtracted from the
            remainder on CUDA only (on CPU the tracker already attributes them to activations).
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, device: torch.device, ema=None,
                 dp_buffer_bytes: Callable[[], int | Iterable[torch.Tensor]] | None = None):  # fmt: skip
        self.model, self.optimizer, self.device, self.ema = model, optimizer, device, ema
        self.dp_buffer_bytes = dp_buffer_bytes
        self.records: list[dict] = []
        self.tracker = LiveTensorTracker() if device.type != "cuda" else None
        self.saved = SavedTensorCounter()
        self.outside = None  # CUDA: bytes requested before the step began that are no part (set by track())
        self._outside_step = None

    @contextlib.contextmanager
    def track(self, step: int | None = None):
        """Wrap forward and backward: follows the tensors they create and the ones autograd saves.

        step: the step the wrapped code belongs to. On CUDA the first `track` of a step (every one without a step)
        takes what is allocated and no part as the step's baseline, "other" from then on.
        """
        if self.device.type == "cuda" and (step is None or step != self._outside_step):
            torch.cuda.synchronize(self.device)
            self.outside = _requested_bytes(self.device) - sum(self._parts()[0].values())
            self._outside_step = step
        with contextlib.ExitStack() as stack:
            stack.enter_context(self.saved.hooks())
            if self.tracker is not None:
                stack.enter_context(self.tracker)
            yield

    def _parts(self) -> tuple[dict[str, int], dict[tuple, int]]:
        """Bytes per tensor-owned part, and {storage key: bytes} of all their storages."""
        sharded, gathered = fsdp_parameters(self.model)
        params = sharded + list(self.model.parameters())  # while gathered, a module shows its unsharded params
        groups = {
            "fsdp_gathered": gathered,  # first: an unsharded parameter's storage is the all-gather output
            "parameters": params,
            "gradients": [p.grad for p in params],
            "optimizer_states": optimizer_tensors(self.optimizer) if self.optimizer is not None else [],
            "ema": list(getattr(self.ema, "shadow", None) or []),
            "buffers": list(self.model.buffers()),
        }
        dp = self.dp_buffer_bytes() if self.dp_buffer_bytes is not None else 0
        if not isinstance(dp, int):
            groups["dp_buffers"] = list(dp)
        parts, owned = {"dp_buffers": dp if isinstance(dp, int) else 0}, {}
        for name, tensors in groups.items():
            # A storage shared by two parts counts in the first only.
            sizes = {k: v for k, v in storage_sizes(tensors, self.device.type).items() if k not in owned}
            parts[name] = sum(sizes.values())
            owned.update(sizes)
        return parts, owned

    def record(self, stage: str, step: int = 0) -> dict:
        """Measures the parts now and appends {"step", "stage", parts..., "total", "peak"} to `records`.

        "peak" is the most memory held since the previous record (on CPU an approximation: the tracked
        tensors at their peak plus the tensor-owned storages the tracker did not create).
        """
        parts, owned = self._parts()
        tensor_owned = sum(parts.values())
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            requested, allocated = _requested_bytes(self.device), torch.cuda.memory_allocated(self.device)
            # Before the first step nothing is an activation: what is not a part is "other".
            parts["activations"] = 0 if self.outside is None else max(0, requested - tensor_owned - self.outside)
            parts["other"] = max(0, allocated - tensor_owned - parts["activations"])
            peak = torch.cuda.max_memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            parts["other"] = 0
            parts["activations"] = sum(s.nbytes() for s in self.tracker.alive() if _key(s) not in owned)
            untracked = sum(n for k, n in owned.items() if k not in self.tracker.storages)
            peak = self.tracker.peak + untracked
            self.tracker.reset_peak()
        total = sum(parts.values())
        record = {"step": step, "stage": stage, **{p: parts[p] for p in PARTS}, "total": total,
                  "peak": max(peak, total), "saved_for_backward": self.saved.alive_bytes(set(owned))}  # fmt: skip
        self.records.append(record)
        return record

    def write(self, folder: Path, name: str = "memory_breakdown", title: str = "") -> tuple[Path, Path]:
        """Writes <name>.json and <name>.png (stacked bars, one per recorded stage) into folder."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        json_path, png_path = folder / f"{name}.json", folder / f"{name}.png"
        json_path.write_text(json.dumps({"device": self.device.type, "records": self.records}, indent=1))
        plot_breakdown(self.records, png_path, title)
        return json_path, png_path


def stacked_bars(ax, labels: list[str], records: list[dict], parts, unit: int) -> None:
    """Bars of each record's parts (in units of `unit` bytes), stacked in `parts` order; a part that is zero in
    every record gets no bar and no legend entry. Each part has one color in every figure."""
    bottom = [0.0] * len(records)
    for part in parts:
        values = [r.get(part, 0) / unit for r in records]
        if any(values):
            ax.bar(labels, values, bottom=bottom, label=part, color=_COLORS.get(part))
            bottom = [b + v for b, v in zip(bottom, values)]


def plot_breakdown(records: list[dict], path: Path, title: str = "") -> None:
    """One stacked bar per record (parts in MiB), the peak since the previous record as a marker."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on training machines
    import matplotlib.pyplot as plt

    mib = 1024**2
    labels = [f"{r['step']}:{r['stage']}" for r in records]
    fig, ax = plt.subplots(figsize=(max(6, 0.9 * len(records) + 2), 4.5))
    stacked_bars(ax, labels, records, PARTS, mib)
    ax.plot(labels, [r["peak"] / mib for r in records], "k_", markersize=18, label="peak since previous")
    ax.set_ylabel("MiB")
    ax.set_title(title or "memory by stage (step:stage)")
    ax.tick_params(axis="x", rotation=45)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def dp_buffer_reporter(private) -> Callable | None:
    """The DP engine's buffer reporter (`buffer_tensors()` or `buffer_bytes()`), if DP is on and offers one."""
    engine = getattr(private, "engine", None)
    for name in ("buffer_tensors", "buffer_bytes"):
        if callable(getattr(engine, name, None)):
            return getattr(engine, name)
    return None


class MemoryBreakdownObserver:
    """A step observer (see torchtitan/trainer.py): records the first `steps` steps a run takes (resumed or not) at
    each stage the step reports, then writes memory_breakdown.json and .png to the run folder.

    `track(step)` wraps forward and backward; `stage(name, step)` records after each stage. Steps count from 1.
    """

    def __init__(self, breakdown: MemoryBreakdown, steps: int, folder: Path, rank: int):
        self.breakdown, self.steps, self.folder, self.rank = breakdown, steps, Path(folder), rank
        self.first_step = None
        self.written = None  # (json, png) once written
        breakdown.record("init", 0)

    @classmethod
    def for_trainer(cls, trainer, steps: int, folder: Path | None = None) -> "MemoryBreakdownObserver":
        breakdown = MemoryBreakdown(trainer.model, trainer.optimizer, trainer.device, trainer.ema,
                                    dp_buffer_reporter(trainer.private))  # fmt: skip
        return cls(breakdown, steps, folder or trainer.dump_folder, trainer.rank)

    def _active(self, step: int) -> bool:
        self.first_step = step if self.first_step is None else self.first_step
        return step < self.first_step + self.steps

    def track(self, step: int):
        return self.breakdown.track(step) if self._active(step) else contextlib.nullcontext()

    def stage(self, name: str, step: int) -> None:
        if not self._active(step):
            return
        self.breakdown.record(name, step)
        if name == "zero_grad" and step == self.first_step + self.steps - 1:
            self.write()

    def write(self, name: str = "memory_breakdown", title: str = "") -> tuple[Path, Path]:
        suffix = "" if self.rank == 0 else f"_rank{self.rank}"
        self.written = self.breakdown.write(self.folder, f"{name}{suffix}", title)
        from torchtitan.tools.logging import logger

        logger.info(f"wrote the memory breakdown of {self.steps} step(s): {self.written[0]}, {self.written[1]}")
        return self.written


def format_records(records: list[dict]) -> str:
    """The records as a markdown table in MiB."""
    columns = (*PARTS, "total", "peak")
    rows = ["| step:stage | " + " | ".join(columns) + " |", "|---" * (len(columns) + 1) + "|"]
    for r in records:
        rows.append(f"| {r['step']}:{r['stage']} | " + " | ".join(f"{r[c] / 1024**2:.2f}" for c in columns) + " |")
    return "\n".join(rows)
