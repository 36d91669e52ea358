"""FID-50K from the command to ADM's five numbers, timed phase by phase, across as many calls as a time limit needs.

The setting of the speed target (docs/benchmarks.md): DiT-XL/2's shapes sampled by the flow's 50-step Euler ODE (50
NFE; `--sampler heun --steps 25` is 49) with guidance 1.5, each batch decoded through SD-VAE's decoder, 50,000
samples, then `scripts/evaluate_fid.py` (one Inception pass: FID, sFID, IS, precision, recall). Weights are random
(the time does not depend on them), so nothing is downloaded. In `--work` the script writes once:
- `run/`: a run folder (config.toml, ema.safetensors) of SiT-XL/2 (DiT-XL/2's shapes predicting the velocity; the
  weights the model zero-initializes, adaLN-Zero, drawn at std 0.02 so every matmul sees non-zero data);
- `vae/`: a random diffusers AutoencoderKL of SD-VAE's config (scripts/benchmark_sampling.py's SD_VAE_CONFIG);
- `inception.pth`: a random state dict of the FID Inception network (`write_random_inception`);
- `reference.npz`: a stand-in for ADM's VIRTUAL_imagenet256_labeled.npz in its format: `--reference-images` random
  images as `arr_0`, labels as `arr_1`, and `mu`/`sigma` (2048) and `mu_s`/`sigma_s` (2023) statistics.
Then it runs, each phase a process of its own, timed by its wall clock and appended to `--work`/times.jsonl:
1. `torchrun --nproc_per_node N sample.py --checkpoint run --num-samples 50000 ... --compile --npz samples.npz`;
2. `python scripts/evaluate_fid.py --samples samples.npz --reference reference.npz --inception-weights ...`.
A phase still running when `--budget-s` (from this script's start) is spent is stopped (SIGTERM): sample.py keeps
its whole shards, and the same command again resumes it (exit status 3 says so). At the end it prints each call's
phases and the sum of the sampling and evaluation seconds over all calls, against the 15-minute target. Example,
on 4 GPUs within 10-minute calls:

    python scripts/benchmarks/benchmark_fid50k.py --work build/fid50k --nproc 4   # again while it exits with 3
"""

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from scripts.benchmarks.benchmark_sampling import SD_VAE_CONFIG, SD_VAE_SCALE, ZERO_INIT_STD, build_vae, execute  # noqa: E402
from torchtitan.tools.fid import SPATIAL_DIMS  # noqa: E402
from torchtitan.tools.runs import TORCHRUN_VARS, launcher  # noqa: E402

TARGET_S = 15 * 60  # FID-50K on 4 H200s: 15 minutes or less, sampling and evaluation together
RESUME = 3  # exit status: the budget ran out; run the same command again
RUN_CONFIG = """[model]
name = "dit"
flavor = "{flavor}"
input_size = {latent_size}
in_channels = 4
num_classes = 1000

[diffusion]
objective = "rectified_flow"
prediction = "velocity"

[training]
dataset = "dummy"
mixed_precision_param = "bfloat16"

[latent]
tokenizer = "diffusers"
checkpoint_dir = "{vae}"
scale_factor = {scale}
"""


def write_random_inception(path: Path, seed: int = 0) -> Path:
    """A random state dict with the FID Inception network's keys (torchvision's InceptionV3, 1008 classes), its batch
    norms calibrated on noise: with the defaults the features grow to ~1e10, calibrated they stay O(1e5). The
    softmax weight is scaled by 1e-3 so that the Inception Score's softmax is not saturated, and the bias, which
    ADM's score leaves out, drawn large (any use of it shows)."""
    import torchvision

    torch.manual_seed(seed)
    net = torchvision.models.inception_v3(weights=None, aux_logits=False, num_classes=1008, init_weights=False)
    for module in net.modules():
        if isinstance(module, torch.nn.BatchNorm2d):
            module.momentum = None  # a plain average over the calibration batch
    with torch.no_grad():
        net.train()(torch.rand(4, 3, 96, 96) * 2 - 1)  # small: only the statistics' scale matters
        net.fc.weight *= 1e-3
        net.fc.bias.normal_(0, 5)
    torch.save(net.state_dict(), path)
    return path


def write_run(folder: Path, flavor: str, latent_size: int, vae: Path, seed: int) -> None:
    """A run folder sample.py reads: config.toml and ema.safetensors of random weights (none left at zero)."""
    from safetensors.torch import save_file

    from torchtitan.config_manager import parse_args
    from torchtitan.train_spec import build_model_args, get_train_spec

    folder.mkdir(parents=True, exist_ok=True)
    config = RUN_CONFIG.format(flavor=flavor, latent_size=latent_size, vae=vae.resolve(), scale=SD_VAE_SCALE)
    (folder / "config.toml").write_text(config)
    torch.manual_seed(seed)
    spec = get_train_spec("dit")
    model = spec.model_cls(build_model_args(spec, parse_args(["--job.config_file", str(folder / "config.toml")])))
    model.init_weights()
    with torch.no_grad():
        for param in model.parameters():
            if not param.any():
                param.normal_(std=ZERO_INIT_STD)
    save_file(model.state_dict(), str(folder / "ema.safetensors.tmp"))
    (folder / "ema.safetensors.tmp").rename(folder / "ema.safetensors")


def write_reference(path: Path, images: int, image_size: int, seed: int) -> None:
    """ADM's reference-batch format with random contents: arr_0 uint8 images, arr_1 labels, Gaussian statistics."""
    rng = np.random.default_rng(seed)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        np.savez(f, arr_0=rng.integers(0, 256, (images, image_size, image_size, 3), dtype=np.uint8),
                 arr_1=np.arange(images) % 1000, mu=rng.normal(size=2048), sigma=np.eye(2048),
                 mu_s=rng.normal(size=SPATIAL_DIMS), sigma_s=np.eye(SPATIAL_DIMS))  # fmt: skip
    tmp.rename(path)


def set_up(args: argparse.Namespace, work: Path) -> None:
    """The fixtures not written yet (a resumed call finds them)."""
    vae = work / "vae"
    if not (vae / "config.json").is_file():
        build_vae({**SD_VAE_CONFIG, "sample_size": args.image_size}, args.seed).save_pretrained(str(vae))
    if not (work / "run" / "ema.safetensors").is_file():
        write_run(work / "run", args.flavor, args.image_size // 8, vae, args.seed)
    if not (work / "inception.pth").is_file():
        write_random_inception(work / "inception.pth", args.seed)
    if not (work / "reference.npz").is_file():
        write_reference(work / "reference.npz", args.reference_images, args.image_size, args.seed)


def commands(args: argparse.Namespace, work: Path) -> dict[str, list[str]]:
    """The two timed phases' command lines."""
    npz = str(work / "samples.npz")
    sample = [*launcher(args.nproc), str(ROOT / "sample.py"), "--checkpoint", str(work / "run"), "--num-samples",
              str(args.num_samples), "--batch-size", str(args.batch_size), "--sampler", args.sampler, "--steps",
              str(args.steps), "--cfg-scale", str(args.cfg_scale), "--compile", "--npz", npz]  # fmt: skip
    evaluate = [sys.executable, str(ROOT / "scripts" / "evaluate_fid.py"), "--samples", npz, "--reference",
                str(work / "reference.npz"), "--inception-weights", str(work / "inception.pth")]  # fmt: skip
    return {"sampling": sample, "evaluation": evaluate}


def summary(times: list[dict]) -> str:
    """Each call's phases, and the sampling and evaluation seconds summed over the calls."""
    lines = ["| call | phase | status | seconds |", "|---|---|---|---|"]
    lines += [f"| {t['call']} | {t['phase']} | {t['status']} | {t['seconds']:.1f} |" for t in times]
    timed = sum(t["seconds"] for t in times if t["phase"] != "setup")
    lines.append(f"sampling + evaluation over {max(t['call'] for t in times)} call(s): {timed:.1f} s "
                 f"(target {TARGET_S} s)")  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    start = time.perf_counter()
    work = args.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    log = work / "times.jsonl"
    times = [json.loads(line) for line in log.read_text().splitlines()] if log.is_file() else []
    call = 1 + max((t["call"] for t in times), default=0)

    def record(phase: str, status: str, seconds: float) -> None:
        times.append({"call": call, "phase": phase, "status": status, "seconds": round(seconds, 1)})
        with open(log, "a") as f:
            f.write(json.dumps(times[-1]) + "\n")
        print(f"call {call}: {phase} {status} in {seconds:.1f} s", flush=True)

    set_up(args, work)
    record("setup", "ok", time.perf_counter() - start)
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_VARS}
    env.update(PYTHONUNBUFFERED="1", TORCHINDUCTOR_CACHE_DIR=str(work / "inductor_cache"))  # kept between calls
    output = ""
    for phase, cmd in commands(args, work).items():
        if phase == "sampling" and (work / "samples.npz").is_file():
            continue  # sampled in an earlier call
        left = args.budget_s - (time.perf_counter() - start)
        if left < 60:
            print(f"{left:.0f} s of --budget-s left: run the same command again to go on", flush=True)
            return RESUME
        status, output, seconds = execute(cmd, env, work / f"{phase}_call{call}.log", left)
        record(phase, status, seconds)
        if status != "ok":
            print(f"{phase} {status}: run the same command again to go on (sample.py resumes from its shards)")
            return RESUME if status == "timeout" else 1
    result = json.loads([line for line in output.splitlines() if line.startswith("{")][-1])  # evaluate_fid's line
    print("  ".join(f"{name} {result[name]}" for name in ("fid", "sfid", "inception_score", "precision", "recall")))
    print(summary(times))
    return 0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, required=True, help="fixtures, shards, samples, logs, times.jsonl")
    parser.add_argument("--nproc", type=int, default=1, help="GPUs (sample.py ranks under torchrun)")
    parser.add_argument("--num-samples", type=int, default=50000)
    parser.add_argument("--batch-size", type=int, default=256, help="samples a batch, a rank (guidance doubles it)")
    parser.add_argument("--sampler", default="euler", choices=("euler", "heun"))
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--cfg-scale", type=float, default=1.5)
    parser.add_argument("--flavor", default="SiT-XL/2", help="our flavor (SiT-XL/2: DiT-XL/2's shapes, a flow)")
    parser.add_argument("--image-size", type=int, default=256, help="pixels (latents: / 8)")
    parser.add_argument("--reference-images", type=int, default=10000, help="ADM's reference batch holds 10,000")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--budget-s", type=float, default=520,
                        help="seconds this call may take, setup included (a 10-minute call: 520 leaves the stop's "
                             "grace)")  # fmt: skip
    return parser.parse_args(argv)


if __name__ == "__main__":
    sys.exit(main())
