"""The Llama 3 family's training objective: one cross-entropy per sequence, so DP-SGD and loss logging need nothing
else. A causal LM's loss of a sequence is the mean over its tokens; a classifier's, the cross-entropy of its label."""

import torch
import torch.nn.functional as F
from torch import nn


class LanguageModelObjective:
    """Next-token prediction (num_labels 0) or sequence classification (num_labels > 0).

    With packed windows of equal length, the mean of the per-sequence losses is the mean over tokens, so the
    logged loss and `exp(loss)` (perplexity) mean what they do in TorchTitan.
    """

    def __init__(self, num_labels: int, seq_len: int):
        self.classification = num_labels > 0
        self.reports_perplexity = not self.classification
        self.tokens_per_sample = seq_len

    def losses(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor, step: int, micro: int) -> torch.Tensor:
        """x: (B, T) token ids; y: (B, T) next tokens, or (B,) labels. Returns (B,) float32 losses."""
        return self.output_losses(model(x), y)

    def output_losses(self, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """(B,) float32 losses from the logits (B, T, V) or (B, num_labels)."""
        if self.classification:
            return F.cross_entropy(logits.float(), y, reduction="none")
        per_token = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten(), reduction="none")  # (B T,)
        return per_token.view(y.shape).mean(1)

    def compile_loss(self) -> None:
        """torch.compile `output_losses`: the float32 cast of the logits fuses into the cross-entropy."""
        self.output_losses = torch.compile(self.output_losses)
