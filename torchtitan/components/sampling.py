"""Sample grids during training: fixed noise and classes, the EMA weights, every `sampling.freq` steps.

A side feature: a failure is logged as an error and training goes on. A latent model's samples are decoded through
the `[latent]` tokenizer (checked against the latents at start, on rank 0), or saved as latents
(`samples/step-N.safetensors`) when it has none: model-space latents, whose metadata records the normalization of the
prepared latents the model trained on and their tokenizer (`latents.model_space_metadata`), so
`cosmos_latent_decoder.py` decodes them right with no flag.
"""

import contextlib
from pathlib import Path

import torch

from torchtitan.diffusion import sample_images, sampler_options
from torchtitan.errors import ConfigError
from torchtitan.tools.images import save_image_grid
from torchtitan.tools.logging import logger
from torchtitan.tools.utils import rank0_error


class SampleWriter:
    """Writes `samples/step-N.png` (or `.safetensors` of latents) into the run folder.

    Args:
        job_config: the resolved config (`[sampling]`, `[latent]`, `training.dataset`).
        model_args: the model's args (input shape, classes).
        diffusion: the objective whose sampler runs.
        device: where the model runs.
        rank: only rank 0 decodes and writes; every rank runs the model (FSDP needs them all).
        dump_folder: the run folder.
        metrics: the MetricsLogger, which also logs the grid to TensorBoard / wandb.
    """

    def __init__(self, job_config, model_args, diffusion, device: torch.device, rank: int, dump_folder: Path,
                 metrics):  # fmt: skip
        self.config, self.args, self.diffusion = job_config, model_args, diffusion
        self.device, self.rank, self.folder, self.metrics = device, rank, Path(dump_folder) / "samples", metrics
        self.latent_space = job_config.training.dataset == "latents" or model_args.in_channels not in (1, 3)
        self.decodes = self.latent_space and bool(job_config.latent.tokenizer)

    def due(self, step: int, last: bool) -> bool:
        freq = self.config.sampling.freq
        return freq > 0 and (step % freq == 0 or last)

    def check(self) -> None:
        """Said or checked at start, not at the first grid thousands of steps in: a latent model without a tokenizer
        saves latents; with one, rank 0 loads the decoder and checks it against the latents.

        Raises:
            ConfigError: on every rank, when rank 0 cannot load or match the tokenizer.
        """
        cfg = self.config
        if not self.latent_space or cfg.sampling.freq <= 0:
            return
        if not cfg.latent.tokenizer:
            logger.warning("sampling.freq > 0 on a latent model with no [latent] tokenizer: samples are saved as "
                           "latents (samples/step-N.safetensors); set latent.tokenizer and latent.checkpoint_dir "
                           "for image grids, or decode them later with cosmos_latent_decoder.py")  # fmt: skip
            return
        error = ""
        if self.rank == 0:  # only rank 0 decodes grids
            from torchtitan.datasets.tokenizers import load_training_decoder

            try:
                load_training_decoder(cfg, self.device)
            except (FileNotFoundError, ValueError, RuntimeError) as e:
                error = f"[latent] tokenizer for the sample grids (sampling.freq = {cfg.sampling.freq}): {e}"
        if error := rank0_error(error):
            raise ConfigError(error)

    def write(self, model: torch.nn.Module, ema, step: int, compute_context) -> None:
        """Samples with the EMA weights swapped in (if kept) and writes them; a failure is logged, never raised."""
        try:
            with ema.swapped_in() if ema is not None else contextlib.nullcontext():
                samples, labels = self.generate(model, compute_context)
            if self.rank == 0:
                self._save(samples, labels, step)
        except Exception as e:  # noqa: BLE001 (any failure here must not end the run)
            logger.exception(f"step {step}: writing samples failed ({type(e).__name__}: {e}); training goes on")
            if self.device.type == "cuda":
                torch.cuda.empty_cache()

    @torch.no_grad()
    def generate(self, model: torch.nn.Module, compute_context) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A grid's worth of samples from fixed noise and fixed classes, and their labels."""
        args, s = self.args, self.config.sampling
        generator = torch.Generator().manual_seed(s.seed)
        noise = torch.randn(s.num_samples, args.in_channels, args.input_size, args.input_size, generator=generator)
        y = torch.arange(s.num_samples) % args.num_classes if args.num_classes > 0 else None
        noise, y = noise.to(self.device), (y.to(self.device) if y is not None else None)
        with compute_context():
            samples = sample_images(self.diffusion, model, noise, y, s.steps, s.sampler, s.cfg_scale,
                                    args.num_classes, clip_denoised=not self.latent_space,
                                    guidance_channels=s.guidance_channels, **sampler_options(s))  # fmt: skip
        return samples, y

    def _save(self, samples: torch.Tensor, labels: torch.Tensor | None, step: int) -> None:
        if self.latent_space and not self.decodes:
            from safetensors.torch import save_file

            from torchtitan.datasets.latents import model_space_metadata

            training = self.config.training
            metadata = model_space_metadata(training.dataset_path if training.dataset == "latents" else "",
                                            self.config.latent.scale_factor, self.config.latent.stats_file)  # fmt: skip
            self.folder.mkdir(parents=True, exist_ok=True)
            tensors = {"latents": samples.float().cpu().contiguous()}
            if labels is not None:
                tensors["labels"] = labels.cpu()
            path = self.folder / f"step-{step}.safetensors"
            save_file(tensors, str(path), metadata=metadata or None)
            logger.info(f"wrote sampled latents {path}")
            return
        if self.decodes:
            from torchtitan.datasets.tokenizers import decode_for_training

            samples = decode_for_training(self.config, samples)
        classes = self.args.num_classes
        nrow = classes if classes and len(samples) % classes == 0 else 0  # one class per column
        path = save_image_grid(samples, self.folder / f"step-{step}.png", nrow)
        logger.info(f"wrote samples {path}")
        self.metrics.log_image(step, path)
