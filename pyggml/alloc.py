"""Graph allocator (ggml-alloc): place a graph's intermediate tensors in compute buffers.

Walking the nodes in execution order, each result gets memory when it is produced and
gives it back after its last consumer ran, so later results reuse it.  With several
buffer types (one per backend, as the scheduler needs) each tensor is placed in the
buffer of the backend it runs on, and each buffer type is planned independently.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

from .backend import Buffer, BufferType, BufferUsage, align_up
from .opdefs import VIEW_OPS
from .tensor import Tensor, TensorFlag


class _FreeList:
    """Best-fit allocator over a growing address range (ggml_dyn_tallocr)."""

    def __init__(self, alignment: int) -> None:
        self.alignment = alignment
        self.free: list[list[int]] = []  # [offset, size], sorted by offset
        self.high = 0

    def alloc(self, size: int) -> int:
        size = align_up(max(size, 1), self.alignment)
        best = None
        for i, (off, sz) in enumerate(self.free):
            if sz >= size and (best is None or sz < self.free[best][1]):
                best = i
        if best is not None:
            off, sz = self.free[best]
            if sz == size:
                del self.free[best]
            else:
                self.free[best] = [off + size, sz - size]
            return off
        off = self.high
        self.high += size
        return off

    def release(self, offset: int, size: int) -> None:
        size = align_up(max(size, 1), self.alignment)
        self.free.append([offset, size])
        self.free.sort()
        merged: list[list[int]] = []
        for off, sz in self.free:
            if merged and merged[-1][0] + merged[-1][1] == off:
                merged[-1][1] += sz
            else:
                merged.append([off, sz])
        self.free = merged


def needs_compute_memory(t: Tensor) -> bool:
    """True for tensors the graph allocator places: not views, and either unallocated or
    placed by an earlier allocation (in a compute buffer), which a new plan may move."""
    return t.view_src is None and (t.buffer is None or t.buffer.usage == BufferUsage.COMPUTE)


class GraphAllocator:
    """ggml_gallocr: one compute buffer per buffer type, grown when a graph needs more."""

    def __init__(self, bufts: Sequence[BufferType]) -> None:
        self.bufts = list(bufts)
        self.buffers: list[Buffer | None] = [None] * len(self.bufts)

    def alloc_graph(self, nodes: Sequence[Tensor], leafs: Sequence[Tensor] = (),
                    buft_of: Callable[[Tensor], int] = lambda t: 0) -> None:
        """Give every node (and leaf) without storage a place; ``buft_of`` picks the buffer type."""
        plans = [_FreeList(b.get_alignment()) for b in self.bufts]
        offsets: dict[int, tuple[Tensor, int, int]] = {}  # id -> (tensor, buft index, offset)

        def place(t: Tensor) -> None:
            if needs_compute_memory(t) and id(t) not in offsets:
                i = buft_of(t)
                offsets[id(t)] = (t, i, plans[i].alloc(self.bufts[i].get_alloc_size(t)))

        # consumers per storage owner; a view's users keep its source alive
        pending: dict[int, int] = {}
        for node in nodes:
            for s in node.src:
                if s is not None:
                    root = s.data_root()
                    pending[id(root)] = pending.get(id(root), 0) + 1
        keep = {id(nodes[-1].data_root())} if nodes else set()
        keep |= {id(n.data_root()) for n in nodes if n.flags & TensorFlag.OUTPUT}

        for leaf in leafs:  # inputs are written before the graph runs: they must not share memory
            place(leaf)
            keep.add(id(leaf))
        for node in nodes:
            if node.op not in VIEW_OPS or node.view_src is None:
                place(node)
            for s in node.src:
                if s is None:
                    continue
                root = s.data_root()
                pending[id(root)] -= 1
                if pending[id(root)] == 0 and id(root) not in keep and id(root) in offsets:
                    t, i, off = offsets[id(root)]
                    plans[i].release(off, self.bufts[i].get_alloc_size(t))

        for i, plan in enumerate(plans):
            buf = self.buffers[i]
            if plan.high and (buf is None or buf.get_size() < plan.high):
                if buf is not None:
                    buf.free()
                buf = self.bufts[i].alloc_buffer(plan.high)
                buf.set_usage(BufferUsage.COMPUTE)
                self.buffers[i] = buf
        for t, i, off in offsets.values():
            t.buffer, t.offset = self.buffers[i], off
        for node in list(leafs) + list(nodes):  # views take their place from their source
            if node.view_src is not None and node.view_src.buffer is not None:
                node.buffer = node.view_src.buffer
                node.offset = node.view_src.offset + node.view_offs

    def get_buffer_size(self, i: int = 0) -> int:
        buf = self.buffers[i]
        return buf.get_size() if buf is not None else 0

    def free(self) -> None:
        for buf in self.buffers:
            if buf is not None:
                buf.free()
        self.buffers = [None] * len(self.bufts)


def alloc_graph(graph, buft: BufferType) -> GraphAllocator:
    """Allocate a single-backend graph in a new compute buffer of ``buft``."""
    galloc = GraphAllocator([buft])
    galloc.alloc_graph(graph.nodes, graph.leafs)
    return galloc


__all__ = ["GraphAllocator", "alloc_graph", "needs_compute_memory"]
