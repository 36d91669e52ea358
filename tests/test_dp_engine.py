"""DPEngine in one process: every mode against torch.func per-sample gradients, clipped and averaged."""

import copy
import dataclasses

import pytest
import torch
from torch import nn
from torch._dynamo.utils import counters
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

from torchtitan.dp import DP_MODES, DPEngine
from torchtitan.dp.testing import clipped_mean, per_sample_grads
from torchtitan.models.dit import DiT, dit_configs
from torchtitan.models.dit.model import LearnedPosEmbed

PRIVATE_MODES = [m for m in DP_MODES if m != "vanilla"]


def _perturb(model: nn.Module, scale: float = 0.05) -> nn.Module:
    """Random offsets on every parameter: zero-initialized layers would make many gradients exactly zero."""
    torch.manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn_like(p))
    return model


def _mse(out, *batch):
    return out.square().mean(tuple(range(1, out.dim())))


class Dense2d(nn.Module):
    """Linear layers on (B, d) inputs."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3, bias=False))

    def forward(self, x):
        return self.net(x)


class Tokens(nn.Module):
    """Linear layers on (B, T, d): one Gram-form layer (2 T^2 < d p), one explicit; norms with affine."""

    def __init__(self):
        super().__init__()
        self.gram = nn.Linear(16, 16)  # T = 3: 2 T^2 = 18 < d p = 256, Gram form
        self.explicit = nn.Linear(16, 1)  # 18 > 16: explicit A^T G
        self.ln = nn.LayerNorm(16)
        self.ln_nobias = nn.LayerNorm(16, bias=False)
        self.rms = nn.RMSNorm(16)
        self.head = nn.Linear(16, 3)

    def forward(self, x):
        h = self.ln(torch.tanh(self.gram(x)))
        h = self.rms(self.ln_nobias(h))
        return self.head(h) + self.explicit(h).sum(-1, keepdim=True)


class PatchesAndLabels(nn.Module):
    """Conv2d patch embedding, an overlapping padded Conv2d, learned positions, embeddings."""

    def __init__(self):
        super().__init__()
        self.patch = nn.Conv2d(2, 8, kernel_size=2, stride=2)
        self.conv = nn.Conv2d(2, 8, kernel_size=3, padding=1, stride=2)
        self.pos = LearnedPosEmbed(4, 8)
        nn.init.normal_(self.pos.weight)
        self.label = nn.Embedding(5, 8)
        self.token = nn.Embedding(7, 8, padding_idx=0)
        self.head = nn.Linear(8, 2)

    def forward(self, x, y, tokens):
        h = self.pos(self.patch(x).flatten(2).transpose(1, 2)) + self.conv(x).flatten(2).transpose(1, 2)
        h = h + self.label(y)[:, None] + self.token(tokens)  # tokens (B, 4) with repeats
        return self.head(torch.tanh(h))


def _toy_batches(b=5):
    g = torch.Generator().manual_seed(0)
    return {
        Dense2d: (torch.randn(b, 6, generator=g),),
        Tokens: (torch.randn(b, 3, 16, generator=g),),
        PatchesAndLabels: (
            torch.randn(b, 2, 4, 4, generator=g),
            torch.randint(0, 5, (b,), generator=g),
            torch.randint(0, 3, (b, 4), generator=g),  # few values: repeats and padding tokens
        ),
    }


def _run(model, mode, batch, loss_fn, max_norm, **kwargs):
    model = copy.deepcopy(model)
    engine = DPEngine(model, mode, max_norm, 0.0, **kwargs)
    norms = engine.backward(loss_fn(model(*batch), *batch))
    return model, norms


def _reference(model, loss_fn, batch) -> dict:
    grads = per_sample_grads(model, loss_fn, *batch)
    all_norms = torch.cat([g.flatten(1) for g in grads.values()], 1).norm(dim=1)
    max_norm = all_norms.median().item()  # about half the samples get clipped
    clipped, norms = clipped_mean(grads, max_norm)
    return {
        "max_norm": max_norm,
        "clipped": clipped,
        "norms": norms,
        "vanilla": {n: g.mean(0) for n, g in grads.items()},
    }


def _assert_matches(model, mode, batch, loss_fn, ref, rtol=1e-4):
    dp_model, norms = _run(model, mode, batch, loss_fn, ref["max_norm"])
    if norms is not None:
        torch.testing.assert_close(norms, ref["norms"], rtol=rtol, atol=0)
    expected = ref["vanilla" if mode == "vanilla" else "clipped"]
    for name, p in dp_model.named_parameters():
        name = name.replace("_checkpoint_wrapped_module.", "")
        err = ((p.grad - expected[name]).norm() / expected[name].norm()).item()
        assert err < rtol, f"{mode} {name}: relative error {err:.2e}"


@pytest.mark.parametrize("mode", DP_MODES)
@pytest.mark.parametrize("model_cls", [Dense2d, Tokens, PatchesAndLabels])
def test_layers_match_torch_func(model_cls, mode):
    torch.manual_seed(0)
    model, batch = _perturb(model_cls()), _toy_batches()[model_cls]
    _assert_matches(model, mode, batch, _mse, _reference(model, _mse, batch))


def _dit(**overrides) -> DiT:
    torch.manual_seed(0)
    model = DiT(dataclasses.replace(dit_configs["debug"], **overrides))
    model.init_weights()
    return _perturb(model, 0.02)


def _dit_batch(b=4):
    g = torch.Generator().manual_seed(0)
    return torch.randn(b, 1, 16, 16, generator=g), torch.randint(0, 1000, (b,), generator=g), torch.arange(b) % 11


def _dit_loss(out, x, t, y):
    return (out - x).square().mean((1, 2, 3))


@pytest.mark.parametrize("pos_embed", ["rope2d", "sincos", "learned"])
@pytest.mark.parametrize("qk_norm", [False, True])
def test_dit_matches_torch_func(pos_embed, qk_norm):
    model, batch = _dit(pos_embed=pos_embed, qk_norm=qk_norm), _dit_batch()
    ref = _reference(model, _dit_loss, batch)
    for mode in PRIVATE_MODES:
        _assert_matches(model, mode, batch, _dit_loss, ref)


def test_llama_style_dit_with_activation_checkpointing():
    model, batch = _dit(norm="rmsnorm", mlp="swiglu", qk_norm=True, pos_embed="learned"), _dit_batch()
    ref = _reference(model, _dit_loss, batch)  # torch.func cannot run through checkpointing
    for key, block in list(model.blocks.items()):
        model.blocks[key] = checkpoint_wrapper(block)  # non-reentrant: the hooks skip the recompute
    for mode in ("ghost", "bookkeeping"):
        _assert_matches(model, mode, batch, _dit_loss, ref)


def _augmult_rows(batch: tuple, k: int) -> tuple:
    """K rows per sample, consecutive: floating inputs get fresh noise per draw (as a diffusion step
    draws noise and timestep), integer inputs (labels, tokens) repeat."""
    g = torch.Generator().manual_seed(5)
    rows = []
    for b in batch:
        b = b.repeat_interleave(k, 0)
        rows.append(b + 0.3 * torch.randn(b.shape, generator=g) if b.is_floating_point() else b)
    return tuple(rows)


@pytest.mark.parametrize("mode", PRIVATE_MODES)
@pytest.mark.parametrize("model_cls", [Dense2d, Tokens, PatchesAndLabels, "dit"])
def test_augmult_matches_torch_func(model_cls, mode):
    """(B, K) losses of a forward on B K rows: sample i's gradient is the mean of its K rows' gradients."""
    k = 3
    if model_cls == "dit":
        model, (x, t, y), loss_fn = _dit(pos_embed="learned"), _dit_batch(3), _dit_loss
        rows = (*_augmult_rows((x,), k), t.repeat_interleave(k) + torch.arange(3 * k), y.repeat_interleave(k))
    else:
        model, loss_fn = _perturb(model_cls()), _mse
        rows = _augmult_rows(_toy_batches(4)[model_cls], k)
    grads = per_sample_grads(model, loss_fn, *rows)  # one per row
    grads = {n: g.unflatten(0, (-1, k)).mean(1) for n, g in grads.items()}  # one per sample
    max_norm = torch.cat([g.flatten(1) for g in grads.values()], 1).norm(dim=1).median().item()
    ref, ref_norms = clipped_mean(grads, max_norm)
    m = copy.deepcopy(model)
    engine = DPEngine(m, mode, max_norm, 0.0)
    norms = engine.backward(loss_fn(m(*rows), *rows).unflatten(0, (-1, k)))
    torch.testing.assert_close(norms, ref_norms, rtol=1e-4, atol=0)
    for name, p in m.named_parameters():
        err = ((p.grad - ref[name]).norm() / ref[name].norm()).item()
        assert err < 1e-4, f"{mode} {name}: relative error {err:.2e}"


def test_augmult_needs_k_rows_per_sample():
    model, batch = _perturb(Tokens()), _toy_batches(6)[Tokens]
    engine = DPEngine(model, "ghost", 1.0, 0.0)
    losses = _mse(model(*batch))  # 6 rows, but (3, 2) losses would claim 3 samples x K = 2 ...
    engine.backward(losses.view(3, 2))  # ... which is consistent; (6, 2) is not:
    with pytest.raises(RuntimeError, match="rows"):
        engine.backward(torch.stack([_mse(model(*batch))] * 2, 1))


def test_mask_and_accumulation():
    model, batch = _perturb(Tokens()), _toy_batches(6)[Tokens]
    grads = per_sample_grads(model, _mse, *batch)
    keep = torch.tensor([True, True, False, True, False, True])
    ref, _ = clipped_mean({n: g * keep.view(-1, *[1] * (g.dim() - 1)) for n, g in grads.items()}, 0.5, batch_size=4)
    for mode in ("ghost", "bookkeeping"):
        # Masked rows count neither in the sum nor in B.
        m = copy.deepcopy(model)
        engine = DPEngine(m, mode, 0.5, 0.0)
        engine.backward(_mse(m(*batch)), mask=keep)
        for name, p in m.named_parameters():
            torch.testing.assert_close(p.grad, ref[name], rtol=1e-4, atol=1e-7)
        # Two micro-batches of 3, accumulated: B is the global batch of the step.
        m = copy.deepcopy(model)
        engine = DPEngine(m, mode, 0.5, 0.0, global_batch_size=4)
        for part in (slice(0, 3), slice(3, 6)):
            engine.backward(_mse(m(batch[0][part])), mask=keep[part], add_noise=part.start == 3)
        assert engine.step == 1
        for name, p in m.named_parameters():
            torch.testing.assert_close(p.grad, ref[name], rtol=1e-4, atol=1e-7)


def test_autocast_bf16_runs_close_to_fp32():
    model, batch = _dit(pos_embed="learned"), _dit_batch()
    ref, _ = clipped_mean(per_sample_grads(model, _dit_loss, *batch), 1.0)
    for mode in ("ghost", "bookkeeping"):
        m = copy.deepcopy(model)
        engine = DPEngine(m, mode, 1.0, 0.0)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            losses = _dit_loss(m(*batch).float(), *batch)
        engine.backward(losses)
        for name, p in m.named_parameters():
            assert p.grad.dtype == torch.float32
            assert ((p.grad - ref[name]).norm() / ref[name].norm()) < 0.1, name


def test_coefficients_are_prepared_once_per_dtype_and_rounded_down():
    # Every layer of a step scales by the same coefficients: one prepared tensor per operand dtype. In bf16 each is
    # shrunk by one rounding step, so a coefficient of 1 (an unclipped sample) never rounds above 1.
    from torchtitan.dp.layers import Coefficients, scale_per_sample, weighted_sum

    coef = Coefficients(torch.tensor([1.0, 0.5, 0.25]))
    bf16 = coef.for_operand(torch.bfloat16)
    assert coef.for_operand(torch.bfloat16) is bf16 and bf16.dtype == torch.float32
    assert bf16[0] < 1 and torch.equal(bf16, bf16.bfloat16().float())  # bf16 values, below the exact ones
    assert torch.equal(coef.for_operand(torch.float32), coef.values)
    t = torch.ones(3, 2, dtype=torch.bfloat16)
    assert torch.equal(scale_per_sample(t, coef), bf16.bfloat16().view(3, 1).expand(3, 2))
    assert scale_per_sample(t, None) is t
    assert torch.equal(weighted_sum(coef, torch.ones(3, 4)), torch.full((4,), 1.75))
    assert torch.equal(weighted_sum(None, torch.ones(3, 4)), torch.full((4,), 3.0))


def test_frozen_parameters_are_skipped():
    model = nn.Sequential(nn.Conv1d(2, 4, 1), nn.Flatten(), nn.Linear(4 * 3, 2))
    model[0].requires_grad_(False)  # a module with no rule is fine once frozen
    _perturb(model)
    m, _ = _run(model, "ghost", (torch.randn(3, 2, 3),), _mse, 1.0)
    assert m[0].weight.grad is None and m[2].weight.grad is not None


@pytest.mark.parametrize(
    "module, match",
    [
        (nn.Sequential(nn.Linear(3, 4), nn.Conv1d(4, 4, 1)), r"module 1 \(Conv1d\)"),
        (nn.GRU(3, 4), r"<root> \(GRU\)"),
        (nn.Sequential(nn.Conv2d(4, 4, 3, groups=2)), r"module 0 \(Conv2d\).*groups=1"),
        (nn.Embedding(4, 3, scale_grad_by_freq=True), "scale_grad_by_freq"),
    ],
)
def test_unsupported_modules_raise_at_construction(module, match):
    with pytest.raises(NotImplementedError, match=match):
        DPEngine(module, "ghost", 1.0, 0.0)


def test_tied_parameters_raise():
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3))
    model[1].weight = model[0].weight
    with pytest.raises(NotImplementedError, match="shared"):
        DPEngine(model, "ghost", 1.0, 0.0)


class UsesWeightOutside(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)

    def forward(self, x):
        return self.lin(x) + x @ self.lin.weight.T  # a second use the Linear's rule never sees


class CallsTwice(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)

    def forward(self, x):
        return self.lin(self.lin(x))


@pytest.mark.parametrize("mode", ["ghost", "bookkeeping"])
def test_parameter_used_outside_its_module_raises(mode):
    model = UsesWeightOutside()
    engine = DPEngine(model, mode, 1.0, 0.0)
    with pytest.raises(RuntimeError, match=r"'lin\.weight' is used outside its module"):
        engine.backward(_mse(model(torch.randn(2, 3))))
    engine = DPEngine(CallsTwice(), mode, 1.0, 0.0)
    with pytest.raises(RuntimeError, match=r"module lin ran twice"):
        engine.backward(_mse(engine.model(torch.randn(2, 3))))


def test_eval_forward_is_untouched_and_hooks_detach():
    model = _perturb(Dense2d())
    x = torch.randn(4, 6)
    expected = model(x)
    engine = DPEngine(model, "bookkeeping", 1.0, 0.0)
    with torch.no_grad():
        torch.testing.assert_close(model(x), expected)
    assert all(r.x is None for r in engine._capture.records) and engine._capture.token is None
    engine.remove_hooks()
    assert type(model.net[0]) is nn.Linear
    out = model(x)
    out.sum().backward()  # a plain backward again: the parameters get their gradients
    assert model.net[0].weight.grad is not None


def _count_python_norms(engine: DPEngine) -> list[str]:
    """The names of the layers whose norms the engine's Python computes from now on, one entry per call."""
    calls = []
    for record in engine._capture.records:

        def norm_sq(*args, name=record.name, rule_norm_sq=record.rule.norm_sq):
            calls.append(name)
            return rule_norm_sq(*args)

        record.rule = dataclasses.replace(record.rule, norm_sq=norm_sq)
    return calls


@pytest.mark.parametrize("model_type", [Tokens, PatchesAndLabels])
@pytest.mark.parametrize("mode", ["ghost", "bookkeeping"])
def test_compiled_model_stays_exact(mode, model_type):
    # The capture is traced code and custom ops: the only graph break is the root's pre-hook that makes the token.
    # Book-keeping's compiled backward computes every layer's norms in its graph, so the engine's Python computes
    # none. The "eager" backend checks the tracing quickly (tests/test_dp_composition.py runs inductor).
    model, batch = _perturb(model_type()), _toy_batches()[model_type]
    ref = _reference(model, _mse, batch)
    torch._dynamo.reset()
    counters.clear()
    model.compile(backend="eager", fullgraph=False)  # as the trainer does: compile, then build the engine
    engine = DPEngine(model, mode, ref["max_norm"], 0.0)
    python_norms = _count_python_norms(engine)
    for _ in range(2):
        for p in model.parameters():
            p.grad = None
        torch.testing.assert_close(engine.backward(_mse(model(*batch))), ref["norms"], rtol=1e-4, atol=0)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, ref["clipped"][name], rtol=1e-4, atol=1e-7)
    assert sum(counters["graph_break"].values()) <= 1, dict(counters["graph_break"])
    assert len(python_norms) == (0 if mode == "bookkeeping" else 2 * len(engine._capture.records)), python_norms


def test_hooks_seeing_other_modules_later_raises():
    model = _perturb(Dense2d())
    engine = DPEngine(model, "ghost", 1.0, 0.0)
    x = torch.randn(3, 6)
    engine.backward(_mse(model(x)))
    with pytest.raises(RuntimeError, match=r"missing \['net\.2'\]"):
        model.forward = lambda x: torch.tanh(model.net[0](x))  # a forward that skips the last layer
        engine.backward(_mse(model(x)))
