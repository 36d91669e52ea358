"""NCCL bandwidth of the collectives FSDP2 and DDP issue for DiT-XL/2, one process a GPU (torchrun); rank 0 prints.

    torchrun --standalone --nproc_per_node 4 scripts/benchmarks/nccl_bw.py

One block of DiT-XL/2 is about 24M parameters: its all-gather in bf16 and its reduce-scatter in fp32. Call C of
docs/benchmark_log.md, 2026-11-28 (i), ran it; its output is assets/studies/2026-11-28_h200x4/nccl/collectives.txt.
"""

import argparse
import os
import time

import torch
import torch.distributed as dist


def bench(name, fn, nbytes, rank, iters=20):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    dist.barrier()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    ms = (time.perf_counter() - start) / iters * 1e3
    if rank == 0:
        print(f"{name:38s} {nbytes / 2**20:8.1f} MiB {ms:8.3f} ms  algbw {nbytes / ms / 1e6:7.1f} GB/s", flush=True)


def main() -> None:
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dev = torch.device("cuda")
    for mib in (48, 800, 2700):
        x = torch.ones(mib * 2**20 // 4, device=dev)
        bench("all_reduce f32", lambda x=x: dist.all_reduce(x), x.numel() * 4, rank)
    ag_out = torch.empty(24_000_000, dtype=torch.bfloat16, device=dev)
    ag_in = ag_out.chunk(world)[rank].clone()
    bench("all_gather bf16 (one block)", lambda: dist.all_gather_into_tensor(ag_out, ag_in), ag_out.numel() * 2, rank)
    rs_in = torch.ones(24_000_000, device=dev)
    rs_out = rs_in.chunk(world)[0].clone()
    bench("reduce_scatter f32 (one block)", lambda: dist.reduce_scatter_tensor(rs_out, rs_in), rs_in.numel() * 4, rank)
    rs_in = torch.ones(64 * 2**20, device=dev)
    rs_out = rs_in.chunk(world)[0].clone()
    bench(
        "reduce_scatter f32 (256 MiB bucket)",
        lambda: dist.reduce_scatter_tensor(rs_out, rs_in),
        rs_in.numel() * 4,
        rank,
    )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
