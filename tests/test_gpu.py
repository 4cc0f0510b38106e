"""Tree decoding on a CUDA device: greedy exactness against HF `generate` on the same device (fp32), and whole steps
replayed as CUDA graphs that read the device once a step, greedy or sampling."""

import importlib
from importlib.resources import files

import pytest
import torch

from medusa_heads import EMBEDDED_MODEL, MedusaModel, load_backbone, load_heads
from medusa_heads.fast_llama import FAST_FORWARD
from medusa_heads.inference import ExactAcceptance, make_drafter
from medusa_heads.inference.generate import encode_prompt, prefill
from medusa_heads.inference.static_step import StaticStepper, static_steps
from medusa_heads.model import shipped_heads

from oracle import assert_exact, decode, hf_greedy  # noqa: E402  (pytest puts tests/ on sys.path)

generate_module = importlib.import_module("medusa_heads.inference.generate")  # the package exports a function so named

pytestmark = [pytest.mark.gpu, pytest.mark.slow,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.mark.parametrize("drafter, options", [("medusa", {"tree": "cpu-16"}), ("medusa+ngram", {"tree": "cpu-8"}),
                                              ("dynamic", {})])
def test_tree_decoding_on_cuda_is_the_backbone_greedy_output(tokenizer, chat_prompts, drafter, options):
    backbone = load_backbone(EMBEDDED_MODEL, dtype=torch.float32, device="cuda")
    model = MedusaModel(backbone, load_heads(shipped_heads(EMBEDDED_MODEL), dtype=torch.float32).to("cuda"))
    references = [(ids.cuda(), hf_greedy(backbone, ids.cuda(), 64))
                  for ids in (encode_prompt(tokenizer, p) for p in chat_prompts[:3])]
    assert_exact(model, backbone, references, make_drafter(model, drafter, **options), 64)


def test_the_fast_forward_on_cuda_is_the_backbone_greedy_output(tokenizer, chat_prompts):
    """`from_pretrained` on a GPU: nothing packed, the fast forward over views of one stacked q/k/v and gate/up
    weight; HF's greedy tokens with the default tree."""
    model = MedusaModel.from_pretrained(dtype=torch.float32, device="cuda")
    assert hasattr(model.backbone, FAST_FORWARD)
    references = [(ids.cuda(), hf_greedy(model.backbone, ids.cuda(), 64))
                  for ids in (encode_prompt(tokenizer, p) for p in chat_prompts[:3])]
    assert_exact(model, model.backbone, references, make_drafter(model, "medusa+ngram", tree="hydra-cpu-6"), 64)


@pytest.mark.parametrize("drafter, options, heads, temperature", [
    ("medusa", {"tree": "cpu-16"}, None, 0.0), ("plain", {}, None, 0.0),
    ("medusa", {"tree": "eagle3-bf16-8"}, "eagle3", 0.0), ("medusa", {"tree": "cpu-16"}, None, 0.7)])
def test_whole_steps_replay_as_cuda_graphs_reading_the_device_once_a_step(tokenizer, chat_prompts, drafter, options,
                                                                          heads, temperature, monkeypatch):
    """Each step one CUDA graph replay (`captured_step.py`) and one read of its results: no other synchronizing call
    (`set_sync_debug_mode("error")` raises at one), and HF's greedy tokens in fp32; the shipped Hydra heads, plain
    decoding, and the shipped EAGLE-3 drafter with its own cache. Sampling exactly (its random numbers drawn on the
    device): the tokens the host-driven step samples from the same seed."""
    folder = heads and str(files("medusa_heads") / "pretrained" / f"smollm2-135m-embedded-{heads}")
    model = MedusaModel.from_pretrained(folder, dtype=torch.float32, device="cuda")
    ids = encode_prompt(tokenizer, chat_prompts[0]).cuda()

    def sampling():
        return temperature and ExactAcceptance(temperature, generator=torch.Generator("cuda").manual_seed(0))
    if temperature:
        with monkeypatch.context() as patch:  # the host-driven step
            patch.setattr(generate_module, "static_steps", lambda *args: None)
            reference = decode(model, ids, make_drafter(model, drafter, **options), sampling(), 64)
    else:
        reference = hf_greedy(model.backbone, ids, 64)
    chosen, acceptance = make_drafter(model, drafter, **options), sampling() or None
    steps = static_steps(model, chosen, acceptance)
    assert steps is not None
    prompt = ids[0].tolist()
    cache = steps.borrow_cache(len(prompt) + 64 + 2 * chosen.tree.size)
    logits, hidden = prefill(model, [prompt], cache)
    root = acceptance.first_token(logits[0]) if acceptance else int(logits[0].argmax())
    stepper = StaticStepper(steps, chosen, cache, root, hidden[0], prompt, acceptance)
    sequence = prompt + [root]
    sequence += stepper.step(sequence)[0]  # the first step of a tree captures its graph
    torch.cuda.set_sync_debug_mode("error")
    try:
        while len(sequence) - len(prompt) < 64:
            sequence += stepper.step(sequence)[0]
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert len(steps.captured) == 1
    new = sequence[len(prompt):]
    shared = min(len(new), len(reference))  # HF's answer may end at an EOS; the steps above do not stop there
    assert shared >= 32 and new[:shared] == reference[:shared]
