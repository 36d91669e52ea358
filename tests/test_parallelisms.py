"""One process, DDP, FSDP and HSDP (gloo, CPU) train the same losses from the same seed checkpoint."""

import json
from pathlib import Path

import pytest
import torch

from tests.conftest import ROOT, TINY, read_metrics, run_python, run_train
from torchtitan.parallelisms.parallel_dims import ParallelDims

STEPS = 3
COMMON = [*TINY, "--training.steps", str(STEPS), "--training.global_batch_size", "16", "--checkpoint.enable", "true",
          "--checkpoint.interval", "1000", "--training.ema_decay", "0"]  # fmt: skip


@pytest.fixture(scope="module")
def seed_checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("seed")
    run_train([*COMMON, "--job.dump_folder", str(folder), "--checkpoint.create_seed_checkpoint", "true"])
    return folder / "checkpoint" / "step-0"


@pytest.fixture(scope="module")
def reference(seed_checkpoint, tmp_path_factory):
    folder = tmp_path_factory.mktemp("one")
    run_train([*COMMON, "--job.dump_folder", str(folder), "--training.local_batch_size", "16",
               "--checkpoint.initial_load_path", str(seed_checkpoint)])  # fmt: skip
    return read_metrics(folder)


def assert_same_losses(got: list[dict], expected: list[dict]) -> None:
    # fp32 on CPU; only the order of the gradient reductions differs between layouts.
    assert [m["step"] for m in got] == [m["step"] for m in expected]
    for a, b in zip(got, expected):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5), (a, b)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4), (a, b)


# name: (the layout whose launch runs it, its arguments). Each runs in its layout's launch of tests/layout_grads.py
# (layout_runs below), before that layout's gradient cases.
MATCH_RUNS = {
    # DDP over every rank as dit_xl2_latent256.toml sets it: replicate takes the rest of the world
    "ddp": ("ddp", ["--parallelism.data_parallel_replicate_degree", "-1", "--parallelism.data_parallel_shard_degree",
                    "1", "--training.local_batch_size", "8"]),
    "fsdp": ("fsdp", ["--training.local_batch_size", "8"]),
    # 2 micro-batches per step; blocks stay gathered from forward to backward (FSDP's setting for large batches)
    "fsdp_accum_no_reshard": ("fsdp", ["--training.local_batch_size", "4", "--parallelism.fsdp_reshard_after_forward",
                                       "never"]),
    "hsdp": ("hsdp", ["--parallelism.data_parallel_replicate_degree", "2", "--training.local_batch_size", "4"]),
}  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("name", list(MATCH_RUNS))
def test_parallelisms_match_one_process(reference, layout_runs, name):
    """Several steps (the optimizer's sharded state, accumulation, resharding) against one process. Activation
    checkpointing and compile in each layout: their first-step gradients, exactly, in the tests below."""
    assert_same_losses(read_metrics(layout_runs(MATCH_RUNS[name][0])[name]), reference)


# First-step gradients of every layout against one process (tests/layout_grads.py): global batch 8, fp32, gloo.
GRAD_ARGS = [*TINY, "--training.global_batch_size", "8", "--debug.deterministic", "true"]
VARIANTS = {
    "eager": [],
    "full_ac": ["--activation_checkpoint.mode", "full"],
    "op_ac": ["--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "op"],
    "every_2nd_ac": ["--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "2"],
    "compiled": ["--compile.enable", "true"],
    "compiled_full_ac": ["--compile.enable", "true", "--activation_checkpoint.mode", "full"],
    "compiled_op_ac": ["--compile.enable", "true", "--activation_checkpoint.mode", "selective"],
}
# The whole model compiled: one device or DDP (config_validation refuses it where the model is sharded). Buckets of
# 1 MiB split the debug model's 4.9 MiB of gradients, so DDPOptimizer splits its graph (at 100 MiB it would not).
WHOLE_MODEL = {"compiled_model": ["--compile.enable", "true", "--compile.scope", "model",
                                  "--parallelism.ddp_bucket_cap_mb", "1"]}  # fmt: skip
# Sharded layouts: blocks grouped into FSDP units of 3 (the tiny model's 4 blocks: units of 3 and 1), each unit
# all-gathering the next one as it starts.
UNITS = {"compiled_units_prefetch": ["--compile.enable", "true", "--parallelism.fsdp_blocks_per_unit", "3",
                                     "--parallelism.fsdp_prefetch", "1"]}  # fmt: skip
LAYOUTS = {  # name: (processes, arguments)
    "ddp": (2, ["--parallelism.data_parallel_replicate_degree", "2", "--training.local_batch_size", "4"]),
    "fsdp": (2, ["--parallelism.data_parallel_shard_degree", "2", "--training.local_batch_size", "4"]),
    "hsdp": (4, ["--parallelism.data_parallel_replicate_degree", "2", "--training.local_batch_size", "2"]),
}


def layout_gradients(out: Path, nproc: int, cases: dict[str, list[str]], trainings: dict | None = None) -> dict:
    """{name: first-step gradients} of each case and {name: run folder} of each training run (train.py's main(),
    run first), from one launch of tests/layout_grads.py."""
    import shlex

    trainings = trainings or {}
    args = [str(out), *(f"train:{name}={shlex.join(a)}" for name, a in trainings.items())]
    args += [f"{name}={shlex.join(a)}" for name, a in cases.items()]
    result = run_python(str(ROOT / "tests" / "layout_grads.py"), args, nproc, timeout=900)
    assert result.returncode == 0, result.stderr[-6000:]
    return {**{name: out / name for name in trainings}, **{name: torch.load(out / f"{name}.pt") for name in cases}}


# A torchrun launch costs every rank the trainer's imports and the process group's start (about 10 CPU-s a process
# on CI's 2 cores): one process's plain and DP-SGD gradients come from one launch, and each layout's from one launch
# shared by test_every_gradient_matches_one_process and test_dp_gradient_matches_one_process, which also trains that
# layout's runs of test_parallelisms_match_one_process and test_fsdp_checkpoint_resumes_and_exports (7 launches,
# 19 processes, fewer: 316 -> 250 s of this file alone, serially).
@pytest.fixture(scope="module")
def one_process_runs(tmp_path_factory):
    one_dp = [*DP_ARGS, "--training.local_batch_size", "8"]
    cases = {"one": [*GRAD_ARGS, "--training.local_batch_size", "8"], "plain": one_dp, "augmult": [*one_dp, *AUGMULT]}
    return layout_gradients(tmp_path_factory.mktemp("grads_one"), 1, cases)


@pytest.fixture(scope="module")
def layout_runs(seed_checkpoint, tmp_path_factory):
    """layout -> {case: gradients} for the cases of both gradient tests below, and {name: run folder} of its
    training runs (test_parallelisms_match_one_process; FSDP: the first two of
    test_fsdp_checkpoint_resumes_and_exports), run on first use."""
    runs = {}

    def run(layout: str) -> dict:
        if layout not in runs:
            from_seed = ["--checkpoint.initial_load_path", str(seed_checkpoint)]
            trainings = {n: [*COMMON, *args, *from_seed] for n, (at, args) in MATCH_RUNS.items() if at == layout}
            if layout == "fsdp":  # the run that test_fsdp_checkpoint_resumes_and_exports resumes, and the whole one
                fsdp = fsdp_checkpoint_args(seed_checkpoint)
                trainings |= {
                    "checkpoint_2": [*fsdp, "--training.steps", "2"],
                    "checkpoint_4": [*fsdp, "--training.steps", "4"],
                }
            cases = {**gradient_cases(layout), **dp_gradient_cases(layout)}
            runs[layout] = layout_gradients(tmp_path_factory.mktemp(f"grads_{layout}"), LAYOUTS[layout][0], cases,
                                            trainings)  # fmt: skip
        return runs[layout]

    return run


@pytest.fixture(scope="module")
def one_process_gradients(one_process_runs):
    return one_process_runs["one"]


def gradient_cases(layout: str) -> dict[str, list[str]]:
    layout_args = LAYOUTS[layout][1]
    variants = {**VARIANTS, **(WHOLE_MODEL if layout == "ddp" else UNITS)}
    return {f"{layout}_{v}": [*GRAD_ARGS, *layout_args, *args] for v, args in variants.items()}


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_gradient_matches_one_process(one_process_gradients, layout_runs, layout):
    """Every parameter's full gradient after one forward+backward, in each AC and compile variant (and under DDP with
    the whole model compiled, its graph split at DDP's buckets), equals one process's within 1e-5 relative (fp32;
    only the reduction order differs), with adaLN-Zero's zeros re-drawn so no gradient hides behind a zero; the
    weights start identical (the init draws whole tensors in every layout); and the norm the trainer clips and logs
    by is the norm of exactly these gradients."""
    reference = one_process_gradients
    assert all(g.norm() > 0 for g in reference["grads"].values()), "a zero reference gradient hides nothing"
    runs = layout_runs(layout)
    for name in gradient_cases(layout):
        got = runs[name]
        for param, weight in reference["init"].items():
            assert torch.equal(got["init"][param], weight), f"{name}: {param} starts from other weights"
        for param, expected in reference["grads"].items():
            error = (got["grads"][param] - expected).norm() / expected.norm()
            assert error < 1e-5, f"{name}: {param} gradient off by {error:.2e} (relative)"
        norm = torch.stack([g.norm() for g in got["grads"].values()]).norm().item()
        assert got["grad_norm"] == pytest.approx(norm, rel=1e-6), name
        assert got["grad_norm"] == pytest.approx(reference["grad_norm"], rel=1e-5), name


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 or more CUDA GPUs (NCCL); run on the GPU machine")
def test_nccl_gradients_match_one_gpu(tmp_path, monkeypatch):
    """Over NCCL, on 2 to 4 GPUs: every parameter's first-step gradient in DDP (also with the whole model compiled),
    FSDP and HSDP (with 4 GPUs), eager and compiled, with the fused converters on at any batch, and DP-SGD's clipped,
    noised gradient in each layout (compiled), equals one GPU's within 1e-4 relative (fp32; the reduction order and
    the kernels' tile sums differ).

    TF32 off in every process: with cuDNN's default (TF32 allowed), DDP with the whole model compiled (through
    DDPOptimizer, 2 images a GPU) gave 3.5e-4 on blocks.0.attn.qkv.weight on 4 H200s, and 4.2e-7 with TF32 off,
    while one GPU's whole compiled model (8 images) matched eager (3.8e-7) either way (docs/benchmark_log.md,
    2026-11-27 (c))."""
    monkeypatch.setenv("NVIDIA_TF32_OVERRIDE", "0")
    gpus = min(4, torch.cuda.device_count())
    cuda = [*GRAD_ARGS, "--training.mixed_precision_param", "float32", "--model.converters_min_tokens", "0"]
    # DP-SGD's clipped, noised gradient (flash book-keeping, its Triton kernels on the GPU): the noise is drawn per
    # element of the global gradient, so each layout's equals one GPU's with the same noise.
    dp = [*cuda, *DP_ARGS[len(GRAD_ARGS) :], "--dp.mode", "flash_bookkeeping"]
    ones = layout_gradients(tmp_path / "one", 1, {"one": [*cuda, "--training.local_batch_size", "8"],
                                                  "one_dp": [*dp, "--training.local_batch_size", "8"]})  # fmt: skip
    degrees = "--parallelism.data_parallel_replicate_degree", "--parallelism.data_parallel_shard_degree"
    layouts = {"ddp": [degrees[0], str(gpus), degrees[1], "1"], "fsdp": [degrees[0], "1", degrees[1], str(gpus)]}
    if gpus == 4:
        layouts["hsdp"] = [degrees[0], "2", degrees[1], "2"]
    variants = {"eager": [], **{k: VARIANTS[k] for k in ("compiled", "compiled_full_ac")}}
    cases = {f"{layout}_{variant}": [*cuda, *layout_args, "--training.local_batch_size", str(8 // gpus), *args]
             for layout, layout_args in layouts.items() for variant, args in variants.items()}  # fmt: skip
    cases["ddp_compiled_model"] = [*cuda, *layouts["ddp"], "--training.local_batch_size", str(8 // gpus),
                                   *WHOLE_MODEL["compiled_model"]]  # fmt: skip
    for layout, layout_args in layouts.items():
        cases[f"{layout}_dp_compiled"] = [*dp, *layout_args, "--training.local_batch_size", str(8 // gpus), *COMPILED]
    worst = {}
    for name, got in layout_gradients(tmp_path / "multi", gpus, cases).items():
        reference = ones["one_dp" if "_dp_" in name else "one"]["grads"]
        errors = {p: ((got["grads"][p] - g).norm() / g.norm()).item() for p, g in reference.items()}
        worst[name] = max(errors.items(), key=lambda item: item[1])
    print(f"\nfirst-step gradients over NCCL on {gpus} GPUs against one GPU (worst parameter, relative):")
    for name, (param, error) in worst.items():
        print(f"  {name:24} {error:.2e}  {param}")
    for name, (param, error) in worst.items():
        assert error < 1e-4, f"{name}: {param} gradient off by {error:.2e} (relative)"


# DP-SGD in each layout, with noise: the noise is drawn once per element of the global gradient, so the clipped,
# noised gradient of a layout equals one process's (eager, no AC) exactly but for the reduction order. Each case
# composes DP with compile and an AC mode; accumulation and augmult where named. The one-process eager gradients are
# checked against torch.func in tests/test_dp_composition.py and tests/test_dp_engine.py.
DP_ARGS = [*GRAD_ARGS, "--dp.enable", "true", "--dp.noise_multiplier", "0.5", "--dp.max_grad_norm", "0.05"]
AUGMULT = ["--dp.augmult", "2"]
COMPILED = ["--compile.enable", "true"]
SELECTIVE = ["--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option"]
WHOLE = [*COMPILED, "--compile.scope", "model"]
DP_VARIANTS = {  # name: (arguments, micro-batches per step)
    "fbk_compiled_full_ac": (["--dp.mode", "flash_bookkeeping", *COMPILED, "--activation_checkpoint.mode", "full"], 1),
    # DDP's whole compiled model: one graph (no reducer to split it for), the engine's buckets all-reduced over it
    "fbk_compiled_model_full_ac": (
        [*WHOLE, "--dp.mode", "flash_bookkeeping", "--activation_checkpoint.mode", "full"],
        1,
    ),
    "ghost_compiled_every_2nd_ac_accum": (["--dp.mode", "ghost", *COMPILED, *SELECTIVE, "2"], 2),
    "bk_compiled_op_ac_augmult": (["--dp.mode", "bookkeeping", *COMPILED, *SELECTIVE, "op", *AUGMULT], 1),
}
DP_LAYOUTS = {
    "ddp": ["fbk_compiled_model_full_ac"],
    "fsdp": ["fbk_compiled_full_ac", "ghost_compiled_every_2nd_ac_accum", "bk_compiled_op_ac_augmult"],
    "hsdp": ["bk_compiled_op_ac_augmult"],
}


@pytest.fixture(scope="module")
def one_process_dp_gradients(one_process_runs):
    return {"plain": one_process_runs["plain"], "augmult": one_process_runs["augmult"]}


def dp_gradient_cases(layout: str) -> dict[str, list[str]]:
    nproc, layout_args = LAYOUTS[layout]
    local_batch = 8 // nproc
    cases = {}
    for variant in DP_LAYOUTS[layout]:
        args, micro_batches = DP_VARIANTS[variant]
        local = ["--training.local_batch_size", str(local_batch // micro_batches)]  # the last word wins
        cases[f"{layout}_{variant}"] = [*DP_ARGS, *layout_args, *local, *args]
    return cases


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(DP_LAYOUTS))
def test_dp_gradient_matches_one_process(one_process_dp_gradients, layout_runs, layout):
    runs = layout_runs(layout)
    for name in dp_gradient_cases(layout):
        got = runs[name]
        reference = one_process_dp_gradients["augmult" if "augmult" in name else "plain"]
        for param, expected in reference["grads"].items():
            error = (got["grads"][param] - expected).norm() / expected.norm()
            assert error < 1e-5, f"{name}: {param} gradient off by {error:.2e} (relative)"


@pytest.mark.slow
@pytest.mark.parametrize("scope", ["block", "model"])
def test_compile_matches_eager(seed_checkpoint, reference, tmp_path, scope):
    folder = tmp_path / "compiled"
    run = run_train([*COMMON, "--training.local_batch_size", "16", "--compile.enable", "true", "--compile.scope",
                     scope, "--job.dump_folder", str(folder), "--checkpoint.initial_load_path", str(seed_checkpoint)],
                    timeout=900)  # fmt: skip
    compiled = "the whole model" if scope == "model" else "4 blocks"
    assert f"compiled {compiled} with torch.compile(fullgraph=True" in run.stdout + run.stderr
    got = read_metrics(folder)
    assert len(got) == len(reference)
    for a, b in zip(got, reference):  # inductor fuses and reorders fp32 maths: looser than eager layouts
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4)


def fsdp_checkpoint_args(seed_checkpoint: Path) -> list[str]:
    return [*COMMON, "--training.local_batch_size", "8", "--checkpoint.initial_load_path", str(seed_checkpoint),
            "--training.ema_decay", "0.5"]  # fmt: skip


@pytest.mark.slow
def test_fsdp_checkpoint_resumes_and_exports(seed_checkpoint, layout_runs):
    # FSDP's launch in layout_runs trained 2 steps in `folder` and 4 in `full`; the resume is a launch of its own.
    folder, full = layout_runs("fsdp")["checkpoint_2"], layout_runs("fsdp")["checkpoint_4"]
    args = [*fsdp_checkpoint_args(seed_checkpoint), "--job.dump_folder", str(folder), "--training.steps", "4"]
    run_train(args, nproc=2)  # resumes at step 2 from the FSDP checkpoint
    assert [m["loss"] for m in read_metrics(folder)] == [m["loss"] for m in read_metrics(full)]

    # The exported EMA (gathered from FSDP shards) loads into a plain model; outputs match the DCP EMA.
    from safetensors import safe_open

    from torchtitan.models.dit import DiT, DiTArgs

    with safe_open(str(folder / "ema.safetensors"), "pt") as f:
        model = DiT(DiTArgs.from_dict(json.loads(f.metadata()["model_args"])))
        model.load_state_dict({k: f.get_tensor(k) for k in f.keys()})
    model.init_buffers()
    import torch.distributed.checkpoint as dcp

    reference = DiT(model.args)
    reference.init_buffers()
    state = {"ema": {k: torch.empty_like(v) for k, v in reference.state_dict().items()}}
    state["ema"]["num_updates"] = torch.tensor(0)
    dcp.load(state, checkpoint_id=str(folder / "checkpoint" / "step-4"))
    del state["ema"]["num_updates"]
    reference.load_state_dict(state["ema"])
    x, t, y = torch.randn(2, 1, 16, 16), torch.tensor([10.0, 700.0]), torch.tensor([3, 7])
    torch.testing.assert_close(model(x, t, y), reference(x, t, y), rtol=0, atol=0)


def test_parallel_dims_resolve():
    dims = ParallelDims(2, -1, 8)
    assert (dims.dp_replicate, dims.dp_shard, dims.mode) == (2, 4, "hsdp")
    assert ParallelDims(4, 1, 4).mode == "ddp" and ParallelDims(1, -1, 4).mode == "fsdp"


def test_compile_scope_auto_is_the_whole_model_on_cuda_unless_sharded(monkeypatch):
    from types import SimpleNamespace

    from torchtitan.parallelisms.utils import compile_scope

    auto, block = SimpleNamespace(scope="auto"), SimpleNamespace(scope="block")
    one, ddp, fsdp, fsdp_one = (
        ParallelDims(1, 1, 1),
        ParallelDims(2, 1, 2),
        ParallelDims(1, -1, 2),
        ParallelDims(1, 1, 1, True),
    )
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert [compile_scope(auto, dims) for dims in (one, ddp, fsdp, fsdp_one)] == ["model", "model", "block", "block"]
    assert compile_scope(block, one) == "block"  # an explicit scope is kept
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert compile_scope(auto, one) == "block"  # on the CPU one block's graph compiles once for all


def test_sharded_7b_init_without_materializing():
    """fully_shard over a fake 8-rank world on the meta device: right count, right per-rank shards."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from torchtitan.models.dit import DiT, dit_configs
    from torchtitan.parallelisms.utils import apply_fsdp

    world = 8
    dist.init_process_group("fake", store=FakeStore(), rank=3, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))
        with torch.device("meta"):
            model = DiT(dit_configs["7B"])
        total = sum(p.numel() for p in model.parameters())
        assert 7.0e9 < total < 7.6e9
        apply_fsdp(model, list(model.blocks.values()), mesh, torch.bfloat16, torch.float32, "default")
        local = 0
        for p in model.parameters():
            assert p.device.type == "meta"  # nothing was materialized
            rows = p.shape[0]
            expected_rows = max(0, min(rows - 3 * -(-rows // world), -(-rows // world)))  # torch.chunk's rank-3 rows
            assert p.to_local().shape[0] == expected_rows
            local += p.to_local().numel()
        assert local == pytest.approx(total / world, rel=0.01)
    finally:
        dist.destroy_process_group()


def test_fsdp_units_group_blocks_within_a_gigabyte_and_at_most_half():
    from torchtitan.parallelisms.utils import blocks_per_unit, fsdp_units

    mib = 1 << 20
    # DiT-XL/2's 28 blocks of 45.6 MiB (bf16): half of them a unit; the 7B flavor's 578 MiB blocks: one a unit.
    assert blocks_per_unit(0, int(45.6 * mib), 28) == 14
    assert blocks_per_unit(0, 578 * mib, 24) == 1
    assert blocks_per_unit(0, 100 * mib, 40) == 10  # 1 GiB of gathered parameters
    assert blocks_per_unit(0, 1, 1) == 1 and blocks_per_unit(5, 1, 3) == 3  # a set value, at most every block
    assert fsdp_units(4, 3) == [range(0, 3), range(3, 4)]
