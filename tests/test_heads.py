import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from medusa_heads import EMBEDDED_MODEL, MedusaConfig, MedusaError, MedusaHeads, MedusaModel, load_heads
from medusa_heads.model import check_fits, untrained_heads


def tiny_heads(share_lm_head=True, **kw):
    config = MedusaConfig(base_model_name_or_path="tiny", num_heads=3, num_layers=2, hidden_size=16,
                          vocab_size=40, share_lm_head=share_lm_head, **kw)
    return MedusaHeads(config)


def test_untrained_heads_equal_the_backbone_lm_head(backbone):
    heads = untrained_heads(backbone, EMBEDDED_MODEL, num_heads=3)
    hidden = torch.randn(5, backbone.config.hidden_size)
    expected = backbone.get_output_embeddings()(hidden)
    logits = heads(hidden, lm_head=backbone.get_output_embeddings())
    assert logits.shape == (3, 5, backbone.config.vocab_size)
    for k in range(3):
        assert torch.equal(logits[k], expected)
    own = untrained_heads(backbone, EMBEDDED_MODEL, num_heads=2, share_lm_head=False)
    assert torch.allclose(own(hidden), expected.expand(2, -1, -1), atol=1e-5)


def test_each_block_is_its_own_module():
    heads = tiny_heads()
    params = [p for block in heads.blocks for p in block.parameters()]
    assert len({id(p) for p in params}) == 3 * 2 * 2
    heads.blocks[0][0].weight.data.fill_(1.0)
    assert heads.blocks[0][1].weight.abs().sum() == 0 and heads.blocks[1][0].weight.abs().sum() == 0


@pytest.mark.parametrize("share_lm_head", [True, False])
def test_save_load_round_trip(tmp_path, share_lm_head):
    torch.manual_seed(0)
    heads = tiny_heads(share_lm_head)
    for p in heads.parameters():
        p.data.normal_()
    heads.save_pretrained(tmp_path)
    saved = load_file(tmp_path / "model.safetensors")
    assert any("lm_heads" in k for k in saved) == (not share_lm_head)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["base_model_name_or_path"] == "tiny" and config["format_version"] == 1
    loaded = load_heads(tmp_path)
    lm_head = torch.nn.Linear(16, 40, bias=False)
    x = torch.randn(4, 16)
    assert torch.equal(heads(x, lm_head=lm_head), loaded(x, lm_head=lm_head))
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
