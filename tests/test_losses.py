import itertools
import math

import pytest
import torch

from medusa_heads.inference.acceptance import GreedyAcceptance
from medusa_heads.inference.draft import Draft
from medusa_heads.training.losses import decoded_steps, head_targets, heads_loss, rank_hits, tree_walk, walk_hits_counts
from medusa_heads.tree import build_tree, load_tree


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
    V = 5
    logits = [torch.zeros(2, V), torch.zeros(1, V)]
    labels = [torch.tensor([1, 2]), torch.tensor([3])]
    total, per_head = heads_loss(logits, labels, decay=0.5)
    assert torch.allclose(per_head[0], torch.tensor(math.log(V)))
    assert torch.allclose(total, torch.tensor(math.log(V) * (0.5 + 0.25)))
    # head k weighs decay ** k: three heads with per-head losses 1, 2 and 3 (logits making p(label) = e^-k)
    three = [torch.tensor([[0.0, -float(k)]]) for k in (1, 2, 3)]
    total, per_head = heads_loss(three, [torch.tensor([1])] * 3, decay=0.8)
    expected = [-math.log(math.exp(-k) / (1 + math.exp(-k))) for k in (1, 2, 3)]
    assert [float(x) for x in per_head] == pytest.approx(expected)
    assert float(total) == pytest.approx(sum(0.8 ** k * x for k, x in zip((1, 2, 3), expected)))
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


def test_tree_walk_replays_greedy_verification():
    """Against the runtime's own acceptance: each position's heads fill the tree with their top-k, a backbone
    whose argmax is the true path's next token verifies it; the accepted depth must be what `tree_walk` says."""
    torch.manual_seed(0)
    tree = build_tree(load_tree("cpu-16"))
    K, N, V = tree.max_depth, 300, 6  # a small vocabulary: labels often sit at ranks the tree holds
    logits = [torch.randn(N, V) for _ in range(K)]
    labels = [torch.randint(0, V, (N,)) for _ in range(K)]
    labels[2][:20] = -1  # outside the draft vocabulary: never accepted
    tried, accepted = tree_walk(logits, labels, tree.paths)
    for i in range(N):
        top = [lg[i].topk(V).indices for lg in logits]
        tokens = torch.tensor([0] + [int(top[len(p) - 1][p[-1]]) for p in tree.paths])
        truth = [max(int(lb[i]), 0) if lb[i] >= 0 else V for lb in labels]  # V: a token no head drafts
        verify = torch.nn.functional.one_hot(torch.tensor([truth[min(int(d), K - 1)] for d in tree.depth]), V + 1)
        depth = GreedyAcceptance().accept(Draft(tree, tokens), verify.float()).depth
        assert int(accepted[:, i].sum()) == depth, i
        assert accepted[:depth, i].all()
    assert tried[0].all() and (accepted <= tried).all() and (tried[1:] <= accepted[:-1]).all()
    assert not tried[1:][accepted[:-1]].all()  # an accepted leaf: the tree drafts nothing below it
    assert 0 < accepted[0].float().mean() < 1 and accepted[1].any()  # both outcomes happen


def test_tree_weighting_counts_only_where_the_tree_drafts():
    logits = [torch.tensor([[2.0, 1.0, 0.0]] * 2), torch.zeros(2, 3)]
    labels = [torch.tensor([0, 2]), torch.tensor([1, 1])]  # position 1: head 1's label is outside the chain
    total, per_head = heads_loss(logits, labels, weighting="tree", tree_paths=((0,), (0, 0)))
    first = -torch.log_softmax(logits[0], -1)[[0, 1], [0, 2]]
    assert torch.allclose(total, first.mean() + math.log(3) / 2)  # head 2 counts at position 0 only
    assert torch.allclose(per_head[1], torch.tensor(math.log(3)))


def test_walk_counts_are_the_complete_tree_walk():
    """Head j is counted where every earlier head's label was within the top-k, which is where the complete
    top-k-ary tree drafts depth j + 1 below the true path (`tree_walk`); its hits are the label's ranks there."""
    torch.manual_seed(1)
    K, N, V, top_k = 3, 400, 5, 2
    logits = [torch.randn(N, V) for _ in range(K)]
    labels = [torch.randint(0, V, (N,)) for _ in range(K)]
    labels[1][:30] = -1  # outside the draft vocabulary: a miss
    labels[2][30:60] = -100  # past the answer: the walk ends uncounted
    hits, counts = walk_hits_counts(logits, labels, top_k)
    complete = [p for d in range(1, K + 1) for p in itertools.product(range(top_k), repeat=d)]
    tried, accepted = tree_walk(logits, labels, tuple(complete))
    scored = torch.stack([lb != -100 for lb in labels])
    assert counts.tolist() == (tried & scored).sum(1).tolist()
    assert hits.sum(1).tolist() == accepted.sum(1).tolist()
    for j in range(K):
        ranks = [int((logits[j][i] > logits[j][i, labels[j][i]]).sum()) for i in range(N) if accepted[j, i]]
        assert hits[j].tolist() == [ranks.count(r) for r in range(top_k)]
    assert counts[0] == N and counts[2] < counts[1] < counts[0]


def test_decoded_steps_by_hand():
    """Two rows: one answer of 5 roots, one of two answers (3 and 2 roots). Each answer's first root is the prefill's
    token; steps start at the second and jump ahead by what they commit."""
    roots = torch.zeros(2, 10, dtype=torch.bool)
    roots[0, 2:7] = True
    roots[1, 1:4] = True
    roots[1, 6:8] = True
    lengths = torch.tensor([9, 3, 9, 9, 1, 9, 2, 9, 9, 1])
    # row 0: steps at roots 1 (3 tokens) and 4 (1); row 1, first answer: root 1 (2); second answer: root 1 (1)
    assert decoded_steps(roots, lengths) == (4 + 2 + 1, 4)
