"""All-gather of one DiT-XL/2 block (bf16) alone and beside a stream of GEMMs, with and without cuBLAS's SM carve-out.

    torchrun --standalone --nproc_per_node 4 scripts/benchmarks/nccl_contend.py

The GEMMs are fc1's shape at 32 images a GPU (8192 x 1152 by 1152 x 4608, bf16), 2000 of them queued on a side
stream before 20 all-gathers, which CUDA events time on the current stream. Call D of docs/benchmark_log.md,
2026-11-28 (i), ran it; its output is in assets/studies/2026-11-28_h200x4/nccl/collectives.txt.
"""

import argparse
import os

import torch
import torch.distributed as dist


def main() -> None:
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dev = torch.device("cuda")
    ag_out = torch.empty(24_000_000, dtype=torch.bfloat16, device=dev)
    ag_in = ag_out.chunk(world)[rank].clone()
    a = torch.randn(8192, 1152, dtype=torch.bfloat16, device=dev)
    b = torch.randn(1152, 4608, dtype=torch.bfloat16, device=dev)
    side = torch.cuda.Stream()

    def run(label, gemms, carve):
        torch._C._set_sm_carveout_experimental(carve)
        for _ in range(3):
            dist.all_gather_into_tensor(ag_out, ag_in)
        torch.cuda.synchronize()
        dist.barrier()
        torch.cuda.synchronize()
        with torch.cuda.stream(side):
            for _ in range(gemms):
                a @ b
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(20):
            dist.all_gather_into_tensor(ag_out, ag_in)
        end.record()
        end.synchronize()
        side.synchronize()
        if rank == 0:
            print(f"{label:34s} all_gather 45.8 MiB: {start.elapsed_time(end) / 20:.3f} ms each", flush=True)
        torch.cuda.synchronize()

    cases = [("alone", 0, 0), ("beside GEMMs", 2000, 0)]
    cases += [(f"beside GEMMs, carve-out {sms} SMs", 2000, sms) for sms in (24, 32)]
    for label, gemms, carve in cases:
        run(label, gemms, carve)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
