r"""
SDPA for tree verification with grouped-query attention: the key/value heads are read in place, not copied.

A tree step queries several positions at once through a 4D mask. For that case transformers' `sdpa` attention
copies each key/value head to every query head of its group (`repeat_kv`) over the whole cache window, two copies
per layer and step; it uses SDPA's own grouped-query mode only where that kernel takes no mask (CUDA). On CPU the
kernel takes both, and gives bit-identical results: on SmolLM2-135M (3 key/value heads for 9 query heads) the
copies were about 8% of a 17-node bf16 verification forward on this project's CPU (docs/benchmarks.md).
Everything else (one query token, no mask, no groups, other devices) is transformers' `sdpa` unchanged.
"""

import torch
from transformers import AttentionInterface, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

NAME = "sdpa_tree_gqa"


def sdpa_tree_gqa_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                          attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                          **kwargs) -> tuple[torch.Tensor, None]:
    """An `AttentionInterface` function: transformers' `sdpa`, with grouped queries over a mask on CPU."""
    grouped = getattr(module, "num_key_value_groups", 1) > 1
    if not (grouped and attention_mask is not None and query.shape[2] > 1 and query.device.type == "cpu"
            and kwargs.get("position_bias") is None and kwargs.get("softcap") is None):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling, enable_gqa=True)
    return out.transpose(1, 2).contiguous(), None


def use_tree_gqa_attention(model: PreTrainedModel) -> bool:
    """Switch a model running transformers' `sdpa` to `sdpa_tree_gqa`; returns whether it switched."""
    if model.config._attn_implementation != "sdpa":
        return False
    AttentionInterface.register(NAME, sdpa_tree_gqa_forward)
    AttentionMaskInterface.register(NAME, sdpa_mask)
    model.set_attn_implementation(NAME)
    return True
