r"""
Trees fitted to the heads and the hardware.

The model: `p[d][r]` is the probability that the rank-r guess of the head at depth d + 1 is accepted given
that its parent was (measured by `medusa_heads.inference.calibrate`), the same for every parent of that
depth. A node's path is then accepted with probability P(path) = the product of p along it, and since the
guesses of one node's children are distinct tokens, at most one node per depth is accepted: the accepted
length of a step (the bonus token included) is 1 + the number of accepted nodes, with expectation

    E(tree) = 1 + sum over the tree's nodes of P(path).

A step with a tree of n nodes (the root included) costs `cost(n)` times a 1-node step; the best tree is the
one that maximises E(n) / cost(n), the predicted speed-up over one token per step.
"""

import heapq
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from medusa_heads.errors import MedusaError

from .spec import Path_, validate_tree


def check_probabilities(p: Sequence[Sequence[float]]) -> None:
    """Raise MedusaError unless `p` is a non-empty [depth][rank] table of probabilities."""
    if not isinstance(p, (list, tuple)) or not p:
        raise MedusaError("Acceptance probabilities must be a non-empty list, one list of ranks per depth.")
    for d, row in enumerate(p):
        if not isinstance(row, (list, tuple)) or not row:
            raise MedusaError(f"Acceptance probabilities of depth {d + 1} must be a non-empty list.")
        for r, value in enumerate(row):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
                raise MedusaError(f"Acceptance probability of depth {d + 1}, rank {r} is {value!r}, not in [0, 1].")


def path_probability(path: Sequence[int], p: Sequence[Sequence[float]]) -> float:
    """P(every node on `path` is accepted) under the independence model; ranks beyond `p` count as 0."""
    prob = 1.0
    for d, r in enumerate(path):
        prob *= p[d][r] if d < len(p) and r < len(p[d]) else 0.0
    return prob


def expected_accepted_length(paths: Sequence[Sequence[int]], p: Sequence[Sequence[float]]) -> float:
    """E = 1 + sum of P(path) over the tree's nodes: tokens per step, the bonus token included."""
    return 1.0 + sum(path_probability(path, p) for path in paths)


def grow_tree(p: Sequence[Sequence[float]], max_nodes: int) -> list[Path_]:
    r"""
    The best trees for every budget at once: the first n - 1 paths returned form the tree of n nodes
    (the root included) with the largest expected accepted length, for every n <= `max_nodes`.

    Why greedy is optimal: E is 1 plus a sum of one value per node, and any prefix-closed set of paths is a
    valid tree, so no tree of n - 1 paths can beat the n - 1 paths of largest P. Because every p <= 1, a
    child's P is at most its parent's, so those paths are themselves prefix-closed (taking a parent before
    its children on ties): they are a tree. Expanding greedily, always taking the frontier path of largest P,
    lists the paths in exactly that order, since a path's parent, of P at least as large, was taken first.
    """
    check_probabilities(p)
    if max_nodes < 1:
        raise MedusaError(f"A tree needs at least 1 node (the root), got a budget of {max_nodes}.")
    # Heap entries (-P, depth, path): the most probable first, then the shallower, then the lower ranks.
    frontier = [(-p[0][r], 1, (r,)) for r in range(len(p[0]))]
    heapq.heapify(frontier)
    paths: list[Path_] = []
    while frontier and len(paths) < max_nodes - 1:
        neg_prob, depth, path = heapq.heappop(frontier)
        paths.append(path)
        if depth < len(p):
            for r, q in enumerate(p[depth]):
                heapq.heappush(frontier, (neg_prob * q, depth + 1, path + (r,)))
    return paths


def choose_budget(expected: Sequence[float], cost: Sequence[float], min_nodes: int = 1) -> int:
    """The n (1-based: `expected[n - 1]` is E(n)) maximising E(n) / cost(n), the smallest n on ties."""
    if len(expected) != len(cost) or not expected:
        raise MedusaError("Expected lengths and step costs must be given for the same budgets 1..N.")
    if min_nodes > len(expected):
        raise MedusaError(f"No budget of at least {min_nodes} nodes among the {len(expected)} given.")
    return max(range(min_nodes, len(expected) + 1), key=lambda n: (expected[n - 1] / cost[n - 1], -n))


@dataclass(frozen=True)
class FittedTree:
    paths: tuple[Path_, ...]  # canonical order
    expected: tuple[float, ...]  # E(n) for n = 1..N
    cost: tuple[float, ...]  # cost(n) relative to a 1-node step, n = 1..N

    @property
    def budget(self) -> int:
        """Nodes in the chosen tree, the root included."""
        return len(self.paths) + 1

    @property
    def expected_accepted_length(self) -> float:
        return self.expected[self.budget - 1]

    @property
    def predicted_speedup(self) -> float:
        """E(n) / cost(n): predicted tokens per unit of a 1-node step's time."""
        return self.expected_accepted_length / self.cost[self.budget - 1]


def fit_tree(p: Sequence[Sequence[float]], cost: Sequence[float], budget: int | None = None) -> FittedTree:
    r"""
    The tree maximising E(n) / cost(n) over budgets n = 2..len(cost), `cost[n - 1]` being the step time
    of n nodes relative to 1 node; or, given `budget`, the best tree of that many nodes. A 1-node "tree"
    (plain decoding) is not a tree file, so it is never chosen; a `predicted_speedup` below 1 says plain
    decoding would be faster.
    """
    if len(cost) < 2:
        raise MedusaError("Step costs are needed for at least 2 tree sizes (1 node and more).")
    if budget is not None and not 2 <= budget <= len(cost):
        raise MedusaError(f"A budget of {budget} nodes is outside 2..{len(cost)}, the sizes the costs cover.")
    grown = grow_tree(p, len(cost))
    cost = cost[: len(grown) + 1]  # `p` may allow fewer paths than the budget
    expected = [1.0]
    for path in grown:
        expected.append(expected[-1] + path_probability(path, p))
    budget = min(budget, len(cost)) if budget else choose_budget(expected, cost, min_nodes=2)
    return FittedTree(validate_tree(grown[: budget - 1]), tuple(expected), tuple(cost))


def write_tree(fitted: FittedTree, out: Path, calibration: dict, profile: dict, replayed: float | None = None) -> None:
    """A tree file for `--tree` (`paths`) with what it was fitted to and what it is predicted to do (`replayed`:
    tokens per step of tree decoding replayed on the calibration answers, when they were given)."""
    data = {
        "description": (f"Fitted by `medusa-heads tree optimize`: {fitted.budget} nodes, predicted "
                        f"{fitted.expected_accepted_length:.2f} tokens per step at "
                        f"{fitted.cost[fitted.budget - 1]:.2f}x "
                        f"the time of one token on {profile.get('device', 'the profiled device')} "
                        f"({profile.get('dtype', '?')})."),
        "paths": [list(path) for path in fitted.paths],
        "budget": fitted.budget,
        "expected_accepted_length": round(fitted.expected_accepted_length, 4),
        "predicted_speedup": round(fitted.predicted_speedup, 4),
        **({"replayed_accepted_length": round(replayed, 4)} if replayed is not None else {}),
        "by_budget": {"nodes": list(range(1, len(fitted.cost) + 1)),
                      "expected_accepted_length": [round(e, 4) for e in fitted.expected],
                      "relative_cost": [round(c, 4) for c in fitted.cost]},
        "profile": profile,
        "calibration": calibration,
    }
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(data, indent=1) + "\n")
    except OSError as err:
        raise MedusaError(f"Cannot write the tree to `{out}`: {err.strerror or err}.") from None
