"""Head training (Medusa-1; Medusa-2 with `medusa2`). `train` at the bottom reads in the order a run goes:
data, heads, accelerator, optimizer, the loop (batch_loss, evaluate, save_checkpoint), the saved heads."""

import copy
import json
import logging
import math
import os
import shutil
import socket
import time
from dataclasses import asdict, dataclass
from functools import cached_property
from pathlib import Path

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import DeepSpeedPlugin, InitProcessGroupKwargs, broadcast_object_list, set_seed
from torch import nn
from tqdm import tqdm
from transformers import DynamicCache, PreTrainedModel

from medusa_heads.backbone import backbone_forward, load_backbone, load_tokenizer, parse_dtype, tap_features
from medusa_heads.eagle import unrolled_mask
from medusa_heads.errors import MedusaError
from medusa_heads.head_types import head_type_class
from medusa_heads.heads import DraftHeads
from medusa_heads.model import load_heads, save_heads, untrained_heads
from medusa_heads.quantize import quantize_backbone
from medusa_heads.tree import load_tree, validate_tree

from .data import Example, load_examples
from .draft_vocab import frequent_tokens, repick_draft_vocab
from .hidden_states import HiddenStateCache, compute_hidden, pad_batch
from .losses import (backbone_kl, decoded_steps, draft_labels, follow_embeddings, head_targets, heads_loss,
                     rank_hits, tree_walk, walk_hits_counts)
from .recipe import TrainConfig

logger = logging.getLogger(__name__)

TIMING_STEPS = 20  # steps a run with `max_minutes` times before it fits `max_steps` to the budget


def get_lr(step: int, cfg: TrainConfig) -> float:
    # 1) linear warm-up, 2) cosine decay to min_lr_ratio, 3) flat after max_steps
    if step < cfg.warmup_steps:
        return cfg.learning_rate * (step + 1) / cfg.warmup_steps
    if step >= cfg.max_steps:
        return cfg.learning_rate * cfg.min_lr_ratio
    progress = (step - cfg.warmup_steps) / max(cfg.max_steps - cfg.warmup_steps, 1)
    return cfg.learning_rate * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def batches_per_epoch(n_examples: int, batch_size: int) -> int:
    """How many micro-batches `batch_order` cuts an epoch into: full ones, or one short batch of everything."""
    return max(n_examples // batch_size, 1)


def batch_order(lengths: list[int], batch_size: int, epoch: int, seed: int, window: int = 1) -> list[list[int]]:
    """One epoch's micro-batches of conversation indices: a shuffle cut into batches, the last partial one dropped.
    With `window` > 1 (`length_window`) each run of `window` batches of the shuffle is sorted by length before it
    is cut, and the batches are shuffled again: a batch holds conversations of like length, so little of it is
    padding, and is still a random draw from its window."""
    generator = torch.Generator().manual_seed(seed * 1000 + epoch)
    perm = torch.randperm(len(lengths), generator=generator).tolist()
    if window > 1:
        span = window * batch_size
        perm = [i for s in range(0, len(perm), span) for i in sorted(perm[s : s + span], key=lambda i: lengths[i])]
    batches = [perm[i : i + batch_size] for i in range(0, len(perm) - batch_size + 1, batch_size)] or [perm]
    if window > 1:
        batches = [batches[i] for i in torch.randperm(len(batches), generator=generator).tolist()]
    return batches


def heads_forward(heads, lm_head, embed, hidden, input_ids, loss_mask, cfg: TrainConfig, vocab_index=None):
    """-> (per-head logits [N, V_out], labels [N] and teacher logits or None) at the N positions where any
    head has a label; see `heads_loss` for the label codes. `heads` may be the prepared (DDP/DeepSpeed) module:
    its own forward is called, the one a DDP wrapper syncs gradients for. `embed` is given for heads that read
    tokens (`reads_tokens`) only."""
    labels, teacher_pos = head_targets(input_ids, loss_mask, cfg.num_heads)
    where = (labels != -100).any(dim=0)  # [B, T]
    dtype = next(heads.parameters()).dtype
    states = hidden[where].to(dtype)  # [N, H]
    embeds = follow_embeddings(embed, input_ids, cfg.num_heads)[where].to(dtype) if embed is not None else None
    logits = list(heads(states, lm_head, embeds))  # K x [N, V_out]
    targets = [draft_labels(labels[j][where], vocab_index) for j in range(cfg.num_heads)]
    teachers = None
    if cfg.loss == "kl":
        b_idx = torch.nonzero(where, as_tuple=True)[0]
        with torch.no_grad():
            teachers = [lm_head(hidden[b_idx, teacher_pos[j][where]].to(lm_head.weight.dtype))
                        for j in range(cfg.num_heads)]
    return logits, targets, teachers


def eagle_forward(drafter, lm_head, embed, hidden, input_ids, loss_mask, cfg: TrainConfig, vocab_index=None,
                  aligned: bool = False):
    """`heads_forward` for an EAGLE drafter, unrolled `cfg.num_heads` draft depths deep ("training-time test"):
    level j at position t predicts x_{t+2} from the backbone's features up to t - j + 1 and its own predicted
    features after them, seeing exactly what it sees when drafting j deep (`unrolled_mask`). Every level is
    scored at the same positions (t >= num_heads - 1, where x_{t+2} is an answer token). `hidden` holds the
    backbone's features as `backbone_forward` gives them, the last hidden state first (EAGLE-3 reads more layers).

    `aligned` (evaluation): entry i of every level belongs to the same drafting step instead, as in
    `heads_forward`: level j scores the step whose root is the token after position r at position r + j - 1, so
    that tree walks and calibration counts follow one step's path (at equal positions, level j's guess belongs
    to a step j - 1 tokens earlier, and a walk down them would score one token j times)."""
    B, T = input_ids.shape
    raw = getattr(drafter, "module", drafter)  # a DDP module or DeepSpeed engine keeps the drafter as `module`
    n, levels, device = T - 1, cfg.num_heads, input_ids.device  # entry t = (f_t, x_{t+1}), t = 0 .. T - 2
    dtype = next(drafter.parameters()).dtype
    token_embeds = embed(input_ids[:, 1:]).to(dtype)
    positions = torch.arange(n, device=device).expand(B, n)
    where = torch.zeros(B, n, dtype=torch.bool, device=device)
    where[:, levels - 1 : n - 1] = loss_mask[:, levels + 1 :].bool()
    if aligned:
        roots = torch.zeros(B, n, dtype=torch.bool, device=device)
        roots[:, : n - 1] = loss_mask[:, 2:].bool()
        rows, first = roots.nonzero(as_tuple=True)
        later = F.pad(input_ids[:, 2:], (0, levels)), F.pad(loss_mask[:, 2:], (0, levels)).bool()
    else:
        labels = draft_labels(F.pad(input_ids[:, 2:], (0, 1))[where], vocab_index)
    cache, logits, level_labels, out = DynamicCache(), [], [], None
    with raw.unrolled():
        for level in range(1, levels + 1):
            features = hidden[:, :-1].to(dtype) if level == 1 else F.pad(out[:, :-1], (0, 0, 1, 0))
            mask = unrolled_mask(level, n, device)[None, None].expand(B, 1, n, level * n)
            out = drafter(features, token_embeds, positions, mask, cache)
            if not aligned:
                logits.append(raw.project(level - 1, out[where], lm_head))
                continue
            at = first + level - 1
            logits.append(raw.project(level - 1, out[rows, at.clamp(max=n - 1)], lm_head))
            scored = (at < n - 1) & later[1][rows, at]
            level_labels.append(torch.where(scored, draft_labels(later[0][rows, at], vocab_index), -100))
    if aligned:
        return logits, level_labels, None
    teachers = None
    if cfg.loss == "kl":
        last = hidden[:, 1:, : raw.config.hidden_size]
        with torch.no_grad():
            teachers = [lm_head(last[where].to(lm_head.weight.dtype))] * levels
    return logits, [labels] * levels, teachers


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def check_trackers(report_to: str | None) -> list[str] | None:
    """`report_to` (comma-separated) -> accelerate's `log_with`; accelerate drops a tracker that is not installed
    without a word, so that is an error here."""
    from accelerate.tracking import get_available_trackers
    from accelerate.utils import LoggerType

    if report_to is None:
        return None
    names = [n.strip() for n in report_to.split(",") if n.strip()]
    unknown = [n for n in names if n not in LoggerType.list()]
    if unknown:
        raise MedusaError(f"Unknown tracker `{unknown[0]}` in `report_to`; known: {', '.join(LoggerType.list())}.")
    missing = [n for n in names if n != "all" and LoggerType(n) not in get_available_trackers()]
    if missing:
        raise MedusaError(f"`report_to: {missing[0]}`: the {missing[0]} package is not installed "
                          f"(pip install {missing[0]}).")
    return names


@dataclass
class Data:
    """The conversations and what is derived from them before any training."""

    train_set: list[Example]
    held_out: list[Example]
    tree_paths: tuple | None  # the validated paths of `cfg.tree`
    draft_vocab: torch.Tensor | None  # token ids the heads guess among (None: all)

    @cached_property  # read every step to order the batches
    def train_lengths(self) -> list[int]:
        return [len(e.input_ids) for e in self.train_set]


@dataclass
class Run:
    """What the steps of a run share once accelerate has prepared it."""

    cfg: TrainConfig
    accelerator: Accelerator
    data: Data
    backbone: nn.Module  # frozen, or a peft model whose adapters train (medusa2)
    heads: nn.Module  # as prepared: a DDP module or a DeepSpeed engine around the heads
    lm_head: nn.Module  # the backbone's LM head (its draft-vocabulary rows), frozen: shared heads score with it
    embed: nn.Module | None  # the frozen token embeddings, for heads that read tokens
    vocab_index: torch.Tensor | None  # [V]: token id -> draft-vocabulary index, -1 outside it
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    trainable: list[nn.Parameter]  # what the gradient clip sees
    train_cache: HiddenStateCache | None = None
    held_cache: HiddenStateCache | None = None

    @property
    def kind(self) -> type[DraftHeads]:
        return head_type_class(self.cfg.head_type)

    @property
    def raw_heads(self) -> nn.Module:
        return self.accelerator.unwrap_model(self.heads)

    @property
    def output_dir(self) -> Path:
        return Path(self.cfg.output_dir)


def check_setup(cfg: TrainConfig) -> list[str] | None:
    """What can fail before any model loads: the DeepSpeed file and the trackers (-> accelerate's `log_with`)."""
    if cfg.deepspeed_config and not Path(cfg.deepspeed_config).is_file():
        raise MedusaError(f"DeepSpeed config `{cfg.deepspeed_config}` does not exist.")
    return check_trackers(cfg.report_to)


def prepare_data(cfg: TrainConfig, backbone: PreTrainedModel, tokenizer,
                 kept_vocab: torch.Tensor | None = None) -> Data:
    """Training and held-out conversations, the tree and the draft vocabulary (`kept_vocab`, that of the heads a
    run continues, else counted on the data); every check that can fail on the data runs here, before any compute."""
    examples = load_examples(cfg.data, tokenizer, cfg.max_length)
    if cfg.eval_data:
        train_set, held_out = examples, load_examples(cfg.eval_data, tokenizer, cfg.max_length)
    else:
        n_held = int(len(examples) * cfg.held_out_fraction)
        split = torch.randperm(len(examples), generator=torch.Generator().manual_seed(cfg.seed)).tolist()
        held_out = [examples[i] for i in split[:n_held]]
        train_set = [examples[i] for i in split[n_held:]]
    tree_paths = validate_tree(load_tree(cfg.tree), num_heads=cfg.num_heads) if cfg.tree else None
    if len(train_set) < cfg.batch_size:
        raise MedusaError(f"Only {len(train_set)} training conversations for `batch_size` {cfg.batch_size}.")
    draft_vocab = kept_vocab
    if draft_vocab is None and (cfg.draft_vocab_size or cfg.draft_vocab_coverage):
        vocab = backbone.get_output_embeddings().weight.shape[0]
        draft_vocab, covered = frequent_tokens(train_set, vocab, cfg.draft_vocab_size, cfg.draft_vocab_coverage)
        logger.info("draft vocabulary: %d tokens cover %.2f%% of the training targets", draft_vocab.numel(),
                    100 * covered)
    return Data(train_set, held_out, tree_paths, draft_vocab)


def build_heads(cfg: TrainConfig, backbone: PreTrainedModel, draft_vocab: torch.Tensor | None,
                start: DraftHeads | None = None) -> tuple[DraftHeads, nn.Module, nn.Module | None]:
    """-> (fp32 heads: `start`, the saved heads a run continues, else fresh ones; the projection they score with;
    the token embeddings if they read tokens). The heads train in fp32 (autocast for mixed precision); so do the
    frozen projection and embeddings they read."""
    if start is not None:
        heads = start
    else:
        layers = {"feature_layers": [int(x) for x in cfg.feature_layers.split(",")]} if cfg.feature_layers else {}
        heads = untrained_heads(backbone, cfg.model, cfg.num_heads, cfg.num_layers, cfg.share_lm_head,
                                head_type=cfg.head_type, draft_vocab=draft_vocab, **layers)
    heads = heads.to(torch.float32).train()
    lm_head = heads.output_projection(copy.deepcopy(backbone.get_output_embeddings()).float().requires_grad_(False))
    embed = None
    if type(heads).reads_tokens:
        embed = copy.deepcopy(backbone.get_input_embeddings()).float().requires_grad_(False)
    return heads, lm_head, embed


def initial_heads(cfg: TrainConfig) -> DraftHeads:
    """The saved heads `cfg.init_heads`, checked to be the heads the recipe describes (with their own draft
    vocabulary, if they have one, unless `repick_draft_vocab`)."""
    heads = load_heads(cfg.init_heads)
    wanted = {"num_heads": cfg.num_heads, "num_layers": cfg.num_layers, "head_type": cfg.head_type,
              "share_lm_head": cfg.share_lm_head}
    if not cfg.repick_draft_vocab:
        wanted["draft_vocab_size"] = cfg.draft_vocab_size
    differ = [f"{k} {getattr(heads.config, k)!r} (the recipe: {v!r})" for k, v in wanted.items()
              if getattr(heads.config, k) != v]
    if differ:
        raise MedusaError(f"`init_heads` {cfg.init_heads} are not the recipe's heads: {'; '.join(differ)}.")
    heads.config.base_model_name_or_path = cfg.model
    return heads


def add_adapters(cfg: TrainConfig, backbone: PreTrainedModel) -> PreTrainedModel:
    """Medusa-2: LoRA adapters on the backbone, trained with the heads."""
    from peft import LoraConfig, get_peft_model

    lora = LoraConfig(r=cfg.lora_r, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout,
                      target_modules=[m.strip() for m in cfg.lora_target_modules.split(",")], task_type="CAUSAL_LM")
    return get_peft_model(backbone, lora)


def training_device() -> torch.device:
    """The device accelerate will train on: the machine's accelerator, else the CPU."""
    return torch.accelerator.current_accelerator() or torch.device("cpu")


def make_accelerator(cfg: TrainConfig, trackers: list[str] | None) -> Accelerator:
    """An Accelerator over every launched process (DeepSpeed when configured); a process left alone is an error."""
    if cfg.deepspeed_config and "RANK" not in os.environ:
        # Not started by a launcher: one process, so set up the rendezvous a launcher would have.
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=os.environ.get("MASTER_PORT", str(free_port())))
    plugin = DeepSpeedPlugin(hf_ds_config=cfg.deepspeed_config) if cfg.deepspeed_config else None
    on_cpu = not torch.accelerator.is_available()
    # On a machine without an accelerator accelerate finds no process-group backend of its own, and then counts
    # each launched process alone (world size 1): cpu=True joins them over gloo (MULTI_CPU); under DeepSpeed, which
    # cpu=True would switch off, naming gloo does.
    handlers = [InitProcessGroupKwargs(backend="gloo")] if plugin is not None and on_cpu else None
    mixed = cfg.mixed_precision
    if mixed == "auto":  # emulated bf16 (a CPU without AMX or AVX512-BF16) is several times slower than fp32
        mixed = "bf16" if parse_dtype("auto", training_device()) == torch.bfloat16 else "no"
    accelerator = Accelerator(mixed_precision=mixed, deepspeed_plugin=plugin,
                              gradient_accumulation_steps=cfg.gradient_accumulation_steps,
                              cpu=plugin is None and on_cpu, kwargs_handlers=handlers,
                              log_with=trackers, project_dir=cfg.output_dir)
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    if accelerator.num_processes != launched:
        raise MedusaError(f"The launcher started {launched} processes but accelerate joined "
                          f"{accelerator.num_processes}: each would train alone; see docs/training.md, several "
                          "processes.")
    if plugin is not None:
        # We feed batches ourselves (no DataLoader), so DeepSpeed's "auto" sizes are filled in here.
        ds = accelerator.state.deepspeed_plugin.deepspeed_config
        ds["train_micro_batch_size_per_gpu"] = cfg.batch_size
        ds["gradient_accumulation_steps"] = cfg.gradient_accumulation_steps
        ds["train_batch_size"] = cfg.batch_size * cfg.gradient_accumulation_steps * accelerator.num_processes
    logger.info("world size %d (process %d), device %s%s", accelerator.num_processes, accelerator.process_index,
                accelerator.device, f", DeepSpeed ZeRO-{plugin.zero_stage}" if plugin else "")
    return accelerator


def make_optimizer(cfg: TrainConfig, heads: nn.Module,
                   backbone: nn.Module) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler,
                                                 list[nn.Parameter]]:
    """-> (AdamW over the heads and any trainable backbone weights, its `get_lr` schedule, those parameters)."""
    trainable = list(heads.parameters()) + [p for p in backbone.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=cfg.learning_rate, weight_decay=cfg.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: get_lr(s, cfg) / cfg.learning_rate)
    return optimizer, scheduler, trainable


def draft_index(draft_vocab: torch.Tensor | None, vocab_size: int) -> torch.Tensor | None:
    """[vocab_size]: each token's index in the draft vocabulary, -1 outside it."""
    if draft_vocab is None:
        return None
    index = torch.full((vocab_size,), -1, dtype=torch.long)
    index[draft_vocab] = torch.arange(draft_vocab.numel())
    return index


def prepare_run(cfg: TrainConfig, accelerator: Accelerator, data: Data, backbone: nn.Module, heads: nn.Module,
                lm_head: nn.Module, embed: nn.Module | None) -> Run:
    """Models on the device, the optimizer, accelerate's wrappers, the trackers and the hidden-state caches."""
    if batches_per_epoch(len(data.train_set), cfg.batch_size) < accelerator.num_processes:
        raise MedusaError(f"Only {len(data.train_set)} training conversations for {accelerator.num_processes} "
                          f"processes with `batch_size` {cfg.batch_size}: each process needs a batch of its own.")
    device = accelerator.device
    backbone.to(device)
    lm_head.to(device)
    if embed is not None:
        embed.to(device)
    vocab_index = draft_index(data.draft_vocab, backbone.get_output_embeddings().weight.shape[0])
    if vocab_index is not None:
        vocab_index = vocab_index.to(device)
    optimizer, scheduler, trainable = make_optimizer(cfg, heads, backbone)
    if cfg.medusa2:  # the adapters are trained state too: checkpoints must hold them
        heads, backbone, optimizer, scheduler = accelerator.prepare(heads, backbone, optimizer, scheduler)
    else:
        heads, optimizer, scheduler = accelerator.prepare(heads, optimizer, scheduler)
    if cfg.report_to:
        accelerator.init_trackers("medusa-heads", config=asdict(cfg))
    run = Run(cfg, accelerator, data, backbone, heads, lm_head, embed, vocab_index, optimizer, scheduler, trainable)
    if cfg.cache_hidden_states:
        run.train_cache, run.held_cache = cache_hidden_states(run)
    return run


def cache_hidden_states(run: Run) -> tuple[HiddenStateCache, HiddenStateCache | None]:
    """The frozen backbone's hidden states of the training and held-out sets, computed once (or read from disk)."""
    cfg, data = run.cfg, run.data
    start = time.perf_counter()
    folder = Path(cfg.hidden_cache_dir) if cfg.hidden_cache_dir else None
    name = cfg.model if cfg.quantize == "none" else f"{cfg.model} ({cfg.quantize})"  # another backbone's states
    if run.raw_heads.feature_layers:  # more layers' states (`tap_features`)
        name += f" (+ layers {list(run.raw_heads.feature_layers)})"
    train_cache = HiddenStateCache.build(run.backbone, name, data.train_set, cfg.batch_size, folder)
    held_cache = None
    if data.held_out:
        held_cache = HiddenStateCache.build(run.backbone, name, data.held_out, cfg.batch_size, folder)
    logger.info("hidden states ready in %.1f s", time.perf_counter() - start)
    return train_cache, held_cache


def micro_batch(cfg: TrainConfig, lengths: list[int], position: int, world: int, rank: int) -> list[int]:
    """The conversations of this process's micro-batch number `position` (`lengths`: every training conversation's
    token count): process `rank` takes every world-th batch of the order all processes share, epoch after epoch."""
    per_epoch = max(batches_per_epoch(len(lengths), cfg.batch_size) // world, 1)
    epoch, index = divmod(position, per_epoch)
    return batch_order(lengths, cfg.batch_size, epoch, cfg.seed, cfg.length_window)[index * world + rank]


def batch_inputs(run: Run, examples: list[Example], indices: list[int],
                 cache: HiddenStateCache | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> hidden states [B, T, H] (cached, or from the backbone now), input ids and loss mask [B, T]."""
    ids, mask, attn = pad_batch([examples[i] for i in indices])
    hidden = cache.batch(indices) if cache else compute_hidden(run.backbone, ids, attn)
    device = run.accelerator.device
    return hidden.to(device), ids.to(device), mask.to(device)


def draft_forward(run: Run, heads: nn.Module, hidden: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor,
                  aligned: bool = False):
    """`heads_forward`, or `eagle_forward` for a drafter trained unrolled over the context (`aligned`: its
    evaluation layout, one drafting step per entry)."""
    if run.kind.drafts_over_context:
        return eagle_forward(heads, run.lm_head, run.embed, hidden, ids, mask, run.cfg, run.vocab_index, aligned)
    return heads_forward(heads, run.lm_head, run.embed, hidden, ids, mask, run.cfg, run.vocab_index)


def draft_loss(run: Run, hidden: torch.Tensor, ids: torch.Tensor,
               mask: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The heads' loss (weighted total, per head) on a batch's hidden states."""
    cfg = run.cfg
    logits, targets, teachers = draft_forward(run, run.heads, hidden, ids, mask)
    return heads_loss(logits, targets, cfg.decay, cfg.loss, teachers, cfg.loss_weighting, run.data.tree_paths)


def medusa2_loss(run: Run, indices: list[int], warm: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Heads loss on the adapted backbone's hidden states, plus its KL to itself without adapters; during the
    warm-up (`warm`) the heads alone train."""
    ids, mask, attn = (t.to(run.accelerator.device) for t in pad_batch([run.data.train_set[i] for i in indices]))
    with torch.set_grad_enabled(not warm):
        student, hidden = backbone_forward(run.backbone, ids, None, attention_mask=attn)
    heads_total, per_head = draft_loss(run, hidden, ids, mask)
    if warm:
        return heads_total, per_head
    with torch.no_grad(), run.accelerator.unwrap_model(run.backbone).disable_adapter():
        teacher, _ = backbone_forward(run.backbone, ids, None, attention_mask=attn)
    return backbone_kl(student, teacher, mask) + run.cfg.heads_loss_weight * heads_total, per_head


def batch_loss(run: Run, indices: list[int], step: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One micro-batch of training conversations -> (loss, per-head losses): the heads' on the frozen
    backbone's hidden states, or Medusa-2's."""
    if run.cfg.medusa2:
        return medusa2_loss(run, indices, warm=step < run.cfg.heads_warmup_steps)
    return draft_loss(run, *batch_inputs(run, run.data.train_set, indices, run.train_cache))


def train_step(run: Run, step: int) -> tuple[float, list[float], int]:
    """One optimizer step over `gradient_accumulation_steps` micro-batches -> (the last micro-batch's loss and
    per-head losses, answer tokens trained on)."""
    cfg, accelerator = run.cfg, run.accelerator
    tokens = 0
    for micro in range(cfg.gradient_accumulation_steps):
        indices = micro_batch(cfg, run.data.train_lengths, step * cfg.gradient_accumulation_steps + micro,
                              accelerator.num_processes, accelerator.process_index)
        with accelerator.accumulate(run.heads), accelerator.autocast():
            loss, per_head = batch_loss(run, indices, step)
            if not torch.isfinite(loss):
                last = latest_checkpoint(run.output_dir)
                raise MedusaError(f"The loss became {loss.item()} at step {step}; stopped. The last good "
                                  f"checkpoint is {last or 'none (none was written yet)'}.")
            accelerator.backward(loss)
            if accelerator.sync_gradients and cfg.grad_clip > 0:
                accelerator.clip_grad_norm_(run.trainable, cfg.grad_clip)
            run.optimizer.step()
            run.scheduler.step()
            run.optimizer.zero_grad()
        tokens += sum(sum(run.data.train_set[i].loss_mask) for i in indices)
    return loss.item(), [x.item() for x in per_head], tokens


@torch.no_grad()
def evaluate(run: Run) -> dict:
    """Held-out accuracy per head and rank (and the tree's accepted length when `tree` is set). Every process
    evaluates the whole held-out set: under ZeRO-3 the heads' forward needs all of them."""
    cfg, data = run.cfg, run.data
    run.heads.eval()
    hits = torch.zeros(cfg.num_heads, cfg.top_k, dtype=torch.long)
    counts = torch.zeros(cfg.num_heads, dtype=torch.long)
    walk_hits, walk_counts = torch.zeros_like(hits), torch.zeros_like(counts)
    steps = committed = 0
    by_length = sorted(range(len(data.held_out)), key=lambda i: len(data.held_out[i].input_ids))  # little padding
    for b in range(0, len(data.held_out), cfg.batch_size):
        idx = by_length[b : b + cfg.batch_size]
        hidden, ids, mask = batch_inputs(run, data.held_out, idx, run.held_cache)
        with run.accelerator.autocast():
            logits, targets, _ = draft_forward(run, run.raw_heads, hidden, ids, mask, aligned=True)
        h, c = rank_hits(logits, targets, cfg.top_k)
        hits += h
        counts += c
        h, c = walk_hits_counts(logits, targets, cfg.top_k)
        walk_hits += h
        walk_counts += c
        if data.tree_paths is not None:
            _, accepted = tree_walk(logits, targets, data.tree_paths)
            roots = targets[0] != -100  # the entries of steps: the token two ahead is an answer token
            grid = torch.zeros_like(mask, dtype=torch.bool)  # the same positions, [B, T]
            grid[:, :-2] = mask[:, 2:].bool()
            tokens, n = decoded_steps(grid, 1 + accepted[:, roots].sum(0))
            committed += tokens
            steps += n
    run.heads.train()
    per_rank = (hits.double() / counts.clamp(min=1)[:, None].double()).tolist()
    return {"num_heads": cfg.num_heads, "top_k": cfg.top_k, "positions": counts.tolist(), "hits": hits.tolist(),
            "per_rank": per_rank,  # [head][rank]: share of positions whose label sat at that rank
            "top1": [r[0] for r in per_rank], "top5": [sum(r[:5]) for r in per_rank],
            # what `tree optimize --calibration` reads: head j counted only where heads 1..j-1 had the truth in
            # their top_k (P(rank r accepted | parent accepted), the counts of `medusa_heads.apps.calibrate`)
            "calibration": {"top_k": cfg.top_k, "positions": walk_counts.tolist(), "hits": walk_hits.tolist(),
                            "conversations": len(data.held_out)},
            # greedy tree decoding of `tree` replayed on the held-out answers: tokens per step
            **({"tree": cfg.tree, "tree_accepted_length": committed / max(steps, 1)} if data.tree_paths else {})}


def log_progress(run: Run, step: int, loss: float, per_head: list[float], tokens_per_second: float) -> None:
    logger.info("step %d loss %.4f per head %s lr %.2e %.0f tokens/s", step, loss,
                " ".join(f"{x:.3f}" for x in per_head), run.scheduler.get_last_lr()[0], tokens_per_second)
    if run.cfg.report_to:
        run.accelerator.log({"loss": loss, **{f"loss_head{j + 1}": x for j, x in enumerate(per_head)}}, step=step)


def log_accuracy(run: Run, step: int, accuracies: dict) -> None:
    logger.info("held-out top-1 per head %s, top-5 %s%s", " ".join(f"{a:.3f}" for a in accuracies["top1"]),
                " ".join(f"{a:.3f}" for a in accuracies["top5"]),
                f", accepted length on {run.cfg.tree} {accuracies['tree_accepted_length']:.3f}" if run.cfg.tree else "")
    if run.cfg.report_to:
        run.accelerator.log({f"held_out_top1_head{j + 1}": a for j, a in enumerate(accuracies["top1"])}, step=step)


def latest_checkpoint(output_dir: Path) -> Path | None:
    done = sorted(output_dir.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))
    return done[-1] if done else None


def save_checkpoint(run: Run, step: int) -> None:
    """Every process writes its part (its RNG state; under DeepSpeed its shard of the weights and optimizer)
    into one temporary folder, then process 0 completes it and renames it: a kill at any point leaves the
    previous checkpoint whole. Every process must call this (DeepSpeed's save is collective), with the same
    `output_dir` on a file system they share."""
    accelerator, output_dir = run.accelerator, run.output_dir
    tmp = output_dir / f".tmp-checkpoint-{step}"
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)  # left by a killed run
    accelerator.wait_for_everyone()
    accelerator.save_state(str(tmp))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        (tmp / "trainer.json").write_text(json.dumps({"step": step, "config": asdict(run.cfg)}, indent=1))
        final = output_dir / f"checkpoint-{step}"
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        for old in sorted(output_dir.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))[:-2]:
            shutil.rmtree(old)
    accelerator.wait_for_everyone()  # no process starts the next step (or a resume) before the folder is whole


def load_checkpoint(run: Run) -> int:
    """Weights, optimizer, scheduler and each process's own RNG state (and DeepSpeed shard) from the last
    complete checkpoint -> its step; the data position follows from the step."""
    last = latest_checkpoint(run.output_dir)
    if last is None:
        raise MedusaError(f"`--resume` found no checkpoint in `{run.output_dir}`.")
    run.accelerator.load_state(str(last))
    step = json.loads((last / "trainer.json").read_text())["step"]
    logger.info("resumed from %s at step %d", last, step)
    return step


def steps_in_budget(cfg: TrainConfig, step: int, steps_done: int, elapsed: float, planned: int) -> int:
    """The last step that fits `max_minutes` at the pace so far: at least `step`, at most `planned` (the
    recipe's `max_steps`)."""
    pace = elapsed / steps_done
    return max(step, min(planned, step + int((cfg.max_minutes * 60 - elapsed) / pace)))


def fit_to_budget(run: Run, step: int, first: int, t0: float, planned: int) -> None:
    """`max_minutes`: set `max_steps` to what fits; process 0 decides for all (they must stop together). The
    schedule reads `max_steps`, so the cosine decay ends with the budget."""
    fitted = [steps_in_budget(run.cfg, step, step - first, time.perf_counter() - t0, planned)]
    if run.accelerator.num_processes > 1:
        broadcast_object_list(fitted)
    if fitted[0] != run.cfg.max_steps:
        small = abs(fitted[0] - run.cfg.max_steps) <= 0.02 * run.cfg.max_steps  # the pace wobbles a little
        logger.log(logging.DEBUG if small else logging.INFO, "max_minutes %g: %d steps fit at this pace (max_steps "
                   "was %d)", run.cfg.max_minutes, fitted[0], run.cfg.max_steps)
        run.cfg.max_steps = fitted[0]


def train_loop(run: Run, step: int) -> tuple[list[dict], dict | None, float]:
    """Steps from `step` to `max_steps` (fitted to `max_minutes` as it goes), logging, evaluating and
    checkpointing on schedule -> (the loss curve, the last held-out accuracies or None, training tokens per
    second of this process)."""
    cfg = run.cfg
    history, accuracies = [], None
    bar = tqdm(total=cfg.max_steps, initial=step, desc="train", unit="step",
               disable=not run.accelerator.is_main_process)
    tokens, t0, first, planned = 0, time.perf_counter(), step, cfg.max_steps
    while step < cfg.max_steps:
        loss, per_head, n = train_step(run, step)
        tokens += n
        step += 1
        history.append({"step": step, "loss": loss, "per_head": per_head})
        bar.update(1)
        if cfg.max_minutes and step - first >= TIMING_STEPS and (step - first) % cfg.log_every == 0:
            fit_to_budget(run, step, first, t0, planned)
            bar.total = cfg.max_steps
        if step % cfg.log_every == 0 or step == cfg.max_steps:
            rate = tokens / (time.perf_counter() - t0)
            bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{rate:.0f}")
            log_progress(run, step, loss, per_head, rate)
        if run.data.held_out and (step % cfg.eval_every == 0 or step == cfg.max_steps):
            accuracies = evaluate(run)
            history[-1]["held_out_top1"] = accuracies["top1"]
            log_accuracy(run, step, accuracies)
        if step % cfg.checkpoint_every == 0:
            save_checkpoint(run, step)
    bar.close()
    return history, accuracies, tokens / (time.perf_counter() - t0)


def save_results(run: Run, history: list[dict], accuracies: dict | None, tokens_per_second: float) -> dict:
    """Process 0 writes the trained heads (and Medusa-2's adapter), their held-out accuracies and the loss curve
    -> what `train` returns."""
    accelerator, output_dir = run.accelerator, run.output_dir
    accelerator.wait_for_everyone()
    if run.data.held_out and accuracies is None:  # resumed at `max_steps`: no step ran
        accuracies = evaluate(run)
    result = {"history": history, "train_tokens_per_second": tokens_per_second}
    state_dict = accelerator.get_state_dict(run.heads)  # gathered from all ranks under ZeRO-3; every rank takes part
    if accelerator.is_main_process:
        adapter = accelerator.unwrap_model(run.backbone) if run.cfg.medusa2 else None  # saves its weights only
        final = save_heads(output_dir / "heads", run.raw_heads, state_dict, adapter=adapter)
        if run.data.held_out:
            result["accuracies"] = accuracies
            (final / "head_accuracies.json").write_text(json.dumps(accuracies, indent=1))
        (output_dir / "history.json").write_text(json.dumps(history))
        logger.info("saved heads to %s", final)
    # Every process tears the world down together: one that leaves while process 0 still writes can abort
    # in gloo's teardown (seen under ZeRO-3).
    accelerator.wait_for_everyone()
    accelerator.end_training()
    return result


def train(cfg: TrainConfig, resume: bool = False) -> dict:
    """Train heads as `cfg` says (continuing from the last checkpoint with `resume`) -> {"history": the loss
    curve, "train_tokens_per_second", and "accuracies" on the held-out set when there is one}."""
    set_seed(cfg.seed)
    trackers = check_setup(cfg)
    # Backbone (frozen), data and heads, made before the Accelerator: under ZeRO-3 anything built after it
    # is partitioned on construction, and the frozen backbone must stay whole.
    backbone = load_backbone(cfg.model, dtype=parse_dtype(cfg.backbone_dtype, training_device()))
    quantize_backbone(backbone, cfg.quantize)
    start = initial_heads(cfg) if cfg.init_heads else None
    kept_vocab = start.draft_vocab if start is not None and not cfg.repick_draft_vocab else None
    data = prepare_data(cfg, backbone, load_tokenizer(cfg.model), kept_vocab)
    if cfg.repick_draft_vocab:
        new = repick_draft_vocab(start, data.draft_vocab, backbone.get_output_embeddings().weight)
        logger.info("draft vocabulary re-picked: %d of %d tokens new", new, data.draft_vocab.numel())
    heads, lm_head, embed = build_heads(cfg, backbone, data.draft_vocab, start)
    if heads.feature_layers:  # the backbone's forwards also return the layers the heads read
        tap_features(backbone, heads.feature_layers)
    if cfg.medusa2:
        backbone = add_adapters(cfg, backbone)
    accelerator = make_accelerator(cfg, trackers)
    run = prepare_run(cfg, accelerator, data, backbone, heads, lm_head, embed)
    step = load_checkpoint(run) if resume else 0
    history, accuracies, tokens_per_second = train_loop(run, step)
    return save_results(run, history, accuracies, tokens_per_second)
