"""DPEngine: per-sample clipped, noised gradients (DP-SGD, Abadi et al., 2016) in one call.

After a forward of the wrapped model, `engine.backward(per_sample_losses)` leaves in every
trainable `p.grad` the value (sum_i c_i g_i + noise) / B, where g_i is the gradient of sample
i's loss over all trainable parameters, c_i = min(1, C / (||g_i|| + 1e-6)) and B the global
batch size. Modes differ only in how they get there:

- "ghost": two backward passes. The first computes per-sample norms layer by layer from the
  layer inputs and output gradients (ghost norms, Li et al., 2021) without any weight gradient;
  the second, a backward of sum_i c_i L_i / B, forms each layer's weight gradients from its input
  and output gradient.
- "bookkeeping": one backward that keeps every layer's output gradient, then each weight
  gradient as one matmul A^T diag(c) G (book-keeping, Bu et al., 2023).
- "flash" / "flash_bookkeeping": the same with the Triton norm kernels of flash_kernels.py.
- "vanilla": the plain mean-loss backward (not private), for comparison.
"""

import re
from collections.abc import Callable

import torch
from torch import nn
from torch._dynamo.eval_frame import OptimizedModule
from torch.distributed.tensor import DTensor

from torchtitan.dp import distributed as dpdist
from torchtitan.dp.capture import LayerCapture, LayerRecord, outside_uses
from torchtitan.dp.layers import Coefficients
from torchtitan.dp.noise import add_gaussian_noise_many_

DP_MODES = ("vanilla", "ghost", "flash", "bookkeeping", "flash_bookkeeping")
_TWO_PASS = ("ghost", "flash")
_FLASH = ("flash", "flash_bookkeeping")
# Wrappers that insert names into FQNs; noise seeds use the FQN without them.
_WRAPPER_NAMES = re.compile(r"(_checkpoint_wrapped_module|_orig_mod|_fsdp_wrapped_module)\.")


def _keep_compiled_buffers() -> None:
    """Makes the layer inputs and output gradients that book-keeping keeps safe to hold in compiled code, uncopied.

    Inductor's generated code may hand a buffer's memory to a later tensor once the buffer's last use has run
    (`allow_buffer_reuse`), or write a kernel's output over a dead input (`inplace_buffers`): a buffer the custom op
    saw could then change under the engine before its weight gradient is formed. Without both, each buffer is its
    own allocation, freed by dropping its last reference, so holding the tensor keeps its values (as in eager). Set
    before the first forward compiles anything; they are part of inductor's cache key.
    """
    import torch._inductor.config

    torch._inductor.config.allow_buffer_reuse = False
    torch._inductor.config.inplace_buffers = False


def _per_row(norm_sq: torch.Tensor, group: int) -> torch.Tensor:
    """(B,) per-sample values as the token's (B K,) rows: sample i's at row i K, zeros in its other K - 1 rows."""
    if group == 1:
        return norm_sq
    rows = norm_sq.new_zeros(norm_sq.shape[0], group)
    rows[:, 0] = norm_sq
    return rows.view(-1)


class DPEngine:
    """Differentially private backward for a model (plain, FSDP2/HSDP, or DDP `replicate`).

    Build it after the model is parallelized and compiled, before the first forward: it captures every
    module that owns a trainable parameter (capture.py), and refuses (NotImplementedError naming the
    module) a module it has no per-sample rule for. Frozen parameters are skipped.

    Args:
        model: the model, already wrapped by fully_shard / replicate if distributed.
        mode: one of DP_MODES.
        max_grad_norm: the clipping bound C.
        noise_multiplier: sigma; the noise std is sigma * C on the summed gradient.
        global_batch_size: B of the average. Under Poisson sampling pass the expected batch size
            (sample_rate * dataset size), as the accountant assumes; None counts the samples of
            each call over all data-parallel ranks (its mask if given).
        dp_mesh: the data-parallel DeviceMesh (1D, or 2D for HSDP); None: the default world.
        seed: noise seed; with the step counter it fixes the noise (see noise.py).
        augmult: the K of the per-sample losses `backward` will get (rows per sample). A compiled backward is traced
            before the first call says K, for one row a sample: with K > 1 the engine computes the norms instead.
    """

    def __init__(
        self,
        model: nn.Module,
        mode: str,
        max_grad_norm: float,
        noise_multiplier: float,
        global_batch_size: int | float | None = None,
        dp_mesh=None,
        seed: int = 0,
        augmult: int = 1,
    ):
        if mode not in DP_MODES:
            raise ValueError(f"DP mode must be one of {DP_MODES}, got {mode!r}")
        if max_grad_norm <= 0 or noise_multiplier < 0:
            raise ValueError(
                f"need max_grad_norm > 0 and noise_multiplier >= 0, got {max_grad_norm}, {noise_multiplier}"
            )
        self.model, self.mode = model, mode
        self.max_grad_norm, self.noise_multiplier = float(max_grad_norm), float(noise_multiplier)
        self.global_batch_size, self.seed, self.step = global_batch_size, int(seed), 0
        base = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
        self._params = [(_WRAPPER_NAMES.sub("", n), p) for n, p in base.named_parameters() if p.requires_grad]
        self._groups = dpdist.dp_groups(dp_mesh)
        self._sharded = any(isinstance(p, DTensor) for _, p in self._params)
        self._ddp = dpdist.is_ddp(model)
        # One-pass modes: a compiled backward computes the norms in its graph (capture.keep_layer).
        in_graph = mode not in _TWO_PASS and augmult == 1
        self._capture = LayerCapture(model, norms_in_graph=in_graph) if mode != "vanilla" else None
        # Compiled parts in the model: their layer inputs are buffers of compiled code (see _keep_compiled_buffers).
        self._compiled = any(
            isinstance(m, OptimizedModule) or getattr(m, "_compiled_call_impl", None) is not None
            for m in model.modules()
        )
        if mode != "vanilla":
            # Ghost clipping backpropagates through the graph twice (retain_graph=True), which compiled backwards
            # that donate their buffers refuse, and a donated saved tensor's memory may be reused while book-keeping
            # still holds the layer input; set before the first forward compiles anything.
            import torch._functorch.config

            torch._functorch.config.donated_buffer = False
            if mode not in _TWO_PASS:
                _keep_compiled_buffers()
        self._captured: frozenset[str] | None = None  # modules the first step's norm pass reached
        self._check_uses = True  # the first step checks that no parameter is used outside its module
        self._group = 1  # augmult K of the backward in progress: rows per sample
        self._norm_sq: torch.Tensor | None = None  # the norms being summed (a DP buffer, for the breakdown)

    def backward(
        self,
        per_sample_losses: torch.Tensor,
        mask: torch.Tensor | None = None,
        add_noise: bool = True,
        on_norms: Callable[[], None] | None = None,
    ) -> torch.Tensor | None:
        """Private backward of this rank's per-sample losses.

        Args:
            per_sample_losses: (B_local,) losses, or (B_local, K) for augmult (K noise/timestep
                draws per example), averaged over K before clipping. With K > 1 the forward ran on
                B_local * K rows, the K draws of example i in rows i K ... i K + K - 1.
            mask: optional (B_local,) bool; False rows (padding of a Poisson batch) contribute nothing.
            add_noise: False for all but the last micro-batch of an accumulated step: gradients
                accumulate into .grad and the noise (and the step counter) come once.
            on_norms: called once the per-sample norms exist, while the engine's buffers are at their largest
                (book-keeping's kept output gradients): the trainer's "dp_norms" stage (the memory breakdown).

        Returns:
            (B_local,) per-sample gradient norms before clipping; None in "vanilla".
        """
        losses = per_sample_losses.mean(1) if per_sample_losses.dim() == 2 else per_sample_losses
        self._group = per_sample_losses.shape[1] if per_sample_losses.dim() == 2 else 1
        if losses.dim() != 1:
            raise ValueError(f"per-sample losses must be (B,) or (B, K), got {tuple(per_sample_losses.shape)}")
        keep = None if mask is None else mask.to(device=losses.device, dtype=torch.bool)
        batch = self._global_batch(losses, keep)
        if self.mode == "vanilla":
            kept = losses if keep is None else losses * keep
            self._plain_backward(kept.sum(), batch)
            norms = None
        else:
            norms = self._private_backward(losses, keep, batch, on_norms)
        if add_noise and self.mode != "vanilla":
            self._add_noise(batch)
            self.step += 1
        return norms

    def _private_backward(self, losses, keep, batch, on_norms) -> torch.Tensor:
        capture = self._capture
        token = capture.token
        if token is None or losses.grad_fn is None:
            raise RuntimeError(
                "DPEngine.backward() needs the losses of a forward of the model the engine was built on, run with grad "
                "enabled"
            )
        if token.shape[0] != losses.shape[0] * self._group:
            raise RuntimeError(
                f"the model's forward ran on {token.shape[0]} rows for {losses.shape[0]} samples x K = {self._group} "
                "(augmult: the forward must run on B * K rows, each sample's K draws consecutive)"
            )
        try:
            norms = self._norm_pass(losses, token)
            captured = frozenset(r.name for r in capture.records if r.seen)
            if self._captured is None:
                self._captured = captured
            elif captured != self._captured:  # later steps: the same layers must reach the loss
                raise RuntimeError(
                    f"DP capture saw different modules than on the first step: missing "
                    f"{sorted(self._captured - captured)}, new {sorted(captured - self._captured)}"
                )
            if on_norms is not None:
                on_norms()
            coef = (self.max_grad_norm / (norms + 1e-6)).clamp(max=1.0)
            if keep is not None:
                coef = coef * keep
            if self.mode in _TWO_PASS:
                self._grad_pass((losses * (coef / batch)).sum(), token)
                self._write_grads(None)
            else:
                self._write_grads(Coefficients(coef / batch))
        finally:
            capture.reset()
            self._norm_sq = None
        return norms

    def _norm_pass(self, losses: torch.Tensor, token: torch.Tensor) -> torch.Tensor:
        """First backward: per-sample norms from every layer's input and output gradient, summed in the token's
        gradient; book-keeping keeps each layer's input and output gradient."""
        flash, two_pass = self.mode in _FLASH, self.mode in _TWO_PASS
        group, samples = self._group, losses.shape[0]

        def on_grad(record: LayerRecord, x: torch.Tensor, grad: torch.Tensor, computed) -> torch.Tensor:
            if record.seen:
                raise RuntimeError(
                    f"module {record.name} ran twice in one forward: a module must run once per forward, and each "
                    "forward must be followed by engine.backward()"
                )
            record.seen = True
            if computed is not None and group == 1:  # a compiled backward's norms, traced for one row per sample
                norm_sq, record.state = computed
            else:
                norm_sq = record.rule.norm_sq(record.module, x, grad, record.param_names, flash, group, record.state)
            if two_pass:
                record.state = {}  # the second pass computes the weight gradients afresh
            else:  # kept as they are: nothing writes into them while the engine holds them (_keep_compiled_buffers)
                record.x, record.grad = x, grad
            return _per_row(norm_sq, group)

        inputs = [token]
        if self._check_uses:  # first step: prove no parameter is used outside its module
            inputs += outside_uses(losses, token)
        grads = self._through_layers(on_grad, losses.sum(), inputs, retain_graph=two_pass)
        if self._check_uses:
            self._raise_outside_uses([t for t, g in zip(inputs[1:], grads[1:]) if g is not None])
            self._check_uses = False
        if grads[0] is None:
            raise RuntimeError("the losses do not depend on any clipped layer of this step's forward")
        norm_sq = self._norm_sq = grads[0].view(samples, group).sum(1)
        return norm_sq.sqrt()

    def _grad_pass(self, weighted_sum: torch.Tensor, token: torch.Tensor) -> None:
        """Ghost clipping's second backward, of sum_i c_i L_i / B: each layer's weight gradients from its input and
        output gradient, kept for `_write_grads`."""
        group = self._group

        def on_grad(record: LayerRecord, x: torch.Tensor, grad: torch.Tensor, computed) -> torch.Tensor:
            record.grads = record.rule.grads(record.module, x, grad, None, record.param_names, group, {})
            return grad.new_zeros(grad.shape[0], dtype=torch.float32)

        self._through_layers(on_grad, weighted_sum, [token])

    def _through_layers(self, on_grad, output: torch.Tensor, inputs: list, retain_graph: bool = False) -> tuple:
        """autograd.grad(output, inputs) with `on_grad` handling each captured layer's (input, output gradient)."""
        self._capture.on_grad = on_grad
        try:
            return torch.autograd.grad(output, inputs, retain_graph=retain_graph, allow_unused=True)
        finally:
            self._capture.on_grad = None

    def _raise_outside_uses(self, used: list[torch.Tensor]) -> None:
        if not used:
            return
        names = {id(p): n for n, p in self.model.named_parameters()}
        for record in self._capture.records:  # under FSDP the forward used the unsharded tensors
            for n in record.param_names:
                names.setdefault(id(getattr(record.module, n)), f"{record.name}.{n}")
        known = [names[id(t)] for t in used if id(t) in names]
        if known:
            raise RuntimeError(
                f"parameter '{_WRAPPER_NAMES.sub('', known[0])}' is used outside its module; DP-SGD's per-layer rules "
                "would miss that part of its gradient"
            )
        raise RuntimeError(
            f"a trainable tensor of shape {tuple(used[0].shape)} gets a gradient outside every clipped module call "
            "(a parameter used outside its module, or an input that requires grad); DP-SGD cannot clip it"
        )

    def _plain_backward(self, loss_sum: torch.Tensor, batch) -> None:
        """loss_sum / B backpropagated so that .grad ends up summed over ranks and divided by B."""
        if self._sharded:
            divide = dpdist.fsdp_divide_factor(self.model) or 1.0
            (loss_sum * (divide / batch)).backward()
        elif self._ddp:
            (loss_sum * (self._dp_size() / batch)).backward()
        elif self._groups:
            # A plain model on several ranks: reduce this call's gradients only, not accumulated ones.
            previous = {p: p.grad for _, p in self._params}
            for _, p in self._params:
                p.grad = None
            (loss_sum / batch).backward()
            reducer = dpdist.ReplicatedGradReducer(self._groups)
            for _, p in self._params:
                new, p.grad = p.grad, previous[p]
                if new is not None:
                    reducer.add(p, new)  # summed over ranks into what earlier micro-batches left
            reducer.finish()
        else:
            (loss_sum / batch).backward()

    def _write_grads(self, scale: Coefficients | None) -> None:
        """sum_i scale_i g_i per parameter, reduced over ranks, into .grad: book-keeping's one matmul per layer from
        the kept input and output gradient, or (scale None) the gradients ghost clipping's second pass left."""
        plain = dpdist.ReplicatedGradReducer(self._groups)
        sharded = dpdist.ShardedGradReducer()
        # Every record, captured or not, in a fixed order: ranks must issue the same collectives.
        for record in self._capture.records:
            if record.grads is not None:
                grads = record.grads
            elif record.x is not None and record.grad is not None:
                grads = record.rule.grads(record.module, record.x, record.grad, scale, record.param_names,
                                          self._group, record.state)  # fmt: skip
            else:  # the layer did not reach the loss on this rank
                grads = {n: None for n in record.param_names}
            record.x = record.grad = record.grads = None  # free the layer's activations as soon as its grads exist
            record.state = {}
            for name, grad in grads.items():
                param = record.params[name]
                # Reduced in buckets while the next layers' gradients are formed, cast to the param's dtype there.
                (sharded if isinstance(param, DTensor) else plain).add(param, grad)
        sharded.finish()
        plain.finish()

    def _add_noise(self, batch) -> None:
        if self.noise_multiplier == 0:
            return
        # A Python float keeps the add to one fused kernel per block; .item() syncs once per step.
        std = float(self.noise_multiplier * self.max_grad_norm / batch)
        with torch.no_grad():
            grads = []
            for name, param in self._params:
                if param.grad is None:
                    param.grad = torch.zeros_like(param)
                grads.append((param.grad.to_local() if isinstance(param.grad, DTensor) else param.grad, param, name))
            add_gaussian_noise_many_(grads, self.seed, self.step, std)  # one launch for all of them where it can

    def _global_batch(self, losses: torch.Tensor, keep: torch.Tensor | None):
        if self.global_batch_size is not None:
            return float(self.global_batch_size)
        count = keep.sum() if keep is not None else torch.tensor(losses.shape[0], device=losses.device)
        # A 0-dim tensor: dividing by it needs no host sync.
        return dpdist.all_reduce_sum(count.to(torch.float32), self._groups)

    def _dp_size(self) -> int:
        size = 1
        for group in self._groups:
            size *= group.size()
        return size

    def buffer_tensors(self) -> list[torch.Tensor]:
        """The engine's own memory now.

        That is the norms being summed and, in book-keeping modes, every layer's kept output gradient and
        the per-sample pieces its rule kept for the gradient pass (a bias's per-sample sums). Layer inputs count
        only in a model with compiled parts (there they may be buffers of compiled code); otherwise they are the
        tensors autograd saves for backward (activations).
        """
        records = self._capture.records if self._capture else []
        kept = [r.grad for r in records if r.grad is not None] + [t for r in records for t in r.state.values()]
        if self._compiled:  # there the kept inputs may be buffers compiled code made, not tensors autograd saved
            kept += [r.x for r in records if r.x is not None]
        return kept + ([self._norm_sq] if self._norm_sq is not None else [])

    def state_dict(self) -> dict:
        """Step counter and seed: restoring them makes the noise of a resumed run exact."""
        return {"step": self.step, "seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        self.step, self.seed = int(state["step"]), int(state["seed"])

    def remove_hooks(self) -> None:
        """Detaches the engine from the model: every module gets its own class and forward back."""
        if self._capture is not None:
            self._capture.remove()
