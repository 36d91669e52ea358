"""DevicePrefetcher: a batch fetched a step ahead is not lost to a checkpoint, and pixels reach the model as before.

The trainer-level proof is tests/test_train.py::test_killed_run_resumes_bitwise: every step prefetches the next
batch before its checkpoint is saved, and the resumed run's losses equal the uninterrupted run's bit for bit.
"""

import torch

from torchtitan.config_manager import JobConfig
from torchtitan.datasets import DiffusionDataLoader
from torchtitan.datasets.digits import DigitsDataset
from torchtitan.datasets.dummy import DummyDataset
from torchtitan.datasets.prefetch import DevicePrefetcher, batch_to_device


def _loader(data) -> DiffusionDataLoader:
    return DiffusionDataLoader(
        data, 16, dp_rank=0, dp_world=1, seed=3, dataloader_config=JobConfig().training.dataloader
    )


def test_the_state_is_the_one_before_the_batch_fetched_ahead():
    data = DigitsDataset(8)
    plain = _loader(data)
    expected = [next(plain) for _ in range(6)]
    feed = DevicePrefetcher(_loader(data), torch.device("cpu"))
    for i in range(3):
        x, y = next(feed)
        assert torch.equal(x, expected[i][0]) and torch.equal(y, expected[i][1])
    feed.prefetch()  # batch 3 is fetched ahead: the host loader has moved past it
    state = feed.state_dict()
    assert state["loader"]["_num_yielded"] == 3 and feed.host.state_dict()["loader"]["_num_yielded"] == 4
    resumed = DevicePrefetcher(_loader(data), torch.device("cpu"))
    resumed.prefetch()  # a stale batch from the fresh position is dropped by the load
    resumed.load_state_dict(state)
    for i in range(3, 6):
        x, y = next(resumed)
        assert torch.equal(x, expected[i][0]) and torch.equal(y, expected[i][1]), i


def test_pixels_travel_as_uint8_and_arrive_in_the_unit_range():
    data = DummyDataset(3, 8, 10)
    image, _ = data[0]
    assert image.dtype == torch.uint8
    (x, y), (images, labels) = next(DevicePrefetcher(_loader(data), torch.device("cpu"))), next(_loader(data))
    assert x.dtype == torch.float32 and torch.equal(x, images.float() / 127.5 - 1.0)  # the host's old arithmetic
    torch.testing.assert_close(x.double(), images.double() / 127.5 - 1, rtol=0, atol=1e-7)  # float32 rounding
    assert torch.equal(y, labels)
    latents = DummyDataset(4, 8, 10)[0][0]  # other channel counts are latents: float32 as they are
    assert latents.dtype == torch.float32 and torch.equal(batch_to_device((latents,), torch.device("cpu"))[0], latents)


def test_close_stops_persistent_workers():
    """Trainer.close stops the loader's worker processes at once, not when the process ends (persistent workers
    live as long as the loader object)."""
    config = JobConfig().training.dataloader
    config.num_workers, config.persistent_workers = 2, True
    feed = DevicePrefetcher(DiffusionDataLoader(DigitsDataset(8), 16, 0, 1, 3, config), torch.device("cpu"))
    next(feed)
    feed.prefetch()
    workers = feed.host.loader._iterator._workers
    assert len(workers) == 2 and all(w.is_alive() for w in workers)
    feed.close()
    assert not any(w.is_alive() for w in workers) and feed.host.loader._iterator is None


def test_dummy_batches_are_one_gather_on_the_device_equal_to_item_by_item():
    """The dummy data costs the step nothing: its loader hands out index batches and the pool, moved to the device by
    the prefetcher, gathers each batch there (no collation, pinning or copy), whatever num_workers says (no worker
    process starts). The batches equal item-by-item collation (the loader before), and a resume continues with the
    next one. The "meta" device stands for a GPU here: what is made there never touched the host."""
    from torch.utils.data import default_collate

    from torchtitan.datasets import PoissonDataLoader
    from torchtitan.dp.sampling import PoissonBatchSampler

    config = JobConfig().training.dataloader
    config.num_workers, config.persistent_workers = 2, True
    data = DummyDataset(3, 8, 10, length=100, pool=7)
    loader = DiffusionDataLoader(data, 16, 0, 1, 3, config)
    expected = []
    for indices in list(torch.utils.data.BatchSampler(loader.sampler, 16, drop_last=True))[:4]:
        expected.append(default_collate([data[i] for i in indices]))
    for want in expected[:2]:
        assert all(torch.equal(a, b) for a, b in zip(next(loader), want, strict=True))
    assert loader.loader.num_workers == 0 and loader._iterator._num_workers == 0
    state = loader.state_dict()
    resumed = DiffusionDataLoader(DummyDataset(3, 8, 10, length=100, pool=7), 16, 0, 1, 3, config)
    resumed.load_state_dict(state)
    assert all(torch.equal(a, b) for a, b in zip(next(resumed), expected[2], strict=True))

    feed = DevicePrefetcher(DiffusionDataLoader(DummyDataset(3, 8, 10), 16, 0, 1, 3, config), torch.device("meta"))
    assert feed.dataset.images.device.type == "meta"  # the pool moved once, at the start
    x, y = next(feed)
    assert x.device.type == y.device.type == "meta" and x.dtype == torch.float32 and x.shape == (16, 3, 8, 8)

    # Poisson (DP): one gather too; with worker processes the pool stays on the host, where they gather it.
    for workers, where in ((0, "meta"), (2, "cpu")):
        config.num_workers = workers
        pool = DummyDataset(3, 8, 10, length=100, pool=7)
        sampler = PoissonBatchSampler(len(pool), 16 / len(pool), 3, seed=5)
        poisson = PoissonDataLoader(pool, sampler, 16, config)
        images, labels, mask = next(DevicePrefetcher(poisson, torch.device("meta")))
        assert pool.images.device.type == where and images.device.type == mask.device.type == "meta"
        poisson.close()
    poisson = PoissonDataLoader(pool, PoissonBatchSampler(len(pool), 16 / len(pool), 3, seed=5), 16, config)
    images, labels, mask = next(poisson)  # on the host, by the workers
    drawn = default_collate([pool[i] for i in sampler.batch(0)])
    assert torch.equal(images[: len(drawn[0])], drawn[0]) and torch.equal(labels[: len(drawn[1])], drawn[1])
    poisson.close()
