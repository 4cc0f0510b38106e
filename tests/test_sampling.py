"""Lossless sampling: tree decoding with exact acceptance samples exactly the backbone's warped distribution.

On a tiny random Llama, the joint law of the first 3 generated tokens under tree decoding is compared with
the backbone's own (ancestral sampling with the same warpers), computed exactly by enumerating all
VOCAB^3 continuations. The statistic is the total-variation distance between the empirical law of N samples
and the exact one. Under the null, E[TV] <= 1/2 sum_x sqrt(p_x (1 - p_x) / N) (Jensen, per cell), and one
sample moves TV by at most 1/N, so TV exceeds that bound plus sqrt(ln(1 / ALPHA) / (2N)) with probability
below ALPHA (McDiarmid). Lossy rules must exceed the same threshold.
"""

import math

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from medusa_heads import MedusaError, MedusaModel
from medusa_heads.inference import (DecodeState, Draft, ExactAcceptance, TypicalAcceptance, Warper, generate_ids,
                                    make_acceptance)
from medusa_heads.inference.acceptance import ExactRule, sibling_table
from medusa_heads.inference.sampling import draw
from medusa_heads.inference.cache import TreeCache
from medusa_heads.inference.generate import prefill, verify
from medusa_heads.model import untrained_heads
from medusa_heads.tree import TreeBuffers, build_tree, load_tree

VOCAB = 16
PROMPT = [3, 1, 4, 1, 5]
NEW = 3  # tokens compared: the prefill's, then a first and (when it accepts nothing) a second tree step
SAMPLES = 4000
ALPHA = 1e-4


@pytest.fixture(scope="module")
def backbone():
    torch.manual_seed(0)
    # A wide initialisation gives peaked next-token laws, like a trained model's, so drafts are often accepted.
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         initializer_range=0.3)
    model = LlamaForCausalLM(config).eval()
    model.generation_config.eos_token_id = None
    return model


@pytest.fixture(scope="module")
def model(backbone):
    return MedusaModel(backbone, untrained_heads(backbone, "tiny-llama", num_heads=4))


class BackboneRankDrafter:
    """Fills the node of rank r with the backbone's own rank-`ranks[r]` token after its parent: often right, and
    a fixed function of the context, as exact acceptance requires. Repeating a rank in `ranks` drafts a
    duplicate sibling, as an n-gram branch repeating a head's guess does."""

    def __init__(self, backbone, tree: TreeBuffers, ranks: tuple[int, ...] = (0, 1, 2, 3)):
        self.backbone, self.tree, self.ranks = backbone, tree, ranks
        self.index = {path: i + 1 for i, path in enumerate(tree.paths)} | {(): 0}

    @torch.no_grad()
    def propose(self, state: DecodeState) -> Draft:
        tokens = [state.root] + [0] * len(self.tree.paths)
        for depth in range(1, self.tree.max_depth + 1):
            parents = sorted({path[:-1] for path in self.tree.paths if len(path) == depth})
            contexts = [state.token_ids + [tokens[self.index[p[:d]]] for d in range(1, depth)] for p in parents]
            order = self.backbone(torch.tensor(contexts)).logits[:, -1].argsort(dim=-1, descending=True)
            for path in self.tree.paths:
                if len(path) == depth:
                    tokens[self.index[path]] = int(order[parents.index(path[:-1]), self.ranks[path[-1]]])
        return Draft(self.tree, torch.tensor(tokens))


class TreeSampler:
    r"""
    The first tokens of tree decoding, through the runtime's own prefill, drafter, verify and the acceptance
    rule under test. All but the rule's draws is a fixed function of the context, so each context's logits and
    draft are computed once (on a fresh cache) and reused: thousands of samples cost a few hundred forwards.
    `test_the_sampler_decodes_what_generate_ids_does` checks that it reproduces `generate_ids`.
    """

    def __init__(self, model: MedusaModel, drafter):
        self.model, self.drafter = model, drafter
        self.prefills: dict[tuple[int, ...], tuple[torch.Tensor, torch.Tensor]] = {}
        self.steps: dict[tuple[int, ...], tuple[Draft, torch.Tensor]] = {}

    def prefill(self, prompt: tuple[int, ...]):
        """(logits [V], hidden [L, H]) after `prompt`, and a cache holding it (fresh each call)."""
        cache = TreeCache(self.model.backbone, 1, len(prompt) + 2 * self.drafter.tree.size)
        logits, hidden = prefill(self.model, [list(prompt)], cache)
        return logits[0], hidden[0], cache

    def step(self, context: tuple[int, ...]) -> tuple[Draft, torch.Tensor]:
        """The draft and the tree's logits of the step whose root is `context`'s last token."""
        if context not in self.steps:
            _, hidden, cache = self.prefill(context[:-1])
            draft = self.drafter.propose(DecodeState(list(context), context[-1], hidden[-1], hidden))
            logits, _ = verify(self.model, draft.tree, draft.tokens[None], cache)
            self.steps[context] = draft, logits[0]
        return self.steps[context]

    @torch.no_grad()
    def sample(self, acceptance, prompt: list[int], new_tokens: int) -> tuple[list[int], list[int]]:
        """(the first `new_tokens` new tokens, the accepted depth of each tree step)."""
        if tuple(prompt) not in self.prefills:
            self.prefills[tuple(prompt)] = self.prefill(tuple(prompt))[0]
        tokens = [acceptance.first_token(self.prefills[tuple(prompt)])]
        depths = []
        while len(tokens) < new_tokens:
            draft, logits = self.step(tuple(prompt + tokens))
            accepted = acceptance.accept(draft, logits)
            depths.append(accepted.depth)
            tokens += draft.tokens[accepted.nodes[1:]].tolist() + [accepted.bonus]
        return tokens[:new_tokens], depths


class ForgetsRejectedSiblings(ExactRule):
    """Broken on purpose: tries each child with its plain q and draws the bonus from the whole q."""

    def acceptance_probs(self, tree: TreeBuffers, earlier, tokens: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
        return probs[tree.parent.clamp(min=0), tokens]

    def residual(self, tree: TreeBuffers, tokens: torch.Tensor, probs: torch.Tensor, node: torch.Tensor):
        return probs.index_select(0, node)[0]


def forgetting_rejected_siblings(warp: dict, generator: torch.Generator) -> ExactAcceptance:
    acceptance = ExactAcceptance(**warp, generator=generator)
    acceptance.rule = ForgetsRejectedSiblings(*acceptance.warper.filters)
    return acceptance


# Both warp at T < 1 and draft on the backbone's ranks; the second truncates too and drafts a duplicate sibling.
CASES = {
    "temperature": dict(warp=dict(temperature=0.7), tree="cpu-16", ranks=(0, 1, 2, 3)),
    "top-k-top-p-duplicates": dict(warp=dict(temperature=0.8, top_k=6, top_p=0.9), tree="cpu-8", ranks=(0, 1, 0)),
}
LOSSY = {
    "temperature": lambda warp, generator: TypicalAcceptance(warp["temperature"], generator=generator),
    "top-k-top-p-duplicates": forgetting_rejected_siblings,
}


@torch.no_grad()
def exact_law(backbone, warper: Warper) -> torch.Tensor:
    """[V, V, V] the backbone's law of its first 3 new tokens after PROMPT, by enumeration."""
    pairs = torch.cartesian_prod(torch.arange(VOCAB), torch.arange(VOCAB))  # [V^2, 2]: (t1, t2)
    ids = torch.cat([torch.tensor(PROMPT).expand(len(pairs), -1), pairs], dim=1)
    probs = warper.probs(backbone(ids).logits[:, -3:]).double()  # laws of t1, t2 | t1, t3 | t1 t2
    first = probs[0, 0]
    second = probs[::VOCAB, 1]  # [t1, t2]
    third = probs[:, 2].reshape(VOCAB, VOCAB, VOCAB)
    return first[:, None, None] * second[:, :, None] * third


def tv_threshold(law: torch.Tensor, n: int) -> float:
    """TV of n samples from `law` to `law` stays below this with probability >= 1 - ALPHA (module docstring)."""
    return float(0.5 * (law * (1 - law)).sqrt().sum() / math.sqrt(n) + math.sqrt(math.log(1 / ALPHA) / (2 * n)))


@pytest.fixture(scope="module")
def samplers(model):
    """One sampler (with its memory of steps) per case, shared by the exact and the lossy rule."""
    return {name: TreeSampler(model, BackboneRankDrafter(model.backbone, build_tree(load_tree(case["tree"])),
                                                         case["ranks"]))
            for name, case in CASES.items()}


def tv_to_backbone(backbone, sampler: TreeSampler, acceptance, warp: dict) -> tuple[float, float, float]:
    """(TV of SAMPLES tree-decoded 3-token prefixes to the exact law, its threshold, mean accepted depth)."""
    law = exact_law(backbone, Warper(**warp))
    counts = torch.zeros_like(law)
    depths = []
    for _ in range(SAMPLES):
        tokens, step_depths = sampler.sample(acceptance, PROMPT, NEW)
        counts[tuple(tokens)] += 1
        depths += step_depths
    tv = float(0.5 * (counts / SAMPLES - law).abs().sum())
    return tv, tv_threshold(law, SAMPLES), sum(depths) / len(depths)


@pytest.mark.parametrize("case", sorted(CASES))
def test_exact_acceptance_samples_the_backbones_law(backbone, samplers, case):
    warp = CASES[case]["warp"]
    acceptance = ExactAcceptance(**warp, generator=torch.Generator().manual_seed(1))
    tv, threshold, depth = tv_to_backbone(backbone, samplers[case], acceptance, warp)
    print(f"{case}: exact TV {tv:.4f}, threshold {threshold:.4f}, mean accepted depth {depth:.2f}")
    assert depth > 1.0  # the tree does the work: most tokens come from accepted drafts
    assert tv < threshold


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_same_test_fails_a_lossy_rule(backbone, samplers, case):
    warp = CASES[case]["warp"]
    acceptance = LOSSY[case](warp, torch.Generator().manual_seed(1))
    tv, threshold, _ = tv_to_backbone(backbone, samplers[case], acceptance, warp)
    print(f"{case}: {type(acceptance).__name__} TV {tv:.4f}, threshold {threshold:.4f}")
    assert tv > threshold


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_sampler_decodes_what_generate_ids_does(model, samplers, case):
    warp = CASES[case]["warp"]
    for seed in range(8):
        ours = [t for chunk in generate_ids(model, torch.tensor([PROMPT]), samplers[case].drafter,
                                            ExactAcceptance(**warp, generator=torch.Generator().manual_seed(seed)),
                                            max_new_tokens=8)
                for t in chunk]
        fast, _ = samplers[case].sample(ExactAcceptance(**warp, generator=torch.Generator().manual_seed(seed)),
                                        PROMPT, 8)
        assert ours == fast


@pytest.mark.parametrize("warp", [dict(temperature=0.7), dict(temperature=1.0, top_k=5),
                                  dict(temperature=1.3, top_p=0.7), dict(temperature=0.8, top_k=6, top_p=0.9)])
def test_warped_probabilities_are_what_hf_generate_samples_from(backbone, warp):
    prompt = torch.tensor([PROMPT])
    out = backbone.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=True, max_new_tokens=1,
                            output_scores=True, return_dict_in_generate=True, temperature=warp["temperature"],
                            top_k=warp.get("top_k", 0), top_p=warp.get("top_p", 1.0))
    hf = torch.softmax(out.scores[0][0], dim=-1)
    with torch.no_grad():
        ours = Warper(**warp).probs(backbone(prompt).logits[0, -1])
    assert torch.equal(ours > 0, hf > 0)
    torch.testing.assert_close(ours, hf, rtol=0, atol=1e-6)


@pytest.mark.parametrize("warp", [dict(temperature=0.7), dict(temperature=1.0, top_k=5),
                                  dict(temperature=1.3, top_p=0.7), dict(temperature=0.8, top_k=6, top_p=0.9),
                                  dict(temperature=1.0, top_k=1), dict(temperature=2.0, top_k=40, top_p=0.999)])
@pytest.mark.parametrize("ties", [False, True])
def test_warped_probabilities_are_hf_warpers(warp, ties):
    """Against transformers' own warpers, on rows whose scores tie at the top-k and top-p boundaries too (bf16
    logits tie often): the same law, except which of the equally likely tokens at the nucleus's edge it keeps
    (HF: where its unstable sort put them) -- the same number of them."""
    from transformers import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper
    generator = torch.Generator().manual_seed(0)
    logits = 3 * torch.randn(256, 40, generator=generator)
    if ties:
        logits[::2] = logits[::2].round()
        logits[1::2] = logits[1::2].bfloat16().float()
    scores = logits
    for hf in ([TemperatureLogitsWarper(warp["temperature"])]
               + ([TopKLogitsWarper(warp["top_k"])] if "top_k" in warp else [])
               + ([TopPLogitsWarper(warp["top_p"])] if "top_p" in warp else [])):
        scores = hf(None, scores)
    hf, ours = scores.softmax(dim=-1), Warper(**warp).probs(logits)
    same = (ours > 0).eq(hf > 0).all(dim=-1)
    torch.testing.assert_close(ours[same], hf[same], rtol=0, atol=1e-7)
    assert same.sum() > len(same) // 2
    for row in (~same).nonzero()[:, 0]:  # only ties at the edge of the nucleus differ
        assert "top_p" in warp
        for score in logits[row].unique():
            tied = logits[row] == score
            assert (ours[row][tied] > 0).sum() == (hf[row][tied] > 0).sum()
    assert same.all() or ties


def test_top_p_keeps_the_lowest_ids_of_equally_likely_tokens_at_its_edge():
    logits = torch.tensor([[0.0, 1.0, 1.0, 1.0, 1.0, -1.0]])
    kept = Warper(1.0, top_p=0.5).probs(logits) > 0  # each 1 of the 4 tied tokens holds 0.22: 3 reach 0.5
    assert kept.tolist() == [[False, True, True, True, False, False]]
    kept = Warper(1.0, top_k=2, top_p=1.0).probs(logits) > 0  # top-k keeps every token tied with the k-th
    assert kept.tolist() == [[False, True, True, True, True, False]]


def test_duplicate_and_covering_children_by_hand():
    tree = build_tree([[0], [1], [2], [3]])
    q = torch.tensor([0.4, 0.3, 0.2, 0.1, 0.0])
    tokens = torch.tensor([4, 0, 0, 1, 2])  # the second child repeats the first's token
    rule, earlier = ExactRule(), sibling_table(tree.paths, "cpu")
    got = rule.acceptance_probs(tree, earlier, tokens, q.expand(tree.size, -1).clone())
    torch.testing.assert_close(got[1:], torch.tensor([0.4, 0.0, 0.3 / 0.6, 0.2 / 0.3]))
    residual = rule.residual(tree, tokens, q.expand(tree.size, -1).clone(), torch.tensor([0]))
    assert residual.tolist() == pytest.approx([0.0, 0.0, 0.0, 0.1, 0.0])
    # With top_k = 2 two children cover q's support: the second is accepted for sure, the residual is never empty.
    two = ExactAcceptance(1.0, top_k=2, generator=torch.Generator().manual_seed(0))
    pair = Draft(build_tree([[0], [1]]), torch.tensor([4, 1, 0]))
    logits = torch.tensor([2.0, 1.0, -1.0, -2.0, -3.0]).expand(3, -1)
    probs = two.warper.probs(logits)
    assert rule.acceptance_probs(pair.tree, sibling_table(pair.tree.paths, "cpu"), pair.tokens, probs)[2] == 1.0
    assert {two.accept(pair, logits).nodes.tolist()[1] for _ in range(200)} == {1, 2}


def test_a_draw_follows_its_weights_and_never_takes_a_token_of_weight_0():
    weights = torch.tensor([0.0, 2.0, 0.0, 1.0, 1.0, 0.0])
    uniforms = (torch.arange(4000, dtype=torch.float64) + 0.5) / 4000
    tokens = torch.cat([draw(weights, u.reshape(1)) for u in uniforms])
    assert torch.bincount(tokens, minlength=6).tolist() == [0, 2000, 0, 1000, 1000, 0]
    almost_one = torch.tensor([1 - 2 ** -24])  # the largest float32 below 1: u x total may round to the total
    assert draw(weights, almost_one).item() == 4 and draw(weights, torch.zeros(1)).item() == 1


def test_bad_sampling_settings_are_one_line_errors(capsys):
    from medusa_heads.apps.cli import main

    with pytest.raises(MedusaError, match="use greedy"):
        make_acceptance("exact", temperature=0.0)
    for bad in (dict(top_k=-1), dict(top_k=2.5), dict(top_p=0.0), dict(top_p=1.5)):
        with pytest.raises(MedusaError, match="top_"):
            make_acceptance("exact", temperature=0.7, **bad)
    with pytest.raises(MedusaError, match="exact acceptance only"):
        make_acceptance("typical", temperature=0.7, top_k=5)
    assert isinstance(make_acceptance("exact", 0.7, seed=3, top_k=5, top_p=0.9), ExactAcceptance)
    # The CLI refuses before loading any model.
    assert main(["generate", "--prompt", "hi", "--acceptance", "exact", "--model", "/nonexistent"]) == 2
    assert "use greedy acceptance" in capsys.readouterr().err
    assert main(["generate", "--prompt", "hi", "--acceptance", "exact", "--temperature", "0.7", "--top-p", "0",
                 "--model", "/nonexistent"]) == 2
    assert "`top_p` must be in (0, 1]" in capsys.readouterr().err


def test_bench_methods_can_sample():
    from medusa_heads.apps.bench import make_methods, markdown, summarize

    methods = make_methods(["hf-sample@0.7", "medusa:cpu-16:exact@0.7", "medusa:cpu-16:typical@0.7"])
    assert list(methods) == ["hf", "hf-sample@0.7", "medusa:cpu-16:exact@0.7", "medusa:cpu-16:typical@0.7"]
    for bad, message in [("medusa:cpu-16:exact@0", "temperature > 0"), ("hf-sample@x", "temperature > 0"),
                         ("medusa:cpu-16:greedy@0.7", "exact@T or typical@T")]:
        with pytest.raises(MedusaError, match=message):
            make_methods([bad])
    # Only greedy methods are compared with HF greedy's output.
    rows = [{"prompt": "a", "category": "x", "method": m, "tokens_per_second": 10.0, "identical_to_hf": same,
             "identical_to_fp32": None, "accepted_lengths": lengths}
            for m, same, lengths in [("hf", True, None), ("medusa:cpu-16:exact@0.7", None, [1, 2])]]
    summary = summarize(rows)
    assert summary["medusa:cpu-16:exact@0.7"]["identical_outputs"] is None
    table = markdown({"summary": summary, "max_new_tokens": 8, "repeats": 1,
                      "fingerprint": {"dtype": "float32", "device": "cpu", "cpu": "x", "threads": 1,
                                      "torch": "t", "transformers": "t"}})
    assert "| medusa:cpu-16:exact@0.7 | 10.0 | 1.00x (1.00-1.00) | 1.50 | - |" in table
