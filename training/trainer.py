"""Medusa-1 training: the backbone is frozen, only the heads learn. Reads in the order it runs."""

import copy
import json
import logging
import math
import os
import shutil
import socket
import time
from dataclasses import asdict
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm
from transformers import DynamicCache

from medusa_heads.backbone import backbone_forward, load_backbone, load_tokenizer
from medusa_heads.eagle import unrolled_mask
from medusa_heads.errors import MedusaError
from medusa_heads.model import untrained_heads
from medusa_heads.tree import load_tree, validate_tree

from .data import load_examples
from .hidden_states import HiddenStateCache, compute_hidden, pad_batch
from .draft_vocab import frequent_tokens
from .losses import backbone_kl, draft_labels, follow_embeddings, head_targets, heads_loss, rank_hits, tree_walk
from .recipe import TrainConfig

logger = logging.getLogger(__name__)


def get_lr(step: int, cfg: TrainConfig) -> float:
    # 1) linear warm-up, 2) cosine decay to min_lr_ratio, 3) flat after max_steps
    if step < cfg.warmup_steps:
        return cfg.learning_rate * (step + 1) / cfg.warmup_steps
    if step >= cfg.max_steps:
        return cfg.learning_rate * cfg.min_lr_ratio
    progress = (step - cfg.warmup_steps) / max(cfg.max_steps - cfg.warmup_steps, 1)
    return cfg.learning_rate * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def batch_order(n_examples: int, batch_size: int, epoch: int, seed: int) -> list[list[int]]:
    perm = torch.randperm(n_examples, generator=torch.Generator().manual_seed(seed * 1000 + epoch)).tolist()
    return [perm[i : i + batch_size] for i in range(0, n_examples - batch_size + 1, batch_size)] or [perm]


def heads_forward(heads, lm_head, embed, hidden, input_ids, loss_mask, cfg: TrainConfig, vocab_index=None):
    """-> (per-head logits [N, V_out], labels [N] and teacher logits or None) at the N positions where any
    head has a label; see `heads_loss` for the label codes. `heads` may be the prepared (DDP/DeepSpeed) module:
    its own forward is called, the one a DDP wrapper syncs gradients for. `embed` is given for Hydra heads only."""
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


def eagle_forward(drafter, lm_head, embed, hidden, input_ids, loss_mask, cfg: TrainConfig, vocab_index=None):
    """`heads_forward` for an EAGLE drafter, unrolled `cfg.num_heads` draft depths deep ("training-time test"):
    level j at position t predicts x_{t+2} from the backbone's features up to t - j + 1 and its own predicted
    features after them, seeing exactly what it sees when drafting j deep (`unrolled_mask`). Every level is
    scored at the same positions (t >= num_heads - 1, where x_{t+2} is an answer token)."""
    B, T = input_ids.shape
    n, levels, device = T - 1, cfg.num_heads, input_ids.device  # entry t = (f_t, x_{t+1}), t = 0 .. T - 2
    dtype = next(drafter.parameters()).dtype
    token_embeds = embed(input_ids[:, 1:]).to(dtype)
    positions = torch.arange(n, device=device).expand(B, n)
    where = torch.zeros(B, n, dtype=torch.bool, device=device)
    where[:, levels - 1 : n - 1] = loss_mask[:, levels + 1 :].bool()
    labels = draft_labels(F.pad(input_ids[:, 2:], (0, 1))[where], vocab_index)
    cache, logits, out = DynamicCache(), [], None
    for level in range(1, levels + 1):
        features = hidden[:, :-1].to(dtype) if level == 1 else F.pad(out[:, :-1], (0, 0, 1, 0))
        mask = unrolled_mask(level, n, device)[None, None].expand(B, 1, n, level * n)
        out = drafter(features, token_embeds, positions, mask, cache)
        logits.append(lm_head(out[where]))
    teachers = None
    if cfg.loss == "kl":
        with torch.no_grad():
            teachers = [lm_head(hidden[:, 1:][where].to(lm_head.weight.dtype))] * levels
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


def latest_checkpoint(output_dir: Path) -> Path | None:
    done = sorted(output_dir.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))
    return done[-1] if done else None


def train(cfg: TrainConfig, resume: bool = False) -> dict:
    from accelerate import Accelerator
    from accelerate.utils import DeepSpeedPlugin, set_seed

    set_seed(cfg.seed)
    output_dir = Path(cfg.output_dir)
    if cfg.deepspeed_config and not Path(cfg.deepspeed_config).is_file():
        raise MedusaError(f"DeepSpeed config `{cfg.deepspeed_config}` does not exist.")
    trackers = check_trackers(cfg.report_to)
    if cfg.deepspeed_config and "RANK" not in os.environ:
        # Not started by a launcher: one process, so set up the rendezvous a launcher would have.
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=os.environ.get("MASTER_PORT", str(free_port())))
    # Backbone (frozen), data and heads, made before the Accelerator: under ZeRO-3 anything built after it
    # is partitioned on construction, and the frozen backbone must stay whole. Every check that can fail
    # runs here, before any compute.
    backbone = load_backbone(cfg.model, dtype=cfg.backbone_dtype)
    tokenizer = load_tokenizer(cfg.model)
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
    draft_vocab, vocab_index = None, None
    if cfg.draft_vocab_size or cfg.draft_vocab_coverage:
        vocab = backbone.get_output_embeddings().weight.shape[0]
        draft_vocab, covered = frequent_tokens(train_set, vocab, cfg.draft_vocab_size, cfg.draft_vocab_coverage)
        vocab_index = torch.full((vocab,), -1, dtype=torch.long)
        vocab_index[draft_vocab] = torch.arange(draft_vocab.numel())
        logger.info("draft vocabulary: %d tokens cover %.2f%% of the training targets", draft_vocab.numel(),
                    100 * covered)
    heads = untrained_heads(backbone, cfg.model, cfg.num_heads, cfg.num_layers, cfg.share_lm_head,
                            head_type=cfg.head_type, draft_vocab=draft_vocab)
    heads = heads.to(torch.float32).train()
    # The heads train in fp32 (autocast for mixed precision); so do the frozen projection and embeddings they read.
    lm_head = heads.output_projection(copy.deepcopy(backbone.get_output_embeddings()).float().requires_grad_(False))
    reads_tokens = cfg.head_type in ("hydra", "eagle")
    embed = copy.deepcopy(backbone.get_input_embeddings()).float().requires_grad_(False) if reads_tokens else None
    forward = eagle_forward if cfg.head_type == "eagle" else heads_forward
    if cfg.medusa2:
        from peft import LoraConfig, get_peft_model

        lora = LoraConfig(r=cfg.lora_r, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout,
                          target_modules=[m.strip() for m in cfg.lora_target_modules.split(",")], task_type="CAUSAL_LM")
        backbone = get_peft_model(backbone, lora)

    # Accelerate (and DeepSpeed when configured), then optimizer and schedule.
    plugin = DeepSpeedPlugin(hf_ds_config=cfg.deepspeed_config) if cfg.deepspeed_config else None
    # cpu=True on a machine without an accelerator: only then does accelerate join launched processes over gloo
    # (MULTI_CPU); without it each process trains alone with world size 1.
    accelerator = Accelerator(mixed_precision=cfg.mixed_precision, deepspeed_plugin=plugin,
                              gradient_accumulation_steps=cfg.gradient_accumulation_steps,
                              cpu=plugin is None and not torch.accelerator.is_available(),
                              log_with=trackers, project_dir=str(output_dir))
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    if accelerator.num_processes != launched:
        raise MedusaError(f"The launcher started {launched} processes but accelerate joined "
                          f"{accelerator.num_processes}: each would train alone; see the README's training section.")
    if plugin is not None:
        # We feed batches ourselves (no DataLoader), so DeepSpeed's "auto" sizes are filled in here.
        ds = accelerator.state.deepspeed_plugin.deepspeed_config
        ds["train_micro_batch_size_per_gpu"] = cfg.batch_size
        ds["gradient_accumulation_steps"] = cfg.gradient_accumulation_steps
        ds["train_batch_size"] = cfg.batch_size * cfg.gradient_accumulation_steps * accelerator.num_processes
    logger.info("world size %d (process %d), device %s%s", accelerator.num_processes, accelerator.process_index,
                accelerator.device, f", DeepSpeed ZeRO-{plugin.zero_stage}" if plugin else "")
    backbone.to(accelerator.device)
    lm_head.to(accelerator.device)
    if embed is not None:
        embed.to(accelerator.device)
    if vocab_index is not None:
        vocab_index = vocab_index.to(accelerator.device)

    trainable = list(heads.parameters()) + [p for p in backbone.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=cfg.learning_rate, weight_decay=cfg.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: get_lr(s, cfg) / cfg.learning_rate)
    if cfg.medusa2:  # the adapters are trained state too: checkpoints must hold them
        heads, backbone, optimizer, scheduler = accelerator.prepare(heads, backbone, optimizer, scheduler)
    else:
        heads, optimizer, scheduler = accelerator.prepare(heads, optimizer, scheduler)
    raw_heads = accelerator.unwrap_model(heads)
    if cfg.report_to:
        accelerator.init_trackers("medusa-heads", config=asdict(cfg))

    # Hidden states: computed once per set (training, held-out) when the backbone is frozen.
    train_cache = held_cache = None
    if cfg.cache_hidden_states:
        start = time.perf_counter()
        folder = Path(cfg.hidden_cache_dir) if cfg.hidden_cache_dir else None
        train_cache = HiddenStateCache.build(backbone, cfg.model, train_set, cfg.batch_size, folder)
        if held_out:
            held_cache = HiddenStateCache.build(backbone, cfg.model, held_out, cfg.batch_size, folder)
        logger.info("hidden states ready in %.1f s", time.perf_counter() - start)

    def batch_inputs(examples: list, indices: list[int], cache: HiddenStateCache | None):
        ids, mask, attn = pad_batch([examples[i] for i in indices])
        hidden = cache.batch(indices) if cache else compute_hidden(backbone, ids, attn)
        dev = accelerator.device
        return hidden.to(dev), ids.to(dev), mask.to(dev)

    def medusa2_loss(indices: list[int], warm: bool):
        """Heads loss on the adapted backbone's hidden states, plus its KL to itself without adapters;
        during the warm-up (`warm`) the heads alone train."""
        ids, mask, attn = (t.to(accelerator.device) for t in pad_batch([train_set[i] for i in indices]))
        with torch.set_grad_enabled(not warm):
            student, hidden = backbone_forward(backbone, ids, None, attention_mask=attn)
        logits, targets, teachers = forward(heads, lm_head, embed, hidden, ids, mask, cfg, vocab_index)
        heads_total, per_head = heads_loss(logits, targets, cfg.decay, cfg.loss, teachers, cfg.loss_weighting,
                                           tree_paths)
        if warm:
            return heads_total, per_head, mask
        with torch.no_grad(), accelerator.unwrap_model(backbone).disable_adapter():
            teacher, _ = backbone_forward(backbone, ids, None, attention_mask=attn)
        return backbone_kl(student, teacher, mask) + cfg.heads_loss_weight * heads_total, per_head, mask

    @torch.no_grad()
    def evaluate() -> dict:
        heads.eval()
        hits = torch.zeros(cfg.num_heads, cfg.top_k, dtype=torch.long)
        counts = torch.zeros(cfg.num_heads, dtype=torch.long)
        steps = committed = 0
        for b in range(0, len(held_out), cfg.batch_size):
            idx = list(range(b, min(b + cfg.batch_size, len(held_out))))
            hidden, ids, mask = batch_inputs(held_out, idx, held_cache)
            with accelerator.autocast():
                logits, targets, _ = forward(raw_heads, lm_head, embed, hidden, ids, mask, cfg, vocab_index)
            h, c = rank_hits(logits, targets, cfg.top_k)
            hits += h
            counts += c
            if tree_paths is not None:
                roots = targets[0] != -100  # a step's root: the token after it is an answer token
                _, accepted = tree_walk(logits, targets, tree_paths)
                steps += int(roots.sum())
                committed += int(roots.sum()) + int(accepted[:, roots].sum())
        heads.train()
        per_rank = (hits.double() / counts.clamp(min=1)[:, None].double()).tolist()
        # `top_k`, `positions` and `hits` are also calibration counts: `tree optimize --calibration` reads them
        return {"num_heads": cfg.num_heads, "top_k": cfg.top_k, "positions": counts.tolist(), "hits": hits.tolist(),
                "per_rank": per_rank,  # [head][rank]: share of positions whose label sat at that rank
                "top1": [r[0] for r in per_rank], "top5": [sum(r[:5]) for r in per_rank],
                # greedy verification of `tree` replayed on the held-out answers: tokens per step
                **({"tree": cfg.tree, "tree_accepted_length": committed / max(steps, 1)} if tree_paths else {})}

    # Resume: weights, optimizer, scheduler and RNG from the last complete checkpoint; data position from step.
    step = 0
    if resume:
        last = latest_checkpoint(output_dir)
        if last is None:
            raise MedusaError(f"`--resume` found no checkpoint in `{output_dir}`.")
        accelerator.load_state(str(last))
        step = json.loads((last / "trainer.json").read_text())["step"]
        logger.info("resumed from %s at step %d", last, step)

    def save_checkpoint() -> None:
        # Written beside, then renamed: a kill leaves the previous checkpoint whole.
        final = output_dir / f"checkpoint-{step}"
        tmp = output_dir / f".tmp-checkpoint-{step}"
        shutil.rmtree(tmp, ignore_errors=True)
        accelerator.save_state(str(tmp))
        (tmp / "trainer.json").write_text(json.dumps({"step": step, "config": asdict(cfg)}, indent=1))
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        for old in sorted(output_dir.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))[:-2]:
            shutil.rmtree(old)

    # Each process takes its own micro-batches: rank r gets every world-size-th batch of the shared order.
    world, rank = accelerator.num_processes, accelerator.process_index
    per_epoch = max(len(batch_order(len(train_set), cfg.batch_size, 0, cfg.seed)) // world, 1)
    history, acc = [], None
    bar = tqdm(total=cfg.max_steps, initial=step, desc="train", unit="step", disable=not accelerator.is_main_process)
    tokens, t0 = 0, time.perf_counter()
    while step < cfg.max_steps:
        for micro in range(cfg.gradient_accumulation_steps):
            position = step * cfg.gradient_accumulation_steps + micro
            epoch, index = divmod(position, per_epoch)
            indices = batch_order(len(train_set), cfg.batch_size, epoch, cfg.seed)[index * world + rank]
            with accelerator.accumulate(heads), accelerator.autocast():
                if cfg.medusa2:
                    loss, per_head, mask = medusa2_loss(indices, warm=step < cfg.heads_warmup_steps)
                else:
                    hidden, ids, mask = batch_inputs(train_set, indices, train_cache)
                    logits, targets, teachers = forward(heads, lm_head, embed, hidden, ids, mask, cfg, vocab_index)
                    loss, per_head = heads_loss(logits, targets, cfg.decay, cfg.loss, teachers,
                                                cfg.loss_weighting, tree_paths)
                if not torch.isfinite(loss):
                    last = latest_checkpoint(output_dir)
                    raise MedusaError(f"The loss became {loss.item()} at step {step}; stopped. The last good "
                                      f"checkpoint is {last or 'none (none was written yet)'}.")
                accelerator.backward(loss)
                if accelerator.sync_gradients and cfg.grad_clip > 0:
                    accelerator.clip_grad_norm_(trainable, cfg.grad_clip)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            tokens += int(mask.sum())
        step += 1
        history.append({"step": step, "loss": loss.item(), "per_head": [x.item() for x in per_head]})
        bar.update(1)
        if step % cfg.log_every == 0 or step == cfg.max_steps:
            rate = tokens / (time.perf_counter() - t0)
            bar.set_postfix(loss=f"{loss.item():.3f}", tok_s=f"{rate:.0f}")
            logger.info("step %d loss %.4f per head %s lr %.2e %.0f tokens/s", step, loss.item(),
                        " ".join(f"{float(x):.3f}" for x in per_head), scheduler.get_last_lr()[0], rate)
            if cfg.report_to:
                accelerator.log({"loss": loss.item(), **{f"loss_head{j + 1}": float(x) for j, x in
                                                          enumerate(per_head)}}, step=step)
        if held_out and (step % cfg.eval_every == 0 or step == cfg.max_steps):
            acc = evaluate()
            history[-1]["held_out_top1"] = acc["top1"]
            logger.info("held-out top-1 per head %s, top-5 %s%s", " ".join(f"{a:.3f}" for a in acc["top1"]),
                        " ".join(f"{a:.3f}" for a in acc["top5"]),
                        f", accepted length on {cfg.tree} {acc['tree_accepted_length']:.3f}" if cfg.tree else "")
            if cfg.report_to:
                accelerator.log({f"held_out_top1_head{j + 1}": a for j, a in enumerate(acc["top1"])}, step=step)
        if step % cfg.checkpoint_every == 0 and accelerator.is_main_process:
            save_checkpoint()
    bar.close()

    accelerator.wait_for_everyone()
    result = {"history": history, "train_tokens_per_second": tokens / (time.perf_counter() - t0)}
    state_dict = accelerator.get_state_dict(heads)  # gathered from all ranks under ZeRO-3; every rank takes part
    if accelerator.is_main_process:
        final = output_dir / "heads"
        if cfg.medusa2:
            raw_heads.config.base_model_adapter = "adapter"
            accelerator.unwrap_model(backbone).save_pretrained(final / "adapter")  # the adapter weights only
        raw_heads.save_pretrained(final, state_dict=state_dict)
        if held_out:
            result["accuracies"] = acc if acc is not None else evaluate()  # the last step's, when it ran
            (final / "head_accuracies.json").write_text(json.dumps(result["accuracies"], indent=1))
        (output_dir / "history.json").write_text(json.dumps(history))
        logger.info("saved heads to %s", final)
    accelerator.end_training()
    return result
