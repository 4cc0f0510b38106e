r"""
Medusa heads in the layouts other projects read.

- The original Medusa project's, which TensorRT-LLM's Medusa converter also reads: `config.json` with
  `medusa_num_heads` / `medusa_num_layers`, weights `medusa_lm_head.safetensors` (or `.pt`) with keys
  `{h}.{l}.linear.weight`, `{h}.{l}.linear.bias` (residual block l of head h) and `{h}.{L}.weight` (its LM head).
  The tree goes beside them as `medusa_choices` (the rank paths `configs/trees/` already uses).
- vLLM's `method: "medusa"`: `config.json` with `model_type: medusa`, `num_heads`, `num_hidden_layers`,
  `medusa_fc_bias`, `truncated_vocab_size` (the draft vocabulary, with a `token_map` tensor of its token ids) and
  `original_lm_head` (one LM head shared by every head); weights `blocks.{h}.layers.{l}.weight/bias`,
  `lm_heads.{h}.weight`. vLLM drafts a top-1 chain from them (no tree).

Only plain Medusa heads have these layouts: Hydra heads read the draft path's tokens and the EAGLE drafter is a
decoder layer with its own cache, which neither layout can hold.
"""

import json
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from .config import MedusaConfig
from .errors import MedusaError
from .heads import DraftHeads, MedusaHeads

ORIGINAL_WEIGHTS = ("medusa_lm_head.safetensors", "medusa_lm_head.pt")


def is_original_layout(folder: str | Path) -> bool:
    return any((Path(folder) / name).is_file() for name in ORIGINAL_WEIGHTS)


def plain_medusa(heads: DraftHeads, layout: str) -> MedusaHeads:
    """`heads` if they are plain Medusa heads, the only type an engine layout holds; else a one-line error."""
    if type(heads) is not MedusaHeads:
        raise MedusaError(f"{layout} holds plain Medusa heads only; these are `{heads.head_type}` heads, which no "
                          "serving engine reads (see docs/heads.md).")
    return heads


def head_projections(heads: MedusaHeads, lm_head_weight: torch.Tensor | None) -> list[torch.Tensor]:
    """Each head's projection weight [V_out, H] over its output vocabulary; shared heads take the backbone's LM head
    weight `lm_head_weight` [V, H] (its draft-vocabulary rows)."""
    if heads.lm_heads is not None:
        return [own.weight for own in heads.lm_heads]
    if lm_head_weight is None:
        raise MedusaError("These heads share the backbone's LM head: its weight is needed to export them.")
    rows = lm_head_weight if heads.draft_vocab is None else lm_head_weight[heads.draft_vocab.to(lm_head_weight.device)]
    return [rows] * heads.config.num_heads


def _own_copies(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """safetensors refuses tensors that share memory (a shared LM head written once per head)."""
    return {k: v.detach().to("cpu").clone() for k, v in tensors.items()}


def export_original(heads: DraftHeads, lm_head_weight: torch.Tensor | None, folder: str | Path,
                    tree: tuple | None = None) -> Path:
    """Write `heads` in the original Medusa layout (TensorRT-LLM's converter input); `tree`: rank paths written as
    `medusa_choices`."""
    heads = plain_medusa(heads, "The original Medusa layout")
    if heads.draft_vocab is not None:
        raise MedusaError("The original Medusa layout has no draft vocabulary, and these heads guess among "
                          f"{heads.config.draft_vocab_size} tokens only; export them with --format vllm (token_map).")
    config, layers = heads.config, heads.config.num_layers
    weights = {}
    for h, (block, projection) in enumerate(zip(heads.blocks, head_projections(heads, lm_head_weight))):
        for l, res in enumerate(block):
            weights[f"{h}.{l}.linear.weight"], weights[f"{h}.{l}.linear.bias"] = res.weight, res.bias
        weights[f"{h}.{layers}.weight"] = projection
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(_own_copies(weights), str(folder / ORIGINAL_WEIGHTS[0]), metadata={"format": "pt"})
    meta = {"medusa_num_heads": config.num_heads, "medusa_num_layers": layers,
            "base_model_name_or_path": config.base_model_name_or_path, "hidden_size": config.hidden_size,
            "vocab_size": config.vocab_size}
    if tree is not None:
        meta["medusa_choices"] = [list(p) for p in tree]
        (folder / "medusa_choices.json").write_text(json.dumps(meta["medusa_choices"]))
    (folder / "config.json").write_text(json.dumps(meta, indent=1))
    return folder


def import_original(folder: str | Path, dtype: torch.dtype | None = None) -> MedusaHeads:
    """Heads saved by the original Medusa project (or `export_original`) as `MedusaHeads` with their own
    projections."""
    folder = Path(folder)
    try:
        meta = json.loads((folder / "config.json").read_text())
        heads_n, layers = int(meta["medusa_num_heads"]), int(meta["medusa_num_layers"])
        path = next(folder / name for name in ORIGINAL_WEIGHTS if (folder / name).is_file())
        weights = load_file(str(path)) if path.suffix == ".safetensors" else torch.load(path, map_location="cpu",
                                                                                           weights_only=True)
        vocab, hidden = weights[f"0.{layers}.weight"].shape
    except (OSError, ValueError, KeyError, TypeError, SafetensorError, json.JSONDecodeError) as err:
        raise MedusaError(f"Cannot read original Medusa heads from `{folder}`: {type(err).__name__}: {err}") from None
    expected = {f"{h}.{l}.linear.{p}" for h in range(heads_n) for l in range(layers) for p in ("weight", "bias")}
    expected |= {f"{h}.{layers}.weight" for h in range(heads_n)}
    if set(weights) != expected:
        raise MedusaError(f"The weights in `{path}` do not match {heads_n} heads of {layers} layers: missing "
                          f"{sorted(expected - set(weights))[:3]}, unexpected {sorted(set(weights) - expected)[:3]}.")
    config = MedusaConfig(base_model_name_or_path=meta.get("base_model_name_or_path"), num_heads=heads_n,
                          num_layers=layers, hidden_size=hidden, vocab_size=vocab, share_lm_head=False)
    heads = MedusaHeads(config)
    state = {}
    for h in range(heads_n):
        for l in range(layers):
            state[f"blocks.{h}.{l}.weight"] = weights[f"{h}.{l}.linear.weight"]
            state[f"blocks.{h}.{l}.bias"] = weights[f"{h}.{l}.linear.bias"]
        state[f"lm_heads.{h}.weight"] = weights[f"{h}.{layers}.weight"]
    heads.load_state_dict(state, strict=True)
    heads.name_or_path = str(folder)
    return heads.to(dtype) if dtype is not None else heads


def export_vllm(heads: DraftHeads, lm_head_weight: torch.Tensor | None, folder: str | Path) -> Path:
    """Write `heads` in vLLM's Medusa layout (`--speculative-config '{"method": "medusa", "model": FOLDER}'`)."""
    heads = plain_medusa(heads, "vLLM's Medusa layout")
    config = heads.config
    shared = heads.lm_heads is None
    projections = head_projections(heads, lm_head_weight)
    weights = {}
    for h, block in enumerate(heads.blocks):
        for l, res in enumerate(block):
            weights[f"blocks.{h}.layers.{l}.weight"], weights[f"blocks.{h}.layers.{l}.bias"] = res.weight, res.bias
    for h, projection in enumerate(projections[:1] if shared else projections):
        weights[f"lm_heads.{h}.weight"] = projection
    if heads.draft_vocab is not None:
        weights["token_map"] = heads.draft_vocab
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(_own_copies(weights), str(folder / "model.safetensors"), metadata={"format": "pt"})
    meta = {"model_type": "medusa", "architectures": ["MedusaModel"], "hidden_size": config.hidden_size,
            "vocab_size": config.vocab_size, "num_heads": config.num_heads, "num_hidden_layers": config.num_layers,
            "truncated_vocab_size": config.draft_vocab_size or config.vocab_size, "medusa_fc_bias": True,
            "original_lm_head": shared, "torch_dtype": str(projections[0].dtype).removeprefix("torch.")}
    (folder / "config.json").write_text(json.dumps(meta, indent=1))
    return folder
