"""`EagleHead`: an EAGLE-style drafter, one decoder layer over the backbone's own features.

At position t it reads the backbone's last hidden state f_t and the embedding of the next token x_{t+1}, and
predicts f_{t+1}; the backbone's LM head (its draft-vocabulary rows) turns that into a guess for x_{t+2}. Unlike
Medusa heads it sees the whole context through its own KV cache. Drafting d deep feeds its predicted feature
back in place of the backbone's: entry d of a draft path reads (predicted f, drafted token).
"""

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AttentionInterface, AutoConfig, AutoModel, PreTrainedConfig, PreTrainedModel

from .config import MedusaConfig
from .heads import DraftHeads


def decoder_config_for(backbone_config: PreTrainedConfig) -> dict:
    """The backbone's own text config with one layer and no vocabulary: the drafter reads features, not ids."""
    text = backbone_config.get_text_config().to_diff_dict()  # what differs from the class defaults
    for key in ("_name_or_path", "_model_name_or_path", "architectures", "transformers_version", "dtype",
                "quantization_config", "layer_types", "unk_token_id"):  # layer_types is sized for the backbone
        text.pop(key, None)
    text.update(num_hidden_layers=1, vocab_size=1, pad_token_id=None, bos_token_id=None, eos_token_id=None,
                tie_word_embeddings=False)
    return text


class ContextDrafter(DraftHeads):
    """What the drafters over the context share: they read the backbone's features and the next tokens through
    decoder layers built from `config.decoder_config`, with a KV cache of their own; they train alone."""

    reads_tokens = True
    drafts_over_context = True
    trains_with_adapter = False
    main_input_name = "features"

    @classmethod
    def check_config(cls, config: MedusaConfig) -> None:
        super().check_config(config)
        if config.decoder_config is None:
            raise ValueError(f"`head_type={cls.head_type!r}` needs a `decoder_config` (the one-layer decoder's "
                             "config).")

    def decode(self, features: torch.Tensor, token_embeds: torch.Tensor, position_ids: torch.Tensor | None,
               attention_mask: torch.Tensor | None, cache) -> torch.Tensor:
        """`forward` as the decoding loop calls it (no gradient, a cache); a head type may run it by a shorter path
        that computes the same function."""
        return self(features, token_embeds, position_ids, attention_mask, cache)

    @contextmanager
    def unrolled(self) -> Iterator[None]:
        """Within it, the drafter's attention computes the training layout of `unrolled_mask` (whatever 4D mask
        it is given) with `unrolled_attention`, at the cost of one causal attention instead of `level` of them."""
        configs = {id(m.config): m.config for m in self.modules() if type(m).__name__.endswith("Attention")}
        before = {key: config._attn_implementation for key, config in configs.items()}
        for config in configs.values():
            config._attn_implementation = UNROLLED
        try:
            yield
        finally:
            for key, config in configs.items():
                config._attn_implementation = before[key]


class EagleHead(ContextDrafter):
    r"""
    `fc([f_t; e(x_{t+1})])`, then one decoder layer (the backbone's architecture, built from
    `config.decoder_config`) and its final norm: features [..., T, H] -> predicted next features [..., T, H].

    Example:

    >>> from transformers import LlamaConfig
    >>> backbone = LlamaConfig(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2)
    >>> config = MedusaConfig(head_type="eagle", hidden_size=32, vocab_size=100,
    ...                       decoder_config=decoder_config_for(backbone))
    >>> EagleHead(config)(torch.zeros(1, 5, 32), torch.zeros(1, 5, 32)).shape
    torch.Size([1, 5, 32])
    """

    head_type = "eagle"
    can_own_lm_head = False
    base_model_prefix = "eagle"

    @classmethod
    def config_fields_for(cls, backbone_config: PreTrainedConfig) -> dict:
        return {"decoder_config": decoder_config_for(backbone_config)}

    def __init__(self, config: MedusaConfig):
        self.check_config(config)
        super().__init__(config)
        h = config.hidden_size
        decoder = dict(config.decoder_config)
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.decoder = AutoModel.from_config(AutoConfig.for_model(decoder.pop("model_type"), **decoder))
        self._register_draft_vocab()
        self.post_init()

    @torch.no_grad()
    def init_from_backbone(self, backbone: PreTrainedModel) -> None:
        """Start as "the next feature is this one": fc reads the feature only and the layer's residual branches
        output zero, so the drafter's first guesses are the backbone's own next token. From there it learns
        the shift by one position far faster than from a random start."""
        h = self.config.hidden_size
        self.fc.weight.zero_()
        self.fc.weight[:, :h].copy_(torch.eye(h))
        for name, param in self.decoder.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                param.zero_()

    def forward(self, features: torch.Tensor, token_embeds: torch.Tensor, position_ids: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None, cache=None) -> torch.Tensor:
        r"""
        Args:
            features: [B, T, H], the feature at each entry's position (the backbone's, or a predicted one).
            token_embeds: [B, T, H], the embedding of the token after each position.
            position_ids: [B, T]; attention_mask: a 4D boolean mask over cache + new entries (causal if None).
            cache: a transformers cache of earlier entries; the new ones are appended to it.

        Returns:
            [B, T, H], the predicted feature at each entry's next position.
        """
        x = self.fc(torch.cat([features, token_embeds], dim=-1))
        out = self.decoder(inputs_embeds=x, position_ids=position_ids, attention_mask=attention_mask,
                           cache=cache, use_cache=cache is not None)
        return out.last_hidden_state

    def project(self, head: int, states: torch.Tensor, lm_head: nn.Module | None = None) -> torch.Tensor:
        """Predicted features [..., H] -> logits [..., V_out] with the backbone's LM head, `lm_head` (its draft-vocabulary
        rows: `output_projection`); the same at every depth."""
        return lm_head(states)


def unrolled_mask(level: int, length: int, device: torch.device | str = "cpu") -> torch.Tensor:
    r"""
    The attention of draft depth `level` (1-based) in training, over the keys of levels 1..level for one
    sequence of `length` entries: [length, level * length] bool.

    Level 1 is the backbone's own features, causal. Level j at position t stands for the (j-1)-th drafted entry
    after a context that ends at t - j + 1: it sees level-1 keys up to t - j + 1 and, of each level i in
    2..j, the one key at t - (j - i): its own draft path. This is exactly what it sees when drafting.
    """
    t = torch.arange(length, device=device)
    blocks = [t[None, :] <= (t[:, None] - level + 1)]
    blocks += [t[None, :] == (t[:, None] - (level - i)) for i in range(2, level + 1)]
    return torch.cat(blocks, dim=1)


def unrolled_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       attention_mask: torch.Tensor | None, scaling: float, dropout: float = 0.0,
                       **kwargs) -> tuple[torch.Tensor, None]:
    r"""
    Attention over `unrolled_mask(level, n)` without the mask (a transformers attention function, registered as
    "medusa_unrolled"): query [B, h, n, d], key and value [B, h_kv, level * n, d] -> [B, n, h, d].

    Level 1's keys are a causal block shifted by level - 1; each later level i adds one key per query, the one
    at t - (level - i), a dot product along a diagonal. So the cost is one causal attention over n keys and
    level - 1 products a query, where a masked attention over all level * n keys costs `level` of them.
    """
    B, h, n, d = query.shape
    kv_heads, level = key.shape[1], key.shape[2] // n
    if key.shape[2] != level * n or (attention_mask is not None and attention_mask.shape[-1] != key.shape[2]):
        raise ValueError(f"unrolled attention expects level x {n} keys, got {key.shape[2]}")
    q = query.view(B, kv_heads, h // kv_heads, n, d)  # grouped query heads share their key/value head
    k, v = key[:, :, None], value[:, :, None]  # [B, h_kv, 1, level * n, d]
    t = torch.arange(n, device=query.device)
    scores = [(q @ k[..., :n, :].transpose(-1, -2)).masked_fill(t[None, :] > t[:, None] - level + 1, float("-inf"))]
    shifted = []
    for i in range(2, level + 1):
        shift = level - i  # query t sees level i's key at t - shift
        k_i = F.pad(k[..., (i - 1) * n : i * n - shift, :], (0, 0, shift, 0))
        shifted.append(F.pad(v[..., (i - 1) * n : i * n - shift, :], (0, 0, shift, 0)))
        scores.append((q * k_i).sum(-1, keepdim=True).masked_fill((t < shift)[:, None], float("-inf")))
    weights = torch.softmax(torch.cat(scores, dim=-1) * scaling, dim=-1,
                            dtype=torch.promote_types(query.dtype, torch.float32)).to(query.dtype)
    out = weights[..., :n] @ v[..., :n, :]
    for i, v_i in enumerate(shifted):
        out = out + weights[..., n + i, None] * v_i
    return out.reshape(B, h, n, d).transpose(1, 2).contiguous(), None


UNROLLED = "medusa_unrolled"
AttentionInterface.register(UNROLLED, unrolled_attention)
