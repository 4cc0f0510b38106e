"""Training recipes: plain YAML files of overrides on `TrainConfig`, then `--key value` flags."""

import dataclasses
import typing
from dataclasses import dataclass
from pathlib import Path

import yaml

from medusa_heads.backbone import parse_dtype
from medusa_heads.errors import MedusaError
from medusa_heads.head_types import HEAD_TYPES, head_type_class
from medusa_heads.quantize import QUANTIZATIONS


@dataclass
class TrainConfig:
    # backbone
    model: str = "smollm2-135m-embedded"  # hub id, folder, or the embedded default
    backbone_dtype: str = "auto"  # the frozen backbone's dtype while making hidden states; auto: bf16 where the
    # training device computes in it natively (a GPU, a CPU with AMX or AVX512-BF16), fp32 elsewhere (emulated bf16
    # made them 4-5x slower than fp32 on an AVX2 CPU)
    quantize: str = "none"  # int8 or int4: the heads learn that backbone's hidden states (medusa_heads/quantize.py)
    # data
    data: str = "training/data/distilled.jsonl"  # jsonl/json/parquet file or folder, or a hub dataset name
    max_length: int = 512  # tokens per conversation; longer ones are truncated (and counted in the log)
    held_out_fraction: float = 0.02  # conversations kept aside for per-head accuracy
    eval_data: str | None = None  # held-out conversations from this file instead (all of `data` then trains)
    # heads
    num_heads: int = 4
    num_layers: int = 1
    share_lm_head: bool = True  # False: each head owns a projection initialised from the backbone's (True: a few MB
    # to ship, the projection is the backbone's own)
    head_type: str = "medusa"  # in HEAD_TYPES. medusa: hidden state only; hydra: also the path's tokens; eagle: one
    # decoder layer over the context; eagle3: the same over a low, a middle and a high layer, own LM head
    # (`share_lm_head: false`)
    feature_layers: str | None = None  # eagle3: the backbone's layers it reads, comma-separated ("2,15,27"); null: a
    # low, a middle and a high layer (vLLM's choice)
    draft_vocab_size: int | None = None  # heads guess among the N most frequent assistant tokens only
    draft_vocab_coverage: float | None = None  # ... or among as few as cover this share of them (e.g. 0.99)
    init_heads: str | None = None  # start from these saved heads (fine-tuning) instead of the backbone's LM head;
    # their num_heads, num_layers, head_type, share_lm_head and draft_vocab_size must be the recipe's; they keep
    # their draft vocabulary
    repick_draft_vocab: bool = False  # with init_heads: count the draft vocabulary again on this run's data
    # (draft_vocab_size or draft_vocab_coverage); kept tokens keep their trained rows of the heads' own LM head, new
    # ones start from the backbone's rows mapped as the kept ones moved (training/draft_vocab.py)
    # objective
    loss: str = "ce"  # ce: hard labels; kl: the backbone's own distribution (free from the same forward), over the
    # draft vocabulary where there is one; kl was no better for the first Medusa heads, a little better (top-5 and
    # accepted length) continuing the EAGLE-3 drafter (docs/experiments.md)
    decay: float = 0.8  # head k weighs decay ** k
    loss_weighting: str = "decay"  # decay, or acceptance: head k's loss counts as much as heads 1..k-1 were right;
    # or tree: head k's loss counts where the tree `tree` drafts depth k below the true path (its path loss)
    tree: str | None = None  # a tree name or file: held-out accepted length under it is reported
    # optimisation
    learning_rate: float = 1e-3
    weight_decay: float = 0.0
    warmup_steps: int = 50  # linear warm-up to learning_rate, at most max_steps
    max_steps: int = 1000
    max_minutes: float | None = None  # a time budget for the steps: the run times itself (from step 20, then every
    # `log_every` steps) and lowers `max_steps` to what fits, so the cosine decay still ends on time; null: none
    min_lr_ratio: float = 0.1  # cosine decay down to this share of learning_rate
    batch_size: int = 8  # conversations per micro-batch
    length_window: int = 16  # batches of the shuffle sorted by length together, so that a batch is little padding
    # (1: a plain shuffle); on the EAGLE-3 recipe's data 16 halved the padded tokens a step
    gradient_accumulation_steps: int = 1
    grad_clip: float = 1.0  # max gradient norm; 0: no clipping
    mixed_precision: str = "no"  # no | bf16 | fp16 (accelerate) | auto: bf16 where the device computes in it natively
    # Medusa-2: LoRA adapters on the backbone train with the heads; the backbone keeps close to its original
    # self by KL to the same model with the adapters disabled (no second copy in memory)
    medusa2: bool = False
    lora_r: int = 16
    lora_alpha: int = 32
    lora_dropout: float = 0.0
    lora_target_modules: str = "q_proj,k_proj,v_proj,o_proj"  # comma-separated module names
    heads_loss_weight: float = 0.2  # lambda: total = backbone KL + lambda * heads loss
    heads_warmup_steps: int = 100  # heads-only steps before the adapters start to train, so that the fresh heads'
    # early, large gradients do not reach the backbone
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
        for f in dataclasses.fields(self):
            setattr(self, f.name, _checked_type(f.name, getattr(self, f.name), f.type))
        self._check_values()
        self._check_combinations()

    def _check_values(self) -> None:
        """Each field alone: one sentence naming it."""
        for name in ("model", "data", "output_dir", "lora_target_modules"):
            _require(getattr(self, name).strip() != "", name, "must not be empty")
        for name in ("eval_data", "tree", "feature_layers", "hidden_cache_dir", "deepspeed_config", "report_to", "init_heads"):
            _require(getattr(self, name) is None or getattr(self, name).strip() != "", name,
                     "must be a non-empty string or null")
        try:
            parse_dtype(self.backbone_dtype)
        except MedusaError:
            raise MedusaError(f"`backbone_dtype` must be auto, float32, bfloat16 or float16 (or fp32, bf16, fp16), got "
                              f"{self.backbone_dtype!r}.") from None
        _require(self.quantize in QUANTIZATIONS, "quantize", f"must be one of {', '.join(QUANTIZATIONS)}",
                 self.quantize)
        _require(self.head_type in HEAD_TYPES, "head_type", f"must be one of {', '.join(HEAD_TYPES)}",
                 self.head_type)
        _require(self.loss in ("ce", "kl"), "loss", "must be ce or kl", self.loss)
        _require(self.loss_weighting in ("decay", "acceptance", "tree"), "loss_weighting",
                 "must be decay, acceptance or tree", self.loss_weighting)
        _require(self.mixed_precision in ("no", "bf16", "fp16", "auto"), "mixed_precision",
                 "must be no, bf16, fp16 or auto", self.mixed_precision)
        for name in ("max_length", "num_heads", "max_steps", "batch_size", "length_window", "gradient_accumulation_steps",
                     "lora_r", "lora_alpha", "checkpoint_every", "eval_every", "log_every", "top_k"):
            _require(getattr(self, name) >= 1, name, "must be at least 1", getattr(self, name))
        for name in ("num_layers", "warmup_steps", "heads_warmup_steps", "seed"):
            _require(getattr(self, name) >= 0, name, "must be at least 0", getattr(self, name))
        _require(self.draft_vocab_size is None or self.draft_vocab_size >= 1, "draft_vocab_size",
                 "must be at least 1 (or null: the whole vocabulary)", self.draft_vocab_size)
        _require(self.draft_vocab_coverage is None or 0 < self.draft_vocab_coverage <= 1, "draft_vocab_coverage",
                 "must be in (0, 1] (or null)", self.draft_vocab_coverage)
        _require(0 <= self.held_out_fraction < 1, "held_out_fraction", "must be in [0, 1)", self.held_out_fraction)
        _require(0 < self.decay <= 1, "decay", "must be in (0, 1]", self.decay)
        _require(self.learning_rate > 0, "learning_rate", "must be positive", self.learning_rate)
        _require(self.max_minutes is None or self.max_minutes > 0, "max_minutes", "must be positive (or null)",
                 self.max_minutes)
        _require(self.weight_decay >= 0, "weight_decay", "must be at least 0", self.weight_decay)
        _require(0 <= self.min_lr_ratio <= 1, "min_lr_ratio", "must be in [0, 1]", self.min_lr_ratio)
        _require(self.grad_clip >= 0, "grad_clip", "must be at least 0 (0: no clipping)", self.grad_clip)
        _require(0 <= self.lora_dropout < 1, "lora_dropout", "must be in [0, 1)", self.lora_dropout)
        _require(all(m.strip() for m in self.lora_target_modules.split(",")), "lora_target_modules",
                 "must be comma-separated module names", self.lora_target_modules)
        _require(self.heads_loss_weight > 0, "heads_loss_weight", "must be positive", self.heads_loss_weight)

    def _check_combinations(self) -> None:
        """Fields that constrain each other; what a head type allows is read from its class."""
        kind = head_type_class(self.head_type)
        if not self.share_lm_head and not kind.can_own_lm_head:
            raise MedusaError(f"`share_lm_head: false` is not possible with `head_type: {self.head_type}`, which "
                              "scores with the backbone's LM head.")
        if self.share_lm_head and kind.must_own_lm_head:
            raise MedusaError(f"`head_type: {self.head_type}` scores with an LM head of its own: set "
                              "`share_lm_head: false`.")
        if self.feature_layers is not None:
            if not kind.reads_layers:
                raise MedusaError(f"`feature_layers` is for heads that read several layers (eagle3), not "
                                  f"`head_type: {self.head_type}`.")
            _require(all(x.strip().isdigit() for x in self.feature_layers.split(",")), "feature_layers",
                     "must be comma-separated layer ids", self.feature_layers)
        if self.medusa2 and not kind.trains_with_adapter:
            raise MedusaError(f"`medusa2` is not possible with `head_type: {self.head_type}`, which trains alone "
                              "on the frozen backbone.")
        if self.medusa2 and self.cache_hidden_states:
            raise MedusaError("`medusa2` trains the backbone, so its hidden states change: set "
                              "`cache_hidden_states: false`.")
        if self.medusa2 and self.quantize != "none":
            raise MedusaError("`medusa2` trains adapters on the float backbone: it does not take `quantize`.")
        if self.init_heads and self.draft_vocab_coverage is not None and not self.repick_draft_vocab:
            raise MedusaError("`init_heads` continues heads with their own draft vocabulary; drop "
                              "`draft_vocab_coverage` (`draft_vocab_size` may name its size), or set "
                              "`repick_draft_vocab`.")
        if self.repick_draft_vocab and not (self.init_heads and (self.draft_vocab_size or self.draft_vocab_coverage)):
            raise MedusaError("`repick_draft_vocab` re-counts the draft vocabulary of heads a run continues: it "
                              "needs `init_heads` and `draft_vocab_size` or `draft_vocab_coverage`.")
        if self.medusa2 and self.deepspeed_config:
            raise MedusaError("`medusa2` with `deepspeed_config` is not supported yet; use plain accelerate.")
        if self.loss_weighting == "tree" and self.tree is None:
            raise MedusaError("`loss_weighting: tree` needs `tree`, the tree the heads are trained for.")
        if self.draft_vocab_size is not None and self.draft_vocab_coverage is not None:
            raise MedusaError("Give `draft_vocab_size` or `draft_vocab_coverage`, not both.")
        if self.draft_vocab_size is not None and self.top_k > self.draft_vocab_size:
            raise MedusaError(f"`top_k` ({self.top_k}) must be at most `draft_vocab_size` ({self.draft_vocab_size}): "
                              "the heads rank only that many tokens.")
        if self.warmup_steps > self.max_steps:
            raise MedusaError(f"`warmup_steps` ({self.warmup_steps}) must be at most `max_steps` ({self.max_steps}): "
                              "the run would end before reaching `learning_rate`.")


def _require(ok: bool, name: str, rule: str, value=...) -> None:
    if not ok:
        raise MedusaError(f"`{name}` {rule}" + ("." if value is ... else f", got {value!r}."))


def _checked_type(name: str, value, annotation):
    """`value` if it has the field's type (an int is a float too; a bool is not an int), else a one-line error."""
    kinds = [k for k in typing.get_args(annotation) if k is not type(None)] or [annotation]
    kind = kinds[0]
    if value is None:
        if type(None) in typing.get_args(annotation):
            return None
        raise MedusaError(f"`{name}` takes a {kind.__name__}, not null.")
    if (isinstance(value, bool) and kind is not bool) or (
            not isinstance(value, kind) and not (kind is float and isinstance(value, int))):
        raise MedusaError(f"`{name}` takes a {kind.__name__}, got {value!r}.")
    return float(value) if kind is float else value


def _from_text(name: str, value: str, annotation):
    """A command-line (or quoted YAML) string -> the field's type: `--max_steps 10`, `--eval_data null`."""
    kinds = [k for k in typing.get_args(annotation) if k is not type(None)] or [annotation]
    kind = kinds[0]
    if kind is str:
        return value
    if value.lower() in ("null", "none"):
        return None  # `_checked_type` refuses it where the field takes no null
    if kind is bool:
        if value.lower() not in ("true", "false", "1", "0", "yes", "no"):
            raise MedusaError(f"`{name}` takes true or false, got {value!r}.")
        return value.lower() in ("true", "1", "yes")
    try:
        return kind(value)
    except ValueError:
        raise MedusaError(f"`{name}` takes a {kind.__name__}, got {value!r}.") from None


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
    return TrainConfig(**{k: _from_text(k, v, types[k]) if isinstance(v, str) else v for k, v in values.items()})
