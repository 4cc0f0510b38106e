"""The compiled decoding step (`compiled_llama.py`) computes what the eager fast forward computes, in one graph per
step size (`fullgraph=True`: a graph break fails), decodes HF's greedy tokens in fp32, and gives way to the eager
forward where it cannot be built."""

import logging
import os
import shutil

import pytest
import torch
from torch._dynamo.utils import counters

from medusa_heads import MedusaModel
from medusa_heads import compiled_llama
from medusa_heads.backbone import EMBEDDED_MODEL, backbone_forward
from medusa_heads.compiled_llama import CompiledLlama
from medusa_heads.fast_llama import FAST_FORWARD, FastLlama, FastLlamaLayer
from medusa_heads.inference import generate_ids, make_drafter
from medusa_heads.inference.cache import TreeCache
from medusa_heads.tree import build_tree, load_tree

from test_decoding import OracleDrafter  # noqa: E402  (pytest puts tests/ on sys.path)
from test_fast_llama import prefill_and_step, tiny  # noqa: E402


# The operator is built on first use with the machine's C++ compiler; without one the runtime decodes eagerly
pytestmark = pytest.mark.skipif(shutil.which(os.environ.get("CXX", "c++")) is None, reason="no C++ compiler")


def frozen_tiny(family: str):
    """A tiny random backbone of `family`, frozen, so that its linear layers are packed (`packing.pack_linears`)."""
    return tiny(family).requires_grad_(False)


def compiled_and_eager(family: str) -> tuple[MedusaModel, MedusaModel]:
    """One tiny random backbone of `family`, packed, loaded twice: through the compiled step and the eager one."""
    compiled = MedusaModel.from_pretrained(None, base_model=frozen_tiny(family), compile_step=True)
    eager = MedusaModel.from_pretrained(None, base_model=frozen_tiny(family))
    assert isinstance(getattr(compiled.backbone, FAST_FORWARD), CompiledLlama)
    assert isinstance(getattr(eager.backbone, FAST_FORWARD), FastLlama)
    assert all(getattr(layer, name).packed is not None for layer in getattr(eager.backbone, FAST_FORWARD).layers
               for name in FastLlamaLayer.PRODUCTS)  # the products go through the C++ operator
    return compiled, eager


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])  # plain, q/k/v biases, per-head q/k norms
def test_compiled_step_computes_what_the_eager_one_does(family):
    compiled, eager = compiled_and_eager(family)
    tree = build_tree(load_tree("cpu-8"))
    prompt = torch.randint(0, 300, (1, 70), generator=torch.Generator().manual_seed(1))  # a prompt: eager
    tokens = torch.randint(0, 300, (1, tree.size), generator=torch.Generator().manual_seed(2))
    ours, theirs = prefill_and_step(compiled, prompt, tree, tokens), prefill_and_step(eager, prompt, tree, tokens)
    for a, b in zip(ours, theirs):  # logits, hidden states and the keys written into the cache
        assert a.shape == b.shape
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    step = getattr(compiled.backbone, FAST_FORWARD)
    assert step.sizes == {(tree.size, ())} and not step.failed  # the tree step ran compiled, the prompt eagerly


def test_compiled_step_decodes_hf_greedy_without_recompiling():
    compiled, _ = compiled_and_eager("llama")
    tree = build_tree(load_tree("cpu-16"))
    graphs = counters["stats"]["unique_graphs"]
    for seed in range(2):  # two caches of other sizes, each crossing several attention windows
        prompt = torch.randint(0, 300, (1, 12 + 20 * seed), generator=torch.Generator().manual_seed(seed))
        reference = compiled.backbone.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                                               max_new_tokens=60, eos_token_id=None)[0, prompt.shape[1]:].tolist()
        drafter = OracleDrafter(tree, 12, reference, seed=seed, vocab_size=300)
        ours = [t for chunk in generate_ids(compiled, prompt, drafter, max_new_tokens=60) for t in chunk]
        assert ours == reference
    # one graph for the one step size, never one per window or cache size
    assert not getattr(compiled.backbone, FAST_FORWARD).failed
    assert counters["stats"]["unique_graphs"] - graphs == 1


def test_steps_of_two_sizes_take_one_graph_each():
    """Trees of two sizes in turn (the n-gram branch there one step, not the next) over one cache, as eager."""
    compiled, eager = compiled_and_eager("llama")
    trees = [build_tree(load_tree("chain-4")), build_tree(load_tree("cpu-8"))]  # the larger one second
    prompt = torch.randint(0, 300, (1, 9), generator=torch.Generator().manual_seed(3))
    caches = [TreeCache(model.backbone, 1, 64) for model in (compiled, eager)]
    graphs = counters["stats"]["unique_graphs"]
    with torch.no_grad():
        for model, cache in zip((compiled, eager), caches):
            positions, mask = cache.prefill_inputs([prompt.shape[1]], prompt.shape[1])
            backbone_forward(model.backbone, prompt, cache.cache, positions, mask, prompt=True)
        for step in range(6):
            tree = trees[step % 2]
            tokens = torch.randint(0, 300, (1, tree.size), generator=torch.Generator().manual_seed(step))
            outputs = []
            for model, cache in zip((compiled, eager), caches):
                positions, mask = cache.tree_inputs(tree)
                outputs.append(backbone_forward(model.backbone, tokens, cache.cache, positions, mask))
                cache.commit([[0, 1]])  # the root and its first child
            for a, b in zip(*outputs):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert not getattr(compiled.backbone, FAST_FORWARD).failed
    assert counters["stats"]["unique_graphs"] - graphs == 2


def test_without_its_operator_the_step_runs_eagerly(monkeypatch, caplog):
    monkeypatch.setattr(compiled_llama, "load_packed_linear", lambda: "no C++ compiler")
    with caplog.at_level(logging.WARNING):
        model = MedusaModel.from_pretrained(None, base_model=frozen_tiny("llama"), compile_step=True)
    assert type(getattr(model.backbone, FAST_FORWARD)) is FastLlama
    assert "Decoding without compiling: no C++ compiler" in caplog.text


@pytest.mark.slow
def test_compiled_step_on_the_embedded_model_is_hf_greedy(references):
    """The embedded model, packed and compiled, in fp32: HF's greedy tokens, plain and with the default tree."""
    model = MedusaModel.from_pretrained(base_model=EMBEDDED_MODEL, compile_step=True)
    assert isinstance(getattr(model.backbone, FAST_FORWARD), CompiledLlama)
    for ids, reference in references[:2]:
        for name, options in (("plain", {}), ("medusa+ngram", {"tree": "hydra-cpu-6"})):
            drafter = make_drafter(model, name, **options)
            ours = [t for chunk in generate_ids(model, ids, drafter, max_new_tokens=len(reference)) for t in chunk]
            assert ours == reference, name
