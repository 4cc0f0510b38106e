"""Tree specs (lists of top-k rank paths) and the buffers built from them once per device: pure data and torch."""

from .buffers import TreeBuffers, build_tree, canonical_tree, chain_tree
from .spec import load_tree, tree_names, validate_tree

__all__ = ["TreeBuffers", "build_tree", "canonical_tree", "chain_tree", "load_tree", "tree_names", "validate_tree"]
