"""Llama 3 flavors, keyed by the names their sources use.

- "debugmodel": tiny, for CPU tests, over a byte tokenizer (256 bytes + BOS + EOS = 258 tokens).
- "lab": the small lab decoder of our origin documents.
- "small" ... "2.7B": the model sizes of Stanford CS336's assignment 1 (GPT-2's small to XL widths and a 2.7B),
  with its 10,000-token BPE vocabulary and RoPE theta 10,000.
- "Llama-3.2-1B", "Llama-3.2-3B", "Llama-3.1-8B": Meta's released models, as their Hugging Face config.json files
  give them (Llama 3.1 RoPE scaling, 128,256 tokens, 131,072 positions).
"""

from torchtitan.models.llama3.model import Llama3Args, RopeScaling

# CS336 assignment 1's table: name -> (d_model, d_ff, num_layers, num_heads).
_cs336_sizes = {
    "small": (768, 3072, 12, 12),
    "medium": (1024, 4096, 24, 16),
    "large": (1280, 5120, 36, 20),
    "xl": (1600, 6400, 48, 25),
    "2.7B": (2560, 10240, 32, 32),
}

llama3_configs: dict[str, Llama3Args] = {
    "debugmodel": Llama3Args(
        dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=258, ffn_dim=192, rope_theta=10000.0, max_seq_len=256
    ),
    "lab": Llama3Args(
        dim=512, n_layers=6, n_heads=8, vocab_size=10000, ffn_dim=2048, rope_theta=10000.0, max_seq_len=1024
    ),
}
for _name, (_dim, _ffn, _layers, _heads) in _cs336_sizes.items():
    llama3_configs[_name] = Llama3Args(
        dim=_dim, n_layers=_layers, n_heads=_heads, vocab_size=10000, ffn_dim=_ffn, rope_theta=10000.0, max_seq_len=1024
    )

# Meta's Llama 3.1 / 3.2: the numbers of their Hugging Face config.json (hidden_size, num_hidden_layers,
# num_attention_heads, num_key_value_heads, intermediate_size, rope_scaling, tie_word_embeddings).
_meta = dict(vocab_size=128256, norm_eps=1e-5, rope_theta=500000.0, max_seq_len=131072)


def _llama31_scaling(factor: float) -> RopeScaling:
    """Llama 3.1's RoPE scaling from its 8192-token pretraining context; a fresh object per flavor."""
    return RopeScaling(factor=factor, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192)


llama3_configs["Llama-3.2-1B"] = Llama3Args(
    dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim=8192, tie_embeddings=True,
    rope_scaling=_llama31_scaling(32.0), **_meta,
)  # fmt: skip
llama3_configs["Llama-3.2-3B"] = Llama3Args(
    dim=3072, n_layers=28, n_heads=24, n_kv_heads=8, ffn_dim=8192, tie_embeddings=True,
    rope_scaling=_llama31_scaling(32.0), **_meta,
)  # fmt: skip
llama3_configs["Llama-3.1-8B"] = Llama3Args(
    dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336, tie_embeddings=False,
    rope_scaling=_llama31_scaling(8.0), **_meta,
)  # fmt: skip
