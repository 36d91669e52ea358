"""The analytic memory estimate against real tensors: exact state bytes (one device and FSDP shards on a
fake 4-rank world) and exact eager activation bytes on CPU, of the plain and the converted model; the kernels' rows
in the TRITON_INTERPRET=1 child process of `test_kernels_in_interpreter`, where the kernels run on CPU tensors.
Llama 3 (at the end): parameters against meta-built models, FSDP shards, fp32 activations through the trainer and
autocast's casts under CPU autocast, all to the byte."""

import gc
import math
from dataclasses import replace

import pytest
import torch

from tests.conftest import ROOT
from torchtitan.components.ema import EMA
from torchtitan.config_manager import parse_args
from torchtitan.kernels.triton_support import triton_interpreting
from torchtitan.measure import measure_breakdown
from torchtitan.models.dit import DiT, dit_configs
from torchtitan.models.llama3 import Llama3, llama3_configs
from torchtitan.tools.memory_breakdown import MemoryBreakdown, optimizer_tensors, storage_bytes
from torchtitan.tools.memory_estimate import (
    estimate_from_job_config,
    estimate_memory,
    max_batch_that_fits,
    parameter_shapes,
    shard_numel,
)
from torchtitan.tools.memory_estimate_llama3 import estimate_llama3_memory
from torchtitan.tools.memory_estimate_llama3 import parameter_shapes as llama3_parameter_shapes

# The TRITON_INTERPRET=1 child of test_kernels_in_interpreter runs only the kernels' rows (of
# test_eager_fp32_activations_are_exact_on_cpu); the parent runs the rest, which no kernel reaches.
parent_only = pytest.mark.skipif(triton_interpreting(), reason="no kernels: the parent process runs it")

VARIANTS = {
    "debug": dit_configs["debug"],
    "DiT-XL/2": dit_configs["DiT-XL/2"],
    "0.5B": dit_configs["0.5B"],
    "learned_unconditional": replace(dit_configs["debug"], pos_embed="learned", num_classes=0, qk_norm=True),
    "swiglu_sigma": replace(dit_configs["DiT-S/4"], mlp="swiglu", norm="rmsnorm", learn_sigma=True),
}


@parent_only
@pytest.mark.parametrize("name", list(VARIANTS))
def test_parameter_shapes_match_the_model(name):
    args = VARIANTS[name]
    with torch.device("meta"):
        model = DiT(args)
    assert parameter_shapes(args) == {n: tuple(p.shape) for n, p in model.named_parameters()}


def _count(model, optimizer, ema) -> dict:
    return {
        "parameters": storage_bytes(model.parameters()),
        "gradients": storage_bytes(p.grad for p in model.parameters()),
        "optimizer_states": storage_bytes(optimizer_tensors(optimizer)),
        "ema": storage_bytes(ema.shadow),
        "buffers": storage_bytes(model.buffers()),
    }


def _train_step(model, args, batch: int = 2):
    x = torch.randn(batch, args.in_channels, args.input_size, args.input_size)
    model(x, torch.rand(batch) * 999, torch.randint(0, args.num_classes, (batch,))).square().mean().backward()


@parent_only
def test_state_bytes_are_exact_for_the_debug_model():
    args = dit_configs["debug"]
    model = DiT(args)
    model.init_weights()
    optimizer = torch.optim.AdamW(model.parameters(), foreach=True)
    ema = EMA(model, 0.999)
    _train_step(model, args)
    optimizer.step()
    estimate = estimate_memory(args, 8, "fp32")
    assert _count(model, optimizer, ema) == {k: estimate.parts[k] for k in _count(model, optimizer, ema)}


@parent_only
@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_sgd_state_bytes_are_exact(momentum):
    args = dit_configs["debug"]
    model = DiT(args)
    model.init_weights()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=momentum, foreach=True)
    ema = EMA(model, 0.999)
    _train_step(model, args)
    optimizer.step()
    estimate = estimate_memory(args, 8, "fp32", optimizer=("SGD", momentum))
    assert _count(model, optimizer, ema) == {k: estimate.parts[k] for k in _count(model, optimizer, ema)}
    assert (estimate.parts["optimizer_states"] > 0) == (momentum > 0)


@parent_only
def test_state_bytes_are_exact_for_xl2_on_meta():
    args = dit_configs["DiT-XL/2"]
    with torch.device("meta"):
        model = DiT(args)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer = torch.optim.AdamW(model.parameters(), foreach=True)
    optimizer.step()  # meta kernels: creates AdamW's states with their real sizes
    numel = sum(p.numel() for p in model.parameters())
    assert 674e6 < numel < 676e6  # about the DiT paper's 675M
    parts = estimate_memory(args, 64).parts
    assert parts["parameters"] == parts["gradients"] == 4 * numel == storage_bytes(model.parameters())
    assert parts["optimizer_states"] == storage_bytes(optimizer_tensors(optimizer))
    assert parts["ema"] == 4 * numel


@parent_only
def test_shard_numel_follows_torch_chunk():
    for rows, world in [(11, 4), (1001, 4), (3, 4), (4608, 8), (1, 8)]:
        chunks = torch.chunk(torch.empty(rows, 3), world)
        for rank in range(world):
            local, padded = shard_numel((rows, 3), world, rank)
            assert local == (chunks[rank].numel() if rank < len(chunks) else 0)
            assert padded == chunks[0].numel()


@pytest.fixture
def fake_world():
    """A fake 4-rank process group (rank 3): fully_shard runs without peers, collectives do nothing."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=3, world_size=4)
    try:
        yield init_device_mesh("cpu", (4,))
    finally:
        dist.destroy_process_group()


def _shard(model, mesh, reshard_after_forward: str = "default") -> None:
    from torchtitan.parallelisms.utils import apply_fsdp

    apply_fsdp(model, list(model.blocks.values()), mesh, torch.float32, torch.float32, reshard_after_forward)


@parent_only
@pytest.mark.parametrize("reshard_after_forward", ["default", "never", "always"])
def test_fsdp_shards_match_fully_shard(fake_world, reshard_after_forward):
    """Debug model materialized on rank 3 of 4: padded parameters and gradients, unpadded AdamW and EMA, and the
    gathered parameters that `fsdp_reshard_after_forward` keeps from forward to backward."""
    args = dit_configs["debug"]
    with torch.device("meta"):
        model = DiT(args)
    _shard(model, fake_world, reshard_after_forward)
    model.to_empty(device="cpu")
    model.init_weights()
    optimizer = torch.optim.AdamW(model.parameters(), foreach=True)
    ema = EMA(model, 0.999)
    breakdown = MemoryBreakdown(model, optimizer, torch.device("cpu"), ema)
    x = torch.randn(2, args.in_channels, args.input_size, args.input_size)
    with breakdown.track():
        loss = model(x, torch.rand(2) * 999, torch.randint(0, args.num_classes, (2,))).square().mean()
    after_forward = breakdown.record("forward")
    loss.backward()
    optimizer.step()
    estimate = estimate_memory(args, 8, "fp32", dp_shard=4, rank=3, reshard_after_forward=reshard_after_forward)
    counted = _count(model, optimizer, ema)
    assert counted == {k: estimate.parts[k] for k in counted}
    assert after_forward["fsdp_gathered"] == estimate.parts["fsdp_gathered"]
    assert (after_forward["fsdp_gathered"] > 0) == (reshard_after_forward != "always")
    assert after_forward["parameters"] == estimate.parts["parameters"]  # the shards, not the gathered copies
    padded = sum(math.prod(p.to_local().shape[1:]) * -(-p.shape[0] // 4) for p in model.parameters())
    assert estimate.parts["parameters"] == 4 * padded > 4 * sum(p.to_local().numel() for p in model.parameters())


@parent_only
def test_fsdp_shards_of_xl2_on_meta(fake_world):
    args = dit_configs["DiT-XL/2"]
    with torch.device("meta"):
        model = DiT(args)
    _shard(model, fake_world)
    parts = estimate_memory(args, 64, "bf16_fsdp", dp_shard=4, rank=3).parts
    assert parts["parameters"] == sum(p.to_local().untyped_storage().nbytes() for p in model.parameters())
    local = sum(p.to_local().numel() for p in model.parameters())
    assert parts["ema"] == 4 * local
    assert parts["optimizer_states"] == 8 * local + 4 * len(list(model.parameters()))


TINY = ["--job.config_file", str(ROOT / "train_configs/debug_model.toml"), "--training.local_batch_size", "4"]
LLAMA_STYLE = ["--model.norm", "rmsnorm", "--model.mlp", "swiglu", "--model.qk_norm", "true"]
# The kernels' rows under Triton's interpreter: no AC, a mix of checkpointed and plain blocks (fused_norm hands the
# residual on differently at their borders), and the SwiGLU kernel's rows.
INTERPRETED = ("none", "every_2nd", "llama_style")
pytestmark = pytest.mark.usefixtures("interpreter_launch")


@pytest.mark.parametrize(
    "extra",
    [
        [],
        ["--activation_checkpoint.mode", "full"],
        ["--activation_checkpoint.mode", "selective"],
        ["--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "2"],
        LLAMA_STYLE,
        [*LLAMA_STYLE, "--activation_checkpoint.mode", "selective"],
        ["--model.pos_embed", "sincos", "--model.num_classes", "0"],
    ],
    ids=["none", "full", "selective_op", "every_2nd", "llama_style", "llama_style_selective", "sincos_uncond"],
)
@pytest.mark.parametrize("converters", ["fused_norm,fused_mlp,fused_qkv", ""], ids=["converted", "plain"])
def test_eager_fp32_activations_are_exact_on_cpu(tmp_path, monkeypatch, request, extra, converters):
    """The estimate's saved-tensor list against what the trainer's first forward leaves alive. Converted: on CPU the
    torch maths with the residual stream handed on in parts (a gate_mlp copy per block); in the interpreter child, the
    kernels' rows (what the adaLN and SwiGLU kernels keep)."""
    if triton_interpreting() and (not converters or request.node.callspec.id.split("-")[1] not in INTERPRETED):
        pytest.skip("the parent runs it (no kernels), or the interpreter's cases cover it (4-8 s each there)")
    if triton_interpreting():
        # Triton's interpreter leaves reference cycles behind its launches, which the trainer's disabled automatic GC
        # would keep until gc_freq: collected before each record, so the count is of what the step holds.
        record = MemoryBreakdown.record

        def record_collected(self, *args, **kwargs):
            gc.collect()
            return record(self, *args, **kwargs)

        monkeypatch.setattr(MemoryBreakdown, "record", record_collected)
    size = ["--model.input_size", "8" if triton_interpreting() else "16"]  # the interpreter's: the digits are 8x8
    args = [*TINY, *extra, *size, "--model.converters", converters, "--job.dump_folder", str(tmp_path)]
    measured = measure_breakdown(args, steps=1)["records"][1]
    assert measured["stage"] == "forward"
    estimate = estimate_from_job_config(parse_args(args), world_size=1, device_type="cpu")
    assert estimate.parts["activations"] == measured["activations"]


@parent_only
def test_compiled_bf16_estimate_matches_the_h100_measurement():
    """DiT-XL/2 with sin-cos positions (its configs), bf16 autocast, compiled blocks, batch 128: one forward kept
    282.1 MiB per image on an H100 (docs/memory.md, 2026-11-24)."""
    sincos = estimate_memory(replace(dit_configs["DiT-XL/2"], pos_embed="sincos"), 128, "bf16_autocast", compiled=True)
    assert sincos.parts["activations"] / 128 / 2**20 == pytest.approx(282.1, rel=0.025)
    assert "18.06 residual-stream tensors" in sincos.report()
    # RoPE keeps the rotated q and k as well: the peaks measured at batch 128 were 49.7 and 45.7 GiB.
    rope = estimate_memory(dit_configs["DiT-XL/2"], 128, "bf16_autocast", compiled=True)
    assert (rope.peak - sincos.peak) / 2**30 == pytest.approx(49.7 - 45.7, rel=0.05)
    eager = estimate_memory(dit_configs["DiT-XL/2"], 64, "bf16_autocast", compiled=False)
    compiled = estimate_memory(dit_configs["DiT-XL/2"], 64, "bf16_autocast", compiled=True)
    assert eager.parts["activations"] > compiled.parts["activations"] and eager.parts["autocast_weight_copies"] > 0


@parent_only
def test_checkpointing_and_sharding_lower_the_estimate():
    args = dit_configs["0.5B"]
    peaks = [estimate_memory(args, 32, ac_mode=mode, compiled=True).peak for mode in ("none", "selective", "full")]
    assert peaks[0] > peaks[1] > peaks[2]
    assert estimate_memory(args, 32, "bf16_fsdp", dp_shard=8).parts["parameters"] < peaks[2] / 8
    ddp = estimate_memory(args, 32, dp_replicate=8).parts
    assert ddp["ddp_buckets"] == ddp["gradients"]


@parent_only
def test_max_batch_that_fits():
    def estimate(batch):
        return estimate_memory(dit_configs["DiT-XL/2"], batch, compiled=True)

    budget = 40 * 2**30
    best = max_batch_that_fits(budget, estimate)
    assert estimate(best).peak <= budget < estimate(best + 1).peak
    assert max_batch_that_fits(2**20, estimate) == 0


@parent_only
def test_cli_prints_the_derivation(capsys):
    from torchtitan.tools.memory_estimate import main

    main(["--flavor", "DiT-XL/2", "--batch", "64", "--compile", "--device-memory-gib", "80"])
    out = capsys.readouterr().out
    assert "64 x 256 x 1152 x 2 B = 36.00 MiB" in out and "qkv output" in out
    assert "largest batch whose estimate fits 80.0 GiB:" in out and "after QK-norm / RoPE" in out
    main(["--flavor", "DiT-XL/2", "--batch", "64", "--compile", "--pos-embed", "sincos", "--converters", ""])
    out = capsys.readouterr().out
    assert "18.06 residual-stream tensors" in out and "after QK-norm / RoPE" not in out
    # Eager, the default converters' adaLN kernel keeps norm1's x' for norm2 instead of the mid-block residual, and
    # neither norm output.
    main(["--flavor", "DiT-XL/2", "--batch", "64", "--pos-embed", "sincos", "--precision", "fp32"])
    converted = capsys.readouterr().out
    main(["--flavor", "DiT-XL/2", "--batch", "64", "--pos-embed", "sincos", "--precision", "fp32", "--converters", ""])
    plain = capsys.readouterr().out
    assert "20.05 residual-stream tensors" in plain and "17.04 residual-stream tensors" in converted
    assert "gate_mlp copies handed on by 28 block(s)" in converted and "by 0 block(s)" in plain


@parent_only
def test_job_config_estimate_follows_fsdp_reshard_after_forward():
    """`fsdp_reshard_after_forward = "never"` keeps every block's gathered parameters: the 7B flavor on 2 H200s
    peaked 12.3 GiB higher with it at 16 images a GPU (docs/benchmark_log.md, 2026-11-24, night)."""
    base = ["--job.config_file", str(ROOT / "train_configs/dit_7B_latent.toml"), "--training.local_batch_size", "16"]
    parts = {
        mode: estimate_from_job_config(parse_args([*base, "--parallelism.fsdp_reshard_after_forward", mode]), 2).parts
        for mode in ("default", "never")
    }
    extra = (parts["never"]["fsdp_gathered"] - parts["default"]["fsdp_gathered"]) / 2**30
    assert extra == pytest.approx(12.3, rel=0.1)  # 23 more blocks' bf16 parameters: 13.0 GiB


# Llama 3: the same estimator with the family's own description (torchtitan/tools/memory_estimate_llama3.py). No
# Triton kernel runs in these, so the interpreter child of `test_kernels_in_interpreter` skips them.
llama3_test = parent_only

LLAMA3_VARIANTS = {
    "debugmodel": llama3_configs["debugmodel"],
    "classifier": replace(llama3_configs["debugmodel"], num_labels=3),
    "lab": llama3_configs["lab"],
    "Llama-3.2-1B": llama3_configs["Llama-3.2-1B"],  # tied LM head
    "Llama-3.1-8B": llama3_configs["Llama-3.1-8B"],
}


@llama3_test
@pytest.mark.parametrize("name", list(LLAMA3_VARIANTS))
def test_llama3_parameters_match_the_model(name):
    """Shapes by name, and the count (a tied head once), against the model built on the meta device."""
    args = LLAMA3_VARIANTS[name]
    with torch.device("meta"):
        model = Llama3(replace(args))
    shapes = llama3_parameter_shapes(args)
    assert shapes == {n: tuple(p.shape) for n, p in model.named_parameters()}
    numel = sum(p.numel() for p in model.parameters())
    if name == "Llama-3.2-1B":
        assert model.output.weight is model.tok_embeddings.weight and 1.23e9 < numel < 1.24e9  # Meta's 1.24B
    parts = estimate_llama3_memory(args, 1, 128).parts
    assert parts["parameters"] == 4 * numel == 4 * sum(math.prod(s) for s in shapes.values())
    assert parts["buffers"] == storage_bytes(model.buffers())  # the RoPE table


@llama3_test
def test_llama3_fsdp_shards_match_fully_shard(fake_world):
    """Debug Llama materialized on rank 3 of 4: padded parameters and gradients, AdamW, and the gathered root and
    last layer that stay from forward to backward."""
    from torchtitan.parallelisms.utils import apply_fsdp

    args = replace(llama3_configs["debugmodel"])
    with torch.device("meta"):
        model = Llama3(args)
    apply_fsdp(model, list(model.layers.values()), fake_world, torch.float32, torch.float32, "default")
    model.to_empty(device="cpu")
    model.init_weights()
    optimizer = torch.optim.AdamW(model.parameters(), foreach=True)
    breakdown = MemoryBreakdown(model, optimizer, torch.device("cpu"))
    with breakdown.track():
        loss = model(torch.randint(0, args.vocab_size, (2, 16))).square().mean()
    after_forward = breakdown.record("forward")
    loss.backward()
    optimizer.step()
    estimate = estimate_llama3_memory(args, 2, 16, "fp32", dp_shard=4, rank=3)
    counted = {
        "parameters": storage_bytes(model.parameters()),
        "gradients": storage_bytes(p.grad for p in model.parameters()),
        "optimizer_states": storage_bytes(optimizer_tensors(optimizer)),
        "buffers": storage_bytes(model.buffers()),
    }
    assert counted == {k: estimate.parts[k] for k in counted}
    assert after_forward["fsdp_gathered"] == estimate.parts["fsdp_gathered"] > 0


LLAMA3_DEBUG = ["--job.config_file", str(ROOT / "train_configs/llama3_debug.toml"), "--training.local_batch_size", "2",
                "--training.seq_len", "32", "--validation.enable", "false", "--checkpoint.enable", "false"]  # fmt: skip
CLASSIFIER = ["--model.num_classes", "3", "--training.dataset", "synthetic_classification"]
EVERY_2ND = ["--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "2"]


@llama3_test
@pytest.mark.parametrize(
    "extra",
    [
        [],
        CLASSIFIER,
        ["--activation_checkpoint.mode", "full"],
        ["--activation_checkpoint.mode", "selective"],
        EVERY_2ND,
        ["--model.attn_window", "8", *EVERY_2ND],
    ],
    ids=["causal_lm", "classifier", "full", "selective_op", "every_2nd", "window_every_2nd"],
)
def test_llama3_eager_fp32_activations_are_exact_on_cpu(tmp_path, extra):
    """The Llama 3 rows against what the trainer's first forward leaves alive (CPU's composite RMSNorm). The sliding
    window takes SDPA's dense-mask path in the un-checkpointed layer, and its bool mask stays with the checkpoint."""
    args = [*LLAMA3_DEBUG, *extra, "--job.dump_folder", str(tmp_path)]
    measured = measure_breakdown(args, steps=1)["records"][1]
    assert measured["stage"] == "forward"
    estimate = estimate_from_job_config(parse_args(args), world_size=1, device_type="cpu")
    assert estimate.parts["activations"] == measured["activations"]


@llama3_test
@pytest.mark.parametrize("num_labels, attn_window", [(0, 0), (3, 0), (0, 8)], ids=["lm", "classifier", "window"])
def test_llama3_autocast_casts_match_cpu_autocast(num_labels, attn_window):
    """bf16 autocast's copies (three bf16 copies of the attention norm's output, two of the FFN norm's, RoPE's cos
    and sin, the weights) and the fp32 residual stream, against CPU autocast, which casts as CUDA's does (the norm
    kernels aside: CPU's composite RMSNorm and dense window mask here, cuda_kernels=False)."""
    from torchtitan.models.llama3.objective import LanguageModelObjective

    args = replace(llama3_configs["debugmodel"], num_labels=num_labels, attn_window=attn_window)
    model = Llama3(args)
    model.init_weights()
    x = torch.randint(0, args.vocab_size, (2, 32))
    y = torch.randint(0, num_labels, (2,)) if num_labels else torch.randint(0, args.vocab_size, (2, 32))
    breakdown = MemoryBreakdown(model, torch.optim.AdamW(model.parameters()), torch.device("cpu"))
    with breakdown.track(), torch.autocast("cpu", torch.bfloat16):
        losses = LanguageModelObjective(num_labels, 32).losses(model, x, y, 0, 0)
    measured = breakdown.record("forward", 1)["activations"]
    parts = estimate_llama3_memory(args, 2, 32, "bf16_autocast", cuda_kernels=False).parts
    assert measured == parts["activations"] + parts["autocast_weight_copies"]
    assert losses.shape == (2,)


@llama3_test
def test_llama3_estimate_prints_its_derivation(capsys):
    """The CLI for a Llama: the unit, the per-layer rows and totals, the logits, and the finder's answer; lower with
    checkpointing and sharding, and higher by the vocabulary-sized loss gradients for a causal LM."""
    from torchtitan.tools.memory_estimate import main

    main(["--model", "llama3", "--flavor", "Llama-3.2-1B", "--batch", "4", "--seq-len", "2048",
          "--device-memory-gib", "80"])  # fmt: skip
    out = capsys.readouterr().out
    assert "one residual-stream tensor = B x T x D x bytes = 4 x 2048 x 2048 x 4 B = 64.00 MiB" in out
    assert "autocast's bf16 copies of it for wk and wv" in out and "per sequence per block" in out
    assert "logits (B, T, V) = 2048 x 128256 x 2 B, + the fp32 copy" in out
    assert "largest batch whose estimate fits 80.0 GiB:" in out
    args = llama3_configs["Llama-3.1-8B"]
    peaks = [estimate_llama3_memory(args, 1, 8192, ac_mode=mode).peak for mode in ("none", "selective", "full")]
    assert peaks[0] > peaks[1] > peaks[2]
    sharded = estimate_llama3_memory(args, 1, 8192, "bf16_fsdp", dp_shard=8, compiled=True).parts
    assert sharded["parameters"] == 4 * sum(shard_numel(s, 8, 0)[1] for s in llama3_parameter_shapes(args).values())
    classifier = estimate_llama3_memory(replace(args, num_labels=2), 1, 8192).parts["backward_working"]
    assert estimate_llama3_memory(args, 1, 8192).parts["backward_working"] >= 8 * 8192 * 128256 > classifier


@llama3_test
def test_job_config_estimate_dispatches_on_model_name():
    """llama3 configs take the Llama description, with training.seq_len and EMA off as the config says."""
    estimate = estimate_from_job_config(parse_args(LLAMA3_DEBUG), world_size=1)
    assert "TransformerBlock" in estimate.report() and "ema" not in estimate.parts
    assert (
        estimate.parts["activations"]
        == estimate_llama3_memory(llama3_configs["debugmodel"], 2, 32).parts["activations"]
    )


GIB = 1024**3
H100, H200 = 79.2, 139.0  # GiB, as torch.cuda.get_device_properties reports them (an H200 a little over 139)
# Each shipped config on the least its "Fits:" comment names: (world size, device, GiB of memory a rank).
SHIPPED_FITS = {
    "cifar10_pixel.toml": (1, "cuda", 8e9 / GIB),
    "debug_model.toml": (1, "cpu", 4.0),
    "dit_0.5B_latent.toml": (1, "cuda", H100),
    "dit_7B_latent.toml": (2, "cuda", H200),
    "dit_l8_pixel_dp.toml": (1, "cuda", 40e9 / GIB),
    "dit_xl2_latent256.toml": (1, "cuda", H100),
    "imagenet256_latent_dit_xl2.toml": (1, "cuda", 32e9 / GIB),
    "jit_b16_pixel256.toml": (1, "cuda", 24e9 / GIB),
    "lightningdit_xl1_vavae.toml": (8, "cuda", H100),
    "llama3_1b.toml": (1, "cuda", H100),
    "llama3_8b.toml": (1, "cuda", H200),
    "llama3_debug.toml": (1, "cpu", 4.0),
    "llama3_lab.toml": (1, "cpu", 16.0),
    "sit_xl2_repa.toml": (1, "cuda", H100),
}


def _memory(monkeypatch, gib: float, where: str = "the host's available RAM (MemAvailable)") -> None:
    from torchtitan.tools import memory_estimate

    monkeypatch.setattr(memory_estimate, "available_memory", lambda device: (int(gib * GIB), where))


@parent_only
def test_every_shipped_config_passes_the_memory_check_where_it_says_it_fits(monkeypatch, tmp_path):
    from tests.test_alignment import write_tiny_dinov2
    from torchtitan.tools.memory_estimate import check_memory

    assert sorted(SHIPPED_FITS) == sorted(path.name for path in (ROOT / "train_configs").glob("*.toml"))
    # A stand-in for an [alignment] config's DINOv2-B/14: its width (768) is what sizes the projector.
    encoder = ["--alignment.encoder_path", str(write_tiny_dinov2(tmp_path / "vitb14.pth", dim=768, depth=0, grid=2))]
    for name, (world_size, device, gib) in SHIPPED_FITS.items():
        aligns = "[alignment]" in (ROOT / "train_configs" / name).read_text()
        cfg = parse_args(["--job.config_file", str(ROOT / "train_configs" / name), *(encoder if aligns else [])])
        _memory(monkeypatch, gib, "its total memory")
        check_memory(cfg, None, world_size, torch.device(device))  # raises if refused


@parent_only
def test_a_run_too_large_for_the_memory_is_refused_before_its_model_is_built(tmp_path, monkeypatch, capsys, caplog):
    """model.flavor 7B on a CPU was killed by the kernel at about 23 GB with no message. The estimate, taken before
    the model is built (no model is built here), refuses it in one error line naming the flavor, the estimate and
    the memory; training.skip_memory_check = true tries anyway, with a warning, as does an estimate within the
    estimate's own error of the memory."""
    import train
    from torchtitan.tools.logging import logger
    from torchtitan.tools.memory_estimate import check_memory
    from torchtitan.trainer import Trainer

    _memory(monkeypatch, 22.0)
    monkeypatch.setattr(Trainer, "build_model", lambda self: pytest.fail("the model was built"))
    monkeypatch.setattr(train, "init_logger", lambda: None)  # keep the project logger as the other tests see it
    args = ["--model.flavor", "7B", "--training.steps", "1", "--job.dump_folder", str(tmp_path / "run")]
    peak = estimate_from_job_config(parse_args(args), 1, "cpu").peak / GIB
    assert 400 < peak < 500
    assert train.main(args) == 2
    assert [line for line in capsys.readouterr().err.splitlines() if line.startswith("error: ")] == [
        f"error: model.flavor = '7B' in the command line: this run's memory estimate is {peak:.1f} GiB a rank "
        "(training.local_batch_size 32, float32 on cpu; torchtitan/tools/memory_estimate.py), and the host's "
        "available RAM (MemAvailable) is 22.0 GiB: the kernel would kill it, without a message. Choose a smaller "
        "model.flavor or training.local_batch_size, or more ranks, or set training.skip_memory_check = true to "
        "try anyway"
    ]
    monkeypatch.setattr(logger, "propagate", True)  # to caplog, whatever init_logger set before
    check_memory(parse_args([*args, "--training.skip_memory_check", "true"]), None, 1, torch.device("cpu"))
    _memory(monkeypatch, peak / 1.1)  # within the estimate's error (it has been up to 11% over measured peaks)
    check_memory(parse_args(args), None, 1, torch.device("cpu"))
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    # Each once; a handler another test left on the project logger can deliver a record to caplog twice.
    assert list(dict.fromkeys(message.split(":")[0] for message in warned)) == ["training.skip_memory_check", "memory"]
    assert warned[0].endswith("is 22.0 GiB; trying anyway")


@parent_only
def test_a_measurement_is_not_refused_by_the_estimate():
    """The max-batch finder doubles its probe's batch until one runs out of memory: a probe refused by the estimate
    would stop its search as a failure. Measurements (torchtitan.measure) find the real limit: the check only warns."""
    from torchtitan.measure import measure_overrides

    args = ["--model.flavor", "7B"]
    assert parse_args([*args, *measure_overrides(args)]).training.skip_memory_check is True
