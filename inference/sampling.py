"""HF generate's sampling warpers (temperature, top-k, top-p), applied the way `generate(do_sample=True)` does."""

import torch
from transformers import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from medusa_heads.errors import MedusaError


class Warper:
    r"""
    The distribution HF `generate(do_sample=True)` samples from: fp32 logits through transformers' own
    temperature, top-k and top-p warpers.

    Args:
        temperature: > 0 (temperature 0 is greedy decoding: use greedy acceptance).
        top_k: keep the k most likely tokens; 0 keeps all.
        top_p: keep the smallest set of most likely tokens whose probability reaches top_p; 1 keeps all.
    """

    def __init__(self, temperature: float, top_k: int = 0, top_p: float = 1.0):
        if not temperature > 0:
            raise MedusaError(f"Sampling needs a temperature > 0, got {temperature}; use greedy acceptance for "
                              "temperature 0.")
        if not isinstance(top_k, int) or top_k < 0:
            raise MedusaError(f"`top_k` must be an integer >= 1, or 0 for no top-k filtering; got {top_k}.")
        if not 0 < top_p <= 1:
            raise MedusaError(f"`top_p` must be in (0, 1], got {top_p}.")
        self.temperature, self.top_k, self.top_p = float(temperature), top_k, float(top_p)
        # Those HF generate would use, in its order; it skips the ones that would change nothing.
        self.warpers: list = []
        if self.temperature != 1.0:
            self.warpers.append(TemperatureLogitsWarper(self.temperature))
        if top_k:
            self.warpers.append(TopKLogitsWarper(top_k))
        if self.top_p < 1.0:
            self.warpers.append(TopPLogitsWarper(self.top_p))

    def warp(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [..., V] -> warped fp32 scores [..., V], -inf where a token is filtered out."""
        scores = logits.float().reshape(-1, logits.shape[-1])
        no_ids = scores.new_zeros(scores.shape[0], 0, dtype=torch.long)  # these warpers do not look at the ids
        for warper in self.warpers:
            scores = warper(no_ids, scores)
        return scores.reshape(logits.shape)

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [..., V] -> the sampling distribution [..., V] (fp32)."""
        return torch.softmax(self.warp(logits), dim=-1)
