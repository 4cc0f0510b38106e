"""Tree specs (lists of top-k rank paths) and the buffers built from them once per device."""

from .buffers import TreeBuffers, build_tree
from .spec import load_tree, tree_names, validate_tree

__all__ = ["TreeBuffers", "build_tree", "load_tree", "tree_names", "validate_tree"]
