"""HF `generate` on the real model as the oracle of exactness, shared by the decoding and drafter tests; the
drafters over the context's own drafting as the oracle of their training unroll."""

import torch

from medusa_heads.inference import DecodeState, EagleDrafter, GenerationStats, generate_ids
from medusa_heads.inference.cache import TreeCache
from medusa_heads.inference.generate import prefill

REFERENCE_TOKENS = 128  # new tokens of each HF greedy reference; tests compare any prefix of it


def hf_greedy(backbone, input_ids: torch.Tensor, max_new_tokens: int = REFERENCE_TOKENS) -> list[int]:
    out = backbone.generate(input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                            max_new_tokens=max_new_tokens)
    return out[0, input_ids.shape[1]:].tolist()


def first_difference(backbone, input_ids: torch.Tensor, ours: list[int], reference: list[int]
                     ) -> tuple[int, float, list[int]]:
    """-> (the first new token where `ours` leaves `reference`, the backbone's top-2 logit gap there, its top-2
    tokens); a near tie there is a float effect."""
    i = next(k for k, (a, b) in enumerate(zip(ours + [-1], reference + [-2])) if a != b)
    context = torch.cat([input_ids[0], torch.tensor(reference[:i], dtype=torch.long)])[None]
    with torch.no_grad():
        top = backbone(context).logits[0, -1].topk(2)
    return i, float(top.values[0] - top.values[1]), top.indices.tolist()


def explain_mismatch(backbone, input_ids: torch.Tensor, ours: list[int], reference: list[int]) -> str:
    i, gap, top = first_difference(backbone, input_ids, ours, reference)
    return (f"first difference at new token {i}: ours {ours[i:i + 1]}, HF {reference[i:i + 1]}; "
            f"top-2 logit gap there {gap:.2e} (tokens {top})")


def decode(model, input_ids: torch.Tensor, drafter, acceptance=None, max_new_tokens: int = REFERENCE_TOKENS,
           stats: GenerationStats | None = None) -> list[int]:
    eos = [model.backbone.generation_config.eos_token_id]
    return [t for chunk in generate_ids(model, input_ids, drafter, acceptance, max_new_tokens, eos, stats=stats)
            for t in chunk]


def assert_exact(model, backbone, references, drafter, new_tokens: int = REFERENCE_TOKENS,
                 near_tie: float = 0.0) -> list[GenerationStats]:
    """Decode each reference's prompt with `drafter`; its first `new_tokens` tokens must be HF's. With `near_tie`,
    for a backbone that rounds its activations to bf16 (int4 weights): there a different summation order upstream
    (our tree attention, HF's own) can flip a rounding, so ours may leave HF's output, but only at a near tie, where
    the reference's two best logits are within `near_tie`."""
    all_stats = []
    for ids, reference in references:
        stats = GenerationStats()
        ours = decode(model, ids, drafter, max_new_tokens=new_tokens, stats=stats)
        expected = reference[:new_tokens]
        if ours != expected:
            assert first_difference(backbone, ids, ours, expected)[1] < near_tie, \
                explain_mismatch(backbone, ids, ours, expected)
        all_stats.append(stats)
    return all_stats


def unrolled_and_drafted(model, input_ids: torch.Tensor, chain, cfg) -> tuple[list[int], list[int]]:
    """(the token the training unroll scores best at each level, the tokens drafted down `chain`) after one prompt:
    level j at the root's position + j - 2 must guess what drafting guesses at depth j."""
    from medusa_heads.training.trainer import eagle_forward  # accelerate: only for the tests that train

    drafter = EagleDrafter(model, chain)  # before the prefill: it may tap the backbone's layers
    cache = TreeCache(model.backbone, 1, input_ids.shape[1])
    logits, hidden = (x[0] for x in prefill(model, input_ids.tolist(), cache))
    root = int(logits.argmax())
    drafted = drafter.fill(DecodeState(input_ids[0].tolist() + [root], root, hidden[-1], hidden), chain)[1:]
    sequence = torch.cat([input_ids[0], torch.tensor([root]), drafted])[None]
    n = input_ids.shape[1]
    # Real features up to the root; the levels scored below never read the later ones.
    features = torch.cat([hidden, torch.zeros(sequence.shape[1] - n, hidden.shape[1])])[None]
    mask = torch.zeros_like(sequence)
    mask[0, n + 1:] = 1  # the drafted tokens are the labels: one scored position per level
    with torch.no_grad():
        level_logits, _, _ = eagle_forward(model.heads, model.projection, model.backbone.get_input_embeddings(),
                                           features, sequence, mask, cfg)
    return [int(model.heads.token_ids(lg[j].argmax())) for j, lg in enumerate(level_logits)], drafted.tolist()
