"""Analytic memory of training, per rank: parameters, gradients, optimizer states, EMA and activations.

    python -m torchtitan.tools.memory_estimate --flavor DiT-XL/2 --batch 64 --precision bf16_autocast --compile
    python -m torchtitan.tools.memory_estimate --model llama3 --flavor Llama-3.1-8B --batch 2 --seq-len 8192

prints each part with its derivation. One estimator (`estimate_model_memory`, in memory_estimate_core.py) serves
every model family: a family describes itself as a `ModelMemory` (parameter shapes, the `SavedTensor` rows of one
block and of the head, which weights autocast casts), and the precision rules (`element_bytes`), activation
checkpointing, compile, FSDP shards and gathered parameters, DDP buckets and the peak are the core's. This module is
the front door (`estimate_from_job_config` picks the family by `model.name`; the CLI) and holds the DiT's
description (`dit_model_memory`); Llama 3's is in memory_estimate_llama3.py. The rest of this docstring is the DiT's.

Parameter, gradient, optimizer-state and EMA bytes are exact: they come from the DiT's parameter shapes and, under
FSDP, from the rule `fully_shard` shards by (dim-0 chunks as torch.chunk cuts them; each rank's parameter and
gradient storage is padded to the first chunk's size, while AdamW's states and the EMA are `zeros_like` / clones of
the unpadded local shard).

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
import os
from dataclasses import replace

from torchtitan.kernels.dit_modules import residual_finished
from torchtitan.models.dit.model import POS_EMBEDS, DiTArgs
from torchtitan.parallelisms.utils import checkpointed_blocks
from torchtitan.tools.memory_estimate_core import (
    GIB,
    PRECISIONS,
    MemoryEstimate,
    ModelMemory,
    SavedTensor,
    element_bytes,
    estimate_model_memory,
    fmt_bytes,
    max_batch_that_fits,
    saved_bytes_per_batch,
    saved_bytes_per_image,
    shard_numel,
)

# The shared machinery stays importable from here, the estimate's front door.
__all__ = [
    "PRECISIONS",
    "MemoryEstimate",
    "ModelMemory",
    "SavedTensor",
    "block_saved_tensors",
    "check_memory",
    "dit_model_memory",
    "element_bytes",
    "estimate_from_job_config",
    "estimate_memory",
    "estimate_model_memory",
    "head_saved_tensors",
    "kernel_paths",
    "max_batch_that_fits",
    "parameter_shapes",
    "saved_bytes_per_batch",
    "saved_bytes_per_image",
    "shard_numel",
]


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
    for i, out in enumerate(args.align_dims if args.align_depth else ()):  # REPA's projectors: 3 Linear layers
        hidden = args.align_projector_dim
        for j, (n_out, n_in) in enumerate(((hidden, D), (hidden, hidden), (out, hidden))):
            linear(f"projectors.{i}.{2 * j}", n_out, n_in)
    return shapes


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
    if args.qk_norm or args.uses_rope:
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
    for out in args.align_dims if args.align_depth else ():  # each projector and its cosine loss
        hidden = args.align_projector_dim
        rows.append(SavedTensor(f"projector: 2 Linear outputs and 2 SiLU outputs (B, T, {hidden})", 4 * T * hidden))
        rows.append(
            SavedTensor(f"projector output and the encoder's features (B, T, {out}), fp32", 2 * T * out, "fp32")
        )
    labels = 2 if args.num_classes > 0 else 0  # an int64 label is two fp32-sized elements
    rows.append(SavedTensor("the returned per-sample loss (B,), fp32, and the labels (B,), int64", 1 + labels, "fp32"))
    return rows


def dit_model_memory(args: DiTArgs, precision: str, ac: tuple[str, str] = ("none", "op"), converters=(),
                     kernels_run: bool = False) -> ModelMemory:  # fmt: skip
    """The DiT's description for the estimator (see `estimate_memory` for the arguments)."""
    D, T = args.dim, args.num_tokens
    compute = 4 if precision == "fp32" else 2
    kernels = kernel_paths(args, converters, kernels_run, precision)
    shapes = parameter_shapes(args)
    fc1_out = 2 * args.mlp_hidden_dim if args.mlp == "swiglu" else args.mlp_hidden_dim
    # Under fused_norm a block that hands its residual on in parts (neither it nor the next is checkpointed) passes
    # on a copy of gate_mlp (B, D), which the next norm keeps; the copy keeps FSDP's backward hook off a view.
    handed = residual_finished(checkpointed_blocks(args.depth, *ac)).count(False) if "fused_norm" in converters else 0
    return ModelMemory(
        shapes=shapes,
        block_prefix="blocks.",
        depth=args.depth,
        tokens=T,
        dim=D,
        buffer_bytes=4 * (T * D + T * args.head_dim),  # sincos + rope tables
        block_rows=block_saved_tensors(args, kernels),
        head_rows=head_saved_tensors(args, kernels),
        block_input=SavedTensor("block input x (B, T, D)", T * D),
        matmul_weights={n: math.prod(s) for n, s in shapes.items() if "norm" not in n and "embedding" not in n},
        block_working=2 * T * fc1_out * compute,  # the gradients of the largest saved tensor and its input
        extra_per_sample=handed * D * compute,
        header=[f"converters {list(converters)}; kernel paths that change what is kept: {sorted(kernels) or 'none'}"],
        notes=[f"gate_mlp copies handed on by {handed} block(s): {fmt_bytes(handed * D * compute)}/image"],
    )


def estimate_memory(args: DiTArgs, batch: int, precision: str = "bf16_autocast", ac_mode: str = "none",
                    ac_option: str = "op", compiled: bool = False, dp_shard: int = 1, dp_replicate: int = 1,
                    rank: int = 0, ema: bool = True, reshard_after_forward: str = "default",
                    converters=(), kernels_run: bool = False,
                    optimizer: tuple[str, float] = ("AdamW", 0.0)) -> MemoryEstimate:  # fmt: skip
    """Memory of one rank training DiT(args) (Llama 3: memory_estimate_llama3.estimate_llama3_memory).

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
        optimizer: (optimizer.name, optimizer.momentum): "AdamW" keeps two fp32 states per weight, "SGD" one
            with momentum > 0, none without.
    """
    model = dit_model_memory(args, precision, (ac_mode, ac_option), converters, kernels_run)
    return estimate_model_memory(model, batch, precision, ac_mode, ac_option, compiled, dp_shard, dp_replicate, rank,
                                 ema, reshard_after_forward, optimizer)  # fmt: skip


def _job_precision(cfg, fsdp: bool, device_type: str) -> str:
    """The trainer's precision: fp32 on CPU or with fp32 parameters; bf16 autocast, or bf16 FSDP parameters."""
    if cfg.training.mixed_precision_param == "float32" or device_type == "cpu":
        return "fp32"
    return "bf16_fsdp" if fsdp else "bf16_autocast"


def _job_model_memory(cfg, args, precision: str, device_type: str) -> ModelMemory:
    """The description of the model that `model.name` names, as the trainer would build it."""
    from torchtitan.kernels.triton_support import triton, triton_interpreting

    ac = (cfg.activation_checkpoint.mode, cfg.activation_checkpoint.selective_ac_option)
    if cfg.model.name == "llama3":
        from torchtitan.tools.memory_estimate_llama3 import llama3_model_memory

        return llama3_model_memory(args, cfg.training.seq_len, precision, cuda_kernels=device_type == "cuda")
    if cfg.model.name != "dit":
        raise ValueError(f"no memory estimate for model.name {cfg.model.name!r} (known: 'dit', 'llama3')")
    converters = cfg.model.converters
    if cfg.dp.enable or "float8" in converters:  # DP-SGD's hooks and float8's Linears keep the MLP's module path
        converters = [c for c in converters if c != "fused_mlp"]
    kernels_run = triton is not None and (device_type == "cuda" or triton_interpreting())
    return dit_model_memory(args, precision, ac, converters, kernels_run)


def estimate_from_job_config(cfg, world_size: int = 1, device_type: str = "cuda", rank: int = 0,
                             args=None) -> MemoryEstimate:  # fmt: skip
    """The estimate for a JobConfig (as train.py would run it on `world_size` ranks of `device_type`), for the model
    family `model.name` names ("dit", "llama3"); `args`: the model arguments to build, else the config's."""
    from torchtitan.parallelisms.parallel_dims import ParallelDims
    from torchtitan.train_spec import build_model_args, get_train_spec

    args = args if args is not None else build_model_args(get_train_spec(cfg.model.name), cfg)
    p = cfg.parallelism
    dims = ParallelDims(p.data_parallel_replicate_degree, p.data_parallel_shard_degree, world_size,
                        p.fsdp_single_device)  # fmt: skip
    precision = _job_precision(cfg, dims.fsdp_enabled, device_type)
    ac = cfg.activation_checkpoint
    compiled = cfg.compile.enable and "model" in cfg.compile.components
    model = _job_model_memory(cfg, args, precision, device_type)
    optimizer = (cfg.optimizer.name, cfg.optimizer.momentum)
    return estimate_model_memory(model, cfg.training.local_batch_size, precision, ac.mode, ac.selective_ac_option,
                                 compiled, dims.dp_shard, dims.dp_replicate, rank, cfg.training.ema_decay > 0,
                                 p.fsdp_reshard_after_forward, optimizer, units_of=p.fsdp_blocks_per_unit)  # fmt: skip


# The estimate has been up to 11% above measured peaks (docs/memory.md): a run is refused only when it would not
# fit even then; between the memory and this it is warned of.
REFUSE_ABOVE = 1.2


def check_memory(cfg, args, world_size: int, device) -> None:
    """Refuses, before the model is built, a run whose estimated peak a rank (`estimate_from_job_config`, a few
    milliseconds, no model built) exceeds the memory a rank has (`available_memory`) by more than the estimate's
    error: a model too large for a CPU is killed by the kernel without a message. training.skip_memory_check turns
    the refusal into a warning. Under torchrun every rank takes the smallest memory of all, so all decide alike.

    Args:
        cfg: the job config, its training.local_batch_size a number.
        args: the model arguments the trainer builds (None: the config's).
        world_size: ranks of the run.
        device: this rank's torch.device; devices other than CUDA and CPU are not checked.

    Raises:
        ConfigError: naming model.flavor, the estimate and the memory.
    """
    import torch
    import torch.distributed as dist

    from torchtitan.errors import ConfigError, at
    from torchtitan.tools.logging import logger

    memory = available_memory(device)
    if memory is None:
        return
    limit, where = memory
    if dist.is_initialized() and dist.get_world_size() > 1:
        smallest = torch.tensor([limit], dtype=torch.int64, device=device)
        dist.all_reduce(smallest, op=dist.ReduceOp.MIN)
        limit = int(smallest.item())
    estimate = estimate_from_job_config(cfg, world_size, device.type, args=args)
    if estimate.peak <= limit:
        return
    dtype = "float32" if device.type == "cpu" else cfg.training.mixed_precision_param  # the trainer's rule
    figures = (f"this run's memory estimate is {estimate.peak / GIB:.1f} GiB a rank (training.local_batch_size "
               f"{cfg.training.local_batch_size}, {dtype} on {device.type}; torchtitan/tools/memory_estimate.py), "
               f"and {where} is {limit / GIB:.1f} GiB")  # fmt: skip
    if cfg.training.skip_memory_check:
        logger.warning(f"training.skip_memory_check: {figures}; trying anyway")
    elif estimate.peak > REFUSE_ABOVE * limit:
        fate = "the kernel would kill it, without a message" if device.type == "cpu" else "it would run out of memory"
        raise ConfigError(f"{at(cfg, 'model.flavor')}: {figures}: {fate}. Choose a smaller model.flavor or "
                          "training.local_batch_size, or more ranks, or set training.skip_memory_check = true to try "
                          "anyway")  # fmt: skip
    else:
        logger.warning(f"memory: {figures}, within the estimate's error of it: the run may run out of memory")


def device_memory_bytes(index: int = 0) -> int | None:
    """Total memory of this machine's GPU `index`, or None without one."""
    import torch

    return torch.cuda.get_device_properties(index).total_memory if torch.cuda.is_available() else None


def available_memory(device) -> tuple[int, str] | None:
    """The memory one rank has, and what it is: a CUDA device's total memory; on CPU the host's available RAM
    (MemAvailable, which counts what the kernel can reclaim), shared by the ranks on the host (LOCAL_WORLD_SIZE).
    None where it is not known."""
    if device.type == "cuda":
        return device_memory_bytes(device.index or 0), f"{device}'s total memory"
    if device.type != "cpu":
        return None
    try:
        with open("/proc/meminfo") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
        available = int(fields["MemAvailable"].split()[0]) * 1024  # kB
    except (OSError, KeyError, ValueError):  # not Linux: the free pages, fewer than what could be reclaimed
        try:
            available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            return None
    ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    shared = f", shared by its {ranks} ranks," if ranks > 1 else ""
    return available // ranks, f"the host's available RAM (MemAvailable){shared}"


def _cli_parser() -> argparse.ArgumentParser:
    from torchtitan.job_config import Model

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="dit", choices=("dit", "llama3"), help="model family (model.name)")
    parser.add_argument("--flavor", default=None, help="a flavor of the family (default DiT-XL/2, Llama-3.1-8B)")
    parser.add_argument("--batch", type=int, default=64, help="local batch size")
    parser.add_argument("--seq-len", type=int, default=2048, help="llama3: tokens per sequence (training.seq_len)")
    parser.add_argument("--precision", default="bf16_autocast", choices=PRECISIONS)
    parser.add_argument("--ac", default="none", choices=("none", "full", "selective"))
    parser.add_argument("--ac-option", default="op", help="'op' or k: every k-th block (selective)")
    parser.add_argument("--compile", action="store_true", help="blocks compiled with torch.compile")
    parser.add_argument("--shard", type=int, default=1, help="FSDP degree")
    parser.add_argument("--replicate", type=int, default=1, help="DDP / HSDP replicas")
    parser.add_argument("--rank", type=int, default=0, help="shard rank to report")
    parser.add_argument("--ema", action=argparse.BooleanOptionalAction, default=None,
                        help="an fp32 EMA of the weights (default: on for the DiT, off for llama3)")  # fmt: skip
    parser.add_argument("--reshard-after-forward", default="default", choices=("default", "never", "always"),
                        help="FSDP: which gathered parameters stay from forward to backward")  # fmt: skip
    for name in ("input_size", "in_channels", "patch_size", "num_classes"):
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=None,
                            help="flavor override (llama3: num_classes, as num_labels)")  # fmt: skip
    parser.add_argument("--attn-window", type=int, default=None, help="llama3: sliding-window override")
    parser.add_argument("--pos-embed", default=None, choices=POS_EMBEDS, help="flavor override")
    parser.add_argument(
        "--converters",
        default=",".join(Model().converters),
        help="model.converters, comma-separated ('' for the plain model)",
    )
    parser.add_argument("--no-kernels", action="store_true",
                        help="CPU: no converter kernels (DiT); composite RMSNorm, dense windows (llama3)")  # fmt: skip
    parser.add_argument("--device-memory-gib", type=float, default=0.0, help="also print the largest batch that fits")
    return parser


def _cli_estimate_fn(a: argparse.Namespace, parser: argparse.ArgumentParser):
    """batch -> MemoryEstimate for the parsed command line."""
    if a.model == "llama3":
        from torchtitan.models.llama3 import llama3_configs
        from torchtitan.tools.memory_estimate_llama3 import estimate_llama3_memory

        flavors, flavor = llama3_configs, a.flavor or "Llama-3.1-8B"
    else:
        from torchtitan.models.dit import dit_configs

        flavors, flavor = dit_configs, a.flavor or "DiT-XL/2"
    if flavor not in flavors:
        parser.error(f"--flavor {flavor!r} is no {a.model} flavor; known: {sorted(flavors)}")
    args = replace(flavors[flavor])
    if a.model == "llama3":
        args.num_labels = args.num_labels if a.num_classes is None else a.num_classes
        args.tie_embeddings = args.tie_embeddings and args.num_labels == 0  # a classifier has no LM head to tie
        args.attn_window = args.attn_window if a.attn_window is None else a.attn_window
        args.validate()
        return lambda batch: estimate_llama3_memory(
            args, batch, a.seq_len, a.precision, a.ac, a.ac_option, a.compile, a.shard, a.replicate, a.rank,
            bool(a.ema), a.reshard_after_forward, cuda_kernels=not a.no_kernels)  # fmt: skip
    for name in ("input_size", "in_channels", "patch_size", "num_classes", "pos_embed"):
        if getattr(a, name) is not None:
            setattr(args, name, getattr(a, name))
    args.validate()
    converters = [name for name in a.converters.split(",") if name]
    return lambda batch: estimate_memory(
        args, batch, a.precision, a.ac, a.ac_option, a.compile, a.shard, a.replicate, a.rank, a.ema is not False,
        a.reshard_after_forward, converters, not a.no_kernels)  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    parser = _cli_parser()
    a = parser.parse_args(argv)
    estimate = _cli_estimate_fn(a, parser)
    print(estimate(a.batch).report())
    if a.device_memory_gib > 0:
        best = max_batch_that_fits(int(a.device_memory_gib * GIB), estimate)
        print(f"largest batch whose estimate fits {a.device_memory_gib} GiB: {best}")


if __name__ == "__main__":
    main()
