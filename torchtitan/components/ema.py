"""Exponential moving average of the weights; samples and exports use it.

EMA tensors mirror the parameters (DTensor shards under FSDP), so the update needs no communication.
"""

import contextlib

import torch
from torch import nn
from torch.distributed.tensor import DTensor


def clean_fqn(name: str) -> str:
    return name.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", "")


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (its local tensor, which in-place updates write through), else the tensor."""
    return tensor._local_tensor if isinstance(tensor, DTensor) else tensor


class EMA:
    def __init__(self, model: nn.Module, decay: float, warmup: bool = False):
        self.decay = decay
        self.warmup = warmup
        self.num_updates = 0
        # Clean FQNs (no activation-checkpoint wrapper prefix) so exports load into a plain model.
        self.names = [clean_fqn(name) for name, p in model.named_parameters() if p.requires_grad]
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.shadow = [p.detach().clone().float() for p in self.params]

    def current_decay(self) -> float:
        if self.warmup:
            # Ramp used by many short-run trainers: early averages do not drag in the random init.
            return min(self.decay, (1 + self.num_updates) / (10 + self.num_updates))
        return self.decay

    @torch.no_grad()
    def update(self) -> None:
        decay = self.current_decay()
        # On the local shards under FSDP: DTensor's dispatch for each of a model's tensors cost 2.8 ms of host a step
        # against 0.35 (a DiT of 28 blocks over 2 ranks, CI's CPU).
        sources = [_local(p).detach().float() for p in self.params]  # .float() of a float32 tensor is the tensor
        torch._foreach_lerp_([_local(e) for e in self.shadow], sources, 1.0 - decay)
        self.num_updates += 1

    @torch.no_grad()
    def reset_to_model(self) -> None:
        """The average restarts at the model's weights (after they were loaded from elsewhere)."""
        for e, p in zip(self.shadow, self.params):
            e.copy_(p.detach())

    @contextlib.contextmanager
    def swapped_in(self):
        """Temporarily puts the EMA weights into the model (for sampling), then restores the live ones."""
        self._swap()
        try:
            yield
        finally:
            self._swap()

    @torch.no_grad()
    def _swap(self) -> None:
        for p, e in zip(self.params, self.shadow):
            live = p.detach().clone()
            p.copy_(e)
            e.copy_(live)

    def state_dict(self) -> dict:
        return {"num_updates": torch.tensor(self.num_updates), **dict(zip(self.names, self.shadow))}

    def load_state_dict(self, state: dict) -> None:
        self.num_updates = int(state["num_updates"])
        with torch.no_grad():
            for name, e in zip(self.names, self.shadow):
                e.copy_(state[name])
