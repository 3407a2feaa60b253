"""Scheduler (ggml_backend_sched): run one graph across several backends.

1. Assign every node a backend: the one holding its weights (any source that already
   lives in a buffer, e.g. a weight or the KV cache), else the previous node's backend,
   else the last backend (the CPU).  Views go where their bytes are; graph inputs start
   on the CPU.
2. Cut the node list into splits, one per run of nodes on the same backend.
3. For each split, every source that lives on another backend gets a copy on the
   split's backend; the split's nodes are rewired to read the copy.
4. Allocate all intermediates (and the copies) with one :class:`GraphAllocator` that
   has a compute buffer per backend, then run: copy inputs in, compute, next split.

The assignment, splits and allocation are kept and reused while the same graph (same
object, same node count) is computed again, as a decode loop does.  The assignment and splits
of the last few graphs are kept too (:class:`Partition`), so that a context alternating between its
prompt and decode graphs hands each backend the same split graphs again: a remote backend then
re-runs the graph its server holds instead of receiving it anew.  A split graph is renewed
whenever the allocation places its tensors differently, so that nothing a backend derived from
it (a server's copy, a captured CUDA graph) outlives the addresses it was made for.
"""
from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from .alloc import GraphAllocator, needs_compute_memory
from .backend import Backend, tensor_copy
from .graph import Graph
from .opdefs import VIEW_OPS, Op
from .tensor import Tensor


@dataclass
class Split:
    backend_id: int
    nodes: list[Tensor] = field(default_factory=list)
    copies: list[tuple[Tensor, Tensor]] = field(default_factory=list)  # (source elsewhere, local copy)
    graph: Graph = field(default_factory=Graph)
    plan: object = None  # the backend's plan of ``graph`` (Backend.graph_plan_create)
    # copies into later splits of what this split computes, which the destination's buffer can
    # start as soon as it is computed (cpy_tensor_send: a server sends it to another itself)
    sends: list[tuple[Tensor, Tensor]] = field(default_factory=list)


@dataclass
class Partition:
    """One graph's assignment and splits, and where its allocation put each tensor."""
    graph: Graph
    n_nodes: int
    assigned: dict[int, int]
    splits: list[Split]
    rewired: list[tuple[Tensor, int, Tensor, Tensor]]  # (node, src slot, original source, its copy)
    placement: list[tuple[object, int]] = field(default_factory=list)
    runs: int = 0  # computes since it was split and placed as it is
    kept: list[tuple[int, object]] | None = None  # (backend, its kept step) when its backends keep steps
    keepable: bool | None = None  # whether they can (Scheduler._keepable; None: not asked yet)

    def drop_plans(self) -> None:
        """Forget the split graphs and their plans (made anew when this graph is computed again):
        a plan holds what its backend derived from the tensors' places, a CPU plan the arrays of
        the buffers themselves, which would outlive a buffer freed for a larger one."""
        self.placement = []
        self.runs, self.kept, self.keepable = 0, None, None
        for split in self.splits:
            split.graph, split.plan = Graph(), None


MAX_PARTITIONS = 16


class Scheduler:
    def __init__(self, backends: Sequence[Backend]) -> None:
        if not backends:
            raise ValueError("Scheduler needs at least one backend (the last one is the fallback, the CPU)")
        self.backends = list(backends)
        self._buft_ids = {id(b.get_default_buffer_type()): i for i, b in enumerate(self.backends)}
        self.galloc = GraphAllocator([b.get_default_buffer_type() for b in self.backends])
        self.assigned: dict[int, int] = {}
        self.user_assigned: dict[int, int] = {}
        self.splits: list[Split] = []
        self._rewired: list[tuple[Tensor, int, Tensor, Tensor]] = []  # (node, src slot, original source, copy)
        self._partitions: OrderedDict[int, Partition] = OrderedDict()  # by id(graph); each holds its graph
        self.max_partitions = MAX_PARTITIONS
        # the graph last split and allocated, and its node count: held, not its id - a freed
        # graph's id can come back for a new graph of the same size
        self._key: tuple[Graph, int] | None = None
        self.n_copies = 0  # bytes copied between backends in the last graph_compute
        self.busy_seconds: dict[str, float] = {}  # compute time per backend name, since creation

    # -- assignment ---------------------------------------------------------------------------
    def set_tensor_backend(self, tensor: Tensor, backend: Backend) -> None:
        self.user_assigned[id(tensor)] = self.backends.index(backend)
        self._key = None
        self._partitions.clear()

    def get_tensor_backend(self, tensor: Tensor) -> Backend | None:
        i = self._backend_of(tensor)
        return self.backends[i] if i is not None else None

    def _buffer_backend(self, t: Tensor) -> int | None:
        buf = t.data_root().buffer if t.view_src is not None else t.buffer
        if buf is None:
            return None
        i = self._buft_ids.get(id(buf.get_type()))
        if i is None:
            raise ValueError(f"tensor {t.name or '?'} lives in buffer type {buf.get_type().get_name()}, "
                             f"which none of the scheduler's backends owns")
        return i

    def _backend_of(self, t: Tensor) -> int | None:
        if id(t) in self.assigned:
            return self.assigned[id(t)]
        root = t.data_root()
        if id(root) in self.assigned:
            return self.assigned[id(root)]
        return self._buffer_backend(t)

    def _assign(self, graph: Graph) -> None:
        cpu = len(self.backends) - 1
        self.assigned = {}
        for leaf in graph.leafs:
            if needs_compute_memory(leaf):  # an input the caller fills: it starts on the host
                self.assigned[id(leaf)] = self.user_assigned.get(id(leaf), cpu)
        prev = None
        for node in graph.nodes:
            b = graph.pinned.get(id(node), self.user_assigned.get(id(node)))
            if b is None and node.view_src is not None:
                b = self._backend_of(node.view_src)  # views (and writes into a cache) stay with their bytes
            if b is None:
                for s in node.src:
                    if s is not None and s.op == Op.NONE and not needs_compute_memory(s):
                        b = self._buffer_backend(s)  # the weights decide
                        break
            if b is None:
                b = prev if prev is not None else cpu
            if node.op not in VIEW_OPS and not self.backends[b].supports_op(node):
                home = node.data_root().buffer if node.view_src is not None else None
                if home is not None and not home.get_type().is_host():
                    raise NotImplementedError(
                        f"{self.backends[b].get_name()} cannot compute {node.op.name} of {node.name or 'a tensor'} "
                        f"({node.type.name}), whose result must be written in place into its memory")
                b = cpu
            self.assigned[id(node)] = b
            prev = b

    # -- splits ----------------------------------------------------------------------------------
    def _unsplit(self) -> None:
        """Point nodes rewired to cross-device copies back at their sources, so that a graph
        can be split again (after another graph was computed in between)."""
        for node, j, original, _ in self._rewired:
            node.src[j] = original
        self._rewired = []

    def _split(self, graph: Graph) -> None:
        self.splits = []
        for node in graph.nodes:
            b = self.assigned[id(node)]
            if not self.splits or self.splits[-1].backend_id != b:
                self.splits.append(Split(b))
            self.splits[-1].nodes.append(node)
        made_in = {id(node): i for i, split in enumerate(self.splits) for node in split.nodes}
        for split in self.splits:
            local: dict[int, Tensor] = {}
            for node in split.nodes:
                for j, s in enumerate(node.src):
                    if s is None:
                        continue
                    home = self._backend_of(s)
                    if home is None or home == split.backend_id:
                        continue
                    copy = local.get(id(s))
                    if copy is None:
                        copy = Tensor(s.type, s.ne, s.nb, op=Op.DUP, src=[s],
                                      name=f"{s.name or 'tensor'}#{self.backends[split.backend_id].get_name()}")
                        self.assigned[id(copy)] = split.backend_id
                        local[id(s)] = copy
                        split.copies.append((s, copy))
                        if id(s) in made_in:
                            self.splits[made_in[id(s)]].sends.append((s, copy))
                    self._rewired.append((node, j, s, copy))
                    node.src[j] = copy

    def alloc_graph(self, graph: Graph) -> None:
        """Assign, split and allocate ``graph`` (done once per graph, reused afterwards)."""
        if self._key is not None and self._key[0] is graph and self._key[1] == graph.n_nodes:
            return
        self._unsplit()  # the assignment must see the graph's own sources
        part = self._partitions.get(id(graph))
        if part is not None and part.graph is graph and part.n_nodes == graph.n_nodes:
            self._partitions.move_to_end(id(graph))
            self.assigned, self.splits, self._rewired = part.assigned, part.splits, list(part.rewired)
            for node, j, _, copy in self._rewired:
                node.src[j] = copy
        else:
            self._assign(graph)
            self._split(graph)
            part = Partition(graph, graph.n_nodes, self.assigned, self.splits, list(self._rewired))
            self._partitions[id(graph)] = part
            while len(self._partitions) > self.max_partitions:
                self._partitions.popitem(last=False)
        order: list[Tensor] = []
        for split in self.splits:
            order.extend(copy for _, copy in split.copies)
            order.extend(split.nodes)
        inputs = [leaf for leaf in graph.leafs if needs_compute_memory(leaf)]
        buffers = list(self.galloc.buffers)
        self.galloc.alloc_graph(order, inputs, lambda t: self.assigned[id(t)])
        if self.galloc.buffers != buffers:  # a compute buffer grew: the other graphs' plans point into the old one
            for other in self._partitions.values():
                if other is not part:
                    other.drop_plans()
        placement = [(t.buffer, t.offset) for t in order + inputs]  # the buffers held: an id() could come back
        if placement != part.placement:  # new split graphs: what backends derived from the old is stale
            read_across = frozenset(id(s) for split in self.splits for s, _ in split.copies)
            for split in self.splits:
                split.graph = Graph()
                split.graph.nodes = list(split.nodes)
                split.graph.read_across = read_across
                split.plan = self.backends[split.backend_id].graph_plan_create(split.graph)
            part.placement = placement
            part.runs, part.kept, part.keepable = 0, None, None
        self._key = (graph, graph.n_nodes)

    def is_placed(self, graph: Graph) -> bool:
        """Whether ``graph`` is split, allocated and planned: computing it does none of that
        (unless a graph computed meanwhile grew a compute buffer)."""
        part = self._partitions.get(id(graph))
        return part is not None and part.graph is graph and part.n_nodes == graph.n_nodes and bool(part.placement)

    # -- execution ---------------------------------------------------------------------------------
    def graph_compute(self, graph: Graph) -> None:
        self.alloc_graph(graph)
        part = self._partitions[id(graph)]
        if part.kept is not None and all(self.backends[b].step_valid(step) for b, step in part.kept):
            self._run_kept(part)
            return
        # a graph whose backends keep steps is recorded from its second run on (the first may
        # still send graphs and make links) until a recording is kept: later runs are its inputs
        # and one request per backend
        part.kept = None
        if part.keepable is None:
            part.keepable = self._keepable()
        record = part.runs >= 1 and part.keepable
        if record:
            for b in self._kept_backends():
                self.backends[b].step_begin()
        copied = 0
        started: dict[int, int] = {}  # id(copy) -> its tag, for copies sent as soon as computed
        for split in self.splits:
            for src, copy in split.copies:
                tag = started.pop(id(copy), None)
                if tag is not None:
                    copy.buffer.cpy_tensor_wait(copy, tag)
                else:
                    tensor_copy(src, copy)
                copied += src.nbytes()
            backend = self.backends[split.backend_id]
            t0 = time.perf_counter()
            backend.graph_plan_compute(split.plan)
            backend.synchronize()
            name = backend.get_name()
            self.busy_seconds[name] = self.busy_seconds.get(name, 0.0) + time.perf_counter() - t0
            for src, copy in split.sends:  # (else its server would send it only after its next split)
                tag = copy.buffer.cpy_tensor_send(src, copy)
                if tag is not None:
                    started[id(copy)] = tag
        self.n_copies = copied
        part.runs += 1
        if record:
            kept = [(b, self.backends[b].step_end()) for b in self._kept_backends()]
            part.kept = kept if all(step is not None for _, step in kept) else None

    # -- steps kept by the backends (rpc/steps.py) ------------------------------------------------
    def _kept_backends(self) -> list[int]:
        return list(dict.fromkeys(split.backend_id for split in self.splits))

    def _keepable(self) -> bool:
        """Whether this graph's step can be kept: several splits on one backend (a tensor split),
        every split on a backend that keeps steps, one backend per connection, and everything copied in from elsewhere (the inputs) copied into
        its backend's first split - so that uploading it before the kept step runs is the same."""
        used = self._kept_backends()
        if len(self.splits) == len(used):  # one request per backend already: nothing to gain
            return False
        if not all(self.backends[b].keeps_steps() for b in used):
            return False
        if len({id(self.backends[b].get_device().connection()) for b in used}) != len(used):
            return False
        first = {b: next(i for i, sp in enumerate(self.splits) if sp.backend_id == b) for b in used}
        for i, split in enumerate(self.splits):
            for src, _ in split.copies:
                home = self._backend_of(src)
                if (home not in used or not self.backends[home].keeps_steps()) and first[split.backend_id] != i:
                    return False
        return True

    def _run_kept(self, part: Partition) -> None:
        """The inputs uploaded, then each backend's kept step."""
        copied = 0
        kept_by = {b for b, _ in part.kept}
        for split in self.splits:
            for src, copy in split.copies:
                if self._backend_of(src) not in kept_by:
                    tensor_copy(src, copy)
                    copied += src.nbytes()
        for b, step in part.kept:
            self.backends[b].step_run(step)
        self.n_copies = copied
        part.runs += 1

    @property
    def n_splits(self) -> int:
        return len(self.splits)

    def free(self) -> None:
        """Give back the compute buffers (ggml_backend_sched_free)."""
        self.reset()
        self.galloc.free()

    def reset(self) -> None:
        self._unsplit()
        self._key = None
        self._partitions.clear()
        self.assigned = {}
        self.splits = []
