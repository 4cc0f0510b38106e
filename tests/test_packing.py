"""Linear layers packed for oneDNN: the same module and parameters, the same numbers (bit-identical in bf16), and
tree decoding on a packed fp32 model (with `sdpa_tree_gqa` attention) still gives HF `generate`'s greedy output on the stock model."""

import pytest
import torch
from torch import nn

from medusa_heads import EMBEDDED_MODEL, MedusaModel
from medusa_heads.inference import make_drafter
from medusa_heads.packing import PackedLinear, can_pack, pack_linears, stock_linears

from oracle import assert_exact  # noqa: E402

pytestmark = pytest.mark.skipif(not can_pack("cpu", torch.float32), reason="this torch build has no oneDNN packing")


def tied_model(dtype):
    torch.manual_seed(0)
    embed = nn.Embedding(50, 24).to(dtype).requires_grad_(False)
    model = nn.Sequential(nn.Linear(24, 32), nn.SiLU(), nn.Linear(32, 24, bias=False), nn.Linear(24, 50, bias=False))
    model.to(dtype).requires_grad_(False)
    model[3].weight = embed.weight  # an LM head tied to the embedding
    return model, embed


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_linears_compute_what_nn_linear_computes(dtype):
    if not can_pack("cpu", dtype):
        pytest.skip(f"this CPU does not pack {dtype}")
    model, embed = tied_model(dtype)
    x = torch.randn(2, 7, 24, dtype=dtype)
    expected, keys = model(x), list(model.state_dict())
    assert pack_linears(model) == 3
    assert all(type(m) is PackedLinear for m in (model[0], model[2], model[3]))
    assert model[3].weight is embed.weight and list(model.state_dict()) == keys
    got = model(x)
    if dtype == torch.bfloat16:
        assert torch.equal(got, expected)
    else:
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    with stock_linears(model):
        assert type(model[0]) is nn.Linear and torch.equal(model(x), expected)
    assert type(model[0]) is PackedLinear


def test_layers_that_train_stay_unpacked():
    model, _ = tied_model(torch.float32)
    model[0].requires_grad_(True)
    assert pack_linears(model) == 2 and type(model[0]) is nn.Linear


def test_a_packed_fp32_model_decodes_exactly_as_hf_on_the_stock_model(references, backbone):
    model = MedusaModel.from_pretrained(None, EMBEDDED_MODEL, dtype=torch.float32)  # packed by default
    assert any(type(m) is PackedLinear for m in model.backbone.modules())
    assert model.backbone.config._attn_implementation == "sdpa_tree_gqa"
    for name, tree in (("medusa+ngram", "cpu-16"), ("medusa", "cpu-8")):
        assert_exact(model, backbone, references[:3], make_drafter(model, name, tree=tree))
