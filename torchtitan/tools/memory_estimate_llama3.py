"""Llama 3's part of the memory estimate: its parameters and what a TransformerBlock and the head keep for backward.

    python -m torchtitan.tools.memory_estimate --model llama3 --flavor Llama-3.1-8B --batch 2 --seq-len 8192

The estimator itself (precision rules, activation checkpointing, compile, FSDP, the peak) is the one the DiT uses
(torchtitan/tools/memory_estimate_core.py); this module only describes the model (`llama3_model_memory`).

Parameters: exact (`parameter_shapes`; a tied LM head is the embedding's Parameter, counted once).

Activations, one row per tensor autograd keeps (`layer_saved_tensors`, `head_saved_tensors`):
- fp32 eager on CPU: exact to the byte against the trainer's first forward (tests/test_memory_estimate.py), for the
  causal LM and the classifier, sliding windows, and every AC mode (`cuda_kernels=False`). CUDA runs other kernels,
  which a CUDA estimate assumes (`cuda_kernels=True`, not measured here): CPU's composite RMSNorm keeps x * rstd
  besides its input and rstd, CUDA's fused one (aten._fused_rms_norm) only those two; and a sliding window runs
  FlexAttention on CUDA but SDPA with a dense (T, T) mask on CPU (models/llama3/model.py, `window_mask`).
- attention: a fused kernel (SDPA's flash or cuDNN, FlexAttention, CPU's flash) keeps q and k after RoPE, v, its
  output (wo's input is a view of it) and the fp32 logsumexp; grouped-query heads are not repeated (enable_gqa).
  The dense-mask path repeats k and v to every head (both kept) and keeps SDPA's float copy of the mask per layer;
  checkpoints keep the bool mask. A math fallback, which keeps the (B, nh, T, T) probabilities, is not modelled.
- bf16 autocast, eager (an estimate; the casting was checked under CPU autocast): the residual stream stays fp32
  (the embedding lookup and the residual adds run in the fp32 weights' dtype), the norms run on it in fp32, and
  every Linear casts its input to bf16 by itself, so wq, wk and wv keep three bf16 copies of the attention norm's
  output and w1 and w3 two of the FFN norm's; RoPE keeps bf16 copies of its cos and sin tables.
- bf16 FSDP parameters: everything in bf16 but the fp32 rstd, logsumexp and loss, and RoPE's cos and sin copies
  (the table stays an fp32 buffer) (an estimate).
- compiled blocks: the DiT's partitioner rule (recompute pointwise chains, keep what a backward matmul or
  attention reads): no x * rstd, silu, per-Linear or cos/sin copies (an estimate).
- the head: the final norm, the LM head's input, and cross-entropy's fp32 log-softmax (B, T, V). The logits
  (B, T, V) and the fp32 copy `logits.float()` makes of bf16 ones (in fp32 it returns the logits themselves) are
  freed when the forward ends, so they are no activation; the loss's two fp32 vocabulary-sized gradients are
  backward's working set at its start (`ModelMemory.head_working`), which a causal LM's peak is made of.
"""

import math

from torchtitan.models.llama3.model import Llama3Args
from torchtitan.tools.memory_estimate_core import (
    MemoryEstimate,
    ModelMemory,
    SavedTensor,
    estimate_model_memory,
    fmt_bytes,
)


def parameter_shapes(args: Llama3Args) -> dict[str, tuple[int, ...]]:
    """Every parameter of Llama3(args) by its name, as named_parameters() lists it (a tied head once)."""
    D, hd, F = args.dim, args.head_dim, args.ffn_dim
    shapes: dict[str, tuple[int, ...]] = {"tok_embeddings.weight": (args.vocab_size, D)}
    for i in range(args.n_layers):
        layer = f"layers.{i}"
        shapes[f"{layer}.attention_norm.weight"] = (D,)
        shapes[f"{layer}.attention.wq.weight"] = (args.n_heads * hd, D)
        shapes[f"{layer}.attention.wk.weight"] = shapes[f"{layer}.attention.wv.weight"] = (args.kv_heads * hd, D)
        shapes[f"{layer}.attention.wo.weight"] = (D, args.n_heads * hd)
        shapes[f"{layer}.ffn_norm.weight"] = (D,)
        shapes[f"{layer}.feed_forward.w1.weight"] = shapes[f"{layer}.feed_forward.w3.weight"] = (F, D)
        shapes[f"{layer}.feed_forward.w2.weight"] = (D, F)
    shapes["norm.weight"] = (D,)
    if args.num_labels > 0:
        shapes["score.weight"] = (args.num_labels, D)
    elif not args.tie_embeddings:
        shapes["output.weight"] = (args.vocab_size, D)
    return shapes


def _norm_rows(name: str, tokens: int, dim: int, cuda_kernels: bool) -> list[SavedTensor]:
    """An RMSNorm's rstd and, on CPU's composite path, x * rstd: the weight's multiplicand (its input is the row
    before it, its output the matmul input after it)."""
    return [
        SavedTensor(f"{name} rstd (B, T, 1), fp32", tokens, "fp32"),
        SavedTensor(
            f"{name} x * rstd (B, T, D), fp32: CPU's composite RMSNorm only",
            tokens * dim,
            "fp32",
            eager=not cuda_kernels,
            compiled=False,
        ),
    ]


def layer_saved_tensors(args: Llama3Args, seq_len: int, precision: str = "fp32",
                        cuda_kernels: bool = False) -> list[SavedTensor]:  # fmt: skip
    """What one TransformerBlock keeps for backward, per sequence, in the order its forward creates them.

    Args:
        args: the architecture; seq_len: T.
        precision: adds the bf16 copies autocast makes per Linear input ("bf16_autocast") and RoPE's bf16 cos/sin
            copies (any bf16 precision).
        cuda_kernels: CUDA's fused RMSNorm (keeps input and rstd only) and FlexAttention for a sliding window,
            rather than CPU's composite RMSNorm and dense-mask SDPA.
    """
    T, D, F, nh, hd = seq_len, args.dim, args.ffn_dim, args.n_heads, args.head_dim
    H, KV = nh * hd, args.kv_heads * hd
    autocast, window = precision == "bf16_autocast", args.attn_window > 0 and not cuda_kernels  # a dense mask
    rows = [
        SavedTensor("block input x (B, T, D): attention_norm's input", T * D, "stream", selective=True),
        *_norm_rows("attention_norm", T, D, cuda_kernels),
        SavedTensor("attention_norm output (B, T, D): wq/wk/wv's input", T * D),
    ]
    if autocast:  # each Linear casts its fp32 input itself; compiled code casts once
        rows.append(SavedTensor("autocast's bf16 copies of it for wk and wv (B, T, D) x 2", 2 * T * D, compiled=False))
    rows += [  # per-op selective AC keeps every matmul's output
        SavedTensor("wq output (B, T, nh x hd): RoPE's input", T * H, eager=False, compiled=False, selective=True),
        SavedTensor("wk output (B, T, nkv x hd): RoPE's input", T * KV, eager=False, compiled=False, selective=True),
        SavedTensor(
            "v = wv output (B, T, nkv, hd): SDPA's input", T * KV, eager=not window, compiled=not window, selective=True
        ),
    ]
    if precision != "fp32":  # the fp32 table cast to q's dtype, once per call; the muls keep them
        rows.append(SavedTensor("RoPE's bf16 cos and sin for q and k (T, hd/2) x 4, per batch", 2 * T * hd,
                                compiled=False, per_batch=True))  # fmt: skip
    rows += [
        SavedTensor("q after RoPE (B, T, nh, hd)", T * H),
        SavedTensor("k after RoPE (B, T, nkv, hd)", T * KV, eager=not window, compiled=not window),
    ]
    if window:  # the dense mask rules out enable_gqa: SDPA gets k and v repeated to every head, and a float mask
        rows += [
            SavedTensor("k, v repeated to nh heads (B, nh, T, hd) x 2", 2 * T * H),
            SavedTensor("SDPA's additive float mask from the bool mask (T, T), per batch", T * T, per_batch=True),
        ]
    rows += [
        SavedTensor("SDPA output (B, T, nh, hd): wo's input is a view of it", T * H, selective=True),
        SavedTensor("SDPA logsumexp (B, nh, T), fp32", nh * T, "fp32", selective=True),
        SavedTensor("wo output (B, T, D)", T * D, eager=False, compiled=False, selective=True),
        SavedTensor("h = x + attention (B, T, D): ffn_norm's input", T * D, "stream"),
        *_norm_rows("ffn_norm", T, D, cuda_kernels),
        SavedTensor("ffn_norm output (B, T, D): w1/w3's input", T * D),
    ]
    if autocast:
        rows.append(SavedTensor("autocast's bf16 copy of it for w3 (B, T, D)", T * D, compiled=False))
    return rows + [
        SavedTensor(f"w1 output (B, T, {F}): silu's input", T * F, selective=True),
        SavedTensor(f"silu(w1 x) (B, T, {F})", T * F, compiled=False),
        SavedTensor(f"w3 output (B, T, {F})", T * F, selective=True),
        SavedTensor(f"silu(w1 x) * w3 x (B, T, {F}): w2's input", T * F),
        SavedTensor("w2 output (B, T, D)", T * D, eager=False, compiled=False, selective=True),
    ]


def head_saved_tensors(args: Llama3Args, seq_len: int, cuda_kernels: bool = False) -> list[SavedTensor]:
    """What the model keeps outside the blocks, per sequence (final norm, head, loss); always eager. A classifier
    normalizes the last position only, (B, D), but its input is a view that keeps the whole last block output."""
    T, D = seq_len, args.dim
    pooled = 1 if args.num_labels > 0 else T  # positions the final norm and the head see
    classes = args.num_labels if args.num_labels > 0 else args.vocab_size
    head = "score" if args.num_labels > 0 else "LM head"
    rows = [
        SavedTensor("last block output (B, T, D): the final norm's input", T * D, "stream"),
        SavedTensor(f"final norm rstd (B, {'1' if pooled == 1 else 'T'}), fp32", pooled, "fp32"),
        SavedTensor(
            "final norm x * rstd, fp32: CPU's composite RMSNorm only", pooled * D, "fp32", eager=not cuda_kernels
        ),
        SavedTensor(f"final norm output: the {head}'s input", pooled * D),
        SavedTensor(
            f"cross-entropy's log-softmax of the fp32 logits (B, {'T, ' * (pooled > 1)}{classes}), fp32",
            pooled * classes,
            "fp32",
        ),
    ]
    if args.num_labels == 0:  # the loss's flatten() makes a view of the targets, which nll_loss keeps
        rows.append(SavedTensor("next-token targets (B, T), int64: two fp32-sized elements per token", 2 * T, "fp32"))
    return rows + [
        SavedTensor("the returned per-sample loss (B,), fp32", 1, "fp32"),
        SavedTensor("nll_loss's total weight, a scalar, per batch", 1, "fp32", per_batch=True),
    ]


def llama3_model_memory(args: Llama3Args, seq_len: int, precision: str, cuda_kernels: bool = True) -> ModelMemory:
    """Llama 3's description for the estimator (`estimate_model_memory`): see `estimate_llama3_memory`."""
    T, D, V, F = seq_len, args.dim, args.vocab_size, args.ffn_dim
    compute = 4 if precision == "fp32" else 2
    shapes = parameter_shapes(args)
    # Every Linear's weight; a tied LM head multiplies by the embedding's weight (the lookup itself casts nothing).
    weights = {n: math.prod(s) for n, s in shapes.items() if "norm" not in n and "embeddings" not in n}
    if args.num_labels == 0 and args.tie_embeddings:
        weights["output.weight (tied: tok_embeddings.weight)"] = V * D
    lm = args.num_labels == 0
    logits, upcast = T * V * compute, T * V * 4 if compute != 4 else 0
    kv = f"{args.kv_heads} kv heads" + (f", a {args.attn_window}-token sliding window" if args.attn_window else "")
    kernels = "CUDA's (fused RMSNorm, FlexAttention)" if cuda_kernels else "CPU's (composite RMSNorm, dense masks)"
    header = [f"Llama 3: D {D}, {args.n_layers} layers, {args.n_heads} heads ({kv}), head dim {args.head_dim}, "
              f"FFN {F}, vocabulary {V}, T {T}; kernels: {kernels}"]  # fmt: skip
    notes = []
    if lm:
        notes.append(f"logits (B, T, V) = {T} x {V} x {compute} B" + (f", + the fp32 copy .float() makes = {T} x "
                     f"{V} x 4 B" if upcast else " (.float() returns them)") + f": {fmt_bytes(logits + upcast)} per "
                     "sequence, freed when the forward ends; the loss keeps its fp32 log-softmax")  # fmt: skip
    return ModelMemory(
        shapes=shapes,
        block_prefix="layers.",
        depth=args.n_layers,
        tokens=T,
        dim=D,
        buffer_bytes=4 * args.max_seq_len * args.head_dim,  # freqs_cis (max_seq_len, hd/2, 2), fp32
        block_rows=layer_saved_tensors(args, T, precision, cuda_kernels),
        head_rows=head_saved_tensors(args, T, cuda_kernels),
        block_input=SavedTensor("block input x (B, T, D)", T * D, "stream"),
        matmul_weights=weights,
        # Rough, as the DiT's SwiGLU: the gradients of w1's and w3's outputs and of their product, alive together.
        block_working=4 * T * F * compute,
        # Backward starts at the loss: the fp32 gradients of the log-softmax and of the logits (B, T, V) together.
        head_working=2 * T * V * 4 if lm else 0,
        # A checkpoint keeps its arguments: the dense (T, T) bool mask, once for all of them (the model caches
        # FlexAttention's BlockMask instead of making one per step).
        checkpoint_extra=T * T if args.attn_window and not cuda_kernels else 0,
        header=header,
        notes=notes,
        block_name="TransformerBlock",
        head_name="final norm, head, loss",
        sample="sequence",
    )


def estimate_llama3_memory(args: Llama3Args, batch: int, seq_len: int, precision: str = "bf16_autocast",
                           ac_mode: str = "none", ac_option: str = "op", compiled: bool = False, dp_shard: int = 1,
                           dp_replicate: int = 1, rank: int = 0, ema: bool = False,
                           reshard_after_forward: str = "default", cuda_kernels: bool = True,
                           optimizer: tuple[str, float] = ("AdamW", 0.0)) -> MemoryEstimate:  # fmt: skip
    """Memory of one rank training Llama3(args) on sequences of `seq_len` tokens.

    Args:
        args: the architecture (a llama3_configs flavor with overrides: num_labels, attn_window).
        batch: local batch size (sequences per rank per forward); seq_len: tokens per sequence (T).
        precision, ac_mode, ac_option, compiled, dp_shard, dp_replicate, rank, ema, reshard_after_forward,
            optimizer: as memory_estimate.estimate_memory's.
        cuda_kernels: CUDA's kernels (True: fused RMSNorm, FlexAttention windows) or CPU's (False: composite
            RMSNorm, which keeps x * rstd, and dense-mask SDPA windows: the paths measured exactly).
    """
    model = llama3_model_memory(args, seq_len, precision, cuda_kernels)
    return estimate_model_memory(model, batch, precision, ac_mode, ac_option, compiled, dp_shard, dp_replicate, rank,
                                 ema, reshard_after_forward, optimizer)  # fmt: skip
