"""scripts/benchmarks/benchmark_reference.py on stand-ins of the reference's models.py and `diffusion` package, CPU.

The models.py stand-in is test_benchmark_opacus_reference's (the reference's interface in plain torch, no timm,
with torch's default initialization instead of the reference's zeros, so that no gradient hides behind a zero).
The diffusion stand-in has the reference's interface (`create_diffusion(timestep_respacing)`, `num_timesteps`,
`training_losses(model, x, t, model_kwargs)` -> {"loss": one loss per sample}) and imports a module of its own
relatively, as the reference's package does. It records what it drew, so that a test can redo the step by hand.
"""

import copy
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import scripts.benchmarks.benchmark_reference as bench
from tests.test_benchmark_opacus_reference import STAND_IN
from torchtitan.models.dit.model import DiTArgs, flops_per_image
from torchtitan.tools.runs import RESULT_PREFIX, ROOT, launcher, run_to_end

pytestmark = pytest.mark.usefixtures("keep_tf32_flags")  # main() sets TF32, as the reference runs

DIFFUSION_INIT = """
from .gaussian import StandInDiffusion


def create_diffusion(timestep_respacing, diffusion_steps=1000):
    return StandInDiffusion(timestep_respacing, diffusion_steps)
"""

DIFFUSION_GAUSSIAN = """
import torch


def per_sample_loss(output, noise):
    # The noise's MSE on the first C channels; the other C (learned sigma) get a stand-in for the variational bound.
    channels = noise.shape[1]
    mse = (noise - output[:, :channels].float()).square().mean(dim=(1, 2, 3))
    return mse + 0.1 * output[:, channels:].float().square().mean(dim=(1, 2, 3))


class StandInDiffusion:
    def __init__(self, timestep_respacing, num_timesteps):
        self.timestep_respacing, self.num_timesteps = timestep_respacing, num_timesteps
        betas = torch.linspace(1e-4, 0.02, num_timesteps, dtype=torch.float64)
        self.alphas_cumprod = torch.cumprod(1 - betas, dim=0)
        self.calls = []

    def training_losses(self, model, x_start, t, model_kwargs=None):
        noise = torch.randn_like(x_start)
        alpha = self.alphas_cumprod.to(x_start.device)[t].float().view(-1, 1, 1, 1)
        x_t = alpha.sqrt() * x_start + (1 - alpha).sqrt() * noise
        # The random state the model's class dropout starts from: a test replays the forward with it.
        self.calls.append(dict(x_start=x_start, x_t=x_t, t=t, model_kwargs=model_kwargs, noise=noise,
                               rng=torch.get_rng_state()))
        return {"loss": per_sample_loss(model(x_t, t, **model_kwargs), noise)}
"""

# DiT-T/2 (2 blocks of width 32) on 64px images: 8x8 latents, 16 tokens.
TINY = ["--model", "DiT-T/2", "--image-size", "64", "--batch", "3", "--warmup", "1", "--steps", "2", "--no-compile"]
TINY_SHAPE = DiTArgs(input_size=8, in_channels=4, patch_size=2, dim=32, depth=2, num_heads=2, learn_sigma=True)
CPU = torch.device("cpu")


def write_reference(folder: Path, diffusion: bool = True) -> Path:
    folder.mkdir(exist_ok=True)
    (folder / "models.py").write_text(STAND_IN)
    if diffusion:
        (folder / "diffusion").mkdir()
        (folder / "diffusion" / "__init__.py").write_text(DIFFUSION_INIT)
        (folder / "diffusion" / "gaussian.py").write_text(DIFFUSION_GAUSSIAN)
    return folder


@pytest.fixture
def reference(tmp_path) -> Path:
    return write_reference(tmp_path / "ref_dit")


def result_line(stdout: str) -> dict:
    lines = [line for line in stdout.splitlines() if line.startswith(RESULT_PREFIX)]
    assert len(lines) == 1, stdout
    return json.loads(lines[0][len(RESULT_PREFIX) :])


def test_step_applies_the_reference_gradient_adamw_and_ema(reference):
    """One step of the script against the same step redone by hand: the gradient of the batch's mean loss (class
    dropout replayed from the recorded random state), AdamW's first update (lr 1e-4, no weight decay:
    -lr * g / (|g| + eps)) and the EMA update (decay 0.9999). The EMA starts as a copy of the weights; it is moved
    off them before the step, since one step moves the weights by about 1e-4 and the EMA by 1e-4 of that, below
    float32's resolution: from elsewhere, a missing or wrong update shows."""
    torch.manual_seed(0)
    models, diffusion = bench.load_reference(reference), bench.load_reference_diffusion(reference)
    with bench.distributed(CPU):
        run = bench.build_reference_run(models, diffusion, "DiT-T/2", 8, CPU, compile_model=False)
        start = copy.deepcopy(run.plain)
        assert all(torch.equal(e, p) for e, p in zip(run.ema.parameters(), start.parameters()))
        with torch.no_grad():
            ema_start = {name: e.add_(torch.randn_like(e)).clone() for name, e in run.ema.named_parameters()}
        x, y = bench.random_latents(6, 4, 8, CPU)
        loss = bench.train_step(run, x, y, autocast=False)
    assert run.diffusion.timestep_respacing == "" and run.plain.training and not run.ema.training
    (call,) = run.diffusion.calls
    assert call["x_start"] is x and call["model_kwargs"]["y"] is y
    assert call["t"].shape == (6,) and 0 <= call["t"].min() and call["t"].max() < run.diffusion.num_timesteps

    torch.set_rng_state(call["rng"])
    per_sample = diffusion.gaussian.per_sample_loss(start(call["x_t"], call["t"], y), call["noise"])  # (B,)
    trained = {name: p for name, p in start.named_parameters() if p.requires_grad}
    grads = dict(zip(trained, torch.autograd.grad(per_sample.mean(), list(trained.values()))))
    torch.testing.assert_close(loss, per_sample.mean().detach())

    params, ema = dict(run.plain.named_parameters()), dict(run.ema.named_parameters())
    assert not any(p.requires_grad for p in ema.values())
    for name, before in start.named_parameters():
        after = params[name].detach()
        if name in grads:
            grad = params[name].grad
            assert grad.abs().sum() > 0, name
            torch.testing.assert_close(grad, grads[name], rtol=1e-5, atol=1e-8, msg=name)
            torch.testing.assert_close(after, before - 1e-4 * grad / (grad.abs() + 1e-8), rtol=1e-6, atol=1e-7,
                                       msg=name)  # fmt: skip
        else:  # the frozen position embedding
            assert params[name].grad is None and torch.equal(after, before)
        torch.testing.assert_close(ema[name], 0.9999 * ema_start[name] + 1e-4 * after, rtol=1e-6, atol=1e-7,
                                   msg=name)  # fmt: skip


def test_compile_wraps_the_plain_model_before_or_after_ddp(reference):
    models, diffusion = bench.load_reference(reference), bench.load_reference_diffusion(reference)
    with bench.distributed(CPU):
        run = bench.build_reference_run(models, diffusion, "DiT-T/2", 8, CPU, compile_model=True)
        after = bench.build_reference_run(models, diffusion, "DiT-T/2", 8, CPU, True, compile_order="after-ddp")
    assert isinstance(run.model, DDP) and isinstance(run.model.module, torch._dynamo.eval_frame.OptimizedModule)
    assert run.model.module._orig_mod is run.plain
    assert isinstance(after.model, torch._dynamo.eval_frame.OptimizedModule) and isinstance(after.model._orig_mod, DDP)
    assert after.model._orig_mod.module is after.plain


def test_result_line_json_out_and_table(reference, tmp_path, capsys):
    out = tmp_path / "result.json"
    assert bench.main(["--reference-dit", str(reference), *TINY, "--json-out", str(out)]) == 0
    stdout = capsys.readouterr().out
    result = result_line(stdout)
    assert json.loads(out.read_text()) == result
    assert result["status"] == "ok" and result["name"] == "reference_dit" and result["latent_size"] == 8
    assert result["world_size"] == 1 and result["batch"] == result["global_batch"] == 3 and result["timed_steps"] == 2
    assert not result["compile"] and not result["autocast"]
    assert result["step_time_min_s"] <= result["step_time_s"] <= result["step_time_max_s"]
    assert result["images_per_second"] == pytest.approx(3 / result["step_time_s"])
    assert result["streamed_step_time_s"] > 0 and math.isfinite(result["loss"]) and result["loss"] > 0
    assert result["gflop_per_image"] == pytest.approx(flops_per_image(TINY_SHAPE) / 1e9)
    assert f"| reference_dit | 3 | {result['images_per_second']:.1f} | n/a | n/a | n/a |" in stdout


def test_missing_reference_exits_2_with_one_error_line(tmp_path):
    missing = tmp_path / "no_dit_here"
    cmd = [sys.executable, "scripts/benchmarks/benchmark_reference.py", "--reference-dit", str(missing)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stdout == "", proc.stderr
    (line,) = proc.stderr.splitlines()
    assert line.startswith("error: ") and str(missing / "models.py") in line


def test_missing_diffusion_or_model_exits_2(tmp_path, capsys):
    no_diffusion = write_reference(tmp_path / "models_only", diffusion=False)
    assert bench.main(["--reference-dit", str(no_diffusion)]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("error: ") and str(no_diffusion / "diffusion" / "__init__.py") in line
    assert bench.main(["--reference-dit", str(write_reference(tmp_path / "ref"))]) == 2  # DiT-XL/2: not in it
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("error: ") and "DiT-T/2" in line


@pytest.mark.slow
def test_two_ranks_report_global_images_per_second(reference):
    """torchrun, 2 gloo ranks of 3 latents: rank 0 alone prints, and images/s count both ranks' images."""
    cmd = [*launcher(2), "scripts/benchmarks/benchmark_reference.py", "--reference-dit", str(reference), *TINY]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    proc = run_to_end(cmd, timeout=240, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = result_line(proc.stdout)
    assert result["world_size"] == 2 and result["batch"] == 3 and result["global_batch"] == 6
    assert result["images_per_second"] == pytest.approx(6 / result["step_time_s"])
