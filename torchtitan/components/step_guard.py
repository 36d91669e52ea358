"""The non-finite step guard: a step whose loss or gradient norm is NaN or inf never changes the weights, and the run
stops naming it, without the host waiting for the GPU inside the step.

The decision is made on the device. A fused optimizer (AdamW or SGD on CUDA) takes it as `found_inf`, as under
torch.amp's GradScaler, and its kernel skips the update (Adam's step counts are restored). The host reads the flags
later: one step late (by then the GPU has finished that step while the CPU queued the next), and before anything reads
or writes the state (`check()`: logging, checkpoints, samples, validation, the export). The EMA still averages in the
unchanged weights of a skipped step: the run stops at most one step later, before any save. Optimizers without
`found_inf` (the foreach path: CPU runs, SGD on FSDP's DTensor shards) are checked on the host before their update,
which on CUDA costs one sync per step.
"""

import collections
import contextlib
from collections.abc import Callable

import torch


class NonFiniteStepError(RuntimeError):
    """A step's loss or gradient norm is NaN or inf; its update was not applied and the run stops."""


class NonFiniteGuard:
    """Skips a non-finite step's update on the device and raises NonFiniteStepError when the host reads its flag.

    Args:
        optimizer: the run's optimizer; fused param groups take the flag as `found_inf`.
        device: the training device (the flag stays there until read).
        describe: (step, loss_sum, grad_norm) -> the error message, read only for a non-finite step.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, device: torch.device,
                 describe: Callable[[int, torch.Tensor, torch.Tensor], str]):  # fmt: skip
        self.on_device = device.type == "cuda" and all(group.get("fused") for group in optimizer.param_groups)
        self.optimizer = optimizer
        self.describe = describe
        self.pending: collections.deque = collections.deque()  # (step, finite flag, loss_sum, grad_norm)

    @contextlib.contextmanager
    def update(self, step: int, loss_sum: torch.Tensor, grad_norm: torch.Tensor):
        """Around the optimizer's step of `step`: on the device, its kernels skip the update when the loss or the
        gradient norm is not finite; on the host path, raises NonFiniteStepError before the update.

        Raises:
            NonFiniteStepError: an earlier step's flag, or this one's on the host path, says non-finite.
        """
        finite = torch.isfinite(loss_sum) & torch.isfinite(grad_norm)  # (): every rank has the same global norm
        self.pending.append((step, finite, loss_sum, grad_norm))
        if not self.on_device:
            self.check()
            yield
            return
        self.optimizer.found_inf = torch.logical_not(finite).float()  # read by the fused kernels: 1 skips
        try:
            yield
        finally:
            del self.optimizer.found_inf

    def check(self, late: int = 0) -> None:
        """Reads the flags of all pending steps but the newest `late` (a sync with the device for those).

        Raises:
            NonFiniteStepError: the first non-finite step among them, named with its loss and gradient norm.
        """
        while len(self.pending) > late:
            step, finite, loss_sum, grad_norm = self.pending.popleft()
            if not bool(finite):
                self.pending.clear()
                raise NonFiniteStepError(self.describe(step, loss_sum, grad_norm))
