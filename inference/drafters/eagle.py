"""`EagleDrafter`: fills a static tree with an `EagleHead` or `Eagle3Head`, which keeps its own KV cache over the
context."""

import torch
from transformers import DynamicCache

from medusa_heads.errors import MedusaError
from medusa_heads.model import MedusaModel
from medusa_heads.tree import TreeBuffers

from ..draft import DecodeState, Draft
from .heads import depth_plan


class EagleDrafter:
    r"""
    Each step: append the newly committed positions (the backbone's features and the tokens after them) to the
    drafter's cache, then draft depth by depth. A node at depth d >= 1 becomes one entry at position P + d - 1
    (P: the root's position) reading its parent's predicted feature and its own token, attending to the
    context and to the entries of its ancestors only; its output predicts its children. The speculative
    entries are dropped from the cache afterwards: the next step recomputes the accepted ones from the
    backbone's real features.

    A drafter that reads several of the backbone's layers (`feature_layers`, EAGLE-3) finds them in the decoding
    loop's hidden states: `MedusaModel` taps them on the backbone (`tap_features`) when it is built.
    """

    per_sequence = True  # its cache follows one sequence

    def __init__(self, model: MedusaModel, tree: TreeBuffers, max_depth: int | None = None):
        if not model.heads.drafts_over_context:
            raise MedusaError(f"EagleDrafter needs a drafter over the context (`head_type: eagle`), not "
                              f"`{model.heads.head_type}` heads.")
        # The drafter runs the same layer at every depth, so any depth works; a static tree deeper than the depths
        # it was trained for is a mistake, a grown one (`max_depth`) goes there only where it is confident.
        max_depth = model.config.num_heads if max_depth is None else max_depth
        if tree.max_depth > max_depth:
            raise MedusaError(f"The tree is {tree.max_depth} deep but the drafter was trained for "
                              f"{model.config.num_heads}: choose a shallower tree.")
        self.model = model
        self.tree = tree
        self.width = model.config.hidden_size * (1 + len(model.heads.feature_layers))  # of the backbone's features
        self.embed = model.backbone.get_input_embeddings()
        self.cache: DynamicCache | None = None
        self.committed = 0  # positions whose entries are in the cache

    def _commit(self, state: DecodeState) -> torch.Tensor:
        """Cache the entries of the newly committed positions -> the feature predicted for the root's position."""
        fresh = state.fresh_hidden
        if fresh is None:
            raise MedusaError("EagleDrafter needs the hidden states of newly committed positions (`fresh_hidden`).")
        fresh = fresh[..., : self.width]  # an EAGLE drafter on a backbone tapped for an EAGLE-3 one reads the first H
        if fresh.shape[-1] != self.width:
            raise MedusaError(f"EagleDrafter needs the backbone's features ({self.width} values a position), got "
                              f"{fresh.shape[-1]}: is the backbone tapped at {list(self.model.heads.feature_layers)}?")
        root_position = len(state.token_ids) - 1
        start = root_position - fresh.shape[0]
        if start == 0:  # a new sequence
            self.cache = DynamicCache()
        elif start != self.committed:
            raise MedusaError(f"EagleDrafter is out of step: it has {self.committed} positions, the state starts "
                              f"new ones at {start}.")
        device = fresh.device
        after = torch.tensor(state.token_ids[start + 1 :], device=device)  # the token after each fresh position
        positions = torch.arange(start, root_position, device=device)[None]
        out = self.model.heads.decode(fresh[None], self.embed(after)[None], positions, None, self.cache)
        self.committed = root_position
        return out[0, -1]

    def _draft_entries(self, features: torch.Tensor, tokens: torch.Tensor, above: torch.Tensor, drafted: int,
                       depth: int) -> torch.Tensor:
        """Append one entry per node of depth `depth` (its parent's predicted feature [N, H], its token [N]) to the
        cache after the `drafted` speculative ones; each sees the context, its ancestors' entries `above` [N, d - 1]
        and itself -> the outputs [N, H]."""
        n, device = tokens.numel(), tokens.device
        seen = torch.zeros(n, drafted + n, dtype=torch.bool, device=device)
        seen.scatter_(1, above, True)
        seen[:, drafted:] = torch.eye(n, dtype=torch.bool, device=device)
        mask = torch.cat([torch.ones(n, self.committed, dtype=torch.bool, device=device), seen], dim=1)
        positions = torch.full((1, n), self.committed + depth - 1, device=device)
        return self.model.heads.decode(features[None], self.embed(tokens)[None], positions, mask[None, None],
                                       self.cache)[0]

    @torch.no_grad()
    def fill(self, state: DecodeState, tree: TreeBuffers) -> torch.Tensor:
        """Tokens [T] for `tree`'s nodes (as `MedusaDrafter.fill`: others' branches get placeholders)."""
        device = tree.depth.device
        tokens = torch.zeros(tree.size, dtype=torch.long, device=device)
        tokens[0] = state.root
        predicted = torch.zeros(tree.size, self.model.heads.config.hidden_size, dtype=self.model.backbone.dtype,
                                device=device)
        predicted[0] = self._commit(state)
        entry = torch.full((tree.size,), -1, dtype=torch.long, device=device)  # node -> its speculative entry
        drafted = 0
        for depth, step in enumerate(depth_plan(tree.paths, self.tree.top_k, str(device))):
            parents = step.ancestors[:, -1]
            if depth > 0:
                n = parents.numel()
                above = entry[step.ancestors[:, 1:-1]]  # the entries of ancestors at depths 1..depth-1
                predicted[parents] = self._draft_entries(predicted[step.ancestors[:, -2]], tokens[parents], above,
                                                         drafted, depth)
                entry[parents] = drafted + torch.arange(n, device=device)
                drafted += n
            logits = self.model.heads.project(depth, predicted[parents], self.model.projection)
            top = self.model.heads.token_ids(logits.topk(step.k, dim=-1).indices)  # [N, k]
            tokens[step.children] = top[step.child_row, step.child_rank]
        if drafted:
            self.cache.crop(-drafted)
        return tokens

    def propose(self, state: DecodeState) -> Draft:
        return Draft(self.tree, self.fill(state, self.tree))

    # A tree grown depth by depth (`DynamicDrafter`): `begin`, then `topk` once per depth, then `end`.

    def begin(self, state: DecodeState) -> None:
        device = self.model.device
        self._feature = self._commit(state)[None]  # [N, H] the frontier's predicted features, the root's first
        self._above = torch.zeros(1, 0, dtype=torch.long, device=device)  # [N, d - 1] entries of the ancestors
        self._own = torch.zeros(1, dtype=torch.long, device=device)  # [N] each frontier node's entry (d >= 1)
        self._drafted = 0

    @torch.no_grad()
    def topk(self, frontier: torch.Tensor, parent: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`frontier` [N, d + 1]: the tokens from the root to each node of depth d, whose parent is node `parent`
        [N] of the previous call's frontier -> (the drafter's top-k guesses below each node [N, k], their
        log-probabilities [N, k]). Each node of depth d >= 1 becomes an entry of the drafter's cache, seeing the
        context, its ancestors' entries and itself, as in `fill`."""
        depth, n, device = frontier.shape[1] - 1, frontier.shape[0], frontier.device
        if depth:
            above = torch.cat([self._above[parent], self._own[parent, None]], dim=1) if depth > 1 else self._above[parent]
            self._feature = self._draft_entries(self._feature[parent], frontier[:, -1], above, self._drafted, depth)
            self._above, self._own = above, self._drafted + torch.arange(n, device=device)
            self._drafted += n
        logprobs = torch.log_softmax(self.model.heads.project(depth, self._feature, self.model.projection).float(), -1)
        top = logprobs.topk(k)
        return self.model.heads.token_ids(top.indices), top.values

    def end(self) -> None:
        if self._drafted:
            self.cache.crop(-self._drafted)
