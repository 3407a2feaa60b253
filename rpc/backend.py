"""Remote devices as ordinary backends (ggml-rpc's client side).

An :class:`RPCDevice` is one device of one server.  Its buffer type allocates remote
buffers; an :class:`RPCBuffer` is an opaque handle plus a size, and its
``set_tensor``/``get_tensor``/... are requests to the server.  The :class:`RPCBackend`
sends a graph once and afterwards, while the same graph is computed again (a decode
loop), only ``GRAPH_RECOMPUTE`` with the slot the server keeps it in.  To the scheduler
and the allocator all of this looks exactly like a local device.
"""
from __future__ import annotations

import logging
import math
import os
import ssl

from collections import OrderedDict
from collections.abc import Callable, Collection
from operator import attrgetter

import numpy as np

from pyggml.backend import Backend, Buffer, BufferType, BufferUsage, Device, DeviceType, TensorSource
from pyggml.batch_rules import BATCH_RULES, BatchRules
from pyggml.graph import Graph
from pyggml.opdefs import Op
from pyggml.tensor import Tensor
from pyggml.types import Type

from . import protocol as P
from . import steps
from .steps import KeptStep
from .cache import digest
from .client import Connection
from .file_identity import file_identity
from .protocol import Codec, Command, RPCError, WireTensor

log = logging.getLogger("pyggml.rpc")

HASH_THRESHOLD = 64 << 10  # weights at least this large are offered to the server's cache by hash first


class RPCBufferType(BufferType):
    def __init__(self, device: RPCDevice) -> None:
        self.device = device

    def get_name(self) -> str:
        return self.device.get_name()

    def alloc_buffer(self, size: int) -> RPCBuffer:
        handle, real = self.device.conn.request(Command.ALLOC_BUFFER, P.ALLOC_BUFFER.pack(self.device.index, size),
                                                reply=P.ALLOC_REPLY)[0]
        return RPCBuffer(self, handle, real)

    def get_alignment(self) -> int:
        return self.device.alignment

    def get_max_size(self) -> int:
        return self.device.max_size

    def get_alloc_size(self, tensor: Tensor) -> int:
        if self.device.exact_alloc_size:
            return tensor.nbytes()
        payload = P.U32.pack(self.device.index) + wire(tensor, with_buffer=False).pack()
        return self.device.conn.request(Command.GET_ALLOC_SIZE, payload, reply=P.U64)[0][0]

    def get_device(self) -> Device:
        return self.device


def wire(t: Tensor, with_buffer: bool = True, srcs: bool = False) -> WireTensor:
    """A tensor as the protocol sends it; sources and view source only for graph nodes."""
    buf = t.buffer if with_buffer else None
    if buf is not None and not isinstance(buf, RPCBuffer):
        raise ValueError(f"tensor {t.name or '?'} is not in an RPC buffer")
    src = tuple(id(s) if s is not None else 0 for s in t.src) if srcs else ()
    return WireTensor(id=id(t), type=int(t.type), op=int(t.op), buffer=buf.handle if buf is not None else 0,
                      ne=t.ne, nb=t.nb, op_params=tuple(int(x) for x in t.op_params), flags=int(t.flags),
                      src=src + (0,) * (P.MAX_SRC - len(src)),
                      view_src=id(t.view_src) if srcs and t.view_src is not None else 0,
                      view_offs=t.view_offs if srcs and t.view_src is not None else 0,
                      offset=t.offset if buf is not None else 0, name=t.name)


class RPCBuffer(Buffer):
    def __init__(self, buft: RPCBufferType, handle: int, size: int) -> None:
        super().__init__(buft, size)
        self.handle = handle
        self.conn = buft.device.conn
        self.freed = False
        self._wire_cache: dict[tuple, bytes] = {}

    def _check(self, tensor: Tensor, offset: int, size: int) -> None:
        if self.freed:
            raise ValueError(f"{self.buft.get_name()}: buffer already freed")
        if offset < 0 or size < 0 or tensor.offset + offset + size > self.size:
            raise ValueError(f"{self.buft.get_name()}: bytes [{tensor.offset + offset}, "
                             f"{tensor.offset + offset + size}) outside the buffer of {self.size} bytes")

    def set_tensor(self, tensor: Tensor, data: bytes | np.ndarray, offset: int = 0) -> None:
        view = memoryview(np.ascontiguousarray(data) if isinstance(data, np.ndarray) else data).cast("B")
        self._check(tensor, offset, len(view))
        head = self._packed(tensor)
        cacheable = self.usage == BufferUsage.WEIGHTS and len(view) >= HASH_THRESHOLD and self.conn.server_has_cache
        step = self.conn.chunk_bytes
        loaded = self.conn.loaded if self.usage == BufferUsage.WEIGHTS else {}
        for start in range(0, max(len(view), 1), step):
            piece = view[start:start + step]
            if cacheable:
                found = self.conn.request(Command.SET_TENSOR_HASH,
                                          head + P.SET_TENSOR_HASH.pack(offset + start, len(piece), digest(piece)),
                                          reply=P.U8)[0][0]
                if found:
                    loaded["cache"] = loaded.get("cache", 0) + len(piece)
                    continue
            loaded["wire"] = loaded.get("wire", 0) + len(piece)
            codec, body = P.compress(piece, self.conn.compression)
            self.conn.send(Command.SET_TENSOR,
                           head + P.SET_TENSOR.pack(offset + start, len(piece), codec, P.FLAG_CACHE if cacheable else 0),
                           [body])

    def init_tensor(self, tensor: Tensor) -> None:
        """ggml's CUDA backend pads quantized rows to 512 and must clear the padding: a server
        that needs it is told, as ggml's client tells it (GgmlConnection.inits_tensors)."""
        if (self.conn.inits_tensors and tensor.type.is_quantized and tensor.ne[0] % 512
                and tensor.view_src is None):
            self.conn.send(Command.INIT_TENSOR, wire(tensor).pack())

    def load_summary(self) -> str:
        """Where this server's weights came from: its files, its tensor cache, the wire."""
        mib = {k: v / (1 << 20) for k, v in self.conn.loaded.items()}
        return f"{mib['disk']:.0f} MiB from its disk, {mib['cache']:.0f} from its cache, {mib['wire']:.0f} sent"

    def load_tensor(self, tensor: Tensor, source: TensorSource) -> None:
        """From the server's own copy of the model file where it holds this very file
        (``--gguf``), else uploaded."""
        if self.conn.server_files:
            identity = file_identity(source.path)
            if self.holds_file(identity, source.path.name) and self.set_tensor_from_file(tensor, identity,
                                                                                        source.pieces()):
                return
        self.set_tensor(tensor, source.read())

    def holds_file(self, identity: bytes, name: str) -> bool:
        """Whether the server holds the GGUF ``identity`` (``--gguf``); a file of the same
        name in another version is said once, and its tensors are uploaded."""
        if identity in self.conn.server_files:
            return True
        if name in self.conn.server_files.values() and name not in self.conn.warned_versions:
            self.conn.warned_versions.add(name)
            log.warning("%s holds another version of %s: its tensors are uploaded", self.buft.get_name(), name)
        return False

    def set_tensor_from_file(self, tensor: Tensor, identity: bytes, pieces: list[tuple[int, int, int]]) -> bool:
        """Fill ``tensor`` from the server's own copy of the file, piece by piece ((offset in
        the tensor, offset in the file, size): a split's rows of every expert are a piece each):
        nothing but the requests travels, all of them in one round trip (the server checks
        each range against the file's tensors).  False if the server refused (its copy changed
        on its disk): said once, and the file is not asked of it again - the caller uploads
        the bytes."""
        for at, _, size in pieces:
            self._check(tensor, at, size)
        head = self._packed(tensor)
        try:
            self.conn.request_many([(Command.SET_TENSOR_FILE, head + P.SET_TENSOR_FILE.pack(at, size, identity, file_offset),
                                     ()) for at, file_offset, size in pieces])
        except RPCError as e:
            if self.conn.closed_reason is not None:
                raise
            name = self.conn.server_files.pop(identity, "the model")
            log.warning("%s cannot read %s from its disk (%s): its tensors are uploaded", self.buft.get_name(),
                        name, e)
            return False
        self.conn.loaded["disk"] = self.conn.loaded.get("disk", 0) + sum(size for _, _, size in pieces)
        return True

    def _packed(self, tensor: Tensor) -> bytes:
        """The tensor's wire form for data requests, kept: a decode loop writes the same
        input tensors every step (the server reads only type, shape, strides and place)."""
        key = (id(tensor), tensor.offset, tensor.type, tensor.ne, tensor.nb)
        packed = self._wire_cache.get(key)
        if packed is None:
            if len(self._wire_cache) > 4096:
                self._wire_cache.clear()
            packed = self._wire_cache[key] = wire(tensor).pack()
        return packed

    def get_tensor(self, tensor: Tensor, offset: int = 0, size: int | None = None) -> np.ndarray:
        size = tensor.nbytes() - offset if size is None else size
        self._check(tensor, offset, size)
        answer = self.conn.request(Command.GET_TENSOR, self._packed(tensor) + P.GET_TENSOR.pack(
            offset, size, Codec.LZ4), reply=P.GET_REPLY)
        return self._received(answer, size)

    def get_tensors(self, tensors: list[Tensor]) -> list[np.ndarray]:
        """Every tensor whole, asked for together: one round trip to a server, not one each."""
        return self.get_tensors_async(tensors)()

    def get_tensors_async(self, tensors: list[Tensor]) -> Callable[[], list[np.ndarray]]:
        """The requests leave now; the server answers them after what was sent before (the
        graph that computes them) and before what is sent after (the next one, which may
        overwrite them)."""
        if any(not isinstance(t.buffer, RPCBuffer) or t.buffer.conn is not self.conn for t in tensors):
            return super().get_tensors_async(tensors)
        for t in tensors:
            t.buffer._check(t, 0, t.nbytes())
        answers = self.conn.request_many_async([(Command.GET_TENSOR, t.buffer._packed(t) + P.GET_TENSOR.pack(
            0, t.nbytes(), Codec.LZ4), ()) for t in tensors], reply=P.GET_REPLY)
        return lambda: [self._received(a, t.nbytes()) for a, t in zip(answers(), tensors)]

    def _received(self, answer: tuple, size: int) -> np.ndarray:
        (n, codec), frames = answer
        if n != size or len(frames) != 1:
            raise RPCError(self.conn.endpoint, f"GET_TENSOR answered {n} bytes in {len(frames)} frames, asked {size}")
        try:
            data = P.decompress(codec, frames[0], size)
        except P.ProtocolError as e:
            raise RPCError(self.conn.endpoint, f"malformed GET_TENSOR reply: {e}") from None
        return np.frombuffer(data, dtype=np.uint8).copy()

    def memset_tensor(self, tensor: Tensor, value: int, offset: int = 0, size: int | None = None) -> None:
        size = tensor.nbytes() - offset if size is None else size
        self._check(tensor, offset, size)
        self.conn.send(Command.MEMSET_TENSOR, wire(tensor).pack() + P.MEMSET.pack(offset, size, value))

    def cpy_tensor_send(self, src: Tensor, dst: Tensor) -> int | None:
        """The first half of a copy from another server (the scheduler's early send): a tag
        for :meth:`cpy_tensor_wait`, or None (then cpy_tensor does the whole copy later)."""
        if isinstance(src.buffer, RPCBuffer) and src.buffer.conn is not self.conn:
            return peer_send(src, dst)
        return None

    def cpy_tensor_wait(self, dst: Tensor, tag: int) -> None:
        peer_wait(dst, tag)

    def cpy_tensor(self, src: Tensor, dst: Tensor) -> bool:
        if not isinstance(src.buffer, RPCBuffer):
            return False  # from this machine: tensor_copy sets it
        if src.buffer.conn is not self.conn:
            return peer_copy(src, dst)  # another server: straight from it, or through this client
        self.conn.request(Command.COPY_TENSOR, wire(src).pack() + wire(dst).pack(), reply=P.U8)
        return True

    def clear(self, value: int) -> None:
        self.conn.request(Command.BUFFER_CLEAR, P.BUFFER_CLEAR.pack(self.handle, value))

    def free(self) -> None:
        if self.freed:
            return
        self.freed = True
        if self.conn.closed_reason is None:
            try:
                self.conn.request(Command.FREE_BUFFER, P.U64.pack(self.handle))
            except RPCError:
                pass  # the server is gone, and the buffer with it


PEERS = os.environ.get("PYGGML_RPC_PEERS", "1") != "0"  # 0: tensors between servers go through the client


def peer_copy(src: Tensor, dst: Tensor) -> bool:
    """Copy a tensor from one server to another without it passing through this client
    (rpc/peers.py): :func:`peer_send`, then :func:`peer_wait` at once.  False (tensor_copy then
    goes through this client) where the sender cannot reach the receiver, said once per pair."""
    tag = peer_send(src, dst)
    if tag is None:
        return False
    peer_wait(dst, tag)
    return True


def peer_send(src: Tensor, dst: Tensor) -> int | None:
    """Tell the server holding ``src`` to send it to the server of ``dst``, tagged (the first
    time, introduce the two); it answers nothing now.  The tag for :func:`peer_wait`, or None
    where the sender cannot reach the receiver (said once per pair).  Sent as soon as ``src``
    is computed, the receiver keeps it until its wait: the sender does not hold it back while
    it computes what comes next."""
    sender, receiver = src.buffer.conn, dst.buffer.conn
    if not PEERS:
        return None
    link = receiver.links_from.get(sender)
    if link is None:
        try:
            token = bytes(receiver.request(Command.PEER_TOKEN)[0])
            link = sender.request(Command.PEER_CONNECT, P.PEER_CONNECT.pack(token), [receiver.numeric_endpoint.encode()],
                                  reply=P.U32)[0][0]
        except RPCError as e:
            if sender.closed_reason is not None or receiver.closed_reason is not None:
                raise
            log.warning("RPC: %s cannot send tensors to %s itself (%s); they go through this client",
                        sender.endpoint, receiver.endpoint, e)
            link = 0
        receiver.links_from[sender] = link
    if not link:
        return None
    receiver.peer_tag = tag = (receiver.peer_tag + 1) & 0xFFFFFFFF
    sender.send(Command.COPY_TO_PEER, P.COPY_TO_PEER.pack(link, tag) + wire(src).pack() + wire(dst).pack())
    sender.flush()  # the receiver will wait for it: it must not wait in our queue
    return tag


def peer_wait(dst: Tensor, tag: int) -> None:
    """Tell the server of ``dst`` to hold this session's next requests until ``tag`` arrived."""
    dst.buffer.conn.send(Command.WAIT_PEER, P.U32.pack(tag))


_BUFFER, _OFFSET = attrgetter("buffer"), attrgetter("offset")


class RPCBackend(Backend):
    def __init__(self, device: RPCDevice) -> None:
        self.device = device
        self._slots: OrderedDict[int, tuple[Graph, tuple, int]] = OrderedDict()  # id(graph) -> (graph, placement, slot)
        self._slot_tensors: dict[int, int] = {}  # slot -> tensors of the graph the server keeps there
        self._slot_generation: dict[int, int] = {}  # slot -> how many graphs it has held (steps.KeptStep)
        self._errors_seen = device.conn.errors
        self.recomputes = 0

    def get_name(self) -> str:
        return self.device.get_name()

    def get_device(self) -> RPCDevice:
        return self.device

    def graph_compute(self, graph: Graph) -> None:
        """Send the graph (or only "run slot N again") without waiting, as ggml-rpc does: the
        next request that reads a result waits for it, and a failure is reported there."""
        conn = self.device.conn
        if conn.errors != self._errors_seen:  # after a failure the server's slots may not be what we think
            self._slots.clear()
            self._slot_tensors.clear()
            self._errors_seen = conn.errors
        # sources are rewired and tensors placed only when the scheduler splits a graph, which
        # makes new Graph objects; a cheap check of the placement catches direct reuse too
        signature = (tuple(map(_BUFFER, graph.nodes)), tuple(map(_OFFSET, graph.nodes)))  # (compared by identity)
        entry = self._slots.get(id(graph))
        if entry is not None and entry[0] is graph and entry[1] == signature:
            self._slots.move_to_end(id(graph))
            conn.send(Command.GRAPH_RECOMPUTE, P.RECOMPUTE.pack(self.device.index, entry[2]))
            self.recomputes += 1
            conn.flush()  # the server starts now, while we go on to the next split or micro-batch
            return
        if entry is not None:
            slot = entry[2]
        elif len(self._slots) < P.GRAPH_SLOTS:
            slot = len(self._slots) + 1
        else:
            slot = self._slots.popitem(last=False)[1][2]
        self._slots.pop(id(graph), None)
        payload = serialize_graph(graph, self.device.index, slot)
        n_tensors = P.GRAPH.unpack_from(payload)[3]
        # what the server's slots hold with this graph in its slot (as the server counts it)
        if sum(self._slot_tensors.values()) - self._slot_tensors.get(slot, 0) + n_tensors > P.HELD_GRAPH_TENSORS:
            payload = serialize_graph(graph, self.device.index, 0)  # run once, not kept
            conn.send(Command.GRAPH_COMPUTE, payload)
            conn.flush()
            return
        conn.send(Command.GRAPH_COMPUTE, payload)
        self._slot_tensors[slot] = n_tensors
        self._slot_generation[slot] = self._slot_generation.get(slot, 0) + 1
        self._slots[id(graph)] = (graph, signature, slot)
        conn.flush()  # (see below)

    # -- steps kept on the server (rpc/steps.py) --------------------------------------------------
    def keeps_steps(self) -> bool:
        return True

    def step_begin(self) -> None:
        conn = self.device.conn
        conn.recording, conn.recording_spoiled = [], False

    def step_end(self) -> KeptStep | None:
        """Stop recording; keep what was recorded on the server, unless a request a step cannot
        hold went out meanwhile (None then)."""
        conn = self.device.conn
        requests, conn.recording = conn.recording, None
        if conn.recording_spoiled or not requests or len(requests) > P.MAX_STEP_REQUESTS:
            return None
        body = steps.encode(requests)
        if len(body) > P.MAX_STEP_BYTES // 2:
            return None
        number = conn.steps_kept % P.MAX_STEPS + 1  # (the oldest is replaced: its KeptStep no longer valid)
        conn.steps_kept += 1
        conn.send(Command.STEP_STORE, P.STEP.pack(number), [body])
        slots = {slot: self._slot_generation.get(slot, 0) for slot in steps.slots_of(requests)}
        return KeptStep(number, slots, conn.errors, conn.steps_kept)

    def step_valid(self, step: KeptStep) -> bool:
        conn = self.device.conn
        return (conn.errors == step.errors and conn.closed_reason is None
                and conn.steps_kept - step.serial < P.MAX_STEPS
                and all(self._slot_generation.get(slot, 0) == g for slot, g in step.slots.items()))

    def step_run(self, step: KeptStep) -> None:
        conn = self.device.conn
        conn.send(Command.STEP_RUN, P.STEP.pack(step.number))
        conn.flush()

    def synchronize(self) -> None:
        """Nothing to wait for here: every later request to this server is answered only
        after the graph ran (one connection, served in order)."""

    def supports_op(self, op: Tensor) -> bool:
        return self.device.supports_op(op)


def serialize_graph(graph: Graph, device: int, slot: int) -> bytes:
    """GRAPH_COMPUTE's payload: the nodes in order, then every tensor they touch."""
    tensors: dict[int, bytes] = {}
    for n in graph.nodes:
        tensors[id(n)] = wire(n, srcs=True).pack()
    for n in graph.nodes:
        for s in [*n.src, n.view_src]:
            if s is not None and id(s) not in tensors:
                tensors[id(s)] = wire(s).pack()
    ids = np.array([id(n) for n in graph.nodes], dtype="<u8").tobytes()
    return P.GRAPH.pack(device, slot, len(graph.nodes), len(tensors)) + ids + b"".join(tensors.values())


class RPCDevice(Device):
    """Device ``index`` of the server at ``conn.endpoint``."""

    def __init__(self, conn: Connection, index: int) -> None:
        self.conn = conn
        self.index = index
        info, frames = conn.request(Command.GET_DEVICE_INFO, P.U32.pack(index), reply=P.DEVICE_INFO)
        dtype, _, _, self.alignment, self.max_size, exact, speed = info
        self.speed = speed if math.isfinite(speed) and speed > 0 else None  # (unknown: place by memory)
        if len(frames) != 3:
            raise RPCError(conn.endpoint, "malformed device description")
        self.remote_name = bytes(frames[0]).decode("utf-8", "replace")
        self.description = bytes(frames[1]).decode("utf-8", "replace")
        self.ops = frozenset(np.frombuffer(frames[2], dtype="<u2").tolist())
        self.type = DeviceType(dtype) if dtype in DeviceType._value2member_map_ else DeviceType.ACCEL
        self.exact_alloc_size = bool(exact)
        self.name = f"RPC[{conn.endpoint}]" + (f"#{index}" if index else "")
        self.buft = RPCBufferType(self)

    def get_name(self) -> str:
        return self.name

    def get_description(self) -> str:
        return f"{self.remote_name} - {self.description}"

    def get_memory(self) -> tuple[int, int]:
        return self.conn.request(Command.GET_DEVICE_MEMORY, P.U32.pack(self.index), reply=P.DEVICE_MEMORY)[0]

    def get_type(self) -> DeviceType:
        return self.type

    def batch_rules(self, products: Collection[Type] = ()) -> BatchRules:
        """A pyggml server's CPU computes with our CPU's kernels (the protocol's version says
        which); anything else by the rules that hold for any weights."""
        if self.conn.pyggml_extensions and self.type == DeviceType.CPU:
            from pyggml.cpu.device import cpu_batch_rules
            return cpu_batch_rules(products)
        return BATCH_RULES

    def init_backend(self) -> RPCBackend:
        return RPCBackend(self)

    def get_buffer_type(self) -> BufferType:
        return self.buft

    def limitations(self) -> list[str]:
        return self.conn.limitations()

    def connection(self) -> Connection:
        return self.conn

    def get_speed(self) -> float | None:
        return self.speed

    def supports_op(self, op: Tensor) -> bool:
        if op.op in (Op.NONE, Op.VIEW, Op.RESHAPE, Op.PERMUTE, Op.TRANSPOSE):
            return True
        if not self.conn.pyggml_extensions:  # a llama.cpp server (rpc/ggml_client.py)
            return self.conn.runs(op)
        return int(op.op) in self.ops


def connect(endpoints: str | list[str] | tuple[str, ...] | None, key: ssl.SSLContext | None = None,
            connect_timeout: float | None = None) -> list[RPCDevice]:
    """Every device of every server, in the order given (device ids start with these).

    Each endpoint is reached (and greeted) before anything else happens, so an unreachable
    server is reported before any weights move."""
    kwargs = {} if connect_timeout is None else {"connect_timeout": connect_timeout}
    devices: list[RPCDevice] = []
    for ep in P.parse_endpoints(endpoints):
        if ep.startswith("ggml://"):  # a llama.cpp rpc-server (rpc/ggml_client.py)
            from .ggml_client import GgmlConnection
            conn = GgmlConnection(ep, key, **kwargs)
        else:
            conn = Connection(ep, key, **kwargs)
        devices.extend(RPCDevice(conn, i) for i in range(conn.n_devices))
    return devices

