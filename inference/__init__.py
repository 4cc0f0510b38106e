"""Tree decoding: propose candidates, verify them in one backbone forward, accept, compact the cache."""

from .acceptance import Accepted, GreedyAcceptance, TypicalAcceptance, make_acceptance
from .drafters import Draft, MedusaDrafter
from .generate import Generation, GenerationStats, generate, generate_ids, stream

__all__ = [
    "Accepted",
    "Draft",
    "Generation",
    "GenerationStats",
    "GreedyAcceptance",
    "MedusaDrafter",
    "TypicalAcceptance",
    "generate",
    "generate_ids",
    "make_acceptance",
    "stream",
]
