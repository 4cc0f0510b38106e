"""The fast Llama-family forward computes what transformers' modules compute: logits and hidden states of a
prefill and a tree step on tiny random models of each family it covers, HF-identical greedy decoding, and the
modules' path kept for everything else."""

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from medusa_heads import MedusaModel
from medusa_heads.backbone import EMBEDDED_MODEL, backbone_forward, tap_features
from medusa_heads.fast_llama import FAST_FORWARD, supports
from medusa_heads.inference import GenerationStats, generate_ids, make_drafter
from medusa_heads.inference.cache import TreeCache
from medusa_heads.inference.generate import encode_prompt
from medusa_heads.tree import build_tree, canonical_tree, load_tree

from test_decoding import OracleDrafter  # noqa: E402  (pytest puts tests/ on sys.path)

SIZES = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256)
FAMILIES = {
    "llama": dict(tie_word_embeddings=True),
    "mistral": dict(sliding_window=None),
    "qwen2": dict(),  # q/k/v biases
    "qwen3": dict(head_dim=32),  # per-head q/k norms, head_dim apart from hidden_size / heads
    "llama-scaled-rope": dict(rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                                               "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                               "original_max_position_embeddings": 64}),
}


def tiny(family: str, dtype: torch.dtype = torch.float32):
    torch.manual_seed(0)
    arch = family.split("-")[0]
    config = AutoConfig.for_model(arch, **SIZES, **FAMILIES[family])
    backbone = AutoModelForCausalLM.from_config(config).to(dtype).eval()
    for name, param in backbone.named_parameters():  # non-trivial norms and biases, so a missing one shows
        if "norm" in name or "bias" in name:
            param.data.normal_(1.0 if "norm" in name else 0.0, 0.3)
    backbone.generation_config.eos_token_id = None
    return backbone


def pair(backbone, **options) -> tuple[MedusaModel, MedusaModel]:
    """The same backbone's weights loaded twice: through the fast forward and through its modules."""
    fast = MedusaModel.from_pretrained(None, base_model=backbone, **options)
    twin = AutoModelForCausalLM.from_config(backbone.config).to(backbone.dtype).eval()
    twin.load_state_dict(backbone.state_dict())
    twin.generation_config.eos_token_id = None
    slow = MedusaModel.from_pretrained(None, base_model=twin, fast_forward=False, **options)
    return fast, slow  # untrained heads: the same function of the same backbone


def prefill_and_step(model: MedusaModel, prompt: torch.Tensor, tree, tokens: torch.Tensor):
    """(prefill logits, prefill hidden, step logits, step hidden, the step's keys in layer 0's cache)."""
    cache = TreeCache(model.backbone, prompt.shape[0], 64)
    positions, mask = cache.prefill_inputs([prompt.shape[1]] * prompt.shape[0], prompt.shape[1])
    first = backbone_forward(model.backbone, prompt, cache.cache, positions, mask)
    positions, mask = cache.tree_inputs(tree)
    second = backbone_forward(model.backbone, tokens, cache.cache, positions, mask)
    return (*first, *second, cache.cache.layers[0].keys[:, :, : prompt.shape[1] + tree.size].clone())


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_fast_forward_computes_what_the_modules_do(family):
    fast, slow = pair(tiny(family))
    assert hasattr(fast.backbone, FAST_FORWARD) and not hasattr(slow.backbone, FAST_FORWARD)
    tree = build_tree(load_tree("cpu-16"))
    prompt = torch.randint(0, 300, (2, 11), generator=torch.Generator().manual_seed(1))
    tokens = torch.randint(0, 300, (2, tree.size), generator=torch.Generator().manual_seed(2))
    ours, theirs = prefill_and_step(fast, prompt, tree, tokens), prefill_and_step(slow, prompt, tree, tokens)
    for a, b in zip(ours, theirs):
        assert a.shape == b.shape
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_unpacked_the_layers_weights_become_views_of_the_stacked_one(family):
    """Where nothing is packed (a GPU, or `pack_weights=False`) the products run over one stacked weight, and the
    modules keep computing with views of it: one copy of the weights, the same function."""
    fast, slow = pair(tiny(family), pack_weights=False)
    attention = fast.backbone.model.layers[0].self_attn
    stacked = fast.backbone.medusa_fast_forward.layers[0].qkv.weight
    assert attention.k_proj.weight.data_ptr() == stacked[attention.q_proj.out_features:].data_ptr()
    tree = build_tree(load_tree("cpu-8"))
    prompt = torch.randint(0, 300, (1, 10), generator=torch.Generator().manual_seed(7))
    tokens = torch.randint(0, 300, (1, tree.size), generator=torch.Generator().manual_seed(8))
    for a, b in zip(prefill_and_step(fast, prompt, tree, tokens), prefill_and_step(slow, prompt, tree, tokens)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    with torch.no_grad():  # the modules' own forward over the views
        torch.testing.assert_close(fast.backbone(prompt).logits, slow.backbone(prompt).logits)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_fast_forward_decodes_hf_greedy(family):
    fast, _ = pair(tiny(family))
    tree = build_tree(load_tree("cpu-16"))
    for seed in range(2):
        prompt = torch.randint(0, 300, (1, 12), generator=torch.Generator().manual_seed(seed))
        reference = fast.backbone.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                                           max_new_tokens=40, eos_token_id=None)[0, 12:].tolist()
        stats = GenerationStats()
        drafter = OracleDrafter(tree, 12, reference, seed=seed, vocab_size=300)
        ours = [t for chunk in generate_ids(fast, prompt, drafter, max_new_tokens=40, stats=stats) for t in chunk]
        assert ours == reference
        assert stats.mean_accepted_length > 2


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_fast_forward_in_bf16_rounds_as_the_modules_do(family):
    """Bit for bit: the same roundings in the same order, so bf16 output agrees with HF's as often as before."""
    fast, slow = pair(tiny(family, torch.bfloat16))
    for tree in (build_tree(load_tree("cpu-8")), canonical_tree(())):  # a tree step, and one token
        prompt = torch.randint(0, 300, (1, 9), generator=torch.Generator().manual_seed(3))
        tokens = torch.randint(0, 300, (1, tree.size), generator=torch.Generator().manual_seed(4))
        for a, b in zip(prefill_and_step(fast, prompt, tree, tokens), prefill_and_step(slow, prompt, tree, tokens)):
            assert torch.equal(a, b)


def test_tapped_layers_come_out_as_through_the_modules():
    """An EAGLE-3 drafter reads the inputs of several layers: the fast forward returns them in the same order."""
    fast, slow = pair(tiny("llama"))
    for model in (fast, slow):
        tap_features(model.backbone, (0, 2))
    tree = build_tree(load_tree("chain-4"))
    prompt = torch.randint(0, 300, (1, 7), generator=torch.Generator().manual_seed(5))
    tokens = torch.randint(0, 300, (1, tree.size), generator=torch.Generator().manual_seed(6))
    ours, theirs = prefill_and_step(fast, prompt, tree, tokens), prefill_and_step(slow, prompt, tree, tokens)
    assert ours[3].shape[-1] == 3 * 64
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_other_models_keep_the_modules():
    gpt2 = AutoModelForCausalLM.from_config(AutoConfig.for_model("gpt2", n_embd=64, n_layer=2, n_head=4,
                                                                 vocab_size=300)).eval()
    assert "not a Llama-family" in supports(gpt2)
    assert not hasattr(MedusaModel.from_pretrained(None, base_model=gpt2).backbone, FAST_FORWARD)
    sliding = tiny("mistral")
    sliding.config.sliding_window = 16
    assert "sliding-window" in supports(sliding)
    quantized = MedusaModel.from_pretrained(None, base_model=tiny("llama"), quantize="int8").backbone
    assert not hasattr(quantized, FAST_FORWARD) and "quantized" in supports(quantized)


@pytest.mark.slow
def test_fast_forward_on_the_embedded_model_is_hf_greedy(backbone, references):
    """The packed, fused embedded model decoding through the fast forward in fp32: HF's greedy tokens."""
    model = MedusaModel.from_pretrained(base_model=EMBEDDED_MODEL)
    assert hasattr(model.backbone, FAST_FORWARD)
    for ids, reference in references[:3]:
        reference = reference[:64]
        for name, options in (("plain", {}), ("medusa+ngram", {"tree": "hydra-cpu-6"})):
            drafter = make_drafter(model, name, **options)
            ours = [t for chunk in generate_ids(model, ids, drafter, max_new_tokens=len(reference)) for t in chunk]
            assert ours == reference, name


@pytest.mark.slow
def test_fast_forward_on_the_embedded_model_in_bf16_rounds_as_the_modules_do(tokenizer, chat_prompts):
    """bf16 logits bit for bit, one-token steps included (transformers runs them with another attention kernel),
    so the output agrees with HF's bf16 greedy as often as before."""
    fast = MedusaModel.from_pretrained(base_model=EMBEDDED_MODEL, dtype=torch.bfloat16)
    slow = MedusaModel.from_pretrained(base_model=EMBEDDED_MODEL, dtype=torch.bfloat16, fast_forward=False)
    ids = encode_prompt(tokenizer, chat_prompts[0])
    caches = [TreeCache(m.backbone, 1, 512) for m in (fast, slow)]
    steps = [canonical_tree(())] * 3 + [build_tree(load_tree("hydra-cpu-6"))]
    with torch.no_grad():
        outputs = []
        for model, cache in zip((fast, slow), caches):
            positions, mask = cache.prefill_inputs([ids.shape[1]], ids.shape[1])
            outputs.append(backbone_forward(model.backbone, ids, cache.cache, positions, mask))
        for tree in steps:
            assert all(torch.equal(a, b) for a, b in zip(*outputs))
            tokens = outputs[1][0][:, -1:].argmax(-1).repeat(1, tree.size)
            outputs = []
            for model, cache in zip((fast, slow), caches):
                positions, mask = cache.tree_inputs(tree)
                outputs.append(backbone_forward(model.backbone, tokens, cache.cache, positions, mask))
                cache.commit([[0]])
        assert all(torch.equal(a, b) for a, b in zip(*outputs))
