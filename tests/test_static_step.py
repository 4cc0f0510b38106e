"""The whole tree step as one compiled graph (`static_step.py`): Medusa and Hydra heads, with and without the n-gram
branch, decode HF's greedy tokens with the accepted lengths of the host-driven step (`decode_step`), in one graph
per tree (`fullgraph=True`: a graph break fails) for every prompt and cache size, compiled beforehand by
`warm_up`; a step that cannot compile runs the same function eagerly. Compiled ahead of time with the weights
frozen in (`frozen_step.py`), the same tokens, from a package on disk that a second model loads."""

import importlib
import itertools
import logging
import os
import shutil

import pytest
import torch
from torch._dynamo.utils import counters
from torch.utils._pytree import tree_leaves

from transformers import LlamaConfig, LlamaForCausalLM

from medusa_heads import MedusaModel
from medusa_heads.backbone import tap_features
from medusa_heads.fast_llama import FAST_FORWARD
from medusa_heads.inference import ExactAcceptance, GenerationStats, TypicalAcceptance, make_acceptance, make_drafter
from medusa_heads.inference import captured_step, frozen_step, static_step
from medusa_heads.inference.generate import warm_up
from medusa_heads.inference.static_step import StaticSteps, static_steps
from medusa_heads.model import untrained_heads

from oracle import decode, hf_greedy

pytestmark = pytest.mark.skipif(shutil.which(os.environ.get("CXX", "c++")) is None, reason="no C++ compiler")

NEW_TOKENS = 48
generate_module = importlib.import_module("medusa_heads.inference.generate")  # the package exports a function so named


def frozen_tiny() -> LlamaForCausalLM:
    """A tiny random Llama, frozen (so packed), whose greedy answers neither repeat one token nor look like noise
    to the heads below: their drafts are accepted 1 to 4 deep."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=True, initializer_range=0.15)
    backbone = LlamaForCausalLM(config).eval().requires_grad_(False)
    backbone.generation_config.eos_token_id = None
    return backbone


@pytest.fixture(scope="module", params=["medusa", "hydra"])
def heads_folder(request, tmp_path_factory):
    """Random heads of a type for `frozen_tiny()`: Medusa heads with projections of their own, Hydra heads
    sharing the LM head over half the vocabulary; the backbone's own prediction, blurred."""
    backbone = frozen_tiny()
    torch.manual_seed(1)
    vocab = backbone.config.vocab_size
    if request.param == "medusa":
        heads = untrained_heads(backbone, "tiny", num_heads=4, share_lm_head=False)
    else:
        heads = untrained_heads(backbone, "tiny", num_heads=4, head_type="hydra",
                                draft_vocab=torch.randperm(vocab)[: vocab // 2])
    for param in heads.parameters():
        param.data.add_(torch.randn_like(param), alpha=0.05)
    folder = tmp_path_factory.mktemp(request.param)
    heads.save_pretrained(folder)
    return folder


def prompts() -> list[torch.Tensor]:
    """Prompts of three lengths, each a random run said twice, so that prompt lookup finds matches."""
    generator = torch.Generator().manual_seed(4)
    runs = [torch.randint(3, 300, (n,), generator=generator) for n in (5, 17, 40)]
    return [torch.cat([run, run])[None] for run in runs]


def drafter_of(model: MedusaModel, name: str):
    """`name` (`medusa` or `medusa+ngram` over a tree 4 deep, the chain 3 long; or `plain`)."""
    if name == "plain":
        return make_drafter(model, name)
    return make_drafter(model, name, tree="cpu-8", **({"draft_length": 3} if "ngram" in name else {}))


def greedy(model: MedusaModel, name: str) -> tuple[list[list[int]], list[list[int]]]:
    """Each prompt's new tokens and accepted lengths, drafted by `drafter_of(model, name)`."""
    return sampled(model, name, None)


@pytest.mark.parametrize("name", ["medusa", "medusa+ngram", "plain"])
def test_whole_step_graphs_decode_hf_greedy_as_the_host_driven_step(heads_folder, name):
    compiled = MedusaModel.from_pretrained(heads_folder, base_model=frozen_tiny(), compile_step=True)
    eager = MedusaModel.from_pretrained(heads_folder, base_model=frozen_tiny())
    drafter = drafter_of(compiled, name)
    steps = static_steps(compiled, drafter)
    assert steps is not None and static_steps(eager, drafter_of(eager, name)) is None
    warm_up(compiled, drafter)
    assert steps.pending(drafter) == []
    graphs = counters["stats"]["unique_graphs"]
    ours, our_lengths = greedy(compiled, name)
    theirs, their_lengths = greedy(eager, name)
    # no graph compiled while decoding (warm_up made them all), none per prompt or cache size, and none failed
    assert counters["stats"]["unique_graphs"] == graphs and not steps.failed
    assert len(steps.graphs) == (2 if name == "medusa+ngram" else 1)
    assert ours == theirs == [hf_greedy(compiled.backbone, ids, NEW_TOKENS) for ids in prompts()]
    assert our_lengths == their_lengths
    if name == "plain":  # the root's step: one token each
        assert all(n == 1 for lengths in our_lengths for n in lengths)
    else:  # drafts were accepted, and some rejected
        assert any(n > 1 for lengths in our_lengths for n in lengths)
        assert any(n == 1 for lengths in our_lengths for n in lengths)


SAMPLING = {  # each rule from a generator
    "temperature": lambda generator: ExactAcceptance(0.6, generator=generator),
    "top-k-top-p": lambda generator: ExactAcceptance(0.9, top_k=20, top_p=0.8, generator=generator),
    "hotter": lambda generator: ExactAcceptance(1.2, top_k=20, top_p=0.8, generator=generator),
    "typical": lambda generator: TypicalAcceptance(0.6, generator=generator),
}


def sampled(model: MedusaModel, name: str, rule: str | None, seed: int = 0
            ) -> tuple[list[list[int]], list[list[int]]]:
    """`greedy`, sampling by `SAMPLING[rule]` (None: greedy), each prompt from its own seed."""
    drafter = drafter_of(model, name)
    tokens, lengths = [], []
    for i, ids in enumerate(prompts()):
        stats = GenerationStats()
        acceptance = rule and SAMPLING[rule](torch.Generator().manual_seed(seed + i))
        tokens.append(decode(model, ids, drafter, acceptance, max_new_tokens=NEW_TOKENS, stats=stats))
        lengths.append(stats.accepted_lengths)
    return tokens, lengths


@pytest.mark.parametrize("heads_folder, name, rule", [("medusa", "medusa+ngram", "temperature"),
                                                      ("hydra", "medusa+ngram", "top-k-top-p"),
                                                      ("medusa", "plain", "top-k-top-p"),
                                                      ("hydra", "medusa+ngram", "typical")], indirect=["heads_folder"])
def test_whole_step_graphs_sample_as_the_host_driven_step(heads_folder, name, rule):
    """Sampling inside the graph (exact: the warpers, each node's coin, the bonus token's draw; typical): a step draws
    its random numbers from the rule's generator as the host-driven step does, so a seed gives the same tokens and
    accepted lengths either way; the host-driven step samples the backbone's own law (`test_sampling.py`)."""
    compiled = MedusaModel.from_pretrained(heads_folder, base_model=frozen_tiny(), compile_step=True)
    eager = MedusaModel.from_pretrained(heads_folder, base_model=frozen_tiny())
    drafter, acceptance = drafter_of(compiled, name), SAMPLING[rule](None)
    steps = static_steps(compiled, drafter, acceptance)
    assert steps is not None and static_steps(eager, drafter_of(eager, name), acceptance) is None
    warm_up(compiled, drafter, acceptance=acceptance)
    assert steps.pending(drafter, acceptance.rule) == [] and steps.pending(drafter)  # greedy's graphs are others
    graphs = counters["stats"]["unique_graphs"]
    ours, our_lengths = sampled(compiled, name, rule)
    assert counters["stats"]["unique_graphs"] == graphs and not steps.failed
    theirs, their_lengths = sampled(eager, name, rule)
    assert ours == theirs and our_lengths == their_lengths
    assert ours != [hf_greedy(compiled.backbone, ids, NEW_TOKENS) for ids in prompts()]
    assert sampled(compiled, name, rule, seed=10)[0] != ours  # the seed matters
    if name != "plain":
        assert any(n > 1 for lengths in our_lengths for n in lengths)


def test_a_step_that_cannot_compile_runs_the_same_function_eagerly(heads_folder, monkeypatch, caplog):
    def broken(function):
        def fail(*args):
            raise RuntimeError("inductor failed")
        return fail

    monkeypatch.setattr(static_step, "compile_step", broken)
    model = MedusaModel.from_pretrained(heads_folder, base_model=frozen_tiny(), compile_step=True)
    with caplog.at_level(logging.WARNING):
        ours, _ = greedy(model, "medusa+ngram")
    assert static_steps(model, drafter_of(model, "medusa+ngram")).failed
    assert "Compiling the whole step failed, stepping eagerly from now on: inductor failed" in caplog.text
    assert ours == [hf_greedy(model.backbone, ids, NEW_TOKENS) for ids in prompts()]


def test_other_rules_and_batches_keep_the_host_driven_step(heads_folder):
    model = MedusaModel.from_pretrained(heads_folder, base_model=frozen_tiny(), compile_step=True)
    for rule in ("exact", "typical"):
        assert static_steps(model, make_drafter(model, "medusa"), make_acceptance(rule, 0.7)) is not None
    subclass = type("Changed", (ExactAcceptance,), {})  # a rule that may differ from its base's: the host decides
    assert static_steps(model, make_drafter(model, "medusa"), subclass(0.7)) is None
    assert static_steps(model, make_drafter(model, "ngram")) is None


def test_a_backbone_tapped_for_another_drafter_still_steps_whole(heads_folder):
    """An EAGLE-3 drafter sharing the backbone taps its layers (`tap_features`): the heads read the last hidden
    state alone, and the step stays one graph."""
    model = MedusaModel.from_pretrained(heads_folder, base_model=frozen_tiny(), compile_step=True)
    tap_features(model.backbone, (0, 1))
    ours, _ = greedy(model, "medusa+ngram")
    steps = static_steps(model, drafter_of(model, "medusa+ngram"))
    assert len(steps.graphs) == 2 and not steps.failed
    assert ours == [hf_greedy(model.backbone, ids, NEW_TOKENS) for ids in prompts()]


@pytest.mark.parametrize("heads_folder", ["hydra"], indirect=True)  # the default's; Medusa's: the sampling test's
def test_a_frozen_package_decodes_hf_greedy_and_later_models_load_it(heads_folder, monkeypatch, tmp_path, caplog):
    """AMX bf16 CPUs take frozen packages by default; forced here in fp32, where greedy output is exact."""
    monkeypatch.setenv("MEDUSA_HEADS_HOME", str(tmp_path))
    monkeypatch.setattr(frozen_step, "applies", lambda model: True)
    model = MedusaModel.from_pretrained(heads_folder, base_model=frozen_tiny(), compile_step=True)
    said = []
    warm_up(model, drafter_of(model, "medusa"), said.append)
    assert said[0].startswith("compiling the whole decoding step of 1 tree ahead of time")
    steps = static_steps(model, drafter_of(model, "medusa"))
    assert steps.frozen and len(steps.graphs) == 1 and steps.pending(drafter_of(model, "medusa")) == []
    package, = (tmp_path / "steps").glob("*.pt2")
    ours, our_lengths = greedy(model, "medusa")
    _, host_lengths = greedy(MedusaModel.from_pretrained(heads_folder, base_model=frozen_tiny()), "medusa")
    assert ours == [hf_greedy(model.backbone, ids, NEW_TOKENS) for ids in prompts()]
    assert our_lengths == host_lengths

    package.write_bytes(package.read_bytes()[:1000])  # a stopped copy: the next model compiles it again
    with caplog.at_level(logging.WARNING):
        rebuilt = MedusaModel.from_pretrained(heads_folder, base_model=frozen_tiny(), compile_step=True)
        assert greedy(rebuilt, "medusa") == (ours, our_lengths)
    assert "does not load" in caplog.text and package.stat().st_size > 1000
    plain, _ = greedy(model, "plain")  # plain decoding: the step of the root alone, a package of its own
    assert plain == [hf_greedy(model.backbone, ids, NEW_TOKENS) for ids in prompts()]
    packages = sorted((tmp_path / "steps").iterdir())
    assert len(packages) == 2 and package in packages

    def no_compiling(*args, **kwargs):
        raise AssertionError("compiled again")

    monkeypatch.setattr(torch._inductor, "aoti_compile_and_package", no_compiling)
    loaded = MedusaModel.from_pretrained(heads_folder, base_model=frozen_tiny(), compile_step=True)
    said = []
    warm_up(loaded, drafter_of(loaded, "medusa"), said.append)
    assert said == ["loading the whole decoding step of 1 tree, compiled ahead of time, from the disk cache"]
    assert greedy(loaded, "medusa") == (ours, our_lengths)
    assert static_steps(loaded, drafter_of(loaded, "medusa")).frozen
    assert sorted((tmp_path / "steps").iterdir()) == packages  # loading unpacked it into a folder since deleted


@pytest.mark.parametrize("heads_folder", ["medusa"], indirect=True)  # Medusa heads' package; Hydra's: the greedy test's
def test_a_frozen_package_samples_as_the_host_driven_step(heads_folder, monkeypatch, tmp_path):
    """Exact sampling's step as a package of its own (the warpers' settings inputs: a new temperature loads it)."""
    monkeypatch.setenv("MEDUSA_HEADS_HOME", str(tmp_path))
    monkeypatch.setattr(frozen_step, "applies", lambda model: True)
    model = MedusaModel.from_pretrained(heads_folder, base_model=frozen_tiny(), compile_step=True)
    warm_up(model, drafter_of(model, "medusa"), acceptance=SAMPLING["top-k-top-p"](None))
    steps = static_steps(model, drafter_of(model, "medusa"))
    assert steps.frozen and len(steps.graphs) == 1 and len(list((tmp_path / "steps").glob("*.pt2"))) == 1
    host = MedusaModel.from_pretrained(heads_folder, base_model=frozen_tiny())
    assert sampled(model, "medusa", "top-k-top-p") == sampled(host, "medusa", "top-k-top-p")
    assert sampled(model, "medusa", "hotter") == sampled(host, "medusa", "hotter")
    assert steps.frozen and len(steps.graphs) == 1 and len(list((tmp_path / "steps").glob("*.pt2"))) == 1


def test_a_package_is_named_by_the_weights_as_they_are_now(heads_folder):
    model = MedusaModel.from_pretrained(heads_folder, base_model=frozen_tiny())
    tree, root = drafter_of(model, "medusa").tree, drafter_of(model, "plain").tree

    def names():
        return [frozen_step.package_path(model, t, t.top_k, chain=False) for t in (tree, root)]

    named, plain = names()
    assert names() == [named, plain] and frozen_step.package_path(model, tree, tree.top_k, chain=True) != named
    sampling = {frozen_step.package_path(model, tree, tree.top_k, False, ExactAcceptance(t, k, p).rule)
                for t, k, p in [(0.7, 0, 1.0), (1.3, 0, 1.0), (0.7, 5, 1.0), (0.7, 0, 0.9), (0.7, 5, 0.9)]}
    assert len(sampling) == 4 and named not in sampling  # named by which warpers filter, not by their settings
    with torch.no_grad():  # changed in place, after their digests were kept
        next(model.heads.parameters()).view(-1)[0] += 1
        assert names()[0] != named and names()[1] == plain  # plain decoding does not draft
        named = names()[0]
        model.backbone.model.norm.weight[0] += 1
    assert names()[0] != named and names()[1] != plain


def test_the_package_folder_keeps_the_most_recently_used_within_its_limit(tmp_path):
    sizes = {"old": 400, "older": 300, "new": 500, "built": 600}
    for age, (name, size) in enumerate(sizes.items()):
        (tmp_path / f"{name}.pt2").write_bytes(b"x" * size)
        os.utime(tmp_path / f"{name}.pt2", (1000 - age, 1000 - {"old": 2, "older": 3, "new": 1, "built": 0}[name]))
    (tmp_path / "partial-stopped.pt2").write_bytes(b"x")
    (tmp_path / "partial-building.pt2").write_bytes(b"x" * 2000)
    os.utime(tmp_path / "partial-stopped.pt2", (0, 0))
    (tmp_path / "loading-stopped").mkdir()
    os.utime(tmp_path / "loading-stopped", (0, 0))
    frozen_step.prune(tmp_path, keep=tmp_path / "built.pt2", limit=1500)
    # 1500 bytes: "older" goes; so does what a build and a load stopped long ago left, not a build under way
    assert sorted(p.stem for p in tmp_path.iterdir()) == ["built", "new", "old", "partial-building"]
    frozen_step.prune(tmp_path, keep=tmp_path / "old.pt2", limit=100)
    assert sorted(p.stem for p in tmp_path.iterdir()) == ["old", "partial-building"]


def test_frozen_packages_are_for_small_bf16_backbones_on_amx_cpus(heads_folder, monkeypatch):
    model = MedusaModel.from_pretrained(heads_folder, base_model=frozen_tiny().to(torch.bfloat16), dtype=torch.bfloat16)
    amx = torch._C._cpu._init_amx()
    assert frozen_step.applies(model) == amx
    assert not frozen_step.applies(MedusaModel.from_pretrained(heads_folder, base_model=frozen_tiny()))  # fp32
    monkeypatch.setattr(frozen_step, "MAX_WEIGHT_BYTES", 1000)  # a backbone larger than that: no packages
    assert not frozen_step.applies(model)


def test_a_package_that_fails_to_step_leaves_the_step_to_the_in_process_graph(heads_folder, monkeypatch, caplog):
    def broken_package(*args):
        def fail(*step_args):
            raise RuntimeError("a size outside the package's")
        return fail

    monkeypatch.setattr(frozen_step, "applies", lambda model: True)
    monkeypatch.setattr(frozen_step, "load_or_build", broken_package)
    model = MedusaModel.from_pretrained(heads_folder, base_model=frozen_tiny(), compile_step=True)
    with caplog.at_level(logging.WARNING):
        ours, _ = greedy(model, "medusa")
    steps = static_steps(model, drafter_of(model, "medusa"))
    assert "package failed, compiling the step in process from now on" in caplog.text
    assert not steps.frozen and not steps.failed and len(steps.graphs) == 1
    assert ours == [hf_greedy(model.backbone, ids, NEW_TOKENS) for ids in prompts()]


def replaying_on_the_cpu(captures: list):
    """A stand-in for `captured_step.capture` where no GPU is: the function run again over the tensors it was
    captured with, its results written into the tensors it first returned, as a CUDA graph's replay does."""
    def capture(step, args, pool):
        captures.append(pool)
        capture.active = True  # the run that stands for capturing: its results are not read
        try:
            outputs = step(*args)
        finally:
            capture.active = False

        def replay():
            for static, new in zip(tree_leaves(outputs), tree_leaves(step(*args)), strict=True):
                static.copy_(new)
        return outputs, replay, f"pool of graph {len(captures)}"
    capture.active = False
    return capture


def captured_steps(model: MedusaModel, monkeypatch) -> tuple[StaticSteps, list]:
    """`model`'s steps as on a GPU, each tree's replayed from a graph that `replaying_on_the_cpu` captures here, and
    the pools its captures were given."""
    captures = []
    monkeypatch.setattr(captured_step, "capture", replaying_on_the_cpu(captures))
    steps = StaticSteps(model, getattr(model.backbone, FAST_FORWARD))
    steps.capture = True
    monkeypatch.setattr(generate_module, "static_steps", lambda *args: steps)
    return steps, captures


@pytest.mark.parametrize("name", ["medusa+ngram", "plain"])
def test_steps_replayed_from_captured_graphs_decode_hf_greedy(heads_folder, name, monkeypatch):
    """On a GPU each tree's step is a CUDA graph (`captured_step.py`), captured over the memory of its first call:
    the state each step returns must be copied in before the next replay, whichever graph returned it. `warm_up`
    captures them over a scratch prompt in a cache the steps lend and take back, which they lend to the decodes
    after (here of other prompts' lengths, within one size): they replay the same graphs; all share one pool."""
    eager = MedusaModel.from_pretrained(heads_folder, base_model=frozen_tiny())
    theirs, their_lengths = greedy(eager, name)  # the host-driven step
    steps, captures = captured_steps(eager, monkeypatch)
    warm_up(eager, drafter_of(eager, name))
    trees = 2 if name == "medusa+ngram" else 1  # with and without the n-gram branch
    assert captures == [None, "pool of graph 1"][:trees] and not steps.pending(drafter_of(eager, name))
    ours, our_lengths = greedy(eager, name)
    assert ours == theirs == [hf_greedy(eager.backbone, ids, NEW_TOKENS) for ids in prompts()]
    assert our_lengths == their_lengths
    assert len(captures) == trees  # the answers replayed the graphs `warm_up` captured
    assert [len(free) for free in steps.free_caches.values()] == [1]


@pytest.mark.parametrize("heads_folder", ["hydra"], indirect=True)
def test_steps_replayed_from_captured_graphs_sample_as_the_host_driven_step(heads_folder, monkeypatch):
    """As on a GPU: a step's random numbers are an input like its state, copied in before each replay; capturing at
    warm-up draws its own, leaving the answers' generators alone."""
    eager = MedusaModel.from_pretrained(heads_folder, base_model=frozen_tiny())
    theirs = sampled(eager, "medusa+ngram", "top-k-top-p")  # the host-driven step
    steps, captures = captured_steps(eager, monkeypatch)
    acceptance = SAMPLING["top-k-top-p"](None)
    warm_up(eager, drafter_of(eager, "medusa+ngram"), acceptance=acceptance)
    assert len(captures) == 2 and not steps.pending(drafter_of(eager, "medusa+ngram"), acceptance.rule)
    assert sampled(eager, "medusa+ngram", "top-k-top-p") == theirs
    assert len(captures) == 2


def test_decodes_of_other_sizes_and_at_once_capture_over_their_own_caches(heads_folder, monkeypatch):
    """A decode that needs a longer cache borrows one of the next size and captures over it; one that runs while
    another holds the cache borrows its own; each replays only graphs captured over its own memory, or it would
    read another decode's cache."""
    eager = MedusaModel.from_pretrained(heads_folder, base_model=frozen_tiny())
    monkeypatch.setattr(static_step, "POOLED_SIZE", 16)
    steps, captures = captured_steps(eager, monkeypatch)
    drafter = drafter_of(eager, "medusa")
    short, _, long = prompts()
    expected = {id(ids): hf_greedy(eager.backbone, ids, NEW_TOKENS) for ids in (short, long)}
    assert decode(eager, long, drafter, max_new_tokens=NEW_TOKENS) == expected[id(long)]
    assert decode(eager, short, drafter, max_new_tokens=NEW_TOKENS) == expected[id(short)]
    assert sorted(steps.free_caches) == [128, 256] and len(captures) == 2  # one graph per cache size

    def chunks(ids):
        request = generate_module.Request(ids[0].tolist(), drafter_of(eager, "medusa"), max_new_tokens=NEW_TOKENS)
        return generate_module.decode(eager, [request], [eager.backbone.generation_config.eos_token_id])
    first, second = chunks(short), chunks(short)
    ours = {0: [], 1: []}
    for pair in itertools.zip_longest(first, second):  # the two decodes step in turn
        for which, chunk in enumerate(pair):
            ours[which] += chunk[1] if chunk else []
    assert ours[0] == ours[1] == expected[id(short)]
    assert len(captures) == 3 and [len(steps.free_caches[size]) for size in (128, 256)] == [2, 1]
