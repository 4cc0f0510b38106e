import math

import torch

from medusa_heads.training.losses import head_targets, head_weights, heads_loss, rank_hits


def test_targets_by_hand():
    ids = torch.tensor([[10, 11, 12, 13, 14, 15]])
    mask = torch.tensor([[0, 0, 1, 1, 1, 1]])  # two prompt tokens, four assistant tokens
    labels, teacher = head_targets(ids, mask, num_heads=2)
    # head 1 at t predicts ids[t + 2]; head 2 predicts ids[t + 3]
    assert labels[0, 0].tolist() == [12, 13, 14, 15, -100, -100]
    assert labels[1, 0].tolist() == [13, 14, 15, -100, -100, -100]
    # soft targets come from the backbone position that predicts the label: t + k
    assert teacher[0, 0, :4].tolist() == [1, 2, 3, 4]
    assert teacher[1, 0, :3].tolist() == [2, 3, 4]
    mask = torch.tensor([[0, 0, 0, 1, 0, 1]])
    labels, _ = head_targets(ids, mask, num_heads=2)
    assert labels[0, 0].tolist() == [-100, 13, -100, 15, -100, -100]


def test_decay_weights_and_loss():
    assert head_weights(3, 0.8) == [0.8, 0.8 ** 2, 0.8 ** 3]
    V = 5
    logits = [torch.zeros(2, V), torch.zeros(1, V)]
    labels = [torch.tensor([1, 2]), torch.tensor([3])]
    total, per_head = heads_loss(logits, labels, decay=0.5)
    assert torch.allclose(per_head[0], torch.tensor(math.log(V)))
    assert torch.allclose(total, torch.tensor(math.log(V) * (0.5 + 0.25)))
    teacher = [torch.randn(2, V), torch.randn(1, V)]
    _, kl = heads_loss(teacher, labels, kind="kl", teacher_logits=teacher)
    assert all(abs(float(x)) < 1e-6 for x in kl)
    _, kl = heads_loss(logits, labels, kind="kl", teacher_logits=teacher)
    assert all(float(x) > 0 for x in kl)


def test_rank_hits():
    logits = [torch.tensor([[0.0, 3.0, 2.0, 1.0], [5.0, 0.0, 0.0, 1.0]])]
    hits, counts = rank_hits(logits, [torch.tensor([2, 0])], top_k=3)
    assert hits.tolist() == [[1, 1, 0]] and counts.tolist() == [2]


def test_backbone_kl_counts_only_positions_predicting_assistant_tokens():
    from medusa_heads.training.losses import backbone_kl

    teacher = torch.randn(1, 4, 6)
    student = teacher.clone()
    mask = torch.tensor([[0, 0, 1, 1]])  # positions 1 and 2 predict assistant tokens
    assert float(backbone_kl(student, teacher, mask)) < 1e-6
    student[0, 0] += torch.randn(6) * 5  # position 0 predicts a prompt token: ignored
    student[0, 3] += torch.randn(6) * 5  # the last position predicts nothing: ignored
    assert float(backbone_kl(student, teacher, mask)) < 1e-6
    student[0, 1] += torch.randn(6) * 5
    assert float(backbone_kl(student, teacher, mask)) > 0.01


def test_acceptance_weighting_discounts_heads_after_a_miss():
    V = 4
    sure = torch.full((2, V), -30.0)
    sure[0, 1] = sure[1, 2] = 30.0  # head 1 is certain: right at position 0, wrong at position 1
    labels = [torch.tensor([1, 3]), torch.tensor([0, 0])]
    second = torch.zeros(2, V, requires_grad=True)
    total, per_head = heads_loss([sure, second], labels, weighting="acceptance")
    total.backward()
    # head 2's loss counts at position 0 only (head 1 was right there, surely wrong at position 1)
    assert second.grad[0].abs().sum() > 0 and second.grad[1].abs().sum() < 1e-6
    assert torch.allclose(per_head[1], torch.tensor(math.log(V)))


def test_labels_outside_the_draft_vocabulary_are_misses_not_losses():
    from medusa_heads.training.losses import draft_labels

    vocab_index = torch.tensor([-1, 0, -1, 1])  # draft vocabulary: tokens 1 and 3
    labels = draft_labels(torch.tensor([3, 2, -100]), vocab_index)
    assert labels.tolist() == [1, -1, -100]
    logits = torch.tensor([[0.0, 5.0], [5.0, 0.0], [5.0, 0.0]])
    hits, counts = rank_hits([logits], [labels], top_k=2)
    assert hits.tolist() == [[1, 0]] and counts.tolist() == [2]
    _, per_head = heads_loss([logits], [labels])
    assert torch.allclose(per_head[0], torch.log1p(torch.exp(torch.tensor(-5.0))))
