"""What each clipped layer sees, captured inside the traced graph: its input, and its output gradient.

Every module that owns a trainable parameter gets a subclass of its own class (`DP<Name>`, the way FSDP2 wraps
classes) whose forward runs the layer rule's functional forward, with the parameters detached, and routes the output
through `_Tap`, an autograd function that also takes the model's per-row `token` and the layer's key. `_Tap`'s
backward hands the layer's input and output gradient to one custom op, `torchtitan_dp::layer_backward`, whose
result is the token's gradient: the layer's per-sample squared gradient norms. So `torch.autograd.grad(sum_i L_i,
token)` returns the per-sample squared norms summed over every layer, while the custom op passes each layer's input
and output gradient to the engine (book-keeping keeps them; ghost clipping's second pass turns them into weight
gradients). Autograd computes no weight gradient at all: the parameters are detached inside their modules.
In book-keeping modes a compiled backward computes each layer's norms itself, with the rule's torch ops, which the
compiler fuses into its graph, and calls the lighter `torchtitan_dp::keep_layer` instead, which only keeps the
layer's input and output gradient: no Python per layer for the norms.

Nothing here is a Python-side hook on a traced path: the tap, the detached forward and the token are ordinary
traced code, and the custom op is opaque to the compiler, which calls it like a kernel. A compiled block is one
graph with or without DP. The token is made by a forward pre-hook on the root module, outside any compiled block,
for each forward with grad enabled: a (rows,) float32 leaf, rows being the leading dim of the model's first input.
"""

import collections
import itertools

import torch
from torch import nn

from torchtitan.dp.layers import LayerRule, find_layer_rule

_RECORDS: dict[int, "LayerRecord"] = {}  # key -> record: how the custom op finds its layer
_KEYS = itertools.count()
_CAPTURED_CLASSES: dict[type, type] = {}


class LayerRecord:
    """One module with trainable parameters and what the current step captured from it."""

    def __init__(self, name: str, module: nn.Module, rule: LayerRule, params: dict[str, nn.Parameter],
                 capture: "LayerCapture"):  # fmt: skip
        self.name = name
        self.module = module
        self.rule = rule
        self.param_names = tuple(params)
        self.params = params  # as registered now (the sharded DTensors under FSDP)
        self.capture = capture
        self.key = next(_KEYS)
        self.x: torch.Tensor | None = None  # the input of this step's call (book-keeping keeps it)
        self.grad: torch.Tensor | None = None  # the output gradient (book-keeping keeps it)
        self.grads: dict[str, torch.Tensor] | None = None  # ghost clipping's second pass: the weight gradients
        self.state: dict = {}  # what the rule's norm_sq left for its grads, this step
        self.seen = False  # the norm pass reached this layer this step

    def clear(self) -> None:
        self.x = self.grad = self.grads = None
        self.state, self.seen = {}, False


def build_records(model: nn.Module, capture: "LayerCapture") -> list[LayerRecord]:
    """A record per module with trainable parameters; raises for anything the engine cannot clip."""
    records = []
    for module_name, module in model.named_modules():
        params = {n: p for n, p in module.named_parameters(recurse=False) if p.requires_grad}
        if not params:
            continue
        label = f"{module_name or '<root>'} ({type(module).__name__})"
        found = find_layer_rule(module)
        if found is None:
            raise NotImplementedError(
                f"DP-SGD has no per-sample gradient rule for module {label}, which has trainable parameters "
                f"{list(params)}; freeze them or register a rule with torchtitan.dp.register_layer_rule"
            )
        ruled_class, rule = found
        if type(module).forward is not ruled_class.forward:
            # The engine runs the rule's forward (of the ruled class) instead of the module's: an overriding
            # forward would be skipped.
            raise NotImplementedError(
                f"module {label} overrides {ruled_class.__name__}.forward, which DP-SGD runs as its rule's functional "
                f"forward; register a rule for {type(module).__name__} with torchtitan.dp.register_layer_rule"
            )
        unknown = sorted(set(params) - set(rule.param_names))
        if unknown:
            raise NotImplementedError(f"DP-SGD rule for module {label} does not cover its parameters {unknown}")
        try:
            rule.check(module)
        except NotImplementedError as e:
            raise NotImplementedError(f"module {label}: {e}") from e
        records.append(LayerRecord(module_name, module, rule, params, capture))
    uses = collections.Counter(id(p) for _, p in model.named_parameters(remove_duplicate=False) if p.requires_grad)
    shared = [n for n, p in model.named_parameters() if uses[id(p)] > 1]
    if shared:
        # A tied parameter's per-sample gradient sums over its modules; the per-layer rules cannot see that.
        raise NotImplementedError(f"DP-SGD does not support parameters shared between modules: {shared}")
    return records


@torch.library.custom_op("torchtitan_dp::layer_backward", mutates_args=())
def layer_backward(x: torch.Tensor, grad: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """The layer of `key` got output gradient `grad` for input `x`: (rows,) float32, its share of the token's gradient.

    Opaque to the compiler (a compiled backward calls it like a kernel), so the engine's Python runs here at run time.
    """
    record = _RECORDS[int(key)]
    on_grad = record.capture.on_grad
    if on_grad is None:  # a plain .backward() of a DP model's loss: the layer adds nothing
        return grad.new_zeros(grad.shape[0], dtype=torch.float32)
    return on_grad(record, x, grad, None)


@layer_backward.register_fake
def _(x, grad, key):
    return grad.new_empty(grad.shape[0], dtype=torch.float32)


@torch.library.custom_op("torchtitan_dp::keep_layer", mutates_args=())
def keep_layer(x: torch.Tensor, grad: torch.Tensor, key: torch.Tensor, norm_sq: torch.Tensor,
               state: list[torch.Tensor], state_names: str) -> torch.Tensor:  # fmt: skip
    """`layer_backward` for a compiled backward that computed the layer's (B,) squared norms `norm_sq` itself (and
    the pieces its rule left in `state`, named by the comma-separated `state_names`): the engine only keeps what the
    layer saw and runs its checks, in Python, with no kernel but a copy of the norms (an op's result is its own)."""
    record = _RECORDS[int(key)]
    on_grad = record.capture.on_grad
    if on_grad is None:  # a plain .backward() of a DP model's loss: the layer adds nothing
        return grad.new_zeros(grad.shape[0], dtype=torch.float32)
    names = state_names.split(",") if state_names else []
    share = on_grad(record, x, grad, (norm_sq, dict(zip(names, state, strict=True))))
    return share.clone() if share is norm_sq else share


@keep_layer.register_fake
def _(x, grad, key, norm_sq, state, state_names):
    return grad.new_empty(grad.shape[0], dtype=torch.float32)


class _Tap(torch.autograd.Function):
    """Identity on a layer's output; its backward gives the token the layer's per-sample squared norms.

    Given the module (`module`, book-keeping modes), a traced backward computes the norms itself with the rule's torch
    ops, which the compiler fuses into the graph, for one row per sample (the engine passes no module with augmult's
    K > 1, and recomputes the norms should a traced graph meet K > 1). Otherwise, and always when not traced, the
    custom op `layer_backward` computes them in Python at run time.
    """

    @staticmethod
    def forward(ctx, out, x, token, key, module):
        ctx.save_for_backward(x, key)
        ctx.module = module
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):
        x, key = ctx.saved_tensors
        module = ctx.module
        if module is None or not torch.compiler.is_compiling():
            return grad, None, torch.ops.torchtitan_dp.layer_backward(x, grad, key), None, None
        state = {}
        norm_sq = module._dp_rule.norm_sq(module, x, grad, module._dp_names, False, 1, state)
        share = torch.ops.torchtitan_dp.keep_layer(x, grad, key, norm_sq, list(state.values()), ",".join(state))
        return grad, None, share, None, None


def _captured_forward(self, *args, **kwargs):
    """The forward of every captured module: the rule's forward on detached parameters, then the tap."""
    token = self._dp_capture.token
    if token is None or not torch.is_grad_enabled():  # eval, or a forward the engine did not start
        return self._dp_base.forward(self, *args, **kwargs)
    rule = self._dp_rule
    x = args[0] if args else next(iter(kwargs.values()))
    if rule.cast_input and x.is_floating_point() and torch.is_autocast_enabled(x.device.type):
        # What autocast does inside the call, done before it: the tap keeps the tensor the matmul reads.
        x = x.to(torch.get_autocast_dtype(x.device.type))
        args, kwargs = ((x, *args[1:]), kwargs) if args else ((x,), {})
    out = rule.forward(self, *args, **kwargs)
    if not isinstance(out, torch.Tensor):
        raise NotImplementedError(f"{type(self).__name__} must return one tensor for DP-SGD")
    module = self if self._dp_capture.norms_in_graph else None
    return _Tap.apply(out, x if rule.keep_input else x.new_empty(0), token, self._dp_key, module)


def _captured_class(cls: type) -> type:
    if cls not in _CAPTURED_CLASSES:
        _CAPTURED_CLASSES[cls] = type(f"DP{cls.__name__}", (cls,), {"forward": _captured_forward, "_dp_base": cls})
    return _CAPTURED_CLASSES[cls]


class LayerCapture:
    """Makes a model's clipped modules capture what the engine needs, and holds what one step captured."""

    def __init__(self, model: nn.Module, norms_in_graph: bool = False):
        self.records = build_records(model, self)
        self.token: torch.Tensor | None = None
        # Set by the engine during its passes: (record, x, grad, computed) -> (rows,) float32, `computed` the
        # (norm_sq, state) a compiled backward found (keep_layer) or None (layer_backward).
        self.on_grad = None
        # Compiled backwards compute the norms in their graph (one-pass modes: nothing else needs the layer's
        # norms); read when a forward is traced.
        self.norms_in_graph = norms_in_graph
        for record in self.records:
            module = record.module
            _RECORDS[record.key] = record
            module._dp_capture, module._dp_rule, module._dp_names = self, record.rule, record.param_names
            # A tensor, not an int: a compiled block's graph then serves every block (ints would be guarded on).
            module._dp_key = torch.tensor(record.key)
            module.__class__ = _captured_class(type(module))
        self._handle = model.register_forward_pre_hook(self._start, with_kwargs=True)

    @torch.compiler.disable
    def _start(self, module, args, kwargs):
        """A new token per forward with grad enabled (outside compiled code, so autograd can backpropagate to it)."""
        self.token = None
        if not torch.is_grad_enabled():
            return None
        first = next((t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)), None)
        if first is None:
            raise ValueError("DP-SGD needs a tensor input whose leading dim is the batch")
        self.token = torch.zeros(first.shape[0], device=first.device, dtype=torch.float32, requires_grad=True)
        return None

    def reset(self) -> None:
        for r in self.records:
            r.clear()
        self.token = None

    def remove(self) -> None:
        """Gives every module its own class and forward back."""
        self._handle.remove()
        for record in self.records:
            module = record.module
            module.__class__ = module._dp_base
            del module._dp_capture, module._dp_rule, module._dp_names, module._dp_key
            _RECORDS.pop(record.key, None)
        self.records = []


def outside_uses(losses: torch.Tensor, token: torch.Tensor) -> list[torch.Tensor]:
    """Every leaf tensor autograd would reach from `losses` other than the token.

    Inside their modules the parameters are detached, so a parameter that gets a gradient from the losses was used
    outside its module (or is an input that requires grad). Compiled graphs link every parameter they read, used or
    not: the candidates' gradients, not the graph, decide.
    """
    seen, stack, leaves = {losses.grad_fn}, [losses.grad_fn], []
    while stack:
        node = stack.pop()
        variable = getattr(node, "variable", None)  # only AccumulateGrad nodes carry one
        if variable is not None and variable is not token:
            leaves.append(variable)
        for nxt, _ in node.next_functions:
            if nxt is not None and nxt not in seen:
                seen.add(nxt)
                stack.append(nxt)
    return leaves
