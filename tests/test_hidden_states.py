"""The hidden-state cache: shards on disk keyed by each conversation's tokens, whatever their order or split."""

import copy
import logging
import random
from contextlib import contextmanager
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, LlamaForCausalLM

from medusa_heads.training.data import Example
from medusa_heads.training.hidden_states import HiddenStateCache, compute_hidden


@pytest.fixture(scope="module")
def backbone():
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=1)).eval()


@pytest.fixture(scope="module")
def examples() -> list[Example]:
    rng = random.Random(0)
    out = []
    for _ in range(10):
        ids = [rng.randrange(64) for _ in range(rng.randrange(3, 12))]
        out.append(Example(input_ids=ids, loss_mask=[1] * len(ids)))
    out.append(out[2])  # a repeated conversation
    return out


@contextmanager
def counting_rows(backbone):
    """Counts the conversations the backbone is run on."""
    seen = [0]
    handle = backbone.get_decoder().embed_tokens.register_forward_hook(lambda m, args, out: seen.__setitem__(
        0, seen[0] + args[0].shape[0]))
    try:
        yield seen
    finally:
        handle.remove()


def assert_states_of(cache: HiddenStateCache, examples: list[Example], backbone) -> None:
    for state, e in zip(cache.states, examples, strict=True):
        ids = torch.tensor([e.input_ids])
        torch.testing.assert_close(state, compute_hidden(backbone, ids, torch.ones_like(ids))[0], rtol=1e-5, atol=1e-5)


def test_a_reordered_list_of_the_same_examples_reuses_the_cache(tmp_path, backbone, examples):
    first = HiddenStateCache.build(backbone, "tiny", examples, batch_size=4, folder=tmp_path)
    shuffled = examples[::-1]
    # No backbone to compute with: the states can only come from the file.
    again = HiddenStateCache.build(SimpleNamespace(dtype=backbone.dtype), "tiny", shuffled, folder=tmp_path)
    assert len(list(tmp_path.glob("*.safetensors"))) == 1
    assert_states_of(again, shuffled, backbone)
    torch.testing.assert_close(again.batch([0, 1]), first.batch([10, 9]))


def test_a_grown_data_set_computes_only_the_new_conversations(tmp_path, backbone, examples):
    HiddenStateCache.build(backbone, "tiny", examples[:6], batch_size=4, folder=tmp_path)
    with counting_rows(backbone) as rows:
        grown = HiddenStateCache.build(backbone, "tiny", examples, batch_size=4, folder=tmp_path)
    assert rows[0] == 4  # examples 6..9; the repeat of example 2 is cached
    assert len(list(tmp_path.glob("*.safetensors"))) == 2
    assert_states_of(grown, examples, backbone)
    # A subset of both shards needs no backbone.
    mixed = [examples[1], examples[8]]
    assert_states_of(HiddenStateCache.build(SimpleNamespace(dtype=backbone.dtype), "tiny", mixed, folder=tmp_path),
                     mixed, backbone)


def test_another_backbone_or_dtype_does_not_share_states(tmp_path, backbone, examples):
    HiddenStateCache.build(backbone, "tiny", examples, batch_size=4, folder=tmp_path)
    with counting_rows(backbone) as rows:
        HiddenStateCache.build(backbone, "tiny (+ layers [0])", examples, batch_size=4, folder=tmp_path)
    double = copy.deepcopy(backbone).double()
    with counting_rows(double) as double_rows:
        HiddenStateCache.build(double, "tiny", examples, batch_size=4, folder=tmp_path)
    assert double_rows[0] == 10
    assert rows[0] == 10


@pytest.mark.parametrize("damage", ["truncated", "no list of conversations"])
def test_a_corrupted_shard_is_computed_again(tmp_path, backbone, examples, caplog, damage):
    HiddenStateCache.build(backbone, "tiny", examples, batch_size=4, folder=tmp_path)
    (shard,) = tmp_path.glob("*.safetensors")
    if damage == "truncated":
        shard.write_bytes(shard.read_bytes()[:100])
    else:
        save_file(load_file(shard), shard)
    with caplog.at_level(logging.WARNING), counting_rows(backbone) as rows:
        cache = HiddenStateCache.build(backbone, "tiny", examples, batch_size=4, folder=tmp_path)
    assert "unreadable hidden-state shard" in caplog.text
    assert rows[0] == 10
    assert_states_of(cache, examples, backbone)
