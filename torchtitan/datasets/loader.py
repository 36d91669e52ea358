"""Distributed, stateful, endless data loading: a resumed run continues with the very next batch."""

import torch
from torch.utils.data import Dataset, DistributedSampler
from torchdata.stateful_dataloader import StatefulDataLoader


class DiffusionDataLoader:
    """Endless iterator of (images, labels) batches for one data-parallel rank.

    `StatefulDataLoader` remembers the position inside an epoch but not the sampler's epoch
    (which seeds the shuffle), so the epoch is saved here beside the loader's own state.
    """

    def __init__(self, dataset: Dataset, batch_size: int, dp_rank: int, dp_world: int, seed: int, dataloader_config):
        if len(dataset) < batch_size * dp_world:
            raise ValueError(
                f"dataset has {len(dataset)} examples, fewer than one global micro-batch "
                f"(training.local_batch_size {batch_size} x {dp_world} ranks)"
            )
        self.dataset = dataset
        self.sampler = DistributedSampler(
            dataset, num_replicas=dp_world, rank=dp_rank, shuffle=True, seed=seed, drop_last=True
        )
        workers = dataloader_config.num_workers
        self.loader = StatefulDataLoader(
            dataset,
            batch_size=batch_size,
            sampler=self.sampler,
            drop_last=True,
            num_workers=workers,
            persistent_workers=dataloader_config.persistent_workers and workers > 0,
            pin_memory=dataloader_config.pin_memory and torch.cuda.is_available(),
            prefetch_factor=dataloader_config.prefetch_factor if workers > 0 else None,
        )
        self.epoch = 0
        self._iterator = None

    def __iter__(self):
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        while True:
            if self._iterator is None:
                self.sampler.set_epoch(self.epoch)
                self._iterator = iter(self.loader)
            try:
                return next(self._iterator)
            except StopIteration:
                self.epoch += 1
                self._iterator = None

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "loader": self.loader.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.epoch = state["epoch"]
        self.sampler.set_epoch(self.epoch)
        self.loader.load_state_dict(state["loader"])
        self._iterator = None
