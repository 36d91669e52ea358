"""FID sampling throughput, side by side: our `sample.py --npz` against facebookresearch/DiT's own sample_ddp.py
(`--reference-dit`) or sihyun-yu/REPA's generate.py (`--reference-repa`).

The DiT paper's FID setting on one GPU: DiT-XL/2 at 256 px (32 x 32 x 4 latents), 250 DDPM steps, classifier-free
guidance 1.5 on the first 3 latent channels, each batch decoded through the SD-VAE (sd-vae-ft-ema), random weights
on both sides. In a work folder the script writes
- a random-weight checkpoint in the reference's format, built by the reference checkout's own models.py
  (`DiT_models[model](input_size, num_classes)`, its state dict through torch.save). The reference zero-initializes
  the adaLN modulations and the final layer (adaLN-Zero), which leaves a model whose every output is zero; those
  get random values too (normal, std 0.02), so that every matmul sees the non-zero operands of a trained model (a
  GPU's clock, hence its speed, depends on the data it multiplies);
- a random-weight diffusers `AutoencoderKL` of SD-VAE's architecture (`SD_VAE_CONFIG`), saved in a Hugging Face
  cache layout (models--stabilityai--sd-vae-ft-ema/snapshots/<hash>/ and refs/main), so that the reference's
  `AutoencoderKL.from_pretrained("stabilityai/sd-vae-ft-ema")` finds it with HF_HUB_OFFLINE=1; the snapshot
  folder is also our `--latent.tokenizer diffusers` folder. diffusers is imported only here, at run time.

Then it runs, one after the other on the same GPU, each in processes of its own:
1. the reference: `torchrun --standalone --nproc_per_node 1 sample_ddp.py --ckpt ... --num-fid-samples N
   --per-proc-batch-size B ...` (TF32 on, fp32 weights and VAE, one PNG per sample, an .npz at the end, as it
   runs). Its steady-state rate comes from the PNG files' modification times: the samples after the first batch
   over the time from the first batch's last PNG to the last PNG, (count - B) / (last - first batch's last). Model
   loading, warm-up and the final .npz are left out; every timed batch includes its PNG writes, which are part of
   the reference's per-batch work.
2. ours: `python sample.py --checkpoint CKPT --flavor MODEL --npz ... --guidance-channels 3 --sampler default`
   with the same N, B, steps, guidance scale and VAE (`--latent.scale_factor 0.18215`, the reference's
   `samples / 0.18215`), plus `--ours-extra` (e.g. `--ours-extra=--compile`: a lone flag needs the `=`). Its
   rate is the one sample.py prints, `sampling: {n} images after the first batch in {seconds:.2f} s: {rate:.2f}
   images/s` (also after the first batch); without that line the wall time of the whole process stands in (model
   loading included), with a warning.

With `--reference-repa` the reference is REPA's generate.py, in its README's FID setting by default: SiT-XL/2 with
one DINOv2-B projector (`--projector-embed-dims 768`, encoder depth 8), `--mode sde --num-steps 250 --cfg-scale 1.8
--guidance-high 0.7`, its SD-VAE `--vae ema` and TF32, a random-weight checkpoint written by its own models/sit.py
as `{"ema": state dict}` (what generate.py reads; adaLN-Zero made random as above). Ours samples that file as REPA's
(`--flavor SiT-XL/2`) with the same sampler and number of model calls (`--sampler sde --steps N`; `--mode ode` is
`--sampler euler`, with `--heun` `--sampler heun`), the same guidance (all channels, inside the same
`--guidance-low`/`--guidance-high`) and batch. generate.py writes a PNG per sample too: its rate comes from them
as sample_ddp.py's does. `--reference-extra` adds flags to the reference's command (generate.py runs without fused
attention unless given `--reference-extra=--fused-attn`, as its README runs it).

`--gpus A,B` runs the reference on GPU A and ours on GPU B at the same time (each process sees one GPU through
CUDA_VISIBLE_DEVICES), as the issue's comparison asks: each on its own GPU of one host, in one call. Without it the
two run one after the other on the default GPU.

Prints one JSON line per side, then a table (images/s, batch, steps, ours / reference); `--json-out` writes the
rows as a JSON list, as scripts/benchmark.py does. Examples (the DiT checkout needs models.py, download.py,
sample_ddp.py and diffusion/; REPA's generate.py, samplers.py, utils.py, models/; timm, torchvision and diffusers
installed):

    python scripts/benchmarks/benchmark_sampling.py --reference-dit build/ref_dit --num-samples 256 --batch 64 \
        --json-out s.json
    python scripts/benchmarks/benchmark_sampling.py --reference-repa build/ref_repa --gpus 0,1 --num-samples 512 \
        --batch 64 --ours-extra=--compile --json-out repa.json
"""

import argparse
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from scripts.benchmarks.benchmark_opacus_reference import load_reference, reference_load_error  # noqa: E402
from scripts.benchmarks.benchmark_reference_repa import load_error as repa_load_error  # noqa: E402
from scripts.benchmarks.benchmark_reference_repa import load_repa  # noqa: E402
from torchtitan.tools.runs import TORCHRUN_VARS, run_to_end, status_of  # noqa: E402

SD_VAE_REPO = "stabilityai/sd-vae-ft-ema"  # sample_ddp.py's default `--vae ema`
# stabilityai/sd-vae-ft-ema's config.json (diffusers AutoencoderKL): 8x downsampling to 4 latent channels.
SD_VAE_CONFIG = {
    "act_fn": "silu",
    "block_out_channels": [128, 256, 512, 512],
    "down_block_types": ["DownEncoderBlock2D"] * 4,
    "in_channels": 3,
    "latent_channels": 4,
    "layers_per_block": 2,
    "norm_num_groups": 32,
    "out_channels": 3,
    "sample_size": 256,
    "up_block_types": ["UpDecoderBlock2D"] * 4,
}
SD_VAE_SCALE = 0.18215  # the reference decodes `samples / 0.18215`
SNAPSHOT = "5a0f6f8e2b1c4d3e9f7a6b5c4d3e2f1a0b9c8d7e"  # any 40-hex commit: refs/main names it
NUM_CLASSES = 1000
ZERO_INIT_STD = 0.02  # random values for the reference's zero-initialized (adaLN-Zero) weights
OURS_LINE = re.compile(r"sampling: (\d+) images after the first batch in ([0-9.]+) s: ([0-9.]+) images/s")
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1"]
# Each reference's FID setting, the defaults of its mode (DiT's sample_ddp.py; REPA's README command).
DEFAULTS = {
    "dit": {"model": "DiT-XL/2", "cfg_scale": 1.5, "guidance_low": 0.0, "guidance_high": 1.0, "mode": "ddpm"},
    "repa": {"model": "SiT-XL/2", "cfg_scale": 1.8, "guidance_low": 0.0, "guidance_high": 0.7, "mode": "sde"},
}
REPA_Z_DIMS, REPA_ENCODER_DEPTH = [768], 8  # its README's --projector-embed-dims=768 --encoder-depth=8


def write_reference_checkpoint(args: argparse.Namespace, reference, path: Path) -> int:
    """A random-weight checkpoint of the reference's `--model` (its own models.py or models/sit.py) in the format its
    sampling script reads: a plain state dict (DiT), `{"ema": state dict}` (REPA's generate.py).

    Weights the reference initializes to zero (adaLN-Zero) get normal values of std `ZERO_INIT_STD`. Returns the
    number of parameters.
    """
    torch.manual_seed(args.seed)
    latent_size = args.image_size // 8
    if args.reference_repa:  # as generate.py builds it (fused_attn changes no parameter)
        net = reference.SiT_models[args.model](input_size=latent_size, num_classes=NUM_CLASSES, use_cfg=True,
                                               z_dims=REPA_Z_DIMS, encoder_depth=REPA_ENCODER_DEPTH, fused_attn=False,
                                               qk_norm=False)  # fmt: skip
    else:
        net = reference.DiT_models[args.model](input_size=latent_size, num_classes=NUM_CLASSES)
    with torch.no_grad():
        for param in net.parameters():
            if not param.any():
                param.normal_(std=ZERO_INIT_STD)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"ema": net.state_dict()} if args.reference_repa else net.state_dict(), path)
    return sum(p.numel() for p in net.parameters())


def build_vae(config: dict, seed: int):
    """A random-weight diffusers AutoencoderKL of `config` (diffusers imported here: it is a run-time need only)."""
    from diffusers import AutoencoderKL

    torch.manual_seed(seed)
    return AutoencoderKL(**config)


def write_hub_snapshot(hub_cache: Path, repo_id: str, model) -> Path:
    """`model.save_pretrained` into a Hugging Face cache layout: hub_cache/models--{org}--{name}/snapshots/<hash>/
    with refs/main naming <hash>, which `from_pretrained(repo_id)` resolves offline. Returns the snapshot folder."""
    repo = hub_cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / SNAPSHOT
    model.save_pretrained(str(snapshot))
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / "main").write_text(SNAPSHOT)
    return snapshot


def hub_env(hub_home: Path) -> dict[str, str]:
    """This process's environment with the Hugging Face cache at `hub_home`, offline, outside any torchrun group."""
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_VARS}
    hub = str(hub_home / "hub")
    env.update({"HF_HOME": str(hub_home), "HF_HUB_CACHE": hub, "HUGGINGFACE_HUB_CACHE": hub, "HF_HUB_OFFLINE": "1",
                "PYTHONUNBUFFERED": "1"})  # fmt: skip
    return env


def png_rate(folder: Path, batch: int) -> dict:
    """Steady-state images/s from the modification times of the PNGs under `folder`: the samples after the first
    batch over the time from the first batch's last PNG to the last one.

    Raises:
        ValueError: no more than one batch of PNGs.
    """
    mtimes = sorted(p.stat().st_mtime_ns for p in folder.rglob("*.png"))
    if len(mtimes) <= batch:
        raise ValueError(f"{len(mtimes)} PNG(s) under {folder}: a rate needs more than one batch of {batch}")
    seconds = (mtimes[-1] - mtimes[batch - 1]) / 1e9
    timed = len(mtimes) - batch
    return {"images": len(mtimes), "timed_images": timed, "timed_s": seconds, "images_per_second": timed / seconds}


def parse_sampling_line(output: str) -> dict | None:
    """sample.py's last `sampling: {n} images after the first batch in {s} s: {rate} images/s` line, or None."""
    matches = OURS_LINE.findall(output)
    if not matches:
        return None
    images, seconds, rate = matches[-1]
    return {"timed_images": int(images), "timed_s": float(seconds), "images_per_second": float(rate)}


def reference_command(args: argparse.Namespace, checkpoint: Path, sample_dir: Path) -> list[str]:
    """sample_ddp.py or generate.py under torchrun (one process), in the run's setting (`--reference-extra` last)."""
    common = ["--vae", "ema", "--ckpt", str(checkpoint), "--num-fid-samples", str(args.num_samples),
              "--per-proc-batch-size", str(args.batch), "--cfg-scale", str(args.cfg_scale), "--global-seed",
              str(args.seed), "--sample-dir", str(sample_dir), "--model", args.model]  # fmt: skip
    extra = shlex.split(args.reference_extra)
    if not args.reference_repa:
        return [*TORCHRUN, str(args.reference_dit / "sample_ddp.py"), *common, "--num-sampling-steps", str(args.steps),
                "--image-size", str(args.image_size), *extra]  # fmt: skip
    return [*TORCHRUN, str(args.reference_repa / "generate.py"), *common, "--resolution", str(args.image_size),
            "--num-classes", str(NUM_CLASSES), "--projector-embed-dims", ",".join(map(str, REPA_Z_DIMS)),
            "--encoder-depth", str(REPA_ENCODER_DEPTH), "--path-type", "linear", "--mode", args.mode, "--num-steps",
            str(args.steps), "--heun" if args.heun else "--no-heun", "--guidance-low", str(args.guidance_low),
            "--guidance-high", str(args.guidance_high), *extra]  # fmt: skip


def ours_sampler_flags(args: argparse.Namespace) -> list[str]:
    """sample.py's sampler and guidance as the reference's: DiT's on 3 channels; REPA's on all of them, inside its
    interval, with the same sampler and so the same model calls."""
    if not args.reference_repa:
        return ["--guidance-channels", "3", "--sampler", "default"]
    sampler = "sde" if args.mode == "sde" else "heun" if args.heun else "euler"
    return ["--guidance-channels", "-1", "--sampler", sampler, "--guidance-low", str(args.guidance_low),
            "--guidance-high", str(args.guidance_high)]  # fmt: skip


def ours_command(args: argparse.Namespace, checkpoint: Path, vae_dir: Path, npz: Path) -> list[str]:
    """Our sample.py on the reference's checkpoint and VAE, in the run's setting (`--ours-extra` last)."""
    return [sys.executable, str(ROOT / "sample.py"), "--checkpoint", str(checkpoint), "--flavor", args.model,
            "--model.input_size", str(args.image_size // 8), "--npz", str(npz), "--num-samples",
            str(args.num_samples), "--batch-size", str(args.batch), "--steps", str(args.steps), "--cfg-scale",
            str(args.cfg_scale), *ours_sampler_flags(args), "--seed", str(args.seed),
            "--latent.tokenizer", "diffusers", "--latent.checkpoint_dir", str(vae_dir), "--latent.scale_factor",
            str(SD_VAE_SCALE), *shlex.split(args.ours_extra)]  # fmt: skip


def execute(cmd: list[str], env: dict, log: Path, timeout: float | None,
            gpu: str | None = None) -> tuple[str, str, float]:  # fmt: skip
    """Runs `cmd` from the repository root (seeing only GPU `gpu` when given); writes its output to `log`. Returns
    (status, output, wall seconds)."""
    if gpu is not None:
        env = {**env, "CUDA_VISIBLE_DEVICES": gpu}
    start = time.perf_counter()
    try:
        proc = run_to_end(cmd, timeout, ROOT, env)
        status, output = status_of(proc.returncode, proc.stdout + proc.stderr), proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as e:
        status, output = "timeout", (e.stdout or "") + (e.stderr or "")
    wall = time.perf_counter() - start
    log.write_text(output)
    if status != "ok":
        print(f"{log.name}: {status}; its end:\n{output[-3000:]}", file=sys.stderr)
    return status, output, wall


def setting(args: argparse.Namespace) -> dict:
    """The setting both sides run in (one GPU each: the batch is the global batch)."""
    row = {"model": args.model, "image_size": args.image_size, "num_samples": args.num_samples, "batch": args.batch,
           "global_batch": args.batch, "steps": args.steps, "cfg_scale": args.cfg_scale}  # fmt: skip
    if args.reference_repa:
        row.update(mode=args.mode, heun=args.heun, guidance_low=args.guidance_low, guidance_high=args.guidance_high)
    return row


def side_row(args: argparse.Namespace, side: str, status: str, gpu: str | None, wall: float) -> dict:
    """The row of one side ("reference" or "ours"): its name, status, the shared setting, its extra flags, GPU, wall."""
    return {"name": getattr(args, f"{side}_name"), "side": side, "status": status, **setting(args),
            "extra": getattr(args, f"{side}_extra"), "gpu": gpu, "wall_s": wall}  # fmt: skip


def measure_reference(args: argparse.Namespace, work: Path, checkpoint: Path, gpu: str | None = None) -> dict:
    """The reference script's steady-state images/s from its PNGs' modification times."""
    sample_dir = work / "reference_samples"
    shutil.rmtree(sample_dir, ignore_errors=True)  # a kept work folder's earlier PNGs would count
    cmd = reference_command(args, checkpoint, sample_dir)
    status, _, wall = execute(cmd, hub_env(work / "hf"), work / "reference.log", args.timeout, gpu)
    row = side_row(args, "reference", status, gpu, wall) | {"timing": "png_mtime"}
    if status == "ok":
        try:
            row.update(png_rate(sample_dir, args.batch))
        except ValueError as e:
            row["status"] = f"failed ({e})"
    return row


def measure_ours(args: argparse.Namespace, work: Path, checkpoint: Path, vae_dir: Path, gpu: str | None = None) -> dict:
    """sample.py's images/s after its first batch, from the line it prints (else its wall time, with a warning)."""
    cmd = ours_command(args, checkpoint, vae_dir, work / "ours.npz")
    status, output, wall = execute(cmd, hub_env(work / "hf"), work / "ours.log", args.timeout, gpu)
    row = side_row(args, "ours", status, gpu, wall)
    if status != "ok":
        return row
    rate, timing = parse_sampling_line(output), "sampling_line"
    if rate is None:
        print("warning: sample.py printed no 'sampling: {n} images after the first batch in {s} s: {rate} images/s' "
              f"line: ours is timed by its wall time, {args.num_samples} images in {wall:.1f} s (model loading and "
              "warm-up included)", file=sys.stderr)  # fmt: skip
        rate = {"timed_images": args.num_samples, "timed_s": wall, "images_per_second": args.num_samples / wall}
        timing = "wall_time"
    row.update(timing=timing, **rate)
    return row


def add_ratios(rows: list[dict]) -> None:
    """Each measured row of ours gets `ratio_to_reference`: its images/s over the reference's."""
    reference = next((r for r in rows if r["side"] == "reference" and r["status"] == "ok"), None)
    for row in rows:
        if reference is not None and row["side"] == "ours" and row["status"] == "ok":
            row["ratio_to_reference"] = row["images_per_second"] / reference["images_per_second"]


def sampling_table(rows: list[dict]) -> str:
    """| case | images/s | batch | steps | ours / reference |"""
    lines = ["| case | images/s | batch | steps | ours / reference |", "|---|---|---|---|---|"]
    for r in rows:
        rate = f"{r['images_per_second']:.2f}" if r["status"] == "ok" else r["status"]
        ratio = f"{r['ratio_to_reference']:.2f}" if "ratio_to_reference" in r else ""
        lines.append(f"| {r['name']} | {rate} | {r['batch']} | {r['steps']} | {ratio} |")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    references = parser.add_mutually_exclusive_group(required=True)
    references.add_argument("--reference-dit", type=Path, help="a facebookresearch/DiT checkout (with sample_ddp.py)")
    references.add_argument("--reference-repa", type=Path, help="a sihyun-yu/REPA checkout (with generate.py)")
    parser.add_argument("--model", help="a key of the reference's DiT_models or SiT_models, our flavor (default: "
                                        "DiT-XL/2, SiT-XL/2)")  # fmt: skip
    parser.add_argument("--image-size", type=int, choices=[256, 512], default=256, help="pixels (latents: / 8)")
    parser.add_argument("--num-samples", type=int, default=256, help="images per side, a multiple of --batch")
    parser.add_argument("--batch", type=int, default=64, help="images per sampling batch, on both sides")
    parser.add_argument("--steps", type=int, default=250, help="sampling steps (REPA's --num-steps)")
    parser.add_argument("--cfg-scale", type=float, help="classifier-free guidance scale (default: 1.5, REPA's 1.8)")
    repa = parser.add_argument_group("REPA's generate.py (--reference-repa) only")
    repa.add_argument("--mode", choices=("sde", "ode"), help="its sampler (default: sde)")
    repa.add_argument("--heun", action="store_true", help="its ODE with Heun steps")
    repa.add_argument("--guidance-low", type=float, help="guidance only at t >= this (default 0)")
    repa.add_argument("--guidance-high", type=float, help="... and t <= this (default 0.7, its README's)")
    parser.add_argument("--gpus", help="'A,B': the reference on GPU A and ours on GPU B, at the same time")
    parser.add_argument("--seed", type=int, default=0, help="weights' and samplers' seed")
    parser.add_argument("--ours-extra", default="", help="more sample.py flags, one string: --ours-extra=--compile")
    parser.add_argument("--reference-extra", default="", help="more flags of the reference's script, one string")
    parser.add_argument("--ours-name", default="ours_sample_py", help="our row's name")
    parser.add_argument("--reference-name", help="the reference's row's name")
    parser.add_argument("--skip-reference", action="store_true", help="run ours only")
    parser.add_argument("--skip-ours", action="store_true", help="run the reference only")
    parser.add_argument(
        "--keep-work",
        type=Path,
        help="work here and keep it (checkpoint, VAE, samples, logs); default: a temporary folder",
    )
    parser.add_argument("--timeout", type=float, help="seconds each side may take")
    parser.add_argument("--json-out", type=Path, help="also write the rows here (a JSON list)")
    args = parser.parse_args(argv)
    given = [key for key in ("mode", "guidance_low", "guidance_high") if getattr(args, key) is not None]
    args.repa_flags = [f"--{key.replace('_', '-')}" for key in given] + (["--heun"] if args.heun else [])
    for key, value in DEFAULTS["repa" if args.reference_repa else "dit"].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    default_name = "reference_generate" if args.reference_repa else "reference_sample_ddp"
    args.reference_name = args.reference_name or default_name
    return args


def check_args(args: argparse.Namespace) -> None:
    """Raises ValueError naming the flag of a setting the two sides cannot share."""
    if args.batch <= 0:
        raise ValueError(f"--batch {args.batch}: must be > 0")
    if args.num_samples < 2 * args.batch or args.num_samples % args.batch:
        raise ValueError(f"--num-samples {args.num_samples}: must be a multiple of --batch {args.batch}, at least "
                         "two batches (the first batch is not timed)")  # fmt: skip
    if args.steps <= 0 or args.cfg_scale < 1:
        raise ValueError(f"--steps {args.steps} must be > 0 and --cfg-scale {args.cfg_scale} >= 1 (the reference's)")
    if args.reference_dit and args.repa_flags:
        raise ValueError(f"{' '.join(args.repa_flags)}: REPA's generate.py settings (--reference-repa); sample_ddp.py "
                         "samples DDPM, guided at every step")  # fmt: skip
    if args.heun and args.mode == "sde":
        raise ValueError("--heun: REPA's ODE (--mode ode) takes Heun steps, its SDE Euler-Maruyama ones")
    if not 0 <= args.guidance_low < args.guidance_high <= 1:
        raise ValueError(f"--guidance-low {args.guidance_low} --guidance-high {args.guidance_high}: must have "
                         "0 <= low < high <= 1")  # fmt: skip
    if args.mode == "sde" and args.steps < 2:
        raise ValueError(f"--steps {args.steps}: the SDE takes at least 2 (its last step is a step of its own)")
    if args.gpus is not None:
        gpus = args.gpus.split(",")
        if len(gpus) != 2 or len(set(gpus)) != 2 or not all(g.strip() for g in gpus):
            raise ValueError(f"--gpus {args.gpus!r}: two different GPUs, 'A,B' (the reference's, ours)")
        args.gpus = [g.strip() for g in gpus]


def load_checkout(args: argparse.Namespace):
    """The reference's models module (DiT's models.py, REPA's models/sit.py) after its script is found; raises
    FileNotFoundError or ImportError, or ValueError for a model it does not have."""
    folder = args.reference_repa or args.reference_dit
    script = folder / ("generate.py" if args.reference_repa else "sample_ddp.py")
    if not args.skip_reference and not script.is_file():
        raise FileNotFoundError(script)
    reference = load_repa(folder)[0] if args.reference_repa else load_reference(folder)
    models = reference.SiT_models if args.reference_repa else reference.DiT_models
    if args.model not in models:
        name = "SiT_models" if args.reference_repa else "DiT_models"
        raise ValueError(f"--model {args.model!r} is not in the reference's {name}: {sorted(models)}")
    return reference


def run(args: argparse.Namespace, reference, work: Path) -> list[dict]:
    """Writes the checkpoint and the VAE into `work`, then measures each side not skipped: one after the other, or
    with `--gpus` at the same time, each on its own GPU."""
    checkpoint = work / f"{'repa-' if args.reference_repa else ''}{args.model.replace('/', '-')}-random.pt"
    params = write_reference_checkpoint(args, reference, checkpoint)
    print(f"wrote {checkpoint} ({params / 1e6:.0f}M parameters, random)", flush=True)
    vae_dir = write_hub_snapshot(work / "hf" / "hub", SD_VAE_REPO, build_vae(SD_VAE_CONFIG, args.seed))
    print(f"wrote a random-weight {SD_VAE_REPO} into {vae_dir}", flush=True)
    gpus = args.gpus or [None, None]
    sides = []
    if not args.skip_reference:
        sides.append(lambda: measure_reference(args, work, checkpoint, gpus[0]))
    if not args.skip_ours:
        sides.append(lambda: measure_ours(args, work, checkpoint, vae_dir, gpus[1]))
    if args.gpus:
        with ThreadPoolExecutor(max_workers=len(sides)) as pool:
            rows = list(pool.map(lambda side: side(), sides))
    else:
        rows = [side() for side in sides]
    add_ratios(rows)
    for row in rows:
        print(json.dumps(row), flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        check_args(args)
        reference = load_checkout(args)
    except (FileNotFoundError, ImportError) as e:
        if args.reference_repa:
            print(repa_load_error(args.reference_repa, e), file=sys.stderr)
        else:
            print(reference_load_error(args.reference_dit, e), file=sys.stderr)
        return 2
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        if args.keep_work:
            args.keep_work.mkdir(parents=True, exist_ok=True)
            rows = run(args, reference, args.keep_work)
        else:
            with tempfile.TemporaryDirectory(prefix="benchmark_sampling_") as work:
                rows = run(args, reference, Path(work))
    except ImportError as failed:  # diffusers, for the VAE
        print(f"error: building the SD-VAE needs diffusers: {failed}", file=sys.stderr)
        return 2
    print(sampling_table(rows), flush=True)
    if args.json_out:
        args.json_out.write_text(json.dumps(rows, indent=1))
    return 0 if all(r["status"] == "ok" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
