"""The DP engine's per-sample norm kernels timed alone, against the torch implementations of the same maths and
the layer's own forward matmul, at a flavor's block shapes (qkv, proj, fc1, fc2); one CUDA GPU.

    python scripts/benchmarks/benchmark_dp_kernels.py --flavor DiT-L/8 --input-size 256 --batch-size 32

A kernel micro-benchmark. Step times and memory of DP-SGD come from the trainer's step, as scripts/benchmark.py
cases (e.g. --case "fbk=--dp.enable true --dp.mode flash_bookkeeping").
"""

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from torchtitan.dp import flash_kernels as fk  # noqa: E402
from torchtitan.models.dit import dit_configs  # noqa: E402


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
    args = parser.parse_args()
    model_args = dataclasses.replace(dit_configs[args.flavor], input_size=args.input_size, in_channels=args.in_channels)
    d = model_args.dim
    shapes = [(d, 3 * d), (d, d), (d, 4 * d), (4 * d, d)]  # qkv, proj, fc1, fc2
    for row in measure_norm_kernels(args.batch_size, model_args.num_tokens, shapes):
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
