"""Config parsing: TOML < CLI precedence, and clear errors that name the key and the file."""

import pytest

from tests.conftest import ROOT, run_train
from torchtitan.config_manager import ConfigError, JobConfig, check_batch_sizes, parse_args, to_toml


def write(tmp_path, text: str):
    path = tmp_path / "job.toml"
    path.write_text(text)
    return str(path)


def test_toml_then_cli_precedence(tmp_path):
    path = write(tmp_path, "[training]\nsteps = 7\nlocal_batch_size = 4\n[optimizer]\nlr = 0.5\n")
    cfg = parse_args(["--job.config_file", path, "--training.steps", "9"])
    assert cfg.training.steps == 9  # CLI wins
    assert cfg.training.local_batch_size == 4  # TOML beats the default
    assert cfg.optimizer.lr == 0.5
    assert cfg.training.dataset == "digits"  # default


def test_nested_sections_and_lists(tmp_path):
    text = "[quantize.linear.float8]\nenable = true\nfilter_fqns = ['a', 'b']\n[training.dataloader]\nnum_workers = 2\n"
    cfg = parse_args(["--job.config_file", write(tmp_path, text), "--compile.components", "model"])
    assert cfg.quantize.linear.float8.enable and cfg.quantize.linear.float8.filter_fqns == ["a", "b"]
    assert cfg.training.dataloader.num_workers == 2
    assert cfg.compile.components == ["model"]


def test_resolved_config_round_trips(tmp_path):
    cfg = parse_args(["--training.steps", "3", "--model.flavor", "DiT-S/2"])
    again = parse_args(["--job.config_file", write(tmp_path, to_toml(cfg))])
    again.job.config_file = cfg.job.config_file
    assert again == cfg


@pytest.mark.parametrize(
    "text, fragments",
    [
        ("[training]\nstepz = 3\n", ["training.stepz", "job.toml"]),
        ("[trainng]\nsteps = 3\n", ["trainng.steps", "section", "job.toml"]),
        ("[training]\nsteps = 'many'\n", ["training.steps", "job.toml", "int"]),
        ("[training]\nsteps = 0\n", ["training.steps", "job.toml"]),
        ("[model]\nflavor = 'DiT-XXL/2'\n", ["model.flavor", "job.toml"]),
        ("[diffusion]\nobjective = 'rectified_flow'\n", ["diffusion.prediction", "velocity"]),
        ("[activation_checkpoint]\nselective_ac_option = 'every'\n", ["selective_ac_option"]),
        ("[training]\ndataset = 'imagefolder'\n", ["training.dataset_path"]),
        ("[parallelism]\ndata_parallel_shard_degree = 0\n", ["data_parallel_shard_degree"]),
        ("[training]\nema_decay = 1.5\n", ["training.ema_decay"]),
        ("[compile]\nmode = 'max-autotune'\n", ["compile.mode", "job.toml", "CUDA graphs", "no-cudagraphs"]),
        ("[compile]\nmode = 'fast'\n", ["compile.mode", "job.toml", "max-autotune-no-cudagraphs"]),
    ],
)
def test_bad_toml_names_key_and_file(tmp_path, text, fragments):
    with pytest.raises(ConfigError) as err:
        parse_args(["--job.config_file", write(tmp_path, text)])
    for fragment in fragments:
        assert fragment in str(err.value)


def test_bad_cli_values():
    with pytest.raises(ConfigError, match="training.local_batch_size.*command line"):
        parse_args(["--training.local_batch_size", "x"])
    with pytest.raises(ConfigError, match="--training.nope"):
        parse_args(["--training.nope", "1"])
    with pytest.raises(ConfigError, match="does not exist"):
        parse_args(["--job.config_file", "/nonexistent/job.toml"])


def test_local_batch_size_auto_or_a_number(tmp_path):
    toml = write(tmp_path, "[training]\nlocal_batch_size = 'auto'\n")
    assert parse_args(["--job.config_file", toml]).training.local_batch_size == "auto"
    assert parse_args(["--job.config_file", toml, "--training.local_batch_size", "6"]).training.local_batch_size == 6
    assert parse_args(["--training.local_batch_size", "auto"]).training.local_batch_size == "auto"
    cfg = parse_args(["--job.config_file", write(tmp_path, "[training]\nlocal_batch_size = 12\n")])
    assert cfg.training.local_batch_size == 12
    auto = parse_args(["--job.config_file", toml])
    again = parse_args(["--job.config_file", write(tmp_path, to_toml(auto))])
    assert again.training == auto.training  # "auto" survives the resolved config.toml


@pytest.mark.parametrize("value, fragments", [
    ("-3", ["training.local_batch_size = -3", "job.toml", "> 0 or 'auto'"]),
    ("0", ["training.local_batch_size = 0", "job.toml"]),
    ("'big'", ["training.local_batch_size = 'big'", "job.toml", "int or 'auto'"]),
    ("2.5", ["training.local_batch_size = 2.5", "job.toml", "int or 'auto'"]),
])  # fmt: skip
def test_bad_local_batch_size_names_key_and_file(tmp_path, value, fragments):
    with pytest.raises(ConfigError) as err:
        parse_args(["--job.config_file", write(tmp_path, f"[training]\nlocal_batch_size = {value}\n")])
    for fragment in fragments:
        assert fragment in str(err.value)
    with pytest.raises(ConfigError, match="training.local_batch_size = 'big' in the command line: expected int or"):
        parse_args(["--training.local_batch_size", "big"])


def test_global_batch_divisibility():
    cfg = JobConfig()
    cfg.training.local_batch_size, cfg.training.global_batch_size = 8, 64
    assert check_batch_sizes(cfg, dp_degree=2) == 4
    cfg.training.global_batch_size = 60
    with pytest.raises(ConfigError, match="training.global_batch_size = 60.*8 x 2"):
        check_batch_sizes(cfg, dp_degree=2)


def test_train_exits_nonzero_before_work(tmp_path):
    bad = write(tmp_path, "[training]\nglobal_batch_size = 30\nlocal_batch_size = 8\n")
    result = run_train(["--job.config_file", bad, "--job.dump_folder", str(tmp_path / "run")], check=False)
    assert result.returncode == 2
    assert "training.global_batch_size" in result.stderr and "job.toml" in result.stderr
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_help_lists_every_key():
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "train.py", "--help"], cwd=ROOT, capture_output=True, text=True).stdout
    keys = ("--training.global_batch_size", "--quantize.linear.float8.emulate", "--dp.augmult", "--latent.tokenizer",
            "--training.dataloader.num_workers", "--checkpoint.keep_latest_k")  # fmt: skip
    for key in keys:
        assert key in out
    assert "Gradient clipping norm" in out  # field docstrings are the help text
    assert "--training.local_batch_size INT|AUTO" in out


@pytest.mark.parametrize("key", ["fused_norm", "fused_mlp", "fused_qkv"])
def test_fused_kernel_overrides_reach_the_model(key):
    from torchtitan.train_spec import build_model_args, get_train_spec

    spec = get_train_spec("dit")
    for value, expected in (("false", False), ("true", True)):
        assert getattr(build_model_args(spec, parse_args([f"--model.{key}", value]).model), key) is expected
    assert getattr(build_model_args(spec, parse_args([]).model), key) is True  # the flavor's default
    with pytest.raises(ConfigError, match=f"model.{key}"):
        parse_args([f"--model.{key}", "yes"])
