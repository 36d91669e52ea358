"""Parsing a JobConfig (torchtitan/job_config.py): TOML file, then `--section.key value` overrides (CLI > TOML >
default), each key's source recorded for messages; and the resolved config written back as TOML.
"""

import argparse
import contextlib
import dataclasses
import sys
import tomllib
import types
import typing
from pathlib import Path

from torchtitan.config_validation import check_batch_sizes, validate
from torchtitan.errors import ConfigError, at, value_of
from torchtitan.job_config import JobConfig, Model, _field_docs, _leaf_fields, _sections

__all__ = ["ConfigError", "JobConfig", "check_batch_sizes", "parse_args", "to_toml", "validate"]


def _is_union(ftype) -> bool:
    return typing.get_origin(ftype) in (typing.Union, types.UnionType)  # Optional[X] and X | None


def _type_name(ftype) -> str:
    """How help and errors name a field's type: 'int', 'list', "int or 'auto'", 'bool' (for bool | None)."""
    if _is_union(ftype):
        return " or ".join(_type_name(arg) for arg in typing.get_args(ftype) if arg is not type(None))
    if typing.get_origin(ftype) is typing.Literal:
        return " or ".join(repr(word) for word in typing.get_args(ftype))
    return "list" if typing.get_origin(ftype) is list else getattr(ftype, "__name__", str(ftype))


def _convert(value, ftype, key: str, source: str):
    """Converts a TOML or CLI value to the field's type, naming key and source on failure."""
    expected = _type_name(ftype)
    if _is_union(ftype):  # e.g. int | Literal["auto"]: a listed word, else a number; bool | None
        args = typing.get_args(ftype)
        # TOML has no null: an optional is unset by leaving it out. '' is accepted as unset too, as older
        # resolved config.toml files (which sample.py reads) wrote it, and so that the CLI can unset a TOML value.
        if type(None) in args and value in (None, ""):
            return None
        words = [w for arg in args if typing.get_origin(arg) is typing.Literal for w in typing.get_args(arg)]
        if value in words:
            return value
        for arg in args:
            if typing.get_origin(arg) is not typing.Literal and arg is not type(None):
                with contextlib.suppress(ConfigError):
                    return _convert(value, arg, key, source)
    elif ftype is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0"):
            return value.lower() in ("true", "1")
    elif ftype is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, str):
            try:
                return int(value)
            except ValueError:
                pass
    elif ftype is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
    elif ftype is str:
        if isinstance(value, str):
            return value
        if isinstance(value, int) and not isinstance(value, bool):  # e.g. selective_ac_option = 2
            return str(value)
    elif typing.get_origin(ftype) is list:
        if isinstance(value, list) and all(isinstance(v, str) for v in value):
            return list(value)
        if isinstance(value, str):
            return [v.strip() for v in value.split(",") if v.strip()]
    raise ConfigError(f"{key} = {value!r} in {source}: expected {expected}")


def _set(cfg: JobConfig, key: str, value) -> None:
    *parents, leaf = key.split(".")
    obj = cfg
    for part in parents:
        obj = getattr(obj, part)
    setattr(obj, leaf, value)


def _flatten_toml(data: dict, prefix: str = "") -> dict:
    flat = {}
    for k, v in data.items():
        if isinstance(v, dict):
            flat.update(_flatten_toml(v, f"{prefix}{k}."))
        else:
            flat[f"{prefix}{k}"] = v
    return flat


def _build_parser(fields: dict) -> argparse.ArgumentParser:
    # The help prints each key's dataclass default itself: the argparse default is None (meaning "not given"),
    # which ArgumentDefaultsHelpFormatter would print as a second "(default: None)".
    parser = argparse.ArgumentParser(
        prog="train.py",
        description="TorchDiTan trainer. Every TOML key can be given as --section.key VALUE (CLI > TOML > default).",
        allow_abbrev=False,
    )
    groups = {}
    for key, (f, ftype, owner) in fields.items():
        section = key.rsplit(".", 1)[0]
        if section not in groups:
            groups[section] = parser.add_argument_group(f"[{section}]")
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        shown = "unset" if default is None else _toml_value(default)
        doc = _field_docs(owner).get(f.name, "")
        metavar = _type_name(ftype).replace(" or ", "|").replace("'", "").upper()
        help_text = f"{doc} (default: {shown})".replace("%", "%%")  # argparse %-formats help strings
        groups[section].add_argument(f"--{key}", dest=key, default=None, metavar=metavar, help=help_text)
    return parser


def _attach_values(argv: list[str], fields: dict) -> list[str]:
    """`--key value` -> `--key=value` for known keys: argparse reads a value such as -1e-3 or -inf that is not a
    plain negative number as an option ("expected one argument"); attached with '=' it is always the value."""
    out, i = [], 0
    while i < len(argv):
        arg = argv[i]
        if arg[2:] in fields and arg.startswith("--") and i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            out.append(f"{arg}={argv[i + 1]}")
            i += 2
        else:
            out.append(arg)
            i += 1
    return out


# Keys of older releases whose work is now a converter's (model.converters), by the converter they name.
_REMOVED_KEYS = {
    "model.fused_norm": "fused_norm",
    "model.fused_mlp": "fused_mlp",
    "model.fused_qkv": "fused_qkv",
    "quantize.linear.float8.enable": "float8",
}


# TorchTitan's keys that say what one of ours says: key -> (our key, {its value: our value}). A value not listed asks
# for nothing: initial_load_in_hf = false is TorchTitan's default, a DCP checkpoint, and ours.
_ALIASES = {"checkpoint.initial_load_in_hf": ("checkpoint.initial_load_format", {True: "hf"})}
_RETIRED_KEYS = frozenset(_REMOVED_KEYS) | frozenset(_ALIASES)


def _check_removed_key(key: str, value, source: str) -> None:
    """Raises for a removed key (_REMOVED_KEYS) with the model.converters to write instead. A value that asks for
    nothing is let through: quantize.linear.float8.enable = false and '' for the fused switches, as resolved
    config.toml files of older runs hold them (sample.py reads those)."""
    converter = _REMOVED_KEYS[key]
    if value == "" or (converter == "float8" and value in (False, "false", "False", "0")):
        return
    default = Model().converters
    try:
        wanted = _convert(value, bool, key, source)
    except ConfigError:
        wanted = None
    if wanted is None:
        suggestion = f"model.converters = {_toml_value(default)} (the default), with or without {converter!r}"
    elif wanted:
        suggestion = f"model.converters = {_toml_value(list(dict.fromkeys([*default, converter])))}"
    else:
        suggestion = f"model.converters = {_toml_value([c for c in default if c != converter])}"
    raise ConfigError(f"{key} = {value!r} in {source}: removed; use {suggestion}")


def _pop_retired_keys(argv: list[str]) -> tuple[list[str], dict[str, tuple]]:
    """argv without the removed keys that ask for nothing (see _check_removed_key; raises for the others) and
    without TorchTitan's aliases (_ALIASES), whose values it returns: {key: (value, "the command line")}."""
    out, aliases, i = [], {}, 0
    while i < len(argv):
        name, has_value, value = argv[i].partition("=")
        if name.startswith("--") and name[2:] in _RETIRED_KEYS:
            if not has_value:
                value = argv[i + 1] if i + 1 < len(argv) and not argv[i + 1].startswith("--") else None
                i += value is not None
            if name[2:] in _ALIASES:
                if value is None:
                    raise ConfigError(f"{name} on the command line needs a value (true or false)")
                aliases[name[2:]] = (value, "the command line")
            else:
                _check_removed_key(name[2:], value, "the command line")
        else:
            out.append(argv[i])
        i += 1
    return out, aliases


def _apply_aliases(cfg: JobConfig, aliases: dict[str, tuple]) -> None:
    """Sets our key for each TorchTitan alias that asks for something, its source naming the alias.

    Raises:
        ConfigError: the alias's value is of the wrong type, or our key is set to something else (both named).
    """
    for key, (value, source) in aliases.items():
        ours, meaning = _ALIASES[key]
        wanted = meaning.get(_convert(value, bool, key, source))  # TorchTitan's aliases are booleans
        if wanted is None:
            continue
        if ours not in cfg._sources:
            _set(cfg, ours, wanted)
            cfg._sources[ours] = f"{source} (as {key} = {value!r})"
        elif value_of(cfg, ours) != wanted:
            raise ConfigError(
                f"{key} = {value!r} in {source} means {ours} = {wanted!r}, but {at(cfg, ours)}: set one of them"
            )


def parse_args(argv: list[str] | None = None) -> JobConfig:
    """Builds a JobConfig from `--job.config_file` TOML and `--section.key value` overrides.

    Records where each key it sets came from (`JobConfig.source_of`): the TOML file's path or "the command line".

    Raises:
        ConfigError: unknown section/key, wrong type or impossible value; the message names key and source.
    """
    argv, cli_aliases = _pop_retired_keys(sys.argv[1:] if argv is None else argv)
    fields = {key: (f, ftype, owner) for key, f, ftype, owner in _leaf_fields(JobConfig)}
    parser = _build_parser(fields)
    unknown = [a.split("=")[0] for a in argv if a.startswith("--") and a.split("=")[0][2:] not in fields]
    unknown = [a for a in unknown if a not in ("--help", "-h")]
    if unknown:
        raise ConfigError(f"unknown option {unknown[0]} on the command line (keys look like --training.steps)")
    args = parser.parse_args(_attach_values(argv, fields))
    cfg, aliases = JobConfig(), {}
    config_file = getattr(args, "job.config_file") or ""
    if config_file:
        path = Path(config_file)
        if path.is_dir():
            raise ConfigError(f"job.config_file = {config_file!r} in the command line is a directory, not a TOML file")
        if not path.is_file():
            raise ConfigError(f"job.config_file = {config_file!r} in the command line: the file does not exist")
        try:
            data = tomllib.loads(path.read_text())
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{config_file} is not valid TOML: {e}") from e
        for key, value in _flatten_toml(data).items():
            if key in _ALIASES:
                aliases[key] = (value, config_file)
                continue
            if key in _RETIRED_KEYS:
                _check_removed_key(key, value, config_file)
                continue
            if key not in fields:
                section = key.rsplit(".", 1)[0] if "." in key else key
                known_sections = {k.rsplit(".", 1)[0] for k in fields}
                what = "key" if section in known_sections else "section"
                raise ConfigError(f"unknown {what} '{key}' in {config_file}")
            _set(cfg, key, _convert(value, fields[key][1], key, config_file))
            cfg._sources[key] = config_file
    for key in fields:
        value = getattr(args, key)
        if value is not None:
            _set(cfg, key, _convert(value, fields[key][1], key, "the command line"))
            cfg._sources[key] = "the command line"
    cfg.job.config_file = config_file
    _apply_aliases(cfg, aliases | cli_aliases)  # the command line's over the TOML's
    validate(cfg)
    return cfg


def to_toml(cfg: JobConfig) -> str:
    """Serializes the resolved config as TOML (sections mirror the dataclasses).

    An unset optional (None) is left out, as TOML has no null: parse_args reads it back as unset.
    """
    lines: list[str] = []

    def emit(obj, prefix: str) -> None:
        scalars, nested = [], []
        for f in _sections(obj):
            value = getattr(obj, f.name)
            if value is not None:
                (nested if dataclasses.is_dataclass(value) else scalars).append((f.name, value))
        if scalars:
            lines.append(f"[{prefix}]")
            for name, value in scalars:
                lines.append(f"{name} = {_toml_value(value)}")
            lines.append("")
        for name, value in nested:
            emit(value, f"{prefix}.{name}" if prefix else name)

    for f in _sections(cfg):
        emit(getattr(cfg, f.name), f.name)
    return "\n".join(lines)


def _toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return repr(value)
