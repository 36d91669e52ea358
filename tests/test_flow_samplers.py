"""The rectified-flow samplers against the references' own: REPA's samplers.py (ODE Euler and Heun, the SDE, guidance
inside [guidance_low, guidance_high]), SiT's transport (the SDE's diffusion forms and last steps) and LightningDiT's
(the Euler ODE with its timestep shift and cfg interval); the SDE and the shift against closed forms; the new
[sampling] keys and sample.py flags refused by name.

The reference data (tests/data/sampler_reference/, written by make_reference.py there from each reference's checkout)
are the references' samples of a fixed velocity function (`tiny_velocity`, 4 channels, a null class) and the step
noise they drew; ours replays that noise (`torch.randn_like`, as the references draw it when no generator is given).
With REPA_CHECKOUT, SIT_CHECKOUT or LIGHTNINGDIT_CHECKOUT naming a checkout, a test makes that reference's data
afresh and checks it too. Tolerance: 1e-5 (fp32 on CPU; REPA integrates in float64): measured at most 1.9e-6 on
samples of order 1-10.
"""

import contextlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.data.sampler_reference.make_reference import (
    FILES,
    LIGHTNINGDIT_CASES,
    NULL_CLASS,
    REPA_CASES,
    SIT_CASES,
    reversed_time,
    tiny_velocity,
)
from torchtitan.config_manager import parse_args
from torchtitan.diffusion import GaussianDiffusion, RectifiedFlow, SDESettings, sample_images, sampler_options
from torchtitan.errors import ConfigError

DATA = Path(__file__).parent / "data" / "sampler_reference"
TOLERANCE = 1e-5
FLOW = ["--diffusion.objective", "rectified_flow", "--diffusion.prediction", "velocity"]
DDPM = ["--diffusion.objective", "ddpm", "--diffusion.prediction", "epsilon"]


@contextlib.contextmanager
def replayed(draws: torch.Tensor | None):
    """torch.randn_like returns the recorded draws in order (the first rows of each: a reference that samples a
    doubled chain draws for both halves and keeps the first); every one must be used."""
    queue = list(draws) if draws is not None else []
    original = torch.randn_like

    def randn_like(like: torch.Tensor) -> torch.Tensor:
        assert queue, "the sampler drew more step noise than the reference"
        draw = queue.pop(0)[: like.shape[0]]
        assert draw.shape == like.shape
        return draw.to(like.dtype)

    torch.randn_like = randn_like
    try:
        yield
    finally:
        torch.randn_like = original
    assert not queue, f"the sampler drew {len(draws) - len(queue)} step noises, the reference {len(draws)}"


def gap(ours: torch.Tensor, reference: torch.Tensor) -> float:
    return (ours - reference).abs().max().item()


def repa(data: dict, case: str, **change) -> torch.Tensor:
    """Ours on a REPA case: its time is ours (time_input "t"), its guidance all channels, its null label 1000."""
    c = {**REPA_CASES[case], **change}
    sampler = "sde" if c["mode"] == "sde" else "heun" if c["heun"] else "euler"
    with replayed(data.get(f"{case}.draws")):
        return sample_images(RectifiedFlow(time_input="t"), tiny_velocity(data), data["noise"], data["y"], c["steps"],
                             sampler, c["cfg_scale"], NULL_CLASS,
                             guidance_interval=(c["guidance_low"], c["guidance_high"]))  # fmt: skip


def sit(data: dict, case: str, **change) -> torch.Tensor:
    """Ours on a SiT case: its transport's time (time_input "1-t"), guidance on the first 3 channels."""
    c = {**SIT_CASES[case], **change}
    settings = SDESettings(c["diffusion_form"], c["diffusion_norm"], c["last_step"].lower(), c["last_step_size"])
    with replayed(data[f"{case}.draws"]):
        return sample_images(RectifiedFlow(time_input="1-t"), reversed_time(tiny_velocity(data)), data["noise"],
                             data["y"], c["steps"], "sde", c["cfg_scale"], NULL_CLASS,
                             guidance_channels=c.get("guidance_channels", 3), sde=settings)  # fmt: skip


def lightningdit(data: dict, case: str, **change) -> torch.Tensor:
    """Ours on a LightningDiT case: guided for its time s >= cfg_interval_start, i.e. our t <= 1 - start; its
    shift 0 is none."""
    c = {**LIGHTNINGDIT_CASES[case], **change}
    return sample_images(RectifiedFlow(time_input="1-t"), reversed_time(tiny_velocity(data)), data["noise"],
                         data["y"], c["steps"], "euler", c["cfg_scale"], NULL_CLASS, guidance_channels=3,
                         guidance_interval=(0.0, 1.0 - c["cfg_interval_start"]),
                         timestep_shift=c["timestep_shift"] or 1.0)  # fmt: skip


def check_repa(folder: Path) -> None:
    data = load_file(folder / FILES["repa"])
    for case in REPA_CASES:
        assert gap(repa(data, case), data[f"{case}.out"]) <= TOLERANCE, case
        # The interval matters: guided at every step, or at none, the samples are others.
        assert gap(repa(data, case, guidance_low=0.0, guidance_high=1.0), data[f"{case}.out"]) > 1e-2, case
        assert gap(repa(data, case, cfg_scale=1.0), data[f"{case}.out"]) > 1e-2, case


def check_sit(folder: Path) -> None:
    data = load_file(folder / FILES["sit"])
    for case in SIT_CASES:
        assert gap(sit(data, case), data[f"{case}.out"]) <= TOLERANCE, case
    # Each setting matters: another last step, form, norm or last step size, or guidance on all channels.
    for case, change in [("half_sigma_tweedie", dict(last_step="Mean")), ("decreasing_euler", dict(last_step="Mean")),
                         ("sigma_mean", dict(last_step="Euler")), ("decreasing_euler", dict(diffusion_form="sigma")),
                         ("half_sigma_tweedie", dict(diffusion_norm=1.0)),
                         ("half_sigma_tweedie", dict(last_step_size=0.04)),
                         ("sigma_mean", dict(guidance_channels=-1))]:  # fmt: skip
        assert gap(sit(data, case, **change), data[f"{case}.out"]) > 1e-3, (case, change)


def check_lightningdit(folder: Path) -> None:
    data = load_file(folder / FILES["lightningdit"])
    for case in LIGHTNINGDIT_CASES:
        assert gap(lightningdit(data, case), data[f"{case}.out"]) <= TOLERANCE, case
    for case, change in [("shift_interval", dict(cfg_interval_start=0.0)), ("shift_interval", dict(timestep_shift=0)),
                         ("interval", dict(cfg_interval_start=0.0)), ("shift", dict(timestep_shift=0))]:  # fmt: skip
        assert gap(lightningdit(data, case, **change), data[f"{case}.out"]) > 1e-2, (case, change)


def test_repa_samplers_with_a_guidance_interval():
    """euler_sampler (Euler; Heun, whose second evaluation takes its step's guidance) and euler_maruyama_sampler
    (7 stochastic steps from t = 1 to 0.04, then the drift to 0), guided at t in [0.3, 0.7] and [0, 0.5]."""
    check_repa(DATA)


def test_sit_sde_diffusion_forms_and_last_steps():
    """sample_sde (Euler-Maruyama) with 'sigma', 'linear' and 'decreasing' coefficients, norms 1, 0.5 and 1.5, last
    steps Mean, Tweedie and Euler of sizes 0.04 and 0.1, guided through its forward_with_cfg (3 channels) and not."""
    check_sit(DATA)


def test_lightningdit_euler_with_timestep_shift_and_cfg_interval():
    check_lightningdit(DATA)


def _made_afresh(tmp_path: Path, flag: str, variable: str) -> Path:
    script = DATA / "make_reference.py"
    subprocess.run([sys.executable, str(script), flag, os.environ[variable], "--out", str(tmp_path)], check=True)
    return tmp_path


@pytest.mark.skipif(not os.environ.get("REPA_CHECKOUT"), reason="set REPA_CHECKOUT to a sihyun-yu/REPA checkout")
def test_against_the_repa_checkout(tmp_path):
    check_repa(_made_afresh(tmp_path, "--repa", "REPA_CHECKOUT"))


@pytest.mark.skipif(not os.environ.get("SIT_CHECKOUT"), reason="set SIT_CHECKOUT to a willisma/SiT checkout")
def test_against_the_sit_checkout(tmp_path):
    """Its transport imports torchdiffeq and its models.py timm: both on PYTHONPATH (make_reference.py says how)."""
    check_sit(_made_afresh(tmp_path, "--sit", "SIT_CHECKOUT"))


@pytest.mark.skipif(not os.environ.get("LIGHTNINGDIT_CHECKOUT"), reason="set LIGHTNINGDIT_CHECKOUT to a checkout")
def test_against_the_lightningdit_checkout(tmp_path):
    """Its transport imports torchdiffeq and scipy, its models timm, einops and fairscale: on PYTHONPATH."""
    check_lightningdit(_made_afresh(tmp_path, "--lightningdit", "LIGHTNINGDIT_CHECKOUT"))


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--sampling.guidance_high", "1.5"], "sampling.guidance_high = 1.5 in the command line: must be in [0, 1]"),
        (["--sampling.guidance_low", "0.6", "--sampling.guidance_high", "0.4"],
         "sampling.guidance_low with sampling.guidance_high in the command line: 0.6 >= 0.4, an empty guidance"),
        (["--sampling.timestep_shift", "0"], "sampling.timestep_shift = 0.0 in the command line: must be > 0"),
        (["--sampling.sampler", "sde", "--sampling.timestep_shift", "0.3"],
         "sampling.timestep_shift = 0.3 in the command line: the ODE samplers' ('euler', 'heun'); the 'sde' sampler"),
        (["--sampling.sampler", "sde", "--sampling.steps", "1"],
         "sampling.steps = 1 in the command line: the 'sde' sampler (in the command line) takes at least 2"),
        (["--sampling.sde_last_step", "Mean"],
         "sampling.sde_last_step = 'Mean' in the command line: must be one of ['mean', 'tweedie', 'euler']"),
        (["--sampling.sde_diffusion_form", "constant"],
         "sampling.sde_diffusion_form = 'constant' in the command line: must be one of ['sigma', 'linear', "),
        (["--sampling.sde_last_step_size", "1"], "sampling.sde_last_step_size = 1.0 in the command line: must be in"),
        (["--sampling.sde_diffusion_norm", "-1"], "sampling.sde_diffusion_norm = -1.0 in the command line: must be >="),
        ([*DDPM, "--sampling.guidance_high", "0.7"],
         "sampling.guidance_high = 0.7 in the command line: rectified_flow's; diffusion.objective 'ddpm'"),
        ([*DDPM, "--sampling.sampler", "sde"],
         "sampling.sampler = 'sde' in the command line: diffusion.objective 'ddpm' (in the command line) samples"),
    ],
)  # fmt: skip
def test_bad_sampling_keys_are_refused_by_name(flags, message):
    with pytest.raises(ConfigError) as info:
        parse_args([*FLOW, *flags])  # the last --diffusion.* flags count
    assert str(info.value).startswith(message)  # the one problem


def test_sampling_keys_reach_the_sampler():
    """What [sampling] sets is what sample_images runs (sampler_options: sample grids, the FID while training and
    sample.py take it), refused at run time as the config refuses it."""
    cfg = parse_args([*FLOW, "--sampling.sampler", "sde", "--sampling.guidance_low", "0.2",
                      "--sampling.guidance_high", "0.6", "--sampling.sde_diffusion_form", "decreasing",
                      "--sampling.sde_diffusion_norm", "0.5",
                      "--sampling.sde_last_step", "tweedie", "--sampling.sde_last_step_size", "0.1"])  # fmt: skip
    assert sampler_options(cfg.sampling) == {"guidance_interval": (0.2, 0.6), "timestep_shift": 1.0,
                                             "sde": SDESettings("decreasing", 0.5, "tweedie", 0.1)}  # fmt: skip
    flow, ddpm, x = RectifiedFlow(), GaussianDiffusion(), torch.zeros(1, 1, 2, 2)
    zero = lambda x, t, y: torch.zeros_like(x)  # noqa: E731
    for diffusion, sampler, steps, options, message in [
        (flow, "sde", 4, dict(timestep_shift=0.3), "sampling.timestep_shift = 0.3: the ODE samplers'"),
        (flow, "sde", 1, {}, "sampling.steps = 1: the 'sde' sampler takes at least 2"),
        (flow, "euler", 4, dict(guidance_interval=(0.5, 0.5)), "must have 0 <= low < high <= 1"),
        (ddpm, "ddim", 4, dict(guidance_interval=(0.0, 0.7)), "rectified flow's; DDPM guides every step"),
        (ddpm, "sde", 4, {}, "sampling.sampler = 'sde': DDPM samples with 'ddim' or 'ddpm'"),
    ]:  # fmt: skip
        with pytest.raises(ValueError, match=message):
            sample_images(diffusion, zero, x, None, steps, sampler, **options)
    with pytest.raises(ValueError, match=r"sampling.sde_last_step = 'Mean': must be one of \['mean', 'tweedie'"):
        SDESettings(last_step="Mean")


def test_sample_grids_while_training_use_the_sampling_keys():
    """The training's sample grid (SampleWriter) samples with [sampling]'s interval and SDE settings: its grid is
    sample_images' with them, and not the one without."""
    from torchtitan.components.sampling import SampleWriter
    from torchtitan.models.dit import DiTArgs

    data = load_file(DATA / FILES["repa"])
    model = tiny_velocity(data)
    cfg = parse_args([*FLOW, "--sampling.sampler", "sde", "--sampling.num_samples", "2", "--sampling.steps", "5",
                      "--sampling.cfg_scale", "3", "--sampling.guidance_high", "0.5", "--sampling.sde_last_step",
                      "euler", "--diffusion.time_input", "t"])  # fmt: skip
    args = DiTArgs(input_size=2, in_channels=4, patch_size=1, num_classes=10)
    flow = RectifiedFlow(time_input="t")
    writer = SampleWriter(cfg, args, flow, torch.device("cpu"), 0, Path("unused"), None)
    noise = torch.randn(2, 4, 2, 2, generator=torch.Generator().manual_seed(cfg.sampling.seed))

    def expected(**options):
        torch.manual_seed(0)  # the step noise: the global RNG, as the grid draws it
        return sample_images(flow, model, noise, labels, 5, "sde", 3.0, 10, guidance_channels=-1, **options)

    torch.manual_seed(0)
    samples, labels = writer.generate(model, contextlib.nullcontext)
    options = dict(guidance_interval=(0.0, 0.5), sde=SDESettings(last_step="euler"))
    assert labels.tolist() == [0, 1] and torch.equal(samples, expected(**options))
    assert gap(samples, expected()) > 1e-2
