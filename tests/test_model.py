"""The plain DiT: shapes, the paper's block, adaLN-Zero identity at init, RoPE relativity, FLOP formula, meta build."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from torchtitan.models.dit import DiT, DiTArgs, dit_configs, flops_per_image
from torchtitan.models.dit import model as dit_model
from torchtitan.models.dit.rope import apply_rope, build_rope_2d


def tiny(**overrides):
    return dataclasses.replace(dit_configs["debug"], **{"dim": 64, "depth": 2, "num_heads": 4, **overrides})


def perturbed(model: DiT, scale: float = 0.02) -> DiT:
    """Zero-initialized layers make most outputs trivially 0; perturb every parameter."""
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn_like(p))
    return model


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"learn_sigma": True},
        {"pos_embed": "sincos"},
        {"pos_embed": "learned"},
        {"norm": "rmsnorm", "mlp": "swiglu", "qk_norm": True},
        {"num_classes": 0},
        {"patch_size": 4, "in_channels": 3, "input_size": 32},
    ],
)
def test_forward_shapes(overrides):
    args = tiny(**overrides)
    model = DiT(args)
    model.init_weights()
    x = torch.randn(3, args.in_channels, args.input_size, args.input_size)
    y = torch.tensor([0, 1, args.num_classes]) if args.num_classes else None  # the last is the null class
    out = perturbed(model)(x, torch.tensor([0.0, 10.0, 999.0]), y)
    assert out.shape == (3, args.out_channels, args.input_size, args.input_size)
    assert torch.isfinite(out).all()


def test_adaln_zero_blocks_are_identity_at_init():
    model = DiT(tiny())
    model.init_weights()
    h = torch.randn(2, model.args.num_tokens, model.args.dim)
    c = torch.randn(2, model.args.dim)
    for block in model.blocks.values():
        torch.testing.assert_close(block(h, c, model.rope), h, rtol=0, atol=0)
    # The zeroed final layer makes the whole model predict 0.
    out = model(torch.randn(2, 1, 16, 16), torch.tensor([3.0, 4.0]), torch.tensor([1, 2]))
    assert out.abs().max() == 0


def test_block_is_the_papers_adaln_zero_block():
    # DiT's block written out: x + gate * attn(modulate(norm(x))), then the same for the MLP, norms without weights.
    torch.manual_seed(0)
    args = tiny(norm="rmsnorm", mlp="swiglu")
    block = dit_model.DiTBlock(args)
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.1)
    x, c = torch.randn(2, 64, args.dim), torch.randn(2, args.dim)
    shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = block.adaLN_modulation(c).chunk(6, dim=-1)

    def modulated_norm(x, shift, scale):
        return F.rms_norm(x, (args.dim,), eps=args.norm_eps) * (1 + scale[:, None]) + shift[:, None]

    def mlp(h):
        gate, up = block.mlp.fc1(h).chunk(2, dim=-1)
        return block.mlp.fc2(F.silu(gate) * up)

    expected = x + gate_msa[:, None] * block.attn(modulated_norm(x, shift_msa, scale_msa), None)
    expected = expected + gate_mlp[:, None] * mlp(modulated_norm(expected, shift_mlp, scale_mlp))
    torch.testing.assert_close(block(x, c, None), expected, rtol=0, atol=0)
    assert not list(block.norm1.parameters()) and not list(block.norm2.parameters())


def test_args_from_an_older_export_drop_the_kernel_switches():
    # Exports before the converters carried fused_norm/fused_mlp/fused_qkv in their "model_args" metadata.
    old = {**dataclasses.asdict(tiny()), "fused_norm": True, "fused_mlp": False, "fused_qkv": True}
    assert DiTArgs.from_dict(old) == tiny()
    with pytest.raises(TypeError, match="fused_gelu"):
        DiTArgs.from_dict({**old, "fused_gelu": True})


def test_rope_is_relative():
    """Shifting every position by the same offset leaves all attention scores unchanged."""
    torch.manual_seed(0)
    q, k = torch.randn(2, 64, 4, 32), torch.randn(2, 64, 4, 32)  # (B, T, nh, hd), as the model applies it
    base = build_rope_2d(32, 8, 8)
    shifted = build_rope_2d(32, 8, 8, offset=(5, -3))

    def scores(table):  # (B, nh, T, T)
        return apply_rope(q, table).transpose(1, 2) @ apply_rope(k, table).permute(0, 2, 3, 1)

    torch.testing.assert_close(scores(base), scores(shifted), rtol=1e-4, atol=1e-4)
    # ... while the embedding itself does change the scores (it is not a no-op).
    assert (scores(base) - q.transpose(1, 2) @ k.permute(0, 2, 3, 1)).abs().max() > 1e-2


def _math_sdpa(q, k, v, **kwargs):
    attn = (q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5).softmax(-1)
    return attn @ v


@pytest.mark.parametrize("flavor_overrides", [{}, {"learn_sigma": True, "mlp": "swiglu", "norm": "rmsnorm"}])
def test_flop_formula_matches_flop_counter(monkeypatch, flavor_overrides):
    # FlopCounterMode counts 0 for CPU SDPA, so attention runs as explicit matmuls here.
    monkeypatch.setattr(dit_model.F, "scaled_dot_product_attention", _math_sdpa)
    args = tiny(**flavor_overrides)
    model = DiT(args)
    model.init_weights()
    batch = 3
    x = torch.randn(batch, args.in_channels, args.input_size, args.input_size)
    with FlopCounterMode(display=False) as counter:
        model(x, torch.rand(batch) * 1000, torch.randint(0, 10, (batch,)))
    assert counter.get_total_flops() == pytest.approx(batch * flops_per_image(args) / 3, rel=1e-9)


def test_paper_sizes_and_meta_build():
    # DiT-XL/2 has 675M parameters and 118.6 GFLOPs (multiply-adds) per forward in the DiT paper.
    args = dit_configs["DiT-XL/2"]
    with torch.device("meta"):
        model = DiT(args)
    assert sum(p.numel() for p in model.parameters()) == pytest.approx(675e6, rel=0.01)
    assert flops_per_image(args) / 3 / 2 / 1e9 == pytest.approx(118.6, rel=0.01)
    for name in ("debug", "DiT-S/2", "DiT-B/2", "DiT-L/2", "DiT-L/8", "DiT-XL/2", "0.5B", "7B"):
        assert name in dit_configs
    assert dit_configs["7B"].norm == "rmsnorm" and dit_configs["7B"].mlp == "swiglu"


def test_sdpa_matches_math_attention():
    args = tiny()
    torch.manual_seed(0)
    model = perturbed(DiT(args))
    model.init_weights()
    perturbed(model)
    x, t, y = torch.randn(2, 1, 16, 16), torch.tensor([5.0, 500.0]), torch.tensor([1, 3])
    expected = model(x, t, y)
    original = F.scaled_dot_product_attention
    try:
        dit_model.F.scaled_dot_product_attention = _math_sdpa
        got = model(x, t, y)
    finally:
        dit_model.F.scaled_dot_product_attention = original
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_windowed_attention_matches_masked_sdpa():
    """The 2D neighbourhood mask (dense on CPU, FlexAttention's block mask on GPU) equals SDPA with the mask
    written out by hand."""
    args = tiny(attn_window=1)
    torch.manual_seed(0)
    model = DiT(args)
    model.init_weights()
    perturbed(model)
    grid = args.input_size // args.patch_size
    rows, cols = torch.arange(grid * grid) // grid, torch.arange(grid * grid) % grid
    mask = ((rows[:, None] - rows[None]).abs() <= 1) & ((cols[:, None] - cols[None]).abs() <= 1)

    original = F.scaled_dot_product_attention

    def masked_sdpa(q, k, v, **kwargs):
        return original(q, k, v, attn_mask=mask)

    x, t, y = torch.randn(2, 1, 16, 16), torch.tensor([5.0, 500.0]), torch.tensor([1, 3])
    assert torch.equal(model.block_mask, mask)
    windowed = model(x, t, y)
    windowed.sum().backward()  # trains on CPU too
    model.block_mask = None
    try:
        dit_model.F.scaled_dot_product_attention = masked_sdpa
        with torch.no_grad():
            dense = model(x, t, y)
    finally:
        dit_model.F.scaled_dot_product_attention = original
    torch.testing.assert_close(windowed.detach(), dense, rtol=1e-5, atol=1e-5)
    global_attention = DiT(tiny())
    global_attention.load_state_dict(model.state_dict())
    global_attention.init_buffers()
    assert (global_attention(x, t, y) - windowed).abs().max() > 1e-4  # the window does change the output


def test_flex_block_mask_path_matches_the_dense_mask():
    """The GPU path: FlexAttention over the block mask (compiled on first use from eager code, as CUDA runs it)
    equals SDPA over the dense mask; on CPU FlexAttention runs forward only, so no gradients here."""
    from torch.nn.attention.flex_attention import create_block_mask

    grid, window = 4, 1
    dense = dit_model.window_block_mask(grid, window, torch.device("cpu"))
    block_mask = create_block_mask(lambda b, h, q, k: dense[q, k], None, None, grid**2, grid**2, device="cpu",
                                   BLOCK_SIZE=grid**2)  # fmt: skip
    q, k, v = torch.randn(3, 2, 2, grid**2, 8).unbind(0)
    got = dit_model.windowed_attention(q, k, v, block_mask)
    torch.testing.assert_close(got, F.scaled_dot_product_attention(q, k, v, attn_mask=dense), rtol=1e-5, atol=1e-5)
