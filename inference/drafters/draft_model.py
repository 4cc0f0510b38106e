"""Drafters without heads that draft with a language model: a separate small LM, the backbone's own first layers.

Each proposes a chain that the backbone verifies in one forward like any tree, so greedy acceptance keeps the
output exactly the backbone's greedy output whatever the drafter guesses.
"""

import copy

import torch
from torch import nn
from transformers import DynamicCache, PreTrainedModel

from medusa_heads.errors import MedusaError
from medusa_heads.model import MedusaModel
from medusa_heads.tree import chain_tree

from ..draft import DecodeState, Draft


class DraftModelDrafter:
    r"""
    Classic speculative decoding: a small causal LM with the backbone's tokenizer drafts `length` tokens
    greedily, one forward each, with its own KV cache.

    Each step the cache is brought in line with the committed sequence: the drafted tokens the backbone
    rejected are cropped and the tokens committed since the last call are fed in one forward. The draft is
    deterministic (argmax), so greedy acceptance is exact and so is `ExactAcceptance`, the exact-sampling rule
    for deterministic drafts: rejection sampling with the draft's probabilities is not needed for exactness.

    Args:
        model: the backbone (with heads, unused here) that verifies the drafts.
        draft: the draft model, on the backbone's device.
        length: drafted tokens per step.
    """

    per_sequence = True  # its cache follows one sequence

    def __init__(self, model: MedusaModel, draft: PreTrainedModel, length: int = 4):
        vocab, draft_vocab = (m.get_output_embeddings().weight.shape[0] for m in (model.backbone, draft))
        if vocab != draft_vocab:
            raise MedusaError(f"The draft model's vocabulary ({draft_vocab}) differs from the backbone's ({vocab}); "
                              "it must use the same tokenizer.")
        self.draft = draft
        self.length = length
        self.device = model.device
        self.tree = chain_tree(length, model.device)
        self.cache: DynamicCache | None = None
        self.cached: list[int] = []  # the tokens whose keys and values the cache holds
        self.committed = 0  # how many of them were committed tokens at the last call

    def _sync(self, token_ids: list[int]) -> list[int]:
        """Crop the cache to its longest prefix of `token_ids` (leaving at least the last token out: its logits
        are needed); return the tokens to feed."""
        if self.cache is None or token_ids[: self.committed] != self.cached[: self.committed]:
            # another sequence: start over
            self.cache, self.cached, self.committed = DynamicCache(config=self.draft.config), [], 0
        limit = min(len(self.cached), len(token_ids) - 1)
        keep = min(self.committed, limit)  # the committed part matches: only the drafted tokens need a look
        while keep < limit and self.cached[keep] == token_ids[keep]:
            keep += 1
        if len(self.cached) > keep:
            self.cache.crop(keep - len(self.cached))
        self.cached = token_ids[:keep]
        return token_ids[keep:]

    @torch.no_grad()
    def propose(self, state: DecodeState) -> Draft:
        feed = torch.tensor([self._sync(state.token_ids)], device=self.draft.device)
        drafted = []
        for _ in range(self.length):
            logits = self.draft(input_ids=feed, cache=self.cache, use_cache=True, logits_to_keep=1).logits
            feed = logits[:, -1].argmax(dim=-1, keepdim=True)  # [1, 1], stays on the device until the end
            drafted.append(feed[0])
        drafted = torch.cat(drafted).to(self.device)
        # The last drafted token was never fed: its entry is made next step, if it is accepted.
        self.cached = state.token_ids + drafted[:-1].tolist()
        self.committed = len(state.token_ids)
        root = torch.tensor([state.root], device=self.device)
        return Draft(self.tree, torch.cat([root, drafted]))


def early_exit_model(backbone: PreTrainedModel, layers: int) -> PreTrainedModel:
    r"""
    The backbone cut after its first `layers` decoder layers, followed by its own final norm and LM head.

    The modules are the backbone's own (shallow copies of the wrappers, no weight is copied); the config says
    `layers` layers, so caches made from it have that many.
    """
    config = copy.deepcopy(backbone.config)
    text = config.get_text_config()
    total = text.num_hidden_layers
    if not 1 <= layers < total:
        raise MedusaError(f"The exit layer must be between 1 and {total - 1} (the backbone has {total} layers), "
                          f"got {layers}.")
    text.num_hidden_layers = layers
    if getattr(text, "layer_types", None) is not None:
        text.layer_types = text.layer_types[:layers]
    decoder = backbone.base_model
    stacks = [n for n, m in decoder.named_children() if isinstance(m, nn.ModuleList) and len(m) == total]
    if len(stacks) != 1:
        raise MedusaError(f"Cannot find the decoder layers of `{type(backbone).__name__}` for early exit.")
    cut = _shallow_copy(decoder, config=text, **{stacks[0]: nn.ModuleList(getattr(decoder, stacks[0])[:layers])})
    return _shallow_copy(backbone, config=config, **{backbone.base_model_prefix: cut})


def _shallow_copy(module: nn.Module, **replace) -> nn.Module:
    clone = copy.copy(module)
    clone._modules = dict(module._modules)  # copy.copy shares the submodule dict: replacing one would edit both
    for name, value in replace.items():
        setattr(clone, name, value)
    return clone


class EarlyExitDrafter(DraftModelDrafter):
    """Self-drafting with the backbone's first `exit_layer` layers (its own norm and LM head after them) and a
    cache of their own. Backbones not trained for early exit accept few of these drafts."""

    def __init__(self, model: MedusaModel, exit_layer: int, length: int = 4):
        super().__init__(model, early_exit_model(model.backbone, exit_layer), length)
