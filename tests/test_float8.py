"""float8 training through torchao, emulated on CPU: trains and tracks the fp32 loss."""

import pytest

from tests.conftest import TINY, read_metrics, run_train

pytest.importorskip("torchao")

ARGS = [*TINY, "--training.steps", "15", "--training.local_batch_size", "16"]


def test_float8_emulation_tracks_fp32(tmp_path):
    run_train([*ARGS, "--job.dump_folder", str(tmp_path / "fp32")])
    run_train([*ARGS, "--job.dump_folder", str(tmp_path / "fp8"), "--model.converters",
               "fused_norm,fused_mlp,fused_qkv,float8", "--quantize.linear.float8.emulate", "true"])  # fmt: skip
    fp32, fp8 = read_metrics(tmp_path / "fp32"), read_metrics(tmp_path / "fp8")
    assert fp8[-1]["loss"] < 0.8 * fp8[0]["loss"]  # it learns
    for a, b in zip(fp32, fp8):  # e4m3 rounding of activations and weights: a few per cent at most
        assert b["loss"] == pytest.approx(a["loss"], rel=0.03)
