"""The RPC server: local devices offered to remote clients over TCP (ggml-rpc's server).

One thread serves requests in the order they arrive, each client in its own session (named by
its connection, which the server alone numbers; see :mod:`.transport` for why that is the
transport's first job) that sees only the buffers it allocated.  A session ends when its
connection does, so a client killed mid-command leaves nothing behind.  Every request is checked
(see :mod:`.validate`) before memory is touched; a bad one gets an error reply and the server
carries on.

What one session may hold is bounded (:class:`Limits`): buffers, graph slots, unread replies
(a client that stops reading loses its session instead of stalling the server), frames and
bytes per request (checked before the bytes are read, and no more than the session holds in
buffers); what a graph may cost is bounded by the bytes the session owns
(:func:`.validate.check_cost`).  What the server holds for requests not yet served - messages
arriving, requests held while a session waits, tensors from other servers kept for a later
WAIT_PEER, bytes queued to other servers - comes from one server-wide pool
(``Limits.transit``) as well as from the session's own bounds.  Slots are bounded per source
address, and a session that holds nothing gives up its slot when idle (see :mod:`.transport`).
"""
from __future__ import annotations

import logging
import secrets
import ssl
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from pyggml.backend import Backend, Buffer, Device
from pyggml.tensor import Tensor
from pyggml.types import Type

from . import peers
from . import protocol as P
from .cache import TensorCache
from .files import ServerFiles
from .keys import CurveKeys
from .protocol import Command, ProtocolError, Status, unpack
from .transport import FREE_BYTES, Disconnected, Listener, Message, Peer, Pool
from .validate import REBUILD, check_cost, read_graph, read_tensor, tensor_extent, tensor_from_wire

log = logging.getLogger("pyggml.rpc.server")
STEP_TURN = 64  # requests of a kept step served before the other clients' turn
MAX_KNOWN_TENSORS = 4096  # wire tensors a session keeps checked (Session.known): a tensor split passes hundreds


@dataclass(frozen=True)
class Limits:
    """What one session may hold at once; a request beyond a limit is refused by name."""
    buffers: int = 4096            # a model takes a few per device (weights, cache, compute)
    pending_replies: int = 16      # answers the client has not read (beyond what the kernel buffers)
    frames: int = P.MAX_FRAMES     # frames of one request, the header included
    clients: int = 512             # connections at once (each holds a descriptor) ...
    per_address: int = 64          # ... and from one address
    idle_s: float = 600.0          # a session that holds nothing is closed after this long without a request
    transit: int = 1 << 30         # bytes held server-wide for requests not yet served (transport.Pool)


@dataclass
class Counters:
    """What the server did, for --metrics-port (rpc/metrics.py): per command, requests and the
    seconds their handlers took; bytes of the requests read and the replies sent; seconds spent
    computing graphs (by whatever request: a kept step's run inside the request that let it go
    on) and waiting for other servers' tensors."""
    requests: dict[str, int] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)
    bytes_in: int = 0
    bytes_out: int = 0
    refused: int = 0
    compute_s: float = 0.0
    peer_wait_s: float = 0.0

    def served(self, command: str, seconds: float) -> None:
        self.requests[command] = self.requests.get(command, 0) + 1
        self.seconds[command] = self.seconds.get(command, 0.0) + seconds


@dataclass
class Wait:
    """Why a session's requests are held: a tagged tensor from another server (``tag``), or
    a link this server is making for it (``link``)."""
    deadline: float
    tag: int | None = None
    link: Link | None = None
    since: float = field(default_factory=time.monotonic)


@dataclass(eq=False)
class Link:
    """This server's connection to another server, made for one session (PEER_CONNECT)."""
    number: int
    endpoint: str
    peer: Peer
    session: Session
    seq: int                      # the PEER_CONNECT it answers once made
    ready: bool = False
    lost: str | None = None       # why it ended


@dataclass
class ServedDevice:
    device: Device
    backend: Backend
    mem_limit: int
    used: int = 0
    speed: float = 0.0  # GB/s of weights through a product (pyggml.speed), measured by measure_speeds()

    def memory(self) -> tuple[int, int]:
        free, total = self.device.get_memory()
        total = min(total, self.mem_limit)
        return max(0, min(free, total - self.used)), total


@dataclass
class Session:
    peer: Peer
    buffers: dict[int, tuple[int, Buffer]] = field(default_factory=dict)   # handle -> (device, buffer)
    # slot -> (device, the backend's plan of the graph, the buffer handles it uses, its tensor count)
    graphs: dict[int, tuple[int, object, set[int], int]] = field(default_factory=dict)
    deferred_error: str | None = None
    cached: int = 0  # bytes this session has written into the tensor cache
    # servers passing tensors to each other (rpc/peers.py)
    writes_into: Session | None = None   # a link from another server: the session it may write into
    links: dict[int, Link] = field(default_factory=dict)  # link number -> this server's connection to another
    link_attempts: int = 0
    # tagged tensors that came before their WAIT_PEER: (destination, codec, bytes), written only
    # when the client's own requests reach that WAIT_PEER (a sender may run ahead by ubatches)
    arrived: OrderedDict[int, tuple] = field(default_factory=OrderedDict)
    arrived_bytes: int = 0
    waiting: Wait | None = None               # this session's requests are held meanwhile
    senders: int = 0                          # links that write into this session now
    # why a link that wrote into it went (each of its senders may be the one a step waits for,
    # so every later wait fails at once rather than when PEER_WAIT_S ran out); forgotten when a
    # new placement starts (a new link comes, or the session's buffers are all freed)
    sender_lost: str | None = None
    held: deque = field(default_factory=deque)  # the requests held meanwhile, in order
    held_bytes: int = 0
    # wire tensors of SET_TENSOR / GET_TENSOR requests, checked once: a decoding step sets and
    # reads the same few tensors every time (forgotten whenever a buffer goes)
    known: dict[bytes, Tensor] = field(default_factory=dict)
    owned_bytes: int = 0  # of the buffers it holds
    seq: int = 0          # of the request being served
    # steps kept (STEP_STORE): number -> its requests; and the requests of the step being run
    # that wait behind a WAIT_PEER (served before anything held meanwhile)
    steps: dict[int, list[tuple[Command, bytes]]] = field(default_factory=dict)
    step_rest: deque = field(default_factory=deque)

    def owned(self) -> int:
        """Bytes of the buffers this session holds."""
        return self.owned_bytes

    def holds(self) -> bool:
        """Whether it holds anything a client would miss: buffers, links, a wait."""
        return bool(self.buffers or self.links or self.writes_into is not None or self.waiting is not None
                    or self.graphs)

    def may_hold(self) -> int:
        """Bytes of requests (or tensors from other servers) it may have held while it waits."""
        return max(peers.HELD_FREE_BYTES, self.owned_bytes)

    def lookup(self, handle: int) -> Buffer:
        entry = self.buffers.get(handle)
        if entry is None:
            raise ProtocolError(f"unknown buffer handle {handle:#x}")
        return entry[1]


Reply = tuple[bytes, list]
DEFERRED: Reply = (b"", [])  # a handler's answer that it will answer later itself (the same object)
Handler = Callable[[Session, memoryview, list], Reply]


LEAVING = "this server is leaving (stopped): place the model on the other devices"


class RPCServer:
    def __init__(self, devices: list[Device], host: str = "127.0.0.1", port: int = 0, mem: int | None = None,
                 cache_dir: str | None = None, max_message: int = P.DEFAULT_MAX_MESSAGE,
                 tls: ssl.SSLContext | None = None, cache_max: int = P.DEFAULT_CACHE_MAX,
                 limits: Limits = Limits(), files: ServerFiles | None = None, peer_links: bool = True,
                 peer_tls: ssl.SSLContext | None = None, peer_networks: list | None = None,
                 transport: str = "tcp", curve: CurveKeys | None = None, protocol: str = "pyggml") -> None:
        if not devices:
            raise ValueError("the server needs at least one device")
        if protocol not in ("pyggml", "ggml") or (protocol == "ggml" and transport != "tcp"):
            raise ValueError(f"protocol {protocol!r} over {transport}: pyggml (over tcp or zmq) or ggml (over tcp)")
        self.devices = [ServedDevice(d, d.init_backend(), mem if mem is not None else 1 << 62) for d in devices]
        self.cache = TensorCache(cache_dir, cache_max) if cache_dir else None
        self.files = files if files is not None and files.files else None
        self.max_message = max_message
        self.limits = limits
        self.sessions: dict[int, Session] = {}  # by connection
        self.stepping: dict[int, Session] = {}  # sessions with a kept step part-served (served in turns)
        self.peer_links = peer_links  # False (--no-peers): never connect to another server
        self.peer_tls = peer_tls      # how to connect to another server (its client side of TLS)
        self.tokens = peers.Tokens()
        self.link_policy = peers.LinkPolicy(peer_networks if peer_networks is not None else peers.own_networks(host))
        self.outgoing: dict[int, Link] = {}   # this server's links to others (being made or made), by connection
        self._ended: OrderedDict[int, str] = OrderedDict()  # why recent sessions were ended by the server
        self.pool = Pool(limits.transit)
        common = dict(max_frames=limits.frames, max_bytes=max_message, max_peers=limits.clients,
                      max_queued=limits.pending_replies, pool=self.pool, allowance=self._allowance,
                      holds=self._holds, idle_timeout=limits.idle_s)
        if transport == "zmq":  # (links to other servers are made over TCP only)
            from .zmq_transport import ZmqListener
            self.listener = ZmqListener(host, port, curve, **common)
            self.peer_links = False
        elif protocol == "ggml":  # llama.cpp's clients (rpc/ggml_server.py): plain TCP, no links
            from .ggml_server import GGML_FRAMING, GgmlFrontend
            if tls is not None:
                raise ValueError("ggml-rpc has no TLS: --protocol ggml serves plain TCP only")
            self.listener = Listener(host, port, None, max_per_address=limits.per_address, framing=GGML_FRAMING,
                                     **common)
            self.peer_links = False
        else:
            self.listener = Listener(host, port, tls, max_per_address=limits.per_address, **common)
        self.endpoint = self.listener.endpoint
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
            Command.PEER_TOKEN: self._peer_token,
            Command.PEER_CONNECT: self._peer_connect,
            Command.PEER_AUTH: self._peer_auth,
            Command.COPY_TO_PEER: self._copy_to_peer,
            Command.PEER_SET: self._peer_set,
            Command.WAIT_PEER: self._wait_peer,
            Command.STEP_STORE: self._step_store,
            Command.STEP_RUN: self._step_run,
        }
        self.ggml = GgmlFrontend(self) if protocol == "ggml" else None
        self.running = False
        self.counters = Counters()
        self.leave_deadline: float | None = None  # leave(): when to stop even if clients still hold buffers

    # -- the loop -----------------------------------------------------------------------------------
    def serve_forever(self) -> None:
        self.running = True
        self.listener.start_heartbeats()
        try:
            while self.running:
                for event in self.listener.poll(0 if self.stepping else 0.5):
                    if event.peer.outgoing:
                        self._link_event(event)
                    elif isinstance(event, Disconnected):
                        self._disconnected(event)
                    elif (session := self.sessions.get(event.peer.id)) is not None and (
                            session.waiting is not None or session.step_rest):
                        self._hold(session, event)
                    else:
                        self._serve_event(event)
                for session in list(self.stepping.values()):
                    self._release_held(session)
                self._expire_waits()
                self.listener.send_held()  # the replies to what this read brought, together
                if self.leave_deadline is not None and (not self.clients_holding()
                                                        or time.monotonic() > self.leave_deadline):
                    break
        finally:
            self.close()

    def measure_speeds(self) -> None:
        """Time each device's products once (pyggml.speed), for the clients' placement by speed;
        before serving, so that nothing else runs meanwhile."""
        from pyggml.speed import measure
        for sd in self.devices:
            try:
                sd.speed = measure(sd.device)
            except Exception as e:  # noqa: BLE001 - an unknown speed: clients place by memory
                log.warning("measuring %s: %s", sd.device.get_name(), e)

    def leave(self, timeout: float) -> int:
        """Take no more work and stop once no client holds a buffer here, or after ``timeout``
        seconds: every request but FREE_BUFFER that wants a reply is answered Status.LEAVING,
        which tells a client to place its model without this server - failover or not - and
        to let go of it; what its sessions send other servers from then on is a failure naming
        this one, so that a step in flight ends at once there.  Returns
        the clients holding buffers now.  (Safe from a signal handler: it sets what the loop reads.)"""
        self.leave_deadline = time.monotonic() + timeout
        return self.clients_holding()

    def clients_holding(self) -> int:
        return sum(1 for s in list(self.sessions.values()) if s.buffers)

    def _serve_event(self, message: Message) -> None:
        self.listener.serving = message.peer
        try:
            self._serve_one(message)
        finally:
            self.listener.serving = None

    # -- sessions waiting for a tensor from another server (rpc/peers.py) --------------------------
    # -- sessions waiting: for a tensor from another server, or a link being made (rpc/peers.py) -----
    def _hold(self, s: Session, message: Message) -> None:
        size = sum(len(f) for f in message.frames)
        if (len(s.held) >= peers.MAX_HELD or s.held_bytes + size > min(peers.MAX_HELD_BYTES, s.may_hold())
                or not self.pool.take(size)):
            # the wait cannot go on: it ends with an error for the client's next reply
            self._end_wait(s, f"{len(s.held)} requests ({s.held_bytes} bytes) piled up while this session "
                              f"waited for {self._waited_for(s.waiting)} (the limit, or the server's)")
            self._serve_event(message)
            return
        s.held.append(message)
        s.held_bytes += size
        self.listener.held.add(s.peer)  # it waits for us: heartbeats, so that it does not think us gone

    @staticmethod
    def _waited_for(wait: Wait) -> str:
        return f"tensor {wait.tag}" if wait.link is None else f"link {wait.link.number} to {wait.link.endpoint}"

    def _end_wait(self, s: Session, error: str | None) -> None:
        """The session waits no more: with ``error`` for its next reply (a link being made is
        given up and answered with it), and its held requests are served."""
        wait, s.waiting = s.waiting, None
        if wait is not None and wait.tag is not None:
            self.counters.peer_wait_s += time.monotonic() - wait.since
        if wait is not None and wait.link is not None and not wait.link.ready:
            self._link_failed(wait.link, error, answer=True)
        elif error is not None:
            s.deferred_error = s.deferred_error or error
        self._release_held(s)

    def _arrived(self, s: Session, tag: int, tensor: tuple) -> None:
        """A tagged tensor came for session ``s``: written now if the session waits for it (and
        what was held is served), else kept until its WAIT_PEER."""
        if s.waiting is not None and s.waiting.tag == tag:
            try:
                self._write_arrived(s, tensor)
            except (ProtocolError, ValueError) as e:
                self._end_wait(s, str(e))
                return
            self._end_wait(s, None)
            return
        size = len(tensor[2])
        if (len(s.arrived) >= peers.MAX_ARRIVED or s.arrived_bytes + size > min(peers.MAX_ARRIVED_BYTES, s.may_hold())
                or not self.pool.take(size)):
            s.deferred_error = s.deferred_error or (f"tensors from another server piled up ({len(s.arrived)}, "
                                                    f"{s.arrived_bytes} bytes) before this session asked for them")
            return
        s.arrived[tag] = tensor
        s.arrived_bytes += size

    def _write_arrived(self, s: Session, tensor: tuple) -> None:
        """Write a tagged tensor into the session's buffer it names (checked now: the buffer may
        have gone since it came)."""
        wire_dst, codec, body = tensor
        if codec == P.Codec.FAILED:
            raise ProtocolError(f"the server sending this tensor failed: {bytes(body).decode('utf-8', 'replace')}")
        dst = self._checked(s, wire_dst)
        dst.buffer.set_tensor(dst, P.decompress(codec, body, tensor_extent(dst)), 0)

    def _release_held(self, s: Session) -> None:
        self._continue_step(s)
        while s.held and s.waiting is None and not s.step_rest and s.peer.id in self.sessions:
            message = s.held.popleft()
            size = sum(len(f) for f in message.frames)
            s.held_bytes -= size
            self.pool.give(size)
            self._serve_event(message)
        if not s.held:
            self.listener.held.discard(s.peer)

    def _link_lost(self, link: Session, reason: str) -> None:
        """A link from another server is gone: its session waits for nothing more from it."""
        target, link.writes_into = link.writes_into, None
        if target is None:
            return
        target.senders -= 1
        target.sender_lost = reason
        if target.waiting is not None and target.waiting.tag is not None and target.peer.id in self.sessions:
            self._end_wait(target, f"the server sending tensor {target.waiting.tag} is gone ({reason})")

    def _expire_waits(self) -> None:
        now = time.monotonic()
        for s in list(self.sessions.values()):
            if s.waiting is not None and s.waiting.deadline < now:
                self._end_wait(s, f"no tensor tagged {s.waiting.tag} came from the other server within "
                                  f"{peers.PEER_WAIT_S:.0f} s" if s.waiting.tag is not None else None)

    def stop(self) -> None:
        self.running = False

    def close(self) -> None:
        for s in list(self.sessions.values()):
            self._end_session(s)
        self.listener.close()

    def _disconnected(self, event: Disconnected) -> None:
        s = self.sessions.get(event.peer.id)
        if s is not None:
            log.info("client %d (%s) disconnected (%s); its %d buffer(s) freed", s.peer.id, s.peer.address,
                     event.reason, len(s.buffers))
            self._end_session(s, event.reason)
        self._ended.pop(event.peer.id, None)

    def _end_session(self, s: Session, reason: str = "its session was ended") -> None:
        if s.writes_into is not None:  # a link from another server: the session it wrote into hears it
            self._link_lost(s, reason)
        for handle in list(s.buffers):
            self._release(s, handle)
        s.graphs.clear()
        s.steps.clear()
        s.step_rest.clear()
        self.stepping.pop(s.peer.id, None)
        if s.waiting is not None and s.waiting.link is not None:
            self._link_failed(s.waiting.link, None, answer=False)
        s.waiting = None
        for link in s.links.values():
            self.outgoing.pop(link.peer.id, None)
            self.listener.close_peer(link.peer)
        s.links.clear()
        s.held.clear()
        self.pool.give(s.held_bytes + s.arrived_bytes)
        s.held_bytes = s.arrived_bytes = 0
        s.arrived.clear()
        self.listener.held.discard(s.peer)
        s.writes_into = None
        self.tokens.forget(s.peer.id)
        self.sessions.pop(s.peer.id, None)

    def _serve_one(self, message: Message) -> None:
        if self.ggml is not None:
            self.ggml.serve(message)
            return
        peer, frames = message.peer, message.frames
        head, data = frames[0], frames[1:]
        seq, no_reply = 0, False
        self.counters.bytes_in += sum(len(f) for f in frames)
        try:
            if len(head) < P.HEADER.size:
                raise ProtocolError(f"message of {len(head)} bytes is shorter than a header")
            cmd_no, flags, _, seq = P.HEADER.unpack_from(head)
            no_reply = bool(flags & P.FLAG_NO_REPLY)
            if message.error is not None:  # over the frame or byte limits: its bytes were never kept
                raise ProtocolError(message.error)
            try:
                cmd = Command(cmd_no)
            except ValueError:
                raise ProtocolError(f"unknown command {cmd_no}") from None
            payload = head[P.HEADER.size:]
            leaving = self.leave_deadline is not None
            if cmd == Command.HELLO:
                if leaving:
                    self._send(peer, Status.LEAVING, seq, LEAVING.encode(), [])
                    return
                reply = self._hello(peer, payload, data)
            else:
                session = self.sessions.get(peer.id)
                if session is None:
                    raise ProtocolError(self._ended.get(peer.id, "HELLO must come first"))
                if session.writes_into is not None and cmd != Command.PEER_SET:
                    raise ProtocolError("a link from another server may only send PEER_SET")
                if leaving and session.writes_into is None and cmd != Command.FREE_BUFFER:
                    # what this session sends other servers from now on is a failure naming
                    # this (a step in flight ends at once there); a request with a reply hears
                    # LEAVING, which tells the client to place its model without this server
                    session.deferred_error = session.deferred_error or LEAVING
                    if not no_reply:
                        self._send(peer, Status.LEAVING, seq, LEAVING.encode(), [])
                        return
                elif session.deferred_error and not no_reply:
                    err, session.deferred_error = session.deferred_error, None
                    self._forget_arrived(session)  # (the failed step's: no later step may read them)
                    raise ProtocolError(f"an earlier request failed: {err}")
                t0 = time.perf_counter()
                session.seq = seq
                reply = self.handlers[cmd](session, payload, data)
                took = time.perf_counter() - t0
                self.counters.served(cmd.name, took)
                if log.isEnabledFor(logging.DEBUG):
                    log.debug("%s took %.3f ms", cmd.name, took * 1000)
            if reply is DEFERRED:  # answered later (a link being made): its seq is kept
                return
            if not no_reply:
                self._send(peer, Status.OK, seq, *reply)
        except Exception as e:  # noqa: BLE001 - whatever happened, answer and keep serving
            if not isinstance(e, (ProtocolError, ValueError, IndexError, MemoryError)):
                log.exception("unexpected error serving a request")
            message_text = str(e) or type(e).__name__
            log.info("refused a request: %s", message_text)
            self.counters.refused += 1
            session = self.sessions.get(peer.id)
            if no_reply:
                if session is not None and session.deferred_error is None:
                    session.deferred_error = message_text
            else:
                self._send(peer, Status.ERROR, seq, message_text.encode("utf-8", "replace"), [])

    def _send(self, peer: Peer, status: Status, seq: int, payload: bytes, frames: list) -> None:
        self.counters.bytes_out += P.HEADER.size + len(payload) + sum(len(f) for f in frames)
        if self.listener.send(peer, [P.HEADER.pack(status, 0, 0, seq) + payload, *frames], now=False):
            return
        # its answers pile up unread: waiting for it would stall every other client
        session = self.sessions.get(peer.id)
        if session is not None:
            log.warning("client %d (%s) leaves %d replies unread (the limit); its session is ended and its "
                        "%d buffer(s) freed", peer.id, peer.address, self.limits.pending_replies,
                        len(session.buffers))
            self._end_session(session)
            self._ended[peer.id] = (f"this session was ended: it left {self.limits.pending_replies} replies "
                                    f"unread (the limit per session)")
            while len(self._ended) > 256:
                self._ended.popitem(last=False)

    # -- what the transport asks of sessions ----------------------------------------------------------
    def _allowance(self, peer: Peer) -> int:
        """The largest message this connection may send now: small before HELLO and while its
        session holds no buffer, what it holds after (a link: what the session it writes into holds)."""
        s = self.sessions.get(peer.id)
        if s is None:
            return FREE_BYTES
        if s.writes_into is not None:
            s = s.writes_into
        return FREE_BYTES + s.owned_bytes  # (a request's header and tensor records on top of its data)

    def _holds(self, peer: Peer) -> bool:
        s = self.sessions.get(peer.id)
        return s is not None and s.holds()

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
        s.known.clear()  # (a tensor there must be checked against the buffers again)
        s.owned_bytes -= buf.get_size()
        self.devices[dev].used -= buf.get_size()
        buf.free()
        for slot in [k for k, (_, _, handles, _) in s.graphs.items() if handle in handles]:
            del s.graphs[slot]
        if not s.buffers:  # a new placement starts
            s.sender_lost = None
            self._forget_arrived(s)

    def _forget_arrived(self, s: Session) -> None:
        self.pool.give(s.arrived_bytes)
        s.arrived.clear()
        s.arrived_bytes = 0

    @staticmethod
    def _range(t: Tensor, offset: int, size: int) -> None:
        if offset + size > tensor_extent(t):
            raise ProtocolError(f"bytes [{offset}, {offset + size}) outside tensor {t.name!r} "
                                f"({tensor_extent(t)} bytes)")

    # -- commands -----------------------------------------------------------------------------------
    def _hello(self, peer: Peer, payload: memoryview, data: list) -> Reply:
        magic, version = unpack(P.HELLO, payload)
        if magic != P.MAGIC:
            raise ProtocolError("not a pyggml RPC client")
        if version != P.PROTOCOL_VERSION:
            raise ProtocolError(f"protocol version {version} is not supported; this server speaks "
                                f"version {P.PROTOCOL_VERSION}")
        self._frames(data, 0)
        if peer.id not in self.sessions:
            self.sessions[peer.id] = Session(peer)
            peer.greeted = True
            log.info("client %d connected from %s", peer.id, peer.address)
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
                                  min(buft.get_max_size(), sd.mem_limit), 1, sd.speed)
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
        s.owned_bytes += buf.get_size()
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
        return self._checked(s, payload), st.unpack_from(payload, P.TENSOR.size)

    @staticmethod
    def _checked(s: Session, payload: memoryview | bytes, at: int = 0) -> Tensor:
        """The wire tensor at ``at``: the same bytes name the same tensor while its buffer lives,
        so each is checked once (a decoding step sets, reads and passes the same few)."""
        key = bytes(payload[at:at + P.TENSOR.size])
        t = s.known.get(key)
        if t is None:
            t, _ = read_tensor(payload, s.lookup, at)
            if len(s.known) >= MAX_KNOWN_TENSORS:
                s.known.clear()
            s.known[key] = t
        return t

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
        if flags & P.FLAG_CACHE:
            self.cache_weights(s, raw)
        return b"", []

    def cache_weights(self, s: Session, raw) -> bytes | None:
        """Keep weights in the tensor cache (a session may not store more than it holds in its
        buffers): their key, or None where they were not kept."""
        if self.cache is None or s.cached + len(raw) > s.owned():
            return None
        key, new = self.cache.put(raw)
        if new:
            s.cached += len(raw)
        return key

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
        t.buffer.set_tensor(t, self.files.data(identity, file_offset, size), offset)
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
        n_tensors = P.GRAPH.unpack_from(payload)[3]
        held = sum(entry[3] for entry in s.graphs.values())
        if slot and held + n_tensors > P.HELD_GRAPH_TENSORS:
            raise ProtocolError(f"keeping this graph of {n_tensors} tensors would make the session's kept graphs "
                                f"hold more than {P.HELD_GRAPH_TENSORS} (send it in slot 0 to run it once)")
        plan = sd.backend.graph_plan_create(graph)
        self._compute(sd, plan)
        if slot:
            s.graphs[slot] = (dev, plan, handles, n_tensors)
        return b"", []

    def _graph_recompute(self, s: Session, payload: memoryview, data: list) -> Reply:
        self._frames(data, 0)
        dev, slot = unpack(P.RECOMPUTE, payload)
        entry = s.graphs.get(slot)
        if entry is None or entry[0] != dev:
            raise ProtocolError(f"no graph in slot {slot} for device {dev}")
        self._compute(self._device(dev), entry[1])
        return b"", []

    # -- servers passing tensors to each other (rpc/peers.py) -------------------------------------
    def _peer_token(self, s: Session, payload: memoryview, data: list) -> Reply:
        """(on the receiver) A token that lets one connection of another server write into this session."""
        if len(payload) or data:
            raise ProtocolError("PEER_TOKEN takes no payload")
        try:
            return self.tokens.issue(s.peer.id), []
        except ValueError as e:
            raise ProtocolError(str(e)) from None

    def _peer_connect(self, s: Session, payload: memoryview, data: list) -> Reply:
        """(on the sender) Connect to the server at the numeric endpoint in the frame and present
        its token; the reply - once the link is made, or failed, or ``LINK_TIMEOUT_S`` passed -
        is the link's number for COPY_TO_PEER.  The session's later requests wait for it; every
        other client is served meanwhile."""
        (token,) = unpack(P.PEER_CONNECT, payload)
        self._frames(data, 1)
        if not self.peer_links:
            raise ProtocolError("this server makes no connections to other servers (--no-peers, or "
                                "--transport zmq)")
        if len(s.links) >= peers.MAX_LINKS or s.link_attempts >= 2 * peers.MAX_LINKS:
            raise ProtocolError(f"this session has made {s.link_attempts} links to other servers (at most "
                                f"{peers.MAX_LINKS} kept, {2 * peers.MAX_LINKS} tried): the limit")
        try:
            endpoint = P.parse_endpoint(bytes(data[0][:300]).decode("utf-8", "replace"))
            host, port = self.link_policy.check(endpoint)
            self.link_policy.start()
        except ValueError as e:
            raise ProtocolError(str(e)) from None
        s.link_attempts += 1
        number = max(s.links, default=0) + 1
        try:
            peer = self.listener.dial(host, port, self.peer_tls)
        except OSError:
            self.link_policy.dialing -= 1
            raise ProtocolError(peers.LINK_FAILED.format(endpoint=endpoint)) from None
        link = Link(number, endpoint, peer, s, s.seq)
        self.outgoing[peer.id] = link
        # HELLO, then the token: both answered before the link may carry anything
        self.listener.send(peer, [P.HEADER.pack(Command.HELLO, 0, 0, 1) + P.HELLO.pack(P.MAGIC, P.PROTOCOL_VERSION)])
        self.listener.send(peer, [P.HEADER.pack(Command.PEER_AUTH, 0, 0, 2) + bytes(token)])
        s.waiting = Wait(time.monotonic() + peers.LINK_TIMEOUT_S, link=link)
        return DEFERRED

    def _link_event(self, event: Message | Disconnected) -> None:
        """What came over this server's own connection to another server."""
        link = self.outgoing.get(event.peer.id)
        if link is None:
            return
        if isinstance(event, Disconnected):
            if link.ready:  # a link in use: COPY_TO_PEER says so from now on
                link.lost = event.reason
                del self.outgoing[event.peer.id]
            else:
                self._link_failed(link, event.reason, answer=True)
            return
        if link.ready:  # a made link's other end only answers what made it: anything else is ignored
            return
        head = event.frames[0]
        ok = (event.error is None and len(head) >= P.HEADER.size
              and P.HEADER.unpack_from(head)[0] == Status.OK)
        if not ok:
            self._link_failed(link, "refused", answer=True)
        elif P.HEADER.unpack_from(head)[3] == 2:  # PEER_AUTH answered: made
            self.link_policy.dialing -= 1
            s = link.session
            link.ready = True
            s.links[link.number] = link
            log.info("client %d: link %d to %s", s.peer.id, link.number, link.endpoint)
            self._send(s.peer, Status.OK, link.seq, P.U32.pack(link.number), [])
            if s.waiting is not None and s.waiting.link is link:
                self._end_wait(s, None)

    def _link_failed(self, link: Link, reason: str | None, answer: bool) -> None:
        """A link being made did not come about: its connection is closed and, with ``answer``,
        its PEER_CONNECT answered with the one error every failure gets (the reason is logged)."""
        if link.ready or self.outgoing.pop(link.peer.id, None) is None:
            return
        self.link_policy.dialing -= 1
        self.listener.close_peer(link.peer)
        s = link.session
        log.info("client %d: no link to %s (%s)", s.peer.id, link.endpoint, reason or "timed out")
        if s.waiting is not None and s.waiting.link is link:
            s.waiting = None
        if answer and s.peer.id in self.sessions:
            self._send(s.peer, Status.ERROR, link.seq, peers.LINK_FAILED.format(endpoint=link.endpoint).encode(), [])
            self._release_held(s)

    def _peer_auth(self, s: Session, payload: memoryview, data: list) -> Reply:
        """(on the receiver) This connection presents a token: it becomes a link that writes
        into the session the token was issued for, and nothing else."""
        self._frames(data, 0)
        if len(payload) != P.TOKEN_BYTES:
            raise ProtocolError("PEER_AUTH takes a token")
        if s.buffers or s.graphs or s.links:
            raise ProtocolError("PEER_AUTH must come right after HELLO")
        target = self.sessions.get(self.tokens.take(bytes(payload)) or 0)
        if target is None or target is s:
            raise ProtocolError("unknown, used or expired peer token")
        s.writes_into = target
        target.senders += 1
        target.sender_lost = None
        log.info("client %d: a link from %s writes into client %d's tensors", s.peer.id, s.peer.address,
                 target.peer.id)
        return b"", []

    def _copy_to_peer(self, s: Session, payload: memoryview, data: list) -> Reply:
        """(on the sender; no reply) Send a tensor of this session over a link, tagged: after
        whatever came before it on this connection (the graph that computed it).  Queued, never
        waited for: a link whose other end takes no bytes is closed (transport.LINK_STALL_S)."""
        self._frames(data, 0)
        number, tag = unpack(P.COPY_TO_PEER, payload, exact=False)
        if len(payload) != P.COPY_TO_PEER.size + 2 * P.TENSOR.size:
            raise ProtocolError("COPY_TO_PEER payload has the wrong size")
        link = s.links.get(number)
        if link is None:
            raise ProtocolError(f"no link {number} in this session")
        if link.lost is not None or link.peer.closed:
            raise ProtocolError(f"link {number} to {link.endpoint} is gone ({link.lost or 'closed'})")
        src, at = self._checked(s, payload, P.COPY_TO_PEER.size), P.COPY_TO_PEER.size + P.TENSOR.size
        if s.deferred_error is not None:
            # this session failed earlier in the step (a server before it is gone): what it
            # computed since is not to be believed - the receiver hears that, not stale bytes
            codec, body = P.Codec.FAILED, s.deferred_error.encode("utf-8", "replace")[:1024]
        else:
            codec, body = P.compress(src.buffer.get_tensor(src, 0, tensor_extent(src)))
        # the destination is the receiver's to check
        head = P.HEADER.pack(Command.PEER_SET, P.FLAG_NO_REPLY, 0, 0) + P.PEER_SET.pack(tag, codec) + bytes(payload[at:])
        if not self.listener.send(link.peer, [head, body], max_bytes=max(peers.LINK_QUEUE_BYTES, s.owned())):
            link.lost = f"{link.peer.queued_bytes} bytes wait to be sent (the limit, or the server's)"
            self.outgoing.pop(link.peer.id, None)
            self.listener.close_peer(link.peer)
            raise ProtocolError(f"link {number} to {link.endpoint} is gone ({link.lost})")
        return b"", []

    def _peer_set(self, s: Session, payload: memoryview, data: list) -> Reply:
        """(on the receiver, from a link; no reply) A tagged tensor for the link's session: what
        goes wrong is that session's error, reported in its next reply."""
        target = s.writes_into
        if target is None:
            raise ProtocolError("PEER_SET comes only over a link that presented a PEER_TOKEN")
        if target.peer.id not in self.sessions:
            raise ProtocolError("the session this link wrote into is gone")
        tag, codec = unpack(P.PEER_SET, payload, exact=False)
        if len(data) != 1 or len(payload) != P.PEER_SET.size + P.TENSOR.size:
            target.deferred_error = target.deferred_error or f"a malformed tensor from {s.peer.address}"
            body = b""
        else:
            body = bytes(data[0])  # (the frame is the reader's: keep a copy until it is written)
        self._arrived(target, tag, (bytes(payload[P.PEER_SET.size:]), codec, body))
        return b"", []

    def _wait_peer(self, s: Session, payload: memoryview, data: list) -> Reply:
        """(on the receiver; no reply) Hold this session's next requests until the tag arrived."""
        self._frames(data, 0)
        (tag,) = unpack(P.U32, payload)
        tensor = s.arrived.pop(tag, None)
        if tensor is not None:
            s.arrived_bytes -= len(tensor[2])
            self.pool.give(len(tensor[2]))
            self._write_arrived(s, tensor)
            return b"", []
        if not s.senders or s.sender_lost:  # the server that would send it may be gone: nothing to wait for
            raise ProtocolError(f"the server sending tensor {tag} is gone ({s.sender_lost or 'no link'})")
        if s.deferred_error is not None:
            return b"", []  # the step failed already: what follows is not believed, so no wait
            # for a tensor that may never come (each would cost PEER_WAIT_S)
        s.waiting = Wait(time.monotonic() + peers.PEER_WAIT_S, tag=tag)
        return b"", []

    # -- steps kept on the server (rpc/steps.py) ----------------------------------------------------
    def _step_store(self, s: Session, payload: memoryview, data: list) -> Reply:
        """(no reply) Keep the frame's requests (GRAPH_RECOMPUTE, COPY_TO_PEER, WAIT_PEER, each
        checked when it runs, as if it had come then) as step N of this session."""
        (number,) = unpack(P.STEP, payload)
        self._frames(data, 1)
        if not 1 <= number <= P.MAX_STEPS:
            raise ProtocolError(f"step {number} out of range 1..{P.MAX_STEPS}")
        body = bytes(data[0])
        others = sum(len(p) for n, step in s.steps.items() if n != number for _, p in step)
        if others + len(body) > P.MAX_STEP_BYTES:
            raise ProtocolError(f"the session's steps would hold {others + len(body)} bytes; the limit is "
                                f"{P.MAX_STEP_BYTES}")
        requests, at = [], 0
        while at < len(body):
            if len(requests) >= P.MAX_STEP_REQUESTS or at + P.STEP_ENTRY.size > len(body):
                raise ProtocolError(f"a step of more than {P.MAX_STEP_REQUESTS} requests, or cut short")
            cmd_no, size = P.STEP_ENTRY.unpack_from(body, at)
            at += P.STEP_ENTRY.size
            if cmd_no not in P.STEP_COMMANDS or at + size > len(body):
                raise ProtocolError(f"a step may hold only {', '.join(c.name for c in sorted(P.STEP_COMMANDS))}, "
                                    f"whole (command {cmd_no}, {size} bytes)")
            requests.append((Command(cmd_no), body[at:at + size]))
            at += size
        s.steps.pop(number, None)
        s.steps[number] = requests
        return b"", []

    def _step_run(self, s: Session, payload: memoryview, data: list) -> Reply:
        """(no reply) Serve step N's requests in order; a WAIT_PEER among them holds the rest
        (and whatever comes meanwhile) until its tensor arrived, as it would on the wire."""
        (number,) = unpack(P.STEP, payload)
        self._frames(data, 0)
        step = s.steps.get(number)
        if step is None:
            raise ProtocolError(f"no step {number} in this session")
        s.step_rest.extend(step)
        self._continue_step(s)
        return b"", []

    def _continue_step(self, s: Session) -> None:
        """Serve the step's next requests: up to STEP_TURN, then the other clients get their
        turn (a step of thousands of graphs must not keep them waiting), or up to a WAIT_PEER."""
        for _ in range(STEP_TURN):
            if not s.step_rest or s.waiting is not None or s.peer.id not in self.sessions:
                break
            cmd, payload = s.step_rest.popleft()
            try:
                self.handlers[cmd](s, memoryview(payload), [])
            except Exception as e:  # noqa: BLE001 - a request of a step fails as it would on the wire
                if not isinstance(e, (ProtocolError, ValueError, IndexError, MemoryError)):
                    log.exception("unexpected error serving a step's request")
                s.deferred_error = s.deferred_error or f"{cmd.name} of a kept step: {e or type(e).__name__}"
        if s.step_rest and s.waiting is None and s.peer.id in self.sessions:
            self.stepping[s.peer.id] = s
        else:
            self.stepping.pop(s.peer.id, None)

    def _compute(self, sd: ServedDevice, plan: object) -> None:
        self.listener.send_held()  # what was answered before the graph does not wait for it
        t0 = time.perf_counter()
        sd.backend.graph_plan_compute(plan)
        sd.backend.synchronize()
        self.counters.compute_s += time.perf_counter() - t0


def supported_ops(device: Device) -> set[int]:
    """Op numbers the server both checks and runs on ``device`` (sent to clients once)."""
    probes = {op: Tensor(Type.F32, (1,), op=op) for op in REBUILD}
    return {int(op) for op, probe in probes.items() if device.supports_op(probe)}
