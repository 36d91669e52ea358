"""What each clipped layer sees: its input in the forward, its output gradient in the backward.

A forward hook on every module that owns a trainable parameter keeps the module's input and
routes its output through `_Tap`, an identity autograd function that also takes a shared
0-dim `token`. Backpropagating to the token alone (`torch.autograd.grad(loss, token)`) then
visits every tap, handing each layer its output gradient, while autograd skips every weight
gradient: no `.grad` is written and no weight-gradient matmul runs. The same graph can then be
backpropagated again normally (ghost clipping's second pass), where the taps are identities.

On the first step the hooks also record which autograd nodes each module call created, so that
`check_param_usage` can prove every use of a parameter happened inside its own module.
"""

import collections
import functools

import torch
from torch import nn

from torchtitan.dp.layers import LayerRule, find_layer_rule


class LayerRecord:
    """One module with trainable parameters and what the current step captured from it."""

    def __init__(self, name: str, module: nn.Module, rule: LayerRule, params: dict[str, nn.Parameter]):
        self.name = name
        self.module = module
        self.rule = rule
        self.param_names = tuple(params)
        self.params = params  # as registered now (the sharded DTensors under FSDP)
        self.x: torch.Tensor | None = None  # the input of this step's call
        self.grad: torch.Tensor | None = None  # the output gradient (book-keeping keeps it)
        self.state: dict = {}  # what the rule's norm_sq left for its grads, this step
        self.forward_params: dict[str, torch.Tensor] = {}  # the tensors the call used (unsharded under FSDP)
        self.owned_nodes: set | None = None  # autograd nodes the call created (first step only)
        self.output_node = None  # grad_fn of the call's output (first step only)

    def clear(self) -> None:
        self.x = self.grad = self.owned_nodes = self.output_node = None
        self.forward_params, self.state = {}, {}


def build_records(model: nn.Module) -> list[LayerRecord]:
    """A record per module with trainable parameters; raises for anything the engine cannot clip."""
    records = []
    for module_name, module in model.named_modules():
        params = {n: p for n, p in module.named_parameters(recurse=False) if p.requires_grad}
        if not params:
            continue
        label = f"{module_name or '<root>'} ({type(module).__name__})"
        rule = find_layer_rule(module)
        if rule is None:
            raise NotImplementedError(
                f"DP-SGD has no per-sample gradient rule for module {label}, which has trainable parameters "
                f"{list(params)}; freeze them or register a rule with torchtitan.dp.register_layer_rule"
            )
        unknown = sorted(set(params) - set(rule.param_names))
        if unknown:
            raise NotImplementedError(f"DP-SGD rule for module {label} does not cover its parameters {unknown}")
        try:
            rule.check(module)
        except NotImplementedError as e:
            raise NotImplementedError(f"module {label}: {e}") from e
        records.append(LayerRecord(module_name, module, rule, params))
    uses = collections.Counter(id(p) for _, p in model.named_parameters(remove_duplicate=False) if p.requires_grad)
    shared = [n for n, p in model.named_parameters() if uses[id(p)] > 1]
    if shared:
        # A tied parameter's per-sample gradient sums over its modules; the per-layer rules cannot see that.
        raise NotImplementedError(f"DP-SGD does not support parameters shared between modules: {shared}")
    return records


class _Tap(torch.autograd.Function):
    """Identity on a layer's output whose backward hands the output gradient to the capture."""

    @staticmethod
    def forward(ctx, out, token, capture, record):
        ctx.capture, ctx.record = capture, record
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):
        if ctx.capture.on_grad is not None:
            ctx.capture.on_grad(ctx.record, grad)
        return grad, None, None, None


class LayerCapture:
    """Installs the hooks on a model's clipped modules and holds what one step captured."""

    def __init__(self, model: nn.Module):
        self.records = build_records(model)
        self.token: torch.Tensor | None = None
        self.on_grad = None  # set by the engine during its norm pass; None: taps are identities
        self.track_graph = True  # record the autograd nodes of each call (for check_param_usage)
        self._handles = [r.module.register_forward_hook(self._hook(r), with_kwargs=True) for r in self.records]
        # Every record gets the pre-hook: under torch.compile its graph break comes before the call,
        # so each hooked module runs eagerly and its autograd nodes are its own.
        self._handles += [
            r.module.register_forward_pre_hook(functools.partial(_pre_hook, r.rule.cast_input), with_kwargs=True)
            for r in self.records
        ]

    def _hook(self, record: LayerRecord):
        # Side effects on Python objects do not survive tracing: under torch.compile the hook runs
        # eagerly, a graph break around each hooked module.
        @torch.compiler.disable
        def forward_hook(module, args, kwargs, output):
            # Eval forwards need nothing; a forward inside a backward is activation checkpointing
            # recomputing, whose output values equal the ones already captured.
            if not torch.is_grad_enabled() or torch._C._current_graph_task_id() != -1:
                return None
            if record.x is not None:
                raise RuntimeError(
                    f"module {record.name} ran twice before DPEngine.backward(): a module must run once per "
                    "forward, and each forward must be followed by engine.backward()"
                )
            x = args[0] if args else next(iter(kwargs.values()))
            if not isinstance(output, torch.Tensor):
                raise NotImplementedError(f"module {record.name} must return one tensor for DP-SGD")
            record.x = x.detach() if record.rule.keep_input else x.new_empty(0)
            if self.track_graph:
                record.forward_params = {n: getattr(module, n) for n in record.param_names}
                record.owned_nodes = _nodes_of_call(output, (*args, *kwargs.values()))
                record.output_node = output.grad_fn
            if self.token is None:
                self.token = torch.zeros((), device=output.device, requires_grad=True)
            return _Tap.apply(output, self.token, self, record)

        return forward_hook

    def captured(self) -> list[LayerRecord]:
        return [r for r in self.records if r.x is not None]

    def reset(self) -> None:
        for r in self.records:
            r.clear()
        self.token = None

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []


@torch.compiler.disable
def _pre_hook(cast_input: bool, module, args, kwargs):
    # Casting is what autocast would do inside the call, done before it: autograd then saves the
    # same tensor the forward hook keeps, instead of a cast copy next to our full-precision one.
    x = args[0] if args else None
    if not cast_input or not isinstance(x, torch.Tensor) or not x.is_floating_point():
        return None
    device = x.device.type
    if not torch.is_autocast_enabled(device) or x.dtype == torch.get_autocast_dtype(device):
        return None
    return (x.to(torch.get_autocast_dtype(device)), *args[1:]), kwargs


def _nodes_of_call(output: torch.Tensor, inputs: tuple) -> set:
    """Autograd nodes between a module call's output and its inputs: what the call created."""
    stop = {t.grad_fn for t in inputs if isinstance(t, torch.Tensor) and t.grad_fn is not None}
    seen, stack = set(), [output.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen or node in stop:
            continue
        seen.add(node)
        stack.extend(nxt for nxt, _ in node.next_functions)
    return seen


def check_param_usage(root: torch.Tensor, records: list[LayerRecord], token: torch.Tensor) -> None:
    """Raises if a trainable parameter reaches the loss other than through its own module's call.

    Walks the whole autograd graph once. Every leaf that receives a gradient must be a parameter
    that a hook saw, and every operation that combines it with anything else must be one its
    module's call created. Pure functions of the parameter (autocast's cached casts, transposes)
    are followed through, so a use of the cached copy elsewhere is caught too.
    """
    consumers, seen, stack = collections.defaultdict(list), {root.grad_fn}, [root.grad_fn]
    while stack:
        node = stack.pop()
        for nxt, _ in node.next_functions:
            if nxt is None:
                continue
            consumers[nxt].append(node)
            if nxt not in seen:
                seen.add(nxt)
                stack.append(nxt)
    owner = {id(t): (r, n) for r in records for n, t in r.forward_params.items()}
    for leaf in seen:
        variable = getattr(leaf, "variable", None)  # only AccumulateGrad nodes carry one
        if variable is None or variable is token:
            continue
        if id(variable) not in owner:
            raise RuntimeError(
                f"a trainable tensor of shape {tuple(variable.shape)} gets a gradient outside every clipped module "
                "call (a parameter used outside its module, or an input that requires grad); DP-SGD cannot clip it"
            )
        record, name = owner[id(variable)]
        chain, frontier = {leaf}, [leaf]
        while frontier:
            for user in consumers[frontier.pop()]:
                if user in chain or user is record.output_node:
                    continue  # the module's output (an embedding's is a function of its weight alone)
                if all(nxt is None or nxt in chain for nxt, _ in user.next_functions):
                    chain.add(user)  # a function of the parameter alone: follow its users
                    frontier.append(user)
                elif user not in record.owned_nodes:
                    raise RuntimeError(
                        f"parameter '{record.name}.{name}' is used outside its module (by {user.name()}); "
                        "DP-SGD's per-layer rules would miss that part of its gradient"
                    )
