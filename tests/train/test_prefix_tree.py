"""The prefix tree of a batch's prompts, by hand: which segments are shared, which prompts end
where, when a short shared segment is folded into its branches, and how a depth's nodes are
grouped for their forwards. (That its prefill computes what whole prompts compute is
tests/train/test_decoding.py's.)"""

from __future__ import annotations

import pytest

from clbench.train import decoding
from clbench.train.prefix_tree import Node, node_groups, prefix_tree


def _shape(nodes: list[Node]) -> list[tuple[int, int, int, list[int]]]:
    """(depth, start, stop, ends) of each node, in the tree's order."""
    return [(n.depth, n.start, n.stop, n.ends) for n in nodes]


def test_shared_segments_are_nodes_and_repeated_prompts_end_together() -> None:
    prompts = [[1, 2, 3, 4], [1, 2, 5], [1, 2, 3, 4], [9]]
    tree = prefix_tree(prompts, min_shared=2)
    assert _shape(tree) == [
        (0, 0, 2, []),         # [1, 2], shared by prompts 0-2
        (0, 0, 1, [3]),        # [9]: prompt 3 alone (nothing shared at the root)
        (1, 2, 4, [0, 2]),     # [3, 4]: prompts 0 and 2 are the same prompt
        (1, 2, 3, [1]),        # [5]
    ]
    assert sum(n.length for n in tree) == 6  # of 12 prompt tokens
    shared = tree[0]
    assert [n.parent for n in tree] == [None, None, shared, shared]
    assert tree[2].path() == [shared, tree[2]]


def test_a_shared_segment_shorter_than_min_shared_is_computed_with_each_branch() -> None:
    prompts = [[1, 2, 3, 4, 5], [1, 2, 3, 6, 7], [1, 2]]
    # [1, 2] is shared by all three, [1, 2, 3] by two; at min_shared 3 only the second is a node
    tree = prefix_tree(prompts, min_shared=3)
    assert _shape(tree) == [(0, 0, 2, [2]), (0, 0, 3, []), (1, 3, 5, [0]), (1, 3, 5, [1])]
    # at 2 the root segment is a node, the one token after it still folded into each branch
    assert _shape(prefix_tree(prompts, min_shared=2)) == [
        (0, 0, 2, [2]), (1, 2, 5, [0]), (1, 2, 5, [1])]
    # at 1 both are: nested nodes
    assert _shape(prefix_tree(prompts, min_shared=1)) == [
        (0, 0, 2, [2]), (1, 2, 3, []), (2, 3, 5, [0]), (2, 3, 5, [1])]
    # past every prompt's length: each prompt whole, as without a tree
    assert _shape(prefix_tree(prompts, min_shared=99)) == [
        (0, 0, 2, [2]), (0, 0, 5, [0]), (0, 0, 5, [1])]


def test_no_node_is_empty_whatever_min_shared() -> None:
    prompts = [[1, 2, 3], [4, 5], [1, 2, 6]]
    for min_shared in (0, 1):
        tree = prefix_tree(prompts, min_shared)
        assert all(n.length > 0 for n in tree)
        assert sorted(r for n in tree for r in n.ends) == [0, 1, 2]
        for n in tree:  # each prompt's path spells it
            for r in n.ends:
                assert [t for m in n.path() for t in prompts[m.row][m.start:m.stop]] == prompts[r]


def test_a_depths_nodes_are_grouped_within_the_token_budget_and_by_length(monkeypatch) -> None:
    monkeypatch.setattr(decoding, "PREFILL_TOKENS", 100)
    monkeypatch.setattr(decoding, "PREFILL_FILL", 0.5)
    level = [Node(row=i, start=0, stop=length, parent=None)
             for i, length in enumerate([10, 40, 30, 18, 25, 12])]
    groups = [[n.length for n in group] for group in node_groups(level)]
    # longest first; a third node beside 40 would make 3 x 40 = 120 > 100 tokens; 12 is less
    # than half of 25
    assert groups == [[40, 30], [25, 18], [12, 10]]


@pytest.mark.parametrize("fill", [0.0, 0.9])
def test_every_node_is_in_exactly_one_group(monkeypatch, fill: float) -> None:
    monkeypatch.setattr(decoding, "PREFILL_FILL", fill)
    level = [Node(row=i, start=0, stop=1 + (i * 37) % 200, parent=None) for i in range(60)]
    groups = node_groups(level)
    assert sorted(n.row for g in groups for n in g) == list(range(60))
    assert all(len(g) * g[0].length <= decoding.PREFILL_TOKENS or len(g) == 1 for g in groups)
    assert all(n.length >= fill * g[0].length for g in groups for n in g)
