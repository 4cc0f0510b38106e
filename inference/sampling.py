r"""
HF generate's sampling warpers (temperature, top-k, top-p) as functions of tensors, and drawing a token from a law
with one uniform number.

transformers' warpers hold their settings as Python numbers, which a compiled step would bake in: a graph for each
temperature a server is asked for. `warped_probs` takes the settings as a tensor and computes what those warpers
compute, in the order `generate(do_sample=True)` applies them (`tests/test_sampling.py` compares the two); which of
them apply is the graph's structure (top-k and top-p sort the vocabulary, temperature alone does not).
"""

import torch

from medusa_heads.errors import MedusaError


class Warper:
    r"""
    The distribution HF `generate(do_sample=True)` samples from: fp32 logits through temperature, top-k and top-p.

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
        self.filters = (top_k > 0, self.top_p < 1.0)  # which filters apply: top-k, top-p
        self._settings: dict[torch.device, torch.Tensor] = {}

    def settings(self, device: torch.device | str) -> torch.Tensor:
        """[3] (temperature, top_k, 1 - top_p) in fp32 on `device`: `warped_probs`' settings (1 - top_p is taken in
        double, as HF's top-p warper takes it)."""
        device = torch.device(device)
        if device not in self._settings:
            self._settings[device] = torch.tensor([self.temperature, self.top_k, 1 - self.top_p], device=device)
        return self._settings[device]

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [..., V] -> the sampling distribution [..., V] (fp32)."""
        return warped_probs(logits, self.settings(logits.device), *self.filters)


def warped_probs(logits: torch.Tensor, settings: torch.Tensor, top_k: bool = False, top_p: bool = False
                 ) -> torch.Tensor:
    """logits [..., V] -> the law HF generate samples from [..., V] (fp32), `settings` being `Warper.settings`;
    `top_k`, `top_p`: whether those filters apply."""
    scores = logits.float() / settings[0]
    if top_k:  # below the k-th largest score (ties with it stay)
        k = settings[1].long().clamp(max=scores.shape[-1])
        kth = scores.sort(dim=-1, descending=True).values.index_select(-1, (k - 1).reshape(1))
        scores = scores.masked_fill(scores < kth, -torch.inf)
    if top_p:  # the least likely tokens whose probabilities add up to at most 1 - top_p, all but the most likely
        ordered, order = torch.sort(scores, descending=False)
        remove = ordered.softmax(dim=-1).cumsum(dim=-1) <= settings[2]
        remove = remove & (torch.arange(remove.shape[-1], device=remove.device) < remove.shape[-1] - 1)
        scores = scores.masked_fill(remove.scatter(-1, order, remove), -torch.inf)
    return torch.softmax(scores, dim=-1)


def draw(weights: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """A token drawn from `weights` [V] (unnormalised, >= 0, not all 0) with `uniform` [1] in [0, 1) -> [1]: the
    first token whose cumulative weight passes uniform x the total (in double, so that rounding cannot favour a
    token); never a token of weight 0."""
    cumulative = weights.double().cumsum(dim=0)
    token = torch.searchsorted(cumulative, uniform.double() * cumulative[-1:], right=True)
    slots = torch.arange(weights.shape[0], device=weights.device)
    last = torch.where(weights > 0, slots, 0).max()  # uniform x total can round up to the total itself
    return torch.minimum(token, last)
