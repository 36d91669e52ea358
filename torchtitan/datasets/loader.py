"""Distributed, stateful, endless data loading: a resumed run continues with the very next batch."""

import torch
from torch.utils.data import Dataset, DistributedSampler, default_collate
from torchdata.stateful_dataloader import StatefulDataLoader

from torchtitan.tools.logging import logger


def gathers(dataset: Dataset) -> bool:
    """Whether `dataset` builds a whole batch in one call, `gather(indices)` (the dummy data's pool), rather than
    item by item."""
    return callable(getattr(dataset, "gather", None))


class _Positions(Dataset):
    """Item i is i: a loader over it hands out the sampler's index batches, for a dataset that gathers them."""

    def __init__(self, length: int):
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> int:
        return index


def stop_workers(loader, iterator) -> None:
    """Stops a loader's worker processes now, persistent ones included, rather than whenever the iterators holding
    them are collected (a process that builds several trainers, or goes on after one, would keep them)."""
    for held in (iterator, getattr(loader, "_iterator", None)):
        shutdown = getattr(held, "_shutdown_workers", None)
        if shutdown is not None:
            shutdown()
    if getattr(loader, "_iterator", None) is not None:
        loader._iterator = None


class DiffusionDataLoader:
    """Endless iterator of (images, labels) batches for one data-parallel rank.

    `StatefulDataLoader` remembers the position inside an epoch but not the sampler's epoch
    (which seeds the shuffle), so the epoch is saved here beside the loader's own state.

    A dataset that gathers whole batches (`gathers`) is read in this process, whatever `num_workers` says: the
    loader hands out the sampler's index batches and the dataset gathers each one where its pool lives
    (`place_on`), the same samples in the same order as item by item.
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
        self.gathers = gathers(dataset)
        workers = 0 if self.gathers else dataloader_config.num_workers
        self.loader = StatefulDataLoader(
            _Positions(len(dataset)) if self.gathers else dataset,
            batch_size=batch_size,
            sampler=self.sampler,
            drop_last=True,
            num_workers=workers,
            persistent_workers=dataloader_config.persistent_workers and workers > 0,
            pin_memory=dataloader_config.pin_memory and torch.cuda.is_available() and not self.gathers,
            prefetch_factor=dataloader_config.prefetch_factor if workers > 0 else None,
        )
        self.epoch = 0
        self._iterator = None
        self._start = self.loader.state_dict()  # the position at the start of an epoch

    def __iter__(self):
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        while True:
            if self._iterator is None:
                self.sampler.set_epoch(self.epoch)
                self._iterator = iter(self.loader)
            try:
                batch = next(self._iterator)
            except StopIteration:
                self.epoch += 1
                self._iterator = None
                continue
            return self.dataset.gather(batch) if self.gathers else batch

    def place_on(self, device: torch.device) -> None:
        """Batches are made on `device` from here on where the dataset gathers them (its pool moves there)."""
        if self.gathers:
            self.dataset.move_pool(device)

    def close(self) -> None:
        """Stops the worker processes, at the end of training (the loader is not used after)."""
        stop_workers(self.loader, self._iterator)
        self._iterator = None

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "loader": self.loader.state_dict()}

    def load_state_dict(self, state: dict, same_layout: bool = True) -> None:
        """Resumes at the saved position; `same_layout` False (saved by another number of ranks, or from other data,
        where a position inside an epoch means other samples) resumes at the start of the saved epoch, as does a
        saved position past the end of this epoch (a smaller dataset), with a warning."""
        self.epoch = state["epoch"]
        self.sampler.set_epoch(self.epoch)
        self._iterator = None
        if not same_layout:
            return
        self.loader.load_state_dict(state["loader"])
        try:
            self._iterator = iter(self.loader)  # replays the saved position now, where running out can be named
        except StopIteration:  # the sampler ran out while skipping the batches already seen
            logger.warning(f"the saved data position lies past the end of epoch {self.epoch} of this dataset "
                           f"({len(self.dataset):,} samples, {len(self.loader):,} batches per rank): the dataset is "
                           "smaller than the one that saved it; the epoch restarts from its start")  # fmt: skip
            self.loader.load_state_dict(self._start)


def held_out_positions(num_items: int, batch_size: int, dp_rank: int, dp_world: int, max_batches: int):
    """This rank's batches of positions 0..num_items-1 of a held-out split's fixed order, each position at most once
    over all ranks: dealt to the ranks in turn, so the same positions are read whatever the number of ranks. Every
    rank gets as many batches (a collective model under FSDP needs every rank's forward), at most `max_batches`,
    and the split ends the pass rather than wrap around; rows past its end repeat position 0 with weight 0, so
    shapes stay static.

    Yields:
        (positions, weight): `batch_size` positions and a float32 (batch_size,) weight, 1 for a position of the
        split and 0 for padding.
    """
    mine = list(range(dp_rank, num_items, dp_world))
    per_rank = -(-num_items // dp_world)  # the largest share: ranks differ by at most one item
    for start in range(0, min(max_batches * batch_size, per_rank), batch_size):
        positions = mine[start : start + batch_size]
        weight = torch.zeros(batch_size)
        weight[: len(positions)] = 1.0
        yield positions + [0] * (batch_size - len(positions)), weight


def validation_batches(dataset: Dataset, batch_size: int, dp_rank: int, dp_world: int, seed: int,
                       max_batches: int):  # fmt: skip
    """This rank's batches of a held-out split, each item of the split at most once over all ranks.

    The items are taken in one fixed shuffled order (seeded by `seed`, so a capped pass is a random subset, the
    same at every validation) and dealt as `held_out_positions` deals them.

    Yields:
        (inputs, labels, weight): a collated batch of `batch_size` rows and a float32 (batch_size,) weight,
        1 for an item of the split and 0 for padding.
    """
    order = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(seed))
    for positions, weight in held_out_positions(len(dataset), batch_size, dp_rank, dp_world, max_batches):
        inputs, labels = default_collate([dataset[order[p].item()] for p in positions])
        yield inputs, labels, weight


class PoissonDataLoader:
    """This rank's share of each step's Poisson-sampled batch (DP-SGD's sampling), padded to a fixed size.

    Yields (images, labels, mask): padding rows repeat an example and have mask False, so they add
    nothing to the private gradient while shapes stay static. The padded size leaves 6 standard
    deviations of headroom over the expected share; a larger draw raises rather than being truncated.

    Each step's batch is a pure function of (seed, step), so `num_workers` worker processes build whole
    batches ahead of the step that needs them (one map-style item per step). The checkpointed position
    is the step handed out next, not how far the workers have read ahead. Past the sampler's `num_steps`
    the draws go on (steps past the run's end: measurements drive more steps than a config trains).

    Args:
        dataset: (input, label) pairs; inputs are stacked as the dataset gives them (no dtype change).
        batch_sampler: a PoissonBatchSampler; its `step` is the next step handed out.
        expected_local_batch: this rank's expected share of a step's batch.
        dataloader_config: the `[training.dataloader]` section (num_workers, pin_memory, persistent_workers,
            prefetch_factor); None loads in this process, unpinned.
    """

    class _StepBatches(Dataset):
        """Item s: step s's padded batch (inputs, long labels, mask), built where it is read (a worker or here)."""

        def __init__(self, dataset: Dataset, batch_sampler, padded_size: int):
            self.dataset, self.batch_sampler, self.padded_size = dataset, batch_sampler, padded_size

        def __getitem__(self, step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            from torchtitan.dp.noise import block_seed
            from torchtitan.dp.sampling import pad_batch

            if torch.utils.data.get_worker_info() is not None:
                # A worker's random augmentations (flips) as a function of the step, as the batch is, so a
                # resumed run reads the same batches whichever worker builds each; in this process they draw
                # from the global generator, which the checkpoint restores.
                sampler = self.batch_sampler
                torch.manual_seed(block_seed(sampler.seed, step, "poisson_loader", sampler.rank))
            indices, mask = pad_batch(self.batch_sampler.batch(step), self.padded_size)
            if gathers(self.dataset):  # one gather, where the pool lives (`place_on`)
                inputs, labels = self.dataset.gather(torch.tensor(indices))
                return inputs, labels, mask
            items = [self.dataset[i] for i in indices]
            inputs = default_collate([x for x, _ in items])  # images, token windows, or LatentsAndImages
            labels = torch.stack([torch.as_tensor(label, dtype=torch.long) for _, label in items])  # (B,) or (B, T)
            return inputs, labels, mask

    class _StepsFrom:
        """The steps from the sampler's `step` on, endless; read when an iteration (re)starts."""

        def __init__(self, batch_sampler):
            self.batch_sampler = batch_sampler

        def __iter__(self):
            step = self.batch_sampler.step
            while True:
                yield step
                step += 1

    def __init__(self, dataset: Dataset, batch_sampler, expected_local_batch: int, dataloader_config=None):
        self.dataset = dataset
        self.batch_sampler = batch_sampler  # PoissonBatchSampler: batch(step), step, state_dict()
        self.padded_size = int(expected_local_batch + 6 * expected_local_batch**0.5 + 8)
        workers = dataloader_config.num_workers if dataloader_config is not None else 0
        self.loader = torch.utils.data.DataLoader(
            self._StepBatches(dataset, batch_sampler, self.padded_size),
            batch_size=None,  # an item is already a whole batch
            sampler=self._StepsFrom(batch_sampler),
            num_workers=workers,
            persistent_workers=workers > 0 and dataloader_config.persistent_workers,
            pin_memory=dataloader_config is not None and dataloader_config.pin_memory and torch.cuda.is_available(),
            prefetch_factor=dataloader_config.prefetch_factor if workers > 0 else None,
            # Workers' base seeds from a generator of our own: each new iteration (a resume) would otherwise draw
            # from the global generator and shift the training's noise and timesteps.
            generator=torch.Generator().manual_seed(batch_sampler.seed),
        )
        self._iterator = None  # started at the first batch, so a resume's load_state_dict starts no workers
        self.workers = workers

    def place_on(self, device: torch.device) -> None:
        """Batches are made on `device` from here on where the dataset gathers them and no worker process reads it
        (a forked worker cannot touch CUDA memory; workers gather on the host, off the step's path)."""
        if gathers(self.dataset) and self.workers == 0:
            self.dataset.move_pool(device)

    def __iter__(self):
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if self._iterator is None:
            self._iterator = iter(self.loader)  # from batch_sampler.step on
        inputs, labels, mask = next(self._iterator)  # in step order: the loader keeps its sampler's order
        self.batch_sampler.step += 1
        return inputs, labels, mask

    def close(self) -> None:
        """Stops the worker processes, at the end of training (the loader is not used after)."""
        stop_workers(self.loader, self._iterator)
        self._iterator = None

    def state_dict(self) -> dict:
        return self.batch_sampler.state_dict()

    def load_state_dict(self, state: dict, same_layout: bool = True) -> None:
        """The step counter: each step's Poisson draw is the same whatever the number of ranks. Batches the
        workers built ahead are dropped, and the next batch is the saved step's."""
        self.batch_sampler.load_state_dict(state)
        self._iterator = None  # without persistent workers its workers stop; with them, iter() resets them
