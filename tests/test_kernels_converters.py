"""Converters (torchtitan/kernels/converters.py) against the plain DiT: the same outputs and parameter gradients, the
same state dict, and the config that names them.

On CPU the converted modules run the torch maths: they must give the plain model's numbers to the bit. In the
TRITON_INTERPRET=1 child process of `test_kernels_in_interpreter` they run the kernels on CPU tensors: the numbers
agree to the kernel tests' tolerance, and each kernel must be in the autograd graph.
"""

import dataclasses

import pytest
import torch

from tests.conftest import INTERPRETED_IMAGE_SIZE, assert_close_by_name, debug_dit_outputs_and_grads
from torchtitan.job_config import Float8
from torchtitan.kernels.converters import Conversion, apply_converters
from torchtitan.kernels.dit_modules import (
    FusedNormDiTBlock,
    FusedQKVAttention,
    ResidualStream,
    apply_fused_qkv,
    residual_finished,
)
from torchtitan.kernels.triton_support import triton_interpreting
from torchtitan.models.dit import DiT, dit_configs
from torchtitan.parallelisms.utils import apply_ac, checkpointed_blocks

pytestmark = pytest.mark.usefixtures("interpreter_launch")
ALL = ["fused_norm", "fused_mlp", "fused_qkv"]
# The autograd node each converter's kernel leaves in the graph where it runs.
KERNEL_NODES = {"fused_norm": "modulated_norm_fwd", "fused_mlp": "bias_act_fwd", "fused_qkv": "_QKVLinear"}


def converted(names: list[str], ac_mode: str = "none", ac_option: str = "op", compiled: bool = False):
    """A `prepare` for debug_dit_outputs_and_grads: the converters, then activation checkpointing, as parallelize_dit
    applies them (`compiled`: as it does for blocks it will compile; compiling is left to the caller)."""

    def prepare(model: DiT) -> Conversion:
        checkpointed = checkpointed_blocks(len(model.blocks), ac_mode, ac_option)
        conversion = apply_converters(model, names, checkpointed, Float8(emulate=True), fsdp_enabled=False,
                                      compiled=compiled)  # fmt: skip
        if ac_mode != "none":
            apply_ac(model.blocks, ac_mode, ac_option, save_ops=conversion.save_ops)
        return conversion

    return prepare


def _graph_nodes(out: torch.Tensor) -> set[str]:
    seen, stack = set(), [out.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        stack.extend(n for n, _ in node.next_functions)
    return {type(node).__name__ for node in seen}


def assert_matches_the_plain_model(names: list[str], ac: tuple[str, str] = ("none", "op"), **overrides) -> None:
    """Outputs and every parameter's gradient of the converted debug DiT (zero-inits broken) against the plain one's:
    equal on CPU (the same torch maths); with the kernels (4x4 images there, conftest.INTERPRETED_IMAGE_SIZE), fp32
    within rtol 1e-4 and atol 1e-5 (sums in another order; gradients here are about 1e-2), and each converter's
    kernel in the graph."""
    overrides = {"input_size": INTERPRETED_IMAGE_SIZE, **overrides}
    plain = debug_dit_outputs_and_grads(**overrides)
    got = debug_dit_outputs_and_grads(converted(names, *ac), **overrides)
    if not triton_interpreting():
        assert_close_by_name(got, plain, rtol=0, atol=0)
        return
    nodes = " ".join(_graph_nodes(got["output"]))
    for name in names:
        assert KERNEL_NODES[name] in nodes, f"{name}: no {KERNEL_NODES[name]} in the graph"
    assert_close_by_name(got, plain, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("names", [["fused_norm"], ["fused_mlp"], ["fused_qkv"], ALL], ids="+".join)
@pytest.mark.parametrize("ac", [("none", "op"), ("selective", "2")], ids=["no_ac", "every_2nd_block"])
def test_each_converter_and_all_match_the_plain_model(names, ac):
    # Every 2nd block checkpointed: under fused_norm blocks 0, 1, 2 finish their residual and block 3 hands it on
    # in parts, so both hand-overs and the final layer's stream are exercised.
    assert_matches_the_plain_model(names, ac)


@pytest.mark.parametrize("ac", [("full", "op"), ("selective", "op")])
def test_all_converters_under_full_and_per_op_checkpointing(ac):
    # Checkpointed blocks rerun the kernels in backward (full) or replay their saved GEMMs (per-op policy).
    assert_matches_the_plain_model(ALL, ac)


@pytest.mark.parametrize("ac", [("none", "op"), ("selective", "3")])
def test_llama_style_blocks(ac):
    # RMSNorm, SwiGLU and QK-norm: the other norm kind, the other activation, and the attention's norms kept.
    assert_matches_the_plain_model(ALL, ac, norm="rmsnorm", mlp="swiglu", qk_norm=True, pos_embed="learned")


def test_finish_residual_rule():
    # A checkpointed block keeps its input: it gets the stream whole (the block before it finishes it) and finishes
    # its own. With every 3rd of 7 blocks checkpointed: 0, 3, 6 are, so 0, 2, 3, 5, 6 finish.
    checkpointed = checkpointed_blocks(7, "selective", "3")
    assert checkpointed == [True, False, False, True, False, False, True]
    assert residual_finished(checkpointed) == [True, False, True, True, False, True, True]
    assert residual_finished(checkpointed_blocks(3, "none", "op")) == [False] * 3
    model = DiT(dataclasses.replace(dit_configs["debug"], depth=7))
    converted(["fused_norm"], "selective", "3")(model)
    blocks = [b._checkpoint_wrapped_module if hasattr(b, "_checkpoint_wrapped_module") else b
              for b in model.blocks.values()]  # fmt: skip
    assert [b.finish_residual for b in blocks] == residual_finished(checkpointed)


def test_fused_qkv_leaves_compiled_checkpointed_blocks_plain():
    # torch.compile saves what an autograd function's forward makes inside a checkpointed block instead of
    # recomputing it (pytorch/pytorch#177396; on an H100 with torch 2.11 a compiled, fully checkpointed DiT block
    # kept 4 more (B, T, D) tensors with the fused qkv than without), so those blocks keep the plain attention.
    def attentions(ac_mode, compiled):
        model = DiT(dataclasses.replace(dit_configs["debug"], depth=4))
        converted(["fused_qkv"], ac_mode, "2", compiled)(model)
        blocks = [getattr(b, "_checkpoint_wrapped_module", b) for b in model.blocks.values()]
        return ["fused" if isinstance(b.attn, FusedQKVAttention) else "plain" for b in blocks]

    assert attentions("selective", compiled=True) == ["plain", "fused", "plain", "fused"]
    assert attentions("full", compiled=True) == ["plain"] * 4
    assert attentions("full", compiled=False) == ["fused"] * 4  # eager checkpointing recomputes them
    assert attentions("none", compiled=True) == ["fused"] * 4
    with pytest.raises(ValueError, match="fused_qkv: keep_plain names 3 blocks, the model has 4"):
        apply_fused_qkv(DiT(dataclasses.replace(dit_configs["debug"], depth=4)), [False] * 3)


def test_a_handing_block_returns_the_stream_in_parts():
    # x + gate * branch; the block's own x and gate are tensors of their own, not views (FSDP hooks a block's outputs
    # for backward; a hook on a view is lost if the view is changed in place). The branch is the MLP's output.
    torch.manual_seed(0)
    model = DiT(dit_configs["debug"])
    model.init_weights()
    converted(["fused_norm"])(model)
    h = torch.randn(2, model.args.num_tokens, model.args.dim)
    c = torch.randn(2, model.args.dim)
    out = model.blocks["0"](h, c, model.rope)
    assert isinstance(out, ResidualStream) and out.x._base is None and out.gate._base is None
    # adaLN-Zero at init: every gate 0, the block is the identity.
    torch.testing.assert_close(out.x + out.gate.unsqueeze(1) * out.branch, h, rtol=0, atol=0)


def test_state_dicts_are_the_plain_models_and_load_both_ways():
    torch.manual_seed(0)
    plain = DiT(dit_configs["debug"])
    plain.init_weights()
    with torch.no_grad():
        for p in plain.parameters():
            p.add_(0.05 * torch.randn_like(p))
    model = DiT(dit_configs["debug"])
    converted([*ALL, "float8"] if _torchao() else ALL)(model)
    shapes = [(name, value.shape) for name, value in plain.state_dict().items()]
    assert [(name, value.shape) for name, value in model.state_dict().items()] == shapes
    model.load_state_dict(plain.state_dict())  # strict: a plain checkpoint loads into the converted model ...
    model.init_buffers()
    again = DiT(dit_configs["debug"])
    again.load_state_dict(model.state_dict())  # ... and the converted model's into a plain one
    for (name, a), b in zip(plain.state_dict().items(), again.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


def _torchao() -> bool:
    try:
        import torchao.float8  # noqa: F401
    except ImportError:
        return False
    return True


def test_meta_build_then_init_weights_as_the_trainer_does():
    # Converters run on the meta device before the model is materialized; init_weights() then reaches every
    # parameter through the converted modules: the same weights as a plain model's init.
    with torch.device("meta"):
        model = DiT(dit_configs["debug"])
    converted(ALL, "selective", "2")(model)
    model.to_empty(device="cpu")
    torch.manual_seed(3)
    model.init_weights()
    plain = DiT(dit_configs["debug"])
    torch.manual_seed(3)
    plain.init_weights()
    for (name, a), b in zip(model.state_dict().items(), plain.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


def test_converters_apply_to_plain_blocks_only():
    model = DiT(dit_configs["debug"])
    apply_ac(model.blocks, "full", "op")
    with pytest.raises(TypeError, match=r"before activation checkpointing and compile: blocks.0 is a Checkpoint"):
        converted(["fused_qkv"])(model)
    with pytest.raises(ValueError, match=r"model.converters: unknown converter 'fused_gelu'"):
        converted(["fused_gelu"])(DiT(dit_configs["debug"]))
    assert isinstance(converted(ALL)(m := DiT(dit_configs["debug"])), Conversion)
    assert all(isinstance(b, FusedNormDiTBlock) for b in m.blocks.values())


def test_the_gelu_mlp_op_is_declared_for_selective_checkpointing():
    # Per-op selective AC keeps matmul outputs; the cuBLASLt GELU MLP holds two GEMMs, so fused_mlp asks for it
    # to be kept, and parallelize_dit hands that to apply_ac.
    assert converted(["fused_norm", "fused_qkv"])(DiT(dit_configs["debug"])).save_ops == frozenset()
    assert converted(["fused_mlp"])(DiT(dit_configs["debug"])).save_ops == {torch.ops.torchditan.gelu_mlp.default}


def test_dp_refuses_the_float8_converter():
    # float8's Linears have no per-sample gradient; the fused converters keep DP-SGD's module path by themselves.
    import pytest

    from torchtitan.config_manager import ConfigError, parse_args

    parse_args(["--dp.enable", "true"])
    with pytest.raises(ConfigError, match="dp.enable with model.converters in the command line: torchao's float8 "
                                          "Linear computes its weight gradient"):  # fmt: skip
        parse_args(["--dp.enable", "true", "--model.converters", "fused_norm,float8"])


def test_the_fused_converters_stand_aside_below_the_token_threshold_on_cuda(monkeypatch, caplog):
    from torchtitan.config_manager import parse_args
    from torchtitan.models.dit.parallelize import converters_for_batch

    args = dit_configs["DiT-XL/2"]  # 32 x 32 latents, patch 2: 256 tokens an image
    cfg = parse_args(["--model.converters", "fused_norm,float8,fused_mlp,fused_qkv", "--training.local_batch_size",
                      "32"])  # fmt: skip
    assert converters_for_batch(cfg, args) == cfg.model.converters  # no CUDA: the kernels' torch paths, kept
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with caplog.at_level("INFO"):
        assert converters_for_batch(cfg, args) == ["float8"]  # 8,192 tokens < 16,384
    assert "stand aside: 8,192 tokens a micro-batch, below model.converters_min_tokens = 16,384" in caplog.text
    cfg.training.local_batch_size = 64  # 16,384 tokens: the threshold applies them
    assert converters_for_batch(cfg, args) == cfg.model.converters
    cfg.training.local_batch_size, cfg.model.converters_min_tokens = 1, 0  # 0: always
    assert converters_for_batch(cfg, args) == cfg.model.converters
