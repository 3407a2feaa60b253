"""The RPC server: local devices offered to remote clients over ZeroMQ (ggml-rpc's server).

One ROUTER socket, one thread: requests are served in the order they arrive, each
client in its own session (named by its ZeroMQ routing id) that sees only the buffers
it allocated.  A session ends when its connection does - the server watches its
socket's monitor for disconnects and frees that client's buffers - so a client killed
mid-command leaves nothing behind.  Every request is checked (see :mod:`.validate`)
before memory is touched; a bad one gets an error reply and the server carries on.

Routing ids.  libzmq lets a connecting peer choose its own id and
numbers the others itself, from a counter that starts at C's ``rand()``; it aborts the whole
process when a number it hands out is one a peer already chose.  libzmq never seeds
``rand()``, so the numbers were the same in every server, and a client that chose the next one
could take the server down with the next honest client's connection.  The server seeds
``rand()`` from the operating system's secrets before it makes its socket, so the numbers are a
secret 32-bit sequence; knowing where it starts and counting handshakes, it refuses a session
to any peer whose id is not one libzmq has handed out (a client-chosen id), and a request that
comes in on another connection than its session's HELLO.  This makes the abort a guess, not
impossible: a client holding many chosen ids while it sweeps the counter with connections of
its own can still hit one.  Only a transport whose ids peers cannot choose ends it.

What one session may hold is bounded (:class:`Limits`): buffers, graph slots, unread replies
(a client that stops reading loses its session instead of stalling the server), frames and
bytes per request; what a graph may cost is bounded by the bytes the session owns
(:func:`.validate.check_cost`).
"""
from __future__ import annotations

import ctypes
import logging
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import zmq
import zmq.utils.monitor

from pyggml.backend import Backend, Buffer, Device
from pyggml.graph import Graph
from pyggml.tensor import Tensor
from pyggml.types import Type

from . import protocol as P
from .cache import TensorCache
from .files import ServerFiles
from .protocol import Command, ProtocolError, Status, unpack
from .validate import REBUILD, check_cost, read_graph, read_tensor, tensor_extent, tensor_from_wire

log = logging.getLogger("pyggml.rpc.server")

HEARTBEAT_MS = 1000
HEARTBEAT_TIMEOUT_MS = 5000


@dataclass(frozen=True)
class Limits:
    """What one session may hold at once; a request beyond a limit is refused by name."""
    buffers: int = 4096            # a model takes a few per device (weights, cache, compute)
    pending_replies: int = 16      # answers the client has not read (the ROUTER's send high-water mark)
    queued_requests: int = 16      # requests received and not yet served (its receive high-water mark)
    frames: int = P.MAX_FRAMES     # frames of one request, the header included


class RoutingIds:
    """The routing ids libzmq's ROUTER hands out: a zero byte, then a 32-bit counter that starts
    at ``rand() | rand() << 31`` when the socket is made.  :meth:`seed` (call it just before
    making the socket) seeds C's ``rand()`` with 32 secret bits and works out where the counter
    starts; every successful handshake may take the next number."""

    def __init__(self) -> None:
        self.first: int | None = None
        self.handshakes = 0

    def seed(self) -> None:
        try:
            libc = ctypes.CDLL(None)
            seed = ctypes.c_uint(secrets.randbits(32))
            libc.srand(seed)
            low, high = libc.rand(), libc.rand()
            libc.srand(seed)  # libzmq draws the same two numbers again
        except (OSError, AttributeError):
            log.warning("cannot seed the C library's rand(): routing ids are predictable")
            return
        self.first = ((high << 31) | low) & 0xFFFFFFFF

    def handed_out(self, identity: bytes) -> bool:
        """Whether libzmq numbered this peer itself (rather than the peer choosing its id)."""
        if len(identity) != 5 or identity[0] != 0:
            return False
        if self.first is None:
            return True
        return (int.from_bytes(identity[1:], "big") - self.first) % (1 << 32) < self.handshakes


@dataclass
class ServedDevice:
    device: Device
    backend: Backend
    mem_limit: int
    used: int = 0

    def memory(self) -> tuple[int, int]:
        free, total = self.device.get_memory()
        total = min(total, self.mem_limit)
        return max(0, min(free, total - self.used)), total


@dataclass
class Session:
    identity: bytes
    fd: int
    peer: str = "?"
    buffers: dict[int, tuple[int, Buffer]] = field(default_factory=dict)   # handle -> (device, buffer)
    graphs: dict[int, tuple[int, Graph, set[int]]] = field(default_factory=dict)  # slot -> (device, graph, handles)
    deferred_error: str | None = None
    cached: int = 0  # bytes this session has written into the tensor cache

    def owned(self) -> int:
        """Bytes of the buffers this session holds."""
        return sum(buf.get_size() for _, buf in self.buffers.values())

    def lookup(self, handle: int) -> Buffer:
        entry = self.buffers.get(handle)
        if entry is None:
            raise ProtocolError(f"unknown buffer handle {handle:#x}")
        return entry[1]


Reply = tuple[bytes, list]
Handler = Callable[[Session, memoryview, list], Reply]


class RPCServer:
    def __init__(self, devices: list[Device], host: str = "127.0.0.1", port: int = 0, mem: int | None = None,
                 cache_dir: str | None = None, max_message: int = P.DEFAULT_MAX_MESSAGE,
                 curve_secret_key: bytes | None = None, cache_max: int = P.DEFAULT_CACHE_MAX,
                 limits: Limits = Limits(), files: ServerFiles | None = None) -> None:
        if not devices:
            raise ValueError("the server needs at least one device")
        self.devices = [ServedDevice(d, d.init_backend(), mem if mem is not None else 1 << 62) for d in devices]
        self.cache = TensorCache(cache_dir, cache_max) if cache_dir else None
        self.files = files if files is not None and files.files else None
        self.max_message = max_message
        self.limits = limits
        self.sessions: dict[bytes, Session] = {}
        self._ended: OrderedDict[bytes, str] = OrderedDict()  # why recent sessions were ended by the server
        self.ctx = zmq.Context.instance()
        self.routing_ids = RoutingIds()
        self.routing_ids.seed()  # just before the ROUTER exists: it draws its first routing id when made
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        # libzmq checks the size of each frame as it arrives; the total and the frame count of a
        # request are checked when it is whole (the README's security notes say what that leaves)
        self.sock.setsockopt(zmq.MAXMSGSIZE, max_message + (1 << 20))
        self.sock.setsockopt(zmq.RCVHWM, limits.queued_requests)
        self.sock.setsockopt(zmq.SNDHWM, limits.pending_replies)
        self.sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_MS)
        self.sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a reply to a vanished client is an error, not a hang
        if curve_secret_key:
            self.sock.curve_secretkey = curve_secret_key
            self.sock.curve_publickey = zmq.curve_public(curve_secret_key)
            self.sock.curve_server = True
        self.monitor = self.sock.get_monitor_socket(zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED)
        if port:
            self.sock.bind(f"tcp://{host}:{port}")
        else:
            port = self.sock.bind_to_random_port(f"tcp://{host}")
        self.endpoint = f"{host}:{port}"
        self.handlers: dict[Command, Handler] = {
            Command.DEVICE_COUNT: self._device_count,
            Command.GET_DEVICE_MEMORY: self._get_device_memory,
            Command.GET_DEVICE_INFO: self._get_device_info,
            Command.ALLOC_BUFFER: self._alloc_buffer,
            Command.GET_ALIGNMENT: self._get_alignment,
            Command.GET_MAX_SIZE: self._get_max_size,
            Command.GET_ALLOC_SIZE: self._get_alloc_size,
            Command.BUFFER_CLEAR: self._buffer_clear,
            Command.FREE_BUFFER: self._free_buffer,
            Command.INIT_TENSOR: self._init_tensor,
            Command.SET_TENSOR: self._set_tensor,
            Command.SET_TENSOR_HASH: self._set_tensor_hash,
            Command.SET_TENSOR_FILE: self._set_tensor_file,
            Command.GET_TENSOR: self._get_tensor,
            Command.COPY_TENSOR: self._copy_tensor,
            Command.MEMSET_TENSOR: self._memset_tensor,
            Command.GRAPH_COMPUTE: self._graph_compute,
            Command.GRAPH_RECOMPUTE: self._graph_recompute,
        }
        self.running = False

    # -- the loop -----------------------------------------------------------------------------------
    def serve_forever(self) -> None:
        self.running = True
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        poller.register(self.monitor, zmq.POLLIN)
        try:
            while self.running:
                events = dict(poller.poll(500))
                self._drain_monitor()  # disconnects first: an fd may be reused by the next client
                if self.sock in events:
                    self._serve_one(self.sock.recv_multipart(copy=False))
        finally:
            self.close()

    def stop(self) -> None:
        self.running = False

    def close(self) -> None:
        for s in list(self.sessions.values()):
            self._end_session(s)
        self.sock.disable_monitor()  # before closing the monitor (see client.Connection.close)
        self.monitor.close(linger=0)
        self.sock.close(linger=0)

    def _drain_monitor(self) -> None:
        while self.monitor.poll(0):
            ev = zmq.utils.monitor.recv_monitor_message(self.monitor)
            if ev["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self.routing_ids.handshakes += 1
            elif ev["event"] == zmq.EVENT_DISCONNECTED:
                for s in [s for s in self.sessions.values() if s.fd == ev["value"]]:
                    log.info("client %s (%s) disconnected; its %d buffer(s) freed", s.identity.hex(), s.peer,
                             len(s.buffers))
                    self._end_session(s)

    def _end_session(self, s: Session) -> None:
        for handle in list(s.buffers):
            self._release(s, handle)
        s.graphs.clear()
        self.sessions.pop(s.identity, None)

    def _serve_one(self, frames: list[zmq.Frame]) -> None:
        identity = frames[0].bytes
        if len(frames) < 2:
            return
        head = frames[1].buffer
        data = [f.buffer for f in frames[2:]]
        seq, no_reply = 0, False
        try:
            if len(head) < P.HEADER.size:
                raise ProtocolError(f"message of {len(head)} bytes is shorter than a header")
            cmd_no, flags, _, seq = P.HEADER.unpack_from(head)
            no_reply = bool(flags & P.FLAG_NO_REPLY)
            if len(frames) - 1 > self.limits.frames:
                raise ProtocolError(f"a request of {len(frames) - 1} frames; the limit is {self.limits.frames}")
            total = sum(len(f) for f in frames[1:])
            if total > self.max_message:
                raise ProtocolError(f"a request of {total} bytes exceeds this server's --max-message of "
                                    f"{self.max_message}")
            try:
                cmd = Command(cmd_no)
            except ValueError:
                raise ProtocolError(f"unknown command {cmd_no}") from None
            payload = head[P.HEADER.size:]
            fd = frames[1].get(zmq.SRCFD)
            if cmd == Command.HELLO:
                reply = self._hello(identity, fd, payload, data, _peer(frames[1]))
            else:
                session = self.sessions.get(identity)
                if session is None:
                    raise ProtocolError(self._ended.get(identity, "HELLO must come first"))
                if session.fd != fd:
                    raise ProtocolError("this request came on another connection than its session's HELLO")
                if session.deferred_error and not no_reply:
                    err, session.deferred_error = session.deferred_error, None
                    raise ProtocolError(f"an earlier request failed: {err}")
                t0 = time.perf_counter()
                reply = self.handlers[cmd](session, payload, data)
                if log.isEnabledFor(logging.DEBUG):
                    log.debug("%s took %.3f ms", cmd.name, (time.perf_counter() - t0) * 1000)
            if not no_reply:
                self._send(identity, Status.OK, seq, *reply)
        except Exception as e:  # noqa: BLE001 - whatever happened, answer and keep serving
            if not isinstance(e, (ProtocolError, ValueError, IndexError, MemoryError)):
                log.exception("unexpected error serving a request")
            message = str(e) or type(e).__name__
            log.info("refused a request: %s", message)
            session = self.sessions.get(identity)
            if no_reply:
                if session is not None and session.deferred_error is None:
                    session.deferred_error = message
            else:
                self._send(identity, Status.ERROR, seq, message.encode("utf-8", "replace"), [])

    def _send(self, identity: bytes, status: Status, seq: int, payload: bytes, frames: list) -> None:
        try:
            self.sock.send_multipart([identity, P.HEADER.pack(status, 0, 0, seq) + payload, *frames], copy=False,
                                     flags=zmq.NOBLOCK)
        except zmq.Again:  # its answers pile up unread: waiting for it would stall every other client
            session = self.sessions.get(identity)
            if session is not None:
                log.warning("client %s (%s) leaves %d replies unread (the limit); its session is ended and its "
                            "%d buffer(s) freed", identity.hex(), session.peer, self.limits.pending_replies,
                            len(session.buffers))
                self._end_session(session)
                self._ended[identity] = (f"this session was ended: it left {self.limits.pending_replies} replies "
                                         f"unread (the limit per session)")
                while len(self._ended) > 256:
                    self._ended.popitem(last=False)
        except zmq.ZMQError as e:  # the client went away before its answer
            log.info("cannot answer client %s: %s", identity.hex(), e)

    # -- helpers ------------------------------------------------------------------------------------
    def _device(self, index: int) -> ServedDevice:
        if not 0 <= index < len(self.devices):
            raise ProtocolError(f"unknown device {index}; this server has {len(self.devices)}")
        return self.devices[index]

    @staticmethod
    def _frames(data: list, n: int) -> None:
        if len(data) != n:
            raise ProtocolError(f"expected {n} data frame(s), got {len(data)}")

    def _release(self, s: Session, handle: int) -> None:
        dev, buf = s.buffers.pop(handle)
        self.devices[dev].used -= buf.get_size()
        buf.free()
        for slot in [k for k, (_, _, handles) in s.graphs.items() if handle in handles]:
            del s.graphs[slot]

    @staticmethod
    def _range(t: Tensor, offset: int, size: int) -> None:
        if offset + size > tensor_extent(t):
            raise ProtocolError(f"bytes [{offset}, {offset + size}) outside tensor {t.name!r} "
                                f"({tensor_extent(t)} bytes)")

    # -- commands -----------------------------------------------------------------------------------
    def _hello(self, identity: bytes, fd: int, payload: memoryview, data: list, peer: str = "?") -> Reply:
        magic, version = unpack(P.HELLO, payload)
        if magic != P.MAGIC:
            raise ProtocolError("not a pyggml RPC client")
        if version != P.PROTOCOL_VERSION:
            raise ProtocolError(f"protocol version {version} is not supported; this server speaks "
                                f"version {P.PROTOCOL_VERSION}")
        self._frames(data, 0)
        if not self.routing_ids.handed_out(identity):
            self._drain_monitor()  # the handshake's event may not have been read yet
            if not self.routing_ids.handed_out(identity):
                raise ProtocolError("client-chosen routing ids are refused: connect without ZMQ_ROUTING_ID")
        session = self.sessions.get(identity)
        if session is not None and session.fd != fd:
            raise ProtocolError("this routing id belongs to another connection's session")
        if session is None:
            self.sessions[identity] = Session(identity, fd, peer)
            log.info("client %s connected from %s", identity.hex(), peer)
        flags = (P.SERVER_HAS_CACHE if self.cache is not None else 0) | (P.SERVER_HAS_FILES if self.files else 0)
        listing = [self.files.listing()] if self.files else []
        return P.HELLO_REPLY.pack(P.PROTOCOL_VERSION, len(self.devices), self.max_message, flags), listing

    def _device_count(self, s: Session, payload: memoryview, data: list) -> Reply:
        if len(payload):
            raise ProtocolError("DEVICE_COUNT takes no payload")
        return P.U32.pack(len(self.devices)), []

    def _get_device_memory(self, s: Session, payload: memoryview, data: list) -> Reply:
        (dev,) = unpack(P.U32, payload)
        return P.DEVICE_MEMORY.pack(*self._device(dev).memory()), []

    def _get_device_info(self, s: Session, payload: memoryview, data: list) -> Reply:
        (dev,) = unpack(P.U32, payload)
        sd = self._device(dev)
        buft = sd.device.get_buffer_type()
        free, total = sd.memory()
        info = P.DEVICE_INFO.pack(int(sd.device.get_type()), free, total, buft.get_alignment(),
                                  min(buft.get_max_size(), sd.mem_limit), 1)
        ops = np.array(sorted(supported_ops(sd.device)), dtype="<u2").tobytes()
        return info, [sd.device.get_name().encode(), sd.device.get_description().encode(), ops]

    def _alloc_buffer(self, s: Session, payload: memoryview, data: list) -> Reply:
        dev, size = unpack(P.ALLOC_BUFFER, payload)
        sd = self._device(dev)
        if len(s.buffers) >= self.limits.buffers:
            raise ProtocolError(f"this session holds {len(s.buffers)} buffers, the limit per session")
        free, _ = sd.memory()  # within --mem, and within what the device has free
        if size > free:
            raise ProtocolError(f"allocating {size / 2**20:.1f} MiB on {sd.device.get_name()} exceeds the "
                                f"memory this server offers ({free / 2**20:.1f} MiB left)")
        buft = sd.device.get_buffer_type()
        if size > buft.get_max_size():
            raise ProtocolError(f"a buffer of {size} bytes exceeds the device's maximum")
        buf = buft.alloc_buffer(size)
        handle = secrets.randbits(63) | 1
        s.buffers[handle] = (dev, buf)
        sd.used += buf.get_size()
        return P.ALLOC_REPLY.pack(handle, buf.get_size()), []

    def _get_alignment(self, s: Session, payload: memoryview, data: list) -> Reply:
        (dev,) = unpack(P.U32, payload)
        return P.U64.pack(self._device(dev).device.get_buffer_type().get_alignment()), []

    def _get_max_size(self, s: Session, payload: memoryview, data: list) -> Reply:
        (dev,) = unpack(P.U32, payload)
        sd = self._device(dev)
        return P.U64.pack(min(sd.device.get_buffer_type().get_max_size(), sd.mem_limit)), []

    def _get_alloc_size(self, s: Session, payload: memoryview, data: list) -> Reply:
        (dev,) = unpack(P.U32, payload, exact=False)
        sd = self._device(dev)
        w = P.WireTensor.unpack_from(payload, P.U32.size)
        if len(payload) != P.U32.size + P.TENSOR.size:
            raise ProtocolError("GET_ALLOC_SIZE payload has the wrong size")
        t = tensor_from_wire(w, s.lookup, need_buffer=False)
        return P.U64.pack(sd.device.get_buffer_type().get_alloc_size(t)), []

    def _buffer_clear(self, s: Session, payload: memoryview, data: list) -> Reply:
        handle, value = unpack(P.BUFFER_CLEAR, payload)
        s.lookup(handle).clear(value)
        return b"", []

    def _free_buffer(self, s: Session, payload: memoryview, data: list) -> Reply:
        (handle,) = unpack(P.U64, payload)
        s.lookup(handle)
        self._release(s, handle)
        return b"", []

    def _tensor_and(self, s: Session, payload: memoryview, st) -> tuple[Tensor, tuple]:
        """A request made of one tensor followed by a fixed struct."""
        if len(payload) != P.TENSOR.size + st.size:
            raise ProtocolError(f"payload of {len(payload)} bytes where {P.TENSOR.size + st.size} were expected")
        t, at = read_tensor(payload, s.lookup)
        return t, st.unpack_from(payload, at)

    def _init_tensor(self, s: Session, payload: memoryview, data: list) -> Reply:
        if len(payload) != P.TENSOR.size:
            raise ProtocolError("INIT_TENSOR payload has the wrong size")
        read_tensor(payload, s.lookup)  # placing a tensor needs nothing on these backends beyond the checks
        return b"", []

    def _set_tensor(self, s: Session, payload: memoryview, data: list) -> Reply:
        t, (offset, size, codec, flags) = self._tensor_and(s, payload, P.SET_TENSOR)
        self._frames(data, 1)
        self._range(t, offset, size)
        raw = P.decompress(codec, data[0], size)
        t.buffer.set_tensor(t, raw, offset)
        # weights are worth caching; a session may not store more than it holds in its buffers
        if self.cache is not None and flags & P.FLAG_CACHE and s.cached + size <= s.owned():
            if self.cache.put(raw)[1]:
                s.cached += size
        return b"", []

    def _set_tensor_hash(self, s: Session, payload: memoryview, data: list) -> Reply:
        t, (offset, size, key) = self._tensor_and(s, payload, P.SET_TENSOR_HASH)
        self._frames(data, 0)
        self._range(t, offset, size)
        raw = self.cache.get(key, size) if self.cache is not None else None
        if raw is None:
            return P.U8.pack(0), []
        t.buffer.set_tensor(t, raw, offset)
        return P.U8.pack(1), []

    def _set_tensor_file(self, s: Session, payload: memoryview, data: list) -> Reply:
        t, (offset, size, identity, file_offset) = self._tensor_and(s, payload, P.SET_TENSOR_FILE)
        self._frames(data, 0)
        self._range(t, offset, size)
        if self.files is None:
            raise ProtocolError("this server holds no files (start it with --gguf)")
        t.buffer.set_tensor(t, self.files.get(identity).data(file_offset, size), offset)
        return b"", []

    def _get_tensor(self, s: Session, payload: memoryview, data: list) -> Reply:
        t, (offset, size, codec) = self._tensor_and(s, payload, P.GET_TENSOR)
        self._frames(data, 0)
        self._range(t, offset, size)
        raw = t.buffer.get_tensor(t, offset, size)
        used, body = P.compress(raw) if codec == P.Codec.LZ4 else (P.Codec.RAW, raw)
        return P.GET_REPLY.pack(size, used), [body]

    def _copy_tensor(self, s: Session, payload: memoryview, data: list) -> Reply:
        if len(payload) != 2 * P.TENSOR.size:
            raise ProtocolError("COPY_TENSOR payload has the wrong size")
        self._frames(data, 0)
        src, at = read_tensor(payload, s.lookup)
        dst, _ = read_tensor(payload, s.lookup, at)
        if tensor_extent(src) > tensor_extent(dst):
            raise ProtocolError(f"copy of {tensor_extent(src)} bytes into a destination of {tensor_extent(dst)}")
        n = tensor_extent(src)
        if not dst.buffer.cpy_tensor(src, dst):  # same device: a direct copy; else through the host
            dst.buffer.set_tensor(dst, src.buffer.get_tensor(src, 0, n), 0)
        return P.U8.pack(1), []

    def _memset_tensor(self, s: Session, payload: memoryview, data: list) -> Reply:
        t, (offset, size, value) = self._tensor_and(s, payload, P.MEMSET)
        self._frames(data, 0)
        self._range(t, offset, size)
        t.buffer.memset_tensor(t, value, offset, size)
        return b"", []

    def _graph_compute(self, s: Session, payload: memoryview, data: list) -> Reply:
        self._frames(data, 0)
        dev = unpack(P.U32, payload, exact=False)[0]
        sd = self._device(dev)
        _, slot, graph, handles = read_graph(payload, s.lookup, sd.device.supports_op)
        if not 0 <= slot <= P.GRAPH_SLOTS:
            raise ProtocolError(f"graph slot {slot} out of range 0..{P.GRAPH_SLOTS}: a session keeps at most "
                                f"{P.GRAPH_SLOTS} graphs")
        check_cost(graph, s.owned(), sd.memory()[0])
        s.graphs.pop(slot, None)
        self._compute(sd, graph)
        if slot:
            s.graphs[slot] = (dev, graph, handles)
        return b"", []

    def _graph_recompute(self, s: Session, payload: memoryview, data: list) -> Reply:
        self._frames(data, 0)
        dev, slot = unpack(P.RECOMPUTE, payload)
        entry = s.graphs.get(slot)
        if entry is None or entry[0] != dev:
            raise ProtocolError(f"no graph in slot {slot} for device {dev}")
        self._compute(self._device(dev), entry[1])
        return b"", []

    @staticmethod
    def _compute(sd: ServedDevice, graph: Graph) -> None:
        sd.backend.graph_compute(graph)
        sd.backend.synchronize()


def _peer(frame: zmq.Frame) -> str:
    try:
        return frame.get("Peer-Address")
    except zmq.ZMQError:
        return "?"


def supported_ops(device: Device) -> set[int]:
    """Op numbers the server both checks and runs on ``device`` (sent to clients once)."""
    probes = {op: Tensor(Type.F32, (1,), op=op) for op in REBUILD}
    return {int(op) for op, probe in probes.items() if device.supports_op(probe)}
