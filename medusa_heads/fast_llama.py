r"""
A forward for Llama-family decoders written for decoding: the same function as transformers' modules, in fewer
operations.

A decoding step on CPU is a few dozen tiny products wrapped in about 1,500 small eager operations and their Python
(docs/benchmarks.md: of a plain SmolLM2-135M token's 15.9 ms, 6.9 are the products). This forward runs each layer
as gpt-fast's and vLLM's model files do: one product for q/k/v and one for gate/up, RMSNorm as one fused
operation, the rotary rotation of queries and keys together from a table made once, the new keys and values
written in place into the tree cache's static buffers, and SDPA reading grouped key/value heads in place under the
step's 4D mask. It reads the Hugging Face model's own weights: the stacked products are the oneDNN-packed groups
that `packing.fuse_siblings` already made (or, where the model is not packed, the layers' weights become views of
one stacked tensor), so nothing is held twice.

It covers the architectures Medusa heads are trained for: Llama (SmolLM2), Mistral, Qwen2 (q/k/v biases) and Qwen3
(per-head q/k norms), with SiLU MLPs, full attention and a rotary embedding that depends on the position only.
Anything else keeps transformers' modules (`supports` says which). Greedy decoding through it is tested token for
token against HF `generate` in fp32, and its logits against the modules' for each architecture.
"""

import copy
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel

from .packing import PackedLinear, SiblingLinear, pack_weight, packed_product

ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
STATIC_ROPE = ("default", "linear", "llama3", "yarn")  # rotary angles that depend on the position alone
FAST_FORWARD = "medusa_fast_forward"  # the backbone attribute `enable_fast_forward` sets


def supports(backbone: PreTrainedModel) -> str | None:
    """None where the fast forward computes what `backbone`'s modules compute, else why not, in words."""
    config = backbone.config
    name = type(backbone).__name__
    if name not in ARCHITECTURES:
        return f"{name} is not a Llama-family architecture ({', '.join(ARCHITECTURES)})"
    if config.hidden_act != "silu":
        return f"its MLP uses {config.hidden_act}, not silu"
    rope = (getattr(config, "rope_parameters", None) or {}).get("rope_type", "default")
    if rope not in STATIC_ROPE:
        return f"its {rope} rotary embedding changes with the sequence length"
    if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
        return "it uses sliding-window attention"
    layer = backbone.model.layers[0]
    linears = (*_attention_projections(layer), layer.self_attn.o_proj, *_mlp_projections(layer), layer.mlp.down_proj)
    if any(type(m) not in (nn.Linear, PackedLinear, SiblingLinear) for m in linears):
        return "its linear layers are quantized or wrapped"
    if getattr(layer.mlp.gate_proj, "bias", None) is not None or layer.self_attn.o_proj.bias is not None:
        return "its MLP or output projection has a bias"
    return None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama's RMSNorm, rounded as transformers rounds it: normalised in fp32, cast, then scaled in the input dtype."""
    return weight * F.rms_norm(x, weight.shape, eps=eps)


def rotary_tables(rotary_emb: nn.Module, size: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and signed sin [size, D] of positions 0..size-1 in `like`'s dtype and device, as transformers' own
    rotary module computes the angles (with its scaling): rotate_half(x) * sin = roll(x, D / 2) * signed_sin, the
    first half of the sines negated."""
    cos, sin = rotary_emb(like[:1], torch.arange(size, device=like.device)[None])
    half = cos.shape[-1] // 2
    return cos[0], torch.cat([-sin[0, :, :half], sin[0, :, half:]], dim=-1)


def _attention_projections(layer: nn.Module) -> list[nn.Linear]:
    return [layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj]


def _mlp_projections(layer: nn.Module) -> list[nn.Linear]:
    return [layer.mlp.gate_proj, layer.mlp.up_proj]


class Product:
    """`x @ weight.T + bias` [..., out_features] over a layer's own weights: a plain `weight`, its copy `packed` laid
    out by `packing.pack_weight`, or its transposed copy `transposed` (one copy each time: the others are None)."""

    def __init__(self, out_features: int, bias: torch.Tensor | None, weight: torch.Tensor | None = None,
                 packed: torch.Tensor | None = None, transposed: torch.Tensor | None = None):
        self.out_features, self.bias, self.weight, self.packed = out_features, bias, weight, packed
        self.transposed = transposed

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.transposed is not None:
            y = x @ self.transposed
            return y if self.bias is None else y + self.bias
        if self.packed is None:
            return F.linear(x, self.weight, self.bias)
        return packed_product(x, self.packed, self.bias)


def plain_product(out_features: int, bias: torch.Tensor | None, weight: torch.Tensor) -> Product:
    """A product over a transposed copy of `weight`: a graph compiled with its weights as constants lays that copy
    out for its own kernels and drops it, where one over `weight` itself would keep `weight` too (its transpose is
    a view of it) and so hold the weights twice."""
    return Product(out_features, bias, transposed=weight.t().contiguous())


def product(module: nn.Module, plain: bool = False) -> Product | nn.Module:
    """A linear layer's product, called without the module (its packed weight directly where it has one, unless
    `plain`: then over a transposed copy of its weight, as a graph that lays weights out itself wants it,
    `plain_product`); any other layer (a quantized one, a member of a fused group) is called as it is."""
    if type(module) not in ((nn.Linear, PackedLinear, SiblingLinear) if plain else (nn.Linear, PackedLinear)):
        return module
    bias = None if module.bias is None else module.bias.detach()
    if plain:
        return plain_product(module.out_features, bias, module.weight.detach())
    if type(module) is PackedLinear:
        return Product(module.out_features, bias, packed=module.packed)
    return Product(module.out_features, bias, weight=module.weight.detach())


class Concatenated:
    """Layers that cannot be stacked into one product (quantized ones: each calls its own kernel), called one after
    the other, their outputs side by side."""

    def __init__(self, members: list[nn.Module]):
        self.members = members

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([m(x) for m in self.members], dim=-1)


def stacked_product(members: list[nn.Module], plain: bool = False) -> Product | Concatenated:
    """Sibling linear layers as one product whose output holds theirs side by side, over their own weights
    (`plain`: over one stacked copy of their weights, never a packed one)."""
    if any(type(m) not in (nn.Linear, PackedLinear, SiblingLinear) for m in members):
        return Concatenated(members)
    if plain:
        bias = None if members[0].bias is None else torch.cat([m.bias.detach() for m in members])
        weight = torch.cat([m.weight.detach() for m in members])
        return plain_product(sum(m.out_features for m in members), bias, weight)
    siblings = getattr(members[0], "siblings", None)
    biases = [m.bias for m in members]
    bias = None if biases[0] is None else torch.cat([b.detach() for b in biases])
    out_features = sum(m.out_features for m in members)
    if siblings is not None and siblings.members == members:
        return Product(out_features, bias, packed=siblings.packed)  # the group `fuse_siblings` already packed
    weight = torch.cat([m.weight.detach() for m in members])
    if all(type(m) is PackedLinear for m in members):  # packed, but not fused: one more packed copy
        return Product(out_features, bias, packed=pack_weight(weight))
    # one stacked tensor, and each layer's weight a view of its rows: still one copy of the weights
    rows = 0
    for m in members:
        m.weight.data = weight[rows : rows + m.out_features]
        rows += m.out_features
    return Product(out_features, bias, weight=weight)


class FastLlamaLayer:
    """One decoder layer's function over its modules' weights."""

    PRODUCTS = ("qkv", "o_proj", "gate_up", "down_proj")

    def __init__(self, layer: nn.Module, config, plain: bool = False):
        attn = layer.self_attn
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = attn.head_dim
        self.scaling = attn.scaling
        self.qkv = stacked_product(_attention_projections(layer), plain)
        self.gate_up = stacked_product(_mlp_projections(layer), plain)
        self.o_proj, self.down_proj = product(attn.o_proj, plain), product(layer.mlp.down_proj, plain)
        self.norms = [(n.weight, n.variance_epsilon) for n in (layer.input_layernorm, layer.post_attention_layernorm)]
        self.qk_norm = None
        if hasattr(attn, "q_norm"):  # Qwen3: RMSNorm over each head's queries and keys before the rotation
            self.qk_norm = [(n.weight, n.variance_epsilon) for n in (attn.q_norm, attn.k_norm)]

    def with_products(self, wrap: Callable[[Product], Callable]) -> "FastLlamaLayer":
        """The same layer with each of its products `wrap`ped (a copy; this one is left as it is)."""
        twin = copy.copy(self)
        for name in self.PRODUCTS:
            setattr(twin, name, wrap(getattr(self, name)))
        return twin

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, keys: torch.Tensor,
                 values: torch.Tensor, slots: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        # x: [B, T, H]; cos, sin: [B, T, 1, D]; keys, values: [B, H_kv, S, D], written at `slots` [T];
        # mask [B, 1, T, window]: attention reads the first `window` slots
        weight, eps = self.norms[0]
        return self.block(rms_norm(x, weight, eps), x, cos, sin, keys, values, slots, mask)

    def block(self, normed: torch.Tensor, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, keys: torch.Tensor,
              values: torch.Tensor, slots: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """The layer after its input norm: attention over `normed` [B, T, H'] added to the residual stream `x`
        [B, T, H], then the MLP (an EAGLE-3 drafter's attention reads more than its residual stream)."""
        B, T, _ = x.shape
        window = mask.shape[-1]
        D, Hq, Hkv = self.head_dim, self.heads, self.kv_heads
        qkv = self.qkv(normed).view(B, T, Hq + 2 * Hkv, D)
        qk, v = qkv[:, :, : Hq + Hkv], qkv[:, :, Hq + Hkv :]
        if self.qk_norm is not None:
            (wq, eps_q), (wk, eps_k) = self.qk_norm
            qk = torch.cat([rms_norm(qk[:, :, :Hq], wq, eps_q), rms_norm(qk[:, :, Hq:], wk, eps_k)], dim=2)
        qk = qk * cos + qk.roll(D // 2, dims=-1) * sin  # [B, T, Hq + Hkv, D]; `sin` carries the sign
        keys.index_copy_(2, slots, qk[:, :, Hq:].transpose(1, 2))
        values.index_copy_(2, slots, v.transpose(1, 2))
        keys, values = keys[:, :, :window], values[:, :, :window]
        if T == 1 and Hq != Hkv:
            # One token: each key/value head's query heads as rows of one query, as transformers' sdpa runs it
            # (`pack_gqa`), which rounds otherwise than SDPA's grouped mode
            out = F.scaled_dot_product_attention(qk[:, :, :Hq].reshape(B, Hkv, Hq // Hkv, D), keys, values,
                                                 attn_mask=mask, scale=self.scaling)  # [B, Hkv, Hq / Hkv, D]
        else:
            out = F.scaled_dot_product_attention(qk[:, :, :Hq].transpose(1, 2), keys, values, attn_mask=mask,
                                                 scale=self.scaling, enable_gqa=Hq != Hkv).transpose(1, 2)
        x = x + self.o_proj(out.reshape(B, T, Hq * D))
        weight, eps = self.norms[1]
        gate, up = self.gate_up(rms_norm(x, weight, eps)).chunk(2, dim=-1)
        return x + self.down_proj(F.silu(gate) * up)


class FastLlama:
    r"""
    The decoder of a Llama-family `backbone` over a static cache, made once the model is on its device, in its
    dtype and packed (it reads the weights as they are then). `forward` takes what the tree cache gives a step.
    `plain`: every product over plain weights (the q/k/v and gate/up groups stacked into copies), for a graph that
    lays the weights out itself (`frozen_step.py`).
    """

    def __init__(self, backbone: PreTrainedModel, plain: bool = False):
        decoder = backbone.model
        config = backbone.config
        self.embed = decoder.embed_tokens
        self.layers = [FastLlamaLayer(layer, config, plain) for layer in decoder.layers[: config.num_hidden_layers]]
        self.norm = (decoder.norm.weight, decoder.norm.variance_epsilon)
        head = backbone.lm_head
        self.lm_head = product(head, plain)
        self.cos, self.sin = rotary_tables(decoder.rotary_emb, config.max_position_embeddings, self.embed.weight)

    def rotary(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [B, T, 1, D] at `positions` [B, T]."""
        return self.cos[positions].unsqueeze(2), self.sin[positions].unsqueeze(2)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor, kv: list,
                slots: torch.Tensor, taps: tuple[int, ...] = (), logits_to_keep: int | torch.Tensor = 0
                ) -> tuple[torch.Tensor, torch.Tensor]:
        r"""
        input_ids, positions [B, T]; mask [B, 1, T, window] (bool: which of the first `window` cache slots each
        token sees, its own included); kv: per layer (keys, values) [B, H_kv, S, D], the new entries written at
        `slots` [T].
        Returns `backbone_forward`'s (logits, hidden): hidden [B, T, (1 + len(taps)) H] is the last hidden state then
        the inputs of layers `taps`.
        """
        hidden, features = self.decode(input_ids, positions, mask, kv, slots, taps)
        return self.logits(hidden, logits_to_keep), features

    def decode(self, input_ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor, kv: list,
               slots: torch.Tensor, taps: tuple[int, ...] = ()) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward` up to the LM head: (last hidden state [B, T, H], `forward`'s hidden)."""
        x = self.embed(input_ids)
        cos, sin = self.rotary(positions)
        tapped = []
        for i, (layer, (keys, values)) in enumerate(zip(self.layers, kv)):
            if i in taps:
                tapped.append(x)
            x = layer(x, cos, sin, keys, values, slots, mask)
        weight, eps = self.norm
        hidden = rms_norm(x, weight, eps)
        return hidden, torch.cat([hidden, *tapped], dim=-1) if tapped else hidden

    def logits(self, hidden: torch.Tensor, logits_to_keep: int | torch.Tensor = 0) -> torch.Tensor:
        """The logits at the positions `logits_to_keep` (indices, or the last N; 0: all) of `hidden` [B, T, H]."""
        keep = logits_to_keep if isinstance(logits_to_keep, torch.Tensor) else slice(-logits_to_keep, None)
        return self.lm_head(hidden[:, keep])


def enable_fast_forward(backbone: PreTrainedModel) -> bool:
    """Decode `backbone` through `FastLlama` where it `supports` it; returns whether it does."""
    if supports(backbone) is not None:
        return False
    setattr(backbone, FAST_FORWARD, FastLlama(backbone))
    return True
