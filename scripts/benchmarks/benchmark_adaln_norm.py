"""Times the fused adaLN norm (torchtitan/kernels/adaln_norm.py) against Inductor's code for the same maths.

One DiT norm with the gated residual add before it, forward and backward, at a DiT's activation shape:

python scripts/benchmarks/benchmark_adaln_norm.py --batch 128 --tokens 256 --dim 1152

Prints GPU kernel time per call (from a profile: host launch gaps do not count) and the bandwidth of the
(B, T, D) traffic each way needs at least: forward reads x and the branch and writes x' and h; backward reads
the two output gradients, x' and the branch and writes the gradients of x and the branch.
"""

import argparse

import torch

from torchtitan.kernels import adaln_norm as an


def kernel_ms(fn, iters: int = 10) -> tuple[float, list[tuple[str, float]]]:
    """GPU kernel time per call, summed over kernels from a profile (host launch gaps left out), and the kernels."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    kernels = [(e.key, e.self_device_time_total / 1000 / iters) for e in prof.key_averages()]
    kernels = sorted((k for k in kernels if k[1] > 0), key=lambda k: -k[1])
    return sum(ms for _, ms in kernels), kernels


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--dim", type=int, default=1152)
    parser.add_argument("--kind", default="layernorm", choices=["layernorm", "rmsnorm"])
    settings = "each 'fwd_warps,bwd_warps,bwd_rows,bwd_tile' (0 warps: by row width)"
    parser.add_argument("--launch", nargs="*", default=[], help=f"launch settings to compare, {settings}")
    parser.add_argument("--kernels", action="store_true", help="also list each variant's kernels")
    args = parser.parse_args()
    B, T, D = args.batch, args.tokens, args.dim
    g = torch.Generator(device="cuda").manual_seed(0)
    x, branch, grad_x_new, grad_h = (torch.randn(B, T, D, device="cuda", generator=g).bfloat16() for _ in range(4))
    modulation = torch.randn(B, 6 * D, device="cuda", generator=g).bfloat16().requires_grad_()
    x.requires_grad_(), branch.requires_grad_()
    inputs = (x, branch, modulation)

    def step(norm, backward: bool):
        shift, scale, gate = modulation[:, :D], modulation[:, D : 2 * D], modulation[:, 2 * D : 3 * D]
        x_new, h = norm(x, shift, scale, branch, gate, args.kind, 1e-6)
        if backward:
            return torch.autograd.grad((x_new, h), inputs, (grad_x_new, grad_h))
        return x_new, h

    size = B * T * D * 2 / 1e9  # GB of one bf16 (B, T, D) tensor
    print(f"(B, T, D) = ({B}, {T}, {D}) bf16, {args.kind} after a gated residual add; compiled, fullgraph")
    print("| implementation | forward ms | forward GB/s | fwd+bwd ms | backward GB/s |\n|---|---|---|---|---|")
    # Each variant compiles afresh: from caches, a graph compiled under other launch settings would come back.
    torch._inductor.config.fx_graph_cache = False
    torch._functorch.config.enable_autograd_cache = False
    copy, _ = kernel_ms(torch.compile(lambda: x + branch))
    print(f"| x + branch (bandwidth reference: 3 passes) | {copy:.3f} | {3 * size / copy * 1e3:.0f} | | |")
    default, details = dict(an.LAUNCH), []
    variants = [("inductor", an.modulated_norm_torch, None)]
    for launch in args.launch or [",".join(str(v) for v in default.values())]:
        values = dict(zip(default, (int(v) for v in launch.split(",")), strict=True))
        variants.append((f"triton {launch}", an.modulated_norm_triton, values))
    for name, norm, launch in variants:
        an.LAUNCH.update(launch or default)
        torch._dynamo.reset()
        # Compiled, so both sides launch from one graph: eager launches of a 0.1 ms kernel are host-bound.
        fwd, _ = kernel_ms(torch.compile(lambda norm=norm: step(norm, False), fullgraph=True))
        both, kernels = kernel_ms(torch.compile(lambda norm=norm: step(norm, True)))
        print(f"| {name} | {fwd:.3f} | {4 * size / fwd * 1e3:.0f} | {both:.3f} | {6 * size / (both - fwd) * 1e3:.0f} |")
        if args.kernels:
            details.append(f"{name}: " + ", ".join(f"{k[:60]} {ms * 1e3:.0f} us" for k, ms in kernels))
    print("\n".join(details))
    an.LAUNCH.update(default)


if __name__ == "__main__":
    main()
