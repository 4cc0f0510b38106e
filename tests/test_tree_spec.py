import json

import pytest

from medusa_heads import MedusaError
from medusa_heads.tree import build_tree, load_tree, tree_names, validate_tree


def test_canonical_order_is_by_depth_then_ranks():
    assert validate_tree([[1, 0], [0], [0, 0], [1]]) == ((0,), (1,), (0, 0), (1, 0))


@pytest.mark.parametrize(
    "paths, message",
    [
        ([], "non-empty list"),
        ([[0], [0]], "appears twice"),
        ([[0], [0, 1, 0]], "has no parent"),
        ([[0], [-1]], "negative rank"),
        ([[0], ["a"]], "integer ranks"),
        ([[0], []], "integer ranks"),
        ("[[0]]", "non-empty list"),
    ],
)
def test_broken_trees_are_rejected(paths, message):
    with pytest.raises(MedusaError, match=message):
        validate_tree(paths)


def test_depth_and_top_k_limits():
    with pytest.raises(MedusaError, match="only 1 heads"):
        validate_tree([[0], [0, 0]], num_heads=1)
    with pytest.raises(MedusaError, match="top 2"):
        validate_tree([[0], [2]], top_k=2)
    assert validate_tree([[0], [1]], num_heads=1, top_k=2) == ((0,), (1,))


def test_shipped_trees_are_valid_and_sized():
    names = tree_names()
    assert {"cpu-8", "cpu-16", "medusa-63", "chain-4"} <= set(names)
    sizes = {name: len(load_tree(name)) for name in names}
    assert sizes["medusa-63"] == 63 and sizes["cpu-8"] == 8 and sizes["cpu-16"] == 16
    for name in names:
        assert build_tree(load_tree(name)).max_depth <= 4


def test_load_tree_file_forms_and_errors(tmp_path):
    plain = tmp_path / "plain.json"
    plain.write_text("[[0], [0, 0]]")
    wrapped = tmp_path / "wrapped.json"
    wrapped.write_text(json.dumps({"paths": [[0], [0, 0]], "expected_accepted_length": 1.5}))
    assert load_tree(plain) == load_tree(wrapped) == ((0,), (0, 0))
    broken = tmp_path / "broken.json"
    broken.write_text("[[0], [0, 0")
    with pytest.raises(MedusaError, match="not valid JSON"):
        load_tree(broken)
    with pytest.raises(MedusaError, match="does not exist"):
        load_tree(tmp_path / "missing.json")
    with pytest.raises(MedusaError, match="Unknown tree"):
        load_tree("no-such-tree")
