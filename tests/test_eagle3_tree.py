"""The EAGLE-3 drafter on static trees as one function of tensors (`Eagle3TreeDrafter`): the drafts `EagleDrafter`
makes, step after step, eager and compiled (one graph per tree whatever the context's length, `fullgraph=True`),
and decoding through it is HF greedy with the steps `EagleDrafter` takes."""

import importlib
import os
import shutil

import pytest
import torch
from torch._dynamo.utils import counters

from medusa_heads import MedusaError, MedusaModel, load_backbone
from medusa_heads.compiled_llama import CompiledLlama
from medusa_heads.fast_llama import FAST_FORWARD
from medusa_heads.inference import (DecodeState, EagleDrafter, ExactAcceptance, GenerationStats, MedusaNgramDrafter,
                                    make_drafter)
from medusa_heads.inference.drafters.eagle3_tree import FRESH_ROWS, Eagle3TreeDrafter, TreeDraft
from medusa_heads.inference import captured_step, frozen_step
from medusa_heads.inference.generate import encode_prompt, warm_up
from medusa_heads.inference.static_step import StaticSteps, static_steps
from medusa_heads.tree import build_tree, load_tree

from oracle import decode, hf_greedy
from test_eagle3 import three_deep, tiny  # noqa: F401  (a fixture)
from test_static_step import replaying_on_the_cpu

generate_module = importlib.import_module("medusa_heads.inference.generate")  # the package exports a function so named

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
    """Each step one graph (`static_step.py`): drafting, verifying, accepting, compacting; compiled by `warm_up`,
    none while decoding."""
    model = compiled_twin(tiny, tmp_path)
    tree_file = three_deep("cpu-8", tmp_path)
    warm_up(model, make_drafter(model, "medusa+ngram", tree=tree_file, draft_length=4))
    for prompt in (encode_prompt(tokenizer, p) for p in chat_prompts[:2]):
        ours, theirs = GenerationStats(), GenerationStats()
        drafter = make_drafter(model, "medusa+ngram", tree=tree_file, draft_length=4)
        assert isinstance(drafter.heads, Eagle3TreeDrafter)
        graphs = counters["stats"]["unique_graphs"]
        tokens = decode(model, prompt, drafter, max_new_tokens=48, stats=ours)
        assert counters["stats"]["unique_graphs"] == graphs  # none compiled while decoding, whatever the context
        assert tokens == hf_greedy(model.backbone, prompt, 48)
        reference = MedusaNgramDrafter(EagleDrafter(model, drafter.heads.tree), ngram_length=4)
        decode(model, prompt, reference, max_new_tokens=48, stats=theirs)
        assert ours.accepted_lengths == theirs.accepted_lengths and ours.steps > 1
    steps = static_steps(model, drafter)
    assert steps is not None and not steps.failed and len(steps.graphs) == 2 and steps.eagle3 is not None


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


@needs_compiler
def test_a_frozen_package_of_the_whole_step_drafts_and_decodes_as_the_in_process_graph(tiny, tokenizer, chat_prompts,
                                                                                       tmp_path, monkeypatch):
    """AMX bf16 CPUs take frozen packages (`frozen_step.py`), the drafter's own cache an input of the package like
    the backbone's; forced here in fp32, where greedy output is exact."""
    monkeypatch.setenv("MEDUSA_HEADS_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(frozen_step, "applies", lambda model: True)
    model = compiled_twin(tiny, tmp_path)
    tree_file = three_deep("cpu-8", tmp_path)
    drafter = make_drafter(model, "medusa", tree=tree_file)
    warm_up(model, drafter)
    steps = static_steps(model, drafter)
    assert steps.frozen and len(steps.graphs) == 1 and len(list((tmp_path / "home" / "steps").glob("*.pt2"))) == 1
    for prompt in (encode_prompt(tokenizer, p) for p in chat_prompts[:2]):
        ours, theirs = GenerationStats(), GenerationStats()
        assert decode(model, prompt, make_drafter(model, "medusa", tree=tree_file), max_new_tokens=48,
                      stats=ours) == hf_greedy(model.backbone, prompt, 48)
        decode(model, prompt, EagleDrafter(model, drafter.tree), max_new_tokens=48, stats=theirs)
        assert ours.accepted_lengths == theirs.accepted_lengths and ours.steps > 1
    assert steps.frozen and len(steps.graphs) == 1  # the package stepped every context: no fallback


@pytest.mark.parametrize("captured", [False, True])
def test_whole_steps_draft_and_decode_as_the_host_driven_step(tiny, tokenizer, chat_prompts, tmp_path, monkeypatch,
                                                               captured):
    """The whole step's drafting (`Eagle3StaticStep`: the features, the tokens after them and their count carried
    from step to step) drafts what `EagleDrafter` drafts, step after step; run eagerly, and replayed from a graph
    as on a GPU (`captured_step.py`: the drafter's cache has one window for every step, and the next decode's
    drafter takes it over), by a stand-in here."""
    tiny.heads.save_pretrained(tmp_path / "heads")
    model = MedusaModel.from_pretrained(tmp_path / "heads", base_model=load_backbone(tiny.backbone.name_or_path))
    tree_file = three_deep("cpu-8", tmp_path)
    capture = replaying_on_the_cpu(captures := [])
    monkeypatch.setattr(captured_step, "capture", capture)
    steps = StaticSteps(model, getattr(model.backbone, FAST_FORWARD))
    steps.capture = captured
    ours, theirs = [], []  # the drafts of each step, before the n-gram branch is added
    draft, fill = TreeDraft.__call__, EagleDrafter.fill
    monkeypatch.setattr(TreeDraft, "__call__", lambda self, *args: recorded(ours, draft(self, *args), capture))
    monkeypatch.setattr(EagleDrafter, "fill", lambda self, *args: recorded(theirs, fill(self, *args), capture))
    if captured:  # each tree's graph captured beforehand, with another drafter
        with monkeypatch.context() as patch:
            patch.setattr(generate_module, "static_steps", lambda *args: steps)
            warm_up(model, make_drafter(model, "medusa+ngram", tree=tree_file, draft_length=4))
        assert len(captures) == 2
        ours.clear()
    for prompt in (encode_prompt(tokenizer, p) for p in chat_prompts[:2]):
        drafter = make_drafter(model, "medusa+ngram", tree=tree_file, draft_length=4)
        reference = MedusaNgramDrafter(EagleDrafter(model, drafter.heads.tree), ngram_length=4)
        expected = decode(model, prompt, reference, max_new_tokens=48)  # the host-driven step
        with monkeypatch.context() as patch:
            patch.setattr(generate_module, "static_steps", lambda *args: steps)
            assert decode(model, prompt, drafter, max_new_tokens=48) == expected == hf_greedy(model.backbone, prompt,
                                                                                              48)
    assert ours == theirs and len(ours) > 10
    # a graph per tree, replayed by both decodes: their caches, their drafters' too, were warm-up's
    assert len(captures) == (2 if captured else 0)


def test_whole_steps_sample_as_the_host_driven_step(tiny, tokenizer, chat_prompts, tmp_path, monkeypatch):
    """Exact sampling in the EAGLE-3 whole step, replayed from graphs a stand-in captures (each replay runs the eager
    step): a seed gives the tokens the host-driven step gives."""
    tiny.heads.save_pretrained(tmp_path / "heads")
    model = MedusaModel.from_pretrained(tmp_path / "heads", base_model=load_backbone(tiny.backbone.name_or_path))
    tree_file = three_deep("cpu-8", tmp_path)
    monkeypatch.setattr(captured_step, "capture", replaying_on_the_cpu(captures := []))
    steps = StaticSteps(model, getattr(model.backbone, FAST_FORWARD))
    steps.capture = True
    for seed, prompt in enumerate(encode_prompt(tokenizer, p) for p in chat_prompts[:2]):
        drafter = make_drafter(model, "medusa+ngram", tree=tree_file, draft_length=4)
        reference = MedusaNgramDrafter(EagleDrafter(model, drafter.heads.tree), ngram_length=4)
        expected = decode(model, prompt, reference, sampling(seed), max_new_tokens=48)
        assert expected != hf_greedy(model.backbone, prompt, 48)
        with monkeypatch.context() as patch:
            patch.setattr(generate_module, "static_steps", lambda *args: steps)
            assert decode(model, prompt, drafter, sampling(seed), max_new_tokens=48) == expected
    assert captures


def sampling(seed: int) -> ExactAcceptance:
    return ExactAcceptance(0.6, top_p=0.9, generator=torch.Generator().manual_seed(seed))


def recorded(drafts: list, tokens: torch.Tensor, capture) -> torch.Tensor:
    if not capture.active:
        drafts.append(tokens.tolist())
    return tokens
