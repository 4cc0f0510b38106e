"""The EAGLE-style drafter on the real backbone: its training unroll sees what its drafting sees, its own KV
cache stays in step with the context, and decoding with it is exactly HF greedy."""

from dataclasses import replace

import pytest
import torch

from medusa_heads import MedusaError, MedusaModel
from medusa_heads.backbone import EMBEDDED_MODEL, backbone_forward
from medusa_heads.eagle import unrolled_attention, unrolled_mask
from medusa_heads.inference import DecodeState, EagleDrafter, MedusaDrafter, make_drafter
from medusa_heads.model import SHIPPED_HEADS, load_heads, untrained_heads
from medusa_heads.training.recipe import TrainConfig
from medusa_heads.tree import build_tree, load_tree

from oracle import assert_exact, decode, unrolled_and_drafted


@pytest.fixture(scope="module")
def eagle_model(backbone):
    """A random EAGLE drafter (weights large enough that its guesses depend on features, tokens and context)."""
    torch.manual_seed(0)
    heads = untrained_heads(backbone, EMBEDDED_MODEL, head_type="eagle", draft_vocab=torch.randperm(49152)[:4096])
    for p in heads.parameters():
        p.data.normal_(std=0.05)
    return MedusaModel(backbone, heads)


def test_training_unroll_predicts_what_drafting_drafts(eagle_model, references):
    """Level j of the training unroll at the root's position + j - 2 scores the token drafted at depth j."""
    chain = build_tree([(0,) * d for d in range(1, 5)])
    cfg = TrainConfig(num_heads=4, head_type="eagle")
    for ids, _ in references[:2]:
        unrolled, drafted = unrolled_and_drafted(eagle_model, ids, chain, cfg)
        assert unrolled == drafted


@pytest.mark.parametrize("level", [1, 2, 4])
def test_unrolled_attention_is_attention_under_the_unrolled_mask(level):
    """The training unroll's attention without the mask: values and gradients of SDPA over `unrolled_mask`, with
    grouped query heads (6 query heads over 2 key/value heads)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    class Attention(torch.nn.Module):
        is_causal, num_key_value_groups = False, 3

    torch.manual_seed(level)
    n = 9
    q = torch.randn(2, 6, n, 8, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 2, level * n, 8, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, 2, level * n, 8, dtype=torch.float64, requires_grad=True)
    mask = unrolled_mask(level, n)[None, None].expand(2, 1, n, level * n)
    outputs, grads = [], []
    for attention in (sdpa_attention_forward, unrolled_attention):
        out, _ = attention(Attention(), q, k, v, mask, scaling=0.35)
        outputs.append(out)
        grads.append(torch.autograd.grad((out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum(), (q, k, v)))
    torch.testing.assert_close(outputs[1], outputs[0], rtol=0, atol=1e-12)
    for ours, reference in zip(grads[1], grads[0]):
        torch.testing.assert_close(ours, reference, rtol=0, atol=1e-12)


class Recorder:
    """Wraps a drafter, keeping each step's state and proposal."""

    def __init__(self, drafter):
        self.drafter, self.tree, self.steps = drafter, drafter.tree, []

    def propose(self, state):
        draft = self.drafter.propose(state)
        self.steps.append((replace(state, token_ids=list(state.token_ids)), draft.tokens.clone()))  # a snapshot:
        # the decoding loop extends its token list in place
        return draft


def test_drafter_cache_stays_in_step_with_the_context(eagle_model, references):
    """After many steps, the incremental cache drafts what a fresh drafter given the whole context drafts."""
    tree = build_tree(load_tree("cpu-16"))
    ids, _ = references[1]
    recorder = Recorder(EagleDrafter(eagle_model, tree))
    decode(eagle_model, ids, recorder, max_new_tokens=40)
    state, tokens = recorder.steps[-1]
    assert len(recorder.steps) > 10 and state.fresh_hidden.shape[0] < len(state.token_ids) - 1
    with torch.no_grad():
        _, hidden = backbone_forward(eagle_model.backbone, torch.tensor([state.token_ids[:-1]]), None)
    fresh = DecodeState(state.token_ids, state.root, hidden[0, -1], hidden[0])
    assert EagleDrafter(eagle_model, tree).fill(fresh, tree).tolist() == tokens.tolist()


@pytest.mark.parametrize("ngram", [False, True])
def test_decoding_with_the_eagle_drafter_is_exact(eagle_model, backbone, references, ngram):
    drafter = make_drafter(eagle_model, "medusa+ngram" if ngram else "medusa", tree="cpu-16")
    stats = assert_exact(eagle_model, backbone, references[:2], drafter, new_tokens=64)
    assert all(s.steps > 0 for s in stats)


@pytest.mark.parametrize("name, options", [("medusa+ngram", {"tree": "eagle-cpu-16"}), ("dynamic", {"budget": 16}),
                                           ("dynamic+ngram+store", {"budget": 16})])
def test_the_shipped_eagle_drafter_is_exact_and_accepts(backbone, references, name, options):
    """On its fitted static tree, and on a tree grown each step from its own confidence (EAGLE-2), alone or beside
    the n-gram chain (from the context or the drafter's n-gram store)."""
    heads = load_heads(SHIPPED_HEADS[EMBEDDED_MODEL].parent / "smollm2-135m-embedded-eagle", dtype=torch.float32)
    shipped = MedusaModel(backbone, heads)
    drafter = make_drafter(shipped, name, **options)
    stats = assert_exact(shipped, backbone, references[:2], drafter, 64)
    # A random drafter commits about 1 token per forward; the trained one about 2 on these prompts.
    assert sum(s.mean_accepted_length for s in stats) / len(stats) > 1.5


def test_eagle_drafter_errors(eagle_model, model):
    tree = build_tree(load_tree("cpu-16"))
    with pytest.raises(MedusaError, match="draft from the last hidden state alone"):
        MedusaDrafter(eagle_model, tree)
    with pytest.raises(MedusaError, match="needs a drafter over the context"):
        EagleDrafter(model, tree)
    with pytest.raises(MedusaError, match="deep"):
        EagleDrafter(eagle_model, build_tree([(0,) * d for d in range(1, 6)]))
    drafter = EagleDrafter(eagle_model, tree)
    hidden = torch.zeros(3, eagle_model.config.hidden_size)
    drafter.propose(DecodeState([1, 2, 3, 4], 4, hidden[-1], hidden))
    with pytest.raises(MedusaError, match="out of step"):  # positions 5.. are new, but it has only 3
        drafter.propose(DecodeState([1, 2, 3, 4, 5, 6, 7], 7, hidden[-1], hidden[:1]))
    with pytest.raises(MedusaError, match="fresh_hidden"):
        drafter.propose(DecodeState([1, 2, 3, 4], 4, hidden[-1]))
