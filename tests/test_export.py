"""Heads written in the original Medusa layout (TensorRT-LLM's converter input) and vLLM's (Medusa heads and the
EAGLE drafter), checked against those projects' own definitions of the heads, written out here from their sources,
and read back."""

import json
import re

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from medusa_heads import HEAD_TYPES, MedusaConfig, MedusaError, MedusaModel, load_heads
from medusa_heads.formats import check_format, export_original, export_vllm

from test_cli import assert_clean_error  # noqa: E402  (pytest puts tests/ on sys.path)

H, V, K = 16, 40, 3


def random_heads(head_type="medusa", share_lm_head=False, num_layers=1, draft_vocab_size=None):
    torch.manual_seed(0)
    config = MedusaConfig(base_model_name_or_path="tiny", num_heads=K, num_layers=num_layers, hidden_size=H,
                          vocab_size=V, share_lm_head=share_lm_head, head_type=head_type,
                          draft_vocab_size=draft_vocab_size)
    return randomized(HEAD_TYPES[head_type](config), draft_vocab_size)


def randomized(heads, draft_vocab_size=None):
    """`heads` with random weights (and a random draft vocabulary of `draft_vocab_size` tokens)."""
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


def original_heads(num_layers=1, own_lm_head=True):
    """The original project's heads, random: per head `[ResBlock(hidden)] * num_layers` (one block repeated, as it
    builds them), then its own LM head (none in its "version 2", which scores with the backbone's)."""
    torch.manual_seed(1)
    heads = nn.ModuleList(nn.Sequential(*([OriginalResBlock()] * num_layers),
                                        *([nn.Linear(H, V, bias=False)] if own_lm_head else [])) for _ in range(K))
    for p in heads.parameters():
        p.data.normal_(std=0.3)
    return heads


def original_logits(heads, x, lm_head_weight=None):
    """[K, N, V], as the original computes them: each head, then the backbone's LM head if it has none."""
    return torch.stack([head(x) if lm_head_weight is None else F.linear(head(x), lm_head_weight) for head in heads])


def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(2)
    return LlamaForCausalLM(LlamaConfig(hidden_size=H, intermediate_size=32, num_hidden_layers=1, vocab_size=V,
                                        num_attention_heads=2, num_key_value_heads=1))


def write_original(folder, layout, storage, heads, num_layers, **config):
    """Write `heads` as the original project does. v0.1: its MedusaConfig's config.json beside `torch.save` (its
    first trainer) or `save_file` (`train_legacy.py`) of the heads' state dict. v1.0: its Medusa-2 trainer's whole
    model (axolotl, transformers' `save_pretrained`): the backbone with `medusa_head` beside its own modules and the
    counts in its config; `pytorch_model.bin` as transformers 4 wrote it. Returns the backbone's LM head weight."""
    folder.mkdir(parents=True)
    if layout == "v0.1":
        meta = {"medusa_num_heads": K, "medusa_num_layers": num_layers, "base_model_name_or_path": "tiny-backbone",
                "transformers_version": "4.34.0"} | config
        (folder / "config.json").write_text(json.dumps(meta))
        if storage == "medusa_lm_head.pt":
            torch.save(heads.state_dict(), folder / storage)
        else:
            save_file(heads.state_dict(), folder / storage)
        return torch.randn(V, H)
    model = tiny_llama()
    model.medusa_head = heads
    model.config.medusa_num_heads, model.config.medusa_num_layers = K, num_layers
    if storage == "pytorch_model.bin":
        model.config.save_pretrained(folder)
        torch.save(model.state_dict(), folder / storage)
    else:
        model.save_pretrained(folder, max_shard_size="20KB" if storage == "sharded" else "50GB")
    return model.lm_head.weight.detach()


# The shared block of two layers cannot be written to safetensors (it refuses tensors that share memory).
ORIGINAL_LAYOUTS = [("v0.1", "medusa_lm_head.pt", 2), ("v0.1", "medusa_lm_head.safetensors", 1),
                    ("v1.0", "model.safetensors", 1), ("v1.0", "sharded", 1), ("v1.0", "pytorch_model.bin", 2)]


@pytest.mark.parametrize("layout, storage, num_layers", ORIGINAL_LAYOUTS)
def test_original_checkpoints_compute_what_the_original_heads_compute(tmp_path, caplog, layout, storage,
                                                                      num_layers):
    original = original_heads(num_layers)
    write_original(tmp_path / "ckpt", layout, storage, original, num_layers)
    if storage == "sharded":
        assert (tmp_path / "ckpt" / "model.safetensors.index.json").is_file()
    heads = load_heads(tmp_path / "ckpt")
    config = heads.config
    assert (config.num_heads, config.num_layers, config.share_lm_head) == (K, num_layers, False)
    backbone = "tiny-backbone" if layout == "v0.1" else str((tmp_path / "ckpt").resolve())
    assert config.base_model_name_or_path == backbone and not caplog.records
    assert sum(p.numel() for p in heads.parameters()) == sum(p.numel() for p in original.state_dict().values())
    x = torch.randn(5, H)
    torch.testing.assert_close(heads(x), original_logits(original, x))


@pytest.mark.parametrize("layout", ["v0.1", "v1.0"])
def test_heads_without_their_own_lm_head_share_the_backbones(tmp_path, caplog, layout):
    original = original_heads(own_lm_head=False)
    if layout == "v0.1":  # "version 2" configs name the backbone but not its vocabulary
        tiny_llama().config.save_pretrained(tmp_path / "backbone")
        lm_head_weight = write_original(tmp_path / "ckpt", layout, "medusa_lm_head.safetensors", original, 1,
                                        version="2", base_model_name_or_path=str(tmp_path / "backbone"))
    else:
        lm_head_weight = write_original(tmp_path / "ckpt", layout, "model.safetensors", original, 1)
    heads = load_heads(tmp_path / "ckpt")
    assert heads.config.share_lm_head and (heads.config.num_heads, heads.config.vocab_size) == (K, V)
    [warning] = caplog.records
    assert "no LM heads of their own" in warning.getMessage() and "\n" not in warning.getMessage()
    x = torch.randn(5, H)
    torch.testing.assert_close(our_full_logits(heads, lm_head_weight, x), original_logits(original, x, lm_head_weight))
    if layout == "v1.0":  # read directly: the backbone is the whole model, its LM head the one the heads share
        model = MedusaModel.from_pretrained(tmp_path / "ckpt")
        torch.testing.assert_close(model.head_logits(x), original_logits(original, x, lm_head_weight))


@pytest.mark.parametrize("layout", ["v0.1", "v1.0"])
def test_a_head_count_the_weights_contradict_is_taken_from_the_weights(tmp_path, caplog, layout):
    original = original_heads()
    write_original(tmp_path / "ckpt", layout, "medusa_lm_head.pt" if layout == "v0.1" else "model.safetensors",
                   original, 1)
    path = tmp_path / "ckpt" / "config.json"
    config = json.loads(path.read_text())
    if layout == "v0.1":  # as an uploaded config of the original's (its loader hard-codes the count instead)
        config["medusa_num_heads"] = 2
    else:  # the counts may also come in a `medusa` sub-dict
        config["medusa"] = {"medusa_num_heads": 2, "medusa_num_layers": config.pop("medusa_num_layers")}
        del config["medusa_num_heads"]
    path.write_text(json.dumps(config))
    heads = load_heads(tmp_path / "ckpt")
    assert heads.config.num_heads == K
    [warning] = caplog.records
    assert f"says medusa_num_heads=2 but its weights hold {K}: using {K}." in warning.getMessage()
    assert "\n" not in warning.getMessage()
    x = torch.randn(5, H)
    torch.testing.assert_close(heads(x), original_logits(original, x))


def test_the_backbones_weights_are_never_read(tmp_path):
    original = original_heads()
    heads = {f"medusa_head.{k}": v for k, v in original.state_dict().items()}
    save_file(heads, tmp_path / "model-00002-of-00002.safetensors", metadata={"format": "pt"})
    (tmp_path / "model-00001-of-00002.safetensors").write_bytes(b"not even a safetensors header")
    weight_map = dict.fromkeys(heads, "model-00002-of-00002.safetensors")
    weight_map["lm_head.weight"] = weight_map["model.embed_tokens.weight"] = "model-00001-of-00002.safetensors"
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": V, "hidden_size": H}))
    x = torch.randn(5, H)
    torch.testing.assert_close(load_heads(tmp_path)(x), original_logits(original, x))


def _drop(weights, key):
    weights.pop(key)


def _widen(weights, key):
    weights[key] = torch.randn(weights[key].shape[0] - 1, weights[key].shape[1] + 1)


@pytest.mark.parametrize("layout, break_weights, needle", [
    ("v0.1", lambda w: _drop(w, "1.1.weight"), "heads [0, 2] have an LM head of their own and heads [1] do not"),
    ("v1.0", lambda w: _drop(w, "medusa_head.0.1.weight"), "heads [1, 2] have an LM head of their own and heads [0]"),
    ("v0.1", lambda w: _widen(w, "2.0.linear.weight"), "disagree in shape: `2.0.linear.weight` is [15, 17] where"),
    ("v0.1", lambda w: _widen(w, "1.1.weight"), "disagree in shape: `1.1.weight` is [39, 17] where the others make "
     f"it [{V}, {H}]"),
    ("v0.1", lambda w: _drop(w, "1.0.linear.bias"), "missing ['1.0.linear.bias']"),
    ("v0.1", dict.clear, "holds no Medusa head weights"),
])
def test_inconsistent_original_checkpoints_are_one_line_errors(cli, tmp_path, layout, break_weights, needle):
    storage = "medusa_lm_head.safetensors" if layout == "v0.1" else "model.safetensors"
    write_original(tmp_path / "ckpt", layout, storage, original_heads(), 1)
    weights = load_file(tmp_path / "ckpt" / storage)
    break_weights(weights)
    save_file(weights, tmp_path / "ckpt" / storage)
    assert_clean_error(cli("convert", str(tmp_path / "ckpt"), str(tmp_path / "out")), needle)
    assert not (tmp_path / "out").exists()


def test_convert_refuses_what_it_cannot_read_or_write(cli, tmp_path):
    (tmp_path / "backbone").mkdir()
    tiny_llama().save_pretrained(tmp_path / "backbone")
    assert_clean_error(cli("convert", str(tmp_path / "backbone"), str(tmp_path / "out")),
                       "holds no Medusa heads in the original project's layouts")
    write_original(tmp_path / "ckpt", "v0.1", "medusa_lm_head.pt", original_heads(), 1)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    assert_clean_error(cli("convert", str(tmp_path / "ckpt"), str(tmp_path / "out")), "not empty")


@pytest.mark.parametrize("share_lm_head, num_layers", [(False, 1), (False, 2), (True, 1)])
def test_export_then_import_and_convert_give_identical_logits(cli, tmp_path, share_lm_head, num_layers):
    heads = random_heads(share_lm_head=share_lm_head, num_layers=num_layers)
    lm_head_weight = torch.randn(V, H) if share_lm_head else None
    export_original(heads, lm_head_weight, tmp_path / "original")
    assert cli("convert", str(tmp_path / "original"), str(tmp_path / "ours")).returncode == 0
    x = torch.randn(5, H)
    expected = our_full_logits(heads, lm_head_weight, x)
    for again in (load_heads(tmp_path / "original"), load_heads(tmp_path / "ours")):
        assert type(again).__name__ == "MedusaHeads" and again.lm_heads is not None  # exported with their own
        assert again.config.num_layers == num_layers
        if share_lm_head:  # one matmul for shared heads against one per own head: equal up to rounding
            torch.testing.assert_close(again(x), expected)
        else:
            assert torch.equal(again(x), expected)
    assert json.loads((tmp_path / "ours" / "config.json").read_text())["model_type"] == "medusa_heads"


def test_convert_a_whole_model_then_load_it(cli, tmp_path):
    original = original_heads()
    lm_head_weight = write_original(tmp_path / "ckpt", "v1.0", "sharded", original, 1)
    assert cli("convert", str(tmp_path / "ckpt"), str(tmp_path / "ours")).returncode == 0
    assert sorted(p.name for p in (tmp_path / "ours").iterdir()) == ["config.json", "model.safetensors"]
    weights = load_file(tmp_path / "ours" / "model.safetensors")
    assert all(k.startswith(("blocks.", "lm_heads.")) for k in weights)  # not the backbone's
    model = MedusaModel.from_pretrained(tmp_path / "ours")
    assert model.config.base_model_name_or_path == str((tmp_path / "ckpt").resolve())
    torch.testing.assert_close(model.backbone.get_output_embeddings().weight, lm_head_weight)
    x = torch.randn(5, H)
    torch.testing.assert_close(model.head_logits(x), original_logits(original, x))


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


def random_eagle(draft_vocab_size=None, **decoder):
    """An EAGLE drafter on a tiny Llama layer (grouped-query attention, a rope base of its own), random weights."""
    from transformers import LlamaConfig

    from medusa_heads.eagle import decoder_config_for

    torch.manual_seed(3)
    backbone = LlamaConfig(hidden_size=H, intermediate_size=24, num_attention_heads=4, num_key_value_heads=2,
                           rope_parameters={"rope_type": "default", "rope_theta": 500.0}, rms_norm_eps=1e-5)
    config = MedusaConfig(head_type="eagle", hidden_size=H, vocab_size=V, num_heads=K,
                          draft_vocab_size=draft_vocab_size, decoder_config=decoder_config_for(backbone) | decoder)
    return randomized(HEAD_TYPES["eagle"](config), draft_vocab_size)


def _rms(x, weight, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _rope(x, positions, theta):
    """Rotary embedding of [T, heads, d] as vLLM's Llama attention applies it (neox style: halves, not pairs)."""
    half = x.shape[-1] // 2
    angles = positions[:, None].float() * theta ** -(torch.arange(half) / half)
    cos, sin = angles.cos()[:, None], angles.sin()[:, None]
    return torch.cat([x[..., :half] * cos - x[..., half:] * sin, x[..., half:] * cos + x[..., :half] * sin], -1)


def vllm_eagle_features(folder, embedding, input_ids, hidden, positions):
    """vLLM's EagleMistralModel over one sequence, from its source: fc over [embedding; target hidden], one Llama
    decoder layer (input layernorm, attention with rope, post-attention layernorm, SiLU MLP, residuals), the final
    norm over hidden + residual. [T, H]; vLLM's logits are the target's LM head over these."""
    c = json.loads((folder / "config.json").read_text())
    w = {k.removeprefix("model.").removeprefix("layers.0."): v for k, v in load_file(folder / "model.safetensors").items()}
    x = F.linear(torch.cat([embedding[input_ids], hidden], -1), w["fc.weight"])
    x = _vllm_llama_layer(w, c, _rms(x, w["input_layernorm.weight"], c["rms_norm_eps"]), x, positions)
    return _rms(x, w["norm.weight"], c["rms_norm_eps"])


def _vllm_llama_layer(w, c, a, residual, positions):
    """vLLM's Llama decoder layer after its input norm, causal over one sequence: attention (rope, grouped keys and
    values) over `a` [T, H or 2H] added to `residual`, then the post-attention layernorm and SiLU MLP. [T, H]."""
    eps, heads, kv_heads, d = c["rms_norm_eps"], c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
    q, k, v = (F.linear(a, w[f"self_attn.{n}_proj.weight"]).view(len(a), -1, d) for n in "qkv")
    theta = c["rope_parameters"]["rope_theta"]
    q, k = _rope(q, positions, theta), _rope(k, positions, theta)
    k, v = (t.repeat_interleave(heads // kv_heads, dim=1) for t in (k, v))
    scores = torch.einsum("thd,shd->hts", q, k) / d**0.5
    scores = scores.masked_fill(~torch.ones(len(a), len(a), dtype=torch.bool).tril(), -torch.inf)
    attention = torch.einsum("hts,shd->thd", scores.softmax(-1), v).reshape(len(a), heads * d)
    x = residual + F.linear(attention, w["self_attn.o_proj.weight"])
    m = _rms(x, w["post_attention_layernorm.weight"], eps)
    return x + F.linear(F.silu(F.linear(m, w["mlp.gate_proj.weight"])) * F.linear(m, w["mlp.up_proj.weight"]),
                        w["mlp.down_proj.weight"])


@pytest.mark.parametrize("draft_vocab_size", [None, 12])
def test_the_vllm_eagle_layout_is_what_vllm_computes(tmp_path, caplog, draft_vocab_size):
    from transformers import MistralConfig

    heads = random_eagle(draft_vocab_size)
    export_vllm(heads, None, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    # vLLM prefixes `Eagle` to the architecture: EagleMistralForCausalLM, its one eagle model with both norms
    assert (config["architectures"], config["model_type"], config["vocab_size"]) == (["MistralForCausalLM"],
                                                                                     "mistral", V)
    mistral = MistralConfig(**config)
    assert (mistral.sliding_window, mistral.head_dim, mistral.num_hidden_layers) == (None, H // 4, 1)
    assert mistral.rope_parameters["rope_theta"] == 500.0
    assert sorted(load_file(tmp_path / "model.safetensors")) == sorted(
        ["model.fc.weight", "model.norm.weight"] + [f"model.layers.0.{k}" for k in heads.decoder.layers[0].state_dict()])
    assert bool(caplog.records) == bool(draft_vocab_size)  # approximate in vLLM: one warning

    embedding, lm_head_weight = torch.randn(V, H), torch.randn(V, H)  # the target's, shared by the drafter
    hidden, input_ids, positions = torch.randn(6, H), torch.randint(V, (6,)), torch.arange(5, 11)
    with torch.no_grad():
        ours = heads(hidden[None], embedding[input_ids][None], positions[None])[0]
        theirs = vllm_eagle_features(tmp_path, embedding, input_ids, hidden, positions)
    torch.testing.assert_close(F.linear(theirs, lm_head_weight), F.linear(ours, lm_head_weight))
    if draft_vocab_size:  # our draft logits are vLLM's on the draft vocabulary; vLLM also scores the others
        rows = lm_head_weight[heads.draft_vocab]
        torch.testing.assert_close(F.linear(theirs, rows), F.linear(ours, rows))


def random_eagle3(draft_vocab_size=None):
    """An EAGLE-3 drafter on a tiny Llama layer reading three of a 4-layer target's layers, random weights."""
    from transformers import LlamaConfig

    from medusa_heads.eagle import decoder_config_for

    torch.manual_seed(4)
    backbone = LlamaConfig(hidden_size=H, intermediate_size=24, num_attention_heads=4, num_key_value_heads=2,
                           rope_parameters={"rope_type": "default", "rope_theta": 500.0}, rms_norm_eps=1e-5)
    config = MedusaConfig(head_type="eagle3", hidden_size=H, vocab_size=V, num_heads=K, share_lm_head=False,
                          draft_vocab_size=draft_vocab_size, decoder_config=decoder_config_for(backbone),
                          feature_layers=[0, 2, 3])
    return randomized(HEAD_TYPES["eagle3"](config), draft_vocab_size)


def vllm_eagle3_step(folder, embedding, input_ids, hidden, positions):
    """vLLM's Eagle3LlamaForCausalLM over one sequence, from llama_eagle3.py (`norm_before_residual: false`): each
    entry's feature g (the target's aux hidden states through `fc`, or the drafter's own output fed back), attention
    over [input_layernorm(embedding); hidden_norm(g)], g as the residual, the post-attention layernorm and MLP, the
    final norm over hidden + residual, `lm_head` over the draft vocabulary scattered to `arange + d2t` (-inf
    elsewhere). `hidden`: [T, 3H] or [T, H] per entry (a list). -> (logits [T, V], the fed-back output [T, H])."""
    c = json.loads((folder / "config.json").read_text())
    layer = c["transformer_layer_config"]
    w = {k.removeprefix("layers.0."): v for k, v in load_file(folder / "model.safetensors").items()}
    eps = layer["rms_norm_eps"]
    g = torch.stack([F.linear(x, w["fc.weight"]) if x.shape[-1] != H else x for x in hidden])
    a = torch.cat([_rms(embedding[input_ids], w["input_layernorm.weight"], eps), _rms(g, w["hidden_norm.weight"], eps)],
                  -1)
    x = _vllm_llama_layer(w, layer, a, g, positions)
    draft = F.linear(_rms(x, w["norm.weight"], eps), w["lm_head.weight"])
    targets = torch.arange(c["draft_vocab_size"]) + w.get("d2t", 0)
    logits = torch.full((len(a), layer["vocab_size"]), -torch.inf)
    logits[:, targets] = draft
    return logits, x


@pytest.mark.parametrize("draft_vocab_size", [None, 12])
def test_the_speculators_layout_is_what_vllm_eagle3_computes(tmp_path, draft_vocab_size):
    from transformers import DynamicCache

    heads = random_eagle3(draft_vocab_size)
    check_format(heads, "speculators")
    export_vllm(heads, None, tmp_path)  # --format vllm writes the same
    config = json.loads((tmp_path / "config.json").read_text())
    assert (config["speculators_model_type"], config["eagle_aux_hidden_state_layer_ids"],
            config["norm_before_residual"], config["draft_vocab_size"]) == ("eagle3", [0, 2, 3], False,
                                                                            draft_vocab_size or V)
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == K
    weights = load_file(tmp_path / "model.safetensors")
    assert ("d2t" in weights) == ("t2d" in weights) == bool(draft_vocab_size) and "embed_tokens.weight" not in weights
    if draft_vocab_size:
        assert weights["t2d"].dtype == torch.bool and weights["t2d"].sum() == draft_vocab_size
        assert weights["t2d"][heads.draft_vocab].all()

    embedding = torch.randn(V, H)  # the target's, shared by the drafter
    aux, input_ids, positions = torch.randn(5, 3 * H), torch.randint(V, (6,)), torch.arange(5, 11)
    last = torch.randn(5, H)  # the target's last hidden state: the first H of what this project's runtime passes
    with torch.no_grad():
        cache = DynamicCache()  # 5 entries from the target's features, then one from the drafter's own output
        out = heads(torch.cat([last, aux], -1)[None], embedding[input_ids[:5]][None], positions[None, :5], None, cache)
        fed_back = heads(out[:, -1:], embedding[input_ids[5:]][None], positions[None, 5:], None, cache)
        ours = heads.project(0, torch.cat([out, fed_back], 1))[0]
        theirs, theirs_out = vllm_eagle3_step(tmp_path, embedding, input_ids, [*aux, out[0, -1]], positions)
    torch.testing.assert_close(theirs_out, torch.cat([out, fed_back], 1)[0])
    full = torch.full((6, V), -torch.inf)
    full[:, heads.token_ids(torch.arange(ours.shape[-1]))] = ours
    torch.testing.assert_close(theirs, full)


@pytest.mark.parametrize("decoder, needle", [
    ({"attention_bias": True}, "has no biases"),
    ({"model_type": "qwen3"}, "this drafter's layer is `qwen3` (llama/mistral only)"),
    ({"hidden_act": "gelu"}, "has `gelu` and sliding window None"),
])
def test_eagle_drafters_vllm_cannot_build_are_refused(tmp_path, decoder, needle):
    with pytest.raises(MedusaError, match=re.escape(needle)):
        export_vllm(random_eagle(**decoder), None, tmp_path)


@pytest.mark.parametrize("head_type, layout, needle", [
    ("hydra", "vllm", "--format vllm cannot hold `hydra` heads: no serving engine reads them"),
    ("hydra", "trtllm", "--format trtllm cannot hold `hydra` heads: no serving engine reads them"),
    ("eagle", "medusa", "--format medusa cannot hold `eagle` heads: export them with --format vllm."),
    ("eagle", "speculators", "eagle3, peagle, dflash and dspark only"),
    ("medusa", "speculators", "`medusa` heads: export them with --format vllm or medusa or trtllm."),
    ("eagle3", "trtllm", "--format trtllm cannot hold `eagle3` heads: export them with --format speculators or vllm."),
])
def test_formats_that_cannot_hold_a_head_type_are_refused(head_type, layout, needle):
    heads = {"eagle": random_eagle, "eagle3": random_eagle3}.get(head_type, lambda: random_heads(head_type))()
    with pytest.raises(MedusaError, match=re.escape(needle)):
        check_format(heads, layout)


def test_layouts_refuse_types_they_cannot_hold(tmp_path):
    with pytest.raises(MedusaError, match="plain Medusa heads only; these are `eagle` heads: export them with "
                       "--format vllm"):
        export_original(random_eagle(), None, tmp_path)
    for export in (export_vllm, export_original):
        with pytest.raises(MedusaError, match="these are `hydra` heads: no serving engine reads them"):
            export(random_heads("hydra"), None, tmp_path)
    with pytest.raises(MedusaError, match="no draft vocabulary"):
        export_original(random_heads(share_lm_head=True, draft_vocab_size=8), torch.zeros(V, H), tmp_path)


def test_export_the_shipped_eagle_drafter(cli, tmp_path, caplog):
    from conftest import MEDUSA_HEADS

    EAGLE_HEADS = MEDUSA_HEADS.parent / "smollm2-135m-embedded-eagle"
    done = cli("export", "--format", "vllm", str(EAGLE_HEADS), str(tmp_path / "eagle"))
    assert done.returncode == 0
    [warning] = [r.getMessage() for r in caplog.records if r.name == "medusa_heads.formats"]
    assert "8192-token draft vocabulary" in warning and "\n" not in warning
    config = json.loads((tmp_path / "eagle" / "config.json").read_text())
    assert (config["architectures"], config["vocab_size"], config["hidden_size"]) == (["MistralForCausalLM"],
                                                                                      49152, 576)
    for layout, needle in (("trtllm", "cannot hold `eagle` heads: export them with --format vllm"),
                           ("speculators", "no EAGLE-1 or Medusa type")):
        assert_clean_error(cli("export", "--format", layout, str(EAGLE_HEADS), str(tmp_path / layout)), needle)


def test_export_an_eagle3_drafter_through_the_cli(cli, tmp_path):
    heads = random_eagle3(draft_vocab_size=12)
    heads.save_pretrained(tmp_path / "heads")
    for layout in ("speculators", "vllm"):
        assert cli("export", "--format", layout, str(tmp_path / "heads"), str(tmp_path / layout)).returncode == 0
        assert sorted(p.name for p in (tmp_path / layout).iterdir()) == ["config.json", "model.safetensors"]
    assert (tmp_path / "vllm" / "config.json").read_text() == (tmp_path / "speculators" / "config.json").read_text()
    assert_clean_error(cli("export", "--format", "medusa", str(tmp_path / "heads"), str(tmp_path / "medusa")),
                       "cannot hold `eagle3` heads: export them with --format speculators or vllm")


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
