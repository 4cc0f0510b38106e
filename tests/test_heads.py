import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from medusa_heads import EMBEDDED_MODEL, HEAD_TYPES, MedusaConfig, MedusaError, MedusaModel, NgramStore, load_heads
from medusa_heads.backbone import load_backbone
from medusa_heads.config import FORMAT_VERSION
from medusa_heads.model import check_fits, merge_adapter, untrained_heads


def tiny_heads(share_lm_head=True, head_type="medusa", **kw):
    config = MedusaConfig(base_model_name_or_path="tiny", num_heads=3, num_layers=2, hidden_size=16,
                          vocab_size=40, share_lm_head=share_lm_head, head_type=head_type, **kw)
    return HEAD_TYPES[head_type](config)


def test_untrained_heads_equal_the_backbone_lm_head(backbone):
    heads = untrained_heads(backbone, EMBEDDED_MODEL, num_heads=3)
    hidden = torch.randn(5, backbone.config.hidden_size)
    expected = backbone.get_output_embeddings()(hidden)
    logits = heads(hidden, lm_head=backbone.get_output_embeddings())
    assert logits.shape == (3, 5, backbone.config.vocab_size)
    for k in range(3):  # equal up to the matmul's summation order, which BLAS picks by shape and load
        torch.testing.assert_close(logits[k], expected, rtol=0, atol=1e-4)
    own = untrained_heads(backbone, EMBEDDED_MODEL, num_heads=2, share_lm_head=False)
    assert torch.allclose(own(hidden), expected.expand(2, -1, -1), atol=1e-5)


def test_untrained_hydra_heads_with_a_draft_vocabulary_are_the_lm_head_on_those_tokens(backbone):
    vocab = torch.tensor([5, 900, 17, 3000])
    heads = untrained_heads(backbone, EMBEDDED_MODEL, num_heads=2, head_type="hydra", draft_vocab=vocab)
    model = MedusaModel(backbone, heads)
    hidden = torch.randn(backbone.config.hidden_size)
    paths = torch.tensor([[1, 2], [3, 4]])  # two depth-1 nodes: the untrained path mix is zero
    tokens, logprobs = model.head_topk(hidden, paths, k=2)
    full = backbone.get_output_embeddings()(hidden)[vocab]
    expected = vocab[full.topk(2).indices]
    assert tokens.tolist() == [expected.tolist()] * 2
    assert torch.allclose(logprobs[0], torch.log_softmax(full, -1).topk(2).values)
    with pytest.raises(ValueError, match="token_embeds"):
        heads.head_state(0, hidden)


def test_hydra_heads_read_the_path():
    torch.manual_seed(0)
    heads = tiny_heads(head_type="hydra")
    for p in heads.parameters():
        p.data.normal_()
    x, embeds = torch.randn(16), torch.randn(2, 3, 16)
    # head 1 reads the first two tokens only: changing the third leaves it alone, changing the second does not
    changed = embeds.clone()
    changed[:, 2] += 1
    assert torch.equal(heads.head_state(1, x, embeds), heads.head_state(1, x, changed))
    changed[:, 1] += 1
    assert not torch.allclose(heads.head_state(1, x, embeds), heads.head_state(1, x, changed))


def test_each_block_is_its_own_module():
    heads = tiny_heads()
    params = [p for block in heads.blocks for p in block.parameters()]
    assert len({id(p) for p in params}) == 3 * 2 * 2
    heads.blocks[0][0].weight.data.fill_(1.0)
    assert heads.blocks[0][1].weight.abs().sum() == 0 and heads.blocks[1][0].weight.abs().sum() == 0


@pytest.mark.parametrize("share_lm_head,head_type,draft_vocab_size",
                         [(True, "medusa", None), (False, "medusa", None), (True, "hydra", 7), (False, "hydra", None)])
def test_save_load_round_trip(tmp_path, share_lm_head, head_type, draft_vocab_size):
    torch.manual_seed(0)
    heads = tiny_heads(share_lm_head, head_type=head_type, draft_vocab_size=draft_vocab_size)
    for p in heads.parameters():
        p.data.normal_()
    if draft_vocab_size:
        heads.set_draft_vocab(torch.randperm(40)[:draft_vocab_size])
    heads.save_pretrained(tmp_path)
    saved = load_file(tmp_path / "model.safetensors")
    assert any("lm_heads" in k for k in saved) == (not share_lm_head)
    assert any("mixers" in k for k in saved) == (head_type == "hydra")
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["base_model_name_or_path"] == "tiny" and config["format_version"] == FORMAT_VERSION
    loaded = load_heads(tmp_path)
    if draft_vocab_size:
        assert torch.equal(loaded.draft_vocab, heads.draft_vocab)
    lm_head = torch.nn.Linear(16, 40, bias=False)
    x, embeds = torch.randn(4, 16), torch.randn(4, 3, 16)
    projection = heads.output_projection(lm_head)
    assert torch.equal(heads(x, projection, embeds), loaded(x, loaded.output_projection(lm_head), embeds))
    ignore = {"_name_or_path"}
    assert {k: v for k, v in loaded.config.to_dict().items() if k not in ignore} == {
        k: v for k, v in heads.config.to_dict().items() if k not in ignore}


def test_missing_and_unexpected_weights_fail_loudly(tmp_path):
    tiny_heads().save_pretrained(tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    weights.pop("blocks.2.1.weight")
    weights["blocks.9.0.weight"] = torch.zeros(16, 16)
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(MedusaError, match="do not match"):
        load_heads(tmp_path)


def test_corrupted_and_missing_folders(tmp_path):
    tiny_heads().save_pretrained(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(MedusaError, match="Cannot load Medusa heads"):
        load_heads(tmp_path)
    with pytest.raises(MedusaError, match="does not exist"):
        load_heads(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(MedusaError, match="no config.json"):
        load_heads(tmp_path / "empty")


def test_newer_format_is_refused(tmp_path):
    tiny_heads().save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["format_version"] = 99
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(MedusaError, match="upgrade medusa-heads"):
        load_heads(tmp_path)


def test_heads_that_do_not_fit_the_backbone(backbone):
    with pytest.raises(MedusaError, match=r"hidden size 16 vs the backbone's 576; vocabulary 40 vs the backbone's 49152"):
        check_fits(tiny_heads(), backbone)
    with pytest.raises(MedusaError, match="do not fit"):
        MedusaModel(backbone, tiny_heads())


def test_an_unknown_head_type_is_a_one_line_error(tmp_path):
    tiny_heads().save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["head_type"] = "cerberus"
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(MedusaError, match="Unknown head type `cerberus`; use one of medusa, hydra, eagle"):
        load_heads(tmp_path)


def test_a_head_type_refuses_a_config_it_cannot_hold():
    with pytest.raises(ValueError, match="does not match HydraHeads"):
        HEAD_TYPES["hydra"](MedusaConfig(hidden_size=16, vocab_size=40))
    with pytest.raises(ValueError, match="needs `share_lm_head=True`"):
        HEAD_TYPES["eagle"](MedusaConfig(head_type="eagle", hidden_size=16, vocab_size=40, share_lm_head=False,
                                         decoder_config={"model_type": "llama"}))


def test_loaders_keep_the_modelling_code(tiny_backbone, tmp_path):
    """transformers 5 swaps layers for kernels fetched from the hub unless told not to (on a GPU; offline it fails
    there): the backbone and heads loaders turn that off."""
    backbone = load_backbone(str(tiny_backbone))
    untrained_heads(backbone, str(tiny_backbone), num_heads=2).save_pretrained(tmp_path)
    assert not backbone.use_kernels
    assert not load_heads(tmp_path).use_kernels


def test_model_save_pretrained_is_the_inverse_of_from_pretrained(tiny_backbone, tmp_path):
    """Heads, the LoRA adapter merged into the backbone (Medusa-2) and the n-gram store come back as they were."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    backbone = load_backbone(str(tiny_backbone))
    vocab = backbone.get_output_embeddings().weight.shape[0]
    heads = untrained_heads(backbone, str(tiny_backbone), num_heads=2, head_type="hydra",
                            draft_vocab=torch.randperm(vocab)[:64])
    for p in heads.parameters():
        p.data.normal_(std=0.1)
    adapted = get_peft_model(backbone, LoraConfig(r=2, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    merged, adapter = merge_adapter(adapted)
    store = NgramStore.build([[1, 2, 3, 1, 2, 3, 4], [5, 6, 5, 6]], vocab, max_n=2, min_count=1)
    model = MedusaModel(merged, heads, adapter, store)

    saved = model.save_pretrained(tmp_path / "heads")
    assert sorted(p.name for p in saved.iterdir()) == ["adapter", "config.json", "model.safetensors",
                                                      "ngram_store.safetensors"]
    loaded = MedusaModel.from_pretrained(saved)  # the backbone named in the heads' config, adapter merged in
    assert set(loaded.heads.state_dict()) == set(heads.state_dict())
    for name, tensor in heads.state_dict().items():
        assert torch.equal(loaded.heads.state_dict()[name], tensor), name
    for name, tensor in merged.state_dict().items():
        torch.testing.assert_close(loaded.backbone.state_dict()[name], tensor, rtol=0, atol=1e-6, msg=name)
    assert loaded.ngram_store.tables.keys() == store.tables.keys()
    for n, (keys, nexts) in store.tables.items():
        again = loaded.ngram_store.tables[n]
        assert torch.equal(again[0], keys) and torch.equal(again[1], nexts)
    ids = torch.tensor([[1, 5, 9, 2]])
    assert torch.equal(loaded.backbone(ids).logits, merged(ids).logits)
    assert not torch.equal(load_backbone(str(tiny_backbone))(ids).logits, merged(ids).logits)  # the adapter counts

    model.save_pretrained(saved)  # saving over an existing folder replaces it whole
    assert not list(tmp_path.glob(".*"))
