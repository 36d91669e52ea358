"""DP-SGD through the trainer: epsilon logged, resume exact, FSDP equals one process, clear refusals."""

import pytest

from tests.conftest import TINY, read_metrics, run_train

DP = [*TINY, "--training.steps", "4", "--training.global_batch_size", "16", "--dp.enable", "true",
      "--dp.noise_multiplier", "0.7", "--dp.max_grad_norm", "1.0", "--checkpoint.enable", "true",
      "--checkpoint.interval", "2", "--training.ema_decay", "0"]  # fmt: skip


def test_dp_run_logs_epsilon_and_resumes_exactly(tmp_path):
    run_train([*DP, "--job.dump_folder", str(tmp_path / "full"), "--training.local_batch_size", "16"])
    full = read_metrics(tmp_path / "full")
    eps = [m["dp_epsilon"] for m in full]
    assert all(b > a > 0 for a, b in zip(eps, eps[1:]))  # privacy spent grows every step
    assert "dp_clipped_fraction" in full[-1]

    resumed = tmp_path / "resumed"
    run_train([*DP, "--job.dump_folder", str(resumed), "--training.local_batch_size", "16", "--training.steps", "2"])
    run_train([*DP, "--job.dump_folder", str(resumed), "--training.local_batch_size", "16"])
    assert [(m["loss"], m["grad_norm"], m["dp_epsilon"]) for m in read_metrics(resumed)] == [
        (m["loss"], m["grad_norm"], m["dp_epsilon"]) for m in full
    ]


@pytest.mark.slow
@pytest.mark.parametrize("augmult", [1, 3])
def test_dp_fsdp_matches_one_process(tmp_path, augmult):
    """Noise is drawn once per element of the global gradient: the layout does not change it. With augmult,
    each sample's K noise/timestep draws are the same whichever rank holds the sample."""
    seed = tmp_path / "seed"
    run_train([*DP, "--job.dump_folder", str(seed), "--checkpoint.create_seed_checkpoint", "true"])
    init = ["--checkpoint.initial_load_path", str(seed / "checkpoint" / "step-0"), "--dp.augmult", str(augmult)]
    run_train([*DP, *init, "--job.dump_folder", str(tmp_path / "one"), "--training.local_batch_size", "16"])
    run_train([*DP, *init, "--job.dump_folder", str(tmp_path / "fsdp"), "--training.local_batch_size", "8"], nproc=2)
    for a, b in zip(read_metrics(tmp_path / "one"), read_metrics(tmp_path / "fsdp")):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4)


@pytest.mark.slow
def test_dp_with_activation_checkpointing_matches_without(tmp_path):
    """Recomputation in backward does not re-fire the DP hooks: same clipped, noised steps with AC on."""
    base = [*DP, "--training.local_batch_size", "16", "--checkpoint.enable", "false", "--dp.mode", "bookkeeping"]
    runs = {"none": [], "full": ["--activation_checkpoint.mode", "full"],
            "op": ["--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "op"],
            "ghost_every2": ["--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option",
                             "2", "--dp.mode", "ghost"]}  # fmt: skip
    for name, extra in runs.items():
        run_train([*base, "--job.dump_folder", str(tmp_path / name), *extra])
    reference = read_metrics(tmp_path / "none")
    for name in runs:
        for a, b in zip(reference, read_metrics(tmp_path / name)):
            assert b["loss"] == pytest.approx(a["loss"], rel=1e-5), name
            assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4), name


@pytest.mark.parametrize(
    "extra, fragment",
    [
        (["--compile.enable", "true"], "compile.enable"),
        (["--dp.sampling", "poisson", "--training.local_batch_size", "8"], "no gradient accumulation"),
    ],
)
def test_unsupported_dp_combinations_are_refused(tmp_path, extra, fragment):
    result = run_train([*DP, "--training.local_batch_size", "16", "--job.dump_folder", str(tmp_path), *extra],
                       check=False)  # fmt: skip
    assert result.returncode == 2 and fragment in result.stderr
