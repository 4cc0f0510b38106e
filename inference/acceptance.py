"""Acceptance rules: given a drafted tree and the backbone's logits at every node, pick the path to keep.

A rule also chooses the token after the last accepted node (the bonus token, which becomes the next root).
`greedy` reproduces the backbone's greedy decoding exactly; `typical` is Medusa's faster, lossy rule.
"""

import math
from dataclasses import dataclass
from typing import Protocol

import torch

from medusa_heads.errors import MedusaError

from .drafters import Draft


@dataclass
class Accepted:
    nodes: torch.Tensor  # [n + 1] long, tree node ids from the root to the last accepted node
    bonus: int  # the token chosen after the last accepted node

    @property
    def depth(self) -> int:
        """Drafted tokens accepted (the root not counted)."""
        return self.nodes.numel() - 1


class Acceptance(Protocol):
    def first_token(self, logits: torch.Tensor) -> int: ...

    def accept(self, draft: Draft, logits: torch.Tensor) -> Accepted: ...


def _path_lengths(draft: Draft, ok: torch.Tensor) -> torch.Tensor:
    """ok: [T] bool, node i's token is acceptable given its parent -> [P] accepted length of each path."""
    tree = draft.tree
    ok_on_path = ok[tree.retrieve[:, 1:]] & tree.retrieve_valid[:, 1:]  # [P, D]
    return ok_on_path.int().cumprod(dim=1).sum(dim=1)


def _best(draft: Draft, lengths: torch.Tensor, row: int) -> torch.Tensor:
    return draft.tree.retrieve[row, : int(lengths[row]) + 1]


class GreedyAcceptance:
    """Accept a drafted token iff it is the backbone's argmax after its parent."""

    def first_token(self, logits: torch.Tensor) -> int:
        return int(logits.argmax())

    def accept(self, draft: Draft, logits: torch.Tensor) -> Accepted:
        pred = logits.argmax(dim=-1)  # [T]
        parent = draft.tree.parent.clamp(min=0)
        ok = draft.tokens == pred[parent]  # [T], the root's entry is unused
        lengths = _path_lengths(draft, ok)
        nodes = _best(draft, lengths, int(lengths.argmax()))
        return Accepted(nodes, int(pred[nodes[-1]]))


class TypicalAcceptance:
    r"""
    Medusa's typical acceptance: keep x if p(x) > min(epsilon, delta * exp(-H(p))), p the backbone's
    distribution at temperature T after the parent. Among the longest paths, the most likely wins; the bonus
    token is sampled at T. Lossy: faster than exact sampling, but not the backbone's distribution.

    Args:
        temperature: > 0; the bonus token and p use it.
        epsilon: the hard threshold (Medusa's `posterior_threshold`, 0.09).
        delta: the entropy-scaled threshold (Medusa's `posterior_alpha`, 0.3).
        generator: torch RNG for the bonus token, for reproducible runs.
    """

    def __init__(self, temperature: float = 0.7, epsilon: float = 0.09, delta: float = 0.3,
                 generator: torch.Generator | None = None):
        if temperature <= 0:
            raise MedusaError("Typical acceptance needs `temperature` > 0; use greedy acceptance for temperature 0.")
        if not 0 < epsilon <= 1 or delta <= 0:
            raise MedusaError(f"Typical acceptance needs 0 < epsilon <= 1 and delta > 0, got {epsilon} and {delta}.")
        self.temperature, self.epsilon, self.delta = temperature, epsilon, delta
        self.generator = generator

    def _probs(self, logits: torch.Tensor) -> torch.Tensor:
        return torch.softmax(logits.float() / self.temperature, dim=-1)

    def first_token(self, logits: torch.Tensor) -> int:
        return int(torch.multinomial(self._probs(logits), 1, generator=self.generator))

    def accept(self, draft: Draft, logits: torch.Tensor) -> Accepted:
        probs = self._probs(logits)  # [T, V]
        entropy = -(probs * torch.log(probs.clamp_min(1e-12))).sum(dim=-1)  # [T]
        threshold = torch.minimum(torch.full_like(entropy, self.epsilon), self.delta * torch.exp(-entropy))
        parent = draft.tree.parent.clamp(min=0)
        p_token = probs[parent, draft.tokens]  # [T]
        lengths = _path_lengths(draft, p_token > threshold[parent])
        # Tie-break the longest paths by the log-likelihood of their accepted prefix.
        tree = draft.tree
        depth_idx = torch.arange(tree.max_depth, device=lengths.device)
        on_prefix = depth_idx[None, :] < lengths[:, None]  # [P, D]
        logp = torch.log(p_token.clamp_min(1e-12))[tree.retrieve[:, 1:]]
        score = torch.where(on_prefix, logp, 0.0).sum(dim=1)
        score = torch.where(lengths == lengths.max(), score, -math.inf)
        nodes = _best(draft, lengths, int(score.argmax()))
        bonus = int(torch.multinomial(probs[nodes[-1]], 1, generator=self.generator))
        return Accepted(nodes, bonus)


def make_acceptance(name: str, temperature: float = 0.0, epsilon: float = 0.09, delta: float = 0.3,
                    seed: int | None = None, device: str | torch.device = "cpu") -> Acceptance:
    """`greedy` or `typical`, by name, as the CLI names them; `device` is where the logits will be."""
    if name == "greedy":
        return GreedyAcceptance()
    if name == "typical":
        generator = torch.Generator(device=device).manual_seed(seed) if seed is not None else None
        return TypicalAcceptance(temperature or 0.7, epsilon, delta, generator)
    raise MedusaError(f"Unknown acceptance `{name}`; use greedy or typical.")
