"""The draft vocabulary: the tokens the backbone itself says most, which the heads are allowed to guess."""

import torch

from medusa_heads.errors import MedusaError
from medusa_heads.heads import DraftHeads

from .data import Example


def frequent_tokens(examples: list[Example], vocab_size: int, size: int | None = None,
                    coverage: float | None = None) -> tuple[torch.Tensor, float]:
    """The most frequent assistant tokens, most frequent first: `size` of them, or as few as cover `coverage`
    of all assistant tokens. -> (token ids [N], the share of assistant tokens they cover)."""
    if (size is None) == (coverage is None):
        raise MedusaError("Give exactly one of `draft_vocab_size` and `draft_vocab_coverage`.")
    targets = [t for e in examples for t, m in zip(e.input_ids, e.loss_mask) if m]
    counts = torch.bincount(torch.tensor(targets, dtype=torch.long), minlength=vocab_size).double()
    order = counts.argsort(descending=True, stable=True)
    cumulative = counts[order].cumsum(0) / counts.sum()
    if size is None:
        if not 0 < coverage <= 1:
            raise MedusaError(f"`draft_vocab_coverage` must be in (0, 1], got {coverage}.")
        size = int(torch.searchsorted(cumulative, torch.tensor(coverage, dtype=torch.double))) + 1
    size = min(size, vocab_size)
    return order[:size], float(cumulative[size - 1])


@torch.no_grad()
def repick_draft_vocab(heads: DraftHeads, token_ids: torch.Tensor, lm_head_weight: torch.Tensor) -> int:
    r"""
    Give trained `heads` the draft vocabulary `token_ids` [N] in place of their own; -> how many tokens are new.

    A token both vocabularies hold keeps its row in each projection the heads own. A new token's row is the
    backbone's (`lm_head_weight` [V, H]) times the least-squares linear map from the backbone's rows of the kept
    tokens to their trained rows: what training did to the rows it saw, applied to those it did not. (Copying the
    backbone's rows unmapped lowered the EAGLE-3 drafter's replayed accepted length; mapped, the new rows take
    nothing away before they are trained, docs/experiments.md.) Heads that share the backbone's LM head only
    change the ids they guess among.
    """
    vocab, device = lm_head_weight.shape[0], token_ids.device
    old = heads.draft_vocab if heads.draft_vocab is not None else torch.arange(vocab, device=device)
    where = torch.full((vocab,), -1, dtype=torch.long, device=device)
    where[old.to(device)] = torch.arange(old.numel(), device=device)
    where = where[token_ids]
    known = where >= 0
    kept, new = token_ids[known], token_ids[~known]
    for projection in heads.owned_projections():
        weight = projection.weight
        rows = torch.empty(token_ids.numel(), weight.shape[1], dtype=weight.dtype, device=weight.device)
        rows[known] = weight[where[known]]
        if new.numel():
            source = lm_head_weight[kept].to(weight.device, torch.float64)
            mapping = torch.linalg.lstsq(source, rows[known].double()).solution  # [H, H]
            rows[~known] = (lm_head_weight[new].to(weight.device, torch.float64) @ mapping).to(weight.dtype)
        projection.weight = torch.nn.Parameter(rows, requires_grad=weight.requires_grad)
        projection.out_features = token_ids.numel()
    if "draft_vocab" not in heads._buffers:
        del heads.draft_vocab  # heads over the whole vocabulary hold None
    heads.register_buffer("draft_vocab", token_ids.clone())
    heads.config.draft_vocab_size = token_ids.numel()
    return new.numel()
