"""Tree decoding through transformers' public interfaces works beyond Llama: tiny random models of several
architectures, exact against their own HF greedy `generate`; the hidden state the heads read is the model's own."""

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from medusa_heads import MedusaModel
from medusa_heads.errors import MedusaError
from medusa_heads.backbone import backbone_forward, compile_backbone, load_backbone
from medusa_heads.inference import GenerationStats, generate_ids, make_drafter
from medusa_heads.model import untrained_heads
from medusa_heads.packing import PackedLinear
from medusa_heads.tree import build_tree, load_tree

from test_decoding import OracleDrafter  # noqa: E402  (pytest puts tests/ on sys.path)

ARCHITECTURES = {
    "llama": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256),
    "qwen2": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256),
    "gpt2": dict(n_embd=64, n_layer=2, n_head=4, n_positions=256),
    "mistral": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, max_position_embeddings=256, sliding_window=None),
}


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_tree_decoding_is_exact_on(arch):
    torch.manual_seed(0)
    config = AutoConfig.for_model(arch, vocab_size=300, **ARCHITECTURES[arch])
    backbone = AutoModelForCausalLM.from_config(config).eval()
    backbone.generation_config.eos_token_id = None
    model = MedusaModel(backbone, untrained_heads(backbone, arch, num_heads=4))
    ids = torch.randint(0, 300, (1, 9), generator=torch.Generator().manual_seed(9))
    logits, hidden = backbone_forward(backbone, ids, None)
    full = backbone(input_ids=ids, output_hidden_states=True)
    assert torch.equal(hidden, full.hidden_states[-1]) and torch.equal(logits, full.logits)
    tree = build_tree(load_tree("cpu-16"))
    for seed in range(3):
        prompt = torch.randint(0, 300, (1, 12), generator=torch.Generator().manual_seed(seed))
        reference = backbone.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                                      max_new_tokens=40, eos_token_id=None)[0, 12:].tolist()
        drafter = OracleDrafter(tree, 12, reference, seed=seed, vocab_size=300)
        stats = GenerationStats()
        ours = [t for chunk in generate_ids(model, prompt, drafter, max_new_tokens=40, stats=stats) for t in chunk]
        assert ours == reference
        assert stats.mean_accepted_length > 2  # long paths were accepted, on random branches


def test_compiling_a_backbone_packed_for_onednn_is_a_one_line_error(tiny_backbone):
    model = MedusaModel.from_pretrained(None, base_model=load_backbone(str(tiny_backbone)))
    if not any(isinstance(m, PackedLinear) for m in model.backbone.modules()):
        pytest.skip("this torch build packs nothing")
    with pytest.raises(MedusaError, match="load the model with `pack_weights=False` to compile it"):
        compile_backbone(model.backbone)


@pytest.mark.slow
def test_a_compiled_backbone_decodes_what_the_eager_one_does(tiny_backbone):
    """`compile_backbone` (inductor, dynamic sizes): tree steps of varying size and cache windows, same tokens."""
    eager = MedusaModel.from_pretrained(None, base_model=load_backbone(str(tiny_backbone)))
    compiled = MedusaModel(load_backbone(str(tiny_backbone)), eager.heads)
    compile_backbone(compiled.backbone)
    prompt = torch.tensor([[1, 5, 9, 14, 5, 9]])
    outputs = []
    for model in (eager, compiled):
        drafter = make_drafter(model, "medusa+ngram", tree="cpu-8")  # two tree sizes: with and without the chain
        outputs.append([t for chunk in generate_ids(model, prompt, drafter, max_new_tokens=80) for t in chunk])
    assert outputs[0] == outputs[1] and len(outputs[0]) == 80
