"""Acceptance rules: given a drafted tree and the backbone's logits at every node, pick the path to keep.

A rule also chooses the token after the last accepted node (the bonus token, which becomes the next root).
`greedy` reproduces the backbone's greedy decoding exactly; `exact` samples exactly from the backbone's
distribution; `typical` is Medusa's faster, lossy rule.
"""

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Callable

import torch

from medusa_heads.errors import MedusaError
from medusa_heads.tree import TreeBuffers

from .draft import Accepted, Draft
from .sampling import Warper, draw, warped_probs


def _path_lengths(tree: TreeBuffers, ok: torch.Tensor) -> torch.Tensor:
    """ok: [T] bool, node i's token is acceptable given its parent -> [P] accepted length of each path."""
    ok_on_path = ok[tree.retrieve[:, 1:]] & tree.retrieve_valid[:, 1:]  # [P, D]
    return ok_on_path.int().cumprod(dim=1).sum(dim=1)


def _path(tree: TreeBuffers, lengths: torch.Tensor, row: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Path `row` (a 0-d tensor) -> (its node ids [D + 1], padded past its accepted length; that length [1])."""
    row = row.reshape(1)
    return tree.retrieve.index_select(0, row)[0], lengths.index_select(0, row)


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


@lru_cache(maxsize=64)
def sibling_table(paths: tuple, device: str) -> torch.Tensor:
    """[T, S] the siblings before each node of the tree of `paths`, in tree order, padded with T."""
    index = {(): 0} | {p: i + 1 for i, p in enumerate(paths)}
    children: list[list[int]] = [[] for _ in index]
    for p in paths:
        children[index[p[:-1]]].append(index[p])
    width = max(len(c) for c in children) - 1
    earlier = [[len(index)] * width for _ in index]
    for kids in children:
        for i, node in enumerate(kids):
            earlier[node][:i] = kids[:i]
    return torch.tensor(earlier, dtype=torch.long, device=device)


class RuleAcceptance:
    """An acceptance rule computed by a function of tensors, `rule`, from the draft, the logits and its
    `step_inputs` (its settings and the step's random numbers, drawn on the host from `generator`): what the whole step
    (`static_step.py`) runs inside its graph, so that a seed gives the same tokens on either path."""

    rule: "StepRule"
    generator: torch.Generator | None
    step_inputs: Callable[[int, torch.device | str], tuple[torch.Tensor, torch.Tensor]]

    def accept(self, draft: Draft, logits: torch.Tensor) -> Accepted:
        tree = draft.tree
        earlier = sibling_table(tree.paths, str(tree.parent.device))
        path, accepted, bonus = self.rule(tree, earlier, draft.tokens, logits,
                                          *self.step_inputs(tree.size, logits.device))
        return Accepted(path[: int(accepted) + 1], int(bonus))


@dataclass(frozen=True)
class TypicalRule:
    """`TypicalAcceptance` as a function of tensors: settings (temperature, epsilon, delta), draws [1] (the bonus
    token's); called as `ExactRule` is."""

    def __call__(self, tree: TreeBuffers, earlier: torch.Tensor, tokens: torch.Tensor, logits: torch.Tensor,
                 settings: torch.Tensor, draws: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        temperature, epsilon, delta = settings.unbind()
        probs = torch.softmax(logits.float() / temperature, dim=-1)  # [T, V]
        entropy = -(probs * torch.log(probs.clamp_min(1e-12))).sum(dim=-1)  # [T]
        threshold = torch.minimum(epsilon, delta * torch.exp(-entropy))
        parent = tree.parent.clamp(min=0)
        p_token = probs[parent, tokens]  # [T]
        lengths = _path_lengths(tree, p_token > threshold[parent])
        # Tie-break the longest paths by the log-likelihood of their accepted prefix.
        depths = torch.arange(tree.retrieve.shape[1] - 1, device=lengths.device)
        on_prefix = depths[None, :] < lengths[:, None]  # [P, D]
        logp = torch.log(p_token.clamp_min(1e-12))[tree.retrieve[:, 1:]]
        score = torch.where(on_prefix, logp, 0.0).sum(dim=1)
        score = torch.where(lengths == lengths.max(), score, -math.inf)
        path, accepted = _path(tree, lengths, score.argmax())
        return path, accepted, draw(probs.index_select(0, path.gather(0, accepted))[0], draws)

    def scratch_inputs(self, tree_size: int, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs of the shapes and dtypes `TypicalAcceptance.step_inputs` gives: what a graph is compiled with."""
        return torch.tensor([1.0, 0.09, 0.3], device=device), torch.zeros(1, device=device)


class TypicalAcceptance(RuleAcceptance):
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

    rule = TypicalRule()

    def __init__(self, temperature: float = 0.7, epsilon: float = 0.09, delta: float = 0.3,
                 generator: torch.Generator | None = None):
        if temperature <= 0:
            raise MedusaError("Typical acceptance needs `temperature` > 0; use greedy acceptance for temperature 0.")
        if not 0 < epsilon <= 1 or delta <= 0:
            raise MedusaError(f"Typical acceptance needs 0 < epsilon <= 1 and delta > 0, got {epsilon} and {delta}.")
        self.temperature, self.epsilon, self.delta = temperature, epsilon, delta
        self.generator = generator
        self._settings: dict[torch.device, torch.Tensor] = {}

    def first_token(self, logits: torch.Tensor) -> int:
        return int(torch.multinomial(torch.softmax(logits.float() / self.temperature, dim=-1), 1,
                                     generator=self.generator))

    def step_inputs(self, tree_size: int, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
        """(temperature, epsilon, delta; the bonus token's draw [1])."""
        device = torch.device(device)
        if device not in self._settings:
            self._settings[device] = torch.tensor([self.temperature, self.epsilon, self.delta], device=device)
        return self._settings[device], torch.rand(1, device=device, generator=self.generator)


@dataclass(frozen=True)
class ExactRule:
    r"""
    `ExactAcceptance` as a function of tensors: what its `accept` runs, and what the whole step (`static_step.py`)
    runs inside its graph. Its fields are a graph's structure (which warpers filter); the warpers' settings and the
    step's random numbers are inputs, drawn on the host.
    """

    top_k: bool = False
    top_p: bool = False

    def __call__(self, tree: TreeBuffers, earlier: torch.Tensor, tokens: torch.Tensor, logits: torch.Tensor,
                 settings: torch.Tensor, draws: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A draft's tokens [T] and the backbone's logits [T, V] at its nodes, `earlier` = `sibling_table` of its
        tree, the warpers' `settings` (`Warper.settings`), `draws` [T + 1] uniform in [0, 1) (node i's coin, then
        the bonus token's) -> (accepted path [D + 1] (node ids, padded), accepted length [1], bonus [1])."""
        probs = warped_probs(logits, settings, self.top_k, self.top_p)
        ok = draws[:-1] < self.acceptance_probs(tree, earlier, tokens, probs)  # each node's coin, if it is tried
        # the child taken is the first whose coin says yes: none of its earlier siblings' did
        taken = ok & ~torch.nn.functional.pad(ok, (0, 1))[earlier].any(dim=1)
        lengths = _path_lengths(tree, taken)
        path, accepted = _path(tree, lengths, lengths.argmax())  # down the taken children (paths share its prefix)
        bonus = draw(self.residual(tree, tokens, probs, path.gather(0, accepted)), draws[-1:])
        return path, accepted, bonus

    def acceptance_probs(self, tree: TreeBuffers, earlier: torch.Tensor, tokens: torch.Tensor,
                         probs: torch.Tensor) -> torch.Tensor:
        """[T] q_res of each node's token after its parent, given that its earlier siblings were rejected."""
        vocab = probs.shape[1]
        rows = torch.nn.functional.pad(probs, (0, 1))[tree.parent.clamp(min=0)]  # [T, V + 1]
        rejected = torch.nn.functional.pad(tokens, (0, 1), value=vocab)[earlier]  # padding -> column V
        rows = rows.scatter(1, rejected, 0.0)
        # A node whose earlier siblings cover q's support gets 0 / 0 = NaN, never accepted; it is never tried
        # either: the sibling completing the cover had q_res = 1.
        return rows.gather(1, tokens[:, None])[:, 0] / rows.sum(dim=1)

    def residual(self, tree: TreeBuffers, tokens: torch.Tensor, probs: torch.Tensor, node: torch.Tensor
                 ) -> torch.Tensor:
        """[V] q after `node` [1] without its children's tokens (all rejected), unnormalised: the bonus token's
        law."""
        vocab = probs.shape[1]
        children = torch.where(tree.parent == node, tokens, vocab)  # the others -> column V
        return torch.nn.functional.pad(probs.index_select(0, node)[0], (0, 1)).scatter(0, children, 0.0)[:vocab]

    def scratch_inputs(self, tree_size: int, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs of the shapes and dtypes `ExactAcceptance.step_inputs` gives: what a graph is compiled with."""
        return Warper(1.0, top_k=1).settings(device), torch.zeros(tree_size + 1, device=device)


StepRule = ExactRule | TypicalRule


class ExactAcceptance(RuleAcceptance):
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

    Each step draws T + 1 uniform numbers from `generator` (`step_inputs`), whether it steps on the host or as
    one graph: the same seed gives the same tokens either way.

    Args:
        temperature, top_k, top_p: the warpers, as in HF `generate(do_sample=True)`.
        generator: torch RNG on the logits' device, for reproducible runs.
    """

    def __init__(self, temperature: float = 0.7, top_k: int = 0, top_p: float = 1.0,
                 generator: torch.Generator | None = None):
        self.warper = Warper(temperature, top_k, top_p)
        self.rule = ExactRule(*self.warper.filters)
        self.generator = generator

    def first_token(self, logits: torch.Tensor) -> int:
        return int(torch.multinomial(self.warper.probs(logits), 1, generator=self.generator))

    def step_inputs(self, tree_size: int, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
        """(the warpers' settings, the step's draws [tree_size + 1]): what `ExactRule` takes besides the draft."""
        draws = torch.rand(tree_size + 1, device=device, generator=self.generator)
        return self.warper.settings(device), draws
