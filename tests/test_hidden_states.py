"""The hidden-state cache: keyed by the set of conversations, whatever their order."""

import random
from types import SimpleNamespace

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from medusa_heads.training.data import Example
from medusa_heads.training.hidden_states import HiddenStateCache, cache_key, compute_hidden


def test_a_reordered_list_of_the_same_examples_reuses_the_cache(tmp_path):
    torch.manual_seed(0)
    backbone = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                            num_attention_heads=2, num_key_value_heads=1)).eval()
    rng = random.Random(0)
    examples = []
    for _ in range(10):
        ids = [rng.randrange(64) for _ in range(rng.randrange(3, 12))]
        examples.append(Example(input_ids=ids, loss_mask=[1] * len(ids)))
    examples.append(examples[2])  # a repeated conversation
    first = HiddenStateCache.build(backbone, "tiny", examples, batch_size=4, folder=tmp_path)
    shuffled = examples[::-1]
    assert cache_key("tiny", shuffled, backbone.dtype) == cache_key("tiny", examples, backbone.dtype)
    assert cache_key("tiny", examples[:-2], backbone.dtype) != cache_key("tiny", examples, backbone.dtype)
    # No backbone to compute with: the states can only come from the file.
    again = HiddenStateCache.build(SimpleNamespace(dtype=backbone.dtype), "tiny", shuffled, folder=tmp_path)
    assert len(list(tmp_path.glob("*.safetensors"))) == 1
    for i, e in enumerate(shuffled):
        ids = torch.tensor([e.input_ids])
        alone = compute_hidden(backbone, ids, torch.ones_like(ids))[0]
        torch.testing.assert_close(again.states[i], alone, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(again.batch([0, 1]), first.batch([10, 9]))
