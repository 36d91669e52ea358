"""Writes tests/data/sampler_reference/: what the references' OWN samplers give on a fixed velocity function, with
their step noise recorded (tests/test_flow_samplers.py reproduces them with ours).

    # SiT's transport imports torchdiffeq, its models.py timm; LightningDiT's also scipy, einops and fairscale.
    # REPA's samplers.py needs nothing more. Leaving the project's venv as it is:
    pip install --no-deps --target /tmp/ref_site timm==1.0.22 einops fairscale torchdiffeq
    PYTHONPATH=/tmp/ref_site python tests/data/sampler_reference/make_reference.py [--repa /path/to/REPA] \\
        [--sit /path/to/SiT] [--lightningdit /path/to/LightningDiT] [--out tests/data/sampler_reference]

The model is `tiny_velocity`, a fixed smooth function of x, t and the label (its weights drawn from a seeded
generator and stored with the outputs), nonlinear in both, with a null class for guidance and 4 channels, so that
SiT's and LightningDiT's guidance on the first 3 differs from guidance on all. REPA reads it in REPA's time (ours:
t = 1 is the noise); SiT and LightningDiT read `reversed_time(tiny_velocity)`, the same flow in their transport's time
(t = 1 is the data, the velocity negated), as their weights are read with diffusion.time_input = "1-t".
- REPA (`samplers.py`): `euler_sampler` (Euler, Heun) and `euler_maruyama_sampler`, guided inside a
  [guidance_low, guidance_high] that leaves steps out at both ends (REPA_CASES);
- SiT (`transport`, `Sampler(create_transport()).sample_sde` as its sample.py builds it): diffusion forms and norms,
  last steps "Mean", "Tweedie" and "Euler" and their sizes, guided through its models.py `SiT.forward_with_cfg` on
  the doubled chain its sample.py samples (SIT_CASES);
- LightningDiT (`transport`, `sample_ode(sampling_method="euler", timestep_shift=...)` as its inference.py builds
  it): the timestep shift and its models/lightningdit.py `forward_with_cfg` with its cfg interval
  (LIGHTNINGDIT_CASES).
`forward_with_cfg` runs unbound on a stand-in whose `forward` is the function. The step noise the references draw
(REPA's `torch.randn_like`, SiT's `torch.randn`) comes from a seeded generator and is recorded, in float32.

Files (one per reference; each holds the function's weights "W", "E", "a", the starting "noise" (B, 4, 2, 2) and the
labels "y"): repa_samplers.safetensors, sit_samplers.safetensors, lightningdit_samplers.safetensors, with
"<case>.out" the reference's samples and "<case>.draws" (steps, B or 2B, 4, 2, 2) the step noise it drew.
"""

import argparse
import functools
import importlib.util
import sys
from pathlib import Path
from types import ModuleType, SimpleNamespace

import torch

CHANNELS, SIZE, NUM_CLASSES, NULL_CLASS, SEED = 4, 2, 10, 1000, 0  # REPA's and its scripts' null label: 1000
LABELS = [3, 7]
FILES = {"repa": "repa_samplers.safetensors", "sit": "sit_samplers.safetensors",
         "lightningdit": "lightningdit_samplers.safetensors"}  # fmt: skip
# Guided at t in [low, high] only: 8 steps put t = 0.625, 0.5, 0.375 (Euler, Heun) or 0.589, 0.451, 0.314 (the SDE's
# grid, 1 to 0.04) inside [0.3, 0.7]; Heun's step from 0.75 ends inside, the one from 0.375 outside. [0, 0.5] guides
# the SDE's last step too.
REPA_CASES = {
    "ode_euler": dict(mode="ode", heun=False, steps=8, cfg_scale=4.0, guidance_low=0.3, guidance_high=0.7),
    "ode_heun": dict(mode="ode", heun=True, steps=8, cfg_scale=4.0, guidance_low=0.3, guidance_high=0.7),
    "sde_middle": dict(mode="sde", heun=False, steps=8, cfg_scale=4.0, guidance_low=0.3, guidance_high=0.7),
    "sde_low": dict(mode="sde", heun=False, steps=8, cfg_scale=2.5, guidance_low=0.0, guidance_high=0.5),
}
SIT_CASES = {
    "sigma_mean": dict(diffusion_form="sigma", diffusion_norm=1.0, last_step="Mean", last_step_size=0.04,
                       steps=8, cfg_scale=3.0),
    "half_sigma_tweedie": dict(diffusion_form="sigma", diffusion_norm=0.5, last_step="Tweedie",
                               last_step_size=0.1, steps=8, cfg_scale=3.0),
    "decreasing_euler": dict(diffusion_form="decreasing", diffusion_norm=1.5, last_step="Euler",
                             last_step_size=0.04, steps=8, cfg_scale=3.0),
    "linear_mean_unguided": dict(diffusion_form="linear", diffusion_norm=1.0, last_step="Mean",
                                 last_step_size=0.04, steps=6, cfg_scale=1.0),
}  # fmt: skip
# Its time s = 1 - ours: 8 steps shifted by 0.3 start at s = 0, 0.041, 0.091, 0.153, 0.231, ...: a cfg interval
# starting at 0.2 leaves the first four unguided; unshifted (0: its "none"), 0.11 leaves the first one.
LIGHTNINGDIT_CASES = {
    "shift_interval": dict(steps=8, timestep_shift=0.3, cfg_scale=4.0, cfg_interval_start=0.2),
    "interval": dict(steps=8, timestep_shift=0.0, cfg_scale=4.0, cfg_interval_start=0.11),
    "shift": dict(steps=8, timestep_shift=0.3, cfg_scale=1.0, cfg_interval_start=0.0),
}


def tiny_weights() -> dict[str, torch.Tensor]:
    """The function's weights, the starting noise (B, C, H, W) and the labels (B,)."""
    g = torch.Generator().manual_seed(SEED)
    return {"W": torch.randn(CHANNELS, CHANNELS, generator=g) * 0.7,
            "E": torch.randn(NUM_CLASSES + 1, CHANNELS, generator=g),  # the last row: the null class
            "a": torch.randn(CHANNELS, generator=g),
            "noise": torch.randn(len(LABELS), CHANNELS, SIZE, SIZE, generator=g),
            "y": torch.tensor(LABELS)}  # fmt: skip


def tiny_velocity(weights: dict[str, torch.Tensor]):
    """v(x, t, y) in REPA's and our time (t = 1 the noise): 2 tanh(W x + E[y] (1 + t)) + (t - 1/2) a x, per
    position; labels >= NUM_CLASSES (REPA's 1000) read the null row."""
    W, E, a = weights["W"], weights["E"], weights["a"]

    def v(x: torch.Tensor, t: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        t = t.to(x.dtype).view(-1, 1, 1, 1)
        label = E.to(x.dtype)[y.clamp(max=NUM_CLASSES)].view(-1, CHANNELS, 1, 1)
        mixed = torch.einsum("oc,bchw->bohw", W.to(x.dtype), x)
        return 2 * torch.tanh(mixed + label * (1 + t)) + (t - 0.5) * a.to(x.dtype).view(1, -1, 1, 1) * x

    return v


def reversed_time(v):
    """The same flow in SiT's and LightningDiT's time s = 1 - t, whose velocity d x / d s is -v."""
    return lambda x, s, y: -v(x, 1 - s, y)


class RecordedNoise:
    """Replaces `torch.<name>` while active: standard normal draws from a seeded generator, in float32 (then in the
    dtype asked for), each recorded."""

    def __init__(self, name: str, seed: int):
        self.name, self.generator, self.draws = name, torch.Generator().manual_seed(seed), []

    def draw(self, *args, **kwargs) -> torch.Tensor:
        like = args[0] if self.name == "randn_like" else None
        shape = like.shape if like is not None else (args[0] if len(args) == 1 else args)
        noise = self.original(tuple(shape), generator=self.generator)
        self.draws.append(noise)
        return noise.to(like.dtype) if like is not None else noise

    def __enter__(self):
        self.original = torch.randn
        self.replaced = getattr(torch, self.name)
        setattr(torch, self.name, self.draw)
        return self

    def __exit__(self, *exc):
        setattr(torch, self.name, self.replaced)


def load_module(name: str, path: Path) -> ModuleType:
    """A reference file (or a package's __init__.py) imported under a name of its own: SiT and LightningDiT both
    have a `transport` package."""
    if not path.is_file():
        raise FileNotFoundError(path)
    folder = [str(path.parent)] if path.name == "__init__.py" else None
    spec = importlib.util.spec_from_file_location(name, path, submodule_search_locations=folder)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def repa_samples(checkout: Path, weights: dict) -> dict[str, torch.Tensor]:
    samplers = load_module("reference_repa_samplers", checkout / "samplers.py")
    v = tiny_velocity(weights)
    model = lambda x, t, y: (v(x, t, y),)  # noqa: E731 (REPA's SiT returns (output, projections))
    out = {}
    for i, (case, c) in enumerate(REPA_CASES.items()):
        sampler = samplers.euler_maruyama_sampler if c["mode"] == "sde" else samplers.euler_sampler
        with RecordedNoise("randn_like", SEED + i) as noise:
            x = sampler(model, weights["noise"], weights["y"], num_steps=c["steps"], heun=c["heun"],
                        cfg_scale=c["cfg_scale"], guidance_low=c["guidance_low"], guidance_high=c["guidance_high"],
                        path_type="linear")  # fmt: skip
        out[f"{case}.out"] = x.float()
        if noise.draws:  # the SDE's
            out[f"{case}.draws"] = torch.stack(noise.draws)
    return out


def sit_samples(checkout: Path, weights: dict) -> dict[str, torch.Tensor]:
    transport = load_module("reference_sit_transport", checkout / "transport" / "__init__.py")
    sit_models = load_module("reference_sit_models", checkout / "models.py")
    forward = reversed_time(tiny_velocity(weights))
    out = {}
    for i, (case, c) in enumerate(SIT_CASES.items()):
        sample = transport.Sampler(transport.create_transport("Linear", "velocity")).sample_sde(
            sampling_method="Euler", diffusion_form=c["diffusion_form"], diffusion_norm=c["diffusion_norm"],
            last_step=c["last_step"], last_step_size=c["last_step_size"], num_steps=c["steps"])  # fmt: skip
        z, y = weights["noise"], weights["y"]
        with RecordedNoise("randn", SEED + i) as noise:
            if c["cfg_scale"] > 1:  # as its sample.py: the doubled chain, the conditional half kept
                guided = functools.partial(sit_models.SiT.forward_with_cfg, SimpleNamespace(forward=forward))
                doubled = torch.cat([y, torch.full_like(y, NULL_CLASS)])
                x = sample(torch.cat([z, z]), guided, y=doubled, cfg_scale=c["cfg_scale"])[-1][: len(y)]
            else:
                x = sample(z, forward, y=y)[-1]
        out[f"{case}.out"], out[f"{case}.draws"] = x, torch.stack(noise.draws)
    return out


def lightningdit_samples(checkout: Path, weights: dict) -> dict[str, torch.Tensor]:
    # Its @torch.compile functions run eagerly here, and only here: the tests import this module, and a process-wide
    # TORCHDYNAMO_DISABLE set at import would turn compile off for every test after it in that process.
    with torch._dynamo.config.patch(disable=True):
        return _lightningdit_samples(checkout, weights)


def _lightningdit_samples(checkout: Path, weights: dict) -> dict[str, torch.Tensor]:
    transport = load_module("reference_lightningdit_transport", checkout / "transport" / "__init__.py")
    sys.path.insert(0, str(checkout))  # models/lightningdit.py imports its siblings as models.*
    from models.lightningdit import LightningDiT  # the reference's own code

    forward = reversed_time(tiny_velocity(weights))
    out = {}
    for case, c in LIGHTNINGDIT_CASES.items():
        sample = transport.Sampler(transport.create_transport("Linear", "velocity")).sample_ode(
            sampling_method="euler", num_steps=c["steps"] + 1, atol=1e-6, rtol=1e-3, reverse=False,
            timestep_shift=c["timestep_shift"])  # fmt: skip
        z, y = weights["noise"], weights["y"]
        if c["cfg_scale"] > 1:  # as its inference.py: the doubled chain, the conditional half kept
            guided = functools.partial(LightningDiT.forward_with_cfg, SimpleNamespace(forward=forward))
            doubled = torch.cat([y, torch.full_like(y, NULL_CLASS)])
            x = sample(torch.cat([z, z]), guided, y=doubled, cfg_scale=c["cfg_scale"], cfg_interval=True,
                       cfg_interval_start=c["cfg_interval_start"])[-1][: len(y)]  # fmt: skip
        else:
            x = sample(z, forward, y=y)[-1]
        out[f"{case}.out"] = x
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repa", type=Path, help="a clone of sihyun-yu/REPA (samplers.py)")
    parser.add_argument("--sit", type=Path, help="a clone of willisma/SiT (transport/, models.py)")
    parser.add_argument("--lightningdit", type=Path, help="a clone of hustvl/LightningDiT (transport/, models/)")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent)
    args = parser.parse_args(argv)
    from safetensors.torch import save_file

    makers = {"repa": repa_samples, "sit": sit_samples, "lightningdit": lightningdit_samples}
    args.out.mkdir(parents=True, exist_ok=True)
    for name, make in makers.items():
        checkout = getattr(args, name)
        if checkout is None:
            continue
        weights = tiny_weights()
        tensors = {**weights, **make(checkout.resolve(), weights)}
        save_file({k: v.contiguous() for k, v in tensors.items()}, args.out / FILES[name],
                  metadata={"torch": torch.__version__})  # fmt: skip
        print(f"wrote {args.out / FILES[name]}")


if __name__ == "__main__":
    main()
