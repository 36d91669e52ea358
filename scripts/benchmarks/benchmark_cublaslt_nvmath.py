"""A/B: the MLP's cuBLASLt GELU epilogues through nvmath-python against our ctypes binding (one CUDA GPU).

torchtitan/kernels/cublaslt.py calls cuBLASLt through ctypes (the library torch loaded, constants and struct
layouts copied from cublasLt.h). NVIDIA's nvmath-python exposes the same matmuls with GELU_AUX_BIAS and DGELU
epilogues on torch tensors, as a maintained library. This script puts both behind the same two functions,

    gelu_aux_bias(x (M, K), w (N, K), b (N,)) -> (gelu_tanh(x w^T + b), x w^T + b)     both (M, N), row-major
    matmul_dgelu(g (M, K), w (K, N), pre (M, N)) -> (g w) * gelu_tanh'(pre)            (M, N), row-major

checks nvmath's against the binding's (and a torch reference), times each alone at a flavor's MLP shapes (CUDA
events, median), and with `--with-steps` times the trainer's own step with each backend in this process
(torchtitan.measure, the backend swapped in torchtitan.kernels.mlp), alternating:

    python scripts/benchmarks/benchmark_cublaslt_nvmath.py --config train_configs/dit_xl2_latent256.toml --batch 224

nvmath-python (with cuda-bindings, cuda-core, cuda-pathfinder) is not a dependency of TorchDiTan; on the GPU
machine it comes from wheels. The nvmath backend here keeps one planned `Matmul` per shape (planning costs
milliseconds) and resets its operands on each call.

Measured on an H100 (torch 2.11, nvmath-python 1.0.0, cuda-core 1.2.2; docs/benchmark_log.md, 2026-11-25 night):
both agree with the binding, and nvmath's GEMMs were 9-24% slower at DiT-XL/2's MLP shapes (batch 224), so the
binding stays. With `--with-steps` the trainer's step with the nvmath backend failed in backward: cuda.core's
current device is per thread, autograd runs backward on a thread of its own, and setting it there did not help
(`Device 0 is not yet initialized` from the stream's event). Hence the op timings are the default.
"""

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from scripts.benchmarks.benchmark_matmuls import time_ms  # noqa: E402
from torchtitan.kernels import cublaslt  # noqa: E402
from torchtitan.kernels import mlp as mlp_kernels  # noqa: E402


class NvmathBackend:
    """gelu_aux_bias and matmul_dgelu through nvmath.linalg.advanced.Matmul, one planned object per shape.

    nvmath adds an epilogue bias per row of the result (it refuses a bias of the result's column count), so the
    row-major (M, N) = x w^T + b is computed as its transpose and transposed back.
    """

    def __init__(self):
        import nvmath.linalg.advanced as nla
        from cuda.core import Device

        self.nla, self.device = nla, Device(torch.cuda.current_device())
        self.plans: dict[tuple, object] = {}

    def _run(self, key: tuple, a: torch.Tensor, b: torch.Tensor, epilog, inputs: dict):
        # cuda.core's current device is per thread, and autograd runs backward on a thread of its own.
        self.device.set_current()
        mm = self.plans.get(key)
        if mm is None:
            mm = self.nla.Matmul(a, b)
            mm.plan(epilog=epilog, epilog_inputs=inputs)
            self.plans[key] = mm
        else:
            mm.reset_operands(a=a, b=b, epilog_inputs=inputs)
        return mm.execute()

    def gelu_aux_bias(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # nvmath adds a bias per row of the result: compute (x w^T + b)^T = w x^T + b[:, None], then transpose back
        # (a copy where nvmath's result is not laid out as a row-major (M, N)).
        key = ("gelu_aux_bias", tuple(x.shape), tuple(w.shape), x.dtype, x.device)
        out, aux = self._run(key, w, x.t(), self.nla.MatmulEpilog.GELU_AUX_BIAS, {"bias": b})
        return out.t().contiguous(), aux["gelu_aux"].t().contiguous()

    def matmul_dgelu(self, g: torch.Tensor, w: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
        # (g w)^T = w^T g^T, with the GELU input laid out as that result, pre^T.
        key = ("dgelu", tuple(g.shape), tuple(w.shape), g.dtype, g.device)
        out = self._run(key, w.t(), g.t(), self.nla.MatmulEpilog.DGELU, {"gelu_aux": pre.t()})
        return out.t().contiguous()


def check(backend: NvmathBackend, m: int, k: int, n: int) -> dict:
    """nvmath's results against the binding's and against torch, at one shape (bf16); raises if they disagree."""
    torch.manual_seed(0)
    x, w, b = (torch.randn(*s, device="cuda", dtype=torch.bfloat16) for s in ((m, k), (n, k), (n,)))
    g, w2 = (torch.randn(*s, device="cuda", dtype=torch.bfloat16) for s in ((m, k), (k, n)))
    h_ref, pre_ref = cublaslt.gelu_aux_bias(x, w, b)
    h, pre = backend.gelu_aux_bias(x, w, b)
    report = {"shapes": (m, k, n), "h_strides": h.stride(), "pre_strides": pre.stride()}
    torch.testing.assert_close(h, h_ref, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(pre, pre_ref, rtol=2e-2, atol=2e-2)
    d_ref = cublaslt.matmul_dgelu(g, w2, pre_ref)
    d = backend.matmul_dgelu(g, w2, pre)
    torch.testing.assert_close(d, d_ref, rtol=2e-2, atol=5e-2)
    report["contiguous"] = h.is_contiguous() and pre.is_contiguous() and d.is_contiguous()
    return report


def op_times(backend: NvmathBackend, m: int, d: int, h: int) -> list[dict]:
    """Each op alone, both backends, at the MLP's shapes: fc1 forward (M, d) -> (M, h), fc2's input gradient."""
    x, w1, b1 = (torch.randn(*s, device="cuda", dtype=torch.bfloat16) for s in ((m, d), (h, d), (h,)))
    g, w2 = (torch.randn(*s, device="cuda", dtype=torch.bfloat16) for s in ((m, d), (d, h)))
    _, pre = cublaslt.gelu_aux_bias(x, w1, b1)
    _, pre_nv = backend.gelu_aux_bias(x, w1, b1)
    rows = []
    for name, ours, theirs in (
        ("gelu_aux_bias", lambda: cublaslt.gelu_aux_bias(x, w1, b1), lambda: backend.gelu_aux_bias(x, w1, b1)),
        ("matmul_dgelu", lambda: cublaslt.matmul_dgelu(g, w2, pre), lambda: backend.matmul_dgelu(g, w2, pre_nv)),
    ):
        rows.append({"op": name, "ctypes_ms": round(time_ms(ours), 4), "nvmath_ms": round(time_ms(theirs), 4)})
    return rows


def step_times(backend: NvmathBackend, train_args: list[str], rounds: int, warmup: int, steps: int) -> list[dict]:
    """The trainer's step with each backend swapped into the MLP kernels, alternating, in this process."""
    from torchtitan.measure import measure_steps

    ours = (mlp_kernels.gelu_aux_bias, mlp_kernels.matmul_dgelu)
    results = []
    for r in range(rounds):
        for name, funcs in (("ctypes", ours), ("nvmath", (backend.gelu_aux_bias, backend.matmul_dgelu))):
            mlp_kernels.gelu_aux_bias, mlp_kernels.matmul_dgelu = funcs
            try:
                out = measure_steps(train_args, warmup, steps)
            finally:
                mlp_kernels.gelu_aux_bias, mlp_kernels.matmul_dgelu = ours
            results.append(
                {
                    "backend": name,
                    "round": r,
                    "images_per_second": round(out["images_per_second"], 1),
                    "step_ms": round(1000 * out["step_time_s"], 1),
                    "mfu": round(out.get("mfu", 0.0), 2),
                }
            )
            print(json.dumps(results[-1]), flush=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="train_configs/dit_xl2_latent256.toml")
    parser.add_argument("--batch", type=int, default=224)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument(
        "--with-steps",
        action="store_true",
        help="also the trainer's step with each backend (see the "
        "module docstring: on an H100 the nvmath backward failed in autograd's thread)",
    )
    args = parser.parse_args()
    from torchtitan.config_manager import parse_args
    from torchtitan.train_spec import build_model_args, get_train_spec

    cfg = parse_args(["--job.config_file", args.config])
    model = build_model_args(get_train_spec(cfg.model.name), cfg)
    backend = NvmathBackend()
    m = args.batch * model.num_tokens
    print(json.dumps(check(backend, 512, model.dim, model.mlp_hidden_dim), default=str), flush=True)
    for row in op_times(backend, m, model.dim, model.mlp_hidden_dim):
        print(json.dumps(row), flush=True)
    if args.with_steps:
        train_args = ["--job.config_file", args.config, "--training.local_batch_size", str(args.batch),
                      "--training.global_batch_size", str(args.batch)]  # fmt: skip
        results = step_times(backend, train_args, args.rounds, args.warmup, args.steps)
        for name in ("ctypes", "nvmath"):
            ips = [r["images_per_second"] for r in results if r["backend"] == name]
            print(f"{name}: images/s {ips}, median {statistics.median(ips):.1f}")


if __name__ == "__main__":
    main()
