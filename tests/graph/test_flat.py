"""The recorder's fast flattening visits op arguments and results as torch's pytree does."""

from __future__ import annotations

import collections

import torch
from torch.utils._pytree import tree_flatten, tree_map

from devgraph.graph._flat import leaves, map_leaves, tensor_leaves

t1, t2 = torch.ones(2), torch.zeros(3)
Point = collections.namedtuple("Point", "x y")
TREES = [
    (t1, 3, None, [t2, 1.5], {"out": t1, "alpha": 2}),
    ([t1, None, t2], {}),
    t1,
    torch.max(torch.arange(6.0).view(2, 3), dim=1),  # torch.return_types.max
    (Point(t1, 2), "text", True),
    ((), [], {"a": [(t1,), {"b": t2}]}),
]


def test_leaves_are_pytrees_leaves_in_its_order():
    for tree in TREES:
        assert all(a is b for a, b in zip(leaves(tree), tree_flatten(tree)[0], strict=True))
        assert [id(t) for t in tensor_leaves(tree)] == [
            id(t) for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)
        ]


def test_map_leaves_rebuilds_the_same_structure_as_tree_map():
    def fn(x):
        return x + 1 if isinstance(x, torch.Tensor) else x

    for tree in TREES:
        mine, theirs = map_leaves(fn, tree), tree_map(fn, tree)
        assert type(mine) is type(theirs)
        assert [id(type(x)) for x in leaves(mine)] == [id(type(x)) for x in tree_flatten(theirs)[0]]
        for a, b in zip(leaves(mine), tree_flatten(theirs)[0], strict=True):
            assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b
