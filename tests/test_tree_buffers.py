import torch

from medusa_heads.tree import build_tree


def test_hand_worked_tree():
    #            root(0)
    #        /            \
    #     [0](1)          [1](2)
    #    /      \            \
    # [0,0](3) [0,1](4)    [1,0](5)
    #   |
    # [0,0,0](6)
    tree = build_tree([[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]])
    assert tree.size == 7 and tree.max_depth == 3 and tree.top_k == 2
    assert tree.depth.tolist() == [0, 1, 1, 2, 2, 2, 3]
    assert tree.parent.tolist() == [-1, 0, 0, 1, 1, 2, 3]
    assert tree.head.tolist()[1:] == [0, 0, 1, 1, 1, 2]
    assert tree.rank.tolist()[1:] == [0, 1, 0, 1, 0, 0]
    expected_mask = torch.tensor(
        [
            [1, 0, 0, 0, 0, 0, 0],
            [1, 1, 0, 0, 0, 0, 0],
            [1, 0, 1, 0, 0, 0, 0],
            [1, 1, 0, 1, 0, 0, 0],
            [1, 1, 0, 0, 1, 0, 0],
            [1, 0, 1, 0, 0, 1, 0],
            [1, 1, 0, 1, 0, 0, 1],
        ],
        dtype=torch.bool,
    )
    assert torch.equal(tree.mask, expected_mask)
    # Leaves [0,1], [1,0], [0,0,0] in canonical order, root first, padded with 0 / invalid.
    assert tree.retrieve.tolist() == [[0, 1, 4, 0], [0, 2, 5, 0], [0, 1, 3, 6]]
    assert tree.retrieve_valid.tolist() == [[True, True, True, False], [True, True, True, False], [True] * 4]
    assert tree.internal.tolist() == [0, 1, 2, 3]  # the nodes with children
    assert build_tree([[0]]).internal.tolist() == [0]


def test_buffers_are_built_once_per_tree_and_device():
    assert build_tree([[0], [0, 0]]) is build_tree([(0,), (0, 0)])
    assert build_tree([[0], [0, 0]]) is not build_tree([[0], [1]])
