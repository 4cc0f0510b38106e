"""The runtime. Tree decoding: propose candidates, verify them in one backbone forward, accept, compact the cache.

Drafters and acceptance rules are listed by name in `registry`; `generate` holds the decoding loop.
"""

from .acceptance import ExactAcceptance, GreedyAcceptance, TypicalAcceptance
from .draft import Accepted, DecodeState, Draft, Drafter
from .drafters.draft_model import DraftModelDrafter, EarlyExitDrafter
from .drafters.dynamic import AdaptiveDrafter, DynamicDrafter
from .drafters.eagle import EagleDrafter
from .drafters.eagle3_tree import Eagle3TreeDrafter
from .drafters.heads import MedusaDrafter
from .drafters.ngram import DynamicNgramDrafter, MedusaNgramDrafter, NgramDrafter, ngram_lookup
from .generate import (Generation, GenerationStats, Request, decode, generate, generate_batch, generate_ids, stream,
                       warm_up)
from .registry import ACCEPTANCE_RULES, DRAFTERS, heads_drafter, make_acceptance, make_drafter, make_drafters
from .sampling import Warper

__all__ = [
    "ACCEPTANCE_RULES",
    "Accepted",
    "AdaptiveDrafter",
    "DRAFTERS",
    "DecodeState",
    "Draft",
    "DraftModelDrafter",
    "Drafter",
    "DynamicDrafter",
    "DynamicNgramDrafter",
    "Eagle3TreeDrafter",
    "EagleDrafter",
    "EarlyExitDrafter",
    "ExactAcceptance",
    "Generation",
    "GenerationStats",
    "GreedyAcceptance",
    "MedusaDrafter",
    "MedusaNgramDrafter",
    "NgramDrafter",
    "Request",
    "TypicalAcceptance",
    "Warper",
    "decode",
    "generate",
    "generate_batch",
    "generate_ids",
    "heads_drafter",
    "make_acceptance",
    "make_drafter",
    "make_drafters",
    "ngram_lookup",
    "stream",
    "warm_up",
]
