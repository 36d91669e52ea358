"""Times each SDPA backend (forward + backward) at DiT shapes and checks it against fp32 math attention.

python scripts/benchmarks/benchmark_attention.py --batch 256 --heads 16 --tokens 256 --head-dim 72
"""

import argparse

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

BACKENDS = {
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "math": SDPBackend.MATH,
}


def time_backend(backend, q, k, v, grad, iters: int = 20) -> float:
    with sdpa_kernel([backend]):
        for _ in range(3):
            torch.autograd.grad(F.scaled_dot_product_attention(q, k, v), (q, k, v), grad)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            torch.autograd.grad(F.scaled_dot_product_attention(q, k, v), (q, k, v), grad)
        end.record()
        torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--head-dim", type=int, default=72)
    args = parser.parse_args()
    torch.manual_seed(0)
    shape = (args.batch, args.heads, args.tokens, args.head_dim)
    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    grad = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    reference = F.scaled_dot_product_attention(q.double(), k.double(), v.double())
    flops = 4 * args.batch * args.heads * args.tokens**2 * args.head_dim * 3.5  # fwd 2 matmuls, bwd 5 -> x3.5
    print(f"shape {shape} bf16, forward+backward")
    print("| backend | ms | TFLOP/s | max abs err vs fp64 |\n|---|---|---|---|")
    for name, backend in BACKENDS.items():
        try:
            with sdpa_kernel([backend]):
                err = (F.scaled_dot_product_attention(q, k, v).double() - reference).abs().max().item()
            ms = time_backend(backend, q, k, v, grad)
            print(f"| {name} | {ms:.3f} | {flops / ms / 1e9:.0f} | {err:.2e} |")
        except RuntimeError as e:
            print(f"| {name} | unsupported | | {str(e).splitlines()[0][:60]} |")


if __name__ == "__main__":
    main()
