"""The draft vocabulary: the tokens the backbone itself says most, which the heads are allowed to guess."""

import torch

from medusa_heads.errors import MedusaError

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
