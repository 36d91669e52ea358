"""scripts/benchmarks/benchmark_reference_repa.py on stand-ins of REPA's models/sit.py and loss.py and of its encoder,
CPU.

The stand-ins have REPA's interfaces in plain torch, no timm: `SiT_models[name](input_size, num_classes, use_cfg,
z_dims, encoder_depth, projector_dim, fused_attn, qk_norm)` whose forward returns (the velocity, [the projected
tokens of block `encoder_depth`, one per z_dim]), with torch's default initialization instead of REPA's zeros so that
no gradient hides behind a zero; `SILoss(...)(model, images, model_kwargs, zs)` with REPA's maths (linear path,
v-prediction, uniform t drawn on the CPU, then the noise, negative cosine similarity per token) returning the
per-sample denoising and projection losses; an encoder answering `forward_features` as torch.hub's DINOv2. The step
is checked against REPA's step redone by hand from its definition, with the random draws replayed.
"""

import contextlib
import copy
import json
import math
import os
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import scripts.benchmarks.benchmark_reference_repa as bench
from scripts.benchmarks.benchmark_reference import distributed
from torchtitan.models.dit.model import DiTArgs, flops_per_image
from torchtitan.tools.runs import RESULT_PREFIX

pytestmark = pytest.mark.usefixtures("keep_tf32_flags")  # main() sets TF32, as the reference runs

SIT_STAND_IN = """
import math

import torch
from torch import nn
from torch.nn import functional as F


def projector(width, projector_dim, z_dim):
    return nn.Sequential(nn.Linear(width, projector_dim), nn.SiLU(), nn.Linear(projector_dim, projector_dim), nn.SiLU(),
                         nn.Linear(projector_dim, z_dim))


class Patches(nn.Module):
    def __init__(self, input_size, patch_size, in_channels, width):
        super().__init__()
        self.num_patches = (input_size // patch_size) ** 2
        self.proj = nn.Conv2d(in_channels, width, patch_size, stride=patch_size)

    def forward(self, x):
        return self.proj(x).flatten(2).transpose(1, 2)


class Block(nn.Module):
    def __init__(self, width, num_heads, mlp_ratio):
        super().__init__()
        self.num_heads = num_heads
        self.qkv, self.out = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.mlp = nn.Sequential()
        self.mlp.fc1 = nn.Linear(width, int(width * mlp_ratio))
        self.mlp.act = nn.GELU(approximate="tanh")
        self.mlp.fc2 = nn.Linear(int(width * mlp_ratio), width)
        self.modulation = nn.Linear(width, 6 * width)

    def forward(self, x, c):
        B, T, D = x.shape
        shift1, scale1, gate1, shift2, scale2, gate2 = self.modulation(F.silu(c))[:, None].chunk(6, dim=-1)
        h = F.layer_norm(x, (D,), eps=1e-6) * (1 + scale1) + shift1
        q, k, v = self.qkv(h).view(B, T, 3, self.num_heads, D // self.num_heads).permute(2, 0, 3, 1, 4)
        x = x + gate1 * self.out(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(B, T, D))
        return x + gate2 * self.mlp(F.layer_norm(x, (D,), eps=1e-6) * (1 + scale2) + shift2)


class SiT(nn.Module):
    def __init__(self, input_size=32, patch_size=2, in_channels=4, hidden_size=1152, depth=28, num_heads=16,
                 mlp_ratio=4.0, class_dropout_prob=0.1, num_classes=1000, use_cfg=False, z_dims=[768],
                 projector_dim=2048, encoder_depth=8, **block_kwargs):
        super().__init__()
        self.in_channels = self.out_channels = in_channels
        self.patch_size, self.num_heads, self.encoder_depth = patch_size, num_heads, encoder_depth
        self.num_classes, self.class_dropout_prob, self.use_cfg = num_classes, class_dropout_prob, use_cfg
        self.z_dims, self.projector_dim, self.block_kwargs = z_dims, projector_dim, block_kwargs
        self.x_embedder = Patches(input_size, patch_size, in_channels, hidden_size)
        self.t_embedder = nn.Sequential(nn.Linear(256, hidden_size), nn.SiLU(), nn.Linear(hidden_size, hidden_size))
        self.y_embedder = nn.Embedding(num_classes + (class_dropout_prob > 0), hidden_size)
        self.pos_embed = nn.Parameter(torch.randn(1, self.x_embedder.num_patches, hidden_size), requires_grad=False)
        self.blocks = nn.ModuleList([Block(hidden_size, num_heads, mlp_ratio) for _ in range(depth)])
        self.projectors = nn.ModuleList([projector(hidden_size, projector_dim, z_dim) for z_dim in z_dims])
        self.final_modulation = nn.Linear(hidden_size, 2 * hidden_size)
        self.final_linear = nn.Linear(hidden_size, patch_size * patch_size * in_channels)

    def forward(self, x, t, y):
        N, C, H, W = x.shape
        p = self.patch_size
        freqs = torch.exp(-math.log(10000) * torch.arange(128, dtype=torch.float32, device=x.device) / 128)
        angles = t[:, None].float() * freqs[None]  # (N, 128)
        c = self.t_embedder(torch.cat([angles.cos(), angles.sin()], dim=-1))  # (N, D)
        if self.training and self.class_dropout_prob > 0:
            y = torch.where(torch.rand(N, device=x.device) < self.class_dropout_prob, self.num_classes, y)
        c = c + self.y_embedder(y)
        x = self.x_embedder(x) + self.pos_embed  # (N, T, D)
        for i, block in enumerate(self.blocks):
            x = block(x, c)
            if i + 1 == self.encoder_depth:
                zs = [projector(x) for projector in self.projectors]  # each (N, T, z_dim)
        shift, scale = self.final_modulation(F.silu(c))[:, None].chunk(2, dim=-1)
        x = self.final_linear(F.layer_norm(x, (x.shape[-1],), eps=1e-6) * (1 + scale) + shift)
        x = x.view(N, H // p, W // p, p, p, C).permute(0, 5, 1, 3, 2, 4)
        return x.reshape(N, C, H, W), zs


def SiT_T_8(**kwargs):
    return SiT(depth=2, hidden_size=32, patch_size=8, num_heads=2, **kwargs)


SiT_models = {"SiT-T/8": SiT_T_8}
"""

LOSS_STAND_IN = """
import torch
from torch.nn import functional as F


class SILoss:
    def __init__(self, prediction="v", path_type="linear", weighting="uniform", encoders=[], accelerator=None,
                 latents_scale=None, latents_bias=None):
        self.prediction, self.path_type, self.weighting = prediction, path_type, weighting
        self.encoders, self.accelerator = encoders, accelerator
        self.latents_scale, self.latents_bias = latents_scale, latents_bias

    def __call__(self, model, images, model_kwargs=None, zs=None):
        # t drawn on the CPU and moved, then the noise: REPA's order of draws.
        t = torch.rand((images.shape[0], 1, 1, 1)).to(device=images.device, dtype=images.dtype)
        noise = torch.randn_like(images)
        output, zs_tilde = model((1 - t) * images + t * noise, t.flatten(), **(model_kwargs or {}))
        denoising = (output - (noise - images)).square().mean(dim=(1, 2, 3))
        cosines = [(F.normalize(z, dim=-1) * F.normalize(z_tilde, dim=-1)).sum(-1).mean(-1)
                   for z, z_tilde in zip(zs, zs_tilde)]
        return denoising, -torch.stack(cosines).mean(0)
"""


class StandInEncoder(nn.Module):
    """torch.hub DINOv2's interface at 224 pixels: 16 patch tokens (56-pixel patches) of width 16, final-normed."""

    embed_dim = 16

    def __init__(self):
        super().__init__()
        self.patch = nn.Conv2d(3, self.embed_dim, 56, stride=56)
        self.norm = nn.LayerNorm(self.embed_dim)
        self.inputs = []

    def forward_features(self, x):
        self.inputs.append(x)
        return {"x_norm_patchtokens": self.norm(self.patch(x).flatten(2).transpose(1, 2))}  # (B, 16, 16)


# 256px images: 32x32 latents, 4x4 tokens of patch 8, as the stand-in encoder's 4x4 patches of 224px.
TINY = ["--model", "SiT-T/8", "--image-size", "256", "--batch", "3", "--encoder-depth", "1", "--warmup", "1",
        "--steps", "2", "--mixed-precision", "no"]  # fmt: skip
TINY_SHAPE = DiTArgs(input_size=32, in_channels=4, patch_size=8, dim=32, depth=2, num_heads=2, learn_sigma=False)
CPU = torch.device("cpu")
IMAGENET_MEAN = torch.tensor([0.485, 0.456, 0.406]).view(3, 1, 1)
IMAGENET_STD = torch.tensor([0.229, 0.224, 0.225]).view(3, 1, 1)


def write_checkout(folder: Path, sit: bool = True, loss: bool = True) -> Path:
    (folder / "models").mkdir(parents=True)
    if sit:
        (folder / "models" / "sit.py").write_text(SIT_STAND_IN)
    if loss:
        (folder / "loss.py").write_text(LOSS_STAND_IN)
    return folder


@pytest.fixture
def checkout(tmp_path) -> Path:
    return write_checkout(tmp_path / "ref_repa")


def redo_by_hand(model: nn.Module, encoder: nn.Module, raw: torch.Tensor, moments: torch.Tensor, y: torch.Tensor,
                 rng: torch.Tensor, dtype: torch.dtype | None, loss_scale: float = 1.0,
                 proj_coeff: float = 0.5) -> tuple:  # fmt: skip
    """REPA's step from its definition, the random draws replayed from `rng` in its order (the latents' noise, t,
    the diffusion noise, the class dropout inside the model), the backward of the loss times `loss_scale` (fp16's
    GradScaler) unscaled. Returns the mean denoising and projection losses, the gradient norm and the clipped
    gradients of `model`'s trainable parameters, by name."""
    torch.set_rng_state(rng)
    cast = torch.autocast("cpu", dtype) if dtype else contextlib.nullcontext()
    mean, std = moments.chunk(2, dim=1)
    x = (mean + std * torch.randn_like(mean)) * 0.18215
    with torch.no_grad(), cast:
        pixels = F.interpolate((raw.float() / 255 - IMAGENET_MEAN) / IMAGENET_STD, 224, mode="bicubic")
        (z,) = [encoder.forward_features(pixels)["x_norm_patchtokens"]]  # (B, T, z_dim)
    t = torch.rand(raw.shape[0], 1, 1, 1)
    noise = torch.randn_like(x)
    with cast:  # accelerate's forward: under autocast, the outputs back in float32
        output, (z_tilde,) = model((1 - t) * x + t * noise, t.flatten(), y=y)
    output, z_tilde = output.float(), z_tilde.float()
    denoising = (output - (noise - x)).square().mean(dim=(1, 2, 3)).mean()
    projection = -(F.normalize(z, dim=-1) * F.normalize(z_tilde, dim=-1)).sum(-1).mean()
    trained = {name: p for name, p in model.named_parameters() if p.requires_grad}
    grads = torch.autograd.grad((denoising + proj_coeff * projection) * loss_scale, list(trained.values()))
    grads = [g / loss_scale for g in grads]
    norm = torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))
    clip = torch.clamp(1.0 / (norm + 1e-6), max=1.0)  # clip_grad_norm_(max_norm=1)
    return denoising.detach(), projection.detach(), norm, {name: g * clip for name, g in zip(trained, grads)}


def check_step(run: bench.RepaRun, encoder: nn.Module, inputs: tuple, dtype: torch.dtype | None, rtol: float,
               atol: float) -> dict:  # fmt: skip
    """One step of the script against `redo_by_hand`: the losses, the gradient norm, the clipped gradients AdamW
    sees, its first update (-lr * g / (|g| + eps)) and the EMA update (decay 0.9999). The EMA is moved off the
    weights first: one step moves the EMA by 1e-8, below float32's resolution of weights near 1."""
    start = copy.deepcopy(run.plain)
    with torch.no_grad():
        ema_start = {name: e.add_(torch.randn_like(e)).clone() for name, e in run.ema.named_parameters()}
    names = {p: name for name, p in run.plain.named_parameters()}
    seen = {}  # the gradients AdamW steps with

    def record(*_):
        seen.update({names[p]: p.grad.clone() for p in names if p.grad is not None})

    run.optimizer.register_step_pre_hook(record)
    rng, scale = torch.get_rng_state(), run.scaler.get_scale() if run.scaler else 1.0
    losses = bench.train_step(run, *inputs)
    loss, projection, norm, grads = redo_by_hand(start, encoder, *inputs, rng, dtype, scale)
    torch.testing.assert_close(losses["loss"], loss, rtol=rtol, atol=atol)
    torch.testing.assert_close(losses["proj_loss"], projection, rtol=rtol, atol=atol)
    torch.testing.assert_close(losses["grad_norm"], norm, rtol=rtol, atol=atol)
    assert seen.keys() == grads.keys()
    params, ema = dict(run.plain.named_parameters()), dict(run.ema.named_parameters())
    assert all(params[name].grad is None for name in params)  # zero_grad(set_to_none=True)
    for name, before in start.named_parameters():
        after = params[name].detach()
        if name in grads:
            assert grads[name].abs().sum() > 0, name
            torch.testing.assert_close(seen[name], grads[name], rtol=rtol, atol=atol * 1e-3,
                                       msg=lambda text, name=name: f"{name}: {text}")  # fmt: skip
            g = seen[name]
            torch.testing.assert_close(after, before - 1e-4 * g / (g.abs() + 1e-8), rtol=1e-6, atol=1e-7, msg=name)
        else:  # the frozen position embedding
            assert torch.equal(after, before), name
        torch.testing.assert_close(ema[name], 0.9999 * ema_start[name] + 1e-4 * after, rtol=1e-6, atol=1e-7,
                                   msg=name)  # fmt: skip
    return losses


@pytest.mark.parametrize("precision", ["no", "bf16", "fp16"])
def test_step_is_repas_step_redone_by_hand(checkout, precision):
    """1e-5 in all three precisions: the script and the hand run the same ops at the same precision (the hand's fp16
    backward scales the loss by the GradScaler's 2**16 and unscales, as the script's does)."""
    torch.manual_seed(0)
    sit, loss = bench.load_repa(checkout)
    encoder = StandInEncoder()
    with distributed(CPU):
        run = bench.build_repa_run(sit, loss, encoder, "SiT-T/8", 32, CPU, encoder_depth=1, precision=precision)
        inputs = bench.random_inputs(3, 256, CPU)
        losses = check_step(run, encoder, inputs, bench.PRECISIONS[precision], rtol=1e-5, atol=1e-6)
    assert losses["grad_norm"] > 1  # the clipping acted
    pixels, by_hand = encoder.inputs  # REPA's preprocessing: the script's, then the hand's
    assert pixels.shape == (3, 3, 224, 224) and pixels.dtype == torch.float32
    torch.testing.assert_close(pixels, by_hand, rtol=1e-6, atol=1e-6)
    assert run.plain.training and not run.ema.training and not encoder.training
    assert run.plain.use_cfg and run.plain.z_dims == [16] and run.plain.projector_dim == 2048
    assert run.plain.block_kwargs == {"fused_attn": True, "qk_norm": False}
    assert run.loss_fn.prediction == "v" and run.loss_fn.path_type == "linear" and run.loss_fn.weighting == "uniform"
    assert run.loss_fn.latents_scale.flatten().tolist() == [pytest.approx(0.18215)] * 4
    assert not run.loss_fn.latents_bias.any()
    group = run.optimizer.param_groups[0]
    assert (group["lr"], group["betas"], group["weight_decay"], group["eps"]) == (1e-4, (0.9, 0.999), 0.0, 1e-8)
    assert (run.scaler is not None) == (precision == "fp16")


def test_model_wrapping_follows_accelerate(checkout):
    """Mixed precision: the forward under autocast with float32 outputs; DDP only with more than one rank unless
    forced; compile before DDP."""
    sit, loss = bench.load_repa(checkout)
    with distributed(CPU):
        plain = bench.build_repa_run(sit, loss, StandInEncoder(), "SiT-T/8", 32, CPU, 1, precision="no")
        wrapped = bench.build_repa_run(sit, loss, StandInEncoder(), "SiT-T/8", 32, CPU, 1, "bf16", True, ddp=True)
    assert plain.model is plain.plain and plain.autocast_dtype is None
    assert isinstance(wrapped.model, DDP) and isinstance(wrapped.model.module, torch._dynamo.eval_frame.OptimizedModule)
    forward = wrapped.model.module._orig_mod
    assert isinstance(forward, bench.MixedPrecisionForward) and forward.module is wrapped.plain
    out, (z_tilde,) = forward(torch.randn(2, 4, 32, 32), torch.rand(2), y=torch.tensor([1, 2]))
    assert out.dtype == z_tilde.dtype == torch.float32 and z_tilde.shape == (2, 16, 16)


def test_result_line_json_out_and_table(checkout, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(bench, "build_encoder", lambda image_size: StandInEncoder())
    out = tmp_path / "result.json"
    assert bench.main(["--reference-repa", str(checkout), *TINY, "--ddp", "--json-out", str(out)]) == 0
    stdout = capsys.readouterr().out
    lines = [line for line in stdout.splitlines() if line.startswith(RESULT_PREFIX)]
    assert len(lines) == 1, stdout
    result = json.loads(lines[0][len(RESULT_PREFIX) :])
    assert json.loads(out.read_text()) == result
    assert result["status"] == "ok" and result["name"] == "reference_repa" and result["model"] == "SiT-T/8"
    assert result["latent_size"] == 32 and result["encoder_image_size"] == 224 and result["encoder_depth"] == 1
    assert result["world_size"] == 1 and result["batch"] == result["global_batch"] == 3 and result["timed_steps"] == 2
    assert result["ddp"] and not result["compile"] and result["mixed_precision"] == "no" and result["allow_tf32"]
    assert result["step_logs"] and result["proj_coeff"] == 0.5
    assert result["step_time_min_s"] <= result["step_time_s"] <= result["step_time_max_s"]
    assert result["images_per_second"] == pytest.approx(3 / result["step_time_s"])
    assert result["streamed_step_time_s"] > 0 and result["loss"] > 0 and result["grad_norm"] > 0
    assert -1 <= result["proj_loss"] <= 1
    assert result["gflop_per_image"] == pytest.approx(flops_per_image(TINY_SHAPE) / 1e9)
    assert f"| reference_repa | 3 | {result['images_per_second']:.1f} | n/a | n/a | n/a |" in stdout


def error_line(capsys) -> str:
    captured = capsys.readouterr()
    assert captured.out == ""
    (line,) = captured.err.splitlines()
    assert line.startswith("error: ")
    return line


def test_missing_checkout_file_or_timm_is_one_error_line(tmp_path, capsys, monkeypatch):
    missing = tmp_path / "no_repa_here"
    assert bench.main(["--reference-repa", str(missing)]) == 2
    assert str(missing / "models" / "sit.py") in error_line(capsys)
    no_loss = write_checkout(tmp_path / "sit_only", loss=False)
    assert bench.main(["--reference-repa", str(no_loss)]) == 2
    assert str(no_loss / "loss.py") in error_line(capsys)
    monkeypatch.setitem(sys.modules, "timm", None)  # as if not installed: the real encoder's import fails
    assert bench.main(["--reference-repa", str(write_checkout(tmp_path / "ref"))]) == 2
    line = error_line(capsys)
    assert "package timm" in line and "pip install timm" in line


def test_unknown_model_or_image_size_is_one_error_line(checkout, capsys, monkeypatch):
    monkeypatch.setattr(bench, "build_encoder", lambda image_size: StandInEncoder())
    assert bench.main(["--reference-repa", str(checkout)]) == 2  # SiT-XL/2: not in the stand-in
    assert "SiT-T/8" in error_line(capsys)
    assert bench.main(["--reference-repa", str(checkout), "--image-size", "224"]) == 2
    assert "--image-size 224" in error_line(capsys)


@pytest.mark.skipif(not os.environ.get("REPA_CHECKOUT"), reason="set REPA_CHECKOUT to a sihyun-yu/REPA checkout")
def test_repa_checkout_step_is_redone_by_hand():
    """REPA's own models/sit.py and loss.py and timm's DINOv2-B (random weights): one step at 256px, batch 2, CPU,
    fp32, against the hand. SiT-B/2, as REPA's SiT-S/2 cannot run: its final layer is built 768 wide (the default
    decoder_hidden_size) on 384-wide tokens. REPA's zero initializations (adaLN, final layer) are broken first."""
    pytest.importorskip("timm")
    sit, loss = bench.load_repa(Path(os.environ["REPA_CHECKOUT"]))
    torch.manual_seed(0)
    encoder = bench.build_encoder(256)
    with distributed(CPU):
        run = bench.build_repa_run(sit, loss, encoder, "SiT-B/2", 32, CPU, precision="no")
        with torch.no_grad():
            for p in run.plain.parameters():
                if not p.any():
                    p.normal_(std=0.02)
        check_step(run, encoder, bench.random_inputs(2, 256, CPU), None, rtol=1e-5, atol=1e-6)
    assert math.isfinite(run.plain.blocks[0].attn.qkv.weight.sum().item())
