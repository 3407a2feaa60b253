"""Compute graphs: the ops needed for some outputs, in an order that respects dependencies."""
from __future__ import annotations

from collections.abc import Iterator

from .opdefs import Op
from .tensor import Tensor, TensorFlag


class Graph:
    """ggml_cgraph: ``nodes`` are computed in order, ``leafs`` are data the graph reads."""

    def __init__(self) -> None:
        self.nodes: list[Tensor] = []
        self.leafs: list[Tensor] = []
        self._seen: set[int] = set()
        # set by the Scheduler on the graphs of its splits: ids of the tensors that other splits
        # read, so a backend knows which intermediates nobody else needs (None: not known, as for
        # a graph that arrived over RPC; a backend must then compute every node as it is)
        self.read_across: frozenset[int] | None = None
        # the scheduler backend of each node (by id) where the graph's maker decided it (a tensor
        # split: every device computes its own copy of the same ops); the others are assigned
        self.pinned: dict[int, int] = {}

    def build_forward_expand(self, tensor: Tensor) -> Graph:
        """Add ``tensor`` and everything it depends on (depth first, sources before users)."""
        seen = self._seen
        if id(tensor) in seen:
            return self
        # iterative DFS (deep models would overflow Python's recursion limit): each entry is a
        # tensor and its sources still to look at; a tensor is added once all of them are
        stack: list[tuple[Tensor, Iterator[Tensor | None]]] = [(tensor, iter(tensor.src))]
        while stack:
            t, sources = stack[-1]
            for s in sources:
                if s is not None and id(s) not in seen:
                    stack.append((s, iter(s.src)))
                    break
            else:
                stack.pop()
                seen.add(id(t))
                if t.op == Op.NONE and not (t.flags & TensorFlag.PARAM):
                    self.leafs.append(t)
                else:
                    self.nodes.append(t)
        return self

    @property
    def n_nodes(self) -> int:
        return len(self.nodes)

    def output(self) -> Tensor:
        return self.nodes[-1]

    def __repr__(self) -> str:
        return f"Graph({len(self.nodes)} nodes, {len(self.leafs)} leafs)"


def build_forward(tensor: Tensor) -> Graph:
    return Graph().build_forward_expand(tensor)
