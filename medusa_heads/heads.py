"""`MedusaHeads`: K small heads that guess the tokens after next from the backbone's last hidden state."""

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel

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


class MedusaHeads(PreTrainedModel):
    r"""
    The heads alone: per head, `num_layers` residual blocks (each its own module) and a vocabulary projection.

    With `config.share_lm_head` the projection is the backbone's LM head, passed to `forward`, and the
    saved weights hold the residual blocks only. An untrained head is then exactly the backbone's LM head.

    Example:

    >>> heads = MedusaHeads(MedusaConfig(num_heads=2, hidden_size=8, vocab_size=11))
    >>> heads(torch.zeros(3, 8), lm_head=nn.Linear(8, 11, bias=False)).shape
    torch.Size([2, 3, 11])
    """

    config_class = MedusaConfig
    base_model_prefix = "medusa"
    main_input_name = "hidden_states"

    def __init__(self, config: MedusaConfig):
        super().__init__(config)
        h = config.hidden_size
        self.blocks = nn.ModuleList(
            nn.Sequential(*[ResBlock(h) for _ in range(config.num_layers)]) for _ in range(config.num_heads)
        )
        self.lm_heads = (
            None
            if config.share_lm_head
            else nn.ModuleList(nn.Linear(h, config.vocab_size, bias=False) for _ in range(config.num_heads))
        )
        self.post_init()

    @torch.no_grad()
    def init_lm_heads_from(self, lm_head: nn.Module) -> None:
        """Copy the backbone's LM head into each head's own projection (`share_lm_head=False`)."""
        if self.lm_heads is None:
            raise ValueError("These heads share the backbone's LM head (`share_lm_head=True`); there is nothing to copy into.")
        for own in self.lm_heads:
            own.weight.copy_(lm_head.weight)

    def head_states(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """hidden_states: [..., H] -> [K, ..., H], before the vocabulary projection."""
        return torch.stack([block(hidden_states) for block in self.blocks])

    def project(self, head: int, states: torch.Tensor, lm_head: nn.Module | None = None) -> torch.Tensor:
        """One head's vocabulary projection: states [..., H] -> logits [..., V]."""
        if self.lm_heads is not None:
            return self.lm_heads[head](states)
        if lm_head is None:
            raise ValueError("These heads share the backbone's LM head: pass it as `lm_head=`.")
        return lm_head(states)

    def forward(self, hidden_states: torch.Tensor, lm_head: nn.Module | None = None) -> torch.Tensor:
        """hidden_states: [..., H] -> logits [K, ..., V]. `lm_head` is required when the heads share it."""
        states = self.head_states(hidden_states)
        if self.lm_heads is None:
            return self.project(0, states, lm_head)  # one matmul for all heads
        return torch.stack([self.project(k, s) for k, s in enumerate(states)])
