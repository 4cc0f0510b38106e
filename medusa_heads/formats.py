r"""
Medusa heads in the layouts other projects read.

- The original Medusa project's, which TensorRT-LLM's Medusa converter also reads: `config.json` with
  `medusa_num_heads` / `medusa_num_layers`, weights `medusa_lm_head.safetensors` (or `.pt`) with keys
  `{h}.{l}.linear.weight`, `{h}.{l}.linear.bias` (residual block l of head h) and `{h}.{L}.weight` (its LM head).
  The tree goes beside them as `medusa_choices` (the rank paths `configs/trees/` already uses). Its v1.0 layout,
  read only, keeps the same keys under `medusa_head.` in a whole model's weights, beside the backbone's.
- vLLM's `method: "medusa"`: `config.json` with `model_type: medusa`, `num_heads`, `num_hidden_layers`,
  `medusa_fc_bias`, `truncated_vocab_size` (the draft vocabulary, with a `token_map` tensor of its token ids) and
  `original_lm_head` (one LM head shared by every head); weights `blocks.{h}.layers.{l}.weight/bias`,
  `lm_heads.{h}.weight`. vLLM drafts a top-1 chain from them (no tree).

- vLLM's `method: "eagle"` for the EAGLE drafter (`export_vllm_eagle`): a one-layer `MistralForCausalLM` config and
  weights `model.fc.weight`, `model.layers.0.*`, `model.norm.weight`; embedding and LM head are the target's.
- `speculators`, vLLM's `method: "eagle3"`, for the EAGLE-3 drafter (`export_speculators`): `speculators_model_type:
  eagle3`, its one Llama layer as `transformer_layer_config`, the target's layers as
  `eagle_aux_hidden_state_layer_ids`; weights `fc.weight`, `layers.0.*` (with `hidden_norm`), `norm.weight`,
  `lm_head.weight` over the draft vocabulary and its `d2t`/`t2d` maps; the embedding is the target's.

Hydra heads read the draft path's tokens, which no engine feeds a head: they have no engine layout. The `speculators`
format has EAGLE-3, PEagle, DFlash and DSpark types only (vLLM 0.32): of this project's drafters, EAGLE-3 alone.
"""

import json
import logging
import pickle
import re
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from .backbone import first_line, resolve_model_path
from .config import MedusaConfig
from .eagle import ContextDrafter, EagleHead
from .eagle3 import Eagle3Head
from .errors import MedusaError
from .heads import DraftHeads, MedusaHeads

logger = logging.getLogger(__name__)

ORIGINAL_WEIGHTS = ("medusa_lm_head.safetensors", "medusa_lm_head.pt")
# The v1.0 layout: the heads' keys under this prefix, in a whole model saved by transformers.
V1_PREFIX = "medusa_head."
WHOLE_MODEL_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
WHOLE_MODEL_WEIGHTS = ("model.safetensors", "pytorch_model.bin")
_BLOCK_KEY = re.compile(r"(\d+)\.(\d+)\.linear\.(weight|bias)")  # head h, residual block l
_OWN_LM_HEAD_KEY = re.compile(r"(\d+)\.(\d+)\.weight")  # head h, its LM head after its L blocks
READ_ERRORS = (OSError, ValueError, KeyError, RuntimeError, SafetensorError, pickle.UnpicklingError)
# `export --format` layouts each head type has.
ENGINE_FORMATS = {"medusa": ("vllm", "medusa", "trtllm"), "eagle": ("vllm",), "eagle3": ("speculators", "vllm")}


def is_original_layout(folder: str | Path) -> bool:
    """Whether `folder` holds heads saved by the original Medusa project: alone (v0.1) or in a whole model (v1.0)."""
    folder = Path(folder)
    if any((folder / name).is_file() for name in ORIGINAL_WEIGHTS):
        return True
    try:
        meta = json.loads((folder / "config.json").read_text())
        if not isinstance(meta, dict) or meta.get("model_type") == MedusaConfig.model_type:
            return False
        return any(name.startswith(V1_PREFIX) for name in _whole_model_files(folder))
    except READ_ERRORS:  # unreadable: not recognised here, and `load_heads` reports the folder as it is
        return False


def _instead(heads: DraftHeads) -> str:
    """What `heads` can be exported as, for an error message."""
    formats = ENGINE_FORMATS.get(heads.head_type)
    if formats:
        return "export them with --format " + " or ".join(formats)
    return ("no serving engine reads them (a head that reads the draft path's tokens); train Medusa heads or an "
            "EAGLE drafter to serve in an engine (docs/heads.md)")


def check_format(heads: DraftHeads, layout: str) -> None:
    """A one-line error unless `layout` (an `export --format`) can hold `heads`, naming what can instead."""
    formats = ENGINE_FORMATS.get(heads.head_type, ())
    if layout == "speculators" and layout not in formats:
        raise MedusaError("vLLM 0.32 loads `speculators` checkpoints of types eagle3, peagle, dflash and dspark only "
                          "(EAGLE-3 reads several of the target's layers, these heads one, and it has no EAGLE-1 or "
                          f"Medusa type); these `{heads.head_type}` heads: {_instead(heads)}.")
    if layout not in formats:
        raise MedusaError(f"--format {layout} cannot hold `{heads.head_type}` heads: {_instead(heads)}.")


def plain_medusa(heads: DraftHeads, layout: str) -> MedusaHeads:
    """`heads` if they are plain Medusa heads, the only type a Medusa layout holds; else a one-line error."""
    if type(heads) is not MedusaHeads:
        raise MedusaError(f"{layout} holds plain Medusa heads only; these are `{heads.head_type}` heads: "
                          f"{_instead(heads)}.")
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
    r"""
    Heads saved by the original Medusa project (or `export_original`) as `MedusaHeads`, from either of its layouts:

    - v0.1, the heads alone: `medusa_lm_head.safetensors` or `.pt`, keys `{h}.{l}.linear.weight/bias` and
      `{h}.{L}.weight`, the backbone named by `base_model_name_or_path` in `config.json`.
    - v1.0, the heads saved inside a whole model (its axolotl trainer, Medusa-1 or -2): the same keys under
      `medusa_head.` in the model's `model.safetensors` (or its shards) or `pytorch_model.bin`, `medusa_num_heads`
      / `medusa_num_layers` in its `config.json`; the backbone is that model. Only the heads' tensors are read.

    Head and layer counts come from the weights: a config that disagrees is warned about, as are heads without LM
    heads of their own (the original's "version 2"), which then share the backbone's. A mix of the two, or weights
    whose shapes disagree, is a one-line `MedusaError`.

    Args:
        dtype: the heads' dtype; `None`: the weights' own.
    """
    folder = Path(folder)
    single = next((folder / name for name in ORIGINAL_WEIGHTS if (folder / name).is_file()), None)
    if single is None and not is_original_layout(folder):
        raise MedusaError(f"`{folder}` holds no Medusa heads in the original project's layouts "
                          "(`medusa_lm_head.safetensors` or `.pt`, or `medusa_head.*` weights in a whole model).")
    meta = _read_config(folder)
    where = single or folder
    try:
        if single is not None:
            weights = load_file(str(single)) if single.suffix == ".safetensors" else torch.load(
                single, map_location="cpu", weights_only=True)
            base = meta.get("base_model_name_or_path")
        else:
            weights = _read_whole_model_heads(folder)
            base = str(folder.resolve())
    except READ_ERRORS as err:
        raise MedusaError(f"Cannot read original Medusa heads from `{where}`: {type(err).__name__}: "
                          f"{first_line(err)}") from None
    heads = _heads_from_weights(weights, meta, where, base)
    heads.name_or_path = str(folder)
    return heads.to(dtype or next(iter(weights.values())).dtype)


def _read_config(folder: Path) -> dict:
    try:
        meta = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError) as err:
        raise MedusaError(f"Cannot read the config of the original Medusa heads in `{folder}`: "
                          f"{type(err).__name__}: {err}") from None
    if not isinstance(meta, dict):
        raise MedusaError(f"`{folder / 'config.json'}` is not a JSON object.")
    return meta


def _whole_model_files(folder: Path) -> dict[str, Path]:
    """Each weight name of a model saved by transformers -> the file holding it (one file, or shards and their
    index); only file headers are read."""
    for index in WHOLE_MODEL_INDEXES:
        if (folder / index).is_file():
            weight_map = json.loads((folder / index).read_text())["weight_map"]
            return {name: folder / file for name, file in weight_map.items()}
    for path in (folder / name for name in WHOLE_MODEL_WEIGHTS):
        if not path.is_file():
            continue
        if path.suffix == ".safetensors":
            with safe_open(str(path), "pt") as f:
                return dict.fromkeys(f.keys(), path)
        return dict.fromkeys(torch.load(path, map_location="cpu", weights_only=True, mmap=True), path)
    return {}


def _read_whole_model_heads(folder: Path) -> dict[str, torch.Tensor]:
    """The `medusa_head.*` tensors of a whole model, without the prefix; the backbone's are left on disk."""
    by_file: dict[Path, list[str]] = {}
    for name, path in _whole_model_files(folder).items():
        if name.startswith(V1_PREFIX):
            by_file.setdefault(path, []).append(name)
    weights = {}
    for path, names in by_file.items():
        if path.suffix == ".safetensors":
            with safe_open(str(path), "pt") as f:
                weights |= {name.removeprefix(V1_PREFIX): f.get_tensor(name) for name in names}
        else:  # memory-mapped: only these tensors' bytes are read
            state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            weights |= {name.removeprefix(V1_PREFIX): state[name].clone() for name in names}
    return weights


def _heads_from_weights(weights: dict[str, torch.Tensor], meta: dict, where: Path, base: str | None) -> MedusaHeads:
    """`MedusaHeads` from the original's keys (`{h}.{l}.linear.weight/bias`, `{h}.{L}.weight`), counted from them."""
    blocks = {key: m for key in weights if (m := _BLOCK_KEY.fullmatch(key))}
    own = {key: m for key in weights if (m := _OWN_LM_HEAD_KEY.fullmatch(key))}
    if not blocks and not own:
        raise MedusaError(f"`{where}` holds no Medusa head weights.")
    heads_n = 1 + max(int(m[1]) for m in [*blocks.values(), *own.values()])
    layers = max((int(m[2]) for m in own.values()), default=max((int(m[2]) + 1 for m in blocks.values()), default=0))
    with_lm_head = sorted({int(m[1]) for m in own.values()})
    if own and len(with_lm_head) < heads_n:
        without = sorted(set(range(heads_n)) - set(with_lm_head))
        raise MedusaError(f"In `{where}` heads {with_lm_head} have an LM head of their own and heads {without} do "
                          "not: the original project saves all of them with one, or none.")
    expected = {f"{h}.{l}.linear.{p}" for h in range(heads_n) for l in range(layers) for p in ("weight", "bias")}
    expected |= {f"{h}.{layers}.weight" for h in range(heads_n)} if own else set()
    if set(weights) != expected:
        raise MedusaError(f"The weights in `{where}` do not match {heads_n} heads of {layers} layers: missing "
                          f"{sorted(expected - set(weights))[:3]}, unexpected {sorted(set(weights) - expected)[:3]}.")
    said = meta.get("medusa") if isinstance(meta.get("medusa"), dict) else meta
    for key, found in (("medusa_num_heads", heads_n), ("medusa_num_layers", layers)):
        if key in said and said[key] != found:
            logger.warning("The config of `%s` says %s=%s but its weights hold %d: using %d.", where, key, said[key],
                           found, found)
    hidden = next(iter(weights.values())).shape[-1]
    vocab = weights[f"0.{layers}.weight"].shape[0] if own else _backbone_vocab(meta, base)
    for key, tensor in weights.items():
        shape = (hidden,) if key.endswith("bias") else (vocab if key in own else hidden, hidden)
        if tuple(tensor.shape) != shape:
            raise MedusaError(f"The Medusa head weights in `{where}` disagree in shape: `{key}` is "
                              f"{list(tensor.shape)} where the others make it {list(shape)}.")
    if not own:
        logger.warning("The Medusa heads in `%s` have no LM heads of their own: they score with the backbone's "
                       "(share_lm_head=True).", where)
    config = MedusaConfig(base_model_name_or_path=base, num_heads=heads_n, num_layers=layers, hidden_size=hidden,
                          vocab_size=vocab, share_lm_head=not own)
    state = {f"blocks.{m[1]}.{m[2]}.{m[3]}": weights[key] for key, m in blocks.items()}
    state |= {f"lm_heads.{m[1]}.weight": weights[key] for key, m in own.items()}
    heads = MedusaHeads(config)
    heads.load_state_dict(state, strict=True)
    return heads


def _backbone_vocab(meta: dict, base: str | None) -> int:
    """The vocabulary of heads that share the backbone's LM head: from the config beside them (a whole model's is
    the backbone's own), else from the backbone's config."""
    if "vocab_size" in meta:
        return int(meta["vocab_size"])
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(resolve_model_path(base or "")).get_text_config().vocab_size
    except (OSError, ValueError) as err:
        raise MedusaError(f"These heads share the LM head of `{base}`, whose vocabulary size cannot be read "
                          f"({first_line(err)}); add `vocab_size` to their config.json.") from None


def export_vllm(heads: DraftHeads, lm_head_weight: torch.Tensor | None, folder: str | Path) -> Path:
    """Write `heads` in vLLM's Medusa layout (`--speculative-config '{"method": "medusa", "model": FOLDER}'`), or an
    EAGLE drafter in its eagle layout (`export_vllm_eagle`), or an EAGLE-3 drafter as `export_speculators`."""
    if isinstance(heads, Eagle3Head):
        return export_speculators(heads, folder)
    if isinstance(heads, EagleHead):
        return export_vllm_eagle(heads, folder)
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


# vLLM builds the drafter's decoder layer as its Llama layer (Mistral's is the same one): these types are that layer.
VLLM_EAGLE_DECODERS = ("llama", "mistral")


def _vllm_eagle_decoder(heads: ContextDrafter):
    """The drafter's decoder config, whole (defaults filled in), if vLLM's Llama decoder layer is that layer."""
    from transformers import AutoConfig

    fields = dict(heads.config.decoder_config)
    decoder = AutoConfig.for_model(fields.pop("model_type"), **fields)
    if decoder.model_type not in VLLM_EAGLE_DECODERS:
        raise MedusaError(f"vLLM's EAGLE methods build a Llama decoder layer; this drafter's layer is "
                          f"`{decoder.model_type}` ({'/'.join(VLLM_EAGLE_DECODERS)} only).")
    if getattr(decoder, "attention_bias", False) or getattr(decoder, "mlp_bias", False):
        raise MedusaError("vLLM's EAGLE layer has no biases, and this drafter's decoder layer has some.")
    window = getattr(decoder, "sliding_window", None)
    if decoder.hidden_act != "silu" or window is not None:
        raise MedusaError(f"vLLM's EAGLE layer is a SiLU MLP over full attention; this drafter's has "
                          f"`{decoder.hidden_act}` and sliding window {window}.")
    return decoder


def export_vllm_eagle(heads: EagleHead, folder: str | Path) -> Path:
    r"""
    Write the EAGLE drafter as vLLM's `method: "eagle"` reads it
    (`--speculative-config '{"method": "eagle", "model": FOLDER, "num_speculative_tokens": K}'`).

    The config says `MistralForCausalLM`: vLLM then builds `EagleMistralForCausalLM`, which computes
    `norm(layer(fc([embedding; hidden])))` with the layer's input layernorm, which is this drafter's function. Its
    Llama form (`LlamaForCausalLM` -> `EagleLlamaForCausalLM`) is the original EAGLE-1 network: it replaces the
    layer's input layernorm with the identity and has no final norm, so it would load these weights and draft with
    another function. `fc` reads `[embedding; hidden]` in vLLM and `[feature; embedding]` here: its two column
    halves are swapped. vLLM shares the target's embedding and LM head (neither is written) and scores the whole
    vocabulary: a drafter trained on a draft vocabulary is approximate there (one warning).
    """
    decoder = _vllm_eagle_decoder(heads)
    config, h = heads.config, heads.config.hidden_size
    if heads.draft_vocab is not None:
        logger.warning("vLLM's eagle method drafts over the whole vocabulary (%d tokens), this drafter over its "
                       "%d-token draft vocabulary: vLLM may draft tokens it never learnt to rank (output stays "
                       "exact, acceptance may differ slightly) and pays for the full projection.",
                       config.vocab_size, config.draft_vocab_size)
    fc = heads.fc.weight
    weights = {"model.fc.weight": torch.cat([fc[:, h:], fc[:, :h]], dim=1), "model.norm.weight":
               heads.decoder.norm.weight}
    weights |= {f"model.layers.0.{name}": p for name, p in heads.decoder.layers[0].state_dict().items()}
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(_own_copies(weights), str(folder / "model.safetensors"), metadata={"format": "pt"})
    meta = {"architectures": ["MistralForCausalLM"], "model_type": "mistral", "sliding_window": None,
            "num_hidden_layers": 1, "vocab_size": config.vocab_size, "tie_word_embeddings": False,
            "dtype": str(fc.dtype).removeprefix("torch.")}
    meta |= _layer_sizes(decoder)
    (folder / "config.json").write_text(json.dumps(meta, indent=1))
    return folder


def _layer_sizes(decoder) -> dict:
    """The fields of a Llama decoder layer's config that vLLM reads to build it."""
    return {key: getattr(decoder, key) for key in ("hidden_size", "intermediate_size", "num_attention_heads",
                                                   "num_key_value_heads", "head_dim", "hidden_act", "rms_norm_eps",
                                                   "rope_parameters", "max_position_embeddings")}


def export_speculators(heads: Eagle3Head, folder: str | Path) -> Path:
    r"""
    Write the EAGLE-3 drafter as a `speculators` checkpoint, which vLLM reads as `method: "eagle3"`
    (`--speculative-config '{"method": "eagle3", "model": FOLDER, "num_speculative_tokens": K}'`): its
    `Eagle3LlamaForCausalLM` with `norm_before_residual: false` is this drafter's function, and it taps the target's
    `eagle_aux_hidden_state_layer_ids`, the drafter's `feature_layers`, in the same order.

    Weights: `fc.weight`, `layers.0.*` (the decoder layer, q/k/v over [embedding; feature], and its `hidden_norm`),
    `norm.weight`, `lm_head.weight` (one row per draft-vocabulary index) and, with a draft vocabulary, `d2t` (draft
    index -> target id minus that index, what vLLM adds to the index) and `t2d` (bool over the target's vocabulary).
    No embedding: vLLM shares the target's, as this project's runtime does. The verifier named in the config is the
    heads' `base_model_name_or_path`.
    """
    decoder = _vllm_eagle_decoder(heads)
    config = heads.config
    weights = {"fc.weight": heads.fc.weight, "layers.0.hidden_norm.weight": heads.hidden_norm.weight,
               "norm.weight": heads.norm.weight, "lm_head.weight": heads.lm_head.weight}
    weights |= {f"layers.0.{name}": p for name, p in heads.layer.state_dict().items()}
    if heads.draft_vocab is not None:
        weights["d2t"] = heads.draft_vocab - torch.arange(heads.draft_vocab.numel(), device=heads.draft_vocab.device)
        weights["t2d"] = torch.zeros(config.vocab_size, dtype=torch.bool).index_fill_(0, heads.draft_vocab.cpu(), True)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(_own_copies(weights), str(folder / "model.safetensors"), metadata={"format": "pt"})
    layer = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": 1,
             "vocab_size": config.vocab_size, "tie_word_embeddings": False, "attention_bias": False,
             "mlp_bias": False} | _layer_sizes(decoder)
    meta = {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
            "transformer_layer_config": layer, "draft_vocab_size": config.draft_vocab_size or config.vocab_size,
            "target_hidden_size": config.hidden_size, "norm_before_residual": False, "norm_before_fc": False,
            "eagle_aux_hidden_state_layer_ids": list(config.feature_layers),
            "speculators_config": {"algorithm": "eagle3", "default_proposal_method": "greedy",
                                   "proposal_methods": [{"proposal_type": "greedy",
                                                         "speculative_tokens": config.num_heads}],
                                   "verifier": {"name_or_path": config.base_model_name_or_path,
                                                "architectures": []}},
            "dtype": str(heads.fc.weight.dtype).removeprefix("torch.")}
    (folder / "config.json").write_text(json.dumps(meta, indent=1))
    return folder
