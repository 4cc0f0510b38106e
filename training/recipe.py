"""Training recipes: plain YAML files of overrides on `TrainConfig`, then `--key value` flags."""

import dataclasses
import typing
from dataclasses import dataclass
from pathlib import Path

import yaml

from medusa_heads.errors import MedusaError


@dataclass
class TrainConfig:
    # backbone
    model: str = "smollm2-135m-embedded"  # hub id, folder, or the embedded default
    backbone_dtype: str = "bfloat16"  # the frozen backbone's dtype while making hidden states
    # data
    data: str = "training/data/distilled.jsonl"  # jsonl/json/parquet file or folder, or a hub dataset name
    max_length: int = 512  # tokens per conversation; longer ones are truncated (and counted in the log)
    held_out_fraction: float = 0.02  # conversations kept aside for per-head accuracy
    eval_data: str | None = None  # held-out conversations from this file instead (all of `data` then trains)
    # heads
    num_heads: int = 4
    num_layers: int = 1
    share_lm_head: bool = True  # False: each head owns a projection initialised from the backbone's
    head_type: str = "medusa"  # medusa: hidden state only; hydra: also the path's tokens; eagle: one decoder layer
    draft_vocab_size: int | None = None  # heads guess among the N most frequent assistant tokens only
    draft_vocab_coverage: float | None = None  # ... or among as few as cover this share of them (e.g. 0.99)
    # objective
    loss: str = "ce"  # ce: hard labels; kl: the backbone's own distribution (free from the same forward)
    decay: float = 0.8  # head k weighs decay ** k
    loss_weighting: str = "decay"  # decay, or acceptance: head k's loss counts as much as heads 1..k-1 were right;
    # or tree: head k's loss counts where the tree `tree` drafts depth k below the true path (its path loss)
    tree: str | None = None  # a tree name or file: held-out accepted length under it is reported
    # optimisation
    learning_rate: float = 1e-3
    weight_decay: float = 0.0
    warmup_steps: int = 50
    max_steps: int = 1000
    min_lr_ratio: float = 0.1  # cosine decay down to this share of learning_rate
    batch_size: int = 8  # conversations per micro-batch
    gradient_accumulation_steps: int = 1
    grad_clip: float = 1.0
    mixed_precision: str = "no"  # no | bf16 | fp16 (accelerate)
    # Medusa-2: LoRA adapters on the backbone train with the heads; the backbone keeps close to its original
    # self by KL to the same model with the adapters disabled (no second copy in memory)
    medusa2: bool = False
    lora_r: int = 16
    lora_alpha: int = 32
    lora_dropout: float = 0.0
    lora_target_modules: str = "q_proj,k_proj,v_proj,o_proj"  # comma-separated module names
    heads_loss_weight: float = 0.2  # lambda: total = backbone KL + lambda * heads loss
    heads_warmup_steps: int = 100  # heads-only steps before the adapters start to train
    # speed
    cache_hidden_states: bool = True  # the backbone is frozen: compute its hidden states once, reuse every epoch
    hidden_cache_dir: str | None = None  # where they are kept (default: ~/.cache/medusa-heads/hidden)
    # bookkeeping
    output_dir: str = "runs/heads"
    checkpoint_every: int = 200  # steps
    eval_every: int = 200
    log_every: int = 10
    top_k: int = 10  # ranks recorded in head_accuracies.json
    seed: int = 0
    deepspeed_config: str | None = None  # path to a DeepSpeed JSON (ZeRO); None: plain accelerate
    report_to: str | None = None  # e.g. tensorboard

    def __post_init__(self):
        if self.loss not in ("ce", "kl"):
            raise MedusaError(f"`loss` must be ce or kl, got {self.loss!r}.")
        if self.head_type not in ("medusa", "hydra", "eagle"):
            raise MedusaError(f"`head_type` must be medusa, hydra or eagle, got {self.head_type!r}.")
        if self.head_type == "eagle" and (self.medusa2 or not self.share_lm_head):
            raise MedusaError("`head_type: eagle` trains the drafter alone with the backbone's LM head: it needs "
                              "`medusa2: false` and `share_lm_head: true`.")
        if self.loss_weighting not in ("decay", "acceptance", "tree"):
            raise MedusaError(f"`loss_weighting` must be decay, acceptance or tree, got {self.loss_weighting!r}.")
        if self.loss_weighting == "tree" and self.tree is None:
            raise MedusaError("`loss_weighting: tree` needs `tree`, the tree the heads are trained for.")
        if self.draft_vocab_size is not None and self.draft_vocab_coverage is not None:
            raise MedusaError("Give `draft_vocab_size` or `draft_vocab_coverage`, not both.")
        if not 0 < self.decay <= 1:
            raise MedusaError(f"`decay` must be in (0, 1], got {self.decay}.")
        if self.num_heads < 1 or self.max_steps < 1 or self.batch_size < 1:
            raise MedusaError("`num_heads`, `max_steps` and `batch_size` must be at least 1.")
        if self.medusa2 and self.cache_hidden_states:
            raise MedusaError("`medusa2` trains the backbone, so its hidden states change: set "
                              "`cache_hidden_states: false`.")
        if self.medusa2 and self.deepspeed_config:
            raise MedusaError("`medusa2` with `deepspeed_config` is not supported yet; use plain accelerate.")
        if not 0 <= self.held_out_fraction < 1:
            raise MedusaError(f"`held_out_fraction` must be in [0, 1), got {self.held_out_fraction}.")


def _coerce(name: str, value, annotation):
    """A recipe or command-line value -> the field's type (`int | None` fields take an int or null)."""
    kinds = [k for k in typing.get_args(annotation) if k is not type(None)] or [annotation]
    kind = kinds[0]
    if value is None or (isinstance(value, str) and value.lower() in ("null", "none") and kind is not str):
        if type(None) in typing.get_args(annotation):
            return None
        raise MedusaError(f"`{name}` takes a {kind.__name__}, not null.")
    if isinstance(value, str) and kind is not str:
        if kind is bool:
            if value.lower() not in ("true", "false", "1", "0", "yes", "no"):
                raise MedusaError(f"`{name}` takes true or false, got {value!r}.")
            return value.lower() in ("true", "1", "yes")
        try:
            return kind(value)
        except ValueError:
            raise MedusaError(f"`{name}` takes a {kind.__name__}, got {value!r}.") from None
    if not isinstance(value, kind) and not (kind is float and isinstance(value, int)) or (
            kind is not bool and isinstance(value, bool)):
        raise MedusaError(f"`{name}` takes a {kind.__name__}, got {value!r}.")
    return float(value) if kind is float else value


def load_recipe(path: str | Path | None = None, overrides: dict | None = None) -> TrainConfig:
    """Defaults, then the recipe file, then overrides; unknown keys and wrong types are errors."""
    values = {}
    if path is not None:
        try:
            values = yaml.safe_load(Path(path).read_text()) or {}
        except FileNotFoundError:
            raise MedusaError(f"Recipe `{path}` does not exist.") from None
        except yaml.YAMLError as err:
            raise MedusaError(f"Recipe `{path}` is not valid YAML: {str(err).splitlines()[0]}") from None
        if not isinstance(values, dict):
            raise MedusaError(f"Recipe `{path}` must be a mapping of keys to values.")
    values.update(overrides or {})
    types = {f.name: f.type for f in dataclasses.fields(TrainConfig)}
    unknown = sorted(set(values) - set(types))
    if unknown:
        raise MedusaError(f"Unknown recipe key(s) {', '.join(unknown)}; known: {', '.join(types)}.")
    return TrainConfig(**{k: _coerce(k, v, types[k]) for k, v in values.items()})
