"""The NCCL gradient test's compiled and DP cases only (a budget-limited run of
tests/test_parallelisms.py::test_nccl_gradients_match_one_gpu): the same arguments, the same 1e-4 bound."""

import os
import sys
import time
from pathlib import Path

sys.path.insert(0, os.getcwd())
os.environ["NVIDIA_TF32_OVERRIDE"] = "0"
import torch

import tests.test_parallelisms as T

start = time.time()
gpus = min(4, torch.cuda.device_count())
cuda = [*T.GRAD_ARGS, "--training.mixed_precision_param", "float32", "--model.converters_min_tokens", "0"]
dp = [*cuda, *T.DP_ARGS[len(T.GRAD_ARGS) :], "--dp.mode", "flash_bookkeeping"]
ones = T.layout_gradients(
    Path("/tmp/nccl/one"),
    1,
    {"one": [*cuda, "--training.local_batch_size", "8"], "one_dp": [*dp, "--training.local_batch_size", "8"]},
)
print(f"one GPU {time.time() - start:.0f}s", flush=True)
d = "--parallelism.data_parallel_replicate_degree", "--parallelism.data_parallel_shard_degree"
layouts = {"ddp": [d[0], str(gpus), d[1], "1"], "fsdp": [d[0], "1", d[1], str(gpus)], "hsdp": [d[0], "2", d[1], "2"]}
lb = ["--training.local_batch_size", str(8 // gpus)]
cases = {
    "ddp_compiled_model": [*cuda, *layouts["ddp"], *lb, *T.WHOLE_MODEL["compiled_model"]],
    "fsdp_compiled": [*cuda, *layouts["fsdp"], *lb, *T.VARIANTS["compiled"]],
}
for name, args in layouts.items():
    cases[f"{name}_dp_compiled"] = [*dp, *args, *lb, *T.COMPILED]
rows = []
for name, got in T.layout_gradients(Path("/tmp/nccl/multi"), gpus, cases).items():
    ref = ones["one_dp" if "_dp_" in name else "one"]["grads"]
    errors = {p: ((got["grads"][p] - g).norm() / g.norm()).item() for p, g in ref.items()}
    p, e = max(errors.items(), key=lambda i: i[1])
    rows.append(f"| {name} | {e:.2e} | {p} | {'ok' if e < 1e-4 else 'FAIL'} |")
print(f"first-step gradients over NCCL on {gpus} GPUs against one GPU, worst parameter ({time.time() - start:.0f}s):")
print("| case | relative error | parameter | < 1e-4 |\n|---|---|---|---|\n" + "\n".join(rows))
