"""medusa-heads: Medusa multi-head self-speculative decoding for Hugging Face causal LMs.

The public names below are imported on first use, so that `import medusa_heads.tree` (pure data and torch)
does not pull in transformers.
"""

import importlib

_EXPORTS = {
    "EMBEDDED_MODEL": "backbone",
    "load_backbone": "backbone",
    "load_tokenizer": "backbone",
    "MedusaConfig": "config",
    "MedusaError": "errors",
    "DraftHeads": "heads",
    "MedusaHeads": "heads",
    "HydraHeads": "heads",
    "EagleHead": "eagle",
    "Eagle3Head": "eagle3",
    "HEAD_TYPES": "head_types",
    "MedusaModel": "model",
    "load_heads": "model",
    "NgramStore": "ngram_store",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'medusa_heads' has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
