"""FID (and Inception Score) while training: a DiT's `[validation]`.

Every `validation.freq` steps and at the end, `validation.fid_num_samples` class-balanced samples of the EMA weights
go through pytorch-fid's FID Inception (torchtitan/tools/fid.py, weights from a local file) and their statistics are
compared with `validation.fid_reference` (ADM's .npz: mu, sigma). The samples are the ones `sample.py --npz` writes
from the same weights with `--num-samples N --seed S --steps K --cfg-scale C`: sample i's noise is seeded by
(seed, i) (`sample_noise`) and labels cycle through the classes. So `scripts/evaluate_fid.py` on that .npz gives the
logged number (tests/test_validation.py checks it), and the number does not depend on the number of ranks: rank r
samples batches r, r + R, ..., and the ranks' feature sums (count, sum x, sum x x^T) are all-reduced into the run's
mean and covariance (32 MiB at 2048 features, where gathering 50,000 feature rows would take 800 MiB).

Inception Score: ADM's evaluator takes softmax(pool3 @ W), W the TF graph's `softmax/logits/MatMul` weight (no
bias), over splits of 5000 samples. pytorch-fid's network drops that layer, but its weights file keeps it as
`fc.weight` (1008 x 2048), so the score is computed from the pool3 features (`validation.fid_dims = 2048` only).

A side feature: a failure (a file that became unreadable, non-finite features, out of memory) is one warning line and
training goes on. Every rank joins the reduction, failed or not, so no rank waits for one that gave up; a failure
inside the model's own forward under FSDP (whose ranks wait for each other there) can still stall, as for the sample
grids.
"""

import contextlib
import math
import time

import numpy as np
import torch
import torch.distributed as dist

from torchtitan.diffusion import labels_for, sample_images, sample_noise, sampler_options
from torchtitan.errors import ConfigError, at
from torchtitan.tools.adm_metrics import IS_SPLIT_SIZE as ADM_SPLIT_SIZE  # compute_inception_score's split_size
from torchtitan.tools.adm_metrics import class_probabilities
from torchtitan.tools.fid import build_inception, frechet_distance, inception_features, load_statistics
from torchtitan.tools.images import to_uint8_nhwc
from torchtitan.tools.logging import logger


def rank_batches(num_samples: int, batch_size: int, rank: int, world: int) -> list[tuple[int, int, int] | None]:
    """This rank's batches as (index, first sample, size): every world-th batch of the run from batch `rank` (each
    sample's noise is its index's, `sample_noise`, so the dealing changes no image). None pads the list to the same
    length on every rank: a DDP or FSDP forward is a collective, so every rank runs as many sampler passes (a padding
    pass is thrown away)."""
    starts = list(range(0, num_samples, batch_size))
    rounds = math.ceil(len(starts) / world)
    batches = []
    for k in range(rounds):
        b = k * world + rank
        batches.append((b, starts[b], min(batch_size, num_samples - starts[b])) if b < len(starts) else None)
    return batches


class FeatureSums:
    """One rank's running sums of Inception features; summed over the ranks they give the run's mean, covariance and
    Inception Score.

    Features are accumulated about `shift` (the reference mean): the covariance comes from sum x x^T - n mu mu^T,
    whose cancellation costs the fewest digits when the mean is near 0.

    Args:
        dims: features per image.
        num_samples: the run's samples (the number of Inception Score splits).
        classes: softmax outputs per image for the Inception Score (0: none kept).
        shift: (dims,) subtracted from every feature row before summing (None: 0).
    """

    def __init__(self, dims: int, num_samples: int, classes: int = 0, shift: np.ndarray | None = None):
        self.dims, self.classes = dims, classes
        self.shift = np.zeros(dims) if shift is None else np.asarray(shift, dtype=np.float64)
        splits = math.ceil(num_samples / ADM_SPLIT_SIZE) if classes else 0
        self.count = 0.0
        self.sum = np.zeros(dims)
        self.outer = np.zeros((dims, dims))
        self.split_count = np.zeros(splits)
        self.split_probabilities = np.zeros((splits, classes))  # sum_i p_i(y) over each split's samples
        self.split_plogp = np.zeros(splits)  # sum_i sum_y p_i(y) log p_i(y)

    def add(self, features: np.ndarray, probabilities: np.ndarray | None = None, first_index: int = 0) -> None:
        """Rows of (n, dims) features, and (n, classes) softmax outputs of samples first_index.. of the run."""
        centred = features - self.shift
        self.count += len(features)
        self.sum += centred.sum(0)
        self.outer += centred.T @ centred  # (dims, dims)
        if probabilities is not None and self.classes:
            split = (first_index + np.arange(len(features))) // ADM_SPLIT_SIZE
            np.add.at(self.split_count, split, 1.0)
            np.add.at(self.split_probabilities, split, probabilities)
            plogp = probabilities * np.log(np.where(probabilities > 0, probabilities, 1.0))  # 0 log 0 = 0
            np.add.at(self.split_plogp, split, plogp.sum(1))

    def to_tensor(self, failed: bool, device: torch.device) -> torch.Tensor:
        """Every sum in one float64 tensor (one all-reduce), led by a failure count: a failed rank sends zeros."""
        parts = [self.count, self.sum, self.outer, self.split_count, self.split_probabilities, self.split_plogp]
        flat = np.concatenate([np.ravel(p) for p in parts])
        if failed:
            flat = np.zeros_like(flat)
        return torch.from_numpy(np.concatenate([[float(failed)], flat])).to(device)

    def load_tensor(self, tensor: torch.Tensor) -> int:
        """Takes the (reduced) sums of `to_tensor`'s layout; returns the failure count."""
        flat = tensor.double().cpu().numpy()
        failed, flat = int(round(flat[0])), flat[1:]
        for name in ("count", "sum", "outer", "split_count", "split_probabilities", "split_plogp"):
            old = getattr(self, name)
            size = np.size(old)
            setattr(self, name, float(flat[0]) if name == "count" else flat[:size].reshape(np.shape(old)))
            flat = flat[size:]
        return failed

    def statistics(self) -> tuple[np.ndarray, np.ndarray]:
        """(mu, sigma): the mean and the unbiased covariance, as np.cov gives them."""
        n = self.count
        if n < 2:
            raise ValueError(f"FID needs at least 2 images, got {int(n)}")
        mean = self.sum / n
        sigma = (self.outer - n * np.outer(mean, mean)) / (n - 1)
        return self.shift + mean, (sigma + sigma.T) / 2

    def inception_score(self) -> float | None:
        """exp(E_x KL(p(y|x) || p(y))) per split of 5000 samples, averaged over the splits (ADM's evaluator, after
        improved-gan); KL's mean is E sum p log p - sum p_bar log p_bar with p_bar the split's mean. None without
        softmax outputs."""
        if not self.classes or not self.split_count.any():
            return None
        n = self.split_count[:, None]
        marginal = self.split_probabilities / n
        marginal_plogp = (marginal * np.log(np.where(marginal > 0, marginal, 1.0))).sum(1)
        return float(np.mean(np.exp(self.split_plogp / n[:, 0] - marginal_plogp)))


class FIDValidator:
    """FID of EMA samples against reference statistics, every `validation.freq` steps; logged as `validation/fid`,
    `validation/inception_score`, and the pass's seconds and images/s.

    Args:
        job_config: the resolved config (`[validation]`; `[sampling]`'s sampler, seed and guidance channels;
            `[latent]`).
        model_args: the model's args (input shape, classes).
        diffusion: the objective whose sampler runs.
        device: where the model (and the Inception network, during a pass) runs.
        dp_rank, dp_degree: this rank's share of the samples.
        dp_group: a callable giving the data-parallel process group (None: the default group).
        metrics: the MetricsLogger whose sinks (metrics.jsonl, TensorBoard, wandb) get the record.
    """

    def __init__(self, job_config, model_args, diffusion, device: torch.device, dp_rank: int, dp_degree: int,
                 dp_group, metrics):  # fmt: skip
        self.config, self.args, self.diffusion, self.device = job_config, model_args, diffusion, device
        self.dp_rank, self.dp_degree, self.dp_group, self.metrics = dp_rank, dp_degree, dp_group, metrics
        self.latent_space = job_config.training.dataset == "latents" or model_args.in_channels not in (1, 3)
        self.network = None  # pytorch-fid's Inception, on the CPU between passes
        self.reference = None  # (mu, sigma)
        self.logits_weight = None  # (1008, 2048): the Inception Score's softmax layer, when the weights have it

    def check(self) -> None:
        """Loads the Inception weights, the reference statistics and (latent models) the decoder on every rank, at
        start rather than at the first validation thousands of steps in.

        Raises:
            ConfigError: on every rank when any rank cannot load them (the message names the key).
        """
        error = ""
        try:
            self._load()
        except ConfigError as e:
            error = str(e)
        failed = self._reduce(torch.tensor([float(bool(error))], device=self.device))[0].item()
        if failed:
            raise ConfigError(error or f"validation: {int(failed)} other rank(s) could not load the FID files")
        scored = "and Inception Score " if self.logits_weight is not None else ""
        logger.info(f"validation: FID {scored}of {self.config.validation.fid_num_samples} EMA samples every "
                    f"{self.config.validation.freq} steps against {self.config.validation.fid_reference}")  # fmt: skip

    def _load(self) -> None:
        cfg, v = self.config, self.config.validation
        try:
            self.network = build_inception(v.inception_weights, "cpu", v.fid_dims)
            if v.fid_dims == 2048:  # build_inception keeps the file's fc.weight (the load requires it)
                self.logits_weight = self.network.logits_weight.numpy()
        except Exception as e:  # noqa: BLE001 (any unreadable file is this key's problem)
            raise ConfigError(f"{at(cfg, 'validation.inception_weights')}: {type(e).__name__}: {e}") from e
        if self.logits_weight is None:
            logger.info("validation: no Inception Score (it needs fid_dims = 2048 and the weights' fc.weight)")
        try:
            self.network.to(self.device)
            mu, sigma = load_statistics(v.fid_reference, self.network, v.fid_batch_size)
        except Exception as e:  # noqa: BLE001
            raise ConfigError(f"{at(cfg, 'validation.fid_reference')}: {type(e).__name__}: {e}") from e
        finally:
            self.network.to("cpu")
        if np.shape(mu) != (v.fid_dims,) or np.shape(sigma) != (v.fid_dims, v.fid_dims):
            dims = f"validation.fid_dims = {v.fid_dims} (in {cfg.source_of('validation.fid_dims')})"
            raise ConfigError(f"{at(cfg, 'validation.fid_reference')}: holds statistics of {np.shape(mu)} features, "
                              f"and {dims}")  # fmt: skip
        if not (np.isfinite(mu).all() and np.isfinite(sigma).all()):
            raise ConfigError(f"{at(cfg, 'validation.fid_reference')}: holds non-finite statistics")
        self.reference = (np.asarray(mu, dtype=np.float64), np.asarray(sigma, dtype=np.float64))
        if self.latent_space:
            from torchtitan.datasets.tokenizers import load_training_decoder

            try:
                load_training_decoder(cfg, self.device)
            except (FileNotFoundError, ValueError, RuntimeError) as e:
                raise ConfigError(f"[latent] tokenizer, which decodes the FID samples (validation.enable): {e}") from e

    def _reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        if dist.is_initialized() and self.dp_degree > 1:
            dist.all_reduce(tensor, group=self.dp_group() if self.dp_group is not None else None)
        return tensor

    def run(self, model: torch.nn.Module, ema, step: int, compute_context) -> dict | None:
        """One validation: samples with the EMA weights swapped in (if kept), FID and IS logged and returned (on the
        ranks that log; None on the others); a failure is one warning line (None returned), never raised."""
        start = time.perf_counter()
        v = self.config.validation
        classes = len(self.logits_weight) if self.logits_weight is not None else 0
        sums, error = FeatureSums(v.fid_dims, v.fid_num_samples, classes, shift=self.reference[0]), ""
        try:
            with ema.swapped_in() if ema is not None else contextlib.nullcontext():
                self.add_local_samples(sums, model, compute_context)
        except Exception as e:  # noqa: BLE001 (a side feature must not end the run)
            error = f"{type(e).__name__}: {e}"
            logger.warning(f"step {step}: FID validation failed on this rank ({error}); training goes on")
        finally:
            self.network.to("cpu")
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
        try:
            failed = sums.load_tensor(self._reduce(sums.to_tensor(bool(error), self.device)))
            if failed:
                if not error:  # the failing rank said why
                    logger.warning(f"step {step}: FID validation failed on {failed} rank(s); training goes on")
                return None
            if not self.metrics.enabled:  # the Frechet distance is seconds of CPU at 2048: only the logging ranks
                return None
            mu, sigma = sums.statistics()
            if not (np.isfinite(mu).all() and np.isfinite(sigma).all()):
                raise ValueError("the Inception features are not finite")
            record = {"validation/fid": frechet_distance(mu, sigma, *self.reference)}
            if not math.isfinite(record["validation/fid"]):
                raise ValueError(f"FID is {record['validation/fid']}")
            if (score := sums.inception_score()) is not None:
                record["validation/inception_score"] = score
            seconds = time.perf_counter() - start
            record["validation/fid_seconds"] = seconds
            record["validation/fid_images_per_second"] = v.fid_num_samples / seconds
            self._log(step, record)
            return record
        except Exception as e:  # noqa: BLE001
            logger.warning(f"step {step}: FID validation failed ({type(e).__name__}: {e}); training goes on")
            return None

    @torch.no_grad()
    def add_local_samples(self, sums: FeatureSums, model: torch.nn.Module, compute_context) -> None:
        """This rank's share of the samples through the sampler, the decoder (latent models) and the Inception
        network, into `sums` (whose layout every rank shares, failed or not)."""
        v, s, a = self.config.validation, self.config.sampling, self.args
        labels = labels_for(v.fid_num_samples, [], a.num_classes)  # class-balanced, as sample.py's
        self.network.to(self.device)
        for batch in rank_batches(v.fid_num_samples, v.fid_batch_size, self.dp_rank, self.dp_degree):
            _, first, size = batch if batch is not None else (0, 0, 1)  # padding: one sample, thrown away
            noise, generator = sample_noise(s.seed, range(first, first + size), a.in_channels, a.input_size)
            y = labels[first : first + size].to(self.device) if labels is not None else None
            with compute_context():
                x = sample_images(self.diffusion, model, noise.to(self.device), y, v.fid_sampling_steps, s.sampler,
                                  v.fid_cfg_scale, a.num_classes, clip_denoised=not self.latent_space,
                                  guidance_channels=s.guidance_channels, generator=generator,
                                  **sampler_options(s))  # fmt: skip
            if batch is None:
                continue
            if self.latent_space:
                from torchtitan.datasets.tokenizers import decode_for_training

                x = decode_for_training(self.config, x)
            features = inception_features(self.network, to_uint8_nhwc(x), batch_size=v.fid_batch_size)
            if not np.isfinite(features).all():
                raise ValueError("the Inception features are not finite")
            probabilities = class_probabilities(features, self.logits_weight) if sums.classes else None
            sums.add(features, probabilities, first)

    def _log(self, step: int, record: dict) -> None:
        """The console line with the pass's cost, and the record to metrics.jsonl, TensorBoard and wandb."""
        self.metrics.log(step, {**record, "validation/fid_samples": self.config.validation.fid_num_samples})
