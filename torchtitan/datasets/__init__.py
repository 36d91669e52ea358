"""Datasets (digits, dummy, image folder, CIFAR-10, latent shards; text) and the stateful distributed loader."""

from pathlib import Path

from torch.utils.data import Dataset

from torchtitan.datasets.loader import DiffusionDataLoader, PoissonDataLoader

__all__ = [
    "DiffusionDataLoader",
    "PoissonDataLoader",
    "build_dataloader",
    "build_dataset",
    "build_held_out_dataset",
    "build_text_dataloader",
]


def build_dataset(training_config, model_args, latent_config=None, images: bool = False,
                  features: tuple[int, int] | None = None, hold_out: bool = False) -> Dataset:  # fmt: skip
    """The dataset named by `training.dataset`, checked against the model's input shape.

    Args:
        training_config: the `[training]` section (dataset, dataset_path, image_size).
        model_args: the model's args (in_channels, input_size, num_classes).
        latent_config: the `[latent]` section; for dataset 'latents' its scale_factor (when > 0) or stats_file
            replaces the stored normalization, and its tokenizer, when set, must be the one the latents were
            encoded with.
        images: a latent dataset's inputs carry the images too (prefetch.LatentsAndImages), for representation
            alignment's encoder: the prepared ones ('latents'), or random ones 8x the latents' size ('dummy').
        features: (T, D): a latent dataset's inputs carry that encoder's features of the images instead
            (prefetch.LatentsAndFeatures): the stored ones ('latents', prepared with --store-features), or random
            ones of that shape ('dummy').
        hold_out: leave out what `build_held_out_dataset` holds out of this data (the digits' last 197 images),
            while a fixed-timestep validation loss reads them.

    Raises:
        FileNotFoundError: the dataset path is missing or empty (the message names it).
        ValueError: the data's channels, size or classes disagree with the model, or the latents' tokenizer with
            `[latent]`.
    """
    name = training_config.dataset
    size = training_config.image_size or model_args.input_size
    if name == "digits":
        from torchtitan.datasets.digits import DigitsDataset

        dataset = DigitsDataset(size, "train" if hold_out else "all")
    elif name == "dummy":
        from torchtitan.datasets.dummy import DummyDataset

        dataset = DummyDataset(model_args.in_channels, size, model_args.num_classes, images=images,
                               features=features)  # fmt: skip
    elif name == "imagefolder":
        from torchtitan.datasets.imagefolder import ImageFolderDataset

        dataset = ImageFolderDataset(
            training_config.dataset_path,
            size,
            skip_unreadable_images=training_config.dataloader.skip_unreadable_images,
        )
    elif name == "cifar10":
        from torchtitan.datasets.cifar10 import CIFAR10Dataset

        dataset = CIFAR10Dataset(training_config.dataset_path)
    elif name == "latents":
        from torchtitan.datasets.latent_tokenizer import check_tokenizer_matches
        from torchtitan.datasets.latents import LatentShardDataset
        from torchtitan.job_config import Latent

        latent_config = latent_config or Latent()
        dataset = LatentShardDataset(training_config.dataset_path, scale_factor=latent_config.scale_factor,
                                     stats_file=latent_config.stats_file, images=images,
                                     features=features is not None)  # fmt: skip
        if latent_config.tokenizer:  # without one the latents train as they are (no decoding)
            check_tokenizer_matches(dataset.meta, latent_config, source=dataset.root)
    else:
        raise ValueError(f"training.dataset = {name!r} is not a known dataset")
    _check_matches_model(name, dataset, model_args)
    return dataset


def build_held_out_dataset(job_config, model_args) -> Dataset:
    """The held-out data of a DiT's fixed-timestep validation loss, never flipped: `validation.dataset_path` read as
    `training.dataset`'s kind, or the dataset's own held-out split (CIFAR-10's test_batch, the digits' last 197
    images, `validation.loss_num_samples` dummy items from a pool of seed 1). Latents take the training latents'
    normalization and must come from their tokenizer; images and latents must name the training data's classes.

    Raises:
        FileNotFoundError, ValueError: the data is missing, or disagrees with the model or the training data.
    """
    training, path = job_config.training, job_config.validation.dataset_path
    name, size = training.dataset, training.image_size or model_args.input_size
    if name == "digits":
        from torchtitan.datasets.digits import DigitsDataset

        dataset = DigitsDataset(size, "validation")
    elif name == "dummy":
        from torchtitan.datasets.dummy import DummyDataset

        # As many items as asked for (a benchmark measures the loss's cost), drawn from a pool of another seed.
        length = max(job_config.validation.loss_num_samples, 1)
        dataset = DummyDataset(model_args.in_channels, size, model_args.num_classes, length=length, seed=1)
    elif name == "cifar10":
        from torchtitan.datasets.cifar10 import TEST_BATCHES, CIFAR10Dataset

        dataset = CIFAR10Dataset(path or training.dataset_path, random_flip=False, batches=TEST_BATCHES)
    elif name == "imagefolder":
        from torchtitan.datasets.imagefolder import ImageFolderDataset

        dataset = ImageFolderDataset(path, size, random_flip=False)
        _check_same_classes(dataset.classes, sorted(p.name for p in Path(training.dataset_path).iterdir()
                                                    if p.is_dir()), path, training.dataset_path)  # fmt: skip
    elif name == "latents":
        dataset = _held_out_latents(path, training.dataset_path, job_config.latent)
    else:
        raise ValueError(f"training.dataset = {name!r} holds out no data")
    _check_matches_model(name, dataset, model_args)
    return dataset


def _held_out_latents(path: str, training_path: str, latent_config) -> Dataset:
    """Held-out latent shards in the model space of the training latents: their normalization (a folder's own
    per-channel statistics would shift the inputs) and their tokenizer's latents."""
    from torchtitan.datasets.latent_tokenizer import describe_tokenizer, same_tokenizer
    from torchtitan.datasets.latents import LatentShardDataset, normalization_for, read_meta

    dataset = LatentShardDataset(path, random_flip=False)
    trained = read_meta(training_path)
    if not same_tokenizer(dataset.meta["tokenizer"], trained["tokenizer"]):
        raise ValueError(f"{path} holds latents of {describe_tokenizer(dataset.meta['tokenizer'], hashes=True)}, and "
                         f"training.dataset_path {training_path} of "
                         f"{describe_tokenizer(trained['tokenizer'], hashes=True)}")  # fmt: skip
    dataset.normalization = normalization_for(trained, latent_config.scale_factor, latent_config.stats_file)
    _check_same_classes(dataset.meta.get("classes") or [], trained.get("classes") or [], path, training_path)
    return dataset


def _check_same_classes(held_out: list[str], trained: list[str], path: str, training_path: str) -> None:
    """Label k must name one class in both (a folder of fewer classes numbers them otherwise); unnamed: unchecked."""
    if held_out and trained and held_out != trained:
        differ = sorted(set(held_out) ^ set(trained))[:3] or "their order"
        raise ValueError(f"{path} has {len(held_out)} classes and training.dataset_path {training_path} "
                         f"{len(trained)}, not the same (differing: {differ}): its labels would name other "
                         "classes")  # fmt: skip


def _check_matches_model(name: str, dataset: Dataset, model_args) -> None:
    image, _ = dataset[0]
    image = getattr(image, "latents", image)  # LatentsAndImages: the model's input is the latent
    expected = (model_args.in_channels, model_args.input_size, model_args.input_size)
    if tuple(image.shape) != expected:
        hint = f"; {dataset.describe()}" if hasattr(dataset, "describe") else ""  # latents: tokenizer + fix
        raise ValueError(
            f"training.dataset {name!r} yields {tuple(image.shape)} (C, H, W) but the model expects {expected} "
            f"(model.in_channels, model.input_size){hint}"
        )
    classes = getattr(dataset, "num_classes", None)
    if classes is not None and model_args.num_classes not in (0, classes):
        raise ValueError(
            f"training.dataset {name!r} has {classes} classes but model.num_classes = {model_args.num_classes}"
        )


def build_dataloader(training_config, model_args, dp_rank: int, dp_world: int, seed: int, poisson_steps: int = 0,
                     latent_config=None, images: bool = False, features: tuple[int, int] | None = None,
                     hold_out: bool = False):  # fmt: skip
    """Shuffled fixed-size batches, or with poisson_steps > 0 Poisson-sampled ones (DP-SGD).

    `latent_config` is the `[latent]` section, `images` says a latent dataset carries its images, `features` the
    shape of its stored encoder features and `hold_out` leaves out the held-out data, passed to `build_dataset`.
    """
    dataset = build_dataset(training_config, model_args, latent_config, images, features, hold_out)
    return _loader(dataset, training_config, dp_rank, dp_world, seed, poisson_steps)


def build_text_dataloader(job_config, vocab_size: int, num_labels: int, dp_rank: int, dp_world: int,
                          poisson_steps: int, split: str):  # fmt: skip
    """A language model's loader: `training.dataset` ('stdlib', 'text', 'synthetic_classification') tokenized by
    `model.tokenizer_path` and packed into windows of `training.seq_len`, for the split ('train' or 'validation').

    Raises:
        FileNotFoundError, ValueError: the tokenizer or data is missing or broken, or the tokenizer's vocabulary is
            larger than the model's (`vocab_size`); the message names the key and value.
    """
    from torchtitan.datasets.text import build_text_dataset
    from torchtitan.datasets.text_tokenizers import build_text_tokenizer

    training = job_config.training
    tokenizer = build_text_tokenizer(job_config.model.tokenizer_path, key="model.tokenizer_path")
    if tokenizer.vocab_size > vocab_size:
        raise ValueError(f"model.tokenizer_path {job_config.model.tokenizer_path!r} has {tokenizer.vocab_size:,} "
                         f"tokens, more than the model's vocab_size {vocab_size:,} (model.flavor)")  # fmt: skip
    dataset = build_text_dataset(training.dataset, training.dataset_path, tokenizer, training.seq_len, split,
                                 num_labels=max(num_labels, 1), vocab_size=vocab_size if training.dataset ==
                                 "synthetic_classification" else None, seed=job_config.debug.seed)  # fmt: skip
    return _loader(dataset, training, dp_rank, dp_world, job_config.debug.seed, poisson_steps)


def _loader(dataset: Dataset, training_config, dp_rank: int, dp_world: int, seed: int, poisson_steps: int):
    if poisson_steps:
        from torchtitan.dp.sampling import PoissonBatchSampler

        local = training_config.local_batch_size
        sampler = PoissonBatchSampler(len(dataset), local * dp_world / len(dataset), poisson_steps, seed, dp_rank,
                                      dp_world)  # fmt: skip
        return PoissonDataLoader(dataset, sampler, local, training_config.dataloader)
    return DiffusionDataLoader(
        dataset, training_config.local_batch_size, dp_rank, dp_world, seed, training_config.dataloader
    )
