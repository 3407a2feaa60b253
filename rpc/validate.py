"""Turning wire tensors and graphs into server-side objects, believing nothing.

Every check happens before any byte of a buffer is touched: the type is a known one
with a block size, ``ne``/``nb`` are non-negative and small enough that no product
overflows, ``ne[0]`` is whole blocks, the strided extent of the tensor lies inside its
buffer, a buffer handle names a buffer of this client, every node and source id is
known and nonzero, the op is one the device runs, and the op's own shape checks (the
functions in :mod:`pyggml.ops` that build the node on the client) pass again with the
node's sources and parameters, giving the same type and shape.

What a graph may make the server do is bounded by what its session owns: no tensor has more
elements than its bytes hold (a stride of 0, or strides that fold many elements onto a few
bytes, would let 4 bytes stand for 2**40 values), the multiply-adds of the whole graph are at
most ``WORK_PER_BYTE`` per byte of the session's buffers, and the float32 scratch one node
needs must fit in the memory the server still offers (``--mem`` counts it).
"""
from __future__ import annotations

from collections.abc import Callable

import numpy as np

from pyggml import ops
from pyggml.backend import Buffer
from pyggml.graph import Graph
from pyggml.opdefs import (VIEW_OPS, ArgsortParams, ClampParams, ConcatParams, FlashAttnParams, GluParams, NormParams, Op, RopeParams,
                           ScaleParams, SoftMaxParams, UnaryParams)
from pyggml.tensor import Tensor, TensorFlag
from pyggml.types import Type

from .protocol import GRAPH, TENSOR, U64, ProtocolError, WireTensor, unpack

MAX_NE = 1 << 40       # elements along one dimension
MAX_NB = 1 << 48       # bytes of one stride
MAX_GRAPH_TENSORS = 1 << 18
# multiply-adds a graph may cost per byte its session owns: an honest prompt batch of 2048
# tokens over F16 weights costs 1024 per weight byte, attention over a GQA-8 cache 8192 per
# cache byte at most; a 4-byte buffer can no longer stand for minutes of work
WORK_PER_BYTE = 1 << 15

BufferLookup = Callable[[int], Buffer]


def tensor_extent(t: Tensor) -> int:
    """Bytes from a tensor's first byte to one past its last, whatever its strides (ggml_nbytes)."""
    return t.nbytes()


def tensor_from_wire(w: WireTensor, lookup: BufferLookup, need_buffer: bool = True) -> Tensor:
    """A :class:`Tensor` placed in one of the client's buffers, or a :class:`ProtocolError`."""
    label = f"tensor {w.name!r}" if w.name else f"tensor {w.id:#x}"
    try:
        ttype = Type(w.type)
    except ValueError:
        raise ProtocolError(f"{label}: type {w.type} is not a known tensor type") from None
    if ttype.block_size <= 0 or ttype.type_size <= 0:
        raise ProtocolError(f"{label}: type {ttype.name} has no block size")
    if any(not 0 <= n < MAX_NE for n in w.ne) or any(not 0 <= b < MAX_NB for b in w.nb):
        raise ProtocolError(f"{label}: ne {list(w.ne)} / nb {list(w.nb)} negative or too large")
    if int(np.prod([float(n) for n in w.ne])) >= 1 << 62:
        raise ProtocolError(f"{label}: {list(w.ne)} elements overflow")
    if w.ne[0] % ttype.block_size:
        raise ProtocolError(f"{label}: ne[0]={w.ne[0]} is not a multiple of the {ttype.name} block size "
                            f"{ttype.block_size}")
    if ttype.is_quantized and w.nb[0] != ttype.type_size:
        raise ProtocolError(f"{label}: nb[0]={w.nb[0]} must be the {ttype.name} block size {ttype.type_size}")
    for i in range(4):
        if w.ne[i] > 1 and w.nb[i] == 0:
            raise ProtocolError(f"{label}: stride nb[{i}] is 0 along a dimension of {w.ne[i]} elements")
    try:
        op = Op(w.op)
    except ValueError:
        raise ProtocolError(f"{label}: op {w.op} is not a known op") from None
    t = Tensor(ttype, w.ne, w.nb, op=op, name=w.name)
    t.op_params[:] = np.asarray(w.op_params, dtype=np.int64).astype(np.int32)
    t.flags = TensorFlag(w.flags & 7)
    if w.buffer == 0:
        if need_buffer:
            raise ProtocolError(f"{label} has no buffer")
        return t
    buf = lookup(w.buffer)
    extent = tensor_extent(t)
    end = w.offset + extent
    if w.offset >= MAX_NB or end > buf.get_size():
        raise ProtocolError(f"{label}: bytes [{w.offset}, {end}) lie outside its buffer of {buf.get_size()} bytes")
    packed = ttype.row_size(w.ne[0]) * w.ne[1] * w.ne[2] * w.ne[3]
    if packed > extent:  # elements laid over one another: more values than bytes
        raise ProtocolError(f"{label}: {t.nelements()} elements of {ttype.name} need {packed} bytes, but its "
                            f"strides cover {extent}")
    t.buffer, t.offset = buf, w.offset
    return t


def read_tensor(payload: memoryview | bytes, lookup: BufferLookup, at: int = 0) -> tuple[Tensor, int]:
    """The tensor at byte ``at`` of a payload and the offset just after it."""
    return tensor_from_wire(WireTensor.unpack_from(payload, at), lookup), at + TENSOR.size


# -- op checks: rebuild the node with the client's own op functions --------------------------------

def _binary(op: Op) -> Callable[[Tensor], Tensor]:
    return lambda n: ops._binary(op, n.src[0], n.src[1])


def _copies_into(n: Tensor) -> bool:
    """A CPY into its second source (ops.cpy), not one whose result is a tensor of its own (ops.cast)."""
    return len(n.src) > 1 and n.src[1] is not None


REBUILD: dict[Op, Callable[[Tensor], Tensor]] = {
    Op.ADD: _binary(Op.ADD),
    Op.SUB: _binary(Op.SUB),
    Op.MUL: _binary(Op.MUL),
    Op.DIV: _binary(Op.DIV),
    Op.SCALE: lambda n: ops.scale(n.src[0], *ScaleParams.of(n).values()),
    Op.UNARY: lambda n: ops.unary(n.src[0], *UnaryParams.of(n).values()),
    Op.GLU: lambda n: ops.glu(n.src[0], n.src[1], *GluParams.of(n).values()),
    Op.RMS_NORM: lambda n: ops.rms_norm(n.src[0], *NormParams.of(n).values()),
    Op.NORM: lambda n: ops.norm(n.src[0], *NormParams.of(n).values()),
    Op.SOFT_MAX: lambda n: ops.soft_max_ext(n.src[0], n.src[1], *SoftMaxParams.of(n).values(),
                                            sinks=n.src[2] if len(n.src) > 2 else None),
    Op.ADD_ID: lambda n: ops.add_id(n.src[0], n.src[1], n.src[2]),
    Op.ROPE: lambda n: ops.rope_ext(n.src[0], n.src[1], n.src[2], *RopeParams.of(n).values()),
    Op.MUL_MAT: lambda n: ops.mul_mat(n.src[0], n.src[1], n.src[2] if len(n.src) > 2 else None),
    Op.GET_ROWS: lambda n: ops.get_rows(n.src[0], n.src[1]),
    Op.SET_ROWS: lambda n: ops.set_rows(n.src[2], n.src[0], n.src[1]),
    Op.CPY: lambda n: ops.cpy(n.src[0], n.src[1]) if _copies_into(n) else ops.cast(n.src[0], n.type),
    Op.CONT: lambda n: ops.cont(n.src[0], *n.ne),
    Op.DUP: lambda n: ops.cont(n.src[0], *n.ne),
    Op.CONCAT: lambda n: ops.concat(n.src[0], n.src[1], *ConcatParams.of(n).values()),
    Op.ARGMAX: lambda n: ops.argmax(n.src[0]),
    Op.ARGSORT: lambda n: ops.argsort(n.src[0], *ArgsortParams.of(n).values()),
    Op.MUL_MAT_ID: lambda n: ops.mul_mat_id(n.src[0], n.src[1], n.src[2], n.src[3] if len(n.src) > 3 else None),
    Op.SUM_ROWS: lambda n: ops.sum_rows(n.src[0]),
    Op.CLAMP: lambda n: ops.clamp(n.src[0], *ClampParams.of(n).values()),
    Op.TOP_K: lambda n: ops.top_k(n.src[0], n.ne[0]),
    Op.FLASH_ATTN_EXT: lambda n: ops.flash_attn_ext(n.src[0], n.src[1], n.src[2], n.src[3],
                                                    *FlashAttnParams.of(n).values(),
                                                    sinks=n.src[4] if len(n.src) > 4 else None),
}
"""Ops the server can check; an op missing here is refused even if a device could run it."""


def check_node(node: Tensor, supported: Callable[[Tensor], bool]) -> None:
    label = f"node {node.name!r} ({node.op.name})" if node.name else f"node {node.op.name}"
    if node.op in VIEW_OPS:
        if node.op != Op.NONE and node.src and node.src[0] is not None and node.src[0].buffer is not node.buffer:
            raise ProtocolError(f"{label}: a view must lie in its source's buffer")
        return
    rebuild = REBUILD.get(node.op)
    if rebuild is None or not supported(node):
        what = f"{node.src[0].type.name} to {node.type.name}" if ops.converts(node) else "op"
        raise ProtocolError(f"{label}: {what} not supported by this server")
    try:
        want = rebuild(node)
    except (ValueError, TypeError, AttributeError, IndexError, ArithmeticError) as e:
        raise ProtocolError(f"{label}: {e}") from None
    if want.ne != node.ne or want.type != node.type:
        raise ProtocolError(f"{label}: result {node.type.name}{list(node.ne)} but its sources give "
                            f"{want.type.name}{list(want.ne)}")
    if not np.array_equal(want.op_params, node.op_params):  # slots its op's record does not use are 0
        raise ProtocolError(f"{label}: op parameters {node.op_params.tolist()} are not ones the op builds")
    if node.op == Op.SET_ROWS or (node.op == Op.CPY and _copies_into(node)):  # the result is the destination itself
        dst = node.src[2] if node.op == Op.SET_ROWS else node.src[1]
        if node.buffer is not dst.buffer or node.offset != dst.offset or node.nb != dst.nb:
            raise ProtocolError(f"{label}: the result must be its destination tensor")


# What writing one element of another type than its source's costs, in multiply-adds: a copy
# into a quantized type runs its quantizer (pyggml.quants), and a K-quant's or MXFP4's searches
# each sub-block's scales over candidates - the time of thousands of a product's multiply-adds,
# which an element counted as one would let a graph of such copies run for hours.
QUANTIZE_WORK = {Type.Q4_K: 8192, Type.Q5_K: 8192, Type.Q6_K: 8192, Type.MXFP4: 8192, Type.F16: 64}
QUANTIZE_WORK_OTHER = 512  # the 32-element types' and BF16's quantizers


def node_cost(node: Tensor) -> tuple[int, int]:
    """(multiply-adds, bytes of float32 scratch) that computing ``node`` may take on the CPU.

    Scratch: every source that is not already float32 becomes a float32 copy, and so does the
    result; quantized and F16 weights of a product are read as stored, and a row lookup
    decodes only the rows it picks.  Elements written in another type than their source's
    cost their quantizer's work (QUANTIZE_WORK)."""
    srcs = [s for s in node.src if s is not None]
    elements = node.nelements() + sum(s.nelements() for s in srcs)
    work, scratch = elements, 4 * node.nelements()
    if ops.converts(node) and node.type != Type.F32:  # (decoding to float32 costs what a copy does)
        work += srcs[0].nelements() * QUANTIZE_WORK.get(node.type, QUANTIZE_WORK_OTHER)
    converted = srcs
    if node.op == Op.MUL_MAT:
        work = node.nelements() * srcs[0].ne[0]
        converted = srcs[1:] if srcs[0].type.has_vec_dot else srcs
        scratch += 4 * srcs[1].nelements()  # the activations quantized for the integer products
    elif node.op == Op.MUL_MAT_ID:  # one product per (token, used expert); the ids are checked when it runs
        work = node.nelements() * srcs[0].ne[0]
        converted = srcs[1:] if srcs[0].type.has_vec_dot else srcs
        pairs = node.ne[1] * node.ne[2]
        # the pairs' results, their activations gathered (float32), quantized (float32 values,
        # then bytes with lane sums) and the route (cpu/experts.py: per pair and per expert)
        scratch += 4 * node.nelements() + 12 * srcs[1].ne[0] * pairs + 8 * (5 * pairs + srcs[0].ne[2] + 8)
    elif node.op == Op.FLASH_ATTN_EXT:
        q, k, v = srcs[:3]
        work = q.ne[1] * q.ne[2] * q.ne[3] * k.ne[1] * (q.ne[0] + v.ne[0])
    elif node.op == Op.GET_ROWS:
        converted = srcs[1:]
    elif node.op in (Op.ARGSORT, Op.TOP_K):  # a sort (or a partition) per row, with int64 indices
        work = srcs[0].nelements() * max(1, int(srcs[0].ne[0]).bit_length())
        scratch += 16 * srcs[0].nelements()
    for s in converted:
        if s.type != Type.F32 or not s.is_contiguous():
            scratch += 4 * s.nelements()
    return work, scratch


def check_cost(graph: Graph, owned: int, free: int) -> None:
    """Refuse a graph whose work is out of proportion to the ``owned`` bytes of its session, or
    a node whose scratch does not fit in the ``free`` memory the server offers."""
    total = 0
    for node in graph.nodes:
        if node.op in VIEW_OPS:
            continue
        work, scratch = node_cost(node)
        if scratch > free:
            raise ProtocolError(f"node {node.name!r} ({node.op.name}) needs {scratch / 2**20:.1f} MiB of scratch "
                                f"memory; the server offers {free / 2**20:.1f} MiB more (--mem counts scratch)")
        total += work
    if total > WORK_PER_BYTE * owned:
        raise ProtocolError(f"a graph of {total:.3g} multiply-adds over {owned} bytes of buffers exceeds the "
                            f"limit of {WORK_PER_BYTE} per byte the session owns")


def read_graph(payload: memoryview | bytes, lookup: BufferLookup,
               supported: Callable[[Tensor], bool]) -> tuple[int, int, Graph, set[int]]:
    """GRAPH_COMPUTE's payload -> (device, slot, graph, buffer handles it uses)."""
    device, slot, n_nodes, n_tensors = unpack(GRAPH, payload, exact=False)
    if not 0 < n_nodes <= n_tensors <= MAX_GRAPH_TENSORS:
        raise ProtocolError(f"graph of {n_nodes} nodes and {n_tensors} tensors")
    want = GRAPH.size + n_nodes * U64.size + n_tensors * TENSOR.size
    if len(payload) != want:
        raise ProtocolError(f"graph payload of {len(payload)} bytes where {want} were expected")
    node_ids = np.frombuffer(payload, dtype="<u8", count=n_nodes, offset=GRAPH.size)
    at = GRAPH.size + n_nodes * U64.size
    wires: dict[int, WireTensor] = {}
    tensors: dict[int, Tensor] = {}
    handles: set[int] = set()
    for _ in range(n_tensors):
        w = WireTensor.unpack_from(payload, at)
        at += TENSOR.size
        if w.id == 0 or w.id in wires:
            raise ProtocolError(f"tensor id {w.id:#x} is zero or repeated")
        wires[w.id] = w
        tensors[w.id] = tensor_from_wire(w, lookup)
        handles.add(w.buffer)
    nodes: list[Tensor] = []
    for nid in node_ids.tolist():
        if nid == 0 or nid not in tensors:
            raise ProtocolError(f"node id {nid:#x} is zero or not among the graph's tensors")
        nodes.append(tensors[nid])
    for nid in node_ids.tolist():  # wire the sources, then check each node with them
        w, t = wires[nid], tensors[nid]
        srcs = list(w.src)  # all MAX_SRC slots, absent ones None: kernels index src[i] freely
        for sid in srcs:
            if sid != 0 and sid not in tensors:
                raise ProtocolError(f"node {t.name!r}: source id {sid:#x} is not among the graph's tensors")
        t.src = [tensors[sid] if sid else None for sid in srcs]
        if w.view_src:
            if w.view_src not in tensors:
                raise ProtocolError(f"node {t.name!r}: view source id {w.view_src:#x} unknown")
            t.view_src, t.view_offs = tensors[w.view_src], w.view_offs
    for t in nodes:
        check_node(t, supported)
    graph = Graph()
    graph.nodes = nodes
    return device, slot, graph, handles
