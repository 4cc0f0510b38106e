"""An int8 or int4 backbone (`medusa_heads/quantize.py`): the weights are quantized, packing leaves them alone, and
greedy tree decoding on it is HF `generate`'s greedy output on the same quantized model (fp32 activations). Int8 or
int4 drafting weights leave the backbone, and so the output, as they are."""

import pytest
import torch
from torch import nn

from medusa_heads import EMBEDDED_MODEL, MedusaModel, load_backbone
from medusa_heads.errors import MedusaError
from medusa_heads.inference import make_drafter
from medusa_heads.inference.generate import encode_prompt
from medusa_heads.model import load_heads, save_heads, untrained_heads
from medusa_heads.packing import PackedLinear, stock_linears
from medusa_heads.quantize import (DEQUANTIZED_ROWS, GROUP_SIZE, Int4Linear, Int8Linear, QUANTIZED_LAYERS,
                                   QuantizedLinear, draft_weights_quantization, quantization_of, quantize_backbone,
                                   quantize_draft_weights)
from medusa_heads.training.recipe import load_recipe
from medusa_heads.training.trainer import train

from conftest import MEDUSA_HEADS, SHIPPED_HEADS  # noqa: E402
from oracle import assert_exact, hf_greedy  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_linear_computes_with_its_int8_weights(dtype):
    torch.manual_seed(0)
    linear = nn.Linear(64, 48).to(dtype).requires_grad_(False)
    layer = Int8Linear(linear)
    assert layer.qweight.dtype == torch.int8 and layer.scales.dtype == dtype
    weight = layer.dequantized(dtype)
    rounding = 0.51 if dtype == torch.float32 else 1.0  # half a step, plus bf16's own rounding of the product
    assert (weight.float() - linear.weight.float()).abs().max() <= layer.scales.float().max() * rounding
    for rows in (1, 5, DEQUANTIZED_ROWS, 40):  # the int8 kernel, then the de-quantised weight
        x = torch.randn(rows, 64, dtype=dtype)
        tol = 1e-5 if dtype == torch.float32 else 3e-2
        torch.testing.assert_close(layer(x[None])[0], x @ weight.T + linear.bias, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int4_linear_computes_with_its_4bit_weights(dtype):
    torch.manual_seed(0)
    linear = nn.Linear(4 * GROUP_SIZE, 48).to(dtype).requires_grad_(False)
    layer = Int4Linear(linear)
    assert layer.packed.dtype == layer.codes.dtype == torch.uint8 and layer.codes.shape == (48, 2 * GROUP_SIZE)
    weight = layer.dequantized(torch.float32)
    groups = linear.weight.float().reshape(48, 4, GROUP_SIZE)
    step = (groups.amax(-1) - groups.amin(-1)) / 15  # one code's width in each group
    error = (weight - linear.weight.float()).reshape(48, 4, GROUP_SIZE).abs().amax(-1)
    assert (error <= 0.51 * step + 0.01 * groups.abs().amax(-1)).all()  # half a step, plus bf16 scales and zeros
    for rows in (1, 5, DEQUANTIZED_ROWS, 40):  # the int4 kernel (bf16 activations), then the de-quantised weight
        x = torch.randn(rows, 4 * GROUP_SIZE, dtype=dtype)
        out = layer(x[None])[0]
        assert out.dtype == dtype
        expected = x.float() @ weight.T + linear.bias.float()
        torch.testing.assert_close(out.float(), expected, rtol=3e-2, atol=3e-2)


def quantized_model(folder, quantize: str, dtype=torch.float32) -> MedusaModel:
    return MedusaModel.from_pretrained(None, base_model=load_backbone(str(folder), dtype=dtype), quantize=quantize)


@pytest.mark.parametrize("quantize", ["int8", "int4"])
def test_the_decoder_is_quantized_and_packing_keeps_the_lm_head(tiny_backbone, quantize):
    model = quantized_model(tiny_backbone, quantize)
    decoder = model.backbone.get_decoder()
    layers = [m for m in decoder.modules() if isinstance(m, QUANTIZED_LAYERS[quantize])]
    assert len(layers) == 2 * 7 and not any(isinstance(m, nn.Linear) for m in decoder.modules())
    assert type(model.backbone.get_output_embeddings()) is PackedLinear  # the float LM head is still packed
    assert quantization_of(model.backbone) == quantize
    float_bytes = sum(m.in_features * m.out_features * 4 for m in layers)
    quantized_bytes = sum(b.numel() * b.element_size() for m in layers for b in m.buffers())
    assert quantized_bytes < 0.3 * float_bytes  # int4: the kernel's layout and a plain copy, 1.1 bytes a weight


@pytest.mark.parametrize("quantize", ["int8", "int4"])
def test_tree_decoding_on_a_quantized_backbone_is_hf_greedy_on_the_same_model(tiny_backbone, quantize):
    model = quantized_model(tiny_backbone, quantize)
    torch.manual_seed(1)
    prompts = [torch.randint(3, 400, (1, n)) for n in (10, DEQUANTIZED_ROWS + 8)]  # both kernels in the prefill
    with stock_linears(model.backbone):  # HF `generate` as users run it: the LM head unpacked, the quantized layers
        references = [(ids, hf_greedy(model.backbone, ids, 40)) for ids in prompts]
    # untrained heads guess right only by chance; the float model as a draft model guesses right often
    drafters = [make_drafter(model, "medusa", tree="cpu-8"), make_drafter(model, "medusa+ngram", tree="cpu-16"),
                make_drafter(model, "draft-model", draft_model=str(tiny_backbone))]
    near_tie = 0.0 if quantize == "int8" else 0.05  # as below
    longest = [max(s.accepted_lengths) for drafter in drafters
               for s in assert_exact(model, model.backbone, references, drafter, 40, near_tie=near_tie)]
    assert max(longest) > 2  # several tokens were verified in one forward and committed, not one a step


def random_eagle3_folder(backbone_folder, folder):
    """A saved random EAGLE-3 drafter: linear layers to quantize (Medusa and Hydra heads keep their blocks in plain
    parameters) whose guesses depend on their weights."""
    torch.manual_seed(0)
    heads = untrained_heads(load_backbone(str(backbone_folder)), str(backbone_folder), 4, share_lm_head=False,
                            head_type="eagle3")
    for name, p in heads.named_parameters():
        if "norm" not in name:
            p.data.normal_(std=0.1)
    return save_heads(folder, heads)


@pytest.mark.parametrize("quantize", ["int8", "int4"])
def test_quantized_draft_weights_leave_the_backbone_and_its_greedy_output_alone(tiny_backbone, tmp_path, quantize):
    folder = random_eagle3_folder(tiny_backbone, tmp_path / "heads")
    model = MedusaModel.from_pretrained(folder, base_model=str(tiny_backbone), quantize_drafter=quantize)
    float_model = MedusaModel.from_pretrained(folder, base_model=str(tiny_backbone))
    drafting = [m for m in model.heads.modules() if isinstance(m, (nn.Linear, QuantizedLinear, PackedLinear))]
    assert drafting and all(type(m) is QUANTIZED_LAYERS[quantize] for m in drafting)
    assert not any(isinstance(m, QuantizedLinear) for m in model.backbone.modules())  # the tied LM head included
    assert draft_weights_quantization(model) == quantize and draft_weights_quantization(float_model) == "none"
    torch.manual_seed(2)
    features, tokens = torch.randn(1, 3, 32), torch.randn(1, 3, 32)
    with torch.no_grad():
        quantized, exact = (m.heads.project(0, m.heads(features, tokens)) for m in (model, float_model))
    rounding = 0.05 if quantize == "int8" else 0.25  # 255 or 16 levels a row or group
    assert 0 < (quantized - exact).abs().max() < rounding * exact.abs().max()  # the float drafter up to its rounding
    prompts = [torch.randint(3, 400, (1, n)) for n in (9, 17)]
    with stock_linears(model.backbone):
        references = [(ids, hf_greedy(model.backbone, ids, 32)) for ids in prompts]
    for name, options in (("medusa", {"tree": "cpu-8"}), ("dynamic", {"budget": 6})):
        assert_exact(model, model.backbone, references, make_drafter(model, name, **options), 32)
    with pytest.raises(MedusaError, match="draft with .* weights .* would not load back as heads"):
        model.save_pretrained(tmp_path / "copy")
    assert not (tmp_path / "copy").exists()


def test_bench_quantizes_the_drafting_weights_of_other_heads_as_the_main_ones(tiny_backbone, tmp_path):
    from medusa_heads.apps.bench import with_heads

    folder = random_eagle3_folder(tiny_backbone, tmp_path / "heads")
    seen = []
    for quantize in ("int8", "none"):
        model = MedusaModel.from_pretrained(folder, base_model=str(tiny_backbone), quantize_drafter=quantize)
        with_heads(lambda other, ids, n: seen.append(draft_weights_quantization(other)), str(folder))(model, None, 1)
    assert seen == ["int8", "none"]


@pytest.mark.parametrize("heads", ["smollm2-135m-embedded", "smollm2-135m-embedded-eagle3"])
def test_int8_drafting_weights_on_the_embedded_model_decode_as_hf_and_draft_as_well(tokenizer, chat_prompts, heads):
    folder = SHIPPED_HEADS[EMBEDDED_MODEL].parent / heads
    float_model = MedusaModel.from_pretrained(folder, EMBEDDED_MODEL, dtype=torch.float32)
    model = MedusaModel(float_model.backbone, load_heads(folder, dtype=torch.float32))  # the same backbone
    assert quantize_draft_weights(model, "int8") >= 1
    if model.heads.config.share_lm_head:  # the Hydra heads' copy of the backbone's draft-vocabulary rows
        assert type(model.projection) is Int8Linear
    prompts = [encode_prompt(tokenizer, p) for p in chat_prompts[:2]]
    with stock_linears(model.backbone):
        references = [(ids, hf_greedy(model.backbone, ids, 48)) for ids in prompts]
    drafter, float_drafter = (make_drafter(m, "medusa+ngram" if heads.endswith("eagle3") else "medusa",
                                           tree="eagle3-bf16-8" if heads.endswith("eagle3") else "cpu-8")
                              for m in (model, float_model))
    steps = [sum(len(s.accepted_lengths) for s in assert_exact(m, m.backbone, references, d, 48))
             for m, d in ((model, drafter), (float_model, float_drafter))]
    assert steps[0] <= 1.1 * steps[1]  # the int8 drafter's guesses are accepted about as often


def test_bad_quantize_values_are_one_line_errors(tiny_backbone, cli, tmp_path):
    with pytest.raises(MedusaError, match="Unknown quantization `int2`; use one of none, int8, int4"):
        MedusaModel.from_pretrained(None, base_model=load_backbone(str(tiny_backbone)), quantize="int2")
    with pytest.raises(MedusaError, match="runs on the CPU only"):
        MedusaModel.from_pretrained(None, base_model=str(tiny_backbone), quantize="int8", device="cuda")
    with pytest.raises(MedusaError, match="needs a float32 or bfloat16 backbone"):
        quantize_backbone(load_backbone(str(tiny_backbone), dtype=torch.float16), "int8")
    with pytest.raises(MedusaError, match="runs on the CPU only"):
        MedusaModel.from_pretrained(None, base_model=str(tiny_backbone), quantize_drafter="int8", device="cuda")
    for flag in ("--quantize", "--quantize-drafter"):
        with pytest.raises(SystemExit):
            cli("generate", "--prompt", "hi", "--model", str(tiny_backbone), flag, "int2")
    with pytest.raises(MedusaError, match="`quantize` must be one of none, int8, int4, got 'fp8'"):
        load_recipe(None, {"quantize": "fp8"})
    with pytest.raises(MedusaError, match="`medusa2` trains adapters on the float backbone"):
        load_recipe(None, {"quantize": "int8", "medusa2": "true", "cache_hidden_states": "false"})


def test_heads_fine_tune_on_the_int8_backbone_from_saved_heads(tiny_backbone, counting_data, tmp_path):
    start = save_heads(tmp_path / "start", untrained_heads(load_backbone(str(tiny_backbone)), str(tiny_backbone), 2))
    values = dict(model=str(tiny_backbone), backbone_dtype="float32", data=str(counting_data), num_heads=2,
                  max_steps=4, batch_size=8, warmup_steps=1, eval_every=4, checkpoint_every=4, held_out_fraction=0.1,
                  top_k=3, hidden_cache_dir=str(tmp_path / "hidden"), init_heads=str(start))
    train(load_recipe(None, {**values, "output_dir": str(tmp_path / "float")}))
    result = train(load_recipe(None, {**values, "quantize": "int8", "output_dir": str(tmp_path / "int8")}))
    assert len(result["accuracies"]["top1"]) == 2
    assert len(list((tmp_path / "hidden").glob("*.safetensors"))) == 4  # int8 states are not the float ones
    with pytest.raises(MedusaError, match="are not the recipe's heads: num_heads 2"):
        train(load_recipe(None, {**values, "num_heads": 3, "output_dir": str(tmp_path / "bad")}))


@pytest.mark.slow
@pytest.mark.parametrize("quantize", ["int8", "int4"])
def test_the_quantized_embedded_model_decodes_as_hf_on_the_same_quantized_model(tokenizer, chat_prompts, quantize):
    model = MedusaModel.from_pretrained(MEDUSA_HEADS, EMBEDDED_MODEL, dtype=torch.float32, quantize=quantize)
    prompts = [encode_prompt(tokenizer, p) for p in chat_prompts[:3]]
    with stock_linears(model.backbone):
        references = [(ids, hf_greedy(model.backbone, ids, 64)) for ids in prompts]
    drafter = make_drafter(model, "medusa", tree="cpu-8")
    # int8: fp32 activations, token for token; the int4 kernel reads bf16 activations: HF's output up to a flipped
    # rounding at a near tie
    stats = assert_exact(model, model.backbone, references, drafter, 64, near_tie=0.0 if quantize == "int8" else 0.05)
    assert sum(len(s.accepted_lengths) for s in stats) < 3 * 64  # the heads still save forwards on it


def test_int8_warns_where_its_kernel_is_slower_than_float(tiny_backbone, monkeypatch, caplog):
    from medusa_heads import quantize
    for kind in (Int8Linear, Int4Linear):  # the real timing, on whatever this CPU is
        assert quantize.kernel_slowdown(kind(nn.Linear(64, 48, bias=False).requires_grad_(False)), torch.float32,
                                        repeats=3) > 0
    # int4's one-layer timing misjudges it (a whole step is faster than float here): it is never warned about
    for quantize_as, slowdown, warned in (("int8", 5.0, True), ("int8", 0.8, False), ("int4", 5.0, False)):
        monkeypatch.setattr(quantize, "kernel_slowdown", lambda layer, dtype: slowdown)
        caplog.clear()
        with caplog.at_level("WARNING", logger="medusa_heads.quantize"):
            quantize_backbone(load_backbone(str(tiny_backbone), dtype=torch.float32), quantize_as)
        assert ("5.0x slower than float32 on this CPU" in caplog.text) is warned
