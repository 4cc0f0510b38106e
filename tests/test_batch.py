"""Batched tree decoding: each sequence of a batch decodes what it decodes alone (HF greedy in fp32), however long
the others' prompts and answers are."""

import pytest
import torch

from medusa_heads import EMBEDDED_MODEL, MedusaModel
from medusa_heads.errors import MedusaError
from medusa_heads.model import SHIPPED_HEADS
from medusa_heads.inference import ExactAcceptance, Request, decode, make_drafters
from medusa_heads.inference.generate import GenerationStats

from oracle import explain_mismatch  # noqa: E402

BUDGETS = [40, 64, 1, 24]  # rows leave the batch at different steps; 1: the prefill's token only


def decode_all(model, requests, eos=()) -> list[list[int]]:
    outputs = [[] for _ in requests]
    for index, tokens in decode(model, requests, eos):
        outputs[index] += tokens
    return outputs


@pytest.mark.parametrize("name, options", [
    ("medusa", {"tree": "cpu-16"}),
    ("medusa+ngram", {"tree": "cpu-8"}),  # the heads' tree, with the n-gram chain when something matches
    ("ngram", {"draft_length": 4}),  # chains of varying length
    ("dynamic", {"budget": 12}),  # a new tree every step
    ("dynamic+ngram", {"budget": 8}),  # ... and the n-gram chain beside it when something matches
])
def test_each_sequence_of_a_batch_is_hf_greedy_alone(model, backbone, references, name, options):
    drafters = make_drafters(model, name, len(BUDGETS), **options)
    eos = [model.backbone.generation_config.eos_token_id]
    requests = [Request(ids[0].tolist(), drafter, max_new_tokens=n)
                for (ids, _), drafter, n in zip(references, drafters, BUDGETS)]
    for (ids, reference), ours, n in zip(references, decode_all(model, requests, eos), BUDGETS):
        assert ours == reference[:n], explain_mismatch(backbone, ids, ours, reference[:n])
    assert all(r.stats.steps >= 1 for r, n in zip(requests, BUDGETS) if n > 1)


def test_the_eagle_drafter_keeps_one_cache_per_sequence(backbone, references):
    eagle = MedusaModel.from_pretrained(SHIPPED_HEADS[EMBEDDED_MODEL].parent / "smollm2-135m-embedded-eagle",
                                        base_model=backbone)
    drafters = make_drafters(eagle, "medusa", 3, tree="eagle-cpu-16")
    assert len({id(d) for d in drafters}) == 3
    requests = [Request(ids[0].tolist(), d, max_new_tokens=32) for (ids, _), d in zip(references, drafters)]
    for (ids, reference), ours in zip(references, decode_all(eagle, requests)):
        assert ours == reference[:32], explain_mismatch(backbone, ids, ours, reference[:32])
    with pytest.raises(MedusaError, match="its own"):
        decode_all(eagle, [Request(ids[0].tolist(), drafters[0]) for ids, _ in references[:2]])


def test_sampled_rows_do_not_mix(model, references):
    """Each row's seeded sampler draws what it draws when its sequence is decoded alone."""
    drafter = make_drafters(model, "medusa", 1, tree="cpu-8")[0]

    def request(row, seed):
        generator = torch.Generator().manual_seed(seed)
        return Request(references[row][0][0].tolist(), drafter, ExactAcceptance(0.8, generator=generator),
                       max_new_tokens=24, stats=GenerationStats())

    together = decode_all(model, [request(0, 1), request(1, 2), request(2, 3)])
    alone = [decode_all(model, [request(row, seed)])[0] for row, seed in [(0, 1), (1, 2), (2, 3)]]
    assert together == alone and all(len(out) == 24 for out in alone)


def test_rows_with_different_drafters_share_a_batch(model, backbone, references):
    """The batch verifies the union of the rows' trees; nodes another row drafted are guesses like any other."""
    drafters = [make_drafters(model, name, 1, **options)[0] for name, options in [
        ("medusa", {"tree": "cpu-8"}), ("ngram", {}), ("medusa+ngram", {"tree": "cpu-16"}), ("dynamic", {})]]
    requests = [Request(ids[0].tolist(), drafter, max_new_tokens=48) for (ids, _), drafter in zip(references, drafters)]
    for (ids, reference), ours in zip(references, decode_all(model, requests)):
        assert ours == reference[:48], explain_mismatch(backbone, ids, ours, reference[:48])


def test_requests_that_cannot_run_fail_in_one_line(model, references):
    prompt = references[0][0][0].tolist()
    eight = make_drafters(model, "medusa", 1, tree="cpu-8")[0]
    with pytest.raises(MedusaError, match="at least one token"):
        decode_all(model, [Request([], eight)])
    with pytest.raises(MedusaError, match="context"):
        decode_all(model, [Request(prompt, eight, max_new_tokens=10**6)])
