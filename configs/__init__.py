"""Shipped recipes and trees, installed as `medusa_heads.configs` so they can be found by name."""
