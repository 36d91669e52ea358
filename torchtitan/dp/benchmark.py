"""Step time and peak memory of each DP mode against non-private training, on one CUDA GPU.

    python -m torchtitan.dp.benchmark --flavor DiT-L/8 --input-size 256 --in-channels 3 --batch-size 32

Prints one JSON line per mode (bf16 autocast, fused AdamW, a full train step), then one per
norm kernel shape timing the flash kernels against the torch implementations and the layer's
own forward matmul.
"""

import argparse
import dataclasses
import gc
import json
import time

import torch

from torchtitan.components.profiling import kernel_summary
from torchtitan.dp import DP_MODES, DPEngine
from torchtitan.dp import flash_kernels as fk
from torchtitan.models.dit import DiT, dit_configs


def measure_mode(
    model_args, mode: str, batch_size: int, steps: int, warmup: int, profile: bool = False, compile_blocks: bool = False
) -> dict:
    """Times `steps` train steps of one mode after `warmup` ones; first-step norms for cross-checks."""
    torch.manual_seed(0)
    model = DiT(model_args).cuda()
    model.init_weights()
    if compile_blocks:  # per block, as the trainer does, before the engine hooks the model
        for block in model.blocks.values():
            block.compile()
    # The batch size is known, as in the trainer: counting it would make the noise's std a host sync each step.
    engine = DPEngine(model, mode, max_grad_norm=1.0, noise_multiplier=1.0, global_batch_size=batch_size)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    c, size = model_args.in_channels, model_args.input_size
    x = torch.randn(batch_size, c, size, size, device="cuda")
    t = torch.randint(0, 1000, (batch_size,), device="cuda")
    y = torch.randint(0, model_args.num_classes, (batch_size,), device="cuda")

    def train_step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(x, t, y)
        norms = engine.backward((out[:, :c].float() - x).square().mean((1, 2, 3)))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return norms

    first_norms = train_step()
    for _ in range(warmup - 1):
        train_step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    for _ in range(steps):
        train_step()
    torch.cuda.synchronize()
    step_time = (time.perf_counter() - start) / steps
    if profile:
        start = time.perf_counter()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                train_step()
            torch.cuda.synchronize()
        print(f"PROFILE mode {mode}", flush=True)
        print(kernel_summary(prof, 3, 1000 * (time.perf_counter() - start) / 3), flush=True)
    result = {
        "mode": mode,
        "compile": compile_blocks,
        "step_time_s": round(step_time, 4),
        "images_per_second": round(batch_size / step_time, 1),
        "peak_memory_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2),
        "first_norms": None if first_norms is None else [round(v, 4) for v in first_norms[:4].tolist()],
    }
    return result


def measure_norm_kernels(batch_size: int, num_tokens: int, shapes: list[tuple[int, int]]) -> list[dict]:
    """Milliseconds per call of each norm implementation, bf16 inputs, against the layer's forward matmul."""
    from triton.testing import do_bench

    def bench(fn, *args, **kwargs) -> float:
        return round(do_bench(lambda: fn(*args, **kwargs)), 3)

    results = []
    for d, p in shapes:
        a = torch.randn(batch_size, num_tokens, d, device="cuda", dtype=torch.bfloat16)
        g = torch.randn(batch_size, num_tokens, p, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(p, d, device="cuda", dtype=torch.bfloat16)
        row = {"B": batch_size, "T": num_tokens, "d": d, "p": p, "gram_chosen": fk.use_gram_form(num_tokens, d, p)}
        row["forward_matmul_ms"] = bench(torch.matmul, a, w.T)
        row["flash_gram_ms"] = bench(fk._triton_norm_sq, a, g, gram=True)
        row["flash_explicit_ms"] = bench(fk._triton_norm_sq, a, g, gram=False)
        row["torch_gram_ms"] = bench(fk.gram_norm_sq_torch, a, g)
        row["torch_explicit_ms"] = bench(fk.explicit_norm_sq_torch, a, g)
        results.append(row)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--flavor", default="DiT-L/8")
    parser.add_argument("--input-size", type=int, default=256)
    parser.add_argument("--in-channels", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--modes", default=",".join(DP_MODES))
    parser.add_argument("--skip-kernels", action="store_true")
    parser.add_argument("--profile", action="store_true", help="print GPU time by kernel category of each mode")
    parser.add_argument("--compile", action="store_true", help="torch.compile each block")
    args = parser.parse_args()
    model_args = dataclasses.replace(dit_configs[args.flavor], input_size=args.input_size, in_channels=args.in_channels)
    baseline = None
    for mode in args.modes.split(","):
        result = measure_mode(
            model_args,
            mode,
            args.batch_size,
            args.steps,
            args.warmup,
            profile=args.profile,
            compile_blocks=args.compile,
        )
        gc.collect()  # the mode's model and optimizer go before the next one is built
        torch.cuda.empty_cache()
        baseline = baseline or (result if mode == "vanilla" else None)
        if baseline is not None:
            result["time_vs_vanilla"] = round(result["step_time_s"] / baseline["step_time_s"], 3)
            result["memory_vs_vanilla"] = round(result["peak_memory_gib"] / baseline["peak_memory_gib"], 3)
        print(json.dumps(result), flush=True)
    if not args.skip_kernels:
        d = model_args.dim
        shapes = [(d, 3 * d), (d, d), (d, 4 * d), (4 * d, d)]  # qkv, proj, fc1, fc2
        for row in measure_norm_kernels(args.batch_size, model_args.num_tokens, shapes):
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
