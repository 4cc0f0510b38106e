"""Drafters: each fills a tree with one candidate token per node (the root is already chosen), one family per
module. `medusa_heads.inference.registry` lists them by name."""
