"""`sdpa_tree_gqa`: tree steps read grouped key/value heads in place and give bit-identical results to
transformers' `sdpa`, which copies them (`repeat_kv`)."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from medusa_heads.attention import NAME, use_tree_gqa_attention


def tiny_gqa_model(dtype, attn_implementation="sdpa"):
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=6, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
                         attn_implementation=attn_implementation)
    return LlamaForCausalLM(config).to(dtype).eval()


def tree_mask(length: int) -> torch.Tensor:
    """A 4D boolean mask like a tree step's: causal with some ancestors dropped, every node sees itself."""
    generator = torch.Generator().manual_seed(1)
    mask = torch.ones(length, length).tril().bool() & (torch.rand(length, length, generator=generator) > 0.4)
    return (mask | torch.eye(length, dtype=torch.bool))[None, None]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tree_steps_give_what_sdpa_gives(dtype):
    model = tiny_gqa_model(dtype)
    ids = torch.randint(0, 64, (1, 12), generator=torch.Generator().manual_seed(2))
    positions = torch.tensor([[0, 1, 2, 3, 4, 4, 5, 5, 6, 6, 7, 8]])
    inputs = [dict(input_ids=ids, attention_mask=tree_mask(12), position_ids=positions),  # the new path
              dict(input_ids=ids),  # no mask: causal prefill, delegated
              dict(input_ids=ids[:, :1], attention_mask=tree_mask(1))]  # one token, delegated
    with torch.no_grad():
        stock = [model(**kwargs).logits for kwargs in inputs]
        assert use_tree_gqa_attention(model)
        assert model.config._attn_implementation == NAME
        switched = [model(**kwargs).logits for kwargs in inputs]
    for a, b in zip(stock, switched):
        assert torch.equal(a, b)


def test_other_attention_implementations_are_left_alone():
    model = tiny_gqa_model(torch.float32, attn_implementation="eager")
    assert not use_tree_gqa_attention(model)
    assert model.config._attn_implementation == "eager"
