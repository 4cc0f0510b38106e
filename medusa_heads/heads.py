"""Heads on the last hidden state: `MedusaHeads` and `HydraHeads`, and `DraftHeads`, the base of every head type."""

from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedConfig, PreTrainedModel

from .config import MedusaConfig


class ResBlock(nn.Module):
    """`h + SiLU(W h + b)`; W and b start at zero, so a fresh block is the identity."""

    def __init__(self, hidden_size: int):
        super().__init__()
        # Plain parameters, not an nn.Linear, so transformers' generic Linear init leaves the zeros alone.
        self.weight = nn.Parameter(torch.zeros(hidden_size, hidden_size))
        self.bias = nn.Parameter(torch.zeros(hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.silu(F.linear(x, self.weight, self.bias))


class TokenMix(nn.Module):
    """Hydra input: `h + W [e_1; ...; e_n]`, the hidden state plus a projection of the path's n token
    embeddings. W starts at zero, so a fresh Hydra head is a fresh Medusa head."""

    def __init__(self, hidden_size: int, n_tokens: int):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(hidden_size, n_tokens * hidden_size))

    def forward(self, hidden: torch.Tensor, token_embeds: torch.Tensor) -> torch.Tensor:
        """hidden [..., H] (broadcast), token_embeds [..., n, H] -> [..., H]."""
        return hidden + F.linear(token_embeds.flatten(-2), self.weight)


class DraftHeads(PreTrainedModel):
    r"""
    What every head type shares: its config, the draft vocabulary, and its capabilities as class attributes.
    The runtime and the trainer read the capabilities; they never compare `head_type` strings.

    Capabilities:
        head_type: the `MedusaConfig.head_type` this class is (the key in `medusa_heads.head_types.HEAD_TYPES`).
        reads_tokens: it also reads the embeddings of tokens after the hidden state's position.
        drafts_over_context: it keeps its own view of the whole context (a KV cache of its own), so it cannot
            score an arbitrary path from the last hidden state alone (no calibration from data or step
            profiling); it drafts static trees and dynamic ones, depth by depth through its cache.
        trains_with_adapter: it can train beside LoRA adapters on the backbone (Medusa-2).
        can_own_lm_head: it may own its vocabulary projection (`share_lm_head=False`).
        must_own_lm_head: it always owns it (`share_lm_head=True` is an error).
    """

    config_class = MedusaConfig
    head_type: ClassVar[str]
    reads_tokens: ClassVar[bool] = False
    drafts_over_context: ClassVar[bool] = False
    trains_with_adapter: ClassVar[bool] = True
    can_own_lm_head: ClassVar[bool] = True
    must_own_lm_head: ClassVar[bool] = False
    reads_layers: ClassVar[bool] = False  # config.feature_layers: layers it reads beside the last hidden state
    draft_vocab: torch.Tensor | None

    @classmethod
    def check_config(cls, config: MedusaConfig) -> None:
        """Raise ValueError, naming the field, for a config this head type cannot be built from."""
        if config.head_type != cls.head_type:
            raise ValueError(f"`head_type` {config.head_type!r} does not match {cls.__name__} ({cls.head_type!r}).")
        if not config.share_lm_head and not cls.can_own_lm_head:
            raise ValueError(f"`head_type={cls.head_type!r}` scores with the backbone's LM head: it needs "
                             "`share_lm_head=True`.")
        if config.share_lm_head and cls.must_own_lm_head:
            raise ValueError(f"`head_type={cls.head_type!r}` scores with an LM head of its own: it needs "
                             "`share_lm_head=False`.")

    @classmethod
    def config_fields_for(cls, backbone_config: PreTrainedConfig) -> dict:
        """Config fields this head type derives from the backbone's config (beyond sizes)."""
        return {}

    def init_from_backbone(self, backbone: PreTrainedModel) -> None:
        """Make fresh heads start from the backbone's own prediction (called by `untrained_heads`)."""

    @property
    def feature_layers(self) -> tuple[int, ...]:
        """The backbone's layers whose inputs the heads read beside its last hidden state (`tap_features`)."""
        return ()

    def _register_draft_vocab(self) -> None:
        if self.config.draft_vocab_size:
            self.register_buffer("draft_vocab", torch.arange(self.config.draft_vocab_size))
        else:
            self.draft_vocab = None

    @torch.no_grad()
    def set_draft_vocab(self, token_ids: torch.Tensor) -> None:
        """The tokens the heads guess among, [draft_vocab_size] ids of the backbone's vocabulary."""
        if self.draft_vocab is None or token_ids.shape != self.draft_vocab.shape:
            raise ValueError(f"Expected {self.config.draft_vocab_size} draft-vocabulary ids, got "
                             f"{tuple(token_ids.shape)}.")
        self.draft_vocab.copy_(token_ids)

    def owned_projections(self) -> list[nn.Linear]:
        """The vocabulary projections the heads own (one row per draft-vocabulary token); none when they share
        the backbone's LM head."""
        return []

    def output_projection(self, lm_head: nn.Module) -> nn.Module:
        """The projection shared heads score with: `lm_head` itself, or its rows of the draft vocabulary
        (a copy, made once by the caller)."""
        if self.draft_vocab is None:
            return lm_head
        sub = nn.Linear(lm_head.weight.shape[1], self.draft_vocab.numel(), bias=False,
                        device=lm_head.weight.device, dtype=lm_head.weight.dtype)
        sub.weight.data.copy_(lm_head.weight.data[self.draft_vocab.to(lm_head.weight.device)])
        return sub.requires_grad_(False)

    def token_ids(self, indices: torch.Tensor) -> torch.Tensor:
        """Indices into the heads' output vocabulary -> token ids of the backbone's vocabulary."""
        return indices if self.draft_vocab is None else self.draft_vocab[indices]


class MedusaHeads(DraftHeads):
    r"""
    Medusa heads (`head_type="medusa"`): per head, `num_layers` residual blocks (each its own module) on the last
    hidden state, then a vocabulary projection.

    With `config.share_lm_head` the projection is the backbone's LM head, passed to `forward`, and the
    saved weights hold the residual blocks only. An untrained head is then exactly the backbone's LM head.
    With `config.draft_vocab_size`, heads score only the tokens in the `draft_vocab` buffer: use
    `output_projection` to get the projection they expect and `token_ids` to map their outputs back.

    Example:

    >>> heads = MedusaHeads(MedusaConfig(num_heads=2, hidden_size=8, vocab_size=11))
    >>> heads(torch.zeros(3, 8), lm_head=nn.Linear(8, 11, bias=False)).shape
    torch.Size([2, 3, 11])
    """

    head_type = "medusa"
    base_model_prefix = "medusa"
    main_input_name = "hidden_states"

    def __init__(self, config: MedusaConfig):
        self.check_config(config)
        super().__init__(config)
        h, k = config.hidden_size, config.num_heads
        self.blocks = nn.ModuleList(nn.Sequential(*[ResBlock(h) for _ in range(config.num_layers)]) for _ in range(k))
        out = config.draft_vocab_size or config.vocab_size
        self.lm_heads = None if config.share_lm_head else nn.ModuleList(nn.Linear(h, out, bias=False) for _ in range(k))
        self._add_modules(config)
        self._register_draft_vocab()
        self.post_init()

    def owned_projections(self) -> list[nn.Linear]:
        return [] if self.lm_heads is None else list(self.lm_heads)

    def _add_modules(self, config: MedusaConfig) -> None:
        """Subclasses add their own modules here, before the weights are initialised."""

    @torch.no_grad()
    def init_from_backbone(self, backbone: PreTrainedModel) -> None:
        """Heads with their own projections start from a copy of the backbone's LM head (its draft-vocabulary
        rows); shared heads already score with it."""
        if self.lm_heads is not None:
            start = self.output_projection(backbone.get_output_embeddings()).weight
            for own in self.lm_heads:
                own.weight.copy_(start)

    def head_state(self, head: int, hidden: torch.Tensor, token_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """One head before its projection: hidden [..., H] -> [..., H]."""
        return self.blocks[head](hidden)

    def head_states(self, hidden_states: torch.Tensor, token_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """hidden_states: [..., H] -> [K, ..., H], before the vocabulary projection."""
        return torch.stack([self.head_state(j, hidden_states, token_embeds) for j in range(len(self.blocks))])

    def project(self, head: int, states: torch.Tensor, lm_head: nn.Module | None = None) -> torch.Tensor:
        """One head's vocabulary projection: states [..., H] -> logits [..., V_out] over the output vocabulary.
        Shared heads take `lm_head=output_projection(backbone_lm_head)`."""
        if self.lm_heads is not None:
            return self.lm_heads[head](states)
        if lm_head is None:
            raise ValueError("These heads share the backbone's LM head: pass it as `lm_head=`.")
        return lm_head(states)

    def forward(self, hidden_states: torch.Tensor, lm_head: nn.Module | None = None,
                token_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """hidden_states: [..., H] -> logits [K, ..., V_out]. `lm_head` is required when the heads share it."""
        states = self.head_states(hidden_states, token_embeds)
        if self.lm_heads is None:
            return self.project(0, states, lm_head)  # one matmul for all heads
        return torch.stack([self.project(k, s) for k, s in enumerate(states)])


class HydraHeads(MedusaHeads):
    r"""
    Hydra heads (`head_type="hydra"`): head j (0-based) also reads the embeddings of the j + 1 tokens after the
    hidden state's position (the root, then the guesses of heads 0..j-1 on the draft path), so the guesses
    along a path are coherent. A fresh Hydra head is a fresh Medusa head (its token mix starts at zero).
    """

    head_type = "hydra"
    reads_tokens = True

    def _add_modules(self, config: MedusaConfig) -> None:
        self.mixers = nn.ModuleList(TokenMix(config.hidden_size, j + 1) for j in range(config.num_heads))

    def head_state(self, head: int, hidden: torch.Tensor, token_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """hidden [..., H] and token_embeds [..., n >= head + 1, H], the embeddings of the tokens after the
        hidden state's position -> [..., H]."""
        if token_embeds is None:
            raise ValueError("Hydra heads read the path's tokens: pass `token_embeds`.")
        return self.blocks[head](self.mixers[head](hidden, token_embeds[..., : head + 1, :]))
