"""sample.py: grids from a run folder (its ema.safetensors first) or a DCP step folder, ADM .npz over torchrun ranks,
and arguments refused by flag."""

import json
import os
import re
import shutil

import numpy as np
import pytest
import torch
from PIL import Image

import sample
from tests.conftest import ROOT, TINY, run_train
from torchtitan.tools.runs import launcher, run_to_end


@pytest.fixture(scope="module")
def digits_run(tmp_path_factory):
    """A pixel DiT trained 4 steps on the digits: checkpoints at steps 2 and 4, and ema.safetensors."""
    run = tmp_path_factory.mktemp("sample") / "run"
    run_train([*TINY, "--job.dump_folder", str(run), "--training.steps", "4", "--checkpoint.enable", "true",
               "--checkpoint.interval", "2", "--training.ema_decay", "0.9"])  # fmt: skip
    return run


def test_grid_from_export_and_from_dcp_agree(digits_run, tmp_path):
    common = ["--num-samples", "4", "--classes", "3,7", "--steps", "3", "--seed", "1", "--cfg-scale", "2"]
    assert sample.main(["--checkpoint", str(digits_run), *common, "--out", str(tmp_path / "export.png")]) == 0
    step4 = digits_run / "checkpoint" / "step-4"
    assert sample.main(["--checkpoint", str(step4), *common, "--out", str(tmp_path / "dcp.png")]) == 0
    step2 = digits_run / "checkpoint" / "step-2"
    assert sample.main(["--checkpoint", str(step2), *common, "--out", str(tmp_path / "step2.png")]) == 0
    export, dcp, step2 = (np.asarray(Image.open(tmp_path / f"{n}.png")) for n in ("export", "dcp", "step2"))
    assert export.shape == (2 + 2 * 66, 2 + 2 * 66)  # 2 classes as columns, 2 rows, grey 16 px enlarged to 64
    # ema.safetensors and the DCP step-4 'ema' entries are the same weights: the same images.
    assert np.array_equal(export, dcp)
    assert not np.array_equal(export, step2)  # and another checkpoint really is other weights


def test_npz_over_four_ranks_matches_one_process(digits_run, tmp_path, capfd):
    """Shards of 2 (shard k from rank k, the last one short), batches of 3 in one process and of 4 (padded) on 4
    ranks: the same file, as FID-50K on 1 and 4 GPUs. Also: the rate once warm is logged (batches 2 and 3: 4
    images), --compile gives the same images to one uint8 level (compiled kernels round differently), and bf16
    autocast reaches the model (other images)."""
    args = ["--checkpoint", str(digits_run), "--num-samples", "7", "--steps", "2", "--shard-size", "2"]
    assert sample.main([*args, "--batch-size", "3", "--npz", str(tmp_path / "one.npz")]) == 0
    assert sample.main([*args, "--batch-size", "3", "--compile", "--npz", str(tmp_path / "compiled.npz")]) == 0
    assert sample.main([*args, "--precision", "bf16", "--npz", str(tmp_path / "bf16.npz")]) == 0  # one batch
    logged = "".join(capfd.readouterr())
    assert re.search(r"sampling: 4 images after the first batch in \d+\.\d\d s: \d+\.\d\d images/s", logged), logged
    cmd = [*launcher(4), "sample.py", *args, "--batch-size", "4", "--npz", str(tmp_path / "four.npz")]
    result = run_to_end(cmd, 300, ROOT, {**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    one, four = np.load(tmp_path / "one.npz"), np.load(tmp_path / "four.npz")
    assert one["arr_0"].shape == (7, 16, 16, 3) and one["arr_0"].dtype == np.uint8
    assert one["arr_1"].tolist() == [0, 1, 2, 3, 4, 5, 6]
    assert np.array_equal(one["arr_0"], four["arr_0"]) and np.array_equal(one["arr_1"], four["arr_1"])
    assert json.loads(str(one["settings"]))["--steps"] == 2
    compiled, bf16 = np.load(tmp_path / "compiled.npz"), np.load(tmp_path / "bf16.npz")
    assert np.abs(compiled["arr_0"].astype(int) - one["arr_0"].astype(int)).max() <= 1
    assert 0 < np.abs(bf16["arr_0"].astype(int) - one["arr_0"].astype(int)).max() <= 2  # 1 measured
    assert json.loads(str(bf16["settings"]))["precision"] == "bf16"
    # Shard folders gone once assembled.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bf16.npz", "compiled.npz", "four.npz", "one.npz"]


def test_npz_resumes_from_its_shards_and_refuses_other_settings(digits_run, tmp_path, monkeypatch, capsys):
    """A run cut short (ranks 1 and 2 of 3 done, rank 0 killed, a half-written shard left) resumes in one process
    with another batch size: it samples only the missing shards and writes the file of an uninterrupted run. Other
    settings are refused, naming the file and the flag, with nothing sampled; a finished file is never resampled."""
    out = tmp_path / "x.npz"
    args = ["--checkpoint", str(digits_run), "--num-samples", "7", "--steps", "2", "--shard-size", "2", "--npz"]
    assert sample.main([*args, str(tmp_path / "whole.npz"), "--batch-size", "7"]) == 0
    sampled = []
    batch = sample.Sampler.batch
    monkeypatch.setattr(
        sample.Sampler, "batch", lambda self, indices, y: sampled.extend(indices) or batch(self, indices, y)
    )
    monkeypatch.setattr(sample.dist, "init_process_group", lambda *a, **k: None)  # ranks of 3, one after the other
    monkeypatch.setenv("WORLD_SIZE", "3")
    for rank in ("1", "2"):
        monkeypatch.setenv("RANK", rank)
        assert sample.main([*args, str(out), "--batch-size", "1"]) == 0
    assert sampled == [2, 3, 4, 5] and not out.exists()  # shards 1 and 2; shards 0 and 3 are rank 0's
    shards = tmp_path / "x.npz.shards"
    assert sorted(p.name for p in shards.iterdir()) == ["shard-00001.npz", "shard-00002.npz"]
    (shards / "shard-00000.npz.tmp").write_bytes(b"killed while writing")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    capsys.readouterr()

    assert sample.main([*args, str(out), "--cfg-scale", "3"]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if "INFO" not in line]
    assert err == [f"error: {shards / 'shard-00001.npz'} was sampled with --cfg-scale 2.0, this run asks "
                   f"--cfg-scale 3.0: run the command that made it, or remove {shards} to start over"]  # fmt: skip
    assert sampled == [2, 3, 4, 5] and len(list(shards.iterdir())) == 3

    sampled.clear()  # the run's own --cfg-scale given: the setting its shards recorded, resolved
    assert sample.main([*args, str(out), "--batch-size", "2", "--cfg-scale", "2"]) == 0
    assert "resuming: 2 of 4 shards" in capsys.readouterr().err
    assert sampled == [0, 1, 6, 6]  # shards 0 and 3, the last batch padded
    whole, resumed = np.load(tmp_path / "whole.npz"), np.load(out)
    for key in ("arr_0", "arr_1", "settings"):
        assert np.array_equal(whole[key], resumed[key]), key
    assert not shards.exists()

    sampled.clear()
    assert sample.main([*args, str(out), "--batch-size", "3"]) == 0  # the same command again: nothing to do
    assert sampled == [] and f"{out} already holds these samples" in capsys.readouterr().err
    assert sample.main([*args, str(out), "--seed", "1"]) == 2
    assert (
        capsys.readouterr()
        .err.splitlines()[-1]
        .startswith(f"error: --npz {out} exists: {out} was sampled with --seed 0, this run asks --seed 1")
    )
    foreign = tmp_path / "foreign.npz"
    np.savez(foreign, arr_0=np.zeros((7, 16, 16, 3), np.uint8))
    assert sample.main([*args, str(foreign)]) == 2
    last = capsys.readouterr().err.splitlines()[-1]
    assert last == f"error: --npz {foreign} exists: {foreign}: has no settings (not written by sample.py --npz)"
    assert sampled == [] and np.load(foreign)["arr_0"].shape == (7, 16, 16, 3)


def test_errors(digits_run, tmp_path, capsys):
    assert sample.main(["--checkpoint", str(tmp_path / "nowhere")]) == 2
    assert f"{tmp_path / 'nowhere'} does not exist" in capsys.readouterr().err
    assert sample.main(["--checkpoint", str(digits_run), "--classes", "12", "--out", str(tmp_path / "x.png")]) == 2
    assert "--classes [12]: the model has classes 0..9" in capsys.readouterr().err
    out = str(tmp_path / "x.png")
    assert sample.main(["--checkpoint", str(digits_run), "--cfg-scale", "2", "--guidance-channels", "2", "--out",
                        out]) == 2  # fmt: skip
    assert "--guidance-channels 2: the model has 1 channel(s)" in capsys.readouterr().err


def test_run_folder_prefers_ema_safetensors(digits_run, tmp_path):
    """A run folder samples with its exported ema.safetensors even where a newer DCP checkpoint exists."""
    from safetensors.torch import save_file

    run = tmp_path / "run"
    shutil.copytree(digits_run, run)
    cfg, _ = sample.resolve_checkpoint(run)
    model, _ = sample.load_model(cfg, run / "checkpoint" / "step-2", torch.device("cpu"))
    save_file(model.state_dict(), str(run / "ema.safetensors"))  # step 2's EMA weights; the newest DCP is step 4
    assert sample.resolve_checkpoint(run)[1] == run / "ema.safetensors"
    common = ["--num-samples", "4", "--classes", "3,7", "--steps", "3", "--seed", "1"]
    for name, checkpoint in (("run", run), ("step2", run / "checkpoint" / "step-2"),
                             ("step4", run / "checkpoint" / "step-4")):  # fmt: skip
        assert sample.main(["--checkpoint", str(checkpoint), *common, "--out", str(tmp_path / f"{name}.png")]) == 0
    grid, step2, step4 = (np.asarray(Image.open(tmp_path / f"{n}.png")) for n in ("run", "step2", "step4"))
    assert np.array_equal(grid, step2) and not np.array_equal(grid, step4)


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--cfg-scale", "nan"], "--cfg-scale nan: must be a finite number"),
        (["--cfg-scale", "inf"], "--cfg-scale inf: must be a finite number"),
        (["--cfg-scale=-inf"], "--cfg-scale -inf: must be a finite number"),  # "=": argparse reads "-inf" as a flag
        (["--num-samples", "0"], "--num-samples 0: must be > 0"),
        (["--num-samples", "-4"], "--num-samples -4: must be > 0"),
        (["--steps", "-2"], "--steps -2: must be > 0"),
        (["--steps", "0"], "--steps 0: must be > 0"),
        (["--batch-size", "0"], "--batch-size 0: must be > 0"),
        (["--batch-size", "-1"], "--batch-size -1: must be > 0"),
        (["--shard-size", "0"], "--shard-size 0: must be > 0"),
        (["--decode-batch-size", "0"], "--decode-batch-size 0: must be > 0"),
        (["--classes", "1,x"], "--classes '1,x': must be comma-separated class indices"),
        (["--guidance-channels", "0"], "--guidance-channels 0: must be -1 (all) or >= 1"),
        (["--guidance-high", "1.5"], "--guidance-high 1.5: must be in [0, 1]"),
        (["--timestep-shift", "0"], "--timestep-shift 0.0: must be > 0"),
        (["--sde-last-step", "Mean"], "--sde-last-step Mean: must be one of ['mean', 'tweedie', 'euler']"),
        (["--sde-diffusion-form", "SBDM"], "--sde-diffusion-form SBDM: must be one of ['sigma', 'linear', 'decr"),
        (["--sde-diffusion-norm", "nan"], "--sde-diffusion-norm nan: must be a finite number"),
        (["--sde-last-step-size", "1"], "--sde-last-step-size 1.0: must be in (0, 1)"),
        # Settings that do not go together, over the run's config (rectified flow, Euler): refused before sampling.
        (["--guidance-low", "0.6", "--guidance-high", "0.4"], "sampling.guidance_low, guidance_high = 0.6, 0.4: must"),
        (["--sampler", "sde", "--timestep-shift", "0.3"], "sampling.timestep_shift = 0.3: the ODE samplers'"),
        (["--sampler", "sde", "--steps", "1"], "sampling.steps = 1: the 'sde' sampler takes at least 2"),
    ],
)
def test_bad_arguments_name_the_flag(digits_run, tmp_path, capsys, flags, message):
    assert sample.main(["--checkpoint", str(digits_run), *flags, "--out", str(tmp_path / "x.png")]) == 2
    err = capsys.readouterr().err
    assert err.splitlines()[-1].startswith(f"error: {message}"), err
    assert "Traceback" not in err and not (tmp_path / "x.png").exists()  # no black or empty grid


def test_flow_sampler_flags_reach_the_sampler(digits_run):
    """The flags of rectified flow's samplers, over the run's [sampling]: a batch is sample_images' with them (each
    sample's own generator drawing the SDE's step noise), and not the one without them."""
    from torchtitan.diffusion import SDESettings, sample_images, sample_noise

    cpu, labels = torch.device("cpu"), torch.tensor([3, 7])
    cfg, weights = sample.resolve_checkpoint(digits_run)
    model, model_args = sample.load_model(cfg, weights, cpu)
    flags = ["--checkpoint", str(digits_run), "--sampler", "sde", "--steps", "4", "--cfg-scale", "3", "--seed", "2",
             "--guidance-low", "0.2", "--guidance-high", "0.6", "--sde-diffusion-form", "decreasing",
             "--sde-diffusion-norm", "0.5", "--sde-last-step", "tweedie", "--sde-last-step-size", "0.1"]  # fmt: skip
    sampler = sample.Sampler(cfg, model, model_args, cpu, sample.parse(flags))
    options = dict(guidance_interval=(0.2, 0.6), timestep_shift=1.0, sde=SDESettings("decreasing", 0.5, "tweedie", 0.1))
    assert sampler.options == options

    def expected(**options):
        noise, generator = sample_noise(2, [2, 3], 1, 16)
        return sample_images(sampler.diffusion, model, noise, labels, 4, "sde", 3.0, 10, clip_denoised=True,
                             generator=generator, **options).clamp(-1, 1)  # fmt: skip

    images = sampler.batch([2, 3], labels)
    assert torch.equal(images, expected(**options)) and (images - expected()).abs().max() > 1e-3
    shifted = sample.Sampler(cfg, model, model_args, cpu, sample.parse([*flags[:2], "--timestep-shift", "0.3"]))
    assert shifted.options["timestep_shift"] == 0.3 and shifted.options["guidance_interval"] == (0.0, 1.0)


def test_several_ranks_need_npz_and_classes_need_a_conditional_model(digits_run, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert sample.main(["--checkpoint", str(digits_run), "--out", str(tmp_path / "x.png")]) == 2
    assert "error: 2 ranks write one grid: several ranks only make sense with --npz" in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"--classes \[1\]: the model is unconditional"):
        sample.labels_for(4, [1], num_classes=0)
    assert sample.labels_for(4, [], num_classes=0) is None


def test_a_llama_run_is_refused_in_one_line(tmp_path, capsys):
    run = tmp_path / "llama_run"
    (run / "checkpoint" / "step-2").mkdir(parents=True)
    shutil.copy(ROOT / "train_configs" / "llama3_debug.toml", run / "config.toml")  # as a Llama run writes it
    for checkpoint in (run, run / "checkpoint" / "step-2"):
        assert sample.main(["--checkpoint", str(checkpoint), "--out", str(tmp_path / "x.png")]) == 2
        assert capsys.readouterr().err.splitlines() == [
            f"error: {run / 'config.toml'} is a 'llama3' run (model.name): "
            "sample.py samples images from DiT runs (model.name = 'dit')"
        ]
