"""Config parsing: TOML < CLI precedence, and clear errors that name the key and the file."""

import json

import pytest

from tests.conftest import ROOT, run_python, run_train
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
    text = "[quantize.linear.float8]\nemulate = true\nfilter_fqns = ['a', 'b']\n[training.dataloader]\nnum_workers = 2"
    cfg = parse_args(["--job.config_file", write(tmp_path, text), "--compile.components", "model"])
    assert cfg.quantize.linear.float8.emulate and cfg.quantize.linear.float8.filter_fqns == ["a", "b"]
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


def test_train_refuses_what_is_not_a_config_file_or_a_writable_run_folder(tmp_path, capsys, monkeypatch):
    """Each with one `error:` line, status 2, no traceback: a directory given as the config file, and a run folder
    that cannot be written (a regular file in its path: as root, permissions alone would not stop the write)."""
    import train
    from torchtitan.components import run_lock

    with pytest.raises(ConfigError, match=f"job.config_file = '{tmp_path}' in the command line is a directory, not a"):
        parse_args(["--job.config_file", str(tmp_path)])
    (tmp_path / "file").write_text("")
    dump = tmp_path / "file" / "run"
    assert train.main(["--job.dump_folder", str(dump), "--training.steps", "1"]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error: ")]
    assert err == [f"error: job.dump_folder {dump} is not writable (Not a directory: {dump}); a run writes its "
                   "metrics and checkpoints there: give it a writable --job.dump_folder"]  # fmt: skip

    def read_only(path, mode="r"):  # what open() raises in a read-only folder for anyone but root
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(run_lock, "open", read_only, raising=False)
    with pytest.raises(run_lock.RunFolderNotWritableError, match=f"job.dump_folder {tmp_path} is not writable "
                       f"\\(Permission denied: {tmp_path / 'run.lock'}\\)"):  # fmt: skip
        run_lock.acquire_run_lock(tmp_path, rank=0)


def test_help_lists_every_key():
    out = run_python("train.py", ["--help"]).stdout  # forked from the train server: `python train.py --help`
    keys = ("--training.global_batch_size", "--quantize.linear.float8.emulate", "--dp.augmult", "--latent.tokenizer",
            "--training.dataloader.num_workers", "--checkpoint.keep_latest_k")  # fmt: skip
    for key in keys:
        assert key in out
    assert "Gradient clipping norm" in out  # field docstrings are the help text
    assert "--training.local_batch_size INT|AUTO" in out


def test_converters_are_named_checked_and_round_trip(tmp_path):
    assert parse_args([]).model.converters == ["fused_norm", "fused_mlp", "fused_qkv"]  # the kernels of every flavor
    for given in (["--model.converters", "fused_qkv,float8"], ["--model.converters", ""]):
        cfg = parse_args(given)
        again = parse_args(["--job.config_file", write(tmp_path, to_toml(cfg))])
        assert again.model.converters == cfg.model.converters == [c for c in given[1].split(",") if c]
    cfg = parse_args(["--job.config_file", write(tmp_path, "[model]\nconverters = ['float8']\n")])
    assert cfg.model.converters == ["float8"] and cfg.source_of("model.converters") == str(tmp_path / "job.toml")
    known = r"known: \['fused_norm', 'fused_mlp', 'fused_qkv', 'float8'\]"
    with pytest.raises(ConfigError, match=rf"model.converters = \[.fused_gelu.\] in the command line: .*{known}"):
        parse_args(["--model.converters", "fused_gelu"])
    with pytest.raises(ConfigError, match=r"model.converters = \['float8', 'float8'\] in .*job.toml: 'float8' is"):
        parse_args(["--job.config_file", write(tmp_path, "[model]\nconverters = ['float8', 'float8']\n")])


@pytest.mark.parametrize(
    "key, value, converters",
    [
        ("model.fused_norm", "false", '["fused_mlp", "fused_qkv"]'),
        ("model.fused_mlp", "true", '["fused_norm", "fused_mlp", "fused_qkv"]'),
        ("model.fused_qkv", "false", '["fused_norm", "fused_mlp"]'),
        ("quantize.linear.float8.enable", "true", '["fused_norm", "fused_mlp", "fused_qkv", "float8"]'),
    ],
)
@pytest.mark.parametrize("given_in", ["toml", "cli"])
def test_removed_kernel_keys_say_what_to_write(tmp_path, key, value, converters, given_in):
    # The fused switches and float8.enable are converters now: an old TOML or command line is told the list to write.
    if given_in == "toml":
        section, leaf = key.rsplit(".", 1)
        argv, source = ["--job.config_file", write(tmp_path, f"[{section}]\n{leaf} = {value}\n")], "job.toml"
    else:
        argv, source = [f"--{key}", value], "the command line"
    with pytest.raises(ConfigError) as err:
        parse_args(argv)
    message = str(err.value)
    assert message.startswith(key) and source in message and f"removed; use model.converters = {converters}" in message


def _hf_config_folder(tmp_path):
    """A Hugging Face Llama folder's config.json (no weights: parsing reads only the config) of the debugmodel's
    shapes with a norm eps the flavor lacks, and flags that start a debugmodel run from that folder."""
    from dataclasses import replace

    from torchtitan.models.llama3 import llama3_configs
    from torchtitan.models.llama3.state_dict_adapter import hf_config_from_args

    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(hf_config_from_args(replace(llama3_configs["debugmodel"],
                                                                               norm_eps=1e-6))))  # fmt: skip
    return ["--model.name", "llama3", "--model.flavor", "debugmodel", "--training.dataset", "stdlib",
            "--training.seq_len", "64", "--job.dump_folder", str(tmp_path / "run"),
            "--checkpoint.initial_load_path", str(folder)]  # fmt: skip


@pytest.mark.parametrize("given_in", ["toml", "cli"])
def test_torchtitan_initial_load_in_hf_reads_a_hugging_face_folder(tmp_path, given_in):
    # TorchTitan's boolean is initial_load_format = "hf": the model takes config.json's numerics as with "hf", the
    # key's source names the alias, and the resolved config.toml writes our key.
    from torchtitan.train_spec import build_model_args, get_train_spec

    llama = _hf_config_folder(tmp_path)
    if given_in == "toml":
        argv = ["--job.config_file", write(tmp_path, "[checkpoint]\ninitial_load_in_hf = true\n")]
        source = f"{tmp_path / 'job.toml'} (as checkpoint.initial_load_in_hf = True)"
    else:
        argv = ["--checkpoint.initial_load_in_hf", "true"]
        source = "the command line (as checkpoint.initial_load_in_hf = 'true')"
    cfg = parse_args([*llama, *argv])
    assert cfg.checkpoint.initial_load_format == "hf"
    assert cfg.source_of("checkpoint.initial_load_format") == source
    assert build_model_args(get_train_spec("llama3"), cfg).norm_eps == 1e-6  # the flavor's is 1e-5
    assert parse_args([*llama]).checkpoint.initial_load_format == "dcp"  # without it, the folder is not read as HF
    assert 'initial_load_format = "hf"' in to_toml(cfg) and "initial_load_in_hf" not in to_toml(cfg)


def test_torchtitan_initial_load_in_hf_false_conflicts_and_bad_values(tmp_path):
    llama = _hf_config_folder(tmp_path)
    toml = write(tmp_path, "[checkpoint]\ninitial_load_in_hf = true\n")
    # false is TorchTitan's default and ours (DCP); the command line's value wins over the TOML's
    assert parse_args([*llama, "--checkpoint.initial_load_in_hf", "false"]).checkpoint.initial_load_format == "dcp"
    cfg = parse_args([*llama, "--job.config_file", toml, "--checkpoint.initial_load_in_hf", "false"])
    assert cfg.checkpoint.initial_load_format == "dcp"
    # the same ask twice is no conflict; another format beside it is one error naming both keys and sources
    cfg = parse_args([*llama, "--job.config_file", toml, "--checkpoint.initial_load_format", "hf"])
    assert cfg.checkpoint.initial_load_format == "hf"
    with pytest.raises(ConfigError) as err:
        parse_args([*llama, "--job.config_file", toml, "--checkpoint.initial_load_format", "dcp"])
    assert str(err.value) == (f"checkpoint.initial_load_in_hf = True in {toml} means checkpoint.initial_load_format "
                              "= 'hf', but checkpoint.initial_load_format = 'dcp' in the command line: set one of "
                              "them")  # fmt: skip
    with pytest.raises(ConfigError, match=r"^checkpoint.initial_load_in_hf = 'yes' in the command line: expected bool"):
        parse_args([*llama, "--checkpoint.initial_load_in_hf", "yes"])
    with pytest.raises(ConfigError, match=r"^--checkpoint.initial_load_in_hf on the command line needs a value"):
        parse_args([*llama, "--checkpoint.initial_load_in_hf"])


def test_help_prints_each_key_default_once(capsys, monkeypatch):
    from torchtitan.job_config import _leaf_keys

    monkeypatch.setenv("COLUMNS", "10000")  # no wrapping inside a key's help text
    with pytest.raises(SystemExit):
        parse_args(["--help"])
    text = capsys.readouterr().out.split("\n\n[job]:")[1]  # the keys, after the usage line
    # One line per key, its help joined (a blank line ends a section's last key).
    lines = [" ".join(block.split("\n\n")[0].split()) for block in text.split("\n  --")[1:]]
    assert len(lines) == len(_leaf_keys())
    for line in lines:
        assert line.count("(default:") == 1, line
        assert "(default: None)" not in line, line
    by_key = {"--" + line.split()[0]: line for line in lines}
    assert by_key["--optimizer.lr"].endswith("(default: 0.0001)")
    assert by_key["--training.dataset"].endswith('(default: "digits")')
    assert by_key["--checkpoint.load_step"].endswith("(default: -1)")
    assert by_key["--model.qk_norm"].endswith("keeps the flavor's. (default: unset)")
    assert by_key["--training.local_batch_size"].endswith("(default: 32)")
    assert by_key["--model.sdpa_backends"].endswith('(default: ["cudnn", "flash", "efficient", "math"])')


@pytest.mark.parametrize("key", ["qk_norm", "learn_sigma"])
@pytest.mark.parametrize("value", [True, False, None])
@pytest.mark.parametrize("given_in", ["toml", "cli"])
def test_model_booleans_are_optional_booleans_that_round_trip(tmp_path, key, value, given_in):
    from torchtitan.train_spec import build_model_args, get_train_spec

    word = {True: "true", False: "false", None: None}[value]
    if value is None:
        argv = []
    elif given_in == "toml":
        argv = ["--job.config_file", write(tmp_path, f"[model]\n{key} = {word}\n")]  # a TOML boolean, not a string
    else:
        argv = [f"--model.{key}", word]
    cfg = parse_args(argv)
    assert getattr(cfg.model, key) is value
    flavor = get_train_spec("dit").model_args["debug"]
    expected = getattr(flavor, key) if value is None else value
    assert getattr(build_model_args(get_train_spec("dit"), cfg), key) is expected
    text = to_toml(cfg)
    assert (f"\n{key} = {word}\n" in text) if value is not None else (f"\n{key} =" not in text)  # TOML has no null
    written = tmp_path / "written.toml"
    written.write_text(text)
    again = parse_args(["--job.config_file", str(written)])
    again.job.config_file = cfg.job.config_file
    assert again == cfg
    assert getattr(again.model, key) is value


def test_model_string_overrides_are_optional_and_old_configs_still_parse(tmp_path):
    cfg = parse_args(["--job.config_file", write(tmp_path, '[model]\nnorm = "rmsnorm"\nlearn_sigma = "true"\n')])
    assert cfg.model.norm == "rmsnorm" and cfg.model.learn_sigma is True  # train_configs wrote "true" strings
    assert cfg.model.mlp is None and cfg.model.pos_embed is None
    # A config.toml written before the change (which sample.py reads from a run folder): '' meant unset. The removed
    # kernel switches pass where they asked for nothing (unset, float8 off: every old config.toml has enable = false).
    old = '[model]\npos_embed = ""\nnorm = ""\nmlp = ""\nqk_norm = ""\nfused_norm = ""\n'
    old += "[quantize.linear.float8]\nenable = false\n"
    cfg = parse_args(["--job.config_file", write(tmp_path, old)])
    assert (cfg.model.pos_embed, cfg.model.norm, cfg.model.qk_norm) == (None, None, None)
    assert cfg.model.converters == ["fused_norm", "fused_mlp", "fused_qkv"]
    with pytest.raises(ConfigError, match=r"model.fused_mlp = 'false' in .*job.toml: removed; use model.converters"):
        parse_args(["--job.config_file", write(tmp_path, old.replace("[model]\n", '[model]\nfused_mlp = "false"\n'))])
    assert parse_args(["--job.config_file", write(tmp_path, "[model]\nqk_norm = true\n"), "--model.qk_norm", ""]
                      ).model.qk_norm is None  # fmt: skip
    with pytest.raises(ConfigError, match=r"model.qk_norm = 'yes' in .*job.toml: expected bool"):
        parse_args(["--job.config_file", write(tmp_path, "[model]\nqk_norm = 'yes'\n")])
    with pytest.raises(ConfigError, match=r"model.norm = 'batchnorm' in the command line: must be one of"):
        parse_args(["--model.norm", "batchnorm"])


def test_every_key_knows_its_source(tmp_path):
    import copy
    import dataclasses

    path = write(tmp_path, "[training]\nsteps = 7\nlocal_batch_size = 4\n[optimizer]\nlr = 0.5\n")
    cfg = parse_args(["--job.config_file", path, "--training.steps", "9", "--dp.delta", "1e-6"])
    assert cfg.source_of("training.steps") == "the command line"  # the CLI overrode the TOML's value
    assert cfg.source_of("training.local_batch_size") == path
    assert cfg.source_of("optimizer.lr") == path
    assert cfg.source_of("dp.delta") == "the command line"
    assert cfg.source_of("job.config_file") == "the command line"
    assert cfg.source_of("optimizer.eps") == "the defaults"
    assert JobConfig().source_of("optimizer.lr") == "the defaults"
    with pytest.raises(KeyError, match="optimizer.learning_rate"):
        cfg.source_of("optimizer.learning_rate")
    for twin in (dataclasses.replace(cfg), copy.deepcopy(cfg), copy.copy(cfg)):
        assert twin.source_of("optimizer.lr") == path and twin.source_of("training.steps") == "the command line"
    twin = dataclasses.replace(cfg)
    twin._sources["optimizer.lr"] = "elsewhere"
    assert cfg.source_of("optimizer.lr") == path  # a copy's sources are its own
    assert "_sources" not in to_toml(cfg) and "_sources" not in cfg.to_dict() and "the command line" not in to_toml(cfg)


@pytest.mark.parametrize("cli_key, cli_value, error", [
    ("--training.steps", "0", "training.steps = 0 in the command line: must be > 0"),
    ("--optimizer.lr", "nan", "optimizer.lr = nan in the command line: must be a finite number"),
    ("--training.local_batch_size", "-2", "training.local_batch_size = -2 in the command line: must be > 0 or 'auto'"),
])  # fmt: skip
def test_an_error_names_the_source_of_the_key_at_fault(tmp_path, cli_key, cli_value, error):
    path = write(tmp_path, "[training]\nsteps = 7\n[optimizer]\nlr = 0.5\n")
    with pytest.raises(ConfigError) as err:
        parse_args(["--job.config_file", path, cli_key, cli_value])
    assert str(err.value) == error  # the TOML file gave other keys, not this one
    with pytest.raises(ConfigError, match=f"optimizer.lr = -0.5 in {path}: must be > 0"):
        parse_args(["--job.config_file", write(tmp_path, "[optimizer]\nlr = -0.5\n"), "--training.steps", "3"])
    with pytest.raises(ConfigError) as err:  # the key at fault kept its default; the TOML set the other one
        parse_args(["--job.config_file", write(tmp_path, "[diffusion]\nobjective = 'rectified_flow'\n")])
    assert str(err.value) == (f"diffusion.prediction = 'epsilon' in the defaults: diffusion.objective "
                              f"'rectified_flow' (in {tmp_path / 'job.toml'}) predicts 'velocity'")  # fmt: skip


def test_combination_errors_name_each_key_source(tmp_path):
    path = write(tmp_path, "[training]\nglobal_batch_size = 60\n[dp]\nenable = true\n")
    cfg = parse_args(["--job.config_file", path, "--training.local_batch_size", "8"])
    with pytest.raises(ConfigError) as err:
        check_batch_sizes(cfg, dp_degree=2)
    assert f"training.global_batch_size = 60 in {path} is not divisible" in str(err.value)
    assert "training.local_batch_size (in the command line) x data-parallel degree = 8 x 2 = 16" in str(err.value)
    with pytest.raises(ConfigError) as err:
        parse_args(["--job.config_file", path, "--model.converters", "float8"])
    assert str(err.value).startswith(f"dp.enable in {path} with model.converters in the command line:")


def test_a_setting_of_the_other_optimizer_is_refused_by_name(tmp_path):
    path = write(tmp_path, '[optimizer]\nname = "SGD"\nmomentum = 0.9\n')
    assert parse_args(["--job.config_file", path]).optimizer.momentum == 0.9
    with pytest.raises(ConfigError, match=f"optimizer.beta2 = 0.95 in the command line: optimizer.name 'SGD' "
                                          f"\\(in {path}\\) has no such setting"):  # fmt: skip
        parse_args(["--job.config_file", path, "--optimizer.beta2", "0.95"])
    with pytest.raises(ConfigError, match="optimizer.momentum = 0.9 in the command line: optimizer.name 'AdamW' "
                                          "\\(in the defaults\\) has no such setting"):  # fmt: skip
        parse_args(["--optimizer.momentum", "0.9"])
    with pytest.raises(ConfigError, match="optimizer.momentum = 1.0 in the command line: must be in \\[0, 1\\)"):
        parse_args(["--optimizer.name", "SGD", "--optimizer.momentum", "1.0"])


def test_every_bad_key_is_reported_at_once(tmp_path):
    path = write(tmp_path, "[optimizer]\nlr = -1.0\n[training]\nsteps = 0\n")
    with pytest.raises(ConfigError) as err:
        parse_args(["--job.config_file", path, "--sampling.freq", "-2", "--model.converters", "fused_nrom"])
    message = str(err.value)
    assert message.startswith("4 problems in the config:")
    for line in (f"optimizer.lr = -1.0 in {path}: must be > 0", f"training.steps = 0 in {path}: must be > 0",
                 "sampling.freq = -2 in the command line: must be >= 0",
                 "model.converters = ['fused_nrom'] in the command line: unknown converter 'fused_nrom'"):  # fmt: skip
        assert line in message, line


def test_layout_checks_name_the_keys(tmp_path):
    from torchtitan.config_validation import validate_layout
    from torchtitan.parallelisms.parallel_dims import ParallelDims

    cfg = parse_args(["--parallelism.data_parallel_replicate_degree", "3", "--compile.enable", "true",
                      "--compile.scope", "model", "--training.local_batch_size", "auto"])  # fmt: skip
    with pytest.raises(ConfigError) as err:
        validate_layout(cfg, world_size=8, device_type="cpu")
    message = str(err.value)
    assert "data_parallel_replicate_degree = 3 in the command line: does not divide the world size 8" in message
    assert "compile.scope = 'model' in the command line: one device or DDP only" in message
    ddp = ["--parallelism.data_parallel_replicate_degree", "4", "--parallelism.data_parallel_shard_degree", "1",
           "--compile.enable", "true", "--compile.scope", "model"]  # fmt: skip
    validate_layout(parse_args(ddp), world_size=4, device_type="cpu")  # a whole compiled model under DDP
    validate_layout(parse_args([*ddp, "--dp.enable", "true"]), world_size=4, device_type="cpu")  # DP-SGD too
    assert "training.local_batch_size = 'auto' in the command line: needs a CUDA device" in message
    cfg = parse_args(["--parallelism.data_parallel_replicate_degree", "2", "--parallelism.data_parallel_shard_degree",
                      "3"])  # fmt: skip
    with pytest.raises(ConfigError, match=r"data_parallel_replicate_degree with .*shard_degree in the command line: "
                                          r"2 x 3 != world size 8"):  # fmt: skip
        validate_layout(cfg, world_size=8, device_type="cpu")
    validate_layout(parse_args(["--parallelism.data_parallel_replicate_degree", "2"]), 8, "cpu")  # HSDP 2 x 4
    # Replicate -1 takes the rest of the world (DDP over every rank with shard 1); only one degree may be -1.
    ddp_everywhere = ["--parallelism.data_parallel_replicate_degree", "-1", "--parallelism.data_parallel_shard_degree"]
    validate_layout(parse_args([*ddp_everywhere, "1"]), 8, "cpu")
    assert ParallelDims(-1, 1, 8).mode == "ddp" and ParallelDims(-1, 2, 8).dp_replicate == 4
    with pytest.raises(ConfigError, match=r"data_parallel_shard_degree = 3 in the command line: does not divide the "
                                          r"world size 8"):  # fmt: skip
        validate_layout(parse_args([*ddp_everywhere, "3"]), 8, "cpu")
    with pytest.raises(ConfigError, match=r"only one of them may be -1"):
        validate_layout(parse_args([*ddp_everywhere, "-1"]), 8, "cpu")


@pytest.mark.parametrize("argv, key, value", [
    (["--optimizer.lr", "-1e-3"], "optimizer.lr", -1e-3),
    (["--optimizer.lr=-1e-3"], "optimizer.lr", -1e-3),
    (["--optimizer.lr", "-.5E+2"], "optimizer.lr", -50.0),
    (["--optimizer.lr", "-inf"], "optimizer.lr", float("-inf")),
    (["--training.steps", "-5"], "training.steps", -5),
    (["--training.steps=-5"], "training.steps", -5),
])  # fmt: skip
def test_negative_numbers_on_the_command_line(argv, key, value):
    with pytest.raises(ConfigError) as err:
        parse_args(argv)
    assert str(err.value).startswith(f"{key} = {value!r} in the command line: must be ")
    cfg = parse_args(["--diffusion.logit_normal_mean", "-5e-1", "--model.num_classes", "-1", "--job.description", "-x"])
    assert cfg.diffusion.logit_normal_mean == -0.5 and cfg.model.num_classes == -1 and cfg.job.description == "-x"
    assert parse_args(["--checkpoint.load_step", "-1", "--training.steps", "2"]).training.steps == 2


@pytest.mark.parametrize("section, key, bad, good, rule", [
    ("optimizer", "lr", "nan", "1e6", "must be a finite number"),  # large but finite is legal
    ("optimizer", "lr", "inf", "1e-4", "must be a finite number"),
    ("optimizer", "beta1", "1.0", "0.0", "must be in [0, 1)"),
    ("optimizer", "beta2", "-0.1", "0.95", "must be in [0, 1)"),
    ("optimizer", "eps", "0.0", "1e-12", "must be > 0"),
    ("optimizer", "weight_decay", "-0.1", "0.0", "must be >= 0"),
    ("lr_scheduler", "warmup_steps", "-1", "0", "must be >= 0"),
    ("lr_scheduler", "min_lr_factor", "1.5", "1.0", "must be in [0, 1]"),
    ("training", "max_norm", "-1.0", "0.0", "must be >= 0"),  # 0 disables clipping
    ("training", "max_norm", "inf", "1e3", "must be a finite number"),
    ("training", "global_batch_size", "0", "-1", "must be -1 or >= 1"),
    ("training", "image_size", "-8", "0", "must be >= 0"),
    ("training", "gc_freq", "-1", "0", "must be >= 0"),
    ("training.dataloader", "num_workers", "-1", "0", "must be >= 0"),
    ("training.dataloader", "prefetch_factor", "0", "1", "must be > 0"),
    ("sampling", "freq", "-1", "0", "must be >= 0"),  # 0: no samples
    ("sampling", "cfg_scale", "inf", "4.0", "must be a finite number"),
    ("sampling", "cfg_scale", "nan", "0.5", "must be a finite number"),
    ("checkpoint", "load_step", "-2", "-1", "must be >= -1"),
    ("profiling", "profile_freq", "0", "1", "must be > 0"),
    ("profiling", "profiler_warmup", "-1", "0", "must be >= 0"),
    ("diffusion", "logit_normal_std", "0.0", "0.5", "must be > 0"),
    ("diffusion", "logit_normal_mean", "-inf", "-0.5", "must be a finite number"),
    ("model", "patch_size", "-2", "0", "must be >= 0"),
    ("model", "num_classes", "-2", "0", "must be >= -1"),
    ("model", "attn_window", "-3", "-1", "must be >= -1"),
    ("latent", "scale_factor", "-0.18215", "0.18215", "must be >= 0"),
    ("dp", "max_grad_norm", "0.0", "0.1", "must be > 0"),
    ("dp", "noise_multiplier", "-1.0", "0.0", "must be >= 0"),
    ("dp", "target_epsilon", "-1.0", "8.0", "must be >= 0"),
    ("dp", "target_epsilon", "inf", "0.0", "must be a finite number"),
    ("dp", "delta", "0.0", "1e-6", "must be in (0, 1)"),
    ("dp", "delta", "1.0", "0.5", "must be in (0, 1)"),
    ("debug", "seed", "-1", "4294967295", "must be in [0, 2**32)"),
    ("quantize.linear.float8", "recipe_name", "'columnwise'", "'rowwise'", "must be one of"),
])  # fmt: skip
def test_impossible_values_are_rejected_naming_key_value_and_file(tmp_path, section, key, bad, good, rule):
    with pytest.raises(ConfigError) as err:
        parse_args(["--job.config_file", write(tmp_path, f"[{section}]\n{key} = {bad}\n")])
    shown = repr(float(bad)) if "." in bad or bad in ("nan", "inf", "-inf") else bad
    assert str(err.value).startswith(f"{section}.{key} = {shown} in {tmp_path / 'job.toml'}: {rule}"), err.value
    parse_args(["--job.config_file", write(tmp_path, f"[{section}]\n{key} = {good}\n")])  # the edge is legal


def test_profiler_window_fits_between_traces(tmp_path):
    text = "[profiling]\nenable_profiling = true\nprofile_freq = 4\nprofiler_active = 5\n"
    with pytest.raises(ConfigError, match=r"profiling.profiler_active = 5 in .*job.toml: records more steps than "
                                          r"profiling.profile_freq = 4 \(in .*job.toml\)"):  # fmt: skip
        parse_args(["--job.config_file", write(tmp_path, text)])
    assert parse_args(["--job.config_file", write(tmp_path, text.replace("= true", "= false"))])


def test_a_sampler_of_the_other_objective_is_refused_at_start():
    with pytest.raises(
        ConfigError,
        match=r"sampling.sampler = 'ddim' in the command line: diffusion.objective "
        r"'rectified_flow' \(in .*debug_model.toml\) samples with \['default', 'euler', 'heun', 'sde'\]",
    ):
        parse_args(["--job.config_file", str(ROOT / "train_configs/debug_model.toml"), "--sampling.sampler", "ddim"])
