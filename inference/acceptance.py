"""Acceptance rules: given a drafted tree and the backbone's logits at every node, pick the path to keep.

A rule also chooses the token after the last accepted node (the bonus token, which becomes the next root).
`greedy` reproduces the backbone's greedy decoding exactly; `exact` samples exactly from the backbone's
distribution; `typical` is Medusa's faster, lossy rule.
"""

import math
from functools import lru_cache

import torch

from medusa_heads.errors import MedusaError
from medusa_heads.tree import TreeBuffers

from .draft import Accepted, Draft
from .sampling import Warper


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
        paths, lengths, bonus = self.accept_rows(draft.tree, draft.tokens[None], logits[None])
        return Accepted(paths[0, : int(lengths[0]) + 1], int(bonus[0]))

    @staticmethod
    def accept_rows(tree: TreeBuffers, tokens: torch.Tensor, logits: torch.Tensor, internal_only: bool = False
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rows of one tree shape at once, on the device: tokens [B, T], logits [B, T, V] -> (accepted paths
        [B, D + 1] (node ids, padded past each length), accepted lengths [B] (the root not counted), bonus [B]).

        `internal_only`: `logits` are [B, I, V], those of `tree.internal` alone (the nodes with children: all that
        accepting needs); where the accepted path ends at a leaf, its bonus is -1, for the caller to compute."""
        pred = logits.max(dim=-1).indices  # [B, T], the first maximum as argmax; 4x faster than argmax in bf16
        if internal_only:
            pred = pred.new_full(tokens.shape, -1).index_copy_(1, tree.internal, pred)
        ok = tokens == pred[:, tree.parent.clamp(min=0)]  # [B, T], the root's entry is unused
        ok_on_path = ok[:, tree.retrieve[:, 1:]] & tree.retrieve_valid[:, 1:]  # [B, P, D]
        lengths = ok_on_path.int().cumprod(dim=2).sum(dim=2)  # [B, P]
        best = lengths.argmax(dim=1)  # [B], the first longest path
        paths = tree.retrieve[best]  # [B, D + 1]
        accepted = lengths.gather(1, best[:, None])[:, 0]
        bonus = pred.gather(1, paths.gather(1, accepted[:, None]))[:, 0]
        return paths, accepted, bonus


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


@lru_cache(maxsize=64)
def _siblings(paths: tuple, device: str) -> tuple[list[list[int]], torch.Tensor]:
    """A tree's children of each node in tree order, and [T, S] the siblings before each node, padded with T."""
    index = {(): 0} | {p: i + 1 for i, p in enumerate(paths)}
    children: list[list[int]] = [[] for _ in index]
    for p in paths:
        children[index[p[:-1]]].append(index[p])
    width = max(len(c) for c in children) - 1
    earlier = [[len(index)] * width for _ in index]
    for kids in children:
        for i, node in enumerate(kids):
            earlier[node][:i] = kids[:i]
    return children, torch.tensor(earlier, dtype=torch.long, device=device)


class ExactAcceptance:
    r"""
    Lossless sampling: the tokens come out distributed exactly as ancestral sampling from the backbone with
    HF generate's warpers (`Warper`: temperature, top-k, top-p), however good or bad the draft.

    From the root, at each accepted node its children are tried in tree order (the heads' rank order): child c
    is accepted with probability q_res(c), q being the warped distribution after the node and q_res that
    distribution with the tokens of the siblings already rejected zeroed and renormalised. When every child is
    rejected, or the node is a leaf, the bonus token is drawn from what is left of q_res. Each token is then
    q-distributed. This is speculative sampling for drafts whose tokens are a fixed function of the context
    (the heads' top-k, n-gram copies), which is what every drafter here proposes. A child repeating an earlier
    sibling's token is skipped: that token was rejected, so its q_res is 0.

    Args:
        temperature, top_k, top_p: the warpers, as in HF `generate(do_sample=True)`.
        generator: torch RNG on the logits' device, for reproducible runs.
    """

    def __init__(self, temperature: float = 0.7, top_k: int = 0, top_p: float = 1.0,
                 generator: torch.Generator | None = None):
        self.warper = Warper(temperature, top_k, top_p)
        self.generator = generator

    def first_token(self, logits: torch.Tensor) -> int:
        return int(torch.multinomial(self.warper.probs(logits), 1, generator=self.generator))

    def siblings(self, draft: Draft) -> tuple[list[list[int]], torch.Tensor]:
        """(children of each node, [T, S] earlier siblings of each node) of the draft's tree."""
        return _siblings(draft.tree.paths, str(draft.tree.parent.device))

    def acceptance_probs(self, draft: Draft, probs: torch.Tensor) -> torch.Tensor:
        """[T] q_res of each node's token after its parent, given that its earlier siblings were rejected."""
        _, earlier = self.siblings(draft)
        vocab = probs.shape[1]
        rows = torch.nn.functional.pad(probs, (0, 1))[draft.tree.parent.clamp(min=0)]  # [T, V + 1]
        rejected = torch.cat([draft.tokens, draft.tokens.new_tensor([vocab])])[earlier]  # padding -> column V
        rows.scatter_(1, rejected, 0.0)
        # A node whose earlier siblings cover q's support gets 0 / 0 = NaN, never accepted; it is never tried
        # either: the sibling completing the cover had q_res = 1.
        return rows.gather(1, draft.tokens[:, None])[:, 0] / rows.sum(dim=1)

    def accept(self, draft: Draft, logits: torch.Tensor) -> Accepted:
        probs = self.warper.probs(logits)  # [T, V]
        children, _ = self.siblings(draft)
        coins = torch.rand(draft.tree.size, device=probs.device, generator=self.generator)
        accepted = (coins < self.acceptance_probs(draft, probs)).tolist()  # each node's coin, if it is tried
        nodes = [0]
        while (child := next((c for c in children[nodes[-1]] if accepted[c]), None)) is not None:
            nodes.append(child)
        bonus = int(torch.multinomial(self.residual(draft, probs, nodes[-1]), 1, generator=self.generator))
        return Accepted(torch.tensor(nodes, device=logits.device), bonus)

    def residual(self, draft: Draft, probs: torch.Tensor, node: int) -> torch.Tensor:
        """[V] q after `node` without its children's tokens (all rejected), unnormalised: the bonus token's law."""
        children, _ = self.siblings(draft)
        residual = probs[node].clone()
        residual[draft.tokens[children[node]]] = 0.0
        return residual
