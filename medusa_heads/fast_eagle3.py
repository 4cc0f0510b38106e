r"""
An `Eagle3Head`'s decoding step written like `FastLlama`'s: its decoder layer as a `FastLlamaLayer` over a static
cache of its own (keys and values written in place at slots given as a tensor), its products called without their
modules, and its guesses (final norm, draft-vocabulary LM head, top-k, token ids) in one function. Nothing in it
reads a Python number from a tensor, so a whole static tree's drafting compiles into one graph
(`inference/drafters/eagle3_tree.py`).

Same function as `Eagle3Head.forward` (tested against it); the drafts it makes are verified like any others.
"""

import copy
from typing import Callable

import torch

from .eagle3 import Eagle3Head
from .fast_llama import FastLlamaLayer, Product, product, rms_norm, rotary_tables


def fast_eagle3_supports(heads) -> bool:
    """Whether `FastEagle3` computes what `heads` compute: an `Eagle3Head` over a Llama layer with rotary angles
    that depend on the position alone."""
    return isinstance(heads, Eagle3Head) and heads._short_decode


class FastEagle3:
    r"""
    `heads`' step over a static cache: `decode` appends entries and returns their outputs, `guesses` turns
    outputs into the top-k drafted token ids. Made once the heads are on their device, in their dtype, packed or
    quantized (it reads the weights as they are then); `plain`: its products over copies of plain weights, as
    `FastLlama`'s (for a graph that lays weights out itself).
    """

    def __init__(self, heads: Eagle3Head, embed: torch.nn.Embedding, plain: bool = False):
        layer = heads.layer
        self.hidden_size = heads.config.hidden_size
        self.embed = embed  # the backbone's: the drafter reads the embedding of the token after each position
        self.layer = FastLlamaLayer(layer, layer.self_attn.config, plain)
        self.fc, self.lm_head = product(heads.fc, plain), product(heads.lm_head, plain)
        self.norms = [(n.weight, n.variance_epsilon) for n in (layer.input_layernorm, heads.hidden_norm, heads.norm)]
        self.draft_vocab = heads.draft_vocab
        self.cos, self.sin = rotary_tables(heads.rotary_emb, layer.self_attn.config.max_position_embeddings,
                                           embed.weight)

    def products(self) -> list:
        """Its products: `fc`, its layer's and its LM head."""
        return [self.fc, *(getattr(self.layer, name) for name in FastLlamaLayer.PRODUCTS), self.lm_head]

    def with_products(self, wrap: Callable[[Product], Callable]) -> "FastEagle3":
        """The same step with each of its products `wrap`ped (a copy; this one is left as it is)."""
        twin = copy.copy(self)
        twin.layer = self.layer.with_products(wrap)
        twin.fc, twin.lm_head = wrap(self.fc), wrap(self.lm_head)
        return twin

    def decode(self, features: torch.Tensor, token_ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor,
               keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        r"""
        One sequence's new entries: features [T, (1 + n) H] (the backbone's, fused by `fc`) or [T, H] (the
        drafter's own outputs, fed back), the token after each [T], their positions [T], written at `slots` [T]
        of keys, values [1, H_kv, S, D]; mask [T, window]: which of the first `window` slots each entry sees, its
        own included. Returns the outputs [T, H] (before the final norm).
        """
        h = self.hidden_size
        if features.shape[-1] != h:
            features = self.fc(features[..., h:])
        (embed_weight, embed_eps), (feature_weight, feature_eps), _ = self.norms
        normed = torch.cat([rms_norm(self.embed(token_ids), embed_weight, embed_eps),
                            rms_norm(features, feature_weight, feature_eps)], dim=-1)
        cos, sin = self.cos[positions][None, :, None], self.sin[positions][None, :, None]
        return self.layer.block(normed[None], features[None], cos, sin, keys, values, slots, mask[None, None])[0]

    def guesses(self, outputs: torch.Tensor, k: int) -> torch.Tensor:
        """Outputs [N, H] -> the drafter's top-`k` guesses of the next token after each, [N, k] token ids."""
        weight, eps = self.norms[2]
        top = self.lm_head(rms_norm(outputs, weight, eps)).topk(k, dim=-1).indices
        return top if self.draft_vocab is None else self.draft_vocab[top]
