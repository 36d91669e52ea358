"""FID sampling throughput, side by side: our `sample.py --npz` against facebookresearch/DiT's own sample_ddp.py.

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

Prints one JSON line per side, then a table (images/s, batch, steps, ours / reference); `--json-out` writes the
rows as a JSON list, as scripts/benchmark.py does. Example (the reference checkout needs models.py, download.py,
sample_ddp.py and diffusion/; timm and diffusers installed):

    python scripts/benchmark_sampling.py --reference-dit build/ref_dit --num-samples 256 --batch 64 --json-out s.json
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
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from scripts.benchmark_opacus_reference import load_reference, reference_load_error  # noqa: E402
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


def write_reference_checkpoint(reference, model: str, latent_size: int, path: Path, seed: int) -> int:
    """A random-weight checkpoint of the reference's `model` (its models.py) in its format: a plain state dict.

    Weights the reference initializes to zero (adaLN-Zero) get normal values of std `ZERO_INIT_STD`. Returns the
    number of parameters.
    """
    torch.manual_seed(seed)
    net = reference.DiT_models[model](input_size=latent_size, num_classes=NUM_CLASSES)
    with torch.no_grad():
        for param in net.parameters():
            if not param.any():
                param.normal_(std=ZERO_INIT_STD)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(net.state_dict(), path)
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
    """sample_ddp.py under torchrun (one process), in the run's setting."""
    return [*TORCHRUN, str(args.reference_dit / "sample_ddp.py"), "--model", args.model, "--vae", "ema",
            "--ckpt", str(checkpoint), "--num-fid-samples", str(args.num_samples), "--per-proc-batch-size",
            str(args.batch), "--num-sampling-steps", str(args.steps), "--cfg-scale", str(args.cfg_scale),
            "--image-size", str(args.image_size), "--global-seed", str(args.seed),
            "--sample-dir", str(sample_dir)]  # fmt: skip


def ours_command(args: argparse.Namespace, checkpoint: Path, vae_dir: Path, npz: Path) -> list[str]:
    """Our sample.py on the reference's checkpoint and VAE, in the run's setting (`--ours-extra` last)."""
    return [sys.executable, str(ROOT / "sample.py"), "--checkpoint", str(checkpoint), "--flavor", args.model,
            "--model.input_size", str(args.image_size // 8), "--npz", str(npz), "--num-samples",
            str(args.num_samples), "--batch-size", str(args.batch), "--steps", str(args.steps), "--cfg-scale",
            str(args.cfg_scale), "--guidance-channels", "3", "--sampler", "default", "--seed", str(args.seed),
            "--latent.tokenizer", "diffusers", "--latent.checkpoint_dir", str(vae_dir), "--latent.scale_factor",
            str(SD_VAE_SCALE), *shlex.split(args.ours_extra)]  # fmt: skip


def execute(cmd: list[str], env: dict, log: Path, timeout: float | None) -> tuple[str, str, float]:
    """Runs `cmd` from the repository root; writes its output to `log`. Returns (status, output, wall seconds)."""
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
    """The setting both sides run in (one GPU: the batch is the global batch)."""
    return {"model": args.model, "image_size": args.image_size, "num_samples": args.num_samples, "batch": args.batch,
            "global_batch": args.batch, "steps": args.steps, "cfg_scale": args.cfg_scale}  # fmt: skip


def measure_reference(args: argparse.Namespace, work: Path, checkpoint: Path) -> dict:
    """sample_ddp.py's steady-state images/s from its PNGs' modification times."""
    sample_dir = work / "reference_samples"
    shutil.rmtree(sample_dir, ignore_errors=True)  # a kept work folder's earlier PNGs would count
    cmd = reference_command(args, checkpoint, sample_dir)
    status, _, wall = execute(cmd, hub_env(work / "hf"), work / "reference.log", args.timeout)
    row = {
        "name": args.reference_name,
        "side": "reference",
        "status": status,
        **setting(args),
        "timing": "png_mtime",
        "wall_s": wall,
    }
    if status == "ok":
        try:
            row.update(png_rate(sample_dir, args.batch))
        except ValueError as e:
            row["status"] = f"failed ({e})"
    return row


def measure_ours(args: argparse.Namespace, work: Path, checkpoint: Path, vae_dir: Path) -> dict:
    """sample.py's images/s after its first batch, from the line it prints (else its wall time, with a warning)."""
    cmd = ours_command(args, checkpoint, vae_dir, work / "ours.npz")
    status, output, wall = execute(cmd, hub_env(work / "hf"), work / "ours.log", args.timeout)
    row = {
        "name": args.ours_name,
        "side": "ours",
        "status": status,
        **setting(args),
        "extra": args.ours_extra,
        "wall_s": wall,
    }
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
    parser.add_argument("--reference-dit", type=Path, required=True,
                        help="a facebookresearch/DiT checkout (with sample_ddp.py)")  # fmt: skip
    parser.add_argument("--model", default="DiT-XL/2", help="a key of the reference's DiT_models, our flavor")
    parser.add_argument("--image-size", type=int, choices=[256, 512], default=256, help="pixels (latents: / 8)")
    parser.add_argument("--num-samples", type=int, default=256, help="images per side, a multiple of --batch")
    parser.add_argument("--batch", type=int, default=64, help="images per sampling batch, on both sides")
    parser.add_argument("--steps", type=int, default=250, help="DDPM sampling steps")
    parser.add_argument("--cfg-scale", type=float, default=1.5, help="classifier-free guidance scale")
    parser.add_argument("--seed", type=int, default=0, help="weights' and samplers' seed")
    parser.add_argument("--ours-extra", default="", help="more sample.py flags, one string: --ours-extra=--compile")
    parser.add_argument("--ours-name", default="ours_sample_py", help="our row's name")
    parser.add_argument("--reference-name", default="reference_sample_ddp", help="the reference's row's name")
    parser.add_argument("--skip-reference", action="store_true", help="run ours only")
    parser.add_argument("--skip-ours", action="store_true", help="run the reference only")
    parser.add_argument(
        "--keep-work",
        type=Path,
        help="work here and keep it (checkpoint, VAE, samples, logs); default: a temporary folder",
    )
    parser.add_argument("--timeout", type=float, help="seconds each side may take")
    parser.add_argument("--json-out", type=Path, help="also write the rows here (a JSON list)")
    return parser.parse_args(argv)


def check_args_and_load_reference(args: argparse.Namespace):
    """The reference's models.py module; raises ValueError (or FileNotFoundError, ImportError) naming the flag."""
    if args.batch <= 0:
        raise ValueError(f"--batch {args.batch}: must be > 0")
    if args.num_samples < 2 * args.batch or args.num_samples % args.batch:
        raise ValueError(f"--num-samples {args.num_samples}: must be a multiple of --batch {args.batch}, at least "
                         "two batches (the first batch is not timed)")  # fmt: skip
    if args.steps <= 0 or args.cfg_scale < 1:
        raise ValueError(f"--steps {args.steps} must be > 0 and --cfg-scale {args.cfg_scale} >= 1 (the reference's)")
    sample_ddp = args.reference_dit / "sample_ddp.py"
    if not args.skip_reference and not sample_ddp.is_file():
        raise FileNotFoundError(sample_ddp)
    reference = load_reference(args.reference_dit)
    if args.model not in reference.DiT_models:
        raise ValueError(f"--model {args.model!r} is not in the reference's DiT_models: {sorted(reference.DiT_models)}")
    return reference


def run(args: argparse.Namespace, reference, work: Path) -> list[dict]:
    """Writes the checkpoint and the VAE into `work`, then measures each side not skipped."""
    checkpoint = work / f"{args.model.replace('/', '-')}-random.pt"
    params = write_reference_checkpoint(reference, args.model, args.image_size // 8, checkpoint, args.seed)
    print(f"wrote {checkpoint} ({params / 1e6:.0f}M parameters, random)", flush=True)
    vae_dir = write_hub_snapshot(work / "hf" / "hub", SD_VAE_REPO, build_vae(SD_VAE_CONFIG, args.seed))
    print(f"wrote a random-weight {SD_VAE_REPO} into {vae_dir}", flush=True)
    rows = []
    if not args.skip_reference:
        rows.append(measure_reference(args, work, checkpoint))
        print(json.dumps(rows[-1]), flush=True)
    if not args.skip_ours:
        rows.append(measure_ours(args, work, checkpoint, vae_dir))
        add_ratios(rows)
        print(json.dumps(rows[-1]), flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        reference = check_args_and_load_reference(args)
    except (FileNotFoundError, ImportError) as e:
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
