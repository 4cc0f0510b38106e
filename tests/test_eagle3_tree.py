"""The EAGLE-3 drafter on static trees as one function of tensors (`Eagle3TreeDrafter`): the drafts `EagleDrafter`
makes, step after step, eager and compiled (one graph per tree whatever the context's length, `fullgraph=True`),
and decoding through it is HF greedy with the steps `EagleDrafter` takes."""

import os
import shutil

import pytest
import torch
from torch._dynamo.utils import counters

from medusa_heads import MedusaError, MedusaModel, load_backbone
from medusa_heads.compiled_llama import CompiledLlama
from medusa_heads.fast_llama import FAST_FORWARD
from medusa_heads.inference import DecodeState, EagleDrafter, GenerationStats, MedusaNgramDrafter, make_drafter
from medusa_heads.inference.drafters.eagle3_tree import FRESH_ROWS, Eagle3TreeDrafter
from medusa_heads.inference.generate import encode_prompt
from medusa_heads.tree import build_tree, load_tree

from oracle import decode, hf_greedy
from test_eagle3 import three_deep, tiny  # noqa: F401  (a fixture)

needs_compiler = pytest.mark.skipif(shutil.which(os.environ.get("CXX", "c++")) is None, reason="no C++ compiler")


def trees(folder) -> tuple:
    """A branching tree 3 deep, and it with an n-gram chain of 4 under the root (as `medusa+ngram` verifies it)."""
    tree = build_tree(load_tree(three_deep("cpu-16", folder)))
    return tree, build_tree(list(tree.paths) + [(tree.top_k,) + (0,) * d for d in range(4)])


def states(width: int, counts: list[int], seed: int = 0):
    """Decoding states of one sequence whose steps commit `counts` positions each (the first: the prompt), with
    random features and tokens."""
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(3, 300, (sum(counts) + 1,), generator=generator).tolist()
    features = torch.randn(sum(counts), width, generator=generator)
    done = 0
    for count in counts:
        done += count
        yield DecodeState(tokens[: done + 1], tokens[done], features[done - 1], features[done - count : done])


def compiled_twin(model: MedusaModel, folder) -> MedusaModel:
    """`model`'s heads on a fresh copy of its backbone, loaded as the CLI loads them (frozen, packed, tapped) with
    the decoding step compiled."""
    model.heads.save_pretrained(folder / "heads")
    backbone = load_backbone(model.backbone.name_or_path).requires_grad_(False)
    twin = MedusaModel.from_pretrained(folder / "heads", base_model=backbone, compile_step=True)
    assert isinstance(getattr(twin.backbone, FAST_FORWARD), CompiledLlama)
    return twin


def test_it_drafts_what_the_eagle_drafter_drafts(tiny, tmp_path):
    """Eager: prompts, steps of 1 to 9 positions (more than a compiled step takes), both trees in turn."""
    tree, union = trees(tmp_path)
    ours, theirs = Eagle3TreeDrafter(tiny, tree), EagleDrafter(tiny, tree)
    width = tiny.config.hidden_size * 3
    drafted = []
    for step, state in enumerate(states(width, [40, 1, 3, FRESH_ROWS + 1, 2, 4, FRESH_ROWS, 1])):
        filled = union if step % 2 else tree
        tokens = ours.fill(state, filled)
        assert torch.equal(tokens, theirs.fill(state, filled)), step
        drafted.append(tokens[1 : tree.size].tolist())
    assert len({tuple(d) for d in drafted}) == len(drafted)  # drafts that depend on the context


@needs_compiler
def test_compiled_drafting_is_one_graph_per_tree_for_every_context(tiny, tmp_path):
    model = compiled_twin(tiny, tmp_path)
    tree, union = trees(tmp_path)
    ours, theirs = Eagle3TreeDrafter(model, tree), EagleDrafter(model, tree)
    before = counters["stats"]["unique_graphs"]
    counts = [30] + [1 + i % FRESH_ROWS for i in range(60)]  # contexts from 30 to 300: many windows
    for step, state in enumerate(states(model.config.hidden_size * 3, counts, seed=1)):
        filled = union if step % 3 else tree
        assert torch.equal(ours.fill(state, filled), theirs.fill(state, filled)), step
    assert len(ours.drafts.graphs) == 2 and ours.drafts.compiled is not None  # no fallback to eager
    assert counters["stats"]["unique_graphs"] - before == 2


@needs_compiler
def test_decoding_through_compiled_drafting_is_hf_greedy_in_the_same_steps(tiny, tokenizer, chat_prompts, tmp_path):
    model = compiled_twin(tiny, tmp_path)
    tree_file = three_deep("cpu-8", tmp_path)
    for prompt in (encode_prompt(tokenizer, p) for p in chat_prompts[:2]):
        ours, theirs = GenerationStats(), GenerationStats()
        drafter = make_drafter(model, "medusa+ngram", tree=tree_file, draft_length=4)
        assert isinstance(drafter.heads, Eagle3TreeDrafter)
        assert decode(model, prompt, drafter, max_new_tokens=48, stats=ours) == hf_greedy(model.backbone, prompt, 48)
        reference = MedusaNgramDrafter(EagleDrafter(model, drafter.heads.tree), ngram_length=4)
        decode(model, prompt, reference, max_new_tokens=48, stats=theirs)
        assert ours.accepted_lengths == theirs.accepted_lengths and ours.steps > 1


@needs_compiler
def test_drafting_that_fails_to_compile_drafts_eagerly(tiny, tmp_path, monkeypatch, caplog):
    def failing(function):
        def call(*args):
            raise RuntimeError("inductor could not compile this\nsecond line")
        return call

    monkeypatch.setattr("medusa_heads.inference.drafters.eagle3_tree.compile_step", failing)
    model = compiled_twin(tiny, tmp_path)
    tree, _ = trees(tmp_path)
    ours, theirs = Eagle3TreeDrafter(model, tree), EagleDrafter(model, tree)
    for state in states(model.config.hidden_size * 3, [20, 2, 3]):
        assert torch.equal(ours.fill(state, tree), theirs.fill(state, tree))
    assert ours.drafts.compiled is None
    assert "drafting eagerly from now on: inductor could not compile this" in caplog.text


def test_states_it_cannot_draft_from_are_one_line_errors(tiny, tmp_path):
    tree, _ = trees(tmp_path)
    drafter = Eagle3TreeDrafter(tiny, tree)
    hidden = torch.zeros(3, tiny.config.hidden_size)  # the last hidden state alone: an untapped backbone
    with pytest.raises(MedusaError, match="backbone's features .96 values a position."):
        drafter.fill(DecodeState([1, 2, 3, 4], 4, hidden[-1], hidden), tree)
    first, _, third = states(tiny.config.hidden_size * 3, [10, 2, 3])
    drafter.fill(first, tree)
    with pytest.raises(MedusaError, match="out of step: it has 10 positions, the state starts new ones at 12"):
        drafter.fill(third, tree)  # a step skipped
    with pytest.raises(MedusaError, match="trained for 3"):
        Eagle3TreeDrafter(tiny, build_tree([(0,) * d for d in range(1, 5)]))
