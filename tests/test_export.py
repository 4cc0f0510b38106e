"""Heads written in the original Medusa layout (TensorRT-LLM's converter input) and vLLM's, checked against those
projects' own definitions of the heads, written out here from their sources, and read back."""

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from medusa_heads import HEAD_TYPES, MedusaConfig, MedusaError, load_heads
from medusa_heads.formats import export_original, export_vllm

from test_cli import assert_clean_error  # noqa: E402  (pytest puts tests/ on sys.path)

H, V, K = 16, 40, 3


def random_heads(head_type="medusa", share_lm_head=False, num_layers=1, draft_vocab_size=None):
    torch.manual_seed(0)
    config = MedusaConfig(base_model_name_or_path="tiny", num_heads=K, num_layers=num_layers, hidden_size=H,
                          vocab_size=V, share_lm_head=share_lm_head, head_type=head_type,
                          draft_vocab_size=draft_vocab_size)
    heads = HEAD_TYPES[head_type](config)
    for p in heads.parameters():
        p.data.normal_(std=0.3)
    if draft_vocab_size:
        heads.set_draft_vocab(torch.randperm(V)[:draft_vocab_size])
    return heads


def our_full_logits(heads, lm_head_weight, x):
    """[K, N, V] logits over the whole vocabulary, -inf outside the draft vocabulary."""
    projection = heads.output_projection(nn.Linear(H, V, bias=False).requires_grad_(False))
    if lm_head_weight is not None:
        projection.weight.data.copy_(lm_head_weight if heads.draft_vocab is None else lm_head_weight[heads.draft_vocab])
    logits = heads(x, projection if heads.lm_heads is None else None)
    if heads.draft_vocab is None:
        return logits
    full = torch.full((*logits.shape[:-1], V), -torch.inf)
    full[..., heads.draft_vocab] = logits
    return full


class OriginalResBlock(nn.Module):
    """The original Medusa project's block: `x + SiLU(linear(x))`, a biased linear named `linear`."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(H, H)

    def forward(self, x):
        return x + F.silu(self.linear(x))


@pytest.mark.parametrize("share_lm_head", [False, True])
def test_the_original_layout_is_what_the_original_heads_compute(tmp_path, share_lm_head):
    heads = random_heads(share_lm_head=share_lm_head)
    lm_head_weight = torch.randn(V, H) if share_lm_head else None
    export_original(heads, lm_head_weight, tmp_path, tree=((0,), (1,), (0, 0)))
    # The original: per head nn.Sequential(ResBlock, ..., nn.Linear(hidden, vocab, bias=False)), one ModuleList.
    original = nn.ModuleList(nn.Sequential(OriginalResBlock(), nn.Linear(H, V, bias=False)) for _ in range(K))
    original.load_state_dict(load_file(tmp_path / "medusa_lm_head.safetensors"), strict=True)
    x = torch.randn(5, H)
    expected = torch.stack([head(x) for head in original])
    torch.testing.assert_close(our_full_logits(heads, lm_head_weight, x), expected)
    config = json.loads((tmp_path / "config.json").read_text())
    assert (config["medusa_num_heads"], config["medusa_num_layers"]) == (K, 1)
    assert config["medusa_choices"] == json.loads((tmp_path / "medusa_choices.json").read_text()) == [[0], [1], [0, 0]]
    # ... and read back: heads with their own projections, the same function
    again = load_heads(tmp_path)
    assert again.lm_heads is not None and again.config.num_heads == K
    torch.testing.assert_close(again(x), expected)


def test_original_checkpoints_with_two_layers_import(tmp_path):
    heads = random_heads(num_layers=2)
    export_original(heads, None, tmp_path)
    x = torch.randn(4, H)
    torch.testing.assert_close(load_heads(tmp_path)(x), heads(x))
    weights = load_file(tmp_path / "medusa_lm_head.safetensors")
    weights.pop("1.1.linear.bias")
    save_file(weights, tmp_path / "medusa_lm_head.safetensors")
    with pytest.raises(MedusaError, match="missing \\['1.1.linear.bias'\\]"):
        load_heads(tmp_path)


class VllmMedusa(nn.Module):
    """vLLM's Medusa module as its source defines it: blocks.{h}.layers.{l} (`x + SiLU(layer(x))`, bias per
    `medusa_fc_bias`), lm_heads over the truncated vocabulary (one shared when `original_lm_head`), logits scattered
    to the whole vocabulary through `token_map`."""

    def __init__(self, config):
        super().__init__()
        self.config = config
        bias = config.get("medusa_fc_bias", False)
        self.blocks = nn.ModuleList(nn.ModuleDict({"layers": nn.ModuleList(
            nn.Linear(config["hidden_size"], config["hidden_size"], bias=bias)
            for _ in range(config["num_hidden_layers"]))}) for _ in range(config["num_heads"]))
        heads = 1 if config.get("original_lm_head") else config["num_heads"]
        self.lm_heads = nn.ModuleList(nn.Linear(config["hidden_size"], config["truncated_vocab_size"], bias=False)
                                      for _ in range(heads))

    def forward(self, x, token_map=None):
        out = []
        for h, block in enumerate(self.blocks):
            y = x
            for layer in block["layers"]:
                y = y + F.silu(layer(y))
            logits = self.lm_heads[0 if self.config.get("original_lm_head") else h](y)
            if token_map is not None:
                full = torch.full((*logits.shape[:-1], self.config["vocab_size"]), -torch.inf)
                full[..., token_map] = logits
                logits = full
            out.append(logits)
        return torch.stack(out)


@pytest.mark.parametrize("share_lm_head, draft_vocab_size", [(False, None), (True, None), (True, 12)])
def test_the_vllm_layout_is_what_vllm_computes(tmp_path, share_lm_head, draft_vocab_size):
    heads = random_heads(share_lm_head=share_lm_head, num_layers=2, draft_vocab_size=draft_vocab_size)
    lm_head_weight = torch.randn(V, H) if share_lm_head else None
    export_vllm(heads, lm_head_weight, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["model_type"] == "medusa" and config["architectures"] == ["MedusaModel"]
    assert config["truncated_vocab_size"] == (draft_vocab_size or V) and config["original_lm_head"] == share_lm_head
    weights = load_file(tmp_path / "model.safetensors")
    token_map = weights.pop("token_map", None)
    assert (token_map is not None) == bool(draft_vocab_size)
    vllm = VllmMedusa(config)
    vllm.load_state_dict(weights, strict=True)
    x = torch.randn(5, H)
    torch.testing.assert_close(vllm(x, token_map), our_full_logits(heads, lm_head_weight, x))


@pytest.mark.parametrize("head_type", ["hydra", "eagle"])
def test_types_without_an_engine_layout_are_refused(tmp_path, head_type):
    if head_type == "eagle":
        from transformers import LlamaConfig

        from medusa_heads.eagle import decoder_config_for

        config = MedusaConfig(head_type="eagle", hidden_size=32, vocab_size=V, decoder_config=decoder_config_for(
            LlamaConfig(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2)))
        heads = HEAD_TYPES["eagle"](config)
    else:
        heads = random_heads(head_type)
    for export in (export_vllm, export_original):
        with pytest.raises(MedusaError, match=f"plain Medusa heads only; these are `{head_type}` heads"):
            export(heads, torch.zeros(V, 32), tmp_path)
    with pytest.raises(MedusaError, match="no draft vocabulary"):
        export_original(random_heads(share_lm_head=True, draft_vocab_size=8), torch.zeros(V, H), tmp_path)


@pytest.mark.slow  # loads the real backbone for its LM head
def test_export_command(cli, tmp_path):
    from conftest import MEDUSA_HEADS, SHIPPED_HEADS, EMBEDDED_MODEL

    assert cli("export", "--format", "trtllm", str(MEDUSA_HEADS), str(tmp_path / "trt"), "--tree", "cpu-16"
               ).returncode == 0
    assert sorted(p.name for p in (tmp_path / "trt").iterdir()) == ["config.json", "medusa_choices.json",
                                                                    "medusa_lm_head.safetensors"]
    assert cli("export", "--format", "vllm", str(MEDUSA_HEADS), str(tmp_path / "vllm")).returncode == 0
    assert json.loads((tmp_path / "vllm" / "config.json").read_text())["num_heads"] == 4
    assert_clean_error(cli("export", "--format", "vllm", str(MEDUSA_HEADS), str(tmp_path / "vllm")), "not empty")
    assert_clean_error(cli("export", "--format", "vllm", str(SHIPPED_HEADS[EMBEDDED_MODEL]), str(tmp_path / "h")),
                       "`hydra` heads")
