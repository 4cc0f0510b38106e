"""Linear layers packed for oneDNN: the same module and parameters, the same numbers (bit-identical in bf16), sibling
layers sharing one product without changing a bit; the bf16 panel products against fp32 sums, bit for bit whatever
the rows and the stacking, inside a compiled graph too; and tree decoding on a packed fp32 model (with `sdpa_tree_gqa` attention) still gives HF `generate`'s greedy output on the stock model."""

import pytest
import torch
from torch import nn

from medusa_heads import EMBEDDED_MODEL, MedusaModel
from medusa_heads.model import SHIPPED_HEADS
from medusa_heads.inference import make_drafter
from medusa_heads.errors import MedusaError
from medusa_heads.packing import (PRODUCTS_VARIABLE, PackedLinear, SiblingLinear, can_pack, fuse_siblings, pack_linears,
                                   pack_weight, packed_product, stock_linears, uses_panels)

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


class TwoReaders(nn.Module):
    """Two linear layers reading one input; `scale_between` modifies that input in place between their calls."""

    def __init__(self, scale_between: bool = False):
        super().__init__()
        self.norm, self.a, self.b = nn.LayerNorm(8), nn.Linear(8, 5), nn.Linear(8, 3)
        self.scale_between = scale_between
        self.requires_grad_(False)

    def forward(self, x):
        x = self.norm(x)
        a = self.a(x)
        if self.scale_between:
            x.mul_(2)
        return torch.cat([a, self.b(x)], -1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sibling_layers_of_a_llama_share_one_product_bit_for_bit(dtype):
    from transformers import LlamaConfig, LlamaForCausalLM
    if not can_pack("cpu", dtype):
        pytest.skip(f"this CPU does not pack {dtype}")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)
    model = LlamaForCausalLM(config).to(dtype).eval().requires_grad_(False)
    ids = torch.randint(0, 64, (2, 9))
    pack_linears(model)
    expected = model(ids).logits
    assert fuse_siblings(model, lambda: model(ids[:, :3]).logits) == 2 * config.num_hidden_layers  # q/k/v, gate/up
    layer = model.model.layers[0]
    assert {type(m) for m in (layer.self_attn.q_proj, layer.self_attn.v_proj, layer.mlp.up_proj)} == {SiblingLinear}
    assert type(layer.self_attn.o_proj) is PackedLinear and type(model.lm_head) is PackedLinear
    with torch.no_grad():
        assert torch.equal(model(ids).logits, expected)
    with torch.inference_mode():
        assert torch.equal(model(ids).logits, expected)
    with stock_linears(model):
        assert type(layer.self_attn.q_proj) is nn.Linear
    assert type(layer.self_attn.q_proj) is SiblingLinear


def test_a_sibling_given_another_input_or_a_modified_one_computes_its_own_product():
    model = TwoReaders()
    x = torch.randn(4, 8)
    pack_linears(model)
    assert fuse_siblings(model, lambda: model(x)) == 1
    other = torch.randn(4, 8)
    torch.testing.assert_close(model.b(other), other @ model.b.weight.T + model.b.bias)
    model.scale_between = True  # with autograd's version counter, the modified input is seen and recomputed
    with torch.no_grad():
        y = model.norm(x)
        torch.testing.assert_close(model(x)[:, 5:], (2 * y) @ model.b.weight.T + model.b.bias)


def test_fusion_that_would_change_the_output_is_undone():
    model = TwoReaders(scale_between=True)
    x = torch.randn(4, 8)
    pack_linears(model)
    with torch.inference_mode():  # inference tensors have no version counter: only the trial's check can tell
        expected = model(x)
        assert fuse_siblings(model, lambda: model(x)) == 0
        assert type(model.a) is PackedLinear and torch.equal(model(x), expected)


def test_layers_that_train_stay_unpacked():
    model, _ = tied_model(torch.float32)
    model[0].requires_grad_(True)
    assert pack_linears(model) == 2 and type(model[0]) is nn.Linear


def test_a_packed_fp32_model_decodes_exactly_as_hf_on_the_stock_model(references, backbone):
    model = MedusaModel.from_pretrained(None, EMBEDDED_MODEL, dtype=torch.float32)  # packed by default
    assert any(type(m) is PackedLinear for m in model.backbone.modules())
    assert any(type(m) is SiblingLinear for m in model.backbone.modules())
    assert model.backbone.config._attn_implementation == "sdpa_tree_gqa"
    for name, tree in (("medusa+ngram", "cpu-16"), ("medusa", "cpu-8")):
        assert_exact(model, backbone, references[:3], make_drafter(model, name, tree=tree))


def test_a_loaded_eagle_drafter_is_frozen_and_packed_and_still_decodes_exactly(references, backbone):
    """The drafter's own layers (its fc and decoder layer) are packed like the backbone's: every drafting step reads
    them once per depth."""
    eagle = SHIPPED_HEADS[EMBEDDED_MODEL].parent / "smollm2-135m-embedded-eagle"
    model = MedusaModel.from_pretrained(eagle, dtype=torch.float32)
    linears = [m for m in model.heads.modules() if isinstance(m, nn.Linear)]
    assert len(linears) == 8 and all(type(m) is PackedLinear for m in linears)  # fc and the layer's 7
    assert not any(p.requires_grad for p in model.heads.parameters())
    assert_exact(model, backbone, references[:2], make_drafter(model, "medusa", tree="eagle-cpu-16"))
    unpacked = MedusaModel.from_pretrained(eagle, dtype=torch.float32, pack_weights=False)
    assert not any(type(m) is PackedLinear for m in unpacked.heads.modules())


def panels_or_skip():
    from medusa_heads.cpu_ops import panel_products
    if not panel_products():
        pytest.skip("no AVX512-BF16 panel products on this CPU (or no compiler)")


@pytest.mark.parametrize("bias", [False, True])
def test_panel_products_are_bf16_products_whatever_the_rows_and_the_stacking(monkeypatch, bias):
    """Each output is the fp32 sum of its bf16 products rounded once (within bf16's rounding of the fp32 reference),
    and its bits depend on its own row and column only: the same for one row or 40, alone or stacked with siblings."""
    panels_or_skip()
    monkeypatch.setenv(PRODUCTS_VARIABLE, "panels")
    torch.manual_seed(0)
    q, k = torch.randn(128, 576, dtype=torch.bfloat16), torch.randn(64, 576, dtype=torch.bfloat16)
    b = torch.randn(192, dtype=torch.bfloat16) if bias else None
    stacked = pack_weight(torch.cat([q, k]))
    assert not stacked.is_mkldnn and stacked.shape == (3, 288, 64, 2)
    x = torch.randn(2, 40, 576, dtype=torch.bfloat16)
    got = packed_product(x, stacked, b)
    reference = x.float() @ torch.cat([q, k]).float().T + (0 if b is None else b.float())
    assert got.shape == (2, 40, 192)
    torch.testing.assert_close(got.float(), reference, rtol=8e-3, atol=0.05)
    for rows in (1, 5, 6, 7, 13):
        assert torch.equal(packed_product(x[:, :rows], stacked, b), got[:, :rows])
    alone = packed_product(x, pack_weight(k), None if b is None else b[128:])
    assert torch.equal(alone, got[..., 128:])


def test_the_products_variable_chooses_the_layout(monkeypatch):
    weight = torch.randn(64, 32, dtype=torch.bfloat16)
    monkeypatch.setenv(PRODUCTS_VARIABLE, "onednn")
    if can_pack("cpu", torch.bfloat16):
        assert pack_weight(weight).is_mkldnn
    monkeypatch.setenv(PRODUCTS_VARIABLE, "fastest")
    with pytest.raises(MedusaError, match="use auto, onednn or panels"):
        pack_weight(weight)
    monkeypatch.setenv(PRODUCTS_VARIABLE, "panels")
    assert not uses_panels(torch.randn(60, 32, dtype=torch.bfloat16))  # not whole panels: oneDNN's
    assert not uses_panels(torch.randn(64, 32))  # fp32: oneDNN's


def test_a_compiled_graph_calls_panel_products_by_index(monkeypatch):
    """Inside a compiled step a product is `packed_linear` on the weight's index; with a panel weight it gives the
    eager panel product's bits."""
    from medusa_heads.compiled_llama import OpaqueProduct
    from medusa_heads.fast_llama import Product
    panels_or_skip()
    monkeypatch.setenv(PRODUCTS_VARIABLE, "panels")
    weight, bias = torch.randn(128, 64, dtype=torch.bfloat16), torch.randn(128, dtype=torch.bfloat16)
    eager = Product(128, bias, packed=pack_weight(weight))
    opaque = OpaqueProduct(eager)
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    compiled = torch.compile(lambda x: torch.nn.functional.silu(opaque(x)), fullgraph=True)
    assert torch.equal(compiled(x), torch.nn.functional.silu(eager(x)))
