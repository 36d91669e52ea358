"""What gives a run's training data its meaning, saved in every full checkpoint and compared on resume.

The record holds the dataset and its folder, the number of samples, the sample's shape (`training.seq_len` for
text, the image or latent size for images), the text tokenizer's identity (file, content hash, vocabulary, BOS/EOS)
and the latents' image tokenizer. On resume each change is judged by what it makes meaningless:

- the weights: another text tokenizer (its ids stand for other text: `model.tokenizer_path`) or latents of another
  image tokenizer (`training.dataset_path`). The resume is refused (`ResumeRefusedError`), naming the key.
- only the data position (an index into the shuffled samples of the epoch in progress): another dataset, folder,
  number of samples or `training.seq_len` (Llama's RoPE has no learned positions, so the weights carry over to
  another window length). The run resumes with a warning and the data loader restarts the saved epoch from its
  start.

A moved tokenizer file of the same content is the same tokenizer. Checkpoints written before the record existed
resume unchecked (`optional_in_checkpoint`).
"""

import json
from pathlib import Path

from torch.utils.data import Dataset

from torchtitan.errors import ResumeRefusedError
from torchtitan.tools.logging import logger

__all__ = ["DataRecord", "data_record"]

# Datasets that read training.dataset_path; the others ignore it, so it is not recorded for them.
PATH_DATASETS = ("text", "imagefolder", "cifar10", "latents")
TOKENIZER_FIELDS = ("tokenizer_fingerprint", "vocab_size", "bos_id", "eos_id")
# Field -> the config key a change comes from, for the fields whose change only moves the data position.
POSITION_FIELDS = {
    "dataset": "training.dataset",
    "dataset_path": "training.dataset_path",
    "seq_len": "training.seq_len",
    "sample_shape": "training.image_size",
}


def data_record(job_config, dataset: Dataset) -> dict:
    """The record of a run's training data (plain str/int/list values) from its config and training dataset."""
    training = job_config.training
    record = {"dataset": training.dataset, "samples": len(dataset)}
    if training.dataset in PATH_DATASETS and training.dataset_path:
        record["dataset_path"] = str(Path(training.dataset_path).expanduser().resolve())
    if hasattr(dataset, "seq_len"):  # text: windows of seq_len tokens
        record["seq_len"] = int(dataset.seq_len)
    else:  # images or latents: the (C, H, W) the model is trained on
        sample = dataset[0][0]
        record["sample_shape"] = [int(n) for n in getattr(sample, "latents", sample).shape]  # LatentsAndImages
    record.update(getattr(dataset, "tokenizer_identity", None) or {})
    meta = getattr(dataset, "meta", None)  # prepared latents: the image tokenizer that encoded them
    if isinstance(meta, dict) and isinstance(meta.get("tokenizer"), dict):
        record["latent_tokenizer"] = f"{meta['tokenizer'].get('kind')}:{meta['tokenizer'].get('name')}"
    return record


def _describe_tokenizer(record: dict) -> str:
    return (f"{record.get('tokenizer')} (sha1 {str(record.get('tokenizer_fingerprint'))[:12]}, "
            f"{record.get('vocab_size')} tokens, BOS {record.get('bos_id')}, EOS {record.get('eos_id')})")  # fmt: skip


class DataRecord:
    """The checkpoint's `data` entry: `data_record` of this run, checked against the saved one on load.

    Args:
        record: this run's `data_record(job_config, dataset)`.

    Attributes:
        keeps_data_position: False after loading a record whose data differs in a way that moves the position only
            (the checkpoint manager then restarts the saved epoch); True otherwise.
    """

    optional_in_checkpoint = True  # checkpoints written before the record existed resume unchecked

    def __init__(self, record: dict):
        self.record = record
        self.keeps_data_position = True

    def state_dict(self) -> dict:
        # One JSON string: a checkpoint loads only the keys it holds, so fields added later never fail a load.
        return {"json": json.dumps(self.record, sort_keys=True)}

    def load_state_dict(self, state: dict) -> None:
        """Compares the saved record with this run's.

        Raises:
            ResumeRefusedError: the text tokenizer or the latents' image tokenizer changed (the message names the
                key, the checkpoint's value and this run's).
        """
        saved = json.loads(state["json"])
        self._refuse_meaningless_weights(saved)
        changes = []
        for field, key in POSITION_FIELDS.items():
            if field in saved and field in self.record and saved[field] != self.record[field]:
                changes.append(f"{key} ({field}: {saved[field]} -> {self.record[field]})")
        if not changes and saved.get("samples", self.record["samples"]) != self.record["samples"]:
            changes.append(f"the data read ({saved['samples']:,} -> {self.record['samples']:,} samples)")
        self.keeps_data_position = not changes
        if changes:
            logger.warning(f"resumed on changed data: {'; '.join(changes)}. The weights carry over; the saved data "
                           "position does not: the data loader restarts the epoch in progress")  # fmt: skip

    def _refuse_meaningless_weights(self, saved: dict) -> None:
        changed = [f for f in TOKENIZER_FIELDS if f in saved and f in self.record and saved[f] != self.record[f]]
        if changed:
            raise ResumeRefusedError(
                f"model.tokenizer_path: the checkpoint was trained with the tokenizer {_describe_tokenizer(saved)}, "
                f"this run has {_describe_tokenizer(self.record)} (changed: {', '.join(changed)}): its token ids "
                "would stand for other text. Resume with the checkpoint's tokenizer, or train in a new "
                "job.dump_folder"
            )
        old, new = saved.get("latent_tokenizer"), self.record.get("latent_tokenizer")
        if old is not None and new is not None and old != new:
            raise ResumeRefusedError(
                f"training.dataset_path: the checkpoint was trained on latents of the image tokenizer {old}, this "
                f"run's latents are {new}'s: the weights would denoise another latent space. Resume on latents of "
                f"{old}, or train in a new job.dump_folder"
            )
