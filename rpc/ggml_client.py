"""``--rpc ggml://HOST:PORT``: a llama.cpp ``rpc-server`` as one of our devices.

:class:`GgmlConnection` is a :class:`.client.Connection` to the rest of pyggml: the RPC backend
sends it the requests of our protocol, and it turns each into ggml-rpc's (:mod:`.ggml_wire`)
and ggml-rpc's answers back into ours.  What ggml-rpc has no word for is done here:

- a buffer's address: ALLOC_BUFFER is followed by BUFFER_GET_BASE, and every tensor record
  carries the base plus its offset;
- graph slots: ggml-rpc's server keeps one graph per device (GRAPH_RECOMPUTE runs the last
  one), and forgets it whenever a buffer is freed.  Our backend keeps several per device, so
  the connection keeps each slot's serialized graph and sends it again when another ran since;
- replies: ggml-rpc answers only some commands, in order, without sequence numbers; where our
  backend waits for an answer ggml-rpc does not give, the answer is made here, in its turn;
- what it cannot do is refused by name (links between servers, kept steps, the server's GGUF
  files, LZ4): a link falls back to copies through this client, the rest is never asked for.

A llama.cpp server closes the connection on any error: that is an :class:`RPCError` here, as a
dead server is (failover treats both alike).  It sends no heartbeats, so a long compute is
waited for up to the request timeout.
"""
from __future__ import annotations

import socket
import time
from collections import Counter, deque
from dataclasses import dataclass

import numpy as np

from pyggml.opdefs import GluParams, Op
from pyggml.tensor import Tensor
from pyggml.types import Type

from . import ggml_wire as G
from . import protocol as P
from . import transport
from .client import CONNECT_TIMEOUT_S, REQUEST_TIMEOUT_S, SEND_TIMEOUT_S, Connection, _split
from .ggml_wire import GgmlCommand
from .protocol import Command, RPCError, Status, WireTensor

# ops a llama.cpp server runs as we do: all of ours, but TOP_K and ARGSORT (ggml leaves the order of
# ties open; ours keep the lower index first, which the sampler and expert routing rely on)
GGML_OPS = frozenset(int(op) for op in Op) - {int(Op.TOP_K), int(Op.ARGSORT)}


def ggml_runs(node: Tensor) -> bool:
    """Whether a llama.cpp server computes ``node`` as we do.  A node it cannot run must never
    reach it: its CPU backend asserts, and the assertion ends the whole server process.  Found
    by running tests/test_backend_ops.py against llama.cpp's ggml-rpc-server."""
    if int(node.op) not in GGML_OPS:
        return False
    src = [s for s in node.src if s is not None]
    if node.op == Op.MUL_MAT:  # ggml asserts rows of contiguous elements; runs are ours
        return len(src) == 2 and all(s.nb[0] == s.type.type_size for s in src)
    if node.op == Op.MUL_MAT_ID:
        return len(src) == 3
    if node.op == Op.GLU and len(src) == 2:  # ggml ignores "swapped" when the halves are two tensors
        return not GluParams.of(node).swapped
    if node.op == Op.FLASH_ATTN_EXT:  # ggml's CPU kernel reads the mask as F16 whatever its type
        return len(src) < 4 or src[3].type == Type.F16
    return True
CUDA_ROW_PAD = 512  # ggml's CUDA backend pads quantized rows to this: it must be asked for the size


@dataclass
class _Ticket:
    """One answer our backend waits for (``seq``), in the order ggml-rpc answers: read from the
    wire (``size`` bytes, or any with -1), or made here (``ready``)."""
    seq: int | None
    size: int = -1
    wire: bool = True
    make: object = None  # bytes of the wire reply -> our reply's parts
    ready: list | None = None


class GgmlChannel:
    """A plain TCP connection speaking ggml-rpc's framing."""

    def __init__(self, host: str, port: int, timeout: float) -> None:
        self.sock = socket.create_connection((host, port), timeout=timeout)
        transport.tune(self.sock)
        self.sock.settimeout(None)

    def send(self, parts: list, timeout: float) -> int:
        self.sock.settimeout(timeout)
        try:
            views = [transport.as_bytes(p) for p in parts]
            total = sum(v.nbytes for v in views)
            if total < CORK:
                self.sock.sendall(b"".join(views))
            else:
                for v in views:
                    self.sock.sendall(v)
            return total
        finally:
            self.sock.settimeout(None)

    def recv_exact(self, n: int, deadline: float) -> memoryview:
        buf = memoryview(bytearray(n))
        got = 0
        while got < n:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("deadline")
            self.sock.settimeout(left)
            try:
                k = self.sock.recv_into(buf[got:], n - got)
            finally:
                self.sock.settimeout(None)
            if k == 0:
                raise transport.Closed("the server closed the connection")
            got += k
        return buf

    def peer_address(self) -> str:
        host, port = self.sock.getpeername()[:2]
        return f"{host}:{port}"

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


class GgmlConnection(Connection):
    """One llama.cpp ``rpc-server`` (ggml-rpc 7.x), behind our protocol's requests."""

    compression = "off"     # ggml-rpc sends bytes as they are
    pyggml_extensions = False
    inits_tensors = True    # INIT_TENSOR where ggml's client sends it (CUDA pads quantized rows)

    def __init__(self, endpoint: str, key=None, connect_timeout: float = CONNECT_TIMEOUT_S,
                 timeout: float = REQUEST_TIMEOUT_S) -> None:  # noqa: D107 - (Connection's attributes)
        self.endpoint = endpoint
        self.timeout = timeout
        self.seq = 0
        self.bytes_sent = self.bytes_received = 0
        self.closed_reason = None
        self.errors = 0
        self.leaving = False
        self.wait_seconds = 0.0
        self.round_trips = 0
        self.sent: Counter = Counter()
        self.links_from = {}
        self.peer_tag = 0
        self.recording = None
        self.recording_spoiled = False
        self.steps_kept = 0
        self.server_has_cache = False
        self.server_files: dict = {}
        self.loaded = {"disk": 0, "cache": 0, "wire": 0}
        self.warned_versions: set[str] = set()
        self._unread: set[int] = set()
        self._early: dict = {}
        self._corked: list = []
        self._corked_bytes = 0
        self._pending: deque[_Ticket] = deque()   # answers not yet read, in ggml-rpc's order
        self._answered: dict[int, list] = {}       # seq -> our reply's parts, read early
        self.bases: dict[int, int] = {}            # buffer handle (remote_ptr) -> its address
        self._graphs: dict[tuple[int, int], tuple[bytes, set[int]]] = {}  # (device, slot) -> graph, handles
        self._last: dict[int, int | None] = {}     # device -> the slot of the graph its server keeps
        import threading
        self._lock = threading.Lock()  # (a Connection's: one request at a time)
        self.channel = None
        if key is not None:
            self._fail("ggml-rpc has no TLS: a llama.cpp server takes no key (leave out --rpc-key for ggml://)")
        host, port = _split(endpoint.removeprefix("ggml://"))
        try:
            self.channel = GgmlChannel(host, port, connect_timeout)
        except ConnectionRefusedError:
            self._fail("connection refused (is llama.cpp's rpc-server running there?)")
        except (TimeoutError, socket.timeout):
            self._fail(f"cannot reach the server within {connect_timeout:.0f} s")
        except OSError as e:
            self._fail(f"cannot connect: {e.strerror or e}")
        hello = self._exchange(GgmlCommand.HELLO, bytes(G.CAPS_BYTES), G.HELLO_REPLY.size, connect_timeout)
        major, minor, patch, _, _ = G.HELLO_REPLY.unpack(hello)
        if major != G.MAJOR or minor > G.MINOR:
            self._fail(f"the server speaks ggml-rpc {major}.{minor}.{patch}; this pyggml speaks {G.MAJOR}.{G.MINOR}.x "
                       f"(the llama.cpp of ../shared/bin/build-llamacpp)")
        self.server_version = f"{major}.{minor}.{patch}"
        (self.n_devices,) = G.U32.unpack(self._exchange(GgmlCommand.DEVICE_COUNT, b"", 4, connect_timeout))
        self.chunk_bytes = P.CHUNK_BYTES
        self.rtt = self.round_trip_time()

    @property
    def numeric_endpoint(self) -> str:
        return self.channel.peer_address()

    def runs(self, node: Tensor) -> bool:
        return ggml_runs(node)

    def limitations(self) -> list[str]:
        return [f"a llama.cpp rpc-server (ggml-rpc {self.server_version}): no TLS, no LZ4, no --gguf, no links to "
                f"other servers (tensors between servers pass through this client); TOP_K, ARGSORT and attention "
                f"with an F32 mask run elsewhere"]

    # -- the wire -------------------------------------------------------------------------------
    def _put(self, cmd: GgmlCommand, *parts) -> None:
        size = sum(memoryview(p).nbytes for p in parts)
        self.sent[cmd.name] += 1
        small = size < CORK and self._corked_bytes + size < CORK
        head = G.REQUEST_HEAD.pack(cmd, size)
        self._corked.append(head)
        self._corked.extend(bytes(memoryview(p).cast("B")) if small else p for p in parts)
        self._corked_bytes += len(head) + size
        if not small:
            self._flush()

    def _flush(self) -> None:
        parts, self._corked, self._corked_bytes = self._corked, [], 0
        if not parts:
            return
        try:
            self.bytes_sent += self.channel.send(parts, SEND_TIMEOUT_S + self.timeout)
        except (TimeoutError, socket.timeout):
            self._fail("the server took no bytes (is it stopped?)")
        except OSError as e:
            self._fail(self._broken(e))

    def _read_reply(self, ticket: _Ticket, deadline: float) -> None:
        try:
            (size,) = G.REPLY_HEAD.unpack(self.channel.recv_exact(G.REPLY_HEAD.size, deadline))
            if ticket.size >= 0 and size != ticket.size:
                self._fail(f"a reply of {size} bytes where {ticket.size} were expected")
            body = self.channel.recv_exact(size, deadline) if size else memoryview(b"")
        except TimeoutError:
            self._fail(f"no answer within {self.timeout:.0f} s")
        except (transport.Closed, OSError) as e:
            self._fail(self._broken(e) + " (a llama.cpp server closes the connection on any error: its log says which)")
        self.bytes_received += G.REPLY_HEAD.size + size
        ticket.ready = ticket.make(body) if ticket.make is not None else [body]

    def _settle(self, until: _Ticket | None, deadline: float) -> None:
        """Read the answers in order up to ``until`` (all, with None), keeping our backend's."""
        self._flush()
        while self._pending:
            ticket = self._pending.popleft()
            if ticket.wire:
                self._read_reply(ticket, deadline)
            if ticket.seq is not None:
                self._answered[ticket.seq] = ticket.ready
            if ticket is until:
                return

    def _exchange(self, cmd: GgmlCommand, payload: bytes, size: int, timeout: float) -> memoryview:
        """One request and its answer, now (after every answer still to come)."""
        self._put(cmd, payload)
        ticket = _Ticket(None, size)
        self._pending.append(ticket)
        self._settle(ticket, time.monotonic() + timeout)
        return ticket.ready[0]

    # -- our requests, translated -----------------------------------------------------------------
    def _send(self, cmd: Command, payload: bytes, frames: list, flags: int, more: bool = False) -> int:
        self._check_open()
        self.seq = (self.seq + 1) & 0xFFFFFFFF
        seq = None if flags & P.FLAG_NO_REPLY else self.seq
        translate = TRANSLATE.get(cmd)
        if translate is None:
            raise RPCError(self.endpoint, f"{cmd.name} is not part of ggml-rpc (a llama.cpp server)")
        translate(self, seq, memoryview(payload), frames)
        if not more:
            self._flush()
        return self.seq

    def _answer_now(self, seq: int | None, body: bytes = b"", frames: list | tuple = ()) -> None:
        """An answer made here, given in its turn (after those still to come from the server)."""
        if seq is not None:
            self._pending.append(_Ticket(seq, wire=False, ready=[body, *frames]))

    def _ask(self, seq: int | None, cmd: GgmlCommand, parts: list, size: int = -1, make=None) -> None:
        self._put(cmd, *parts)
        self._pending.append(_Ticket(seq, size, make=make))

    def _wait(self, seq: int, cmd: Command, timeout: float) -> list:
        if seq not in self._answered:
            ticket = next((t for t in self._pending if t.seq == seq), None)
            if ticket is None:
                self._fail(f"no answer is due for {cmd.name}")
            self._settle(ticket, time.monotonic() + timeout)
        body, *frames = self._answered.pop(seq)
        return [P.HEADER.pack(Status.OK, 0, 0, seq) + bytes(body), *frames]

    def answers(self, timeout: float = 5.0) -> bool:
        if self.closed_reason is not None:
            return False
        try:
            with self._lock:
                self._exchange(GgmlCommand.DEVICE_COUNT, b"", 4, timeout)
        except RPCError:
            return False
        return True

    def _base(self, handle: int) -> int:
        base = self.bases.get(handle)
        if base is None:
            raise RPCError(self.endpoint, f"unknown buffer {handle:#x}")
        return base

    def _tensor(self, payload: memoryview, at: int = 0, compute: bool = False) -> bytes:
        return G.to_ggml(WireTensor.unpack_from(payload, at), self._base, compute)

    # one function per command of ours: (self, seq, payload, frames)
    def _device_count(self, seq, payload, frames) -> None:
        self._ask(seq, GgmlCommand.DEVICE_COUNT, [], 4)

    def _device_info(self, seq, payload, frames) -> None:
        (device,) = P.U32.unpack(payload)
        dev = G.U32.pack(device)
        free, total = G.DEVICE_MEMORY.unpack(self._exchange(GgmlCommand.GET_DEVICE_MEMORY, dev, 16, self.timeout))
        (alignment,) = G.U64.unpack(self._exchange(GgmlCommand.GET_ALIGNMENT, dev, 8, self.timeout))
        (max_size,) = G.U64.unpack(self._exchange(GgmlCommand.GET_MAX_SIZE, dev, 8, self.timeout))
        info = P.DEVICE_INFO.pack(1, free, total, alignment, max_size, 0, 0.0)  # (llama.cpp calls it a GPU)
        ops = np.array(sorted(GGML_OPS), dtype="<u2").tobytes()
        self._answer_now(seq, info, [b"llama.cpp rpc-server", f"ggml-rpc {self.server_version}, device {device}".encode(),
                                     ops])

    def _alloc_buffer(self, seq, payload, frames) -> None:
        device, size = P.ALLOC_BUFFER.unpack(payload)
        ptr, real = G.ALLOC_REPLY.unpack(self._exchange(GgmlCommand.ALLOC_BUFFER, G.ALLOC_BUFFER.pack(device, size),
                                                        16, self.timeout))
        if ptr == 0:
            raise RPCError(self.endpoint, f"ALLOC_BUFFER failed: the server could not allocate {size / 2**20:.1f} MiB")
        (self.bases[ptr],) = G.U64.unpack(self._exchange(GgmlCommand.BUFFER_GET_BASE, G.U64.pack(ptr), 8,
                                                         self.timeout))
        self._answer_now(seq, P.ALLOC_REPLY.pack(ptr, real))

    def _get_alloc_size(self, seq, payload, frames) -> None:
        device = P.U32.unpack_from(payload)[0]
        w = WireTensor.unpack_from(payload, P.U32.size)
        t = Tensor(Type(w.type), w.ne, w.nb)
        if not (t.type.is_quantized and w.ne[0] % CUDA_ROW_PAD):
            self._answer_now(seq, P.U64.pack(t.nbytes()))
            return
        record = G.to_ggml(w, self._base)
        self._ask(seq, GgmlCommand.GET_ALLOC_SIZE, [G.U32.pack(device), record, bytes(P.MAX_SRC * G.TENSOR.size)], 8,
                  make=lambda body: [P.U64.pack(max(G.U64.unpack(body)[0], t.nbytes()))])

    def _no_reply(self, seq, cmd: GgmlCommand, parts: list) -> None:
        self._put(cmd, *parts)
        self._answer_now(seq)

    def _buffer_clear(self, seq, payload, frames) -> None:
        self._no_reply(seq, GgmlCommand.BUFFER_CLEAR, [bytes(payload)])

    def _free_buffer(self, seq, payload, frames) -> None:
        (handle,) = P.U64.unpack(payload)
        self.bases.pop(handle, None)
        self._last.clear()  # (the server forgets its graphs when a buffer goes)
        for key in [k for k, (_, handles) in self._graphs.items() if handle in handles]:
            del self._graphs[key]
        self._no_reply(seq, GgmlCommand.FREE_BUFFER, [bytes(payload)])

    def _init_tensor(self, seq, payload, frames) -> None:
        self._no_reply(seq, GgmlCommand.INIT_TENSOR, [self._tensor(payload)])

    def _set_tensor(self, seq, payload, frames) -> None:
        offset, size, codec, _ = P.SET_TENSOR.unpack_from(payload, P.TENSOR.size)
        data = P.decompress(codec, frames[0], size)
        self._no_reply(seq, GgmlCommand.SET_TENSOR, [self._tensor(payload), G.SET_TENSOR_TAIL.pack(0, offset), data])

    def _get_tensor(self, seq, payload, frames) -> None:
        offset, size, _ = P.GET_TENSOR.unpack_from(payload, P.TENSOR.size)
        self._ask(seq, GgmlCommand.GET_TENSOR, [self._tensor(payload), G.GET_TENSOR_TAIL.pack(offset, size)], size,
                  make=lambda body: [P.GET_REPLY.pack(size, P.Codec.RAW), body])

    def _copy_tensor(self, seq, payload, frames) -> None:
        self._ask(seq, GgmlCommand.COPY_TENSOR, [self._tensor(payload), self._tensor(payload, P.TENSOR.size)], 1)

    def _memset_tensor(self, seq, payload, frames) -> None:
        self._no_reply(seq, GgmlCommand.MEMSET_TENSOR, [self._tensor(payload), bytes(payload[P.TENSOR.size:])])

    def _graph_compute(self, seq, payload, frames) -> None:
        device, slot, n_nodes, n_tensors = P.GRAPH.unpack_from(payload)
        at = P.GRAPH.size + 8 * n_nodes
        ids = payload[P.GRAPH.size:at]
        nodes = set(np.frombuffer(ids, dtype="<u8").tolist())
        records, handles = [], set()
        for i in range(n_tensors):
            w = WireTensor.unpack_from(payload, at + i * P.TENSOR.size)
            # (use_count 0: ggml fuses RMS_NORM into the MUL after it only where the norm has one
            # use, and then never writes the norm; another split of ours may read it)
            records.append(G.to_ggml(w, self._base, compute=w.id in nodes))
            handles.add(w.buffer)
        graph = G.GRAPH_HEAD.pack(device, n_nodes) + bytes(ids) + G.U32.pack(n_tensors) + b"".join(records)
        if slot:
            self._graphs[(device, slot)] = (graph, handles)
        self._last[device] = slot or None
        self._no_reply(seq, GgmlCommand.GRAPH_COMPUTE, [graph])

    def _graph_recompute(self, seq, payload, frames) -> None:
        device, slot = P.RECOMPUTE.unpack(payload)
        if slot and self._last.get(device) == slot:
            self._no_reply(seq, GgmlCommand.GRAPH_RECOMPUTE, [G.U32.pack(device)])
            return
        entry = self._graphs.get((device, slot))
        if entry is None:
            raise RPCError(self.endpoint, f"GRAPH_RECOMPUTE failed: no graph in slot {slot} for device {device}")
        self._last[device] = slot
        self._no_reply(seq, GgmlCommand.GRAPH_COMPUTE, [entry[0]])


CORK = 64 << 10


def _forward(cmd: GgmlCommand, size: int):
    """A command whose payload and reply are the same in both protocols."""
    def ask(self: GgmlConnection, seq, payload, frames) -> None:
        self._ask(seq, cmd, [bytes(payload)], size)
    return ask


TRANSLATE = {
    Command.DEVICE_COUNT: GgmlConnection._device_count,
    Command.GET_DEVICE_INFO: GgmlConnection._device_info,
    Command.GET_DEVICE_MEMORY: _forward(GgmlCommand.GET_DEVICE_MEMORY, 16),
    Command.GET_ALIGNMENT: _forward(GgmlCommand.GET_ALIGNMENT, 8),
    Command.GET_MAX_SIZE: _forward(GgmlCommand.GET_MAX_SIZE, 8),
    Command.ALLOC_BUFFER: GgmlConnection._alloc_buffer,
    Command.GET_ALLOC_SIZE: GgmlConnection._get_alloc_size,
    Command.BUFFER_CLEAR: GgmlConnection._buffer_clear,
    Command.FREE_BUFFER: GgmlConnection._free_buffer,
    Command.INIT_TENSOR: GgmlConnection._init_tensor,
    Command.SET_TENSOR: GgmlConnection._set_tensor,
    Command.GET_TENSOR: GgmlConnection._get_tensor,
    Command.COPY_TENSOR: GgmlConnection._copy_tensor,
    Command.MEMSET_TENSOR: GgmlConnection._memset_tensor,
    Command.GRAPH_COMPUTE: GgmlConnection._graph_compute,
    Command.GRAPH_RECOMPUTE: GgmlConnection._graph_recompute,
}
"""Our commands a llama.cpp server can serve; the others (links, kept steps, files, the hash
cache by SHA-256) are refused here by name."""
