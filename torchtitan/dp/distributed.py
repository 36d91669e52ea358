"""How gradients are summed over data-parallel ranks for each way a model can be wrapped.

- FSDP2 / HSDP (parameters are DTensors): a normal backward reduce-scatters and divides by
  FSDP's gradient divide factor; gradients the engine builds itself (book-keeping) go through
  `ShardedGradReducer`: layers are packed into buckets of a bounded size, each bucket is one
  reduce-scatter (plus an all-reduce over the replicate dim of HSDP), as FSDP packs a block's
  gradients, and a bucket's collective runs while the next bucket's gradients are computed.
- DDP (composable `replicate` or the DistributedDataParallel class): a normal backward
  all-reduces and divides by the group size; gradients the engine builds go through
  `ReplicatedGradReducer`: packed into buckets, each all-reduced while the next is computed, the
  gradients left as views of their bucket (as DDP's `gradient_as_bucket_view`).
- A plain model on several ranks: the engine all-reduces every gradient itself, the same way.
"""

import itertools
import math

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp._fully_shard._fsdp_common import _from_local_no_grad
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard


def dp_groups(dp_mesh) -> list:
    """The process groups whose product is the data-parallel world (empty: one process)."""
    if dp_mesh is not None:
        return [dp_mesh.get_group(i) for i in range(dp_mesh.ndim)]
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return [dist.group.WORLD]
    return []


def all_reduce_sum(tensor: torch.Tensor, groups: list) -> torch.Tensor:
    """In-place sum over every group (their product is the data-parallel world)."""
    for group in groups:
        dist.all_reduce(tensor, group=group)
    return tensor


def is_ddp(model: nn.Module) -> bool:
    """True for a DistributedDataParallel module or one under composable `replicate`."""
    if isinstance(model, nn.parallel.DistributedDataParallel):
        return True
    from torch.distributed._composable.contract import _get_registry

    registry = _get_registry(model)
    return registry is not None and "replicate" in registry


def fsdp_divide_factor(model: nn.Module) -> float | None:
    """What FSDP2 divides reduced gradients by (None: no FSDP module with parameters).

    FSDP2 averages over the data-parallel mesh unless `set_gradient_divide_factor` (called
    `set_reduce_scatter_divide_factor` before torch 2.8) set a factor, stored on each parameter
    group as `gradient_divide_factor` on torch 2.8 through 2.14.
    """
    from torch.distributed.fsdp import FSDPModule

    factors = set()
    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        state = module._get_fsdp_state()
        groups = getattr(state, "_fsdp_param_groups", None)  # torch >= 2.12: several groups per module
        if groups is None:
            groups = [state._fsdp_param_group] if state._fsdp_param_group is not None else []
        for group in groups:
            factor = getattr(group, "gradient_divide_factor", None)
            factors.add(float(factor) if factor is not None else float(group.mesh_info.mesh.size()))
    if len(factors) > 1:
        raise NotImplementedError(f"DP-SGD needs one FSDP gradient divide factor for the model, got {factors}")
    return factors.pop() if factors else None


def reduce_to_param(grad: torch.Tensor, param: DTensor) -> DTensor:
    """Sums a full-shape local gradient over the param's mesh into the param's placements."""
    mesh = param.device_mesh
    partial = DTensor.from_local(grad, mesh, [Partial()] * mesh.ndim, run_check=False)
    return partial.redistribute(mesh, param.placements)


# Full-shape float32 gradients per reduce-scatter of book-keeping (FSDP2 packs about a block's worth).
BUCKET_BYTES = 256 << 20


def accumulate_grad(param: torch.Tensor, grad: torch.Tensor) -> None:
    """param.grad = grad, or += when a previous micro-batch left one."""
    if param.grad is None:
        param.grad = grad
    else:
        param.grad += grad


class _BucketedReducer:
    """Gradients queued into buckets of about `bucket_bytes`, each bucket's collective sent when it fills (or when
    the next gradient needs another kind of bucket) and completed before the one after is sent. Subclasses send
    (`_send`, from `self._pending`) and complete (`_complete`) a bucket."""

    def __init__(self, bucket_bytes: int | None = None):
        self.bucket_bytes = BUCKET_BYTES if bucket_bytes is None else bucket_bytes
        self._pending: list[tuple[torch.Tensor, torch.Tensor | None]] = []
        self._pending_bytes = 0
        self._key = None  # what the pending bucket's gradients share
        self._in_flight = None  # the bucket being reduced

    def _queue(self, param: torch.Tensor, grad: torch.Tensor | None, key, nbytes: int) -> None:
        if self._pending and key != self._key:
            self._send()
        self._key = key
        self._pending.append((param, grad))
        self._pending_bytes += nbytes
        if self._pending_bytes >= self.bucket_bytes:
            self._send()

    def _take(self) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """The pending bucket's (param, grad) pairs, the queue emptied."""
        pending, self._pending, self._pending_bytes = self._pending, [], 0
        return pending

    def finish(self) -> None:
        """Sends what is pending and writes every reduced gradient into its parameter's grad."""
        if self._pending:
            self._send()
        self._complete()


class ReplicatedGradReducer(_BucketedReducer):
    """Sums the gradients of replicated (plain) parameters over the data-parallel ranks into their .grad, in buckets.

    The gradients a bucket holds are copied into one flat buffer of the parameters' dtype; once it passes
    `bucket_bytes` its all-reduce is sent asynchronously and runs while the caller computes the next bucket's
    gradients (it is waited on before the one after is sent: at most two buckets exist beyond the gradients). Each
    parameter's .grad is then a view of its reduced bucket, or has it added when an earlier micro-batch left one.
    With no group (one process) the gradients are taken as they are. Every rank must add the same parameters in the
    same order (the collectives must match).
    """

    def __init__(self, groups: list, bucket_bytes: int | None = None):
        super().__init__(bucket_bytes)
        self.groups = groups

    def add(self, param: torch.Tensor, grad: torch.Tensor | None) -> None:
        """Queues sum-over-ranks of `grad` (param's shape, any float dtype; None: zeros) into param.grad."""
        if not self.groups:
            accumulate_grad(param, torch.zeros_like(param) if grad is None else grad.to(param.dtype))
            return
        self._queue(param, grad, (param.dtype, param.device), param.numel() * param.element_size())

    def _send(self) -> None:
        pending = self._take()
        params = [p for p, _ in pending]
        buffer = torch.empty(sum(p.numel() for p in params), dtype=params[0].dtype, device=params[0].device)
        for (param, grad), part in zip(pending, _parts(buffer, params)):
            if grad is None:
                part.zero_()
            else:
                part.view_as(param).copy_(grad)  # casts to the parameter's dtype
        self._complete()  # at most one bucket in flight
        work = None
        if len(self.groups) == 1:
            work = dist.all_reduce(buffer, group=self.groups[0], async_op=True)
        else:  # collectives over several groups go one after the other
            all_reduce_sum(buffer, self.groups)
        self._in_flight = (work, buffer, params)

    def _complete(self) -> None:
        if self._in_flight is None:
            return
        work, buffer, params = self._in_flight
        self._in_flight = None
        if work is not None:
            work.wait()
        for param, part in zip(params, _parts(buffer, params)):
            accumulate_grad(param, part.view_as(param))


def _parts(buffer: torch.Tensor, params: list[torch.Tensor]) -> list[torch.Tensor]:
    """Consecutive slices of a flat buffer, one per parameter. Each is a view of its own (not `split`'s outputs,
    which autograd refuses to let a later accumulation or noise add modify in place)."""
    offsets = itertools.accumulate((p.numel() for p in params), initial=0)
    return [buffer.narrow(0, start, p.numel()) for start, p in zip(offsets, params)]


def _dim0_sharded(param: DTensor) -> int | None:
    """The mesh dim that shards dim 0, if the placements are FSDP2's (Shard(0) once, Replicate elsewhere)."""
    placements = param.placements
    shards = [i for i, p in enumerate(placements) if type(p) is Shard and p.dim == 0]
    if len(shards) != 1 or not all(type(p) is Replicate for i, p in enumerate(placements) if i != shards[0]):
        return None
    return shards[0]


class ShardedGradReducer(_BucketedReducer):
    """Sums full-shape local gradients over ranks into the grads of FSDP2/HSDP parameters, in buckets.

    Each parameter's gradient is padded along dim 0 to a multiple of the shard count and cut into one
    chunk per rank (FSDP2's own dim-0 layout), the chunks of a bucket's parameters are packed rank by
    rank into one float32 buffer, and one reduce-scatter leaves each rank its shards (HSDP then sums
    them over the replicate dim). A bucket is sent when it passes `bucket_bytes`; its collective runs
    asynchronously while the caller builds the next bucket, and is waited on before the one after is
    sent, so at most two buckets of full-shape gradients exist at a time. Placements other than
    FSDP2's fall back to a Partial DTensor redistributed one parameter at a time.

    Every rank must add the same parameters in the same order (the collectives must match).
    """

    def add(self, param: DTensor, grad: torch.Tensor | None) -> None:
        """Queues sum-over-ranks of `grad` (param's full shape, any float dtype; None: zeros) into param.grad."""
        shard_dim = _dim0_sharded(param)
        if shard_dim is None:
            full = grad if grad is not None else torch.zeros(param.shape, device=param.to_local().device)
            accumulate_grad(param, reduce_to_param(full.to(param.dtype), param))
            return
        nbytes = _padded_numel(param, shard_dim) * param.element_size()
        self._queue(param, grad, (param.device_mesh, param.placements), nbytes)

    def _send(self) -> None:
        mesh, placements = self._key
        pending = self._take()
        params = [p for p, _ in pending]
        shard_dim = _dim0_sharded(params[0])
        ranks, dtype = mesh.size(shard_dim), params[0].dtype
        widths = [_padded_numel(p, shard_dim) // ranks for p in params]
        buffer = torch.empty(ranks, sum(widths), dtype=dtype, device=params[0].to_local().device)
        offset = 0
        for (param, grad), width in zip(pending, widths):
            _pack_chunks(buffer[:, offset : offset + width], grad, param.shape[0])
            offset += width
        self._complete()  # at most one bucket in flight: its buffers are freed before the next is sent
        reduced = buffer.new_empty(buffer.shape[1])
        work = dist.reduce_scatter_tensor(reduced, buffer.view(-1), group=mesh.get_group(shard_dim), async_op=True)
        self._in_flight = (work, reduced, params, widths, buffer)

    def _complete(self) -> None:
        if self._in_flight is None:
            return
        work, reduced, params, widths, _ = self._in_flight
        self._in_flight = None
        work.wait()
        mesh, placements = params[0].device_mesh, params[0].placements
        for dim, placement in enumerate(placements):
            if type(placement) is Replicate:  # HSDP: the replicas hold the same shards of other samples
                dist.all_reduce(reduced, group=mesh.get_group(dim))
        for param, chunk in zip(params, reduced.split(widths)):
            shard = chunk.view(-1, *param.shape[1:])[: param._local_tensor.shape[0]]  # FSDP2 pads the last shards
            if param.grad is None:
                param.grad = _grad_of(param, shard)
            else:
                param.grad._local_tensor.add_(shard)


def _grad_of(param: DTensor, shard: torch.Tensor) -> DTensor:
    """A gradient of `param` made of this rank's `shard`, with the param's own spec, as FSDP2 makes the gradients it
    reduces: `DTensor.from_local` costs ten times the host time (46 against 4.4 us on CI's CPU), for each parameter
    of the model at every step."""
    return _from_local_no_grad(shard, param._spec)


def _padded_numel(param: DTensor, shard_dim: int) -> int:
    """Elements of param's gradient padded along dim 0 to a multiple of the shard count."""
    ranks = param.device_mesh.size(shard_dim)
    rows = math.ceil(param.shape[0] / ranks) * ranks
    return rows * math.prod(param.shape[1:])


def _pack_chunks(dst: torch.Tensor, grad: torch.Tensor | None, rows: int) -> None:
    """Writes grad's rows into dst (ranks, chunk * rest) as FSDP2 splits dim 0 (torch.chunk), zero-padded."""
    ranks = dst.shape[0]
    chunk = math.ceil(rows / ranks)
    if chunk == 0:  # a parameter with no rows: nothing to send
        return
    dst = dst.view(ranks, chunk, -1)  # (ranks, rows per rank, elements per row)
    if grad is None:
        dst.zero_()
        return
    full, rest = divmod(rows, chunk)
    if full == ranks:  # the rows split evenly (most parameters): one copy, no padding to zero
        dst.copy_(grad.reshape(dst.shape))
        return
    grad = grad.reshape(rows, -1)
    dst[:full].copy_(grad[: full * chunk].view(full, chunk, -1))
    if rest:
        dst[full, :rest].copy_(grad[full * chunk :])
        dst[full, rest:].zero_()
    dst[full + (1 if rest else 0) :].zero_()
