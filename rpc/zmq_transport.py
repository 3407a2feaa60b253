"""The RPC messages over ZeroMQ (``pyggml-rpc-server --transport zmq``, ``zmq://`` endpoints).

The same messages as over TCP (:mod:`.transport`): a list of frames - here a ZeroMQ multipart
message, each frame a ZeroMQ frame - with the same limits, sessions and heartbeats, so the
server behind both is one.  What differs is how connections are known and guarded:

- Encryption and authentication are CurveZMQ's, with the keys ``--gen-key`` writes beside the
  TLS certificates (:mod:`.keys`); a ZAP handler (:class:`Zap`) admits only the client key of
  the server's key file, and on any address other than loopback the server refuses to start
  without a key.
- Sessions are named by ZeroMQ's routing ids.  A ROUTER lets a connecting peer choose its own
  id, and numbers the others from a counter that starts at C's ``rand()``; when the counter
  reaches an id some peer chose, libzmq asserts and aborts the process
  (``routing_socket_base_t::add_out_pipe``), and no socket option refuses chosen ids.  libzmq
  never seeds ``rand()``, so the counter starts at the same number in every server: 300
  connections claiming the ids from that start, then one anonymous connection, abort it.  The
  defences, which make the abort a guess no key holder can realistically win rather than
  impossible: ``rand()`` is seeded from ``os.urandom`` before the socket is made (the start is
  a secret 32-bit number); the ZAP handler admits at most ``ZAP_PER_S`` handshakes a second
  (``ZAP_BURST`` at once) and no more than ``max_peers`` connections at once, counted by the
  socket's monitor; without the client key nothing is admitted at all.  This is why TCP, where
  the server alone names connections, is the default.
- Liveness: ZeroMQ's own heartbeats (``ZMQ_HEARTBEAT_*``) drop a connection that vanished, and
  every second the server sends each peer an empty message (ROUTER_MANDATORY makes one to a peer
  whose connection is gone an error: that ends its session - the ROUTER_NOTIFY that would say so
  is a draft of libzmq that pyzmq's wheels lack); so a waiting client hears that the server is
  busy, as over TCP.  Size:
  ``ZMQ_MAXMSGSIZE`` bounds each frame as it arrives, and ``ZMQ_RCVHWM`` the messages queued per
  peer; what libzmq does not bound is the number of frames of a message before its last.

One thread (:class:`ZmqListener`'s front) owns the ROUTER socket, since ZeroMQ sockets must not
be shared between threads: it passes messages to and from the serving loop over an inproc pair
(without copying them) and sends the heartbeats while the loop computes.
"""
from __future__ import annotations

import ctypes
import logging
import secrets
import threading
import time
from collections.abc import Callable

import zmq
import zmq.utils.monitor

from .keys import CurveKeys
from .transport import (FREE_BYTES, HEARTBEAT_S, HEARTBEAT_TIMEOUT_S, KEEP_OF_FIRST_FRAME, Closed, Disconnected,
                        Message, Peer, Pool, as_bytes)

log = logging.getLogger("pyggml.rpc.zmq")

ZAP_ENDPOINT = "inproc://zeromq.zap.01"
ZAP_PER_S, ZAP_BURST = 20.0, 64  # handshakes admitted per second, server-wide, and at once
HEARTBEAT = [b""]  # a message of one empty frame: no request or reply is that short


def seed_rand() -> bool:
    """Seed C's ``rand()``, where libzmq's ROUTER starts numbering its peers, from the OS's
    secrets.  Must come before the socket is made; False where the C library cannot be reached."""
    try:
        libc = ctypes.CDLL(None)
        libc.srand(ctypes.c_uint(secrets.randbits(32)))
        return True
    except (OSError, AttributeError):
        return False


def _options(sock: zmq.Socket) -> None:
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.HEARTBEAT_IVL, int(HEARTBEAT_S * 1000))
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, int(HEARTBEAT_TIMEOUT_S * 1000))
    sock.setsockopt(zmq.HEARTBEAT_TTL, int(HEARTBEAT_TIMEOUT_S * 1000))


def _close_monitored(sock: zmq.Socket, monitor: zmq.Socket) -> None:
    """Close a socket and its monitor: monitoring stopped first.  libzmq's I/O thread sends each
    event to the monitor blocking; with the monitor closed under it, the next event (the socket's
    own closing) blocks that thread for ever, and every connection of the context with it
    (libzmq issue 3575)."""
    if not sock.closed:
        sock.disable_monitor()
    monitor.close(linger=0)
    sock.close(linger=0)


class Zap(threading.Thread):
    """The server's ZAP handler: a handshake is admitted if it holds the client key (or, with
    no key, comes over the NULL mechanism), the server has fewer than ``max_peers`` connections
    (``live()``), and the rate allows it."""

    def __init__(self, ctx: zmq.Context, client_key: bytes | None, max_peers: int, live: Callable[[], int]) -> None:
        super().__init__(name="pyggml-rpc-zap", daemon=True)
        self.sock = ctx.socket(zmq.REP)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(ZAP_ENDPOINT)
        self.client_key = zmq.utils.z85.decode(client_key) if client_key is not None else None
        self.max_peers, self.live = max_peers, live
        self.tokens, self.refilled = float(ZAP_BURST), time.monotonic()
        self.admitted = self.refused = 0
        self.stop = threading.Event()

    def decide(self, address: str, mechanism: bytes, credentials: list[bytes]) -> str | None:
        """Why a handshake is refused, or None."""
        now = time.monotonic()
        self.tokens = min(float(ZAP_BURST), self.tokens + (now - self.refilled) * ZAP_PER_S)
        self.refilled = now
        if self.tokens < 1:
            return "too many handshakes"
        self.tokens -= 1
        if self.live() >= self.max_peers:
            return "too many connections"
        if self.client_key is None:
            return None if mechanism == b"NULL" else "this server speaks plain ZeroMQ"
        if mechanism != b"CURVE" or not credentials or credentials[0] != self.client_key:
            return "unknown key"
        return None

    def run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        while not self.stop.is_set():
            if not poller.poll(200):
                continue
            request = self.sock.recv_multipart()
            if len(request) < 6:  # not a ZAP request: answer nothing that could admit
                self.sock.send_multipart([b"1.0", b"", b"500", b"malformed", b"", b""])
                continue
            version, request_id, _domain, address, _identity, mechanism, *credentials = request
            why = self.decide(address.decode("ascii", "replace"), mechanism, credentials)
            if why is None:
                self.admitted += 1
                self.sock.send_multipart([version, request_id, b"200", b"OK", b"", b""])
            else:
                self.refused += 1
                log.info("refused a ZeroMQ handshake from %s: %s", address.decode("ascii", "replace"), why)
                self.sock.send_multipart([version, request_id, b"400", why.encode(), b"", b""])
        self.sock.close()


class ZmqListener:
    """:class:`.transport.Listener`'s interface over a ROUTER socket (see the module's text)."""

    def __init__(self, host: str, port: int, keys: CurveKeys | None, max_frames: int, max_bytes: int,
                 max_peers: int = 512, max_queued: int = 16, pool: Pool | None = None,
                 allowance: Callable[[Peer], int] | None = None, holds: Callable[[Peer], bool] | None = None,
                 idle_timeout: float = 600.0, greeting_timeout: float = 10.0) -> None:
        if not seed_rand():
            log.warning("cannot seed the C library's rand(): ZeroMQ's routing ids are predictable")
        self.max_frames, self.max_bytes, self.max_queued = max_frames, max_bytes, max_queued
        self.pool = pool if pool is not None else Pool(max(2 * max_bytes, 256 << 20))
        self.allowance, self.holds = allowance, holds
        self.idle_timeout, self.greeting_timeout = idle_timeout, greeting_timeout
        self.ctx = zmq.Context()
        self.connections = 0  # live, from the socket's monitor (the front thread counts them)
        self.zap = Zap(self.ctx, keys.peer if keys is not None else None, max_peers, lambda: self.connections)
        self.zap.start()
        router = self.ctx.socket(zmq.ROUTER)
        _options(router)
        router.setsockopt(zmq.MAXMSGSIZE, max_bytes)
        router.setsockopt(zmq.RCVHWM, max_queued)
        router.setsockopt(zmq.SNDHWM, max_queued)
        router.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a message to a vanished peer is an error, not a silent drop
        router.setsockopt(zmq.ZAP_DOMAIN, b"pyggml")  # ZAP for the NULL mechanism too: rate and count
        if keys is not None:
            router.curve_server = True
            router.curve_secretkey = keys.secret
            router.curve_publickey = keys.public
        bind_host = f"[{host}]" if ":" in host else host
        if port:
            router.bind(f"tcp://{bind_host}:{port}")
        else:
            port = router.bind_to_random_port(f"tcp://{bind_host}")
        self.endpoint = f"zmq://{host}:{port}"
        self.router = router
        self.monitor = router.get_monitor_socket(zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED)
        self.loop_end = self.ctx.socket(zmq.PAIR)
        self.loop_end.bind("inproc://pyggml-rpc-front")
        self.front_end = self.ctx.socket(zmq.PAIR)
        self.front_end.connect("inproc://pyggml-rpc-front")
        self.peers: dict[int, Peer] = {}
        self.by_rid: dict[bytes, Peer] = {}
        self._rid_of: dict[int, bytes] = {}
        self.serving: Peer | None = None
        self.held: set[Peer] = set()
        self._held_out: list[list] = []
        self._ids = iter(range(1, 1 << 62))
        self._stop = threading.Event()
        self._front = threading.Thread(target=self._run_front, name="pyggml-rpc-zmq", daemon=True)

    # -- the front thread: the only one that touches the ROUTER ----------------------------------------
    def start_heartbeats(self) -> None:
        self._front.start()

    def _run_front(self) -> None:
        poller = zmq.Poller()
        for sock in (self.router, self.front_end, self.monitor):
            poller.register(sock, zmq.POLLIN)
        next_beat = time.monotonic() + HEARTBEAT_S
        known: set[bytes] = set()  # routing ids that sent something and were not found gone since
        while not self._stop.is_set():
            ready = dict(poller.poll(max(0, int((next_beat - time.monotonic()) * 1000))))
            if self.monitor in ready:
                while self.monitor.poll(0):
                    event = zmq.utils.monitor.recv_monitor_message(self.monitor)["event"]
                    self.connections += 1 if event == zmq.EVENT_ACCEPTED else -1
            if self.router in ready:
                for _ in range(64):
                    try:
                        frames = self.router.recv_multipart(zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    known.add(frames[0].bytes)
                    self.front_end.send_multipart([b"m", *frames], copy=False)
            if self.front_end in ready:
                while True:
                    try:
                        kind, rid, *frames = self.front_end.recv_multipart(zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    try:
                        self.router.send_multipart([rid, *frames], zmq.NOBLOCK, copy=False)
                    except zmq.ZMQError as e:  # its replies pile up unread, or it is gone
                        known.discard(rid.bytes)
                        why = "left its replies unread" if isinstance(e, zmq.Again) else "closed the connection"
                        self.front_end.send_multipart([b"x", rid.bytes, why.encode()])
            if time.monotonic() >= next_beat:
                next_beat = time.monotonic() + HEARTBEAT_S
                for rid in list(known):
                    try:
                        self.router.send_multipart([rid, *HEARTBEAT], zmq.NOBLOCK)
                    except zmq.Again:
                        pass  # a full queue: it does not read now, which is its right while it waits for nothing
                    except zmq.ZMQError:
                        known.discard(rid)
                        self.front_end.send_multipart([b"x", rid, b"closed the connection"])

    # -- the loop's side ------------------------------------------------------------------------------
    def poll(self, timeout: float) -> list[Message | Disconnected]:
        events: list[Message | Disconnected] = []
        if self.loop_end.poll(int(timeout * 1000)):
            for _ in range(256):
                try:
                    kind, rid, *frames = self.loop_end.recv_multipart(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                self._event(kind.bytes, rid.bytes, frames, events)
        self._expire(events)
        return events

    def _event(self, kind: bytes, rid: bytes, frames: list, events: list) -> None:
        if kind == b"x":
            peer = self.by_rid.get(rid)
            if peer is not None:
                self._forget(peer)
                events.append(Disconnected(peer, f"it {frames[0].bytes.decode()}"))
            return
        peer = self.by_rid.get(rid)
        if peer is None:
            peer = self._add(rid)
        peer.last_active = time.monotonic()
        views = [memoryview(f.buffer) for f in frames]
        total = sum(v.nbytes for v in views)
        allowed = self.max_bytes if self.allowance is None else min(self.max_bytes, self.allowance(peer))
        error = None
        if len(views) > self.max_frames:
            error = f"a request of {len(views)} frames; the limit is {self.max_frames}"
        elif total > allowed:
            error = (f"a request of {total} bytes exceeds the {allowed} this session may send in one (what its "
                     f"buffers hold, and {FREE_BYTES >> 10} KiB)")
        if error is not None:
            views = [views[0][:KEEP_OF_FIRST_FRAME]]
        events.append(Message(peer, views, error))

    def _add(self, rid: bytes) -> Peer:
        peer = Peer(next(self._ids), None, f"zmq:{rid.hex()}", None, tls=False, handshaking=False)
        self.peers[peer.id] = peer
        self.by_rid[rid] = peer
        self._rid_of[peer.id] = rid
        return peer

    def _forget(self, peer: Peer) -> None:
        peer.closed = True
        self.held.discard(peer)
        rid = self._rid_of.pop(peer.id, None)
        self.peers.pop(peer.id, None)
        if rid is not None and self.by_rid.get(rid) is peer:
            del self.by_rid[rid]

    def _expire(self, events: list) -> None:
        """A peer that never said HELLO, or that idles holding nothing, is forgotten (its
        connection stays with libzmq, counted against the ZAP handler's limit)."""
        now = time.monotonic()
        for peer in list(self.peers.values()):
            if not peer.greeted and now - peer.opened > self.greeting_timeout:
                reason = f"no HELLO within {self.greeting_timeout:.0f} s"
            elif (peer.greeted and now - peer.last_active > self.idle_timeout
                  and not (self.holds is not None and self.holds(peer))):
                reason = f"idle for {self.idle_timeout:.0f} s holding nothing"
            else:
                continue
            self._forget(peer)
            events.append(Disconnected(peer, reason))

    def send(self, peer: Peer, frames: list, now: bool = True, max_bytes: int | None = None) -> bool:
        rid = self._rid_of.get(peer.id)
        if rid is None or peer.closed:
            return True
        message = [b"s", rid, *(as_bytes(f) for f in frames)]
        if now:
            self.loop_end.send_multipart(message, copy=False)
        else:
            self._held_out.append(message)
        return True

    def send_held(self) -> None:
        held, self._held_out = self._held_out, []
        for message in held:
            self.loop_end.send_multipart(message, copy=False)

    def dial(self, host: str, port: int, tls: object) -> Peer:
        raise OSError("links between servers are made over TCP")

    def close_peer(self, peer: Peer) -> None:
        self._forget(peer)

    def close(self) -> None:
        self._stop.set()
        if self._front.is_alive():
            self._front.join(5)
        self.zap.stop.set()
        self.zap.join(5)
        _close_monitored(self.router, self.monitor)
        for sock in (self.loop_end, self.front_end):
            sock.close(linger=0)
        self.ctx.term()


class ZmqChannel:
    """The client's side: :class:`.transport.Channel`'s interface over a DEALER socket."""

    def __init__(self, sock: zmq.Socket, monitor: zmq.Socket, host: str, port: int) -> None:
        self.sock, self.monitor = sock, monitor
        self.host, self.port = host, port
        self.up = False  # the TCP connection was made (before: a closing is a refusal)
        self.poller = zmq.Poller()
        self.poller.register(sock, zmq.POLLIN)
        self.poller.register(monitor, zmq.POLLIN)

    @classmethod
    def connect(cls, host: str, port: int, keys: CurveKeys | None, timeout: float) -> ZmqChannel:
        sock = zmq.Context.instance().socket(zmq.DEALER)
        _options(sock)
        sock.setsockopt(zmq.IMMEDIATE, 1)  # messages wait for a connection that is up, never queue for a dead one
        sock.setsockopt(zmq.RECONNECT_IVL, -1)  # a server that went is gone: its sessions went with it
        if keys is not None:
            sock.curve_secretkey, sock.curve_publickey, sock.curve_serverkey = keys.secret, keys.public, keys.peer
        monitor = sock.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_CLOSED
                                          | zmq.EVENT_HANDSHAKE_FAILED_AUTH
                                          | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                                          | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)
        sock.connect(f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}")
        return cls(sock, monitor, host, port)

    def peer_address(self) -> str:
        return f"zmq://{self.host}:{self.port}"

    def _check_monitor(self) -> None:
        while self.monitor.poll(0):
            event = zmq.utils.monitor.recv_monitor_message(self.monitor)["event"]
            if event == zmq.EVENT_CONNECTED:
                self.up = True
            elif event in (zmq.EVENT_HANDSHAKE_FAILED_AUTH, zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL,
                           zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL):
                raise Closed("the server refused this client (a wrong key, no key, or too many connections: "
                             "the CurveZMQ handshake failed)")
            elif not self.up:
                raise Closed("connection refused (is pyggml-rpc-server --transport zmq running there?)")
            else:
                raise Closed("the server closed the connection")

    def send_messages(self, messages: list[list], timeout: float) -> int:
        total = 0
        deadline = time.monotonic() + timeout
        for frames in messages:
            views = [as_bytes(f) for f in frames]
            total += sum(v.nbytes for v in views)
            while True:  # (no connection is up yet, or its queue is full: what the monitor says decides)
                try:
                    self.sock.send_multipart(views, zmq.NOBLOCK, copy=False)
                    break
                except zmq.Again:
                    self._check_monitor()
                    if time.monotonic() > deadline:
                        raise TimeoutError("the server took no message") from None
                    self.monitor.poll(10)
        return total

    def send(self, frames: list, timeout: float) -> int:
        return self.send_messages([frames], timeout)

    def recv(self, deadline: float, silence: float = HEARTBEAT_TIMEOUT_S) -> list[memoryview]:
        """The next message that is not a heartbeat (TimeoutError "silence" or "deadline" as
        :meth:`.transport.Channel.recv`; Closed when the connection ended or was refused)."""
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("deadline")
            ready = dict(self.poller.poll(int(min(left, silence) * 1000)))
            if self.sock in ready:
                frames = self.sock.recv_multipart(copy=False)
                if len(frames) == 1 and not len(frames[0].buffer):
                    continue
                return [memoryview(f.buffer) for f in frames]
            if self.monitor in ready:
                self._check_monitor()
                continue
            raise TimeoutError("silence" if time.monotonic() < deadline else "deadline")

    def close(self) -> None:
        _close_monitored(self.sock, self.monitor)
