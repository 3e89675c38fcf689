"""The prefill of a batch's prompts as a tree of the prefixes they share.

A column's prompts share far more than the leading tokens common to all of them: the chat
template and instructions, and then, among the items of a tool-use column, the listing of
the same functions, the same worked example; among math items, the same words up to the
numbers. Laid out as a tree (a compressed trie of token ids), the starter's columns hold 20-40%
of their prompt tokens (tool use 21,000 of 51,000; math 2,600 of 11,400). :func:`prefill_tree`
computes each node of the tree once: a node's tokens attend to its ancestors' keys and values,
which are copied in as the node's past. Nodes of one depth are prefilled together, in groups of
at most :data:`clbench.train.decoding.PREFILL_TOKENS` tokens (rows x the group's longest
segment) and of similar length (:func:`node_groups`), each segment padded on the right; the
batch's cache is then each prompt's path of
segments, left-padded as the batch is, and each prompt's next-token logits are those of the
node where it ends.

A shared segment shorter than :data:`clbench.train.decoding.SHARED_PREFIX_TOKENS` is not a node
of its own: it is computed with each branch below it, which costs less than a forward of its
own. Keys and values are the model's at each position whatever the tree (positions count from
the prompt's start; in fp32 the logits and the cache are those of whole prompts,
tests/train/test_decoding.py); in bf16 a token's numbers depend on which rows share its
forward, as in any batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from clbench.train import decoding

if TYPE_CHECKING:
    import torch


@dataclass(eq=False)
class Node:
    """Tokens `start:stop` of the prompts below it (read from prompt `row`), computed on top of
    its `parent`'s path; `ends`: the prompts that end with this node (several where prompts
    repeat)."""

    row: int
    start: int
    stop: int
    parent: Node | None
    ends: list[int] = field(default_factory=list)
    depth: int = 0
    keys: list[Any] = field(default_factory=list)     # per layer: (kv heads, tokens, dim)
    values: list[Any] = field(default_factory=list)
    logits: Any = None

    @property
    def length(self) -> int:
        return self.stop - self.start

    def path(self) -> list[Node]:
        """The nodes from the root down to this one."""
        nodes, node = [], self
        while node is not None:
            nodes.append(node)
            node = node.parent
        return nodes[::-1]


def prefix_tree(prompts: Sequence[Sequence[int]], min_shared: int) -> list[Node]:
    """The tree of distinct `prompts` (token ids), parents before children: a node per segment
    shared by several prompts (at least `min_shared` tokens) and one per prompt's own rest."""
    nodes: list[Node] = []

    def add(row: int, start: int, stop: int, parent: Node | None, ends: list[int]) -> Node:
        node = Node(row, start, stop, parent, ends,
                    depth=0 if parent is None else parent.depth + 1)
        nodes.append(node)
        return node

    def grow(rows: list[int], start: int, parent: Node | None) -> None:
        """`rows` share their tokens before `start` (the path to `parent`)."""
        if len(rows) == 1:
            add(rows[0], start, len(prompts[rows[0]]), parent, rows)
            return
        first, shortest = prompts[rows[0]], min(len(prompts[r]) for r in rows)
        stop = start
        while stop < shortest and all(prompts[r][stop] == first[stop] for r in rows):
            stop += 1
        ended = [r for r in rows if len(prompts[r]) == stop]  # one prompt, maybe repeated
        rest = [r for r in rows if len(prompts[r]) > stop]
        if stop > start and stop - start >= min_shared:  # never an empty node
            parent = add(rows[0], start, stop, parent, ended)
            start = stop
        else:  # too short to be computed apart: each branch (each repeat) starts with it
            for r in ended:
                add(r, start, stop, parent, [r])
        branches: dict[int, list[int]] = {}
        for r in rest:
            branches.setdefault(prompts[r][stop], []).append(r)
        for branch in branches.values():
            grow(branch, start, parent)

    grow(list(range(len(prompts))), 0, None)
    return sorted(nodes, key=lambda n: n.depth)  # stable: a depth's nodes in prompt order


def prefill_tree(model: Any, input_ids: torch.Tensor, attention: torch.Tensor, cache: Any
                 ) -> torch.Tensor:
    """Each row's next-token logits after its prompt (left-padded `input_ids`, distinct rows),
    `cache` (preallocated, empty) filled with every row's prompt in the batch's own layout
    (masked by `attention`), the prefixes the rows share computed once (module docstring)."""
    import torch

    width = input_ids.shape[1]
    lengths = attention.long().sum(-1).tolist()
    prompts = [input_ids[i, width - n:].tolist() for i, n in enumerate(lengths)]
    nodes = prefix_tree(prompts, decoding.SHARED_PREFIX_TOKENS)
    for depth in range(nodes[-1].depth + 1):
        for group in node_groups([n for n in nodes if n.depth == depth]):
            _prefill_nodes(model, input_ids, width, lengths, group)
    ends = {row: n for n in nodes for row in n.ends}
    for i, layer in enumerate(cache.layers):
        parts = []
        for row in range(len(prompts)):
            path = ends[row].path()
            parts.append((torch.cat([n.keys[i] for n in path], dim=1)[None],
                          torch.cat([n.values[i] for n in path], dim=1)[None]))
        layer.stack(parts, width)
    return torch.cat([ends[row].logits for row in range(len(prompts))])


def node_groups(level: Sequence[Node]) -> list[list[Node]]:
    """Nodes of one depth in groups for one forward each: longest first, each group within
    :data:`clbench.train.decoding.PREFILL_TOKENS` tokens (rows x its longest segment) and of
    segments at least :data:`clbench.train.decoding.PREFILL_FILL` of its longest (padding is
    computed like tokens)."""
    groups: list[list[Node]] = []
    for node in sorted(level, key=lambda n: -n.length):
        group = groups[-1] if groups else None
        if group is None or (len(group) + 1) * group[0].length > decoding.PREFILL_TOKENS \
                or node.length < decoding.PREFILL_FILL * group[0].length:
            groups.append([node])
        else:
            group.append(node)
    return groups


def _prefill_nodes(model: Any, input_ids: torch.Tensor, width: int, lengths: list[int],
                   group: list[Node]) -> None:
    """One forward over a group of nodes of one depth: each node's segment, padded on the right
    with its last token, after its ancestors' keys and values (left-padded to the longest
    path); each node keeps its own keys and values, and the logits at its last token."""
    import torch

    device = input_ids.device
    past = [n.start for n in group]
    widest_past, longest = max(past), max(n.length for n in group)
    step = torch.arange(longest, device=device)
    rows = torch.tensor([n.row for n in group], device=device)
    own = torch.tensor([n.length for n in group], device=device)
    # column of each segment token in the left-padded batch; its last token again as padding
    first = torch.tensor([width - lengths[n.row] + n.start for n in group], device=device)
    take = first[:, None] + torch.minimum(step[None], own[:, None] - 1)
    ids = input_ids[rows[:, None], take]
    part = decoding.attention_cache(model, capacity=widest_past + longest)
    if widest_past:  # every node of a depth below the first has a parent
        paths = [n.parent.path() for n in group if n.parent is not None]
        for i, layer in enumerate(part.layers):
            layer.stack([(_path_cat(path, i, "keys"), _path_cat(path, i, "values"))
                         for path in paths], widest_past)
    mask = torch.ones((len(group), widest_past + longest), dtype=torch.long, device=device)
    for j, p in enumerate(past):
        mask[j, :widest_past - p] = 0
    positions = torch.tensor(past, device=device)[:, None] + step[None]
    logits = decoding.forward_logits(model, ids, mask, positions, part, at=own - 1)
    for j, node in enumerate(group):
        columns = slice(widest_past, widest_past + node.length)
        node.keys = [layer.keys[j, :, columns].clone() for layer in part.layers]
        node.values = [layer.values[j, :, columns].clone() for layer in part.layers]
        if node.ends:
            node.logits = logits[j:j + 1]


def _path_cat(path: Sequence[Node], layer: int, which: str) -> Any:
    """The keys or values of a path of nodes at one layer, (1, kv heads, tokens, dim)."""
    import torch

    return torch.cat([getattr(n, which)[layer] for n in path], dim=1)[None]
