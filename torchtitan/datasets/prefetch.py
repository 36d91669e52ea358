"""Batches on the device one step ahead: the host loads and copies batch N+1 while the GPU runs step N.

Pixels travel as uint8 (a quarter of float32's bytes through the loader's workers, pinned memory and PCIe) and
become [-1, 1] floats on the device; everything else travels as the dataset gives it. A batch is a tuple of tensors
or of tensor tuples (`LatentsAndImages`: latents with the clean images an alignment encoder sees;
`LatentsAndFeatures`: latents with that encoder's stored features).
"""

import copy
from typing import NamedTuple

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten


class LatentsAndImages(NamedTuple):
    """A latent dataset's input with the image it encodes (uint8 (3, H, W), [-1, 1] on the device): what
    representation alignment's encoder sees on a latent run. Collates, travels and pins field by field."""

    latents: torch.Tensor
    images: torch.Tensor


class LatentsAndFeatures(NamedTuple):
    """A latent dataset's input with the alignment encoder's features of the image it encodes (T, D), stored by
    prepare.py --store-features: what representation alignment compares with in place of running the encoder. The
    features travel in their stored dtype (half float32's bytes); the alignment loss computes in float32."""

    latents: torch.Tensor
    features: torch.Tensor


def images_to_float(x: torch.Tensor) -> torch.Tensor:
    """uint8 images in [0, 255] -> float32 in [-1, 1] (ADM's and DiT's `x / 127.5 - 1`, to the bit wherever it
    runs); any other tensor as it is."""
    return x.float().div_(127.5).sub_(1.0) if x.dtype == torch.uint8 else x


def batch_to_device(batch: tuple, device: torch.device, non_blocking: bool = False) -> tuple:
    """The batch's tensors on `device`, uint8 images as float32 in [-1, 1] (`images_to_float`)."""
    leaves, spec = tree_flatten(batch)
    return tree_unflatten([images_to_float(t.to(device, non_blocking=non_blocking)) for t in leaves], spec)


class DevicePrefetcher:
    """This rank's batches on the device, the next one fetched while the current step runs.

    Wraps a host loader (an endless iterator of tensor tuples with `dataset`, `state_dict()`,
    `load_state_dict(state, same_layout)` and `close()`). `prefetch()`, called once a step's work is queued, takes
    the next batch from the host loader and starts its copy; on CUDA the copy runs on a side stream from pinned
    memory, so it neither waits for the GPU's queue nor holds the host, and the step that takes the batch waits for
    the copy alone. Without a prefetched batch `next()` fetches one.

    The state is the host loader's from before the batch that was fetched ahead: a checkpoint saved between a
    prefetch and the step that uses it resumes with that batch, as an unprefetched run would.
    """

    def __init__(self, host, device: torch.device):
        self.host = host
        self.dataset = host.dataset
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        place_on = getattr(host, "place_on", None)
        if place_on is not None:  # a loader that can make batches on the device itself (the dummy data's)
            place_on(device)
        self._ahead = None  # (batch on the device, copy-done event or None, host state before the batch)

    def __iter__(self):
        return self

    def prefetch(self) -> None:
        """Fetches the next batch and starts its copy, unless one is already ahead; the end of the host loader
        (StopIteration) is left for `next()` to raise."""
        if self._ahead is not None:
            return
        state = copy.deepcopy(self.host.state_dict())
        try:
            batch = next(self.host)
        except StopIteration:
            return
        leaves, spec = tree_flatten(batch)
        made_here = [t.device.type != "cpu" for t in leaves]  # made on the device by the loader (the dummy data's)
        if self.stream is None or all(made_here):
            self._ahead = (batch_to_device(batch, self.device), None, state)
            return
        # Pageable memory would make the copy synchronous with the host; a pinned source lets it run on its own.
        # What the loader made on the device was made on this stream, so it is converted here, not on the side one.
        leaves = [t if here or t.is_pinned() else t.pin_memory() for t, here in zip(leaves, made_here)]
        with torch.cuda.stream(self.stream):
            moved = [None if here else batch_to_device((t,), self.device, non_blocking=True)[0]
                     for t, here in zip(leaves, made_here)]  # fmt: skip
            ready = torch.cuda.Event()
            ready.record(self.stream)
        moved = [images_to_float(t) if here else m for t, m, here in zip(leaves, moved, made_here)]
        self._ahead = (tree_unflatten(moved, spec), ready, state)

    def __next__(self) -> tuple:
        self.prefetch()
        if self._ahead is None:
            raise StopIteration
        batch, ready, _ = self._ahead
        self._ahead = None
        if ready is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(ready)
            for tensor in tree_flatten(batch)[0]:  # made on the side stream, used on this one: not reused before then
                tensor.record_stream(current)
        return batch

    def close(self) -> None:
        """Drops the batch fetched ahead and stops the host loader's worker processes (the end of training)."""
        self._ahead = None
        self.host.close()

    def state_dict(self) -> dict:
        return self._ahead[2] if self._ahead is not None else self.host.state_dict()

    def load_state_dict(self, state: dict, same_layout: bool = True) -> None:
        """Drops the batch fetched ahead (it belongs to the old position) and moves the host loader."""
        self._ahead = None
        self.host.load_state_dict(state, same_layout=same_layout)
