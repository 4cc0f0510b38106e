"""`Eagle3Head`: an EAGLE-3-style drafter, one decoder layer over a fusion of several of the backbone's layers.

At position t it reads the inputs of the backbone's `feature_layers` at t (a low, a middle and a high layer), fused
by `fc` (nH -> H) into g_t, and the embedding of the next token x_{t+1}. Its decoder layer's attention reads
`[input_layernorm(e(x_{t+1})); hidden_norm(g_t)]` (2H) over the whole context, its residual stream starts at g_t,
and its own LM head over the draft vocabulary guesses x_{t+2} from the final norm of its output. Drafting deeper
feeds that output (before the norm) back in place of the fused features. This is the function of vLLM's
`Eagle3LlamaForCausalLM` with `norm_before_residual: false`; `formats.export_speculators` writes it for vLLM.
"""

import copy

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoConfig, AutoModel, PreTrainedConfig, PreTrainedModel
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from .config import MedusaConfig
from .eagle import ContextDrafter, decoder_config_for


def default_feature_layers(num_layers: int) -> list[int]:
    """vLLM's default for EAGLE-3: a low, a middle and a high layer (2, 15 and 27 of 30); fewer when the backbone
    is too shallow for three distinct ones."""
    return sorted({min(2, num_layers - 1), num_layers // 2, max(num_layers - 3, 0)})


class Eagle3Head(ContextDrafter):
    r"""
    `fc` over the backbone's feature layers, one decoder layer whose attention reads [embedding; feature], a final
    norm and an LM head of its own: features [..., T, (1 + n) H] (the backbone's, as `backbone_forward` returns them
    from a backbone tapped with `feature_layers`) or [..., T, H] (its own, fed back) -> its output [..., T, H];
    `project` turns that into logits over the draft vocabulary.

    Example:

    >>> from transformers import LlamaConfig
    >>> backbone = LlamaConfig(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2)
    >>> config = MedusaConfig(head_type="eagle3", hidden_size=32, vocab_size=100, share_lm_head=False,
    ...                       decoder_config=decoder_config_for(backbone), feature_layers=[0, 1, 2])
    >>> Eagle3Head(config)(torch.zeros(1, 5, 4 * 32), torch.zeros(1, 5, 32)).shape
    torch.Size([1, 5, 32])
    """

    head_type = "eagle3"
    must_own_lm_head = True
    reads_layers = True
    base_model_prefix = "eagle3"

    @classmethod
    def check_config(cls, config: MedusaConfig) -> None:
        super().check_config(config)
        if not config.feature_layers:
            raise ValueError("`head_type=\"eagle3\"` needs `feature_layers`, the backbone's layers it reads.")

    @classmethod
    def config_fields_for(cls, backbone_config: PreTrainedConfig) -> dict:
        layers = default_feature_layers(backbone_config.get_text_config().num_hidden_layers)
        return {"decoder_config": decoder_config_for(backbone_config), "feature_layers": layers}

    def __init__(self, config: MedusaConfig):
        self.check_config(config)
        super().__init__(config)
        h = config.hidden_size
        decoder = dict(config.decoder_config)
        decoder = AutoModel.from_config(AutoConfig.for_model(decoder.pop("model_type"), **decoder),
                                        attn_implementation="sdpa")  # boolean 4D masks
        self.fc = nn.Linear(len(config.feature_layers) * h, h, bias=False)
        self.layer = decoder.layers[0]
        for name in ("q_proj", "k_proj", "v_proj"):  # they read [embedding; feature]
            own = getattr(self.layer.self_attn, name)
            setattr(self.layer.self_attn, name, nn.Linear(2 * h, own.out_features, bias=own.bias is not None))
        self.hidden_norm = copy.deepcopy(self.layer.input_layernorm)
        self.norm = decoder.norm
        self.rotary_emb = decoder.rotary_emb
        self.lm_head = nn.Linear(h, config.draft_vocab_size or config.vocab_size, bias=False)
        self._register_draft_vocab()
        self.post_init()
        # `decode` computes the attention block itself where it is a Llama layer's (RMSNorm, rotary angles that
        # depend on the position alone); any other architecture decodes through its modules
        rope_type = getattr(self.rotary_emb, "rope_type", "default")
        self._short_decode = (type(self.layer).__name__ == "LlamaDecoderLayer"
                              and rope_type in ("default", "linear", "llama3"))
        self._rope_table: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def feature_layers(self) -> tuple[int, ...]:
        return tuple(self.config.feature_layers)

    def owned_projections(self) -> list[nn.Linear]:
        return [self.lm_head]

    @torch.no_grad()
    def init_from_backbone(self, backbone: PreTrainedModel) -> None:
        """Start from the highest feature layer passed through unchanged (fc selects it, the layer's residual
        branches output zero), the backbone's final norm and its LM head's draft-vocabulary rows: the first guesses
        are what the backbone's upper layers already say."""
        h = self.config.hidden_size
        self.fc.weight.zero_()
        self.fc.weight[:, -h:].copy_(torch.eye(h))
        self.layer.self_attn.o_proj.weight.zero_()
        self.layer.mlp.down_proj.weight.zero_()
        self.norm.weight.copy_(backbone.get_decoder().norm.weight)
        self.lm_head.weight.copy_(self.output_projection(backbone.get_output_embeddings()).weight)

    def forward(self, features: torch.Tensor, token_embeds: torch.Tensor, position_ids: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None, cache=None) -> torch.Tensor:
        r"""
        Args:
            features: [B, T, (1 + n) H], the backbone's (its last hidden state, then its n feature layers' inputs),
                or [B, T, H], the drafter's own outputs fed back.
            token_embeds: [B, T, H], the embedding of the token after each position.
            position_ids: [B, T]; attention_mask: a 4D boolean mask over cache + new entries (causal if None).
            cache: a transformers cache of earlier entries; the new ones are appended to it.

        Returns:
            [B, T, H], the output at each entry (before the final norm), fed back when drafting deeper.
        """
        features, position_ids, attention_mask = self._inputs(features, position_ids, attention_mask, cache)
        x = torch.cat([self.layer.input_layernorm(token_embeds), self.hidden_norm(features)], dim=-1)
        attended, _ = self.layer.self_attn(hidden_states=x, position_embeddings=self.rotary_emb(x, position_ids),
                                           attention_mask=attention_mask, cache=cache)
        out = features + attended
        return out + self.layer.mlp(self.layer.post_attention_layernorm(out))

    def _inputs(self, features: torch.Tensor, position_ids: torch.Tensor | None, attention_mask: torch.Tensor | None,
                cache) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`forward`'s arguments made whole: the backbone's features fused by `fc` (checked), positions after the
        cache's entries and a causal mask where none are given."""
        h = self.config.hidden_size
        if features.shape[-1] == (1 + len(self.config.feature_layers)) * h:
            features = self.fc(features[..., h:])
        elif features.shape[-1] != h:
            raise ValueError(f"Expected features of {h} or {(1 + len(self.config.feature_layers)) * h} values (the "
                             f"backbone tapped at {self.config.feature_layers}), got {features.shape[-1]}.")
        past, n, device = cache.get_seq_length() if cache is not None else 0, features.shape[-2], features.device
        new = torch.arange(past, past + n, device=device)
        if position_ids is None:
            position_ids = new.expand(*features.shape[:-2], n)
        if attention_mask is None:
            attention_mask = (torch.arange(past + n, device=device)[None, :] <= new[:, None])[None, None]
        return features, position_ids, attention_mask

    def decode(self, features: torch.Tensor, token_embeds: torch.Tensor, position_ids: torch.Tensor | None,
               attention_mask: torch.Tensor | None, cache) -> torch.Tensor:
        r"""
        `forward` for one sequence of the decoding loop ([1, T, ...] inputs and a cache), written out for a Llama
        layer: rotary angles from a table, fused RMSNorms, SDPA over the grouped key/value heads in place. A
        drafter call is a few small matrix products, so the modules' own steps (angles recomputed, eight
        operations a norm, key/value heads copied per group) were about an eighth of the drafting time on this
        project's CPU. Same function as `forward` up to rounding (tested); the drafts it makes are verified like
        any others.
        """
        if not self._short_decode or features.shape[0] != 1:
            return self(features, token_embeds, position_ids, attention_mask, cache)
        attn, mlp = self.layer.self_attn, self.layer.mlp
        features, position_ids, attention_mask = self._inputs(features, position_ids, attention_mask, cache)
        heads, kv_heads, dim = attn.config.num_attention_heads, attn.config.num_key_value_heads, attn.head_dim
        n = features.shape[1]
        x = torch.cat([_rms(token_embeds, self.layer.input_layernorm), _rms(features, self.hidden_norm)], dim=-1)
        q = attn.q_proj(x).view(n, heads, dim).transpose(0, 1)
        k = attn.k_proj(x).view(n, kv_heads, dim).transpose(0, 1)
        v = attn.v_proj(x).view(n, kv_heads, dim).transpose(0, 1)
        cos, sin = self._angles(position_ids[0], x)
        q, k = apply_rotary_pos_emb(q[None], k[None], cos[None], sin[None])
        keys, values = cache.update(k, v[None], 0)
        attended = F.scaled_dot_product_attention(q, keys, values, attn_mask=attention_mask, scale=attn.scaling,
                                                  enable_gqa=kv_heads != heads)
        out = features + attn.o_proj(attended[0].transpose(0, 1).reshape(1, n, heads * dim))
        return out + mlp(_rms(out, self.layer.post_attention_layernorm))

    def _angles(self, positions: torch.Tensor, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The rotary embedding's cos and sin [T, head_dim] at `positions`, from a table of every position the
        backbone takes (made once; no host read of `positions`, which may live on a GPU)."""
        table = self._rope_table
        if table is None or table[0].dtype != like.dtype or table[0].device != like.device:
            size = self.layer.self_attn.config.max_position_embeddings
            cos, sin = self.rotary_emb(like, torch.arange(size, device=like.device)[None])
            table = self._rope_table = cos[0], sin[0]
        return table[0][positions], table[1][positions]

    def project(self, head: int, states: torch.Tensor, lm_head: nn.Module | None = None) -> torch.Tensor:
        """Outputs [..., H] -> logits [..., V_out] over the draft vocabulary, through the final norm and the drafter's
        own LM head (the same at every depth; `lm_head` is not used)."""
        return self.lm_head(self.norm(states))


def _rms(x: torch.Tensor, norm: nn.Module) -> torch.Tensor:
    """A Llama RMSNorm module's function in one fused call (fp32 inside, as the module computes)."""
    return norm.weight * F.rms_norm(x.float(), (x.shape[-1],), eps=norm.variance_epsilon).to(x.dtype)
