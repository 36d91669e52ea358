"""scripts/benchmarks/benchmark_fid50k.py, CPU: its fixtures load where sample.py and evaluate_fid.py read them, and a
call cut
short by its budget resumes. The two phases are stand-ins that check their command lines (the real ones run on GPUs:
sample.py's shards and evaluate_fid.py are tested in tests/test_sample.py and tests/test_fid.py); the VAE is
tests/test_benchmark_sampling.py's stand-in (diffusers' import alone takes seconds)."""

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

import scripts.benchmarks.benchmark_fid50k as bench
from tests.test_benchmark_sampling import StandInVAE
from torchtitan.models.dit.weights import load_model, resolve_checkpoint
from torchtitan.tools.fid import read_eval_batch

FLAGS = ["--nproc", "4", "--flavor", "debug", "--image-size", "32", "--reference-images", "3"]


def test_fixtures_and_a_call_cut_short_that_resumes(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(bench, "build_vae", lambda config, seed: StandInVAE(config))
    ran = []

    def execute(cmd, env, log, timeout):  # the phases: sampling cut short once, then done
        phase = "evaluation" if any(arg.endswith("evaluate_fid.py") for arg in cmd) else "sampling"
        ran.append((phase, cmd, timeout))
        if phase == "sampling" and len(ran) == 1:
            return "timeout", "", 500.0
        if phase == "sampling":
            Path(cmd[cmd.index("--npz") + 1]).write_bytes(b"samples")
            return "ok", "", 300.0
        numbers = {"fid": 1.0, "sfid": 2.0, "inception_score": 3.0, "precision": 0.5, "recall": 0.25}
        return "ok", json.dumps(numbers) + "\nRecall: 0.25\n", 100.0

    monkeypatch.setattr(bench, "execute", execute)
    work = tmp_path / "work"
    assert bench.main(["--work", str(work), *FLAGS]) == bench.RESUME
    assert "sampling timeout: run the same command again" in capsys.readouterr().out
    (_, sample_cmd, timeout), = ran  # fmt: skip
    assert sample_cmd[:5] == bench.launcher(4) and sample_cmd[5].endswith("sample.py") and timeout <= 520
    flags = " ".join(sample_cmd[5:])
    assert "--num-samples 50000 --batch-size 256 --sampler euler --steps 50 --cfg-scale 1.5 --compile --npz" in flags

    assert bench.main(["--work", str(work), *FLAGS]) == 0
    out = capsys.readouterr().out
    assert [phase for phase, _, _ in ran] == ["sampling", "sampling", "evaluation"]
    assert "fid 1.0  sfid 2.0  inception_score 3.0  precision 0.5  recall 0.25" in out
    assert "sampling + evaluation over 2 call(s): 900.0 s (target 900 s)" in out  # 500 + 300 + 100
    assert bench.main(["--work", str(work), *FLAGS]) == 0  # sampled: the evaluation alone
    assert [phase for phase, _, _ in ran[3:]] == ["evaluation"]

    # The fixtures: a run folder sample.py loads (no weight left at zero: adaLN-Zero's drawn), ADM's reference format.
    cfg, weights = resolve_checkpoint(work / "run")
    model, args = load_model(cfg, weights, torch.device("cpu"))
    assert (args.in_channels, args.input_size, args.num_classes, cfg.latent.scale_factor) == (4, 4, 1000, 0.18215)
    assert all(p.any() for p in model.parameters())
    reference = read_eval_batch(work / "reference.npz", SimpleNamespace(feature_dims=2048), images=False)
    assert reference.statistics[1].shape == (2048, 2048) and reference.spatial_statistics[0].shape == (2023,)
    with np.load(work / "reference.npz") as data:
        assert data["arr_0"].shape == (3, 32, 32, 3) and data["arr_0"].dtype == np.uint8
