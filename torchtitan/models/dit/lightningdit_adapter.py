"""LightningDiT (hustvl/LightningDiT) `.pt` checkpoints -> TorchDiTan DiT weights.

Two formats, as its inference.py reads them: what its train.py saves, `{"model", "ema", "opt", "config"}`, of which
the EMA weights are read, and a plain state dict (or `{"ema": ...}`). The file is unpickled through an allow-list
(torchtitan/tools/safe_pickle.py): tensors and their containers (train.py's `config` is the YAML as plain dicts);
a file naming any other code is refused before anything it names runs.

The state dict says which of LightningDiT's options built the model, and each is checked against the DiT it loads
into: RoPE (its `feat_rope` tables) needs `model.pos_embed = "sincos_rope2d"` (LightningDiT adds the fixed sin-cos
table too), RMSNorm weights `model.norm = "rmsnorm"`, SwiGLU (`mlp.w12`) `model.mlp = "swiglu"` with its hidden size
int(2/3 * mlp_ratio * dim) unrounded (the flavors' `multiple_of = 1`), QK-norm `model.qk_norm`. The flavors
`LightningDiT-*` (torchtitan/models/dit/__init__.py) are set so. The conversion is exact algebra, so that our plain
DiT (and its fused kernels) compute what the reference computes:

- RMSNorm weights: LightningDiT's block and final norms carry a weight w, ours none (adaLN supplies the scale).
  norm(x) w (1 + scale) = norm(x) (1 + scale') with scale' = w (1 + scale) - 1, so w goes into the rows of the
  adaLN linear that make `scale`: W' = diag(w) W, b' = w (1 + b) - 1.
- RoPE: EVA's rotary embedding (LightningDiT's models/pos_embed.py) rotates interleaved pairs (2m, 2m + 1) of a
  head, the first half of the pairs by the token's row, the second by its column, at the frequencies ours uses;
  ours rotates the pairs (m, m + hd/2). Attention scores do not change under one permutation of the head dims
  applied to both q and k, so the q and k rows of `qkv` (and the QK-norm weights) are permuted to our layout.
- `wo_shift` (adaLN without shifts, 4 chunks) becomes our 6 chunks with zero shift rows.
- `learn_sigma`: LightningDiT's forward drops the sigma channels, so the final layer's sigma rows are dropped.
- `pos_embed` (its fixed sin-cos table) and `feat_rope.freqs_cos/sin` are compared with ours and dropped.

Time: LightningDiT's transport (SiT's) runs t from noise (0) to data (1), its model reads t in [0, 1] and predicts
data - noise. `diffusion.time_input = "1-t"` gives the model that t and negates its velocity
(torchtitan/diffusion/rectified_flow.py); a run starting from these weights must set it (config_validation says so).
tests/test_lightningdit_weights.py checks all of it on a checkpoint the reference's own code wrote.
"""

import re
from pathlib import Path

import torch

from torchtitan.models.dit.model import DiT, DiTArgs, sincos_pos_embed_2d
from torchtitan.models.dit.rope import build_rope_2d
from torchtitan.models.dit.state_dict_adapter import weights_of
from torchtitan.tools import safe_pickle

# Tensors, the state dicts' OrderedDict; the optimizer state and train.py's YAML config are plain containers.
LIGHTNINGDIT_PT_PICKLE_GLOBALS = safe_pickle.TORCH_TENSOR_GLOBALS
# What sampling a LightningDiT file needs besides its flavor: its transport's flow, time and target.
LIGHTNINGDIT_CONFIG_FLAGS = ("--diffusion.objective", "rectified_flow", "--diffusion.prediction", "velocity",
                             "--diffusion.time_input", "1-t")  # fmt: skip
# Strings only a LightningDiT file's pickle holds: train.py's config section, or keys of LightningDiT's own modules.
_MARKERS = ("transport", "feat_rope.freqs_cos", "blocks.0.mlp.w12.weight", "blocks.0.norm1.weight")
_BLOCK = re.compile(r"^blocks\.(\d+)\.(.*)$")
TABLE_TOLERANCE = 1e-4  # the reference builds its sin-cos and RoPE tables in float32 (ours in float64)
_DROPPED = ("pos_embed", "feat_rope.freqs_cos", "feat_rope.freqs_sin", "final_layer.norm_final.weight")
_HINT = "use a LightningDiT-* flavor or set model.pos_embed, norm, mlp, qk_norm to the checkpoint's"


def is_lightningdit_pt(path: str | Path) -> bool:
    """Whether a `.pt` file is LightningDiT's, told from the strings of its pickle without unpickling it (no code
    runs, no tensor is read): train.py's config with a `transport` section, or a key of LightningDiT's RoPE, SwiGLU
    or RMSNorm. A LayerNorm-GELU LightningDiT without RoPE has facebookresearch/DiT's keys and is not told apart."""
    strings = safe_pickle.pickle_strings(path)
    return any(marker in strings for marker in _MARKERS)


def _features(sd: dict, source: str) -> dict:
    """LightningDiT's options, read from the state dict's keys and shapes."""
    if "blocks.0.attn.q_norm.bias" in sd:  # QK-norm without use_rmsnorm: nn.LayerNorm (eps 1e-5), not ours
        raise ValueError(f"{source}: QK-norm by LayerNorm (LightningDiT's use_qknorm without use_rmsnorm) is not "
                         "supported: ours is RMSNorm")  # fmt: skip
    dim, channels, patch = sd["x_embedder.proj.weight"].shape[:3]
    return {
        "rope": "feat_rope.freqs_cos" in sd,
        "rmsnorm": "blocks.0.norm1.weight" in sd,
        "swiglu": "blocks.0.mlp.w12.weight" in sd,
        "qk_norm": "blocks.0.attn.q_norm.weight" in sd,
        "wo_shift": sd["blocks.0.adaLN_modulation.1.weight"].shape[0] == 4 * dim,
        "learn_sigma": sd["final_layer.linear.weight"].shape[0] == 2 * channels * patch * patch,
        "channels": channels,
    }


def _check_args(found: dict, args: DiTArgs, source: str) -> None:
    wanted = {
        "pos_embed": "sincos_rope2d" if found["rope"] else "sincos",
        "norm": "rmsnorm" if found["rmsnorm"] else "layernorm",
        "mlp": "swiglu" if found["swiglu"] else "gelu",
        "qk_norm": found["qk_norm"],
        "learn_sigma": False,  # the sigma channels LightningDiT's forward drops are dropped here
    }
    wrong = [f"model.{k} = {v!r} (the model has {getattr(args, k)!r})" for k, v in wanted.items()
             if getattr(args, k) != v]  # fmt: skip
    if wrong:
        raise ValueError(f"{source}: this LightningDiT checkpoint needs {', '.join(wrong)}; {_HINT}")


def _check_table(stored: torch.Tensor, ours: torch.Tensor, name: str, source: str) -> None:
    if stored.shape != ours.shape:
        raise ValueError(f"{source}: {name} has shape {tuple(stored.shape)}, the model {tuple(ours.shape)}; set "
                         "model.input_size, model.patch_size and the flavor to the checkpoint's")  # fmt: skip
    error = (stored.double() - ours.double()).abs().max().item()
    if not error <= TABLE_TOLERANCE:  # NaN too
        raise ValueError(f"{source}: {name} differs from the table ours computes by {error:.3g} "
                         f"(> {TABLE_TOLERANCE:g}): not LightningDiT's positions for this grid")  # fmt: skip


def _check_tables(sd: dict, args: DiTArgs, source: str) -> None:
    """The fixed sin-cos table and EVA's RoPE tables equal ours (the RoPE's cos/sin at its even dims, our pairs)."""
    grid = args.input_size // args.patch_size
    _check_table(sd["pos_embed"], sincos_pos_embed_2d(args.dim, grid).unsqueeze(0), "pos_embed", source)
    if "feat_rope.freqs_cos" in sd:
        rope = build_rope_2d(args.head_dim, grid, grid, args.rope_theta)  # (T, hd/2, 2)
        for i, name in enumerate(("feat_rope.freqs_cos", "feat_rope.freqs_sin")):
            _check_table(sd[name][:, ::2], rope[..., i], name, source)


def _rope_order(head_dim: int) -> torch.Tensor:
    """Our head dim m <- EVA's dim 2m, ours m + hd/2 <- EVA's 2m + 1."""
    return torch.cat([torch.arange(0, head_dim, 2), torch.arange(1, head_dim, 2)])


def _permute_qk(tensor: torch.Tensor, args: DiTArgs) -> torch.Tensor:
    """qkv weight (3D, D) or bias (3D,): q's and k's rows of each head in our RoPE layout; v's unchanged."""
    order = _rope_order(args.head_dim)
    rows = tensor.reshape(3, args.num_heads, args.head_dim, *tensor.shape[1:]).clone()
    rows[:2] = rows[:2, :, order]
    return rows.reshape(tensor.shape)


def _adaln(weight: torch.Tensor, bias: torch.Tensor, norm_weights: list, chunks: int, wo_shift: bool):
    """An adaLN linear in our layout: zero shift rows put back (wo_shift), each norm weight folded into its scale
    chunk (chunk 1 of each (shift, scale[, gate]) group)."""
    dim = weight.shape[1]
    w, b = list(weight.split(dim)), list(bias.split(dim))
    if wo_shift:  # (scale, gate) x 2 -> (shift, scale, gate) x 2
        w = [torch.zeros_like(w[0]), w[0], w[1], torch.zeros_like(w[0]), w[2], w[3]]
        b = [torch.zeros_like(b[0]), b[0], b[1], torch.zeros_like(b[0]), b[2], b[3]]
    group = chunks // max(len(norm_weights), 1)
    for g, norm in enumerate(norm_weights):
        if norm is not None:  # norm(x) w (1 + scale) = norm(x) (1 + scale'), scale' = w (1 + scale) - 1
            i = g * group + 1
            w[i], b[i] = norm[:, None] * w[i], norm * (1 + b[i]) - 1
    return torch.cat(w), torch.cat(b)


def from_lightningdit(sd: dict[str, torch.Tensor], args: DiTArgs, source: str = "the state dict") -> dict:
    """A LightningDiT state dict -> ours for `DiT(args)` (see the module docstring), every key and shape checked
    against that model (built on the meta device).

    Raises:
        ValueError: the model's options are not the checkpoint's, a position table differs from ours, or a key is
            unexpected, missing or of another shape; the source and key named.
    """
    sd = {k.removeprefix("module."): v for k, v in sd.items()}
    for key in ("x_embedder.proj.weight", "blocks.0.adaLN_modulation.1.weight", "final_layer.linear.weight",
                "pos_embed"):  # fmt: skip
        if key not in sd:
            raise ValueError(f"{source}: no {key!r}: not a LightningDiT state dict")
    found = _features(sd, source)
    _check_args(found, args, source)
    _check_tables(sd, args, source)
    ours = {}
    for key, tensor in sd.items():
        match = _BLOCK.match(key)
        name = match.group(2) if match else key
        if key in _DROPPED or name.startswith("norm"):
            continue  # checked above; the norm weights are folded into adaLN below
        if name.startswith("adaLN_modulation.1.") or key.startswith("final_layer.adaLN_modulation.1."):
            continue
        if found["rope"] and name in ("attn.qkv.weight", "attn.qkv.bias"):
            tensor = _permute_qk(tensor, args)
        elif found["rope"] and name in ("attn.q_norm.weight", "attn.k_norm.weight"):
            tensor = tensor[_rope_order(args.head_dim)]
        elif found["learn_sigma"] and key.startswith("final_layer.linear."):  # (p p 2C, ...) -> (p p C, ...)
            c = found["channels"]
            tensor = tensor.reshape(-1, 2 * c, *tensor.shape[1:])[:, :c].reshape(-1, *tensor.shape[1:])
        name = name.replace("mlp.w12.", "mlp.fc1.").replace("mlp.w3.", "mlp.fc2.")
        ours[f"blocks.{match.group(1)}.{name}" if match else name] = tensor
    depth = 1 + max((int(m.group(1)) for m in map(_BLOCK.match, sd) if m), default=-1)
    for i in range(depth):
        prefix = f"blocks.{i}."
        norms = [sd.get(prefix + "norm1.weight"), sd.get(prefix + "norm2.weight")]
        w, b = sd[prefix + "adaLN_modulation.1.weight"], sd[prefix + "adaLN_modulation.1.bias"]
        ours[prefix + "adaLN_modulation.1.weight"], ours[prefix + "adaLN_modulation.1.bias"] = _adaln(
            w, b, norms, 6, found["wo_shift"]
        )
    final = "final_layer.adaLN_modulation.1."
    norm_final = [sd.get("final_layer.norm_final.weight")]
    ours[final + "weight"], ours[final + "bias"] = _adaln(sd[final + "weight"], sd[final + "bias"], norm_final, 2,
                                                          False)  # fmt: skip
    return _checked(ours, args, source)


def _checked(ours: dict, args: DiTArgs, source: str) -> dict:
    with torch.device("meta"):
        expected = DiT(args).state_dict()
    for name, tensor in ours.items():
        if name not in expected:
            raise ValueError(f"{source}: unexpected key {name!r} (our name): no parameter of this DiT (depth "
                             f"{args.depth}) maps to it; {_HINT}")  # fmt: skip
        if tensor.shape != expected[name].shape:
            raise ValueError(f"{source}: {name} (our name) has shape {tuple(tensor.shape)}, the model "
                             f"{tuple(expected[name].shape)}; set model.flavor (or the [model] overrides num_classes, "
                             "input_size, in_channels, patch_size) to the checkpoint's")  # fmt: skip
    missing = sorted(set(expected) - set(ours))
    if missing:
        raise ValueError(f"{source}: no weights for {missing[:5]}{' ...' if len(missing) > 5 else ''}; set "
                         "model.flavor to the checkpoint's")  # fmt: skip
    return {name: tensor.float().contiguous() for name, tensor in ours.items()}


def read_lightningdit_pt(path: str | Path, args: DiTArgs) -> dict[str, torch.Tensor]:
    """A LightningDiT `.pt` file as our full state dict for `DiT(args)` (loads with strict=True): train.py's
    checkpoint (its EMA weights) or a plain state dict.

    Raises:
        FileNotFoundError: no such file.
        ValueError: the file names code outside the allow-list (safe_pickle.UnsafePickleError), is no LightningDiT
            state dict, or does not fit `args` (see from_lightningdit); the file named.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist")
    loaded = safe_pickle.torch_load_file(path, LIGHTNINGDIT_PT_PICKLE_GLOBALS, "a LightningDiT checkpoint")
    if not isinstance(loaded, dict):
        raise ValueError(f"{path}: holds a {type(loaded).__name__}, not a LightningDiT state dict or checkpoint")
    loaded = weights_of(loaded, path, "LightningDiT's train.py checkpoint ({'model', 'ema', 'opt', 'config'})")
    return from_lightningdit(loaded, args, str(path))
