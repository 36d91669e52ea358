"""DP-SGD for TorchDiTan: per-sample clipping (ghost, flash, book-keeping), noise, accounting.

The training step calls `DPEngine.backward(per_sample_losses)` in place of `loss.backward()`;
`PrivacyAccountant` turns (sample rate, noise multiplier, steps) into epsilon with Opacus.
See docs/dp.md.
"""

from torchtitan.dp.engine import DP_MODES, DPEngine
from torchtitan.dp.layers import LayerRule, register_layer_rule
from torchtitan.dp.sampling import PoissonBatchSampler, pad_batch

__all__ = [
    "DP_MODES",
    "DPEngine",
    "LayerRule",
    "PoissonBatchSampler",
    "PrivacyAccountant",
    "calibrate_noise_multiplier",
    "pad_batch",
    "register_layer_rule",
]


def __getattr__(name: str):
    # The accountant imports Opacus: only runs that account for privacy need it installed.
    if name in ("PrivacyAccountant", "calibrate_noise_multiplier"):
        from torchtitan.dp import accountant

        return getattr(accountant, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
