"""scripts/benchmarks/benchmark_opacus_reference.py on a stand-in of the reference's models.py (plain torch, no timm),
CPU.

The stand-in has the reference's interface (DiT_models of factories; DiT(input_size, patch_size, in_channels,
hidden_size, depth, num_heads, mlp_ratio, class_dropout_prob, num_classes, learn_sigma); forward(x, t, y)) and its
layer types (Conv2d patch embedding, Linear, LayerNorm without affine, Embedding, a frozen position embedding),
with torch's default initialization instead of the reference's zeros, so that no gradient hides behind a zero.
"""

import copy
import json
import math
from pathlib import Path

import pytest
import torch
from torch.func import functional_call, grad, vmap

pytest.importorskip("opacus")

import scripts.benchmarks.benchmark_opacus_reference as bench  # noqa: E402
from torchtitan.models.dit.model import DiTArgs, flops_per_image  # noqa: E402

STAND_IN = """
import math

import torch
from torch import nn
from torch.nn import functional as F


class PatchEmbed(nn.Module):
    def __init__(self, input_size, patch_size, in_channels, hidden_size):
        super().__init__()
        self.patch_size = (patch_size, patch_size)
        self.num_patches = (input_size // patch_size) ** 2
        self.proj = nn.Conv2d(in_channels, hidden_size, patch_size, stride=patch_size)

    def forward(self, x):
        return self.proj(x).flatten(2).transpose(1, 2)


class Attention(nn.Module):
    def __init__(self, dim, num_heads):
        super().__init__()
        self.num_heads = num_heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        B, T, D = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.num_heads, D // self.num_heads).permute(2, 0, 3, 1, 4)
        return self.proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(B, T, D))


class Block(nn.Module):
    def __init__(self, dim, num_heads, mlp_ratio):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.attn = Attention(dim, num_heads)
        self.norm2 = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.mlp = nn.Sequential()
        self.mlp.fc1 = nn.Linear(dim, int(dim * mlp_ratio))
        self.mlp.act = nn.GELU(approximate="tanh")
        self.mlp.fc2 = nn.Linear(int(dim * mlp_ratio), dim)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(dim, 6 * dim))

    def forward(self, x, c):
        shift1, scale1, gate1, shift2, scale2, gate2 = self.adaLN_modulation(c)[:, None].chunk(6, dim=2)
        x = x + gate1 * self.attn(self.norm1(x) * (1 + scale1) + shift1)
        return x + gate2 * self.mlp(self.norm2(x) * (1 + scale2) + shift2)


class DiT(nn.Module):
    def __init__(self, input_size=32, patch_size=2, in_channels=4, hidden_size=1152, depth=28, num_heads=16,
                 mlp_ratio=4.0, class_dropout_prob=0.1, num_classes=1000, learn_sigma=True):
        super().__init__()
        self.in_channels, self.patch_size, self.num_heads = in_channels, patch_size, num_heads
        self.learn_sigma = learn_sigma
        self.out_channels = 2 * in_channels if learn_sigma else in_channels
        self.num_classes, self.class_dropout_prob = num_classes, class_dropout_prob
        self.x_embedder = PatchEmbed(input_size, patch_size, in_channels, hidden_size)
        self.t_mlp = nn.Sequential(nn.Linear(256, hidden_size), nn.SiLU(), nn.Linear(hidden_size, hidden_size))
        self.y_table = nn.Embedding(num_classes + (class_dropout_prob > 0), hidden_size)
        self.pos_embed = nn.Parameter(torch.randn(1, self.x_embedder.num_patches, hidden_size), requires_grad=False)
        self.blocks = nn.ModuleList([Block(hidden_size, num_heads, mlp_ratio) for _ in range(depth)])
        self.norm_final = nn.LayerNorm(hidden_size, elementwise_affine=False, eps=1e-6)
        self.final_modulation = nn.Sequential(nn.SiLU(), nn.Linear(hidden_size, 2 * hidden_size))
        self.final_linear = nn.Linear(hidden_size, patch_size * patch_size * self.out_channels)

    def forward(self, x, t, y):
        N, _, H, W = x.shape
        p, h, w = self.patch_size, H // self.patch_size, W // self.patch_size
        freqs = torch.exp(-math.log(10000) * torch.arange(128, dtype=torch.float32, device=x.device) / 128)
        angles = t[:, None].float() * freqs[None]  # (N, 128)
        c = self.t_mlp(torch.cat([angles.cos(), angles.sin()], dim=-1))  # (N, D)
        if self.training and self.class_dropout_prob > 0:
            y = torch.where(torch.rand(N, device=x.device) < self.class_dropout_prob, self.num_classes, y)
        c = c + self.y_table(y)
        x = self.x_embedder(x) + self.pos_embed  # (N, T, D)
        for block in self.blocks:
            x = block(x, c)
        shift, scale = self.final_modulation(c)[:, None].chunk(2, dim=2)
        x = self.final_linear(self.norm_final(x) * (1 + scale) + shift)  # (N, T, p * p * C_out)
        x = x.view(N, h, w, p, p, self.out_channels).permute(0, 5, 1, 3, 2, 4)
        return x.reshape(N, self.out_channels, H, W)


def DiT_T_2(**kwargs):
    return DiT(depth=2, hidden_size=32, patch_size=2, num_heads=2, **kwargs)


DiT_models = {"DiT-T/2": DiT_T_2}
"""

TINY = ["--model", "DiT-T/2", "--image-size", "8", "--in-channels", "3", "--batch", "4", "--warmup", "1",
        "--steps", "2"]  # fmt: skip


@pytest.fixture
def reference(tmp_path) -> Path:
    (tmp_path / "models.py").write_text(STAND_IN)
    return tmp_path


def run_script(capsys, argv: list[str]) -> tuple[int, dict, str]:
    """main()'s return code, its JSON line and the table it prints."""
    code = bench.main(argv)
    out = capsys.readouterr().out.splitlines()
    return code, json.loads(out[0]), "\n".join(out[1:])


@pytest.mark.parametrize("mode", ["ghost", "none"])
def test_result_line_and_table(reference, capsys, mode):
    code, result, table = run_script(capsys, ["--reference-dit", str(reference), *TINY, "--mode", mode])
    assert code == 0 and result["status"] == "ok" and result["mode"] == mode
    assert result["name"] == f"reference_{mode}" and result["global_batch"] == 4 and result["timed_steps"] == 2
    assert result["step_time_min_s"] <= result["step_time_s"] <= result["step_time_max_s"]
    assert result["images_per_second"] == pytest.approx(4 / result["step_time_s"])
    # Our FLOP count of the stand-in's shape: DiT-T/2 on 8x8 is 16 tokens of width 32, 2 blocks, 3 output channels.
    shape = DiTArgs(input_size=8, in_channels=3, patch_size=2, dim=32, depth=2, num_heads=2, learn_sigma=False)
    assert result["gflop_per_image"] == pytest.approx(flops_per_image(shape) / 1e9)
    assert math.isfinite(result["loss"]) and result["loss"] > 0
    assert ("dp_grad_norm_mean" in result) == (mode == "ghost")
    if mode == "ghost":
        assert 0 < result["dp_grad_norm_mean"] <= result["dp_grad_norm_max"] and result["opacus"].startswith("1.")
    assert f"| reference_{mode} | 4 | {result['images_per_second']:.1f} | n/a | n/a | n/a |" in table


def test_missing_reference_exits_2_naming_the_path(tmp_path, capsys):
    missing = tmp_path / "no_dit_here"
    with pytest.raises(SystemExit) as exit_info:
        bench.main(["--reference-dit", str(missing), *TINY])
    assert exit_info.value.code == 2
    assert str(missing / "models.py") in capsys.readouterr().err


def test_unknown_model_exits_2(reference, capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench.main(["--reference-dit", str(reference), "--model", "DiT-XL/2"])
    assert exit_info.value.code == 2 and "DiT-T/2" in capsys.readouterr().err


def test_ghost_clipping_gives_the_clipped_sum_of_per_sample_gradients(reference):
    """The script's loss under Opacus' ghost clipping: per-sample norms and the clipped gradient sum against
    torch.func's per-sample gradients of the same per-sample loss (learn_sigma on: the loss reads C of 2C channels)."""
    torch.manual_seed(0)
    model = (
        bench.load_reference(reference)
        .DiT_models["DiT-T/2"](
            input_size=8, in_channels=3, num_classes=bench.NUM_CLASSES, learn_sigma=True, class_dropout_prob=0.0
        )
        .train()
    )
    batch = bench.random_batch(6, 3, 8, torch.device("cpu"))
    frozen = copy.deepcopy(model)
    params = {name: p.detach() for name, p in frozen.named_parameters() if p.requires_grad}
    buffers = {name: p for name, p in frozen.named_parameters() if not p.requires_grad}

    def sample_loss(params, x, t, y, target):
        output = functional_call(frozen, {**params, **buffers}, (x[None], t[None], y[None]))
        return bench.PerSampleMSE()(output, target[None])

    per_sample = vmap(grad(sample_loss), in_dims=(None, 0, 0, 0, 0))(params, *batch)  # name -> (B, *shape)
    norms = torch.stack([g.flatten(1).norm(dim=1) for g in per_sample.values()]).norm(dim=0)  # (B,)
    max_grad_norm = norms.median().item()  # about half the samples clipped
    factors = (max_grad_norm / (norms + 1e-6)).clamp(max=1.0)

    optimizer = torch.optim.AdamW(model.parameters())
    private, _, loss_fn = bench.make_private_ghost(model, optimizer, 6, noise_multiplier=0.0,
                                                   max_grad_norm=max_grad_norm)  # fmt: skip
    x, t, y, target = batch
    loss_fn(private(x, t, y), target).backward()  # Opacus' two backward passes; the optimizer has not stepped
    torch.testing.assert_close(private.per_sample_gradient_norms, norms, rtol=1e-4, atol=1e-6)
    assert 0 < (factors < 1).sum() < len(factors)
    for name, p in model.named_parameters():
        if p.requires_grad:
            clipped_sum = torch.einsum("b,b...->...", factors, per_sample[name])
            torch.testing.assert_close(p.grad, clipped_sum, rtol=1e-4, atol=1e-6, msg=name)
