"""Tree decoding: propose candidates, verify them in one backbone forward, accept, compact the cache."""

from .acceptance import Accepted, ExactAcceptance, GreedyAcceptance, TypicalAcceptance, make_acceptance
from .draft_model import DraftModelDrafter, EarlyExitDrafter, NgramDrafter
from .drafters import Draft, MedusaDrafter, MedusaNgramDrafter, make_drafter, ngram_lookup
from .eagle import EagleDrafter
from .generate import Generation, GenerationStats, generate, generate_ids, stream
from .sampling import Warper

__all__ = [
    "Accepted",
    "Draft",
    "DraftModelDrafter",
    "EagleDrafter",
    "EarlyExitDrafter",
    "ExactAcceptance",
    "Generation",
    "GenerationStats",
    "GreedyAcceptance",
    "MedusaDrafter",
    "MedusaNgramDrafter",
    "NgramDrafter",
    "TypicalAcceptance",
    "Warper",
    "generate",
    "generate_ids",
    "make_acceptance",
    "make_drafter",
    "ngram_lookup",
    "stream",
]
