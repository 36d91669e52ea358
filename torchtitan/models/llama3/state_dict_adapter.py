"""Hugging Face <-> TorchDiTan Llama 3 weights: LlamaForCausalLM and LlamaForSequenceClassification folders.

Both sides use the "rotate half" RoPE layout (model.py's docstring), so wq and wk are copied as they are: no
permutation of their rows, unlike TorchTitan's adapter for its complex (interleaved) layout. Hugging Face leaves
`lm_head.weight` out of a tied checkpoint; ours always has `output.weight`, the same tensor as the embedding.

Importing into a flavor (args_for_hf_folder): the flavor gives the shapes, checked against config.json, and
config.json the numerics the weights were trained with (norm eps, RoPE theta and scaling, max positions).
"""

import dataclasses
import json
import re
from pathlib import Path

import torch
from torch import nn

from torchtitan.models.llama3.model import Llama3Args, RopeScaling

# Our name -> Hugging Face's; "{}" is the layer index.
_TOP_LEVEL = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "score.weight": "score.weight",
}
_PER_LAYER = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
_OURS_TO_HF = {**_TOP_LEVEL, **{f"layers.{{}}.{ours}": f"model.layers.{{}}.{hf}" for ours, hf in _PER_LAYER.items()}}
_HF_TO_OURS = {hf: ours for ours, hf in _OURS_TO_HF.items()}
_LAYER_INDEX = re.compile(r"\.(\d+)\.")
# Buffers older transformers releases saved; recomputed by both sides.
_IGNORED_HF_SUFFIXES = ("rotary_emb.inv_freq",)


def _rename(key: str, table: dict[str, str]) -> str | None:
    """Maps one key through `table`, whose keys may hold "{}" for the layer index; None when it has no match."""
    match = _LAYER_INDEX.search(key)
    if match is None:
        return table.get(key)
    template = table.get(key[: match.start()] + ".{}." + key[match.end() :])
    return None if template is None else template.format(match.group(1))


def from_hf(hf_state_dict: dict[str, torch.Tensor], args: Llama3Args) -> dict[str, torch.Tensor]:
    """Hugging Face Llama weights -> our state dict (same tensors, renamed).

    Raises:
        ValueError: a key with no counterpart in our model, named.
    """
    ours = {}
    for hf_key, tensor in hf_state_dict.items():
        if hf_key.endswith(_IGNORED_HF_SUFFIXES):
            continue
        key = _rename(hf_key, _HF_TO_OURS)
        if key is None:
            raise ValueError(f"unexpected Hugging Face key {hf_key!r}: no Llama3 parameter maps to it")
        ours[key] = tensor
    if args.tie_embeddings and args.num_labels == 0 and "tok_embeddings.weight" in ours:
        ours.setdefault("output.weight", ours["tok_embeddings.weight"])  # a tied HF checkpoint omits lm_head
    return ours


def to_hf(state_dict: dict[str, torch.Tensor], args: Llama3Args) -> dict[str, torch.Tensor]:
    """Our state dict -> Hugging Face Llama names; `lm_head.weight` is left out when tied, as Hugging Face does.

    Raises:
        ValueError: a key with no Hugging Face counterpart, named.
    """
    hf = {}
    for key, tensor in state_dict.items():
        if key == "output.weight" and args.tie_embeddings:
            continue
        hf_key = _rename(key, _OURS_TO_HF)
        if hf_key is None:
            raise ValueError(f"key {key!r} has no Hugging Face Llama counterpart")
        hf[hf_key] = tensor
    return hf


# Fields config.json sets, with the Hugging Face key each comes from. The shapes: a flavor must agree (its weights
# would not fit otherwise). The numerics: taken from config.json when importing (the flavor's may differ, and
# transformers' default rms_norm_eps 1e-6 differs from our 1e-5), each of them changes the logits.
SHAPE_FIELDS = {
    "dim": "hidden_size",
    "n_layers": "num_hidden_layers",
    "n_heads": "num_attention_heads",
    "kv_heads": "num_key_value_heads",
    "vocab_size": "vocab_size",
    "ffn_dim": "intermediate_size",
    "num_labels": "id2label",
    "tie_embeddings": "tie_word_embeddings",
}
NUMERIC_FIELDS = {
    "norm_eps": "rms_norm_eps",
    "rope_theta": "rope_theta",
    "rope_scaling": "rope_scaling",
    "max_seq_len": "max_position_embeddings",
}
_ARCHITECTURES = ("LlamaForCausalLM", "LlamaForSequenceClassification")
_REQUIRED_KEYS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size", "intermediate_size")
# Settings of LlamaConfig our model has no counterpart for, with the only value it implements.
_IMPLEMENTED = {"hidden_act": "silu", "attention_bias": False, "mlp_bias": False, "attention_dropout": 0.0}


def _rope_scaling_from_hf(config: dict, source: str) -> tuple[float, RopeScaling | None]:
    """(rope_theta, rope_scaling) as transformers 5 reads them (RotaryEmbeddingConfigMixin.convert_rope_params_to_dict):
    a non-empty `rope_scaling` replaces `rope_parameters` whole, and a theta missing from the dict taken comes from
    the top-level `rope_theta`, else 10000."""
    key = "rope_scaling" if config.get("rope_scaling") else "rope_parameters"
    rope = config.get(key) or {}
    theta = float(rope.get("rope_theta", config.get("rope_theta", 10000.0)))
    if float(rope.get("partial_rotary_factor", config.get("partial_rotary_factor") or 1.0)) != 1.0:
        raise ValueError(f"{source}: partial_rotary_factor is not supported (Llama3 rotates every head dimension)")
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "default":
        return theta, None
    if kind != "llama3":
        both = key == "rope_scaling" and config.get("rope_parameters")
        why = "; transformers reads rope_scaling, not rope_parameters, when config.json holds both" if both else ""
        raise ValueError(f"{source}: {key}.rope_type {kind!r} is not supported (Llama3 implements 'default' and "
                         f"'llama3'{why})")  # fmt: skip
    missing = [key for key in ("factor", "low_freq_factor", "high_freq_factor") if key not in rope]
    if missing:
        raise ValueError(f"{source}: the 'llama3' {key} has no {missing}")
    # transformers falls back to max_position_embeddings too (standardize_rope_params).
    original = rope.get("original_max_position_embeddings", config.get("max_position_embeddings", 2048))
    scaling = RopeScaling(
        factor=float(rope["factor"]),
        low_freq_factor=float(rope["low_freq_factor"]),
        high_freq_factor=float(rope["high_freq_factor"]),
        original_max_position_embeddings=int(original),
    )
    return theta, scaling


def _check_is_llama(config: dict, source: str) -> None:
    """Raises ValueError, naming model_type and architectures, unless config.json is a Llama one our model
    implements (its heads, activation, biases)."""
    model_type, architectures = config.get("model_type"), config.get("architectures") or []
    if model_type != "llama" and not (model_type is None and architectures):
        raise ValueError(f"{source}: not a Llama config (model_type {model_type!r}, architectures {architectures}); "
                         f"Llama3 imports model_type 'llama'")  # fmt: skip
    others = [arch for arch in architectures if arch not in _ARCHITECTURES]
    if others:
        raise ValueError(f"{source}: architectures {others} are not supported (only {list(_ARCHITECTURES)})")
    missing = [key for key in _REQUIRED_KEYS if key not in config]
    if missing:
        raise ValueError(f"{source}: no {missing}: not a whole Llama config")
    for key, expected in _IMPLEMENTED.items():
        if config.get(key, expected) != expected:
            raise ValueError(f"{source}: {key}={config[key]!r} is not supported (Llama3 implements {expected!r})")


def args_from_hf_config(config: dict, source: str = "config.json") -> Llama3Args:
    """Llama3Args from a Hugging Face LlamaConfig's config.json (as a dict); missing keys take LlamaConfig's
    defaults.

    Args:
        config: the parsed config.json.
        source: what the messages call it (the file's path).

    Raises:
        ValueError: not a Llama config (model_type, architectures), or a setting our model cannot express (biases,
            another activation, attention dropout, another head_dim, another RoPE type), named.
    """
    _check_is_llama(config, source)
    dim, n_heads = config["hidden_size"], config["num_attention_heads"]
    if config.get("head_dim") not in (None, dim // n_heads):
        raise ValueError(f"{source}: head_dim={config['head_dim']} is not hidden_size / num_attention_heads")
    num_labels = 0
    if "LlamaForSequenceClassification" in (config.get("architectures") or []):
        num_labels = len(config["id2label"]) if "id2label" in config else int(config.get("num_labels", 2))
    rope_theta, rope_scaling = _rope_scaling_from_hf(config, source)
    args = Llama3Args(
        dim=dim,
        n_layers=config["num_hidden_layers"],
        n_heads=n_heads,
        n_kv_heads=config.get("num_key_value_heads") or n_heads,
        vocab_size=config["vocab_size"],
        ffn_dim=config["intermediate_size"],
        norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        max_seq_len=config.get("max_position_embeddings", 2048),
        tie_embeddings=bool(config.get("tie_word_embeddings", False)) and num_labels == 0,
        num_labels=num_labels,
    )
    try:
        args.validate()
    except ValueError as e:
        raise ValueError(f"{source}: {e}") from e
    return args


def read_hf_config(folder: str | Path) -> tuple[Path, dict]:
    """(path, parsed dict) of a Hugging Face folder's config.json.

    Raises:
        FileNotFoundError: no config.json, named.
        ValueError: config.json is not a JSON object, named.
    """
    path = Path(folder) / "config.json"
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing: not a Hugging Face model folder")
    try:
        config = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from e
    if not isinstance(config, dict):
        raise ValueError(f"{path}: not a JSON object")
    return path, config


def special_ids_mismatch(folder: str | Path, tokenizer_identity: dict) -> str | None:
    """A warning when a Hugging Face folder's config.json gives other BOS/EOS ids (bos_token_id, eos_token_id, each
    an id or a list of ids) than those the tokenizer packs documents with (`TextTokenizer.identity()`), naming
    both files and every id; None when they agree, config.json names none, or the folder has no readable
    config.json (a resume after the folder was removed)."""
    try:
        path, config = read_hf_config(folder)
    except (FileNotFoundError, ValueError):
        return None
    ours = {"bos_token_id": tokenizer_identity.get("bos_id"), "eos_token_id": tokenizer_identity.get("eos_id")}
    differ = []
    for key, our_id in ours.items():
        theirs = config.get(key)
        if theirs is not None and our_id not in (theirs if isinstance(theirs, list) else [theirs]):
            differ.append(f"{key} {theirs}")
    if not differ:
        return None
    bos, eos = ours.values()
    packed = f"{'no BOS' if bos is None else f'BOS {bos}'} + text + EOS {eos}"
    return (f"{path} has {' and '.join(differ)}, but model.tokenizer_path {tokenizer_identity.get('tokenizer')!r} "
            f"packs each document as {packed}: the weights learned other ids for a document's start and end. Train "
            "with the tokenizer they were trained with (model.tokenizer_path), or correct config.json")  # fmt: skip


def _check_fields(path: Path, ours: Llama3Args, theirs: Llama3Args, fields: dict[str, str], whose: str) -> None:
    """Raises ValueError naming the first field (and its Hugging Face key) where `theirs` (config.json's) differs."""
    for field, hf_key in fields.items():
        if getattr(ours, field) != getattr(theirs, field):
            raise ValueError(f"{path}: {field} ({hf_key}) is {getattr(theirs, field)}, {whose} has "
                             f"{getattr(ours, field)}")  # fmt: skip


def args_for_hf_folder(folder: str | Path, flavor_args: Llama3Args) -> tuple[Llama3Args, list[str]]:
    """The args to import a Hugging Face folder with: `flavor_args`'s shapes, checked against config.json, and
    config.json's numerics (NUMERIC_FIELDS), which change the logits; the rest (attention window, init) the
    flavor's.

    Returns:
        (args, notes): notes name each value config.json gave that differs from the flavor's.

    Raises:
        FileNotFoundError: no config.json, named.
        ValueError: config.json is no Llama config our model implements, or a shape differs from the flavor's:
            the file, the field and both values named.
    """
    path, config = read_hf_config(folder)
    theirs = args_from_hf_config(config, str(path))
    _check_fields(path, flavor_args, theirs, SHAPE_FIELDS, "the flavor")
    taken = {field: getattr(theirs, field) for field in NUMERIC_FIELDS}
    notes = [f"{NUMERIC_FIELDS[field]} {value} (the flavor's {field} {getattr(flavor_args, field)})"
             for field, value in taken.items() if value != getattr(flavor_args, field)]  # fmt: skip
    return dataclasses.replace(flavor_args, **taken), notes


def hf_config_from_args(args: Llama3Args) -> dict:
    """A config.json dict that transformers loads as a LlamaConfig (4.x and 5.x: the RoPE settings are written
    both as 5.x's `rope_parameters` and as the older `rope_theta` + `rope_scaling`)."""
    scaling = None
    if args.rope_scaling is not None:
        scaling = {"rope_type": "llama3", **vars(args.rope_scaling)}
    rope_parameters = {"rope_type": "default", **(scaling or {}), "rope_theta": args.rope_theta}
    config = {
        "architectures": ["LlamaForSequenceClassification" if args.num_labels else "LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": args.dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.kv_heads,
        "head_dim": args.head_dim,
        "vocab_size": args.vocab_size,
        "intermediate_size": args.ffn_dim,
        "hidden_act": "silu",
        "rms_norm_eps": args.norm_eps,
        "max_position_embeddings": args.max_seq_len,
        "rope_theta": args.rope_theta,
        "rope_scaling": scaling,
        "rope_parameters": rope_parameters,
        "tie_word_embeddings": args.tie_embeddings,
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": "float32",
    }
    if args.num_labels:
        config["id2label"] = {str(i): f"LABEL_{i}" for i in range(args.num_labels)}
        config["label2id"] = {f"LABEL_{i}": i for i in range(args.num_labels)}
    return config


def _shards(folder: Path) -> tuple[list[str], Path | None]:
    """The safetensors files of a folder: those its index names when sharded, else model.safetensors; and the
    index's path (None when there is none)."""
    index_path = folder / "model.safetensors.index.json"
    if not index_path.exists():
        return ["model.safetensors"], None
    try:
        weight_map = json.loads(index_path.read_text()).get("weight_map")
    except (UnicodeDecodeError, json.JSONDecodeError, AttributeError) as e:
        raise ValueError(f"{index_path}: not a JSON object ({e})") from e
    if not isinstance(weight_map, dict) or not weight_map:
        raise ValueError(f"{index_path}: no 'weight_map' (tensor name -> safetensors file): not a sharded index")
    return sorted(set(weight_map.values())), index_path


def _read_hf_weights(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the folder's safetensors files (see _shards).

    Raises:
        FileNotFoundError: a safetensors file is missing, named (and the index that names it).
        ValueError: the index has no weight_map, or a file is no whole safetensors file (truncated), named.
    """
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    shards, index_path = _shards(folder)
    weights = {}
    for shard in shards:
        path = folder / shard
        if not path.exists():
            named_by = f" (named by {index_path.name})" if index_path else ""
            raise FileNotFoundError(f"{path} is missing{named_by}")
        try:
            weights.update(load_file(path))
        except SafetensorError as e:  # a truncated or foreign file: its own message names no file
            raise ValueError(f"{path}: not a readable safetensors file ({e})") from e
    return weights


def read_hf_folder(folder: str | Path, args: Llama3Args) -> dict[str, torch.Tensor]:
    """A Hugging Face Llama folder (config.json + safetensors) as our full state dict for a model of `args`, every
    key and shape checked against that model (built on the meta device: nothing allocated).

    Raises:
        FileNotFoundError: config.json or a safetensors file is missing, named.
        ValueError: config.json describes another model than `args` (a shape, or the norm eps or RoPE settings,
            which change the logits: build `args` with args_for_hf_folder or args_from_hf_config), a key is
            unexpected, missing or of another shape, or a file is unreadable, named.
    """
    from torchtitan.models.llama3.model import Llama3

    folder = Path(folder)
    config_path, config = read_hf_config(folder)
    folder_args = args_from_hf_config(config, str(config_path))
    # max_position_embeddings is left out: it sets only how long a sequence the model takes, not its logits.
    fields = {**SHAPE_FIELDS, **{k: v for k, v in NUMERIC_FIELDS.items() if k != "max_seq_len"}}
    _check_fields(config_path, args, folder_args, fields, "the model")
    state_dict = from_hf(_read_hf_weights(folder), args)
    with torch.device("meta"):
        expected = Llama3(args).state_dict()
    missing = sorted(set(expected) - set(state_dict))
    if missing:
        raise ValueError(f"{folder}: missing weights for {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    unexpected = sorted(set(state_dict) - set(expected))
    if unexpected:
        raise ValueError(f"{folder}: unexpected weights {unexpected[:5]}{' ...' if len(unexpected) > 5 else ''}")
    for key, tensor in state_dict.items():
        if tensor.shape != expected[key].shape:
            raise ValueError(f"{folder}: {key} has shape {tuple(tensor.shape)}, the model {tuple(expected[key].shape)}")
    return state_dict


def load_hf_folder(folder: str | Path, model: nn.Module) -> None:
    """Loads a Hugging Face Llama folder into a plain `model` in place (see read_hf_folder; the model's args must
    describe the same model: build it from args_from_hf_config)."""
    model.load_state_dict(read_hf_folder(folder, model.args))


def save_hf_folder(model: nn.Module, args: Llama3Args, folder: str | Path, extra_config: dict | None = None) -> None:
    """Writes config.json and model.safetensors that transformers' from_pretrained loads (LlamaForCausalLM, or
    LlamaForSequenceClassification when args.num_labels > 0). Tensors are saved in their own dtype.

    Args:
        model: a Llama3 (its state_dict is saved).
        args: the model's args.
        folder: created if missing; config.json and model.safetensors are overwritten.
        extra_config: config.json keys to add, such as bos_token_id, eos_token_id or pad_token_id (a classifier
            needs pad_token_id for Hugging Face to take batches of more than one sequence).
    """
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    # safetensors refuses tensors sharing memory, and wants them contiguous: copies of what to_hf keeps.
    weights = {key: tensor.detach().contiguous().clone() for key, tensor in to_hf(model.state_dict(), args).items()}
    config = hf_config_from_args(args)
    config["torch_dtype"] = str(next(iter(weights.values())).dtype).removeprefix("torch.")
    config.update(extra_config or {})
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
