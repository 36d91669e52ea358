"""Llama 3 flavors and their TrainSpec registration: a second model family through the same trainer."""

from torchtitan.models.llama3.flavors import llama3_configs
from torchtitan.models.llama3.model import Llama3, Llama3Args, flops_per_token
from torchtitan.models.llama3.parallelize import parallelize_llama3
from torchtitan.models.llama3.state_dict_adapter import read_hf_folder
from torchtitan.train_spec import TrainSpec, register_train_spec

__all__ = ["Llama3", "Llama3Args", "flops_per_token", "llama3_configs", "parallelize_llama3"]

TEXT_DATASETS = ("stdlib", "text", "synthetic_classification")


def build_llama3_args(args: Llama3Args, job_config) -> Llama3Args:
    """The flavor's args with the overrides that apply to a language model: model.num_classes (> 0: a sequence
    classifier with that many labels, 0: the causal LM), model.attn_window (sliding-window attention)."""
    model_config, seq_len = job_config.model, job_config.training.seq_len
    if model_config.num_classes >= 0:
        args.num_labels = model_config.num_classes
        if args.num_labels > 0:
            args.tie_embeddings = False  # a classifier has no LM head to tie
    if model_config.attn_window >= 0:
        args.attn_window = model_config.attn_window
    if seq_len > args.max_seq_len:
        raise ValueError(f"training.seq_len {seq_len} is longer than the flavor's max_seq_len {args.max_seq_len}")
    if job_config.training.dataset == "synthetic_classification" and args.num_labels == 0:
        raise ValueError("training.dataset 'synthetic_classification' needs a classifier: set model.num_classes > 0")
    args.validate()
    return args


def _build_objective(job_config, model_args: Llama3Args, layout):
    from torchtitan.models.llama3.objective import LanguageModelObjective

    return LanguageModelObjective(model_args.num_labels, job_config.training.seq_len)


def _build_dataloader(job_config, model_args: Llama3Args, dp_rank: int, dp_world: int, poisson_steps: int,
                      split: str):  # fmt: skip
    from torchtitan.datasets import build_text_dataloader

    return build_text_dataloader(job_config, model_args.vocab_size, model_args.num_labels, dp_rank, dp_world,
                                 poisson_steps, split)  # fmt: skip


register_train_spec(
    TrainSpec(
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
        read_hf_fn=read_hf_folder,
    )
)
