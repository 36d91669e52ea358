"""The memory estimator every model family shares: precision rules, activation checkpointing, compile, FSDP and DDP.

A family describes one model under one precision as a `ModelMemory`: its parameter shapes, the `SavedTensor` rows
one block keeps for backward and those its head keeps, the weights autocast casts, rough backward working sets.
`estimate_model_memory` turns that into the bytes of each part on one rank, the peak and a derivation a study can
print (`MemoryEstimate.lines`). The families: the DiT (torchtitan/tools/memory_estimate.py, which is also the
front door: `estimate_from_job_config` and the CLI) and Llama 3 (torchtitan/tools/memory_estimate_llama3.py).

Exact by construction: parameter, gradient, AdamW and EMA bytes, FSDP's shards (`shard_numel`) and gathered
parameters. Activations are as exact as a family's rows: each family says where they were measured.
"""

import math
from dataclasses import dataclass, field

from torchtitan.parallelisms.utils import blocks_per_unit, checkpointed_blocks, fsdp_units, reshards_after_forward

PRECISIONS = ("fp32", "bf16_autocast", "bf16_fsdp")
MIB, GIB = 1024**2, 1024**3


def shard_numel(shape: tuple[int, ...], world: int, rank: int) -> tuple[int, int]:
    """(local, padded) elements of one parameter on `rank` of a `world`-way fully_shard.

    fully_shard cuts dim 0 with torch.chunk (chunks of ceil(rows / world) rows; the last ranks may get
    fewer or none) and pads every rank's storage to the first chunk's size.
    """
    rows, rest = shape[0], math.prod(shape[1:])
    chunk = -(-rows // world)
    local_rows = max(0, min(chunk, rows - rank * chunk))
    return local_rows * rest, chunk * rest


@dataclass(frozen=True)
class SavedTensor:
    """One tensor kept for backward, per image (per sample). `rule` picks its dtype: see `element_bytes`."""

    name: str
    elements: int
    rule: str = "compute"  # "compute" | "fp32" | "stream" | "norm_in" | "norm_out"
    eager: bool = True
    compiled: bool = True
    selective: bool = False  # kept by per-op selective AC: outputs of matmuls and attention, and the block input
    per_batch: bool = False  # one tensor per batch whatever its size (a mask, a scalar), not one per sample


def element_bytes(rule: str, precision: str, compiled: bool) -> int:
    """Bytes per element of a saved tensor under a precision and execution mode.

    "compute" is the matmul dtype (bf16 unless fp32). Norms: under bf16 autocast, eager runs them in fp32
    (autocast's fp32 list), so the norm's saved input and output are fp32 copies; compiled code saves the
    bf16 input and recomputes the upcast. Under bf16 FSDP parameters there is no autocast: all bf16.
    "stream" is a residual stream that starts at an embedding lookup (Llama 3): fp32 under autocast, which leaves
    the lookup and the residual adds in the weights' dtype, and bf16 only when the parameters are (bf16 FSDP).
    """
    compute = 4 if precision == "fp32" else 2
    if rule == "fp32":
        return 4
    if rule == "stream":
        return 2 if precision == "bf16_fsdp" else 4
    if rule in ("norm_in", "norm_out") and precision == "bf16_autocast" and not compiled:
        return 4
    return compute


def _kept(r: SavedTensor, compiled: bool, selective: bool) -> bool:
    return r.selective if selective else (r.compiled if compiled else r.eager)


def _kept_bytes(r: SavedTensor, precision: str, compiled: bool, selective: bool) -> int:
    """Bytes of one kept row (per sample, or per batch for a per_batch row)."""
    if selective:  # the checkpoint keeps the block input and the ops' outputs in the dtype they come in
        return r.elements * element_bytes(r.rule if r.rule in ("fp32", "stream") else "compute", precision, False)
    return r.elements * element_bytes(r.rule, precision, compiled)


def saved_bytes_per_image(rows: list[SavedTensor], precision: str, compiled: bool, selective: bool = False) -> int:
    """Bytes per image (per sample) of the rows kept under this mode (selective: the rows per-op selective AC keeps);
    per_batch rows are left to `saved_bytes_per_batch`."""
    return sum(_kept_bytes(r, precision, compiled, selective) for r in rows
               if not r.per_batch and _kept(r, compiled, selective))  # fmt: skip


def saved_bytes_per_batch(rows: list[SavedTensor], precision: str, compiled: bool, selective: bool = False) -> int:
    """Bytes of the per_batch rows kept under this mode, once per batch whatever its size."""
    return sum(_kept_bytes(r, precision, compiled, selective) for r in rows
               if r.per_batch and _kept(r, compiled, selective))  # fmt: skip


@dataclass
class MemoryEstimate:
    """Bytes per part on one rank, the peak, and the derivation as text lines."""

    parts: dict[str, int] = field(default_factory=dict)
    peak: int = 0
    lines: list[str] = field(default_factory=list)

    def report(self) -> str:
        table = [f"  {name:<22} {value / GIB:10.3f} GiB" for name, value in self.parts.items()]
        table.append(f"  {'peak (estimate)':<22} {self.peak / GIB:10.3f} GiB")
        return "\n".join([*self.lines, "", "per rank:", *table])


def fmt_bytes(nbytes: float) -> str:
    """Bytes as MiB, or GiB from 1 GiB up, for derivation lines."""
    return f"{nbytes / GIB:.3f} GiB" if nbytes >= GIB else f"{nbytes / MIB:.2f} MiB"


@dataclass
class ModelMemory:
    """What the estimator needs to know of one model family under one precision: `dit_model_memory`,
    memory_estimate_llama3.llama3_model_memory. Byte counts per sample unless said otherwise."""

    shapes: dict[str, tuple[int, ...]]  # every parameter by name (a tied one once)
    block_prefix: str  # "blocks." / "layers.": what FSDP and AC wrap one by one, "<prefix><i>."
    depth: int
    tokens: int  # T and D of one residual-stream tensor, for the derivation
    dim: int
    buffer_bytes: int  # fp32 buffers (position and RoPE tables)
    block_rows: list[SavedTensor]  # one block, no checkpointing (see block_saved_tensors)
    head_rows: list[SavedTensor]  # outside the blocks: embeddings, final layer, loss (always eager)
    block_input: SavedTensor  # all a fully checkpointed block keeps: its input
    matmul_weights: dict[str, int]  # elements of each weight autocast casts to bf16 (and keeps for backward)
    block_working: int  # backward's working set in a block (gradients of its largest tensors), rough
    head_working: int = 0  # backward's working set at the loss (a vocabulary-sized gradient), rough
    extra_per_sample: int = 0  # bytes kept beside the rows (the DiT's gate_mlp copies under fused_norm)
    checkpoint_extra: int = 0  # bytes per batch a checkpoint keeps besides the block input (a mask argument)
    header: list[str] = field(default_factory=list)  # derivation lines before the block's rows
    notes: list[str] = field(default_factory=list)  # derivation lines after the tally of blocks
    block_name: str = "DiTBlock"
    head_name: str = "embedders, final layer, loss"
    sample: str = "image"


def _state_parts(model: ModelMemory, shard: int, rank: int, ema: bool, optimizer: tuple[str, float],
                 lines: list[str]) -> dict[str, int]:  # fmt: skip
    """Exact parameter, gradient, optimizer-state and EMA bytes of one rank (all fp32 master tensors).

    optimizer: (optimizer.name, optimizer.momentum): AdamW keeps two fp32 states and a step counter per tensor,
    SGD a momentum buffer when momentum > 0, else nothing.
    """
    shapes = model.shapes
    numel = sum(math.prod(s) for s in shapes.values())
    local = padded = numel
    if shard > 1:
        per = [shard_numel(s, shard, rank) for s in shapes.values()]
        local, padded = sum(p[0] for p in per), sum(p[1] for p in per)
        lines.append(f"FSDP over {shard} ranks, rank {rank}: {local:,} local elements, {padded:,} padded "
                     "(dim-0 chunks of ceil(rows / ranks), storage padded to the first chunk)")  # fmt: skip
    lines.append(f"parameters: {numel:,} in {len(shapes)} tensors, fp32 master weights = {padded:,} x 4 B")
    lines.append("gradients: fp32 like the parameters (under FSDP one padded reduce-scatter output per block)")
    parts = {"parameters": 4 * padded, "gradients": 4 * padded}
    name, momentum = optimizer
    if name == "AdamW":
        lines.append(f"AdamW: exp_avg + exp_avg_sq = 2 x {local:,} x 4 B, + one fp32 step counter per tensor")
        parts["optimizer_states"] = 8 * local + 4 * len(shapes)
    elif name == "SGD":
        lines.append(f"SGD: a momentum buffer = {local:,} x 4 B" if momentum else "SGD without momentum: no state")
        parts["optimizer_states"] = 4 * local if momentum else 0
    else:
        raise ValueError(f"no memory estimate for optimizer.name {name!r} (known: 'AdamW', 'SGD')")
    if ema:
        lines.append(f"EMA: an fp32 clone of every (local) parameter = {local:,} x 4 B")
        parts["ema"] = 4 * local
    parts["buffers"] = model.buffer_bytes
    return parts


def _blocks_with_ac(depth: int, ac_mode: str, ac_option: str) -> list[str]:
    """Per block: "none", "full" or "selective" (per op), as apply_ac wraps them."""
    wrapped = "selective" if ac_mode == "selective" and ac_option == "op" else "full"
    return [wrapped if checkpointed else "none" for checkpointed in checkpointed_blocks(depth, ac_mode, ac_option)]


def _row_lines(rows: list[SavedTensor], batch: int, precision: str, compiled: bool) -> list[str]:
    """One derivation line per row: kept or recomputed, elements x bytes, bytes for the batch."""
    lines = []
    for r in rows:
        kept = r.compiled if compiled else r.eager
        nbytes = element_bytes(r.rule, precision, compiled)
        total = r.elements * nbytes * (1 if r.per_batch else batch)
        lines.append(f"  {'kept' if kept else 'recomputed':<10} {r.name:<78} {r.elements:>11,} x {nbytes} B"
                     f" = {(fmt_bytes(total) + (' per batch' if r.per_batch else '')) if kept else '-'}")  # fmt: skip
    return lines


def _activation_parts(model: ModelMemory, batch: int, precision: str, ac: tuple[str, str], compiled: bool,
                      lines: list[str]) -> dict[str, int]:  # fmt: skip
    """Bytes kept from forward to backward, and the extra a backward step needs at its peak."""
    D, T, B, per = model.dim, model.tokens, batch, model.sample
    stream = element_bytes(model.block_input.rule, precision, False)
    rows = model.block_rows
    mode = "compiled (inductor partitioner)" if compiled else "eager"
    lines.extend(model.header)
    lines.append(f"one residual-stream tensor = B x T x D x bytes = {B} x {T} x {D} x {stream} B = "
                 f"{fmt_bytes(B * T * D * stream)}")  # fmt: skip
    lines.append(f"saved per {model.block_name} ({mode}, {precision}), per {per} and for the batch of {B}:")
    lines.extend(_row_lines(rows, B, precision, compiled))
    per_block = {
        "none": saved_bytes_per_image(rows, precision, compiled),
        "selective": saved_bytes_per_image(rows, precision, compiled, selective=True),
        "full": model.block_input.elements * stream,  # the checkpoint keeps the block input only
    }
    per_batch = {
        "none": saved_bytes_per_batch(rows, precision, compiled),
        "selective": saved_bytes_per_batch(rows, precision, compiled, selective=True),
        "full": 0,
    }
    units = per_block["none"] / (T * D * stream)
    lines.append(f"  = {fmt_bytes(per_block['none'])} per {per} per block, {units:.2f} residual-stream tensors"
                 + (f", + {fmt_bytes(per_batch['none'])} per batch" if per_batch["none"] else ""))  # fmt: skip
    kinds = _blocks_with_ac(model.depth, *ac)
    counts = {k: kinds.count(k) for k in ("none", "selective", "full") if kinds.count(k)}
    lines.append(f"blocks by activation checkpointing {counts}: "
                 + ", ".join(f"{k} keeps {fmt_bytes(per_block[k])}/{per}" for k in counts))  # fmt: skip
    blocks = sum(per_block[k] for k in kinds) + model.extra_per_sample
    fixed = sum(per_batch[k] for k in kinds)
    if model.checkpoint_extra and counts.keys() - {"none"}:
        fixed += model.checkpoint_extra
        lines.append(f"the checkpoints' other arguments (kept once): {fmt_bytes(model.checkpoint_extra)} per batch")
    lines.extend(model.notes)
    head = saved_bytes_per_image(model.head_rows, precision, compiled=False)  # blocks compile only
    fixed += saved_bytes_per_batch(model.head_rows, precision, compiled=False)
    lines.append(f"outside the blocks ({model.head_name}; eager): {fmt_bytes(head)}/{per}")
    lines.extend(_row_lines(model.head_rows, B, precision, compiled=False))
    parts = {"activations": B * (blocks + head) + fixed}
    lines.append(f"activations = {B} x ({fmt_bytes(blocks)} + {fmt_bytes(head)})"
                 + (f" + {fmt_bytes(fixed) if fixed >= MIB else f'{fixed:,} B'} per batch" if fixed else "")
                 + f" = {fmt_bytes(parts['activations'])} ({fmt_bytes(blocks + head)} per {per})")  # fmt: skip
    if precision == "bf16_autocast":
        # autocast caches the bf16 copy of each weight it casts; the graph keeps it when the op saves it.
        prefix, weights = model.block_prefix, model.matmul_weights
        in_blocks = [sum(v for n, v in weights.items() if n.startswith(f"{prefix}{i}.")) for i in range(model.depth)]
        kept = sum(v for n, v in weights.items() if not n.startswith(prefix))
        # Compiled blocks keep them too: inductor saves the bf16 cast of each weight for the input gradient
        # (measured on an H200: DiT-XL/2 compiled blocks hold 1.26 GiB more than their saved activations).
        kept += sum(n for n, kind in zip(in_blocks, kinds) if kind == "none")
        parts["autocast_weight_copies"] = 2 * kept
        lines.append(f"autocast's bf16 weight copies kept for backward (layers outside checkpointed blocks): "
                     f"{fmt_bytes(2 * kept)}")  # fmt: skip
    # Backward's working set at its peak: a checkpointed block recomputes its full set; otherwise the
    # gradients of the largest saved tensor and its input are alive together (a rough figure).
    working = model.block_working
    if "full" in kinds or "selective" in kinds:
        working += per_block["none"] - (per_block["selective"] if "full" not in kinds else 0)
    working = max(working, model.head_working)  # the loss's gradient comes first, before any block's
    parts["backward_working"] = B * working
    lines.append(f"backward working set (peak extra, rough): {fmt_bytes(B * working)}")
    return parts


def estimate_model_memory(model: ModelMemory, batch: int, precision: str = "bf16_autocast", ac_mode: str = "none",
                          ac_option: str = "op", compiled: bool = False, dp_shard: int = 1, dp_replicate: int = 1,
                          rank: int = 0, ema: bool = True, reshard_after_forward: str = "default",
                          optimizer: tuple[str, float] = ("AdamW", 0.0),
                          units_of: int = 0) -> MemoryEstimate:  # fmt: skip
    """Memory of one rank training the model that `model` describes: the one estimator of every family.

    Args: as `estimate_memory`'s (`model` built for the same precision and AC); `units_of`:
        `parallelism.fsdp_blocks_per_unit` (0: its auto).
    """
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    est = MemoryEstimate()
    est.parts = _state_parts(model, dp_shard, rank, ema, optimizer, est.lines)
    fsdp = dp_shard > 1 or precision == "bf16_fsdp"
    if dp_replicate > 1 and dp_shard == 1:
        est.parts["ddp_buckets"] = est.parts["gradients"]  # the reducer's buckets, which hold the gradients
        est.lines.append("DDP: the gradients live in the reducer's buckets (gradient_as_bucket_view), held from the "
                         "first backward on")  # fmt: skip
    est.parts.update(_activation_parts(model, batch, precision, (ac_mode, ac_option), compiled, est.lines))
    transient = 0
    if fsdp:
        # The all-gather output of a parameter is its padded shard times the shard degree.
        gathered = {n: shard_numel(s, dp_shard, 0)[1] * dp_shard for n, s in model.shapes.items()}
        block = sum(v for n, v in gathered.items() if n.startswith(f"{model.block_prefix}0."))
        root = sum(v for n, v in gathered.items() if not n.startswith(model.block_prefix))
        compute = 4 if precision == "fp32" else 2
        # Which modules keep their gathered parameters from forward to backward: apply_fsdp's units and flags.
        per_unit = blocks_per_unit(units_of, block * compute, model.depth)
        units = fsdp_units(model.depth, per_unit)
        unit_flags, root_flag = reshards_after_forward(reshard_after_forward, len(units))
        blocks_kept = sum(len(unit) for unit, flag in zip(units, unit_flags) if not flag)
        root_kept = 0 if root_flag else root
        kept = f"the root and {blocks_kept} of {model.depth} blocks" if root_kept else "nothing"
        est.parts["fsdp_gathered"] = (root_kept + blocks_kept * block) * compute
        # A gathered unit and the next one prefetched, and a block's unsharded fp32 gradient and reduce-scatter
        # buffer: a unit's gradients come at its end, when its activations are freed. Fitted to DiT-XL/2 on 2 H200s at
        # 64 a GPU: units of 14 blocks peaked 1.3 GiB above units of one, 1.2 GiB here (benchmark_log.md, (n)).
        transient = 2 * per_unit * block * compute + 2 * block * 4
        est.parts["backward_working"] += transient
        gathered_bytes = fmt_bytes(est.parts["fsdp_gathered"])
        est.lines.append(f"FSDP (reshard_after_forward {reshard_after_forward!r}): {kept} stay gathered "
                         f"({gathered_bytes}); units of {per_unit} blocks, in flight: "
                         f"{fmt_bytes(transient)}")  # fmt: skip
    p = est.parts
    static = p["parameters"] + p["optimizer_states"] + p.get("ema", 0) + p["buffers"] + p.get("ddp_buckets", 0)
    held = p["activations"] + p.get("autocast_weight_copies", 0) + p.get("fsdp_gathered", 0)
    loose_gradients = 0 if "ddp_buckets" in p else p["gradients"]
    est.peak = static + max(held + p["backward_working"], loose_gradients + transient)
    est.lines.append("peak = parameters + optimizer + EMA + buffers (+ DDP buckets) + max(activations + weight "
                     "copies + FSDP gathered + backward working set, gradients outside DDP's buckets): gradients "
                     "appear as activations are freed")  # fmt: skip
    return est


def max_batch_that_fits(budget_bytes: int, estimate_fn, limit: int = 1 << 16) -> int:
    """Largest batch b <= limit with estimate_fn(b).peak <= budget_bytes (0 if none): doubling, then bisection."""
    if estimate_fn(1).peak > budget_bytes:
        return 0
    low = 1
    while low * 2 <= limit and estimate_fn(low * 2).peak <= budget_bytes:
        low *= 2
    high = min(low * 2, limit + 1)  # high never fits (or is past the limit)
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if estimate_fn(mid).peak <= budget_bytes else (low, mid)
    return low
