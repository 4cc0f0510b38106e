r"""
HF generate's sampling warpers (temperature, top-k, top-p) as functions of tensors, and drawing a token from a law
with one uniform number.

transformers' warpers hold their settings as Python numbers, which a compiled step would bake in: a graph for each
temperature a server is asked for. `warped_probs` takes the settings as a tensor and computes what those warpers
compute, in the order `generate(do_sample=True)` applies them (`tests/test_sampling.py` compares the two); which of
them apply is the graph's structure.

HF's top-k and top-p sort the vocabulary, which costs more than a whole decoding step over a tree's rows (27 ms for
15 rows of 49,152 on 2 cores of a Zen 5, against a 14 ms step). Here each finds its threshold by bisection over the
order of fp32 values instead: 32 passes over the row, each a comparison and a sum. Top-k keeps what HF keeps. Top-p
keeps the same number of tokens at each probability; where equally likely tokens straddle the edge of the nucleus,
HF keeps those its unstable sort happens to put last, and this keeps the lowest token ids; and a token whose mass
lies within fp32 rounding of the edge may go either way, as it may between HF's own kernels on two devices.
"""

from typing import Callable

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
        scores = scores.masked_fill(scores < _kth_largest(scores, settings[1].long()), -torch.inf)
    if top_p:
        scores = scores.masked_fill(_outside_nucleus(torch.softmax(scores, dim=-1), settings[2]), -torch.inf)
    return torch.softmax(scores, dim=-1)


BISECTIONS = 32  # halvings of the 2^32 orders of fp32 values: any threshold is found exactly


def _order(values: torch.Tensor) -> torch.Tensor:
    """fp32 values -> int64 keys in the same order: their bits, with a negative value's other bits flipped."""
    bits = values.view(torch.int32).long()
    return torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


def _value(keys: torch.Tensor) -> torch.Tensor:
    """The inverse of `_order`."""
    bits = torch.where(keys < 0, keys ^ 0x7FFFFFFF, keys)
    return bits.int().view(torch.float32)


def _bisect(low: torch.Tensor, high: torch.Tensor, holds: Callable[[torch.Tensor], torch.Tensor]
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys [..., 1] `low`, where the monotone `holds` is true, and `high`, where it is false -> the two adjacent keys
    between which it turns false."""
    for _ in range(BISECTIONS):
        middle = low + (high - low) // 2
        true = holds(middle)
        low, high = torch.where(true, middle, low), torch.where(true, high, middle)
    return low, high


def _kth_largest(scores: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """scores [..., V], k [] in [1, V] (larger: V) -> [..., 1] the k-th largest score of each row."""
    k = k.clamp(max=scores.shape[-1])
    low = _order(scores.amin(dim=-1, keepdim=True))  # at least k scores are >= low, fewer than k >= high
    high = _order(scores.amax(dim=-1, keepdim=True)) + 1
    low, _ = _bisect(low, high, lambda key: (scores >= _value(key)).sum(dim=-1, keepdim=True) >= k)
    return _value(low)


def _outside_nucleus(probs: torch.Tensor, cut: torch.Tensor) -> torch.Tensor:
    """probs [..., V], cut [] = 1 - top_p -> [..., V] the tokens top-p removes: those whose more likely tokens (and
    equally likely ones of lower id) hold at least the mass `need` = total - cut, all but the most likely."""
    need = probs.sum(dim=-1, keepdim=True) - cut
    # the edge: the smallest probability p such that the tokens more likely than p hold less than `need`
    # (bisected over the bits of probabilities, which are >= 0 and so ordered as integers)
    low = torch.zeros_like(need, dtype=torch.int64)  # the mass above: >= need at low, < need at high
    high = probs.amax(dim=-1, keepdim=True).view(torch.int32).long()
    _, high = _bisect(low, high, lambda key: torch.where(probs > _value(key), probs, 0.0).sum(dim=-1, keepdim=True)
                      >= need)
    edge = _value(high)
    above = torch.where(probs > edge, probs, 0.0).sum(dim=-1, keepdim=True)
    at_edge = probs == edge
    before = above + (at_edge.cumsum(dim=-1) - at_edge.long()) * edge  # more likely, then equal ones of lower id
    return (probs < edge) | (at_edge & (before >= need))


def draw(weights: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """A token drawn from `weights` [V] (unnormalised, >= 0, not all 0) with `uniform` [1] in [0, 1) -> [1]: the
    first token whose cumulative weight passes uniform x the total (in double, so that rounding cannot favour a
    token); never a token of weight 0."""
    cumulative = weights.double().cumsum(dim=0)
    token = torch.searchsorted(cumulative, uniform.double() * cumulative[-1:], right=True)
    slots = torch.arange(weights.shape[0], device=weights.device)
    last = torch.where(weights > 0, slots, 0).max()  # uniform x total can round up to the total itself
    return torch.minimum(token, last)
