"""Tree decoding on the real SmolLM2 model in fp32: HF `generate` is the oracle."""

import importlib
import random

import pytest
import torch
from transformers import DynamicCache

from medusa_heads.inference import (DecodeState, Draft, GreedyAcceptance, MedusaDrafter, TypicalAcceptance,
                                    heads_drafter)
from medusa_heads.inference.cache import TreeCache
from medusa_heads.inference.generate import GenerationStats, encode_prompt, prefill, tree_decode_step, verify
from medusa_heads.tree import build_tree, load_tree

from oracle import REFERENCE_TOKENS, assert_exact, decode, explain_mismatch, hf_greedy  # noqa: E402


class OracleDrafter:
    """Knows the reference continuation and hides it on a random path of the tree, noise elsewhere."""

    def __init__(self, tree, prompt_len, reference, seed=0, vocab_size=49152):
        self.tree, self.prompt_len, self.reference = tree, prompt_len, reference
        self.rng = random.Random(seed)
        self.vocab_size = vocab_size

    def propose(self, state: DecodeState) -> Draft:
        done = len(state.token_ids) - self.prompt_len
        tokens = torch.tensor([self.rng.randrange(self.vocab_size) for _ in range(self.tree.size)])
        tokens[0] = state.root
        row = self.rng.randrange(self.tree.retrieve.shape[0])
        path = self.tree.retrieve[row][self.tree.retrieve_valid[row]][1:]
        truth = self.reference[done:done + len(path)]
        tokens[path[: len(truth)]] = torch.tensor(truth, dtype=torch.long)
        return Draft(self.tree, tokens)


def test_greedy_tree_decoding_equals_hf_generate(model, backbone, references):
    assert_exact(model, backbone, references[:6], heads_drafter(model, build_tree(load_tree("cpu-8"))))


def test_greedy_with_the_shipped_medusa_heads_equals_hf_generate(medusa_model, backbone, references):
    """The default heads are Hydra heads; the shipped Medusa-type heads, on a chain and a tree."""
    for tree in ("chain-4", "cpu-16"):
        assert_exact(medusa_model, backbone, references[:2], MedusaDrafter(medusa_model, build_tree(load_tree(tree))),
                     new_tokens=64)


def test_paths_accepted_down_to_a_leaf_get_the_backbone_s_next_token(model, backbone, references, monkeypatch):
    """Greedy verification computes no logits at the leaves (a tree of 4 leaves or more): where the accepted path
    ends at one, the token after it is computed then, and it is HF greedy's."""
    generate = importlib.import_module("medusa_heads.inference.generate")
    kept = []

    def spy(*args, **kwargs):
        logits, hidden = forward(*args, **kwargs)
        kept.append((logits.shape[1], hidden.shape[1]))
        return logits, hidden

    forward = generate.backbone_forward
    monkeypatch.setattr(generate, "backbone_forward", spy)
    tree = build_tree(load_tree("cpu-16"))
    ids, reference = references[0]
    stats = GenerationStats()
    ours = decode(model, ids, OracleDrafter(tree, ids.shape[1], reference, seed=3), stats=stats)
    assert ours == reference, explain_mismatch(backbone, ids, ours, reference)
    assert stats.steps_without_rejection > 3  # steps whose accepted path ended at a leaf
    assert kept[1:] and set(kept[1:]) == {(tree.internal.numel(), tree.size)}  # after the prefill
    assert tree.size - tree.internal.numel() >= generate.LEAVES_TO_SKIP


def test_greedy_with_the_63_node_tree(model, backbone, references):
    drafter = heads_drafter(model, build_tree(load_tree("medusa-63")))
    for ids, reference in references[:2]:
        ours = decode(model, ids, drafter, max_new_tokens=48)
        assert ours == reference[:48], explain_mismatch(backbone, ids, ours, reference)


@pytest.mark.parametrize("tree_name", ["cpu-16", "medusa-63"])
def test_long_accepted_paths_on_any_branch_stay_exact(model, backbone, references, tree_name):
    """An oracle drafter makes long paths accepted on random branches: exercises the non-contiguous cache gather."""
    tree = build_tree(load_tree(tree_name))
    for ids, reference in references[:2]:
        stats = GenerationStats()
        ours = decode(model, ids, OracleDrafter(tree, ids.shape[1], reference), stats=stats)
        assert ours == reference, explain_mismatch(backbone, ids, ours, reference)
        assert stats.mean_accepted_length > 3.0
        assert stats.new_tokens == len(reference) and sum(stats.accepted_lengths) + 1 >= len(reference)


def test_near_zero_temperature_typical_acceptance_is_greedy(model, backbone, references):
    tree = build_tree(load_tree("cpu-16"))
    ids, reference = references[0]
    acceptance = TypicalAcceptance(temperature=1e-4, generator=torch.Generator().manual_seed(0))
    ours = decode(model, ids, OracleDrafter(tree, ids.shape[1], reference), acceptance)
    assert ours == reference, explain_mismatch(backbone, ids, ours, reference)


def test_typical_acceptance_is_reproducible_with_a_seed(model, tokenizer, chat_prompts):
    drafter = heads_drafter(model, build_tree(load_tree("cpu-8")))
    ids = encode_prompt(tokenizer, chat_prompts[1])
    runs = [decode(model, ids, drafter, TypicalAcceptance(0.7, generator=torch.Generator().manual_seed(3)), 32)
            for _ in range(2)]
    assert runs[0] == runs[1] and len(runs[0]) == 32


def test_tree_logits_equal_sequential_decoding_per_path(model, tokenizer, chat_prompts):
    tree = build_tree(load_tree("cpu-16"))
    ids = encode_prompt(tokenizer, chat_prompts[2])
    cache = TreeCache(model.backbone, 1, ids.shape[1] + tree.size)
    prefill(model, ids.tolist(), cache)
    tokens = torch.randint(0, 49152, (tree.size,), generator=torch.Generator().manual_seed(0))
    tree_logits = verify(model, tree, tokens[None], cache)[0][0]
    for row in range(tree.retrieve.shape[0]):
        path = tree.retrieve[row][tree.retrieve_valid[row]]
        with torch.no_grad():
            seq_logits = model.backbone(torch.cat([ids[0], tokens[path]])[None]).logits[0, ids.shape[1]:]
        torch.testing.assert_close(tree_logits[path], seq_logits, atol=1e-4, rtol=1e-4)


def test_cache_after_a_step_equals_plain_decoding_of_the_accepted_tokens(model, tokenizer, backbone, chat_prompts):
    tree = build_tree(load_tree("cpu-16"))
    ids = encode_prompt(tokenizer, chat_prompts[3])
    reference = hf_greedy(backbone, ids, 8)
    cache = TreeCache(model.backbone, 1, ids.shape[1] + 2 * tree.size)
    logits, hidden = (x[0] for x in prefill(model, ids.tolist(), cache))
    root = int(logits.argmax())
    drafter = OracleDrafter(tree, ids.shape[1], reference, seed=5)
    # Pick a seed whose hidden path is not the first branch, so the gather is not a no-op.
    state = DecodeState(ids[0].tolist() + [root], root, hidden[-1], hidden)
    accepted, new_tokens, _ = tree_decode_step(model, drafter, GreedyAcceptance(), cache, state)
    assert accepted.depth >= 2 and accepted.nodes.tolist() != list(range(accepted.depth + 1))
    kept = torch.cat([ids[0], torch.tensor([root] + new_tokens[:-1])])[None]
    plain = DynamicCache(config=model.backbone.config)
    with torch.no_grad():
        model.backbone(kept, cache=plain)
    assert cache.lengths == [kept.shape[1]] == [plain.get_seq_length()]
    assert cache.valid[0].tolist() == [True] * kept.shape[1] + [False] * (cache.size - kept.shape[1])
    for ours, theirs in zip(cache.cache.layers, plain.layers):
        torch.testing.assert_close(ours.keys[:, :, : kept.shape[1]], theirs.keys, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(ours.values[:, :, : kept.shape[1]], theirs.values, atol=1e-4, rtol=1e-4)
    assert [root] + new_tokens == reference[: len(new_tokens) + 1]


def test_max_new_tokens_and_eos_are_never_overshot(model, tokenizer, references):
    tree = build_tree(load_tree("cpu-16"))
    ids, reference = references[4]
    for limit in (1, 2, 7):
        ours = decode(model, ids, OracleDrafter(tree, ids.shape[1], reference), max_new_tokens=limit)
        assert ours == reference[:limit]
    eos = model.backbone.generation_config.eos_token_id
    short = next(((ids, ref) for ids, ref in references if eos in ref), None)
    if short is not None:
        ids, reference = short
        ours = decode(model, ids, OracleDrafter(tree, ids.shape[1], reference), max_new_tokens=REFERENCE_TOKENS)
        assert ours == reference and ours[-1] == eos


def test_ngram_lookup_by_hand():
    from medusa_heads.inference import ngram_lookup

    seq = [5, 6, 7, 8, 9, 1, 2, 5, 6, 7]
    assert ngram_lookup(seq, 3, max_ngram=3, min_ngram=2) == [8, 9, 1]
    assert ngram_lookup([1, 2, 3, 4], 3) == []
    # the latest earlier match wins
    assert ngram_lookup([1, 2, 3, 1, 2, 4, 1, 2], 1, max_ngram=2) == [4]


@pytest.mark.parametrize("tree_name", ["cpu-8"])
def test_medusa_plus_ngram_drafter_stays_exact(model, backbone, references, tree_name):
    from medusa_heads.inference import MedusaNgramDrafter

    drafter = MedusaNgramDrafter(heads_drafter(model, build_tree(load_tree(tree_name))), ngram_length=6)
    stats_all = assert_exact(model, backbone, references[:3], drafter)
    # repetitive greedy text: the n-gram branch is accepted somewhere
    assert max(s.mean_accepted_length for s in stats_all) > 1.2


def test_hydra_tree_is_filled_path_by_path(random_hydra_model, tokenizer):
    tree = build_tree(load_tree("cpu-16"))
    drafter = MedusaDrafter(random_hydra_model, tree)
    ids = encode_prompt(tokenizer, "Name a colour.")
    hidden = prefill(random_hydra_model, ids.tolist(), TreeCache(random_hydra_model.backbone, 1, ids.shape[1]))[1][0]
    tokens = drafter.fill(DecodeState(ids[0].tolist() + [42], 42, hidden[-1]), tree)
    for node, path in enumerate(tree.paths, start=1):  # each node: its parent's guess of its rank, given the path
        ancestors = [tree.paths.index(path[:d]) + 1 for d in range(1, len(path))]
        path_tokens = torch.tensor([[42] + tokens[ancestors].tolist()])
        guesses, _ = random_hydra_model.head_topk(hidden[-1], path_tokens, path[-1] + 1)
        assert int(tokens[node]) == int(guesses[0, path[-1]])


def test_greedy_with_hydra_heads_equals_hf_generate(random_hydra_model, backbone, references):
    from medusa_heads.inference import make_drafter

    for drafter in (MedusaDrafter(random_hydra_model, build_tree(load_tree("cpu-16"))),
                    make_drafter(random_hydra_model, "medusa+ngram", tree="cpu-8")):
        assert_exact(random_hydra_model, backbone, references[:1], drafter)
