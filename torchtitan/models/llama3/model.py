"""Llama 3, after Grattafiori et al., "The Llama 3 Herd of Models", as TorchTitan's models/llama3/model.py writes it.

A plain nn.Module: no kernels, parallelism, DP, logging or config objects here. Two heads: a causal LM (`output`,
dim -> vocab) and sequence classification (`score`, dim -> num_labels, pooled at the last token as Hugging Face's
LlamaForSequenceClassification does when there is no padding).

RoPE uses Hugging Face's "rotate half" layout (pairs (x[i], x[i + hd/2]) of each head), not TorchTitan's complex
interleaved pairs: Hugging Face checkpoints then load with no permutation of wq and wk, and the table has DiT's
(T, hd/2, 2) cos/sin format. `freqs_cis` is TorchTitan's complex table seen through torch.view_as_real.
"""

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

try:  # FlexAttention (torch >= 2.5): the sliding window's fused kernel on CUDA
    from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention
except ImportError:  # an older torch: the dense mask everywhere
    BlockMask = create_block_mask = flex_attention = None


@dataclass
class RopeScaling:
    """Llama 3.1's RoPE frequency scaling (Hugging Face rope_type "llama3"): long wavelengths are slowed by `factor`,
    short ones kept, and the band between interpolated smoothly."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass
class Llama3Args:
    """Architecture of one Llama 3; flavors in `llama3_configs` fill these in."""

    dim: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: int | None = None  # None: n_heads (multi-head attention); fewer: grouped-query attention
    vocab_size: int = 128256
    ffn_dim: int = 14336  # SwiGLU hidden size (Hugging Face's intermediate_size)
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    rope_scaling: RopeScaling | dict | None = None  # None: plain RoPE; a dict is turned into RopeScaling
    max_seq_len: int = 131072  # rows of the RoPE table
    tie_embeddings: bool = False  # the LM head shares the token embedding's weight
    num_labels: int = 0  # 0: causal LM head `output`; > 0: sequence classification head `score`
    attn_window: int = 0  # > 0: each token attends itself and the attn_window - 1 tokens before it
    depth_init: bool = True  # TorchTitan's depth-scaled init of the residual projections (see init_weights)

    def __post_init__(self) -> None:
        if isinstance(self.rope_scaling, dict):
            known = RopeScaling.__dataclass_fields__
            self.rope_scaling = RopeScaling(**{key: value for key, value in self.rope_scaling.items() if key in known})

    @property
    def kv_heads(self) -> int:
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    def to_dict(self) -> dict:
        """Plain values (rope_scaling as a dict), e.g. for checkpoint metadata."""
        return asdict(self)

    def validate(self) -> None:
        """Raises ValueError naming the first field that cannot build a model."""
        for name in ("dim", "n_layers", "n_heads", "vocab_size", "ffn_dim", "max_seq_len"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.dim % self.n_heads != 0:
            raise ValueError(f"dim {self.dim} is not divisible by n_heads {self.n_heads}")
        if self.head_dim % 2 != 0:
            raise ValueError(f"dim / n_heads (head dim) must be even for RoPE, got {self.head_dim}")
        if self.kv_heads <= 0 or self.n_heads % self.kv_heads != 0:
            raise ValueError(f"n_kv_heads {self.n_kv_heads} must be > 0 and divide n_heads {self.n_heads}")
        if self.norm_eps <= 0:
            raise ValueError(f"norm_eps must be > 0, got {self.norm_eps}")
        if self.rope_theta <= 0:
            raise ValueError(f"rope_theta must be > 0, got {self.rope_theta}")
        if self.num_labels < 0:
            raise ValueError(f"num_labels must be >= 0, got {self.num_labels}")
        if self.attn_window < 0:
            raise ValueError(f"attn_window must be >= 0, got {self.attn_window}")
        if self.tie_embeddings and self.num_labels > 0:
            raise ValueError("tie_embeddings needs the LM head (num_labels 0): a classifier has no vocab-sized head")
        scaling = self.rope_scaling
        if scaling is not None and not isinstance(scaling, RopeScaling):
            raise ValueError(
                f"rope_scaling must be None or a RopeScaling (a dict is turned into one), got {type(scaling).__name__}"
            )
        if scaling is not None and not (scaling.factor > 0 and 0 < scaling.low_freq_factor < scaling.high_freq_factor):
            raise ValueError(f"rope_scaling needs factor > 0 and 0 < low_freq_factor < high_freq_factor, got {scaling}")


def rope_frequencies(args: Llama3Args, device: torch.device | None = None) -> torch.Tensor:
    """RoPE inverse frequencies (hd/2,), with Llama 3.1's scaling applied exactly as Hugging Face's
    `_compute_llama3_parameters` (float32, the same formulas, so the logits match to rounding)."""
    dim = args.head_dim
    inv_freq = 1.0 / (args.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim))
    scaling = args.rope_scaling
    if scaling is None:
        return inv_freq
    old_context_len = scaling.original_max_position_embeddings
    low_freq_wavelen = old_context_len / scaling.low_freq_factor
    high_freq_wavelen = old_context_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    # Wavelengths longer than the pretraining context are slowed by `factor`; shorter than high_freq_wavelen kept.
    inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
    # In between, interpolate between the two.
    smooth = (old_context_len / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * inv_freq_llama / scaling.factor + smooth * inv_freq_llama
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, inv_freq_llama)


def precompute_freqs_cis(args: Llama3Args, device: torch.device | None = None) -> torch.Tensor:
    """The (max_seq_len, hd/2, 2) table of (cos, sin) of position x frequency, in float32 as Hugging Face computes
    it (angles at long positions lose digits in float32; matching it matters more than the digits)."""
    positions = torch.arange(args.max_seq_len, dtype=torch.float32, device=device)
    angles = torch.outer(positions, rope_frequencies(args, device))  # (T, hd/2)
    return torch.stack([angles.cos(), angles.sin()], dim=-1)  # (T, hd/2, 2)


def apply_rotary_emb(x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
    """Rotates the pairs (x[i], x[i + hd/2]) of each head ("rotate half", as Hugging Face's Llama).

    x: (B, T, nh, hd); freqs_cis: (T, hd/2, 2). Computed in x's dtype, as Hugging Face does.
    """
    cos, sin = freqs_cis[:, None, :, 0].to(x.dtype), freqs_cis[:, None, :, 1].to(x.dtype)  # (T, 1, hd/2)
    x1, x2 = x.chunk(2, dim=-1)  # each (B, T, nh, hd/2)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def sliding_window_mask(seq_len: int, window: int, device: torch.device) -> torch.Tensor:
    """(T, T) boolean mask, True where query q may attend key k: causal and at most window - 1 tokens back."""
    pos = torch.arange(seq_len, device=device)
    offset = pos[:, None] - pos[None, :]  # q - k
    return (offset >= 0) & (offset < window)


_block_masks: dict[tuple, "BlockMask"] = {}  # (T, window, device) -> BlockMask: a build evaluates all T x T pairs
_compiled_flex_attention = None  # built on first use: torch.compile at import would cost every process seconds


def sliding_window_block_mask(seq_len: int, window: int, device: torch.device) -> "BlockMask":
    """The FlexAttention BlockMask of `sliding_window_mask`, cached per (T, window, device). Blocks of 128 x 128
    tokens wholly outside the band are skipped: the kernel's work grows with T x window, not T x T."""
    key = (seq_len, window, str(device))
    if key not in _block_masks:

        def sliding_window(b, h, q, k):
            return (q >= k) & (q - k < window)

        _block_masks[key] = create_block_mask(sliding_window, None, None, seq_len, seq_len, device=device)
    return _block_masks[key]


def window_mask(seq_len: int, window: int, device: torch.device) -> "torch.Tensor | BlockMask":
    """The mask sliding-window attention takes: a FlexAttention BlockMask on CUDA (when this torch has FlexAttention),
    the dense (T, T) boolean mask elsewhere (FlexAttention has no CPU backward)."""
    if device.type == "cuda" and flex_attention is not None:
        return sliding_window_block_mask(seq_len, window, device)
    return sliding_window_mask(seq_len, window, device)


def windowed_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_mask: "BlockMask",
                       grouped: bool) -> torch.Tensor:  # fmt: skip
    """FlexAttention of q (B, nh, T, hd) over k, v (B, nkv, T, hd) -> (B, nh, T, hd); GQA reads each kv head once.

    A fused kernel only when compiled (its eager path materializes the (B, nh, T, T) scores), so eager CUDA blocks
    call a compiled copy, as TorchTitan and our DiT do; compiled blocks trace it. Elsewhere (a CPU test) it runs
    eagerly, forward only.
    """
    global _compiled_flex_attention
    if torch.compiler.is_compiling() or not q.is_cuda:
        return flex_attention(q, k, v, block_mask=block_mask, enable_gqa=grouped)
    if _compiled_flex_attention is None:
        _compiled_flex_attention = torch.compile(flex_attention, dynamic=False)
    return _compiled_flex_attention(q, k, v, block_mask=block_mask, enable_gqa=grouped)


class Attention(nn.Module):
    """Causal grouped-query attention with RoPE; n_heads / n_kv_heads query heads share each key/value head."""

    def __init__(self, args: Llama3Args):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.kv_heads, args.head_dim
        self.wq = nn.Linear(args.dim, args.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * self.head_dim, args.dim, bias=False)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor, mask=None) -> torch.Tensor:
        """x (B, T, D), freqs_cis (T, hd/2, 2), mask None (causal), a (T, T) boolean or a FlexAttention BlockMask
        (`window_mask`) -> (B, T, D)."""
        B, T, _ = x.shape
        q = self.wq(x).view(B, T, self.n_heads, self.head_dim)  # (B, T, nh, hd)
        k = self.wk(x).view(B, T, self.n_kv_heads, self.head_dim)  # (B, T, nkv, hd)
        v = self.wv(x).view(B, T, self.n_kv_heads, self.head_dim)
        q, k = apply_rotary_emb(q, freqs_cis), apply_rotary_emb(k, freqs_cis)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, nh or nkv, T, hd)
        grouped = self.n_kv_heads != self.n_heads
        if mask is None:
            # enable_gqa lets the flash kernels read each kv head once instead of a repeated copy.
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=grouped)
        elif not isinstance(mask, torch.Tensor):  # a BlockMask: only the blocks of the band are computed
            out = windowed_attention(q, k, v, mask, grouped)
        else:
            # A dense mask rules the flash backend out and the memory-efficient one has no GQA: repeat kv heads.
            if grouped:
                repeats = self.n_heads // self.n_kv_heads
                k, v = k.repeat_interleave(repeats, dim=1), v.repeat_interleave(repeats, dim=1)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.wo(out.transpose(1, 2).reshape(B, T, -1))  # (B, T, D)


class FeedForward(nn.Module):
    """SwiGLU MLP (Shazeer, "GLU Variants Improve Transformer"): w2(silu(w1 x) * w3 x)."""

    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)  # gate (Hugging Face's gate_proj)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)  # down_proj
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)  # up_proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    """Pre-norm block: x + attention(norm(x)), then + feed_forward(norm(.))."""

    def __init__(self, layer_id: int, args: Llama3Args):
        super().__init__()
        self.layer_id = layer_id
        self.attention_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.feed_forward = FeedForward(args.dim, args.ffn_dim)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor, mask=None) -> torch.Tensor:
        """x (B, T, D) -> (B, T, D); mask as Attention takes it."""
        h = x + self.attention(self.attention_norm(x), freqs_cis, mask)
        return h + self.feed_forward(self.ffn_norm(h))


class Llama3(nn.Module):
    """Llama 3: token embedding -> blocks -> RMSNorm -> LM head (B, T, vocab) or classifier (B, num_labels)."""

    def __init__(self, args: Llama3Args):
        super().__init__()
        args.validate()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        # Non-persistent: init_weights() recomputes it, so it survives a meta-device build and is never checkpointed.
        self.register_buffer("freqs_cis", precompute_freqs_cis(args), persistent=False)
        # A ModuleDict keyed by index, as TorchTitan does, so FQNs stay stable when blocks are wrapped.
        self.layers = nn.ModuleDict({str(i): TransformerBlock(i, args) for i in range(args.n_layers)})
        self.norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        if args.num_labels > 0:
            self.score = nn.Linear(args.dim, args.num_labels, bias=False)
        else:
            self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
            self.tie_weights()

    def tie_weights(self) -> None:
        """Makes `output.weight` the very Parameter `tok_embeddings.weight` when tie_embeddings; to_empty() unties
        them (it builds one new Parameter per module), so init_weights() calls this again."""
        if self.args.tie_embeddings and self.output.weight is not self.tok_embeddings.weight:
            self.output.weight = self.tok_embeddings.weight

    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        """Owns every initialization (TorchTitan's init_weights), so a meta-built model can be materialized with
        `model.to_empty(device=...)` then `model.init_weights()`.

        Args:
            buffer_device: where to build the RoPE table; default the device of `tok_embeddings.weight`.
        """
        args = self.args
        self.tie_weights()
        with torch.no_grad():
            device = buffer_device or self.tok_embeddings.weight.device
            self.freqs_cis = precompute_freqs_cis(args, device)
            # Embeddings N(0, 0.02) as GPT-2 and Hugging Face's initializer_range: with tied weights the same
            # values are the LM head, and TorchTitan's N(0, 1) would make the first logits huge.
            nn.init.normal_(self.tok_embeddings.weight, std=0.02)
            # Keys run "0" .. "L-1" in order; the index, not an attribute, survives AC and compile wrappers.
            for layer_id, layer in enumerate(self.layers.values()):
                # Projections that write into the residual stream get a smaller std, so the stream's variance does
                # not grow with depth: 0.02 / sqrt(2 (layer_id + 1)) (TorchTitan's depth_init) or / sqrt(2 L).
                depth = layer_id + 1 if args.depth_init else args.n_layers
                residual_std = 0.02 / (2 * depth) ** 0.5
                attention, feed_forward = layer.attention, layer.feed_forward
                for linear in (attention.wq, attention.wk, attention.wv, feed_forward.w1):
                    nn.init.trunc_normal_(linear.weight, mean=0.0, std=0.02)
                for linear in (attention.wo, feed_forward.w2, feed_forward.w3):  # TorchTitan scales w3 too
                    nn.init.trunc_normal_(linear.weight, mean=0.0, std=residual_std)
                layer.attention_norm.reset_parameters()  # ones
                layer.ffn_norm.reset_parameters()
            self.norm.reset_parameters()
            # The head: std dim^-0.5 truncated at 3 std, as TorchTitan's `output`, so logits start O(1).
            # A tied head is the embedding, initialized above.
            head = self.score if args.num_labels > 0 else self.output
            if not args.tie_embeddings:
                std = args.dim**-0.5
                nn.init.trunc_normal_(head.weight, mean=0.0, std=std, a=-3 * std, b=3 * std)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens (B, T) int64 -> logits (B, T, vocab_size), or (B, num_labels) for a classifier (last position)."""
        T = tokens.shape[1]
        if T > self.args.max_seq_len:
            raise ValueError(f"sequence length {T} exceeds max_seq_len {self.args.max_seq_len}")
        h = self.tok_embeddings(tokens)  # (B, T, D)
        freqs_cis = self.freqs_cis[:T]
        mask = window_mask(T, self.args.attn_window, tokens.device) if self.args.attn_window else None
        for layer in self.layers.values():
            h = layer(h, freqs_cis, mask)
        if self.args.num_labels > 0:
            # LlamaForSequenceClassification pools the last non-padding position: with no padding, the last one.
            # The head runs on that position only, (B, D) rather than (B, T, D), which gives the same logits.
            return self.score(self.norm(h[:, -1]))  # (B, num_labels)
        return self.output(self.norm(h))  # (B, T, vocab)


def num_params(model: nn.Module, exclude_embedding: bool = True) -> int:
    """Parameters of `model`, each shared Parameter once; without the token embedding table by default (as
    TorchTitan's count for FLOPs), which with tied weights also leaves out the LM head."""
    total = sum(p.numel() for p in model.parameters())
    if exclude_embedding and hasattr(model, "tok_embeddings"):
        total -= model.tok_embeddings.weight.numel()
    return total


def matmul_params_per_token(args: Llama3Args) -> int:
    """Weights each token multiplies by: every block's linears and the LM head (norms and the embedding lookup
    are no matmuls). A classifier's head runs once per sequence, so flops_per_token spreads it over the tokens."""
    hd, kv = args.head_dim, args.kv_heads
    attention = args.dim * args.n_heads * hd + 2 * args.dim * kv * hd + args.n_heads * hd * args.dim
    feed_forward = 3 * args.dim * args.ffn_dim
    head = 0 if args.num_labels > 0 else args.dim * args.vocab_size
    return args.n_layers * (attention + feed_forward) + head


def flops_per_token(args: Llama3Args, seq_len: int) -> float:
    """Training FLOPs per token (forward + backward), PaLM's convention (Chowdhery et al., appendix B) as TorchTitan
    uses for MFU: 6 N + 12 L D T.

    N counts the weights of every matmul (matmul_params_per_token: blocks and LM head, tied or not; the embedding
    lookup is no matmul); 6 = 2 FLOPs per multiply-add x (forward + the two backward matmuls). Attention's two
    (T x T) products add 12 L D T per token, counting the full T x T although causal attention needs about half of
    it (PaLM and TorchTitan do the same, and so do SDPA's FLOP formulas), and a sliding window is not discounted
    either. A classifier's head (D x num_labels, once per sequence) adds 6 D num_labels / T. Norms, RoPE, softmax
    and pointwise ops are left out.
    """
    flops = 6.0 * matmul_params_per_token(args) + 12.0 * args.n_layers * args.n_heads * args.head_dim * seq_len
    if args.num_labels > 0:
        flops += 6.0 * args.dim * args.num_labels / seq_len
    return flops
