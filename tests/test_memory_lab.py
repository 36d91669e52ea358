"""The memory lab: its variants' train.py flags (dry run), a tiny CPU lab whose table, JSON and plots come from the
runs' metrics and memory breakdowns, and the Llama 3 sliding window's FlexAttention path against its dense mask."""

import json
import math
import os
import subprocess
import sys
import tomllib

import pytest
import torch

import scripts.run_memory_lab as lab
import torchtitan.models.llama3.model as llama3_model
from scripts.lib import GIB, breakdown_records
from tests.conftest import ROOT, read_metrics
from tests.test_llama3_model import random_model, tiny_args, tokens
from torchtitan.datasets.text import build_text_dataset

VARIANTS = ["fp32", "bf16", "bf16_fused", "bf16_window512", "bf16_window256", "fp32_ac", "bf16_ac", "bf16_fused_ac"]


def test_variants_dry_run_through_the_shell_script():
    env = {**os.environ, "PYTHON": sys.executable, "BATCH": "16", "STEPS": "50", "OUTPUT_DIR": "/tmp/memory_lab"}
    out = subprocess.run(["bash", "scripts/run_memory_lab.sh", "--dry-run", "--optimizer.lr", "2e-4"], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=60)  # fmt: skip
    assert out.returncode == 0, out.stderr
    lines = {line.split(":")[0]: line for line in out.stdout.splitlines() if ": " in line}
    assert list(lines) == VARIANTS
    for name, line in lines.items():
        for flag in ("--job.config_file train_configs/llama3_lab.toml", "--model.flavor lab", "--training.seq_len 1024",
                     "--training.steps 50", "--training.local_batch_size 16", "--metrics.log_freq 1",
                     "--validation.enable true --validation.freq 50", "--checkpoint.enable false",
                     "--profiling.enable_memory_breakdown true --profiling.memory_breakdown_steps 2",
                     f"--job.dump_folder /tmp/memory_lab/{name} "):  # fmt: skip
            assert flag in line, (name, flag)
        assert line.endswith("--optimizer.lr 2e-4")  # "$@" comes last, so it wins
        # TF32 for the fp32 variants only, through the environment the run starts with.
        assert line.startswith(f"{name}: TORCH_ALLOW_TF32_CUBLAS_OVERRIDE=1 ") == name.startswith("fp32")
    overrides = {
        "fp32": "--training.mixed_precision_param float32 --model.sdpa_backends math --optimizer",
        "bf16": "--training.mixed_precision_param bfloat16 --model.sdpa_backends math --optimizer",
        "bf16_fused": "--training.mixed_precision_param bfloat16 --model.sdpa_backends flash,cudnn --optimizer",
        "bf16_window512": "--training.mixed_precision_param bfloat16 --model.attn_window 512 --optimizer",
        "bf16_window256": "--training.mixed_precision_param bfloat16 --model.attn_window 256 --optimizer",
        "fp32_ac": "float32 --model.sdpa_backends math --activation_checkpoint.mode full --optimizer",
        "bf16_ac": "bfloat16 --model.sdpa_backends math --activation_checkpoint.mode full --optimizer",
        "bf16_fused_ac": "bfloat16 --model.sdpa_backends flash,cudnn --activation_checkpoint.mode full --optimizer",
    }
    for name, flags in overrides.items():
        assert flags in lines[name], name
    assert all("attn_window" not in lines[n] and "activation_checkpoint" not in lines[n] for n in VARIANTS[:3])


def test_tiny_lab_reports_what_the_runs_measured(tmp_path, monkeypatch):
    probed = {}

    def fake_finder(run_at, folder, limit, timeout, force):  # scripts/lib's find_max_batch, tested in test_scripts_lib
        probed[folder.name] = run_at(8)
        return {"batch": 12, "peak_memory_gib": 1.5, "start": 8, "probes": []}

    monkeypatch.setattr(lab.lib, "find_max_batch", fake_finder)
    out = tmp_path / "lab"
    argv = ["--flavor", "debugmodel", "--seq-len", "32", "--batch", "2", "--steps", "3", "--breakdown-steps", "1",
            "--windows", "8", "--variants", "fp32 bf16_window8", "--max-batch", "--output-dir", str(out),
            "--validation.steps", "1"]  # fmt: skip
    assert lab.main(argv) == 0
    rows = {r["variant"]: r for r in json.loads((out / "memory_lab.json").read_text())}
    table = (out / "memory_lab.md").read_text()
    windows = len(build_text_dataset("stdlib", None, None, 32, "train"))  # the byte tokenizer's train split
    for name in ("fp32", "bf16_window8"):
        row, records = rows[name], read_metrics(out / name)
        validation = read_metrics(out / name, validation=True)
        assert row["status"] == "ok" and row["warm_steps"] == [3]  # skip: the breakdown's step and one more
        assert (row["global_batch"], row["seq_len"], row["steps"], row["tokens"]) == (2, 32, 3, 3 * 2 * 32)
        assert row["step_time_s"] == records[2]["step_time_s"]
        assert row["tokens_per_second"] == records[2]["tokens_per_second"]
        assert row["epoch_time_s"] == pytest.approx(windows / 2 * row["step_time_s"])
        assert [r["step"] for r in validation] == [3]  # validated once, after the last step
        assert row["validation_perplexity"] == validation[0]["validation_perplexity"]
        assert row["validation_perplexity"] == pytest.approx(math.exp(row["validation_loss"]))
        stages = {r["stage"]: r for r in breakdown_records(out / name) if r["step"] == 1}
        assert row["forward_peak_gib"] == stages["forward"]["peak"] / GIB > 0
        assert row["backward_peak_gib"] == stages["backward"]["peak"] / GIB > 0
        assert row["activations_gib"] == stages["forward"]["activations"] / GIB > 0
        assert row["max_batch"] == 12
        line = next(line for line in table.splitlines() if line.startswith(f"| {name} | ok |"))
        assert f"| {1000 * row['step_time_s']:.1f} |" in line and f"| {row['validation_perplexity']:.3f} |" in line
        assert f"| {row['epoch_time_s']:.1f} |" in line and f"| {row['forward_peak_gib']:.2f} |" in line
    assert rows["fp32"]["env"] == {"TORCH_ALLOW_TF32_CUBLAS_OVERRIDE": "1"} and rows["bf16_window8"]["env"] == {}
    config = tomllib.loads((out / "bf16_window8" / "config.toml").read_text())
    assert config["model"]["attn_window"] == 8 and config["model"]["flavor"] == "debugmodel"
    assert f"3 steps x batch 2 x seq_len 32 = {3 * 2 * 32:,} tokens" in table
    assert all((out / f"memory_lab_{chart}.png").stat().st_size > 0 for chart in ("memory", "step_time", "perplexity"))
    # The finder's probes: short runs of the variant at the probed batch, no breakdown, no validation, "$@" last.
    probe = probed["fp32"]
    flags = " ".join(probe.args)
    assert probe.name == "fp32_bs8" and probe.env == {"TORCH_ALLOW_TF32_CUBLAS_OVERRIDE": "1"}
    assert "--training.steps 2 --training.local_batch_size 8 " in flags and flags.endswith("--validation.steps 1")
    assert "--validation.enable false" in flags and "--profiling.enable_memory_breakdown false" in flags


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_flex_attention_sliding_window_matches_the_dense_mask(monkeypatch):
    """The CUDA path (a FlexAttention BlockMask, GQA through enable_gqa) gives the dense mask's logits. FlexAttention
    runs eagerly on CPU for forward only (no CPU backward), which is enough to compare the two paths."""
    if llama3_model.flex_attention is None:
        pytest.skip("this torch has no torch.nn.attention.flex_attention")
    window, seq_len = 5, 40  # T not a multiple of the mask's 128-token blocks; a window much shorter than T
    model = random_model(tiny_args(attn_window=window))  # 4 query heads over 2 kv heads: GQA
    x = tokens(seq_len=seq_len)
    assert isinstance(llama3_model.window_mask(seq_len, window, x.device), torch.Tensor)  # CPU: the dense mask
    with torch.no_grad():
        dense = model(x)
        monkeypatch.setattr(llama3_model, "window_mask", llama3_model.sliding_window_block_mask)
        try:
            flex = model(x)
        except NotImplementedError as e:  # a torch whose FlexAttention does not run on CPU at all
            pytest.skip(f"FlexAttention does not run on CPU here: {e}")
    torch.testing.assert_close(flex, dense, rtol=1e-5, atol=1e-5)
    # One BlockMask per (T, window, device), built once.
    mask = llama3_model.sliding_window_block_mask(seq_len, window, x.device)
    assert mask is llama3_model.sliding_window_block_mask(seq_len, window, x.device)
    assert mask is not llama3_model.sliding_window_block_mask(seq_len, window + 1, x.device)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the compiled FlexAttention kernel needs CUDA")
def test_flex_attention_gradients_match_the_dense_mask_on_cuda(monkeypatch):
    window, seq_len = 64, 200
    model = random_model(tiny_args(attn_window=window, max_seq_len=256)).cuda()
    x = tokens(seq_len=seq_len).cuda()

    def logits_and_gradients():
        model.zero_grad()
        logits = model(x)
        logits.square().mean().backward()
        return logits.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}

    assert not isinstance(llama3_model.window_mask(seq_len, window, x.device), torch.Tensor)  # a BlockMask
    flex, flex_grads = logits_and_gradients()
    monkeypatch.setattr(llama3_model, "window_mask", llama3_model.sliding_window_mask)  # the CPU path
    dense, dense_grads = logits_and_gradients()
    torch.testing.assert_close(flex, dense, rtol=1e-4, atol=1e-5)
    for name, grad in dense_grads.items():
        torch.testing.assert_close(flex_grads[name], grad, rtol=1e-3, atol=1e-5, msg=name)
