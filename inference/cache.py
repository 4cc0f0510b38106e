"""Rolling the KV cache back to the accepted path after a tree forward."""

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from medusa_heads.errors import MedusaError


def new_cache(backbone) -> DynamicCache:
    return DynamicCache(config=backbone.config)


def check_compactable(cache: DynamicCache) -> None:
    """Only full-attention layers can drop arbitrary positions; sliding windows and linear states cannot."""
    kinds = {type(layer).__name__ for layer in cache.layers if type(layer) is not DynamicLayer}
    if kinds:
        raise MedusaError(f"Tree decoding needs full-attention cache layers; this model uses {', '.join(sorted(kinds))}.")


def compact_cache(cache: DynamicCache, past_len: int, keep: torch.Tensor) -> None:
    """Keep the first `past_len` entries and, after them, the tree entries at node ids `keep` (ascending)."""
    n = keep.numel()
    tree_len = cache.get_seq_length() - past_len
    contiguous = bool((keep == torch.arange(n, device=keep.device)).all())
    if not contiguous:
        src = past_len + keep
        for layer in cache.layers:
            # keys, values: [B, H_kv, S, D]; the advanced index copies before the slice is written.
            layer.keys[:, :, past_len : past_len + n] = layer.keys[:, :, src]
            layer.values[:, :, past_len : past_len + n] = layer.values[:, :, src]
    cache.crop(-(tree_len - n))
