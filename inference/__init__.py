"""Tree decoding: propose candidates, verify them in one backbone forward, accept, compact the cache."""

from .acceptance import Accepted, GreedyAcceptance, TypicalAcceptance, make_acceptance
from .draft_model import DraftModelDrafter, EarlyExitDrafter, NgramDrafter
from .drafters import Draft, MedusaDrafter, MedusaNgramDrafter, make_drafter, ngram_lookup
from .generate import Generation, GenerationStats, generate, generate_ids, stream

__all__ = [
    "Accepted",
    "Draft",
    "DraftModelDrafter",
    "EarlyExitDrafter",
    "Generation",
    "GenerationStats",
    "GreedyAcceptance",
    "MedusaDrafter",
    "MedusaNgramDrafter",
    "NgramDrafter",
    "TypicalAcceptance",
    "generate",
    "generate_ids",
    "make_acceptance",
    "make_drafter",
    "ngram_lookup",
    "stream",
]
