"""Warm steady-state training throughput: images/s, TFLOP/s, MFU and peak memory per case.

Each case runs in a fresh process (one OOM cannot poison the next) with the trainer's own
train_step() and the same analytic FLOP formula as the trainer's MFU. Example:

    python scripts/benchmark.py --config train_configs/dit_xl2_latent256.toml \
        --case "bs256=--training.local_batch_size 256" --case "eager=--compile.enable false" --warmup 5 --steps 20
"""

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def profile_steps(trainer, steps: int = 3) -> None:
    """Prints the top CUDA kernels of a few warm steps, where the GPU waited between them, and the memory one
    forward leaves for backward."""
    import torch

    from torchtitan.components.profiling import idle_gaps, kernel_summary

    x, y = next(trainer.dataloader)
    x, y = x.to(trainer.device), y.to(trainer.device)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    losses, _ = trainer.forward_losses(x, y, trainer.step, 0)
    after = torch.cuda.memory_allocated()
    losses.mean().backward()
    trainer.optimizer.zero_grad(set_to_none=True)
    print(f"PROFILE activations kept by one forward: {(after - before) / 1024**3:.2f} GiB "
          f"({(after - before) / x.shape[0] / 1024**2:.1f} MiB per image)", flush=True)  # fmt: skip
    torch.cuda.synchronize()
    start = time.perf_counter()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            trainer.train_step()
        torch.cuda.synchronize()
    print(kernel_summary(prof, steps, 1000 * (time.perf_counter() - start) / steps), flush=True)
    print(idle_gaps(prof, steps), flush=True)


def run_case(train_args: list[str], warmup: int, steps: int, profile: bool = False) -> dict:
    """Builds the trainer in this process, runs warmup + timed steps, returns the measurements."""
    import torch

    import train
    from torchtitan.config_manager import parse_args

    train.init_logger()
    cfg = parse_args([*train_args, "--training.dataset", "dummy", "--checkpoint.enable", "false",
                      "--sampling.freq", "0", "--metrics.enable_tensorboard", "false"])  # fmt: skip
    trainer = train.Trainer(cfg)
    sync = torch.cuda.synchronize if trainer.device.type == "cuda" else (lambda: None)
    start = time.perf_counter()
    for _ in range(warmup):
        trainer.train_step()
    sync()
    warmup_s = time.perf_counter() - start
    if profile and trainer.device.type == "cuda":
        profile_steps(trainer)
    if trainer.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    for _ in range(steps):
        out = trainer.train_step()
    loss = out["loss_sum"].item() / trainer.global_batch  # also a sync point
    sync()
    elapsed = time.perf_counter() - start
    images_per_second = trainer.global_batch * steps / elapsed
    result = {
        "global_batch": trainer.global_batch,
        "images_per_second": images_per_second,
        "step_time_s": elapsed / steps,
        "warmup_s": warmup_s,
        "loss": loss,
        "gflop_per_image": trainer.meter.flops_per_image / 1e9,
    }
    per_gpu = trainer.meter.flops_per_image * images_per_second / trainer.world_size
    result["tflops"] = per_gpu / 1e12
    if trainer.meter.peak_flops:
        result["mfu"] = 100 * per_gpu / trainer.meter.peak_flops
    if trainer.device.type == "cuda":
        result["peak_memory_gib"] = torch.cuda.max_memory_allocated() / 1024**3
        result["device"] = torch.cuda.get_device_name()
    trainer.close()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="TOML config every case starts from")
    parser.add_argument("--case", action="append", default=[], help="NAME=OVERRIDES (train.py flags); repeatable")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--nproc", type=int, default=1, help="processes per case (torchrun)")
    parser.add_argument("--json-out", default="", help="also write the results here")
    parser.add_argument("--profile", action="store_true", help="print each case's top CUDA kernels")
    parser.add_argument("--single", default="", help=argparse.SUPPRESS)  # internal: run one case here
    args = parser.parse_args()
    if args.single:
        result = run_case(shlex.split(args.single), args.warmup, args.steps, args.profile)
        if int(os.environ.get("RANK", "0")) == 0:
            print("BENCHMARK_RESULT " + json.dumps(result), flush=True)
        return
    from torchtitan.tools.batch_size_finder import ran_out_of_memory

    results = []
    for case in args.case or ["default="]:
        name, _, overrides = case.partition("=")
        train_args = ["--job.config_file", args.config, *shlex.split(overrides)]
        launcher = [sys.executable]
        if args.nproc > 1:
            launcher += ["-m", "torch.distributed.run", f"--nproc_per_node={args.nproc}"]
        cmd = [*launcher, __file__, "--config", args.config, "--warmup", str(args.warmup), "--steps",
               str(args.steps), "--single", shlex.join(train_args)]  # fmt: skip
        cmd += ["--profile"] if args.profile else []
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
        lines = [line for line in proc.stdout.splitlines() if line.startswith("BENCHMARK_RESULT ")]
        if proc.returncode != 0 or not lines:
            oom = ran_out_of_memory(proc.stderr)
            results.append({"name": name, "status": "OOM" if oom else f"failed ({proc.returncode})"})
            print(proc.stderr[-3000:], file=sys.stderr)
        else:
            results.append({"name": name, "status": "ok", **json.loads(lines[-1].split(" ", 1)[1])})
        print(json.dumps(results[-1]), flush=True)
        if args.profile:
            print("\n".join(line for line in proc.stdout.splitlines() if not line.startswith("BENCHMARK_RESULT")))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(results, indent=1))
    print(format_table(results))


def format_table(results: list[dict]) -> str:
    header = "| case | batch | images/s | TFLOP/s | MFU % | peak mem GiB | step ms |\n|---|---|---|---|---|---|---|"
    rows = [header]
    for r in results:
        if r["status"] != "ok":
            rows.append(f"| {r['name']} | | {r['status']} | | | | |")
            continue
        mfu = f"{r['mfu']:.1f}" if "mfu" in r else "n/a"
        mem = f"{r['peak_memory_gib']:.1f}" if "peak_memory_gib" in r else "n/a"
        rows.append(f"| {r['name']} | {r['global_batch']} | {r['images_per_second']:.1f} | {r['tflops']:.1f} | "
                    f"{mfu} | {mem} | {1000 * r['step_time_s']:.1f} |")  # fmt: skip
    return "\n".join(rows)


if __name__ == "__main__":
    main()
