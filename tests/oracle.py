"""HF `generate` on the real model as the oracle of exactness, shared by the decoding and drafter tests."""

import torch

from medusa_heads.inference import GenerationStats, generate_ids

REFERENCE_TOKENS = 128  # new tokens of each HF greedy reference; tests compare any prefix of it


def hf_greedy(backbone, input_ids: torch.Tensor, max_new_tokens: int = REFERENCE_TOKENS) -> list[int]:
    out = backbone.generate(input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                            max_new_tokens=max_new_tokens)
    return out[0, input_ids.shape[1]:].tolist()


def explain_mismatch(backbone, input_ids: torch.Tensor, ours: list[int], reference: list[int]) -> str:
    """Name the first divergence and the backbone's top-2 logit gap there (a near tie is a float effect)."""
    i = next(k for k, (a, b) in enumerate(zip(ours + [-1], reference + [-2])) if a != b)
    context = torch.cat([input_ids[0], torch.tensor(reference[:i], dtype=torch.long)])[None]
    with torch.no_grad():
        logits = backbone(context).logits[0, -1]
    top = logits.topk(2)
    return (f"first difference at new token {i}: ours {ours[i:i + 1]}, HF {reference[i:i + 1]}; "
            f"top-2 logit gap there {float(top.values[0] - top.values[1]):.2e} (tokens {top.indices.tolist()})")


def decode(model, input_ids: torch.Tensor, drafter, acceptance=None, max_new_tokens: int = REFERENCE_TOKENS,
           stats: GenerationStats | None = None) -> list[int]:
    eos = [model.backbone.generation_config.eos_token_id]
    return [t for chunk in generate_ids(model, input_ids, drafter, acceptance, max_new_tokens, eos, stats=stats)
            for t in chunk]


def assert_exact(model, backbone, references, drafter, new_tokens: int = REFERENCE_TOKENS) -> list[GenerationStats]:
    """Decode each reference's prompt with `drafter`; its first `new_tokens` tokens must be HF's."""
    all_stats = []
    for ids, reference in references:
        stats = GenerationStats()
        ours = decode(model, ids, drafter, max_new_tokens=new_tokens, stats=stats)
        expected = reference[:new_tokens]
        assert ours == expected, explain_mismatch(backbone, ids, ours, expected)
        all_stats.append(stats)
    return all_stats
