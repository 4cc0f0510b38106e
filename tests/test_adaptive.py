"""Dynamic trees and the adaptive budget: exact on the real SmolLM2 model in fp32, valid trees, the budget's
response to good and bad guesses, and the per-depth and per-rank statistics."""

import json
import math

import pytest
import torch

from medusa_heads import MedusaError
from medusa_heads.apps.bench import make_methods, markdown, parse_drafter_method, summarize
from medusa_heads.inference import (AdaptiveDrafter, DecodeState, DynamicDrafter, DynamicNgramDrafter,
                                    GenerationStats, MedusaDrafter, make_drafter)
from medusa_heads.inference.drafters.dynamic import interpolated_cost, relative_costs
from medusa_heads.inference.drafters.ngram import ngram_lookup
from medusa_heads.inference.generate import encode_prompt
from medusa_heads.tree import build_tree, load_tree, validate_tree

from test_cli import assert_clean_error, run_cli  # noqa: E402  (pytest puts tests/ on sys.path)
from oracle import assert_exact, decode  # noqa: E402

NEW_TOKENS = 64


def assert_consistent(stats: GenerationStats) -> None:
    counts = stats.accepted_length_counts
    assert sum(counts) == stats.steps == len(stats.accepted_lengths)
    reached = [stats.steps] + stats.depth_accepts  # steps whose path reached depth d
    for d, accepts in enumerate(stats.depth_accepts):
        assert accepts == sum(counts[d + 1:])
        assert sum(stats.rank_accepts[d]) == accepts
        # a step that reached depth d either went deeper, was rejected just below, or stopped at a leaf
        assert accepts + stats.first_rejections[d] <= reached[d]
    assert stats.steps_without_rejection >= 0
    assert sum(stats.accepted_lengths) == sum(n * c for n, c in enumerate(counts, 1))


def test_dynamic_drafter_is_exact(model, backbone, references):
    all_stats = assert_exact(model, backbone, references[:3], DynamicDrafter(model, budget=16), NEW_TOKENS)
    for stats in all_stats:
        assert_consistent(stats)
    assert max(s.mean_accepted_length for s in all_stats) > 1.2


def test_the_ngram_chain_joins_the_dynamic_tree_as_one_more_branch(model, tokenizer):
    ids = encode_prompt(tokenizer, "Say red blue green, then red blue green again.")[0].tolist()
    state = DecodeState(ids + ids[-3:-1], ids[-2], torch.randn(model.config.hidden_size))
    dynamic = DynamicDrafter(model, budget=8)
    grown = dynamic.propose(state)
    draft = DynamicNgramDrafter(dynamic, ngram_length=4).propose(state)
    validate_tree(list(draft.tree.paths))
    assert list(draft.tree.paths) == sorted(draft.tree.paths, key=lambda p: (len(p), p))  # canonical order
    by_path = dict(zip(((),) + draft.tree.paths, draft.tokens.tolist()))
    assert all(by_path[p] == t for p, t in zip(((),) + grown.tree.paths, grown.tokens.tolist()))
    follow = ngram_lookup(state.token_ids, 4)
    assert follow and [by_path[(dynamic.top_k,) + (0,) * d] for d in range(len(follow))] == follow
    assert draft.tree.size == grown.tree.size + len(follow) <= make_drafter(model, "dynamic+ngram", budget=8).tree.size


def test_dynamic_plus_ngram_is_exact(model, backbone, references):
    stats = assert_exact(model, backbone, references[:3], DynamicNgramDrafter(DynamicDrafter(model, 12)), NEW_TOKENS)
    assert max(s.mean_accepted_length for s in stats) > 1.2


def test_adaptive_drafter_is_exact(model, backbone, references):
    drafter = AdaptiveDrafter(model, max_budget=32)
    for stats in assert_exact(model, backbone, references[:3], drafter, NEW_TOKENS):
        assert_consistent(stats)
    assert len(drafter.budgets) > 0 and all(0 <= n <= 32 for n in drafter.budgets)


def test_static_tree_stats_are_consistent(model, backbone, references):
    drafter = MedusaDrafter(model, build_tree(load_tree("cpu-16")))
    for stats in assert_exact(model, backbone, references[:1], drafter, NEW_TOKENS):
        assert_consistent(stats)
        assert len(stats.rank_accepts[0]) <= 4  # cpu-16 drafts ranks 0-3 at depth 1


def brute_force_best(model, hidden, root, budget, top_k, depth):
    """Every node of the full top_k-ary tree with its path log-probability; the best `budget` by score."""
    nodes = {(): (0.0, [root])}
    frontier = [()]
    for _ in range(depth):
        tokens = torch.tensor([nodes[p][1] for p in frontier])
        guesses, logp = model.head_topk(hidden, tokens, top_k)
        nxt = []
        for row, p in enumerate(frontier):
            for r in range(top_k):
                nodes[p + (r,)] = (nodes[p][0] + float(logp[row, r]), nodes[p][1] + [int(guesses[row, r])])
                nxt.append(p + (r,))
        frontier = nxt
    ranked = sorted((p for p in nodes if p), key=lambda p: (-nodes[p][0], len(p)))
    return nodes, ranked[:budget]


@pytest.mark.parametrize("heads", ["medusa", "hydra"])
@pytest.mark.parametrize("budget", [0, 1, 5, 16])
def test_the_dynamic_tree_is_the_best_valid_tree_of_at_most_budget_nodes(medusa_model, random_hydra_model, heads,
                                                                         budget):
    model = random_hydra_model if heads == "hydra" else medusa_model
    top_k, depth = 3, 3
    drafter = DynamicDrafter(model, budget=budget, top_k=top_k, max_depth=depth)
    torch.manual_seed(budget)
    hidden = torch.randn(model.config.hidden_size)
    candidates = drafter.expand(DecodeState([1, 2, 7], 7, hidden), budget)
    draft, _ = drafter.select(candidates, budget)
    tree = draft.tree
    assert tree.size == budget + 1 <= drafter.tree.size and tree.max_depth <= drafter.tree.max_depth
    if budget:
        assert validate_tree(tree.paths, num_heads=depth, top_k=top_k) == tree.paths  # valid, canonical order
    nodes, best = brute_force_best(model, hidden, 7, budget, top_k, depth)
    assert set(tree.paths) == set(best)
    for node, path in enumerate(tree.paths, 1):
        assert draft.tokens[node] == nodes[path][1][-1]  # each node holds its parent's guess of its rank
    assert draft.tokens[0] == 7
    if budget and heads == "medusa":  # path-independent guesses: the rank-0 chain is the best path at each depth
        assert all((0,) * d in tree.paths for d in range(1, tree.max_depth + 1))
    for d in range(1, tree.max_depth + 1):  # the most likely path of every depth the tree reaches is in it
        assert max((p for p in nodes if len(p) == d), key=lambda p: nodes[p][0]) in tree.paths


def test_the_largest_tree_bounds_every_dynamic_tree(model):
    drafter = DynamicDrafter(model, budget=16)
    assert drafter.tree.size == 17 and drafter.tree.max_depth == model.config.num_heads
    assert DynamicDrafter(model, budget=2).tree.max_depth == 2 and DynamicDrafter(model, budget=0).tree.size == 1
    with pytest.raises(MedusaError, match="node budget"):
        DynamicDrafter(model, budget=-1)
    with pytest.raises(MedusaError, match="1 to 4 deep"):
        DynamicDrafter(model, budget=4, max_depth=5)


class ScriptedHeads:
    """Stands in for the model in the drafter: at every depth it guesses the reference's next token (`oracle`)
    or a wrong one (`wrong`) at rank 0 with probability 0.9, with wrong ranks 1..k-1 sharing the rest."""

    def __init__(self, model, prompt_len, reference, mode):
        self.config, self.device, self.backbone = model.config, model.device, model.backbone
        self.heads = model.heads  # Medusa heads: DynamicDrafter asks `head_topk` below
        self.prompt_len, self.reference, self.mode = prompt_len, reference, mode
        self.done = 0

    def head_topk(self, hidden, paths, k):
        d = paths.shape[1] - 1
        i = self.done + d
        truth = self.reference[i] if i < len(self.reference) else 0
        vocab = self.config.vocab_size
        first = truth if self.mode == "oracle" else (truth + 1) % vocab
        tokens = torch.tensor([first] + [(truth + 2 + r) % vocab for r in range(k - 1)])
        logp = torch.tensor([math.log(0.9)] + [math.log(0.1 / (k - 1))] * (k - 1))
        return tokens.expand(paths.shape[0], k), logp.expand(paths.shape[0], k)


class Positioned:
    """Tells the scripted heads how far decoding is before each proposal."""

    def __init__(self, drafter, heads):
        self.drafter, self.heads, self.tree = drafter, heads, drafter.tree

    def propose(self, state):
        self.heads.done = len(state.token_ids) - self.heads.prompt_len
        return self.drafter.propose(state)

    def observe(self, draft, accepted):
        self.drafter.observe(draft, accepted)


def test_the_budget_shrinks_to_the_root_on_wrong_guesses_and_grows_back_on_right_ones(model, backbone, references):
    ids, reference = references[0][0], references[0][1][:NEW_TOKENS]
    heads = ScriptedHeads(model, ids.shape[1], reference, "wrong")
    adaptive = AdaptiveDrafter(heads, max_budget=16, top_k=4, cost=lambda n: 1 + 0.05 * (n - 1), head_cost=0.0,
                               decay=0.8)
    drafter = Positioned(adaptive, heads)
    stats = GenerationStats()
    assert decode(model, ids, drafter, max_new_tokens=NEW_TOKENS, stats=stats) == reference
    assert adaptive.budgets[0] > 0  # trusts the heads at first
    assert adaptive.budgets[-10:] == [0] * 10  # the root alone: plain decoding
    assert stats.accepted_lengths[-10:] == [1] * 10

    heads.mode = "oracle"
    stats = GenerationStats()
    start = len(adaptive.budgets)
    assert decode(model, ids, drafter, max_new_tokens=NEW_TOKENS, stats=stats) == reference
    grown = adaptive.budgets[start:]
    assert grown[0] == 0 and max(grown) >= 4  # from the root back to a tree as deep as the heads
    assert stats.depth_accepts[-1] > 0 and stats.accepted_lengths.count(5) >= 5
    assert_consistent(stats)


def test_the_budget_follows_the_cost_of_a_step(model, tokenizer, chat_prompts):
    ids = encode_prompt(tokenizer, chat_prompts[1])
    cheap, dear = (AdaptiveDrafter(model, max_budget=16, cost=cost) for cost in ([1.0] * 17, lambda n: 3.0 * n - 2))
    for drafter in (cheap, dear):
        decode(model, ids, drafter, max_new_tokens=16)
    assert min(cheap.budgets) == 16  # free nodes: always the whole budget
    assert max(dear.budgets) == 0  # a node costs a token: nothing pays


def test_costs():
    cost = interpolated_cost({1: 10.0, 3: 14.0, 5: 14.0})
    assert [cost(n) for n in (1, 2, 3, 4, 5, 7)] == [10.0, 12.0, 14.0, 14.0, 14.0, 14.0]
    assert relative_costs([2.0, 3.0, 4.0], 2).tolist() == [1.0, 1.5]
    assert relative_costs(None, 17, torch.bfloat16)[15] == pytest.approx(43 / 36)  # 16 nodes
    with pytest.raises(MedusaError, match="up to 3 nodes"):
        relative_costs([1.0, 2.0, 3.0], 5)
    with pytest.raises(MedusaError, match="1 node"):
        interpolated_cost({2: 1.0})


def test_make_drafter_and_bench_methods(model):
    assert make_drafter(model, "dynamic", budget=8).tree.size == 9
    assert make_drafter(model, "adaptive").tree.size == 33
    assert make_drafter(model, "dynamic+ngram", budget=8, draft_length=3).tree.size == 12  # the chain beside
    assert list(make_methods(["dynamic:16", "adaptive", "adaptive:8"])) == ["hf", "dynamic:16", "adaptive", "adaptive:8"]
    assert parse_drafter_method("dynamic+ngram+store:24:8") == ("dynamic+ngram+store", {"budget": 24, "draft_length": 8},
                                                                 None)
    assert parse_drafter_method("dynamic+ngram+store:32::3") == ("dynamic+ngram+store", {"budget": 32, "depth": 3},
                                                                  None)
    assert make_drafter(model, "dynamic", budget=8, depth=2).tree.max_depth == 2
    assert make_drafter(model, "adaptive", budget=8, depth=1).tree.max_depth == 1
    heads = model.config.num_heads
    assert make_drafter(model, "dynamic+ngram", budget=8, draft_length=1, depth=2).tree.max_depth == 2
    with pytest.raises(MedusaError, match=f"1 to {heads} deep"):  # Medusa heads have one depth each
        make_drafter(model, "dynamic", budget=8, depth=heads + 1)
    with pytest.raises(MedusaError, match="does not apply to the medusa drafter"):
        make_drafter(model, "medusa", depth=2)
    with pytest.raises(MedusaError, match="positive integer"):
        make_methods(["dynamic:x"])


def test_bench_reports_acceptance_by_depth_and_rank():
    rows = []
    for prompt in "ab":  # steps of 1, 2 and 3 tokens; the 3-token one ended at a leaf
        rows.append({"prompt": prompt, "category": "x", "method": "hf", "tokens_per_second": 10.0,
                     "identical_to_hf": True, "identical_to_fp32": None, "accepted_lengths": None})
        rows.append({"prompt": prompt, "category": "x", "method": "dynamic:16", "tokens_per_second": 12.0,
                     "identical_to_hf": True, "identical_to_fp32": None, "accepted_lengths": [1, 2, 3],
                     "depth_accepts": [2, 1], "rank_accepts": [[1, 1], [1]], "first_rejections": [1, 1]})
    s = summarize(rows)["dynamic:16"]
    assert s["depth_acceptance"] == [4 / 6, 2 / 4] and s["first_rejections"] == [2, 2]
    assert s["steps_without_rejection"] == 2 and s["rank_acceptance"] == [[2 / 6, 2 / 6], [2 / 6]]
    table = markdown({"summary": summarize(rows), "max_new_tokens": 8, "repeats": 1,
                      "fingerprint": {"dtype": "float32", "device": "cpu", "cpu": "x", "threads": 2,
                                      "torch": "t", "transformers": "t"}})
    assert "| dynamic:16 | 0.67, 0.50 | 0.33, 0.33; 0.33 | 1: 0.33 0.33; 2: 0.33 |" in table


@pytest.mark.slow  # the real model in a subprocess
def test_cli_dynamic_and_adaptive():
    result = run_cli("generate", "--prompt", "Name three colors.", "--max-new-tokens", "12", "--json",
                     "--drafter", "dynamic", "--budget", "8")
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert out["new_tokens"] == 12 and out["tree_nodes"] == 9
    assert sum(out["accepted_length_counts"]) == out["steps"] and len(out["depth_acceptance"]) == 4
    assert {"rank_acceptance", "first_rejections", "steps_without_rejection"} <= set(out)
    result = run_cli("generate", "--prompt", "Name three colors.", "--max-new-tokens", "12", "--drafter",
                     "adaptive", "--stats")
    assert result.returncode == 0, result.stderr
    assert "acceptance by depth" in result.stderr and "first rejection by depth" in result.stderr
    assert_clean_error(run_cli("generate", "--prompt", "hi", "--drafter", "dynamic", "--budget", "-2"), "--budget")
    assert_clean_error(run_cli("generate", "--prompt", "hi", "--budget", "8"), "--budget")
