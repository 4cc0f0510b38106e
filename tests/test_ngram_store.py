"""The n-gram store (the backbone's frequent continuations in its answers) and the drafter that falls back on it."""

import json
import random
import shutil
from collections import Counter, defaultdict

import pytest
import torch

from medusa_heads import MedusaError
from medusa_heads.inference import MedusaNgramDrafter, heads_drafter
from medusa_heads.inference.registry import heads_store
from medusa_heads.ngram_store import STORE_FILE, NgramStore, find_store, max_order
from medusa_heads.tree import build_tree, load_tree

from conftest import MEDUSA_HEADS  # noqa: E402  (pytest puts tests/ on sys.path)
from oracle import assert_exact  # noqa: E402
from test_cli import assert_clean_error  # noqa: E402

NEW_TOKENS = 64


def counted_by_hand(sequences, max_n, min_count):
    """context tuple -> its most frequent next token (smallest id among ties), if seen min_count times."""
    follow = defaultdict(Counter)
    for seq in sequences:
        for i in range(len(seq)):
            for n in range(1, min(max_n, i) + 1):
                follow[tuple(seq[i - n:i])][seq[i]] += 1
    return {ctx: min(c, key=lambda t: (-c[t], t)) for ctx, c in follow.items() if max(c.values()) >= min_count}


def test_the_store_keeps_each_contexts_most_frequent_follower():
    rng = random.Random(0)
    sequences = [[rng.randrange(6) for _ in range(rng.randrange(1, 40))] for _ in range(30)]
    for min_count in (1, 3):
        store = NgramStore.build(sequences, vocab_size=6, max_n=3, min_count=min_count)
        expected = counted_by_hand(sequences, 3, min_count)
        assert len(store) == len(expected)
        for ctx, token in expected.items():
            n = len(ctx)
            keys, nexts = store.tables[n]
            key = sum(t * 6 ** (n - 1 - i) for i, t in enumerate(ctx))
            assert int(nexts[torch.searchsorted(keys, torch.tensor(key))]) == token, ctx


def test_continuation_follows_the_longest_known_context():
    store = NgramStore.build([[1, 2, 3, 4], [9, 2, 5, 2, 5]], vocab_size=10, max_n=2, min_count=1)
    assert store.next_token([1, 2]) == 3  # the 2-token context (1, 2) wins over (2,), whose top is 5
    assert store.next_token([7, 2]) == 5
    assert store.next_token([8]) is None
    assert store.continuation([1, 2], 4) == [3, 4]  # (3, 4) and (4,) then end: nothing follows 4
    assert store.continuation([9], 3) == [2, 5, 2]


def test_the_context_length_fits_in_one_key():
    assert max_order(49152, 8) == 4
    assert max_order(128256, 8) == 3
    assert max_order(49152, 2) == 2


def test_save_and_load_round_trip(tmp_path):
    rng = random.Random(1)
    store = NgramStore.build([[rng.randrange(50) for _ in range(200)]], vocab_size=50, max_n=4, min_count=1)
    assert find_store(str(tmp_path)) is None
    store.save(tmp_path)
    again = find_store(str(tmp_path))
    assert again.vocab_size == 50 and set(again.tables) == set(store.tables)
    for n, (keys, nexts) in store.tables.items():
        assert torch.equal(again.tables[n][0], keys) and torch.equal(again.tables[n][1], nexts)
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / STORE_FILE).write_bytes((tmp_path / STORE_FILE).read_bytes()[:100])
    with pytest.raises(MedusaError, match="Cannot read the n-gram store"):
        NgramStore.load(broken / STORE_FILE)


class CountingStore:
    def __init__(self, store):
        self.store, self.used = store, 0
        self.vocab_size = store.vocab_size

    def continuation(self, token_ids, length):
        chain = self.store.continuation(token_ids, length)
        self.used += bool(chain)
        return chain


def test_the_shipped_store_drafts_and_greedy_output_stays_exact(model, backbone, references):
    store = CountingStore(heads_store(model))
    drafter = MedusaNgramDrafter(heads_drafter(model, build_tree(load_tree("cpu-16"))), store=store)
    assert_exact(model, backbone, references[:2], drafter, NEW_TOKENS)
    assert store.used > 0  # the store's chains were verified, not only the context's


def test_a_store_of_the_answers_themselves_is_accepted(model, backbone, references):
    """Chains placed one position off would be rejected: a store built from the very continuation must raise
    the accepted length above the drafter without it."""
    refs = references[:1]
    oracle = NgramStore.build([ids[0].tolist() + ref for ids, ref in refs], model.config.vocab_size, max_n=4,
                              min_count=1)
    heads = heads_drafter(model, build_tree(load_tree("cpu-8")))
    plain = assert_exact(model, backbone, refs, MedusaNgramDrafter(heads), NEW_TOKENS)
    told = assert_exact(model, backbone, refs, MedusaNgramDrafter(heads, store=oracle), NEW_TOKENS)
    assert sum(len(s.accepted_lengths) for s in told) < sum(len(s.accepted_lengths) for s in plain)


def test_ngram_store_command_writes_into_the_heads_folder(cli, tmp_path):
    heads = tmp_path / "heads"
    shutil.copytree(MEDUSA_HEADS, heads)
    data = tmp_path / "answers.jsonl"
    rows = [{"messages": [{"role": "user", "content": f"Count to {n}."},
                          {"role": "assistant", "content": ", ".join(str(i) for i in range(1, n + 1))}]}
            for n in (5, 6, 7)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert cli("ngram-store", str(data), "--heads", str(heads), "--min-count", "2").returncode == 0
    store = find_store(str(heads))
    assert store.vocab_size == 49152 and len(store) > 0
    assert_clean_error(cli("ngram-store", str(data), "--heads", str(tmp_path / "none")), "not a folder")
    assert_clean_error(cli("ngram-store", str(tmp_path / "missing.jsonl"), "--heads", str(heads)), "missing.jsonl")


def test_heads_without_a_store_are_a_clean_error(cli):
    assert not (MEDUSA_HEADS / STORE_FILE).exists()
    assert_clean_error(cli("generate", "--prompt", "Hi.", "--heads", str(MEDUSA_HEADS), "--drafter",
                           "medusa+ngram+store", "--max-new-tokens", "2"), STORE_FILE, "ngram-store")
