"""Head training: `accelerate launch -m medusa_heads.training --config configs/RECIPE.yaml`."""
