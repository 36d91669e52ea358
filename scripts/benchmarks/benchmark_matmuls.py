"""The matmul floor of a DiT training step: each block GEMM (forward, input gradient, weight gradient) and
attention timed alone at the flavor's shapes, summed over the depth, against the analytic FLOP count.

It answers "how fast could a step be if everything but the matmuls and attention were free": the MFU ceiling
for a flavor and batch on this GPU, before any pointwise op, optimizer step or launch gap.

python scripts/benchmarks/benchmark_matmuls.py --flavor DiT-XL/2 --batch 128
"""

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from torchtitan.models.dit import dit_configs, flops_per_image  # noqa: E402
from torchtitan.tools.utils import device_peak_flops  # noqa: E402


def time_ms(fn, iters: int = 20) -> float:
    """Median of event-timed runs after warm-up."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def block_linears(args) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of each token-wise Linear in one block."""
    fc1_out = 2 * args.mlp_hidden_dim if args.mlp == "swiglu" else args.mlp_hidden_dim
    return {"qkv": (args.dim, 3 * args.dim), "proj": (args.dim, args.dim), "fc1": (args.dim, fc1_out),
            "fc2": (args.mlp_hidden_dim, args.dim)}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--flavor", default="DiT-XL/2")
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--backend", default="cudnn", choices=["cudnn", "flash", "efficient"])
    args = parser.parse_args()
    model_args = dit_configs[args.flavor]
    tokens, depth, dtype = args.batch * model_args.num_tokens, model_args.depth, torch.bfloat16
    rows, total_ms = [], 0.0
    for name, (d_in, d_out) in block_linears(model_args).items():
        x = torch.randn(tokens, d_in, device="cuda", dtype=dtype)
        w = torch.randn(d_out, d_in, device="cuda", dtype=dtype)
        g = torch.randn(tokens, d_out, device="cuda", dtype=dtype)
        flop = 2 * tokens * d_in * d_out
        for kind, (lhs, rhs) in (("forward", (x, w.t())), ("input grad", (g, w)), ("weight grad", (g.t(), x))):
            ms = time_ms(lambda lhs=lhs, rhs=rhs: lhs @ rhs)
            total_ms += depth * ms
            rows.append(f"| {name} {kind} | {tokens}x{d_in}x{d_out} | {ms:.3f} | {flop / ms / 1e9:.0f} |")
    heads, hd = model_args.num_heads, model_args.head_dim
    shape = (args.batch, heads, model_args.num_tokens, hd)
    q, k, v = (torch.randn(shape, device="cuda", dtype=dtype, requires_grad=True) for _ in range(3))
    grad = torch.randn(shape, device="cuda", dtype=dtype)
    backend = {"cudnn": torch.nn.attention.SDPBackend.CUDNN_ATTENTION,
               "flash": torch.nn.attention.SDPBackend.FLASH_ATTENTION,
               "efficient": torch.nn.attention.SDPBackend.EFFICIENT_ATTENTION}[args.backend]  # fmt: skip
    with torch.nn.attention.sdpa_kernel([backend]):
        ms = time_ms(lambda: torch.autograd.grad(F.scaled_dot_product_attention(q, k, v), (q, k, v), grad))
    attention_flop = 4 * args.batch * heads * model_args.num_tokens**2 * hd * 3  # forward x 3, as the MFU formula
    total_ms += depth * ms
    rows.append(f"| attention fwd+bwd ({args.backend}) | {shape} | {ms:.3f} | {attention_flop / ms / 1e9:.0f} |")
    step_flop = flops_per_image(model_args) * args.batch
    peak = device_peak_flops(torch.device("cuda"))
    print(f"{args.flavor}, batch {args.batch}, {torch.cuda.get_device_name()}: block matmuls + attention")
    print("| op | shape | ms | TFLOP/s |\n|---|---|---|---|\n" + "\n".join(rows))
    ceiling = step_flop / (total_ms / 1000)
    mfu = f", MFU ceiling {100 * ceiling / peak:.1f}%" if peak else ""
    print(f"matmul floor of a step: {total_ms:.1f} ms ({args.batch / total_ms * 1000:.0f} images/s{mfu})")


if __name__ == "__main__":
    main()
