"""The ground floor: the error a bad config raises and how its messages name a key, shared by the models' builders,
the registry, the components and config validation (torchtitan/config_validation.py holds the checks themselves);
and the refusal to resume that the checkpoint, the data record and DP-SGD's accountant raise alike. It imports
nothing of ours, so every floor above can import it without a circle."""


class ConfigError(ValueError):
    """A bad config value; the message names the key, the value and its source."""


def value_of(cfg, key: str):
    """The value of a dotted key ('training.steps') in a JobConfig."""
    obj = cfg
    for part in key.split("."):
        obj = getattr(obj, part)
    return obj


def at(cfg, key: str) -> str:
    """'key = value in source': how a message about one key starts."""
    return f"{key} = {value_of(cfg, key)!r} in {cfg.source_of(key)}"


def keys_in(cfg, *keys: str) -> str:
    """'a with b in X' when one source set them all, else 'a in X with b in Y': a message about a combination."""
    sources = [cfg.source_of(key) for key in keys]
    if len(set(sources)) == 1:
        return f"{' with '.join(keys)} in {sources[0]}"
    return " with ".join(f"{key} in {source}" for key, source in zip(keys, sources))


class CheckpointLoadError(RuntimeError):
    """Checkpoints exist but none could be loaded; the message names each one and why."""


class ResumeRefusedError(CheckpointLoadError):
    """The newest checkpoint cannot continue this run as it is configured (a changed tokenizer, a spent privacy
    budget, DP turned off ...): the message names the key. Older checkpoints are not tried instead, since they
    would be refused for the same reason or silently resume an older state."""
