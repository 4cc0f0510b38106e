"""The heads' objective. Head k (k = 1..K) at position t predicts the token at t + k + 1."""

import torch
import torch.nn.functional as F

from medusa_heads.tree import build_tree


def head_targets(input_ids: torch.Tensor, loss_mask: torch.Tensor, num_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """input_ids, loss_mask: [B, T] -> labels [K, B, T] (-100 where not trained) and teacher positions [K, B, T].

    Head k's label at t is input_ids[t + k + 1], kept only where that token is an assistant token. Its soft
    target (self-distillation) is the backbone's distribution at t + k, the position that predicts that token.
    """
    B, T = input_ids.shape
    labels = torch.full((num_heads, B, T), -100, dtype=torch.long, device=input_ids.device)
    teacher_pos = torch.zeros((num_heads, B, T), dtype=torch.long, device=input_ids.device)
    for j in range(num_heads):  # j = k - 1
        shift = j + 2
        if shift >= T:
            continue
        target = input_ids[:, shift:]
        keep = loss_mask[:, shift:].bool()
        labels[j, :, : T - shift] = torch.where(keep, target, torch.full_like(target, -100))
        teacher_pos[j, :, : T - shift] = torch.arange(j + 1, T - 1, device=input_ids.device)
    return labels, teacher_pos


def follow_embeddings(embed: torch.nn.Module, input_ids: torch.Tensor, n: int) -> torch.Tensor:
    """[B, T] -> [B, T, n, H]: at t, the embeddings of tokens t + 1 .. t + n (zeros past the end), what Hydra
    head j reads (its first j + 1) when teacher-forced with the sequence's own tokens."""
    e = embed(input_ids)  # [B, T, H]
    return torch.stack([F.pad(e[:, i:], (0, 0, 0, i)) for i in range(1, n + 1)], dim=2)


def draft_labels(labels: torch.Tensor, vocab_index: torch.Tensor | None) -> torch.Tensor:
    """Token-id labels -> indices into the heads' draft vocabulary: -1 where the token is outside it (a sure
    miss), -100 kept where there is no label."""
    if vocab_index is None:
        return labels
    return torch.where(labels >= 0, vocab_index[labels.clamp(min=0)], labels)


@torch.no_grad()
def tree_walk(logits: list[torch.Tensor], labels: list[torch.Tensor],
              paths: tuple) -> tuple[torch.Tensor, torch.Tensor]:
    r"""
    Greedy verification of a static tree replayed on the true path. Per head j (depth j + 1): logits [N, V] and
    labels [N] (-1 or -100: no right guess). Returns (tried [K, N], accepted [K, N]) bool: whether the tree
    drafts depth j + 1 below the true path (every depth above was accepted and that node has children), and
    whether the head's guess there was right and within the node's children. The step's accepted length is
    1 + accepted.sum(0).
    """
    device = logits[0].device
    tree = build_tree(paths, device)
    top_k, off = tree.top_k, tree.size  # `off`: a node id for "off the tree", without children
    child = torch.full((off + 1, top_k), off, dtype=torch.long, device=device)  # [parent, rank] -> node
    child[tree.parent[1:], tree.rank[1:]] = torch.arange(1, off, device=device)
    node = torch.zeros(labels[0].shape[0], dtype=torch.long, device=device)
    tried, accepted = [], []
    for lg, lb in zip(logits, labels):
        tried.append(child[node, 0] != off)
        rank = (lg > lg.gather(-1, lb.clamp(min=0)[:, None])).sum(-1)  # the label's rank among the guesses
        node = torch.where((lb < 0) | (rank >= top_k), off, child[node, rank.clamp(max=top_k - 1)])
        accepted.append(node != off)
    return torch.stack(tried), torch.stack(accepted)


def decoded_steps(roots: torch.Tensor, lengths: torch.Tensor) -> tuple[int, int]:
    r"""
    Greedy tree decoding replayed on known answers -> (tokens committed, steps).

    `roots` [B, T]: the positions a step can start from (the token two ahead is an answer token); `lengths`: the
    tokens a step from each of them commits (1 + the accepted depth, `tree_walk`), in row-major order. A run of
    consecutive roots is one answer: its first token comes from the prefill, so decoding starts at the run's
    second root and each step moves on by what it committed. The mean of `lengths` over all roots would count
    every position of an easy stretch, which decoding crosses in a few long steps, and overstate tokens per step.
    """
    tokens = steps = 0
    lengths = lengths.tolist()
    done = 0
    for positions in (row.nonzero().flatten().tolist() for row in roots):
        breaks = [i for i in range(1, len(positions)) if positions[i] != positions[i - 1] + 1]
        for start, end in zip([0] + breaks, breaks + [len(positions)]):
            run, t = lengths[done + start : done + end], 1
            while t < len(run):
                steps += 1
                t += run[t]
            tokens += len(run) - 1
        done += len(positions)
    return tokens, steps


def heads_loss(logits: list[torch.Tensor], labels: list[torch.Tensor], decay: float = 0.8, kind: str = "ce",
               teacher_logits: list[torch.Tensor] | None = None, weighting: str = "decay",
               tree_paths: tuple | None = None) -> tuple[torch.Tensor, list[torch.Tensor]]:
    r"""
    Per head j: logits [N, V] and labels [N] at the same N positions (-100: head j has no label there, -1: its
    label is outside the draft vocabulary) -> (weighted total, per-head mean losses).

    `kind="kl"` matches the backbone's own distribution instead, teacher_logits[j]: [N, V].
    `weighting="decay"` weighs head k by decay ** k. `weighting="acceptance"` weighs head k's loss at each
    position by the probability (under the heads, not differentiated) that heads 1..k-1 guessed their tokens
    there: a head's guess only counts when the path before it was accepted. `weighting="tree"` is the
    negative log-probability, under the heads, of the true path's tokens as far as the tree `tree_paths` would
    draft them: head k's loss counts where greedy verification of that tree, replayed with the heads' current
    ranks (`tree_walk`), reaches depth k below the true path, and nowhere else.
    """
    per_head, totals = [], []
    if weighting == "tree":
        if tree_paths is None:
            raise ValueError("`weighting=\"tree\"` needs the tree's paths (`tree_paths`).")
        tried, _ = tree_walk(logits, labels, tree_paths)
    reached = None  # [N] probability that the heads before this one were right
    for j, (lg, lb) in enumerate(zip(logits, labels)):
        logp = F.log_softmax(lg.float(), -1)
        if kind == "ce":
            loss = -logp.gather(-1, lb.clamp(min=0)[:, None])[:, 0]
            keep = lb >= 0
        elif kind == "kl":
            loss = F.kl_div(logp, F.log_softmax(teacher_logits[j].float(), -1), log_target=True,
                            reduction="none").sum(-1)
            keep = lb != -100
        else:
            raise ValueError(f"Unknown loss `{kind}`; use ce or kl.")
        n = keep.sum().clamp(min=1)
        loss = torch.where(keep, loss, 0.0)
        per_head.append(loss.sum() / n)
        if weighting == "acceptance":
            weight = reached if reached is not None else torch.ones_like(loss)
            totals.append((weight * loss).sum() / n)
            with torch.no_grad():
                right = torch.where(lb >= 0, logp.gather(-1, lb.clamp(min=0)[:, None])[:, 0].exp(), 0.0)
                weight = weight * torch.where(lb == -100, 1.0, right)
            reached = weight
        elif weighting == "decay":
            totals.append(decay ** (j + 1) * per_head[-1])
        elif weighting == "tree":
            totals.append((tried[j] * loss).sum() / n)
        else:
            raise ValueError(f"Unknown weighting `{weighting}`; use decay, acceptance or tree.")
    return sum(totals), per_head


@torch.no_grad()
def rank_hits(logits: list[torch.Tensor], labels: list[torch.Tensor], top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (hits [K, top_k]: how often the label sat at each rank, counts [K]: labelled positions per head).
    Labels -100 are not counted; -1 (outside the draft vocabulary) count as misses."""
    hits = torch.zeros(len(logits), top_k, dtype=torch.long)
    counts = torch.zeros(len(logits), dtype=torch.long)
    for j, (lg, lb) in enumerate(zip(logits, labels)):
        keep = lb != -100
        if keep.any():
            top = lg[keep].topk(top_k, dim=-1).indices  # [N, top_k]
            hits[j] += (top == lb[keep][:, None]).sum(dim=0).cpu()
            counts[j] += int(keep.sum())
    return hits, counts


def walk_hits_counts(logits: list[torch.Tensor], labels: list[torch.Tensor],
                     top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Calibration counts from logits aligned per drafting step (entry i of every head is one step): -> (hits
    [K, top_k], counts [K]), head j counted only where every earlier head had its label within its top_k (the
    walk of `medusa_heads.apps.calibrate`). Labels -100 end a walk uncounted; -1 (outside the draft vocabulary)
    count as misses."""
    hits = torch.zeros(len(logits), top_k, dtype=torch.long)
    counts = torch.zeros(len(logits), dtype=torch.long)
    alive = torch.ones(labels[0].shape[0], dtype=torch.bool, device=labels[0].device)
    for j, (lg, lb) in enumerate(zip(logits, labels)):
        alive &= lb != -100
        rank = (lg > lg.gather(-1, lb.clamp(min=0)[:, None])).sum(-1).masked_fill(lb < 0, top_k)
        counts[j] += int(alive.sum())
        hits[j] += torch.bincount(rank[alive & (rank < top_k)], minlength=top_k)[:top_k].cpu()
        alive &= rank < top_k
    return hits, counts


def backbone_kl(student_logits: torch.Tensor, teacher_logits: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """Medusa-2's backbone loss: KL(teacher || student) at the positions that predict an assistant token.

    student_logits, teacher_logits: [B, T, V]; loss_mask: [B, T].
    """
    predicts = loss_mask[:, 1:].bool()  # position t predicts token t + 1
    student = student_logits[:, :-1][predicts].float()
    teacher = teacher_logits[:, :-1][predicts].float()
    return F.kl_div(F.log_softmax(student, -1), F.log_softmax(teacher, -1), log_target=True, reduction="batchmean")
