"""Analytic memory of DiT training: parameters, gradients, optimizer states, EMA and activations, per rank.

    python -m torchtitan.tools.memory_estimate --flavor DiT-XL/2 --batch 64 --precision bf16_autocast --compile

prints each part with its derivation. Parameter, gradient, optimizer-state and EMA bytes are exact: they
come from the DiT's parameter shapes and, under FSDP, from the rule `fully_shard` shards by (dim-0 chunks
as torch.chunk cuts them; each rank's parameter and gradient storage is padded to the first chunk's size,
while AdamW's states and the EMA are `zeros_like` / clones of the unpadded local shard).

Activations are a model, one row per tensor a DiTBlock keeps for backward (`block_saved_tensors`):
- eager: what each autograd op saves; on CPU in fp32 this matches the saved storages exactly (see the tests);
- compile: inductor's min-cut partitioner recomputes pointwise chains in backward, except tensors that a
  backward matmul or attention kernel must read ("materialized in backward"), which it saves. So norm
  outputs and activation-function intermediates go, matmul inputs stay. With bf16 autocast this gives
  20 bf16 (B, T, D) tensors per DiT-XL/2 block, i.e. 315 MiB per image over 28 blocks at 256 tokens,
  against 318.9 MiB measured on an H100 (compile per block, batch 64, one forward);
- bf16 autocast, eager: norms run in fp32 (autocast's fp32 list), so their inputs and outputs are fp32
  copies, and autocast keeps a bf16 copy of every matmul weight until backward. Not measured on a GPU yet.

Converters (`model.converters`, torchtitan/kernels/) change some rows where their kernels run (`kernel_paths`): the
adaLN norm kernel keeps its input in the stream's dtype and neither its output nor 1 + scale, and in eager blocks
norm2 keeps norm1's x', so the mid-block residual is not kept again; the SwiGLU kernel keeps no silu(gate); the GELU
MLP op (cuBLASLt) is kept whole by per-op selective AC. fused_norm hands the residual stream on in parts on any
device, which keeps a copy of gate_mlp per block. On CPU in fp32 the rows are exact with and without converters, the
kernels' included (run in Triton's interpreter; see the tests). Compiled, DiT-XL/2's blocks kept the same with and
without the converters on an H100 (bf16, batch 32, one forward: 10051 and 10085 MiB; the estimate says 10486).
"""

import argparse
import math
from dataclasses import dataclass, field, replace

from torchtitan.kernels.dit_modules import residual_finished
from torchtitan.models.dit.model import POS_EMBEDS, DiTArgs
from torchtitan.parallelisms.utils import checkpointed_blocks, reshards_after_forward

PRECISIONS = ("fp32", "bf16_autocast", "bf16_fsdp")
MIB, GIB = 1024**2, 1024**3


def parameter_shapes(args: DiTArgs) -> dict[str, tuple[int, ...]]:
    """Every parameter of DiT(args) by its name, from the architecture alone (no model is built)."""
    D, p = args.dim, args.patch_size
    shapes: dict[str, tuple[int, ...]] = {}

    def linear(name: str, out_features: int, in_features: int) -> None:
        shapes[f"{name}.weight"], shapes[f"{name}.bias"] = (out_features, in_features), (out_features,)

    shapes["x_embedder.proj.weight"], shapes["x_embedder.proj.bias"] = (D, args.in_channels, p, p), (D,)
    linear("t_embedder.mlp.0", D, 256)
    linear("t_embedder.mlp.2", D, D)
    if args.num_classes > 0:
        shapes["y_embedder.embedding_table.weight"] = (args.num_classes + 1, D)  # + CFG's null class
    if args.pos_embed == "learned":
        shapes["pos_embed.weight"] = (1, args.num_tokens, D)
    fc1_out = 2 * args.mlp_hidden_dim if args.mlp == "swiglu" else args.mlp_hidden_dim
    for i in range(args.depth):
        # The block norms have no affine parameters: adaLN supplies their scale and shift.
        linear(f"blocks.{i}.attn.qkv", 3 * D, D)
        linear(f"blocks.{i}.attn.proj", D, D)
        if args.qk_norm:
            shapes[f"blocks.{i}.attn.q_norm.weight"] = shapes[f"blocks.{i}.attn.k_norm.weight"] = (args.head_dim,)
        linear(f"blocks.{i}.mlp.fc1", fc1_out, D)
        linear(f"blocks.{i}.mlp.fc2", D, args.mlp_hidden_dim)
        linear(f"blocks.{i}.adaLN_modulation.1", 6 * D, D)
    linear("final_layer.linear", p * p * args.out_channels, D)
    linear("final_layer.adaLN_modulation.1", 2 * D, D)
    return shapes


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
    """One tensor kept for backward, per image. `rule` picks its dtype: see `element_bytes`."""

    name: str
    elements: int
    rule: str = "compute"  # "compute" | "fp32" | "norm_in" | "norm_out"
    eager: bool = True
    compiled: bool = True
    selective: bool = False  # kept by per-op selective AC: outputs of matmuls and attention, and the block input


def kernel_paths(args: DiTArgs, converters, kernels_run: bool, precision: str) -> frozenset[str]:
    """The kernel paths of the converters that change what a block keeps: "adaln_norm" (fused_norm), "bias_act" or
    "gelu_mlp" (fused_mlp: the cuBLASLt GELU MLP for GELU in 16 bits, the Triton kernel otherwise). None where the
    kernels do not run (`kernels_run`: CUDA, or CPU under Triton's interpreter). fused_qkv keeps what the plain
    attention keeps."""
    paths = set()
    if kernels_run and "fused_norm" in converters:
        paths.add("adaln_norm")
    if kernels_run and "fused_mlp" in converters:
        paths.add("gelu_mlp" if args.mlp == "gelu" and precision != "fp32" else "bias_act")
    return frozenset(paths)


def block_saved_tensors(args: DiTArgs, kernels: frozenset[str] = frozenset()) -> list[SavedTensor]:
    """What one DiTBlock keeps for backward, per image, in the order its forward creates them; `kernels` are the
    kernel paths that run (`kernel_paths`)."""
    D, T, nh, H = args.dim, args.num_tokens, args.num_heads, args.mlp_hidden_dim
    fc1_out = 2 * H if args.mlp == "swiglu" else H
    norm_kernel = "adaln_norm" in kernels
    # rstd (RMSNorm) or mean and rstd (LayerNorm); the kernel writes both for either norm.
    stats = (2 if norm_kernel or args.norm == "layernorm" else 1) * T
    # The kernel keeps the stream in its own dtype (no fp32 copy under autocast), and neither its output nor 1 + scale.
    norm_in, torch_norm = ("compute", False) if norm_kernel else ("norm_in", True)
    rows = [
        SavedTensor("silu(c) (B, D): adaLN's matmul input", D, compiled=False),
        SavedTensor("adaLN output (B, 6D): shift/scale/gate are views of it", 6 * D, selective=True),
        SavedTensor("block input x (B, T, D): norm1's input", T * D, norm_in, selective=True),
        SavedTensor(f"norm1 statistics (B, T) x {stats // T}, fp32", stats, "fp32"),
        SavedTensor("1 + scale_msa (B, D)", D, eager=torch_norm, compiled=False),
        SavedTensor(
            "norm1 output (B, T, D): the modulation's multiplicand", T * D, "norm_out", eager=torch_norm, compiled=False
        ),
        SavedTensor("modulated input of qkv (B, T, D)", T * D),
        SavedTensor("qkv output (B, T, 3D): v is a view of it, so attention keeps it all", 3 * T * D, selective=True),
    ]
    if args.qk_norm:
        rows += [
            SavedTensor("q, k RMSNorm statistics (B, T, nh) x 2, fp32", 2 * nh * T, "fp32"),
            SavedTensor("q, k normalized before the RMSNorm weight (B, T, nh, hd) x 2", 2 * T * D, compiled=False),
        ]
    if args.qk_norm or args.pos_embed == "rope2d":
        rows.append(SavedTensor("attention's q, k after QK-norm / RoPE (B, T, nh, hd) x 2", 2 * T * D))
    # Laid out like q, token-major, so proj reads (B, T, D) as a view of it.
    rows.append(SavedTensor("attention output (B, T, nh, hd)", T * D, selective=True))
    rows.append(SavedTensor("attention logsumexp (B, nh, T), fp32", nh * T, "fp32", selective=True))
    rows += [
        SavedTensor("proj output (B, T, D): gate_msa's multiplicand", T * D, selective=True),
        # The norm kernel recomputes x + gate_msa * attn in backward from norm1's x', which it keeps instead. Compiled,
        # plain and converted blocks kept the same (DiT-XL/2, bf16, batch 32, one H100: 10085 and 10051 MiB after one
        # forward), so the compiled column stays the plain model's.
        SavedTensor("x + gate_msa * attn (B, T, D): norm2's input", T * D, norm_in, eager=torch_norm),
        SavedTensor(f"norm2 statistics (B, T) x {stats // T}, fp32", stats, "fp32"),
        SavedTensor("1 + scale_mlp (B, D)", D, eager=torch_norm, compiled=False),
        SavedTensor("norm2 output (B, T, D)", T * D, "norm_out", eager=torch_norm, compiled=False),
        SavedTensor("modulated input of fc1 (B, T, D)", T * D),
        SavedTensor(f"fc1 output (B, T, {fc1_out})", T * fc1_out, selective=True),
    ]
    if args.mlp == "swiglu":  # the SwiGLU kernel keeps only its input, fc1's output
        rows.append(SavedTensor(f"silu(gate) (B, T, {H})", T * H, eager="bias_act" not in kernels, compiled=False))
        rows.append(SavedTensor(f"silu(gate) * up (B, T, {H}): fc2's input", T * H))
    else:  # per-op selective AC keeps every output of the GELU MLP op, the GELU's among them
        rows.append(SavedTensor(f"GELU output (B, T, {H}): fc2's input", T * H, selective="gelu_mlp" in kernels))
    rows.append(SavedTensor("fc2 output (B, T, D): gate_mlp's multiplicand", T * D, selective=True))
    return rows


def head_saved_tensors(args: DiTArgs, kernels: frozenset[str] = frozenset()) -> list[SavedTensor]:
    """What the model keeps outside the blocks, per image (embedders, final layer, loss); always eager."""
    D, T = args.dim, args.num_tokens
    image = args.in_channels * args.input_size**2
    norm_kernel = "adaln_norm" in kernels
    stats = (2 if norm_kernel or args.norm == "layernorm" else 1) * T
    rows = [
        SavedTensor("noised input x_t (B, C, H, W): the patch embedding's input", image),
        SavedTensor("timestep features (B, 256), embedder hidden and conditioning c (B, D) x 3", 256 + 3 * D),
        SavedTensor("last block output (B, T, D): final norm's input", T * D, "compute" if norm_kernel else "norm_in"),
        SavedTensor("final norm statistics, fp32", stats, "fp32"),
    ]
    if norm_kernel:  # the kernel keeps scale, a view of the final adaLN output, and not its own output
        rows.append(SavedTensor("final adaLN: silu(c) (B, D) and its output (B, 2D), which scale views", 3 * D))
    else:
        rows.append(SavedTensor("final adaLN: silu(c) (B, D) and 1 + scale (B, D); no gate keeps its output", 2 * D))
        rows.append(SavedTensor("final norm output (B, T, D)", T * D, "norm_out"))
    rows += [
        SavedTensor("modulated input of the final linear (B, T, D)", T * D),
        SavedTensor("prediction minus target (B, C, H, W), fp32", image, "fp32"),
    ]
    if args.learn_sigma:  # measured on CPU: the VLB term keeps about 16.5 image-sized fp32 tensors
        rows.append(SavedTensor("DDPM learned-sigma VLB term: ~16.5 x (B, C, H, W), fp32", 33 * image // 2, "fp32"))
    labels = 2 if args.num_classes > 0 else 0  # an int64 label is two fp32-sized elements
    rows.append(SavedTensor("the returned per-sample loss (B,), fp32, and the labels (B,), int64", 1 + labels, "fp32"))
    return rows


def element_bytes(rule: str, precision: str, compiled: bool) -> int:
    """Bytes per element of a saved tensor under a precision and execution mode.

    "compute" is the matmul dtype (bf16 unless fp32). Norms: under bf16 autocast, eager runs them in fp32
    (autocast's fp32 list), so the norm's saved input and output are fp32 copies; compiled code saves the
    bf16 input and recomputes the upcast. Under bf16 FSDP parameters there is no autocast: all bf16.
    """
    compute = 4 if precision == "fp32" else 2
    if rule == "fp32":
        return 4
    if rule in ("norm_in", "norm_out") and precision == "bf16_autocast" and not compiled:
        return 4
    return compute


def saved_bytes_per_image(rows: list[SavedTensor], precision: str, compiled: bool, selective: bool = False) -> int:
    """Bytes per image of the rows kept under this mode (selective: the rows per-op selective AC keeps)."""
    if selective:  # the checkpoint keeps the block input and the ops' outputs in the dtype they come in
        return sum(r.elements * element_bytes("fp32" if r.rule == "fp32" else "compute", precision, False)
                   for r in rows if r.selective)  # fmt: skip
    kept = [r for r in rows if (r.compiled if compiled else r.eager)]
    return sum(r.elements * element_bytes(r.rule, precision, compiled) for r in kept)


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


def _fmt(nbytes: float) -> str:
    return f"{nbytes / GIB:.3f} GiB" if nbytes >= GIB else f"{nbytes / MIB:.2f} MiB"


def _state_parts(args: DiTArgs, shard: int, rank: int, ema: bool, lines: list[str]) -> dict[str, int]:
    """Exact parameter, gradient, AdamW and EMA bytes of one rank (all fp32 master tensors)."""
    shapes = parameter_shapes(args)
    numel = sum(math.prod(s) for s in shapes.values())
    local = padded = numel
    if shard > 1:
        per = [shard_numel(s, shard, rank) for s in shapes.values()]
        local, padded = sum(p[0] for p in per), sum(p[1] for p in per)
        lines.append(f"FSDP over {shard} ranks, rank {rank}: {local:,} local elements, {padded:,} padded "
                     "(dim-0 chunks of ceil(rows / ranks), storage padded to the first chunk)")  # fmt: skip
    lines.append(f"parameters: {numel:,} in {len(shapes)} tensors, fp32 master weights = {padded:,} x 4 B")
    lines.append("gradients: fp32 like the parameters (under FSDP one padded reduce-scatter output per block)")
    lines.append(f"AdamW: exp_avg + exp_avg_sq = 2 x {local:,} x 4 B, + one fp32 step counter per tensor")
    parts = {"parameters": 4 * padded, "gradients": 4 * padded, "optimizer_states": 8 * local + 4 * len(shapes)}
    if ema:
        lines.append(f"EMA: an fp32 clone of every (local) parameter = {local:,} x 4 B")
        parts["ema"] = 4 * local
    parts["buffers"] = 4 * (args.num_tokens * args.dim + args.num_tokens * args.head_dim)  # sincos + rope tables
    return parts


def _blocks_with_ac(depth: int, ac_mode: str, ac_option: str) -> list[str]:
    """Per block: "none", "full" or "selective" (per op), as apply_ac wraps them."""
    wrapped = "selective" if ac_mode == "selective" and ac_option == "op" else "full"
    return [wrapped if checkpointed else "none" for checkpointed in checkpointed_blocks(depth, ac_mode, ac_option)]


def _activation_parts(args: DiTArgs, batch: int, precision: str, ac: tuple[str, str], compiled: bool,
                      converters, kernels_run: bool, lines: list[str]) -> dict[str, int]:  # fmt: skip
    """Bytes kept from forward to backward, and the extra a backward step needs at its peak."""
    D, T, B = args.dim, args.num_tokens, batch
    compute = 4 if precision == "fp32" else 2
    kernels = kernel_paths(args, converters, kernels_run, precision)
    rows = block_saved_tensors(args, kernels)
    mode = "compiled (inductor partitioner)" if compiled else "eager"
    lines.append(f"converters {list(converters)}; kernel paths that change what is kept: {sorted(kernels) or 'none'}")
    lines.append(f"one residual-stream tensor = B x T x D x bytes = {B} x {T} x {D} x {compute} B = "
                 f"{_fmt(B * T * D * compute)}")  # fmt: skip
    lines.append(f"saved per DiTBlock ({mode}, {precision}), per image and for the batch of {B}:")
    for r in rows:
        kept = r.compiled if compiled else r.eager
        nbytes = element_bytes(r.rule, precision, compiled)
        lines.append(f"  {'kept' if kept else 'recomputed':<10} {r.name:<78} {r.elements:>11,} x {nbytes} B"
                     f" = {_fmt(B * r.elements * nbytes) if kept else '-'}")  # fmt: skip
    per_block = {
        "none": saved_bytes_per_image(rows, precision, compiled),
        "selective": saved_bytes_per_image(rows, precision, compiled, selective=True),
        "full": T * D * compute,  # the checkpoint keeps the block input only
    }
    units = per_block["none"] / (T * D * compute)
    lines.append(f"  = {_fmt(per_block['none'])} per image per block, {units:.2f} residual-stream tensors")
    kinds = _blocks_with_ac(args.depth, *ac)
    head = saved_bytes_per_image(head_saved_tensors(args, kernels), precision, compiled=False)  # blocks compile only
    blocks = sum(per_block[k] for k in kinds)
    counts = {k: kinds.count(k) for k in ("none", "selective", "full") if kinds.count(k)}
    lines.append(f"blocks by activation checkpointing {counts}: "
                 + ", ".join(f"{k} keeps {_fmt(per_block[k])}/image" for k in counts))  # fmt: skip
    # Under fused_norm a block that hands its residual on in parts (neither it nor the next is checkpointed) passes
    # on a copy of gate_mlp (B, D), which the next norm keeps; the copy keeps FSDP's backward hook off a view.
    handed = 0
    if "fused_norm" in converters:
        handed = residual_finished(checkpointed_blocks(args.depth, *ac)).count(False)
    blocks += handed * D * compute
    lines.append(f"gate_mlp copies handed on by {handed} block(s): {_fmt(handed * D * compute)}/image")
    lines.append(f"outside the blocks (embedders, final layer, loss; eager): {_fmt(head)}/image")
    parts = {"activations": B * (blocks + head)}
    lines.append(f"activations = {B} x ({_fmt(blocks)} + {_fmt(head)}) = {_fmt(parts['activations'])} "
                 f"({_fmt(blocks + head)} per image)")  # fmt: skip
    if precision == "bf16_autocast":
        # autocast caches the bf16 copy of each weight it casts; the graph keeps it when the op saves it.
        shapes = parameter_shapes(args)
        matmul = {n: math.prod(s) for n, s in shapes.items() if "norm" not in n and "embedding" not in n}
        in_blocks = [sum(v for n, v in matmul.items() if n.startswith(f"blocks.{i}.")) for i in range(args.depth)]
        kept = sum(v for n, v in matmul.items() if not n.startswith("blocks."))
        # Compiled blocks keep them too: inductor saves the bf16 cast of each weight for the input gradient
        # (measured on an H200: DiT-XL/2 compiled blocks hold 1.26 GiB more than their saved activations).
        kept += sum(n for n, kind in zip(in_blocks, kinds) if kind == "none")
        parts["autocast_weight_copies"] = 2 * kept
        lines.append(f"autocast's bf16 weight copies kept for backward (layers outside checkpointed blocks): "
                     f"{_fmt(2 * kept)}")  # fmt: skip
    # Backward's working set at its peak: a checkpointed block recomputes its full set; otherwise the
    # gradients of the largest saved tensor and its input are alive together (a rough figure).
    fc1_out = 2 * args.mlp_hidden_dim if args.mlp == "swiglu" else args.mlp_hidden_dim
    working = 2 * T * fc1_out * compute
    if "full" in kinds or "selective" in kinds:
        working += per_block["none"] - (per_block["selective"] if "full" not in kinds else 0)
    parts["backward_working"] = B * working
    lines.append(f"backward working set (peak extra, rough): {_fmt(B * working)}")
    return parts


def estimate_memory(args: DiTArgs, batch: int, precision: str = "bf16_autocast", ac_mode: str = "none",
                    ac_option: str = "op", compiled: bool = False, dp_shard: int = 1, dp_replicate: int = 1,
                    rank: int = 0, ema: bool = True, reshard_after_forward: str = "default",
                    converters=(), kernels_run: bool = False) -> MemoryEstimate:  # fmt: skip
    """Memory of one rank training DiT(args) with AdamW.

    Args:
        args: the model architecture (a dit_configs flavor with overrides).
        batch: local batch size (images per rank per forward).
        precision: "fp32"; "bf16_autocast" (single device / DDP); "bf16_fsdp" (FSDP2 bf16 compute params).
        ac_mode: "none" | "full" | "selective"; ac_option: "op" or k (every k-th block fully checkpointed).
        compiled: blocks compiled with torch.compile (see block_saved_tensors' `compiled` column).
        dp_shard: FSDP degree (sharding); dp_replicate: DDP / HSDP replicas (DDP adds gradient buckets).
        rank: the shard rank to report (rank 0 holds the largest shards).
        ema: whether an fp32 EMA of the weights is kept.
        reshard_after_forward: FSDP's `parallelism.fsdp_reshard_after_forward`: which gathered parameters stay
            from forward to backward ("default": the root and the last block; "never": the root and every
            block; "always": none).
        converters: `model.converters` (fused_norm hands the residual stream on in parts on any device).
        kernels_run: whether the converters' kernels run (CUDA, or CPU under Triton's interpreter): see
            `kernel_paths`.
    """
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    est = MemoryEstimate()
    est.parts = _state_parts(args, dp_shard, rank, ema, est.lines)
    fsdp = dp_shard > 1 or precision == "bf16_fsdp"
    if dp_replicate > 1 and dp_shard == 1:
        est.parts["ddp_buckets"] = est.parts["gradients"]  # the reducer's bucket copy of the gradients
        est.lines.append("DDP: gradient buckets as large as the gradients (gradient_as_bucket_view off)")
    est.parts.update(_activation_parts(args, batch, precision, (ac_mode, ac_option), compiled, converters, kernels_run,
                                       est.lines))  # fmt: skip
    transient = 0
    if fsdp:
        # The all-gather output of a parameter is its padded shard times the shard degree.
        gathered = {n: shard_numel(s, dp_shard, 0)[1] * dp_shard for n, s in parameter_shapes(args).items()}
        block = sum(v for n, v in gathered.items() if n.startswith("blocks.0."))
        root = sum(v for n, v in gathered.items() if not n.startswith("blocks."))
        compute = 4 if precision == "fp32" else 2
        # Which modules keep their gathered parameters from forward to backward: apply_fsdp's flags.
        block_flags, root_flag = reshards_after_forward(reshard_after_forward, args.depth)
        blocks_kept, root_kept = block_flags.count(False), 0 if root_flag else root
        kept = f"the root and {blocks_kept} of {args.depth} blocks" if root_kept else "nothing"
        est.parts["fsdp_gathered"] = (root_kept + blocks_kept * block) * compute
        transient = 2 * block * compute + 2 * block * 4  # gathered block + prefetch; unsharded grad + RS buffer
        est.parts["backward_working"] += transient
        est.lines.append(f"FSDP (reshard_after_forward {reshard_after_forward!r}): {kept} stay gathered "
                         f"({_fmt(est.parts['fsdp_gathered'])}); per block in flight: {_fmt(transient)}")  # fmt: skip
    p = est.parts
    static = p["parameters"] + p["optimizer_states"] + p.get("ema", 0) + p["buffers"] + p.get("ddp_buckets", 0)
    held = p["activations"] + p.get("autocast_weight_copies", 0) + p.get("fsdp_gathered", 0)
    est.peak = static + max(held + p["backward_working"], p["gradients"] + transient)
    est.lines.append("peak = parameters + optimizer + EMA + buffers (+ DDP buckets) + max(activations + weight "
                     "copies + FSDP gathered + backward working set, gradients): gradients appear as "
                     "activations are freed")  # fmt: skip
    return est


def estimate_from_job_config(cfg, world_size: int = 1, device_type: str = "cuda", rank: int = 0) -> MemoryEstimate:
    """The estimate for a JobConfig (as train.py would run it on `world_size` ranks of `device_type`)."""
    from torchtitan.kernels.triton_support import triton, triton_interpreting
    from torchtitan.parallelisms.parallel_dims import ParallelDims
    from torchtitan.train_spec import build_model_args, get_train_spec

    args = build_model_args(get_train_spec(cfg.model.name), cfg)
    p = cfg.parallelism
    dims = ParallelDims(p.data_parallel_replicate_degree, p.data_parallel_shard_degree, world_size,
                        p.fsdp_single_device)  # fmt: skip
    if cfg.training.mixed_precision_param == "float32" or device_type == "cpu":
        precision = "fp32"
    else:
        precision = "bf16_fsdp" if dims.fsdp_enabled else "bf16_autocast"
    ac = cfg.activation_checkpoint
    compiled = cfg.compile.enable and "model" in cfg.compile.components
    converters = cfg.model.converters
    if cfg.dp.enable or "float8" in converters:  # DP-SGD's hooks and float8's Linears keep the MLP's module path
        converters = [c for c in converters if c != "fused_mlp"]
    kernels_run = triton is not None and (device_type == "cuda" or triton_interpreting())
    return estimate_memory(args, cfg.training.local_batch_size, precision, ac.mode, ac.selective_ac_option, compiled,
                           dims.dp_shard, dims.dp_replicate, rank, cfg.training.ema_decay > 0,
                           p.fsdp_reshard_after_forward, converters, kernels_run)  # fmt: skip


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


def main(argv: list[str] | None = None) -> None:
    from torchtitan.job_config import Model
    from torchtitan.models.dit import dit_configs

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--flavor", default="DiT-XL/2", choices=sorted(dit_configs))
    parser.add_argument("--batch", type=int, default=64, help="local batch size")
    parser.add_argument("--precision", default="bf16_autocast", choices=PRECISIONS)
    parser.add_argument("--ac", default="none", choices=("none", "full", "selective"))
    parser.add_argument("--ac-option", default="op", help="'op' or k: every k-th block (selective)")
    parser.add_argument("--compile", action="store_true", help="blocks compiled with torch.compile")
    parser.add_argument("--shard", type=int, default=1, help="FSDP degree")
    parser.add_argument("--replicate", type=int, default=1, help="DDP / HSDP replicas")
    parser.add_argument("--rank", type=int, default=0, help="shard rank to report")
    parser.add_argument("--no-ema", action="store_true")
    parser.add_argument("--reshard-after-forward", default="default", choices=("default", "never", "always"),
                        help="FSDP: which gathered parameters stay from forward to backward")  # fmt: skip
    for name in ("input_size", "in_channels", "patch_size", "num_classes"):
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=None, help="flavor override")
    parser.add_argument("--pos-embed", default=None, choices=POS_EMBEDS, help="flavor override")
    parser.add_argument(
        "--converters",
        default=",".join(Model().converters),
        help="model.converters, comma-separated ('' for the plain model)",
    )
    parser.add_argument("--no-kernels", action="store_true", help="the converters' kernels do not run (CPU)")
    parser.add_argument("--device-memory-gib", type=float, default=0.0, help="also print the largest batch that fits")
    a = parser.parse_args(argv)
    args = replace(dit_configs[a.flavor])
    for name in ("input_size", "in_channels", "patch_size", "num_classes", "pos_embed"):
        if getattr(a, name) is not None:
            setattr(args, name, getattr(a, name))
    args.validate()
    converters = [name for name in a.converters.split(",") if name]

    def estimate(batch: int) -> MemoryEstimate:
        return estimate_memory(args, batch, a.precision, a.ac, a.ac_option, a.compile, a.shard, a.replicate,
                               a.rank, not a.no_ema, a.reshard_after_forward, converters, not a.no_kernels)  # fmt: skip

    print(estimate(a.batch).report())
    if a.device_memory_gib > 0:
        best = max_batch_that_fits(int(a.device_memory_gib * GIB), estimate)
        print(f"largest batch whose estimate fits {a.device_memory_gib} GiB: {best}")


if __name__ == "__main__":
    main()
