"""Gaussian noise of DP-SGD: one draw per element of the global gradient, whatever the sharding.

The noise of a parameter is a fixed function of (seed, step, parameter name), drawn one of two ways:
- on CUDA (and in Triton's interpreter), counter-based: element e of the global tensor gets one of the four
  normals that Philox draws from the key hash(seed, step, crc32(name)) and the counter e // 4, in one Triton
  pass that adds it to the gradient in place (an FSDP shard is a range of global rows, so of counters);
- elsewhere, its rows are cut into blocks of about 2^20
  elements, and block k is drawn from a torch generator seeded with a hash of (seed, step,
  crc32(name), k); a rank draws only the blocks that overlap its shard and slices them.
Either way
- every element of the global gradient gets exactly one draw (shards partition the elements,
  and replicas of a shard draw the same values);
- the values do not depend on the layout: a single process, DDP, FSDP and HSDP runs of the same
  step add the same noise (given the same device type, which picks the way);
- a resumed run that restores the step counter draws what the uninterrupted run would have.
"""

import math
import zlib

import torch
from torch.distributed.tensor import DTensor, Shard

from torchtitan.kernels.triton_support import jit as _jit
from torchtitan.kernels.triton_support import tl, triton, triton_interpreting

_BLOCK_NUMEL = 1 << 20
_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    # SplitMix64's finalizer: neighbouring inputs give unrelated seeds.
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def block_seed(seed: int, step: int, name: str, block: int) -> int:
    """Generator seed of one noise block of one parameter at one step."""
    h = 0
    for value in (seed, step, zlib.crc32(name.encode()), block):
        h = _splitmix64(h ^ (value & _MASK64))
    return h >> 1  # a non-negative int64


def local_region(param: torch.Tensor) -> tuple[slice, ...]:
    """The slice of the global tensor that this rank holds (everything for a plain tensor).

    Follows DTensor's Shard semantics (torch.chunk along the dim, mesh dims applied in order).
    """
    region = [slice(0, n) for n in param.shape]
    if not isinstance(param, DTensor):
        return tuple(region)
    mesh = param.device_mesh
    coordinate = mesh.get_coordinate()
    for mesh_dim, placement in enumerate(param.placements):
        if placement.is_replicate():
            continue
        if type(placement) is not Shard:
            raise NotImplementedError(f"DP noise supports Shard and Replicate placements, got {placement}")
        dim = placement.dim % param.dim()
        start, stop = region[dim].start, region[dim].stop
        chunk = math.ceil((stop - start) / mesh.size(mesh_dim))
        lo = min(start + coordinate[mesh_dim] * chunk, stop)
        region[dim] = slice(lo, min(lo + chunk, stop))
    return tuple(region)


def gaussian_noise(param: torch.Tensor, name: str, seed: int, step: int, std: float) -> torch.Tensor:
    """N(0, std^2) noise for this rank's part of `param`, in the local tensor's shape and dtype: what
    `add_gaussian_noise_` adds to that part of the gradient.

    Args:
        param: a parameter, plain or a DTensor (its global shape defines the noise).
        name: the parameter's fully qualified name; with seed and step it fixes the values.
        seed: the run's noise seed.
        step: the optimizer step.
        std: the standard deviation.
    """
    local = param.to_local() if isinstance(param, DTensor) else param
    noise = torch.zeros(local.shape, device=local.device, dtype=torch.float32)
    add_gaussian_noise_(noise, param, name, seed, step, std)
    return noise.to(local.dtype)


def add_gaussian_noise_(grad: torch.Tensor, param: torch.Tensor, name: str, seed: int, step: int, std: float) -> None:
    """grad += N(0, std^2) noise, for grad the local tensor of param's gradient (this rank's region of it)."""
    add_gaussian_noise_many_([(grad, param, name)], seed, step, std)


def add_gaussian_noise_many_(grads: list[tuple[torch.Tensor, torch.Tensor, str]], seed: int, step: int,
                             std: float) -> None:  # fmt: skip
    """`add_gaussian_noise_` for each (grad, param, name), with one kernel launch per dtype where the kernel runs.

    A gradient whose local part is a contiguous range of the global rows (a whole tensor, or an FSDP shard) gets the
    noise in place, in the shared launch: a step's noise is then one kernel, not one per parameter. Any other region
    draws its rows into a buffer and adds its columns; without the kernel, the torch generator blocks.
    """
    batched: dict[tuple, list[tuple[torch.Tensor, int, int]]] = {}
    for grad, param, name in grads:
        region = local_region(param) or (slice(0, 1),)
        global_shape = tuple(param.shape) or (1,)  # a 0-dim parameter is one row of one element
        local_view = grad.view([s.stop - s.start for s in region])  # a 0-dim gradient as one row
        if triton is None or not (grad.is_cuda or triton_interpreting()):
            for rows, values in _noise_blocks(global_shape, region, name, seed, step, grad.device):
                local_view[rows].add_(values, alpha=std)
            continue
        key, first = block_seed(seed, step, name, 0), region[0].start * math.prod(global_shape[1:])
        if all(s == slice(0, n) for s, n in zip(region[1:], global_shape[1:])) and grad.is_contiguous():
            batched.setdefault((grad.dtype, grad.device), []).append((grad, first, key))  # a range of rows: in place
            continue
        rows = torch.zeros((region[0].stop - region[0].start, *global_shape[1:]), device=grad.device)
        _launch_noise_kernel([(rows, first, key)], std)  # the region's rows, then its columns
        local_view.add_(rows[(slice(None), *region[1:])])
    for group in batched.values():
        _launch_noise_kernel(group, std)


def _launch_noise_kernel(group: list[tuple[torch.Tensor, int, int]], std: float) -> None:
    """out += std * the global noise from element index `first` on, for each (out (contiguous), first, key) of one
    dtype and device, in one launch."""
    group = [item for item in group if item[0].numel()]
    if not group:
        return
    # Programs cover aligned blocks of global indices (each Philox call yields four normals for four neighbours), so
    # a tensor's first block may start before its first element: those lanes are masked.
    programs = [0]
    for out, first, _ in group:
        programs.append(programs[-1] + triton.cdiv(first % _NOISE_BLOCK + out.numel(), _NOISE_BLOCK))
    n = len(group)
    meta = [t.data_ptr() for t, _, _ in group] + [t.numel() for t, _, _ in group] + [f for _, f, _ in group]
    meta += [k for _, _, k in group] + programs
    device = group[0][0].device
    table = torch.tensor(meta, dtype=torch.int64)
    if device.type == "cuda":  # pinned: the copy does not wait for the GPU's queue
        table = table.pin_memory().to(device, non_blocking=True)
    # Every tensor must outlive the launch's use of its address: they are the live gradients, held by the caller.
    dtype = _TL_DTYPES[group[0][0].dtype]
    _add_noise_kernel[(programs[-1],)](table, n, float(std), n.bit_length(), _NOISE_BLOCK, dtype)


_NOISE_BLOCK = 4096


@_jit
def _add_noise_kernel(table, n, std, STEPS: tl.constexpr, BLOCK: tl.constexpr, DTYPE: tl.constexpr):
    # grad[i] += std * z[first + i] for each of n tensors, z[e] the normal that Philox draws from (key, counter e // 4)
    # in lane [0, 2, 1, 3][e % 4]: a function of the element's index in the global tensor alone. One pass over each
    # gradient, no noise tensor in memory. table holds n pointers, numels, firsts, keys, then n + 1 program offsets
    # (tensor t owns programs offsets[t] ... offsets[t + 1] - 1); each program finds its tensor by bisection.
    pid = tl.program_id(0).to(tl.int64)
    offsets = table + 4 * n
    lo = pid * 0
    hi = lo + n
    for _ in range(STEPS):  # bisection: the last t with offsets[t] <= pid
        mid = (lo + hi) // 2
        go_right = tl.load(offsets + mid) <= pid
        lo = tl.where(go_right, mid, lo)
        hi = tl.where(go_right, hi, mid)
    grad_ptr = tl.load(table + lo).to(tl.pointer_type(DTYPE))
    numel = tl.load(table + n + lo)
    first = tl.load(table + 2 * n + lo)
    key = tl.load(table + 3 * n + lo)
    start = (first // BLOCK + pid - tl.load(offsets + lo)) * BLOCK  # global index of this block's first element
    counters = start // 4 + tl.arange(0, BLOCK // 4)
    z0, z1, z2, z3 = tl.randn4x(key, counters)
    z = tl.reshape(tl.join(tl.join(z0, z1), tl.join(z2, z3)), (BLOCK,))  # element 4 j + 2 a + b: z_(2 b + a)[j]
    local = start + tl.arange(0, BLOCK) - first
    mask = (local >= 0) & (local < numel)
    g = tl.load(grad_ptr + local, mask=mask)
    tl.store(grad_ptr + local, (g.to(tl.float32) + std * z).to(g.dtype), mask=mask)


_TL_DTYPES = (
    {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float64: tl.float64}
    if triton
    else {}
)


def _noise_blocks(global_shape, region, name, seed, step, device):
    """Yields (rows of the region, their values) for each noise block overlapping the region (torch generators)."""
    global_shape = global_shape or (1,)  # a 0-dim parameter is one row of one element
    if any(s.stop <= s.start for s in region):
        return
    rows_per_block = max(1, _BLOCK_NUMEL // math.prod(global_shape[1:]))
    start, stop = region[0].start, region[0].stop
    generator = torch.Generator(device=device)
    for block in range(start // rows_per_block, (stop - 1) // rows_per_block + 1):
        first = block * rows_per_block
        generator.manual_seed(block_seed(seed, step, name, block))
        rows = min(rows_per_block, global_shape[0] - first)
        values = torch.randn((rows, *global_shape[1:]), generator=generator, device=device)
        lo, hi = max(start, first), min(stop, first + rows)
        yield slice(lo - start, hi - start), values[(slice(lo - first, hi - first), *region[1:])]
