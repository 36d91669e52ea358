"""DiT flavors (keys are the paper's names) and their TrainSpec registration."""

from dataclasses import replace

from torchtitan.models.dit.model import DiT, DiTArgs, flops_per_image
from torchtitan.models.dit.parallelize import parallelize_dit
from torchtitan.train_spec import TrainSpec, register_train_spec

__all__ = ["DiT", "DiTArgs", "dit_configs", "flops_per_image", "parallelize_dit"]

# Widths and depths from the DiT paper (Table 1); latent 32x32x4 inputs, 1000 classes, learned sigma.
_paper_sizes = {"S": (384, 12, 6), "B": (768, 12, 12), "L": (1024, 24, 16), "XL": (1152, 28, 16)}

dit_configs: dict[str, DiTArgs] = {
    # Tiny and CPU-friendly: the embedded 16x16 digits, 10 classes.
    "debug": DiTArgs(
        input_size=16, in_channels=1, patch_size=2, dim=128, depth=4, num_heads=4, num_classes=10, learn_sigma=False
    ),
}
for _size, (_dim, _depth, _heads) in _paper_sizes.items():
    for _patch in (2, 4, 8):
        dit_configs[f"DiT-{_size}/{_patch}"] = DiTArgs(dim=_dim, depth=_depth, num_heads=_heads, patch_size=_patch)

# Llama-style widths (RMSNorm + SwiGLU, QK-norm) on 64x64x16 latents with patch 2: 1024 tokens.
_llama_style = dict(
    input_size=64, in_channels=16, patch_size=2, norm="rmsnorm", mlp="swiglu", qk_norm=True, learn_sigma=False
)
dit_configs["0.5B"] = DiTArgs(dim=1280, depth=16, num_heads=20, **_llama_style)
dit_configs["7B"] = DiTArgs(dim=4096, depth=24, num_heads=32, **_llama_style)


def get_flavor(flavor: str) -> DiTArgs:
    """A fresh copy of a flavor's args, so overrides never leak into the registry."""
    return replace(dit_configs[flavor])


register_train_spec(
    TrainSpec(
        name="dit",
        model_cls=DiT,
        model_args=dit_configs,
        parallelize_fn=parallelize_dit,
        flops_per_image_fn=flops_per_image,
    )
)
