"""medusa-heads: Medusa multi-head self-speculative decoding for Hugging Face causal LMs."""

from .backbone import EMBEDDED_MODEL, load_backbone, load_tokenizer
from .config import MedusaConfig
from .eagle import EagleHead
from .errors import MedusaError
from .heads import MedusaHeads
from .model import MedusaModel, load_heads

__all__ = [
    "EMBEDDED_MODEL",
    "EagleHead",
    "MedusaConfig",
    "MedusaError",
    "MedusaHeads",
    "MedusaModel",
    "load_backbone",
    "load_heads",
    "load_tokenizer",
]
