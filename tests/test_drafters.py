"""Drafters without heads (prompt lookup, a draft model, early exit) behind the same verifier: exact in fp32."""

import json

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from medusa_heads import MedusaError, MedusaModel
from medusa_heads.inference import DraftModelDrafter, EarlyExitDrafter, NgramDrafter, make_drafter
from medusa_heads.inference.drafters.draft_model import early_exit_model
from medusa_heads.model import untrained_heads

from test_architectures import ARCHITECTURES  # noqa: E402  (pytest puts tests/ on sys.path)
from test_cli import assert_clean_error, run_cli  # noqa: E402
from oracle import assert_exact, decode  # noqa: E402

NEW_TOKENS = 48


def test_ngram_drafter_is_exact(model, backbone, references):
    stats = assert_exact(model, backbone, references[:3], NgramDrafter(6), NEW_TOKENS)
    assert max(s.mean_accepted_length for s in stats) > 1.0


def test_early_exit_drafter_is_exact(model, backbone, references):
    assert_exact(model, backbone, references[:3], EarlyExitDrafter(model, exit_layer=10, length=3), NEW_TOKENS)


def test_the_backbone_as_its_own_draft_model_is_always_accepted(model, backbone, references):
    """A strong check of the cache syncing: a draft model equal to the backbone must never be rejected."""
    length = 4
    for stats in assert_exact(model, backbone, references[:3], DraftModelDrafter(model, backbone, length), NEW_TOKENS):
        assert all(n == length + 1 for n in stats.accepted_lengths[:-1]), stats.accepted_lengths
        assert stats.head_acceptance == [1.0] * (length - 1) + [stats.head_acceptance[-1]]


def test_a_random_draft_model_with_the_same_vocabulary_stays_exact(model, backbone, references):
    torch.manual_seed(0)
    tiny = LlamaForCausalLM(LlamaConfig(vocab_size=49152, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=2, num_key_value_heads=1)).eval()
    assert_exact(model, backbone, references[:2], DraftModelDrafter(model, tiny, length=3), NEW_TOKENS)


def test_early_exit_shares_the_backbones_weights(backbone):
    cut = early_exit_model(backbone, 6)
    assert len(cut.model.layers) == cut.config.num_hidden_layers == 6
    assert len(backbone.model.layers) == backbone.config.num_hidden_layers == 30  # the backbone is untouched
    backbone_storage = {p.data_ptr() for p in backbone.parameters()}
    assert all(p.data_ptr() in backbone_storage for p in cut.parameters())
    assert cut.get_output_embeddings() is backbone.get_output_embeddings() and cut.model.norm is backbone.model.norm


@pytest.mark.parametrize("arch", ["gpt2", "qwen2"])
def test_early_exit_on_other_architectures(arch):
    torch.manual_seed(0)
    layers = "n_layer" if arch == "gpt2" else "num_hidden_layers"
    config = AutoConfig.for_model(arch, vocab_size=300, **{**ARCHITECTURES[arch], layers: 3})
    backbone = AutoModelForCausalLM.from_config(config).eval()
    model = MedusaModel(backbone, untrained_heads(backbone, arch))
    prompt = torch.randint(0, 300, (1, 12), generator=torch.Generator().manual_seed(0))
    reference = backbone.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                                  max_new_tokens=32, eos_token_id=None)[0, 12:].tolist()
    assert decode(model, prompt, EarlyExitDrafter(model, exit_layer=2, length=3), max_new_tokens=32) == reference


def test_bad_drafter_options(model):
    with pytest.raises(MedusaError, match="between 1 and 29"):
        EarlyExitDrafter(model, exit_layer=30)
    with pytest.raises(MedusaError, match="at least 1"):
        NgramDrafter(0)
    with pytest.raises(MedusaError, match="must be an integer >= 1"):
        make_drafter(model, "medusa+ngram", draft_length=0)
    other = LlamaForCausalLM(LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1))
    with pytest.raises(MedusaError, match="vocabulary"):
        DraftModelDrafter(model, other)
    with pytest.raises(MedusaError, match="needs `draft_model`"):
        make_drafter(model, "draft-model")
    with pytest.raises(MedusaError, match="Unknown drafter"):
        make_drafter(model, "lookahead")


@pytest.mark.slow  # the real model in a subprocess
@pytest.mark.parametrize("drafter", [["ngram"], ["early-exit", "--exit-layer", "8"],
                                     ["draft-model", "--draft-model", "smollm2-135m-embedded"]])
def test_generate_json_with(drafter):
    result = run_cli("generate", "--prompt", "Name three colors.", "--max-new-tokens", "12", "--json",
                     "--draft-length", "3", "--drafter", *drafter)
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert out["new_tokens"] == 12 and out["drafter"] == drafter[0] and out["tree_nodes"] == 4
    if drafter[0] == "draft-model":  # the backbone drafting for itself
        assert out["mean_accepted_length"] > 3.0


@pytest.mark.parametrize("drafter, length", [("medusa", "4"), ("dynamic", "4"), ("medusa+ngram", "0")])
def test_draft_length_needs_a_chain(cli, drafter, length):
    assert_clean_error(cli("generate", "--prompt", "hi", "--drafter", drafter, "--draft-length", length),
                       "`draft_length` (--draft-length")


@pytest.mark.slow  # the real model in a subprocess
def test_generate_errors_for_drafter_options():
    assert_clean_error(run_cli("generate", "--prompt", "hi", "--drafter", "early-exit"), "--exit-layer")
    assert_clean_error(run_cli("generate", "--prompt", "hi", "--drafter", "draft-model", "--draft-model",
                               "/no/such/model"), "Cannot load the backbone")
