"""The heads' objective. Head k (k = 1..K) at position t predicts the token at t + k + 1."""

import torch
import torch.nn.functional as F


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


def head_weights(num_heads: int, decay: float) -> list[float]:
    """decay ** k for heads k = 1..K."""
    return [decay ** (j + 1) for j in range(num_heads)]


def heads_loss(logits: list[torch.Tensor], labels: list[torch.Tensor], decay: float = 0.8, kind: str = "ce",
               teacher_logits: list[torch.Tensor] | None = None) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Per head j: logits [N_j, V] at its labelled positions, labels [N_j] -> (weighted total, per-head losses).

    `kind="kl"` matches the backbone's own distribution instead, teacher_logits[j]: [N_j, V].
    """
    per_head = []
    for j, (lg, lb) in enumerate(zip(logits, labels)):
        if lb.numel() == 0:
            per_head.append(lg.sum() * 0.0)
        elif kind == "ce":
            per_head.append(F.cross_entropy(lg.float(), lb))
        elif kind == "kl":
            per_head.append(F.kl_div(F.log_softmax(lg.float(), -1), F.log_softmax(teacher_logits[j].float(), -1),
                                     log_target=True, reduction="batchmean"))
        else:
            raise ValueError(f"Unknown loss `{kind}`; use ce or kl.")
    total = sum(w * l for w, l in zip(head_weights(len(per_head), decay), per_head))
    return total, per_head


@torch.no_grad()
def rank_hits(logits: list[torch.Tensor], labels: list[torch.Tensor], top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (hits [K, top_k]: how often the label sat at each rank, counts [K]: labelled positions per head)."""
    hits = torch.zeros(len(logits), top_k, dtype=torch.long)
    counts = torch.zeros(len(logits), dtype=torch.long)
    for j, (lg, lb) in enumerate(zip(logits, labels)):
        if lb.numel():
            top = lg.topk(top_k, dim=-1).indices  # [N, top_k]
            hits[j] += (top == lb[:, None]).sum(dim=0).cpu()
            counts[j] += lb.numel()
    return hits, counts


def backbone_kl(student_logits: torch.Tensor, teacher_logits: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """Medusa-2's backbone loss: KL(teacher || student) at the positions that predict an assistant token.

    student_logits, teacher_logits: [B, T, V]; loss_mask: [B, T].
    """
    predicts = loss_mask[:, 1:].bool()  # position t predicts token t + 1
    student = student_logits[:, :-1][predicts].float()
    teacher = teacher_logits[:, :-1][predicts].float()
    return F.kl_div(F.log_softmax(student, -1), F.log_softmax(teacher, -1), log_target=True, reduction="batchmean")
