r"""
Trees grown each step from the heads' confidence (EAGLE-2 style), and a node budget chosen each step.

`DynamicDrafter` expands the tree depth by depth with `MedusaModel.head_topk` (Medusa and Hydra heads) or an
`EagleDrafter`'s cache (drafters over the context): a node's score is its path's
log-probability under the heads (the sum along the path), and the tree is the best `budget` nodes of the
top-k-ary tree as deep as the heads. A child never scores above its parent, so the best n nodes form a tree,
and the best n of the best N (n <= N) are the best n: one expansion serves every budget up to N.

`AdaptiveDrafter` picks the budget n each step that maximises predicted tokens per step over the cost of
verifying n + 1 nodes. The prediction is the sum of the kept nodes' path probabilities, with the heads'
probabilities at each depth scaled by how often they were right lately (see `AdaptiveDrafter.observe`).
"""

import bisect
import itertools
import math
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

import torch

from medusa_heads.errors import MedusaError
from medusa_heads.model import MedusaModel
from medusa_heads.tree import TreeBuffers, canonical_tree, validate_tree
from medusa_heads.tree.spec import Path_

from ..draft import Accepted, DecodeState, Draft
from .eagle import EagleDrafter

DEFAULT_TOP_K = 8

# One backbone forward over n tokens with a 300-token cache on this project's CPU (ms, 2 threads,
# ../shared/NOTES.md). A rough default: pass a measured profile for any other machine.
CPU_FORWARD_MS = {
    torch.float32: {1: 35, 2: 45, 8: 65, 16: 69, 32: 84, 64: 124},
    torch.bfloat16: {1: 36, 4: 40, 8: 41, 16: 43, 32: 48, 64: 59},
}


@dataclass
class Candidates:
    r"""
    One step's expansion. Nodes are stored depth by depth, node 0 the root; each depth holds at most the best
    `budget` nodes found so far (no node of the final best `budget` can hang below the others).
    """

    tokens: torch.Tensor  # [M] long, each node's token
    paths: list[Path_]  # [M] each node's path of per-parent ranks, () for the root
    logprob: torch.Tensor  # [M] float, the path's (calibrated) log-probability under the heads, 0 for the root
    order: list[int]  # the best budget + 1 node ids, best first, parents before children: the first n + 1 are
    # the best tree of n drafted nodes
    offsets: list[int]  # node id of the first node of each depth
    child_tokens: list[torch.Tensor]  # per depth d: [N_d, k] the heads' guesses below each node of depth d
    child_logprobs: list[torch.Tensor]  # per depth d: [N_d, k] their (uncalibrated) log-probabilities


def largest_tree(budget: int, top_k: int, max_depth: int) -> tuple[Path_, ...]:
    """A tree as big and as deep as any `budget`-node tree a dynamic drafter may grow: the rank-0 chain as
    deep as allowed, then nodes breadth first."""
    paths = [(0,) * d for d in range(1, min(budget, max_depth) + 1)]
    seen = {()} | set(paths)
    for d in range(1, max_depth + 1):
        for path in itertools.product(range(top_k), repeat=d):
            if len(paths) >= budget:
                return validate_tree(paths) if paths else ()
            if path not in seen and path[:-1] in seen:
                paths.append(path)
                seen.add(path)
    return validate_tree(paths) if paths else ()


class HeadGuesser:
    """Medusa and Hydra heads' guesses below a frontier (`MedusaModel.head_topk`), for `DynamicDrafter`; the
    drafters over the context (`EagleDrafter`) answer the same three calls with their own cache."""

    def __init__(self, model: MedusaModel):
        self.model = model

    def begin(self, state: DecodeState) -> None:
        self.hidden = state.hidden

    def topk(self, frontier: torch.Tensor, parent: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.model.head_topk(self.hidden, frontier, k)

    def end(self) -> None:
        self.hidden = None


class DynamicDrafter:
    r"""
    Each step, the `budget` nodes of highest path probability under the heads (EAGLE-2's dynamic tree).

    Args:
        budget: drafted nodes per step, the root not counted; 0 is plain decoding.
        top_k: children considered per node (its rank in the tree is its place among them).
        max_depth: by default the number of heads; with Medusa or Hydra heads at most that (one head a depth),
            with a drafter over the context (EAGLE, EAGLE-3) any depth up to the budget (it drafts autoregressively).
    """

    def __init__(self, model: MedusaModel, budget: int = 16, top_k: int = DEFAULT_TOP_K, max_depth: int | None = None):
        heads = model.config.num_heads
        max_depth = heads if max_depth is None else max_depth
        over_context = model.heads.drafts_over_context
        deepest = max(budget, heads) if over_context else heads
        if not 1 <= max_depth <= deepest:
            raise MedusaError(f"A dynamic tree can be 1 to {deepest} deep "
                              f"({'the budget' if over_context else 'the heads'}), not {max_depth}.")
        if top_k < 1:
            raise MedusaError(f"A dynamic tree needs top_k >= 1 children per node, got {top_k}.")
        room = sum(top_k ** d for d in range(1, max_depth + 1))
        if not 0 <= budget <= room:
            raise MedusaError(f"The node budget must be in 0..{room} for top_k {top_k} and depth {max_depth}, "
                              f"got {budget}.")
        self.model, self.budget, self.top_k = model, budget, top_k
        self.max_depth = min(max_depth, budget)
        self.tree = canonical_tree(largest_tree(budget, top_k, max_depth), model.device)
        self.guesser = EagleDrafter(model, self.tree, max_depth) if over_context else HeadGuesser(model)
        self.per_sequence = getattr(self.guesser, "per_sequence", False)  # a drafter over the context caches it

    @torch.no_grad()
    def expand(self, state: DecodeState, budget: int, log_calibration: Sequence[float] | None = None,
               worth_deeper: Callable[[torch.Tensor, float, int], bool] | None = None) -> Candidates:
        r"""
        The best `budget` nodes, and the heads' guesses below each node that was expanded.

        Args:
            log_calibration: per depth d, added to the heads' log-probabilities at depth d + 1 (capped at 0)
                before nodes are ranked.
            worth_deeper: asked before each head call after the first, with (the log-probabilities of the
                nodes found so far, the best of the deepest ones, the head calls made); False stops there.
        """
        device = self.model.device
        frontier = torch.tensor([[state.root]], device=device)  # [N, d + 1] tokens from the root to each node
        score = torch.zeros(1, device=device)  # [N] the frontier's path log-probabilities
        level: list[Path_] = [()]
        tokens, logprobs, paths = [frontier[:, 0]], [score], [()]
        offsets, child_tokens, child_logprobs = [0], [], []
        found = score[:0]  # the kept nodes' scores, the root excluded
        parent = torch.zeros(1, dtype=torch.long, device=device)
        self.guesser.begin(state)
        for d in range(min(budget, self.max_depth)):
            if d and worth_deeper is not None and not worth_deeper(torch.cat(logprobs), float(score[0]), d):
                break
            guesses, logp = self.guesser.topk(frontier, parent, self.top_k)  # [N, k]
            child_tokens.append(guesses)
            child_logprobs.append(logp)
            if log_calibration is not None:
                logp = (logp + log_calibration[d]).clamp(max=0.0)
            child = (score[:, None] + logp).flatten()
            # Only children among the best `budget` nodes found so far can be in the tree or lead to nodes that
            # are: any later node scores at most its ancestors. Stable: on ties the shallower node ranks first.
            best = torch.sort(torch.cat([found, child]), descending=True, stable=True).indices[:budget]
            keep = best[best >= found.numel()] - found.numel()  # best first
            if keep.numel() == 0:
                break
            parent, rank = keep // self.top_k, keep % self.top_k
            new = guesses.flatten()[keep]
            frontier = torch.cat([frontier[parent], new[:, None]], dim=1)
            score = child[keep]
            found = torch.cat([found, score])
            level = [level[i] + (r,) for i, r in zip(parent.tolist(), rank.tolist())]
            offsets.append(offsets[-1] + len(tokens[-1]))
            tokens.append(new)
            logprobs.append(score)
            paths += level
        self.guesser.end()
        logprob = torch.cat(logprobs)
        order = torch.sort(logprob, descending=True, stable=True).indices[: budget + 1].tolist()
        return Candidates(torch.cat(tokens), paths, logprob, order, offsets, child_tokens, child_logprobs)

    def select(self, candidates: Candidates, n: int) -> tuple[Draft, list[int]]:
        """The draft of the best `n` nodes, and the candidate node id of each of its tree nodes."""
        nodes = sorted(candidates.order[: n + 1], key=lambda i: (len(candidates.paths[i]), candidates.paths[i]))
        tree = canonical_tree(tuple(candidates.paths[i] for i in nodes[1:]), self.model.device)
        return Draft(tree, candidates.tokens[nodes]), nodes

    def propose(self, state: DecodeState) -> Draft:
        return self.select(self.expand(state, self.budget), self.budget)[0]


def interpolated_cost(points: Mapping[int, float]) -> Callable[[int], float]:
    """cost(n) from measured {nodes: time}, 1 node included: linear between the points, extended along the
    last segment."""
    xs = sorted(points)
    if not xs or xs[0] != 1 or any(points[x] <= 0 for x in xs):
        raise MedusaError("A cost profile needs positive times for 1 node and more.")

    def cost(n: int) -> float:
        if len(xs) == 1:
            return points[1]
        i = bisect.bisect_left(xs, n, 1, len(xs) - 1)  # the segment xs[i - 1]..xs[i] holds n, or is the last
        x0, x1 = xs[i - 1], xs[i]
        return points[x0] + (points[x1] - points[x0]) * (n - x0) / (x1 - x0)

    return cost


def relative_costs(cost: Callable[[int], float] | Sequence[float] | None, nodes: int,
                   dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[nodes]: the cost of a step with 1..nodes tree nodes (the root included) over that of 1 node. `cost` is
    cost(n), or a list of cost(1), cost(2), ... (e.g. `LatencyProfile.relative_cost`), or None for the
    built-in CPU curve of `dtype`."""
    if cost is None:
        cost = interpolated_cost(CPU_FORWARD_MS.get(dtype, CPU_FORWARD_MS[torch.float32]))
    values = [float(cost(n)) for n in range(1, nodes + 1)] if callable(cost) else [float(c) for c in cost[:nodes]]
    if len(values) < nodes:
        raise MedusaError(f"The cost profile covers trees of up to {len(values)} nodes; {nodes} are needed.")
    if min(values) <= 0:
        raise MedusaError("Step costs must be positive.")
    return torch.tensor(values) / values[0]


class AdaptiveDrafter:
    r"""
    A dynamic tree whose budget is chosen each step: the n in 0..`max_budget` that maximises

        predicted tokens per step / (cost(n + 1) + head calls * head_cost),
        predicted = 1 + the sum of the n best nodes' P(path),

    down to plain decoding (the root alone) when no tree pays for itself. P(path) multiplies, along the path,
    the heads' probabilities scaled per depth by a running calibration: at each depth, an exponential moving
    average of how often the committed token was among the guesses below the accepted node, over one of the
    probability the heads gave those guesses (the decoding loop reports each step through `observe`). The
    heads are asked one depth at a time, and no deeper once even ideal deeper nodes could not pay for the call.

    Args:
        max_budget: the most drafted nodes per step, the root not counted.
        top_k: children considered per node.
        cost: cost(n) of a step with n nodes, or the list cost(1), cost(2), ... (e.g. from a latency profile,
            `LatencyProfile.relative_cost`); None: a rough curve measured on this project's CPU for the model's
            dtype.
        head_cost: one `head_topk` call (a vocabulary projection) relative to a 1-node step: about 0.1 for the
            embedded SmolLM2-135M on this project's CPU (bf16, 1 thread), whose LM head is a fifth of its weights.
        decay: weight of the past in the calibration's moving averages, per step.
        max_depth: as for `DynamicDrafter`.
    """

    per_sequence = True  # its calibration follows one sequence's acceptance

    def __init__(self, model: MedusaModel, max_budget: int = 32, top_k: int = DEFAULT_TOP_K,
                 cost: Callable[[int], float] | Sequence[float] | None = None, head_cost: float = 0.1,
                 decay: float = 0.95, max_depth: int | None = None):
        if not 0 <= decay < 1 or head_cost < 0:
            raise MedusaError(f"The calibration decay must be in [0, 1) and head_cost >= 0, got {decay}, {head_cost}.")
        self.dynamic = DynamicDrafter(model, max_budget, top_k, max_depth)
        self.tree: TreeBuffers = self.dynamic.tree
        self.costs = relative_costs(cost, max_budget + 1, model.backbone.dtype).to(model.device)
        self.head_cost, self.decay = head_cost, decay
        depths = self.dynamic.max_depth
        self.hits = [1.0] * depths  # one pseudo-observation: trust the heads until told otherwise
        self.mass = [1.0] * depths
        self.budgets: list[int] = []  # the budget chosen at each step
        self._last: tuple[Candidates, list[int]] | None = None

    @property
    def log_calibration(self) -> list[float]:
        return [math.log(h / m) for h, m in zip(self.hits, self.mass)]

    def _best(self, values: torch.Tensor, calls: int) -> tuple[int, float]:
        """values: P(path) best first, the root's 1 first -> (n, predicted tokens per unit of cost) at the best n."""
        ratio = values.cumsum(0) / (self.costs[: values.numel()] + calls * self.head_cost)
        n = int(ratio.argmax())
        return n, float(ratio[n])

    def _worth_deeper(self, logprob: torch.Tensor, deepest: float, calls: int) -> bool:
        """Could nodes below the deepest ones, each worth at most P = exp(`deepest`), beat the best step so far
        while paying for one more head call?"""
        size = self.dynamic.budget + 1
        values = logprob.exp().sort(descending=True).values[:size]
        cap = math.exp(deepest)
        ideal = torch.cat([values[values >= cap], values.new_full((size,), cap)])[:size]
        return self._best(ideal, calls + 1)[1] > self._best(values, calls)[1]

    def propose(self, state: DecodeState) -> Draft:
        candidates = self.dynamic.expand(state, self.dynamic.budget, self.log_calibration, self._worth_deeper)
        n, _ = self._best(candidates.logprob[candidates.order].exp(), len(candidates.child_tokens))
        draft, nodes = self.dynamic.select(candidates, n)
        self._last = candidates, nodes
        self.budgets.append(n)
        return draft

    def observe(self, draft: Draft, accepted: Accepted) -> None:
        r"""
        Update the calibration with the guesses below each accepted node (the root included).

        Below an accepted node the committed token is known (the next accepted one, or the bonus), whether or
        not its children were drafted, so even the root alone keeps depth 1 calibrated and the tree can grow
        back. Deeper nodes are seen only below accepted ones: only they have a known next token.
        """
        if self._last is None:
            return
        candidates, nodes = self._last
        committed = draft.tokens[accepted.nodes[1:]].tolist() + [accepted.bonus]
        for d, node in enumerate(accepted.nodes.tolist()[: len(candidates.child_tokens)]):
            row = nodes[node] - candidates.offsets[d]
            hit = float((candidates.child_tokens[d][row] == committed[d]).any())
            mass = float(candidates.child_logprobs[d][row].exp().sum())
            self.hits[d] = self.decay * self.hits[d] + hit
            self.mass[d] = self.decay * self.mass[d] + mass
