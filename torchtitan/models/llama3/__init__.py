"""Llama 3 flavors and their TrainSpec (TRAIN_SPEC, listed in torchtitan/models): a second model family through the
same trainer."""

import dataclasses
import functools
from pathlib import Path

from torchtitan.components.checkpoint_model_args import StartingCheckpoint, starting_checkpoint
from torchtitan.errors import ConfigError, at
from torchtitan.models.llama3.flavors import llama3_configs
from torchtitan.models.llama3.model import Llama3, Llama3Args, flops_per_token
from torchtitan.models.llama3.parallelize import parallelize_llama3
from torchtitan.models.llama3.state_dict_adapter import (
    NUMERIC_FIELDS,
    args_for_hf_folder,
    read_hf_folder,
    special_ids_mismatch,
)
from torchtitan.protocols import TrainSpec
from torchtitan.tools.logging import logger

__all__ = ["Llama3", "Llama3Args", "flops_per_token", "llama3_configs", "parallelize_llama3"]

TEXT_DATASETS = ("stdlib", "text", "synthetic_classification")


def build_llama3_args(args: Llama3Args, job_config) -> Llama3Args:
    """The flavor's args with the overrides that apply to a language model: model.num_classes (> 0: a sequence
    classifier with that many labels, 0: the causal LM), model.attn_window (sliding-window attention); and the
    numerics the starting weights were trained with (norm eps, RoPE theta and scaling, max positions): those the
    checkpoint the run starts from records (a resume, or a DCP initial_load_path), else, when a Hugging Face folder
    is the starting point (checkpoint.initial_load_format 'hf'), its config.json's (see _with_hf_config)."""
    model_config, checkpoint, seq_len = job_config.model, job_config.checkpoint, job_config.training.seq_len
    if model_config.num_classes >= 0:
        args.num_labels = model_config.num_classes
        if args.num_labels > 0:
            args.tie_embeddings = False  # a classifier has no LM head to tie
    if model_config.attn_window >= 0:
        args.attn_window = model_config.attn_window
    limit = f"the flavor's max_seq_len {args.max_seq_len}"
    start = starting_checkpoint(checkpoint, Path(job_config.job.dump_folder))
    if start is not None:  # its numerics came with its weights (from config.json, for a run imported from HF)
        args = _with_recorded_numerics(args, start)
        limit = f"the max_seq_len {args.max_seq_len} that {start.path} records"
    elif checkpoint.initial_load_format == "hf" and checkpoint.initial_load_path:
        args = _with_hf_config(args, job_config)
        limit = f"config.json's max_position_embeddings {args.max_seq_len} (the RoPE table's rows)"
    if seq_len > args.max_seq_len:
        raise ValueError(f"training.seq_len {seq_len} is longer than {limit}")
    if job_config.training.dataset == "synthetic_classification" and args.num_labels == 0:
        raise ValueError("training.dataset 'synthetic_classification' needs a classifier: set model.num_classes > 0")
    args.validate()
    return args


def _with_hf_config(args: Llama3Args, job_config) -> Llama3Args:
    """`args` with the numerics of checkpoint.initial_load_path's config.json, whose weights were trained with them
    (the flavor's shapes, overrides applied, are checked against it).

    Raises:
        ConfigError: naming checkpoint.initial_load_path and the file: config.json is missing, no Llama config our
            model implements, or of another shape than the flavor.
    """
    folder = job_config.checkpoint.initial_load_path
    try:
        args, notes = args_for_hf_folder(folder, args)
    except (FileNotFoundError, ValueError) as e:
        raise ConfigError(f"{at(job_config, 'checkpoint.initial_load_path')}: {e}") from e
    if notes:
        _log_once(f"{folder}: the model takes config.json's {', '.join(notes)}")
    return args


def _with_recorded_numerics(args: Llama3Args, start: StartingCheckpoint) -> Llama3Args:
    """`args` with the numerics (NUMERIC_FIELDS) that the checkpoint a run starts from records, logging those that
    differ from the flavor's: a run imported from Hugging Face keeps config.json's when it resumes without the
    folder or the import keys."""
    taken = {field: start.model_args[field] for field in NUMERIC_FIELDS if field in start.model_args}
    recorded = dataclasses.replace(args, **taken)  # a recorded rope_scaling dict becomes a RopeScaling
    notes = [f"{field} {getattr(recorded, field)} (the flavor's {getattr(args, field)})" for field in taken
             if getattr(recorded, field) != getattr(args, field)]  # fmt: skip
    if notes:
        _log_once(f"{start.path}: the model takes the numerics its weights were trained with: {', '.join(notes)}")
    return recorded


@functools.cache
def _log_once(message: str) -> None:
    """The config is validated at parse time and built again by the Trainer: one line, not two."""
    logger.info(message)


def _build_objective(job_config, model_args: Llama3Args, layout):
    from torchtitan.models.llama3.objective import LanguageModelObjective

    return LanguageModelObjective(model_args.num_labels, job_config.training.seq_len)


def _build_dataloader(job_config, model_args: Llama3Args, dp_rank: int, dp_world: int, poisson_steps: int,
                      split: str):  # fmt: skip
    """The text loader; from a Hugging Face folder, a warning when its config.json's BOS/EOS ids are not the ones
    the tokenizer packs documents with (special_ids_mismatch)."""
    from torchtitan.datasets import build_text_dataloader

    loader = build_text_dataloader(job_config, model_args.vocab_size, model_args.num_labels, dp_rank, dp_world,
                                   poisson_steps, split)  # fmt: skip
    identity = getattr(loader.dataset, "tokenizer_identity", None)  # None: no packed documents (classification)
    checkpoint = job_config.checkpoint
    if split == "train" and identity and checkpoint.initial_load_format == "hf" and checkpoint.initial_load_path:
        mismatch = special_ids_mismatch(checkpoint.initial_load_path, identity)
        if mismatch:
            logger.warning(mismatch)
    return loader


TRAIN_SPEC = TrainSpec(
    name="llama3",
    model_cls=Llama3,
    model_args=llama3_configs,
    build_model_args_fn=build_llama3_args,
    parallelize_fn=parallelize_llama3,
    build_objective_fn=_build_objective,
    build_dataloader_fn=_build_dataloader,
    flops_per_sample_fn=lambda args, job_config: (
        flops_per_token(args, job_config.training.seq_len) * job_config.training.seq_len
    ),
    datasets=TEXT_DATASETS,
    has_validation_split=True,
    weight_readers={"hf": read_hf_folder},
    arg_keys={"num_labels": "model.num_classes"},
)
