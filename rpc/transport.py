"""Messages over TCP for the RPC server and client: frames with lengths, connections named by the server.

Why not ZeroMQ by default, which carried these messages first: a ROUTER socket lets a connecting
peer choose its own routing id and numbers the other peers from a counter of its own; when the
counter reaches a number some peer chose, libzmq asserts (``routing_socket_base_t::add_out_pipe``)
and aborts the whole process, and no socket option refuses chosen ids.  Here a connection is named
by the server alone (a counter that never repeats), so no peer can take another's name, and a peer
that sends garbage loses only its own connection.  ggml-rpc speaks plain TCP too.

A message is a list of frames, sent as::

    u32 frame count | u64 size of each frame | the frames' bytes, one after another

A message of no frames is a heartbeat.  The receiver checks the count and the sizes' total against
its limits before it reads any frame; a message over the limits is read past (its bytes discarded,
never kept) and delivered at once as an error carrying the first bytes of its first frame, where
the request header with its sequence number is, so the sender gets an answer and the connection
stays usable.

What the server holds for one connection grows with what that connection has done, never with
what it says it will do:

- memory: a message's buffer grows with the bytes that actually arrived (doubling, from 64 KiB),
  so a head declaring 512 MiB costs nothing until 512 MiB are sent;
- the server-wide :class:`Pool` of bytes in transit: a message over 64 KiB reserves its size
  there before its body is read (a message that started can always finish; one that cannot
  reserve waits, its connection unread, until others give bytes back), and so do the server's
  own sends over links to other servers;
- the size itself: the server says how much each connection may send in one message (its
  ``allowance``: 64 KiB before HELLO and for a session that holds no buffer, what it holds after);
- slots: at most ``max_per_address`` connections from one address, so that one host cannot take
  every slot; when every slot is taken, a new connection takes the slot of the oldest that has
  not said HELLO, or of the session idle longest that holds nothing; such a session is also
  closed after ``idle_timeout``;
- time: each poll reads at most ``READ_BATCH`` messages (heartbeats too) and ``READ_BATCH_BYTES``
  from one connection, so that a stream from one client cannot keep the others waiting.

The server's own connections to other servers (:meth:`Listener.dial`) run in the same loop:
their connect, TLS handshake and sends never block it, and a link whose peer takes no bytes for
``LINK_STALL_S`` is closed.

Liveness.  A process that dies closes its connections (the kernel resets them); a host that
vanishes is found by TCP keepalive and ``TCP_USER_TIMEOUT``.  A server that is stopped or wedged
is found by heartbeats: while a client waits for it - its request is being served, or its bytes
wait unread - the server sends that client an empty message every second from a thread of its
own, so a client can tell a server that is busy for minutes from one that stopped (no byte for
a few seconds).

Encryption and authentication: TLS from the standard library, with the certificates
``pyggml-rpc-server --gen-key`` writes (see :mod:`.keys`).  All socket operations on one
connection hold that connection's lock: an ``SSLSocket`` must not be used from two threads at once.
"""
from __future__ import annotations

import errno
import logging
import select
import selectors
import socket
import ssl
import struct
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import count, islice

log = logging.getLogger("pyggml.rpc.transport")

COUNT = struct.Struct("<I")
SIZE = struct.Struct("<Q")
MAX_FRAME_COUNT = 1024  # a count beyond this is not a message but garbage: the connection is closed
KEEP_OF_FIRST_FRAME = 64  # bytes of the first frame kept from a refused message (the request header)
FREE_BYTES = 64 << 10   # a message this small reserves nothing from the pool, and may always be sent
CORK_TLS = 1 << 20
TLS_CHUNK = 16 << 10    # one TLS record: a partial non-blocking write is retried with the same bytes
HEARTBEAT_S = 1.0
HEARTBEAT_TIMEOUT_S = 3.0  # a client waiting for an answer gives up after this long without a byte
READ_BATCH, READ_BATCH_BYTES = 16, 1 << 20  # messages (heartbeats too) and bytes taken from one peer per poll
GREETING_TIMEOUT_S = 10.0  # a connection must finish its TLS handshake and say HELLO within this
STALL_S = 30.0          # a message begun must go on arriving: no byte of it for this long ends the connection
LINK_STALL_S = 5.0      # a link to another server whose peer takes no byte of what waits for this long is closed


class Closed(Exception):
    """The connection ended: the peer closed it, it broke, or it sent what is not a message."""


class Parked(Exception):
    """A message cannot reserve its bytes from the pool now: its connection is read again once
    other messages gave bytes back."""


class Pool:
    """Bytes in transit, server-wide: reserved by messages over ``FREE_BYTES`` before their body
    is read and by sends over links; given back when served or sent.  Thread-safe."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        self.freed = False  # something was given back since the loop last looked
        self._lock = threading.Lock()

    def take(self, n: int) -> bool:
        with self._lock:
            if self.used + n > self.limit:
                return False
            self.used += n
            return True

    def give(self, n: int) -> None:
        if n:
            with self._lock:
                self.used -= n
                self.freed = True


def message_head(frames: list[memoryview]) -> bytes:
    return COUNT.pack(len(frames)) + b"".join(SIZE.pack(f.nbytes) for f in frames)


def as_bytes(frame: object) -> memoryview:
    """A flat byte view of a frame (bytes, bytearray, memoryview or a contiguous numpy array)."""
    view = memoryview(frame)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def tune(sock: socket.socket) -> None:
    """No Nagle delay for small requests; keepalive so a vanished host ends the connection."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", 2), ("TCP_KEEPINTVL", 1), ("TCP_KEEPCNT", 3), ("TCP_USER_TIMEOUT", 5000)):
        if hasattr(socket, name):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)


class MessageReader:
    """One connection's incoming messages, decoded as far as its bytes go.

    :meth:`read` is called with the socket's ``recv_into`` whenever bytes may be there; it
    returns ``(frames, error)`` for a whole message, ``None`` for a heartbeat, or raises whatever
    ``recv_into`` raises when nothing more can be read now (the state is kept for the next call),
    or :class:`Parked`.  ``limit`` (called at each message's sizes) is what this connection may
    send in one message now, within ``max_bytes``; ``pool`` is the server-wide bound."""

    def __init__(self, max_frames: int, max_bytes: int, limit: Callable[[], int] | None = None,
                 pool: Pool | None = None) -> None:
        self.max_frames = max_frames
        self.max_bytes = max_bytes
        self.limit = limit
        self.pool = pool
        self.reserved = 0    # what the message being read holds of the pool
        self.last_byte = time.monotonic()
        self._scratch: memoryview | None = None  # for refused bytes, made when first needed
        self._start()

    def _start(self) -> None:
        self._phase = "count"
        self._view = memoryview(bytearray(COUNT.size))
        self._pos = 0
        self._sizes: list[int] = []
        self._total = 0
        self._body: bytearray | None = None
        self._error: str | None = None
        self._discard = 0

    @property
    def partial(self) -> bool:
        """A message has begun arriving and is not whole yet."""
        return self._phase != "count" or self._pos > 0

    def release(self) -> None:
        """Give back what the message being read reserved (its connection ended)."""
        if self.pool is not None:
            self.pool.give(self.reserved)
        self.reserved = 0

    def _recv(self, recv_into: Callable, view: memoryview, n: int) -> int:
        got = recv_into(view, n)
        if got == 0:
            raise Closed("the peer closed the connection")
        self.last_byte = time.monotonic()
        return got

    def read(self, recv_into: Callable) -> tuple[list[memoryview], str | None] | None:
        while True:
            if self._phase == "discard":  # the rest of a refused message, already answered
                if self._scratch is None:
                    self._scratch = memoryview(bytearray(64 << 10))
                while self._discard:
                    self._discard -= self._recv(recv_into, self._scratch, min(len(self._scratch), self._discard))
                self._start()
            if self._phase == "reserve":
                self._reserve()
                continue
            if self._phase == "body":
                done = self._read_body(recv_into)
                if done is not None:
                    return done
                continue
            want = len(self._view) - self._pos
            if want:
                self._pos += self._recv(recv_into, self._view[self._pos:], want)
                if self._pos < len(self._view):
                    continue
            if self._phase == "count":
                (n_frames,) = COUNT.unpack(self._view)
                if n_frames > MAX_FRAME_COUNT:
                    raise Closed(f"a message of {n_frames} frames: not a pyggml peer")
                if n_frames == 0:  # a heartbeat
                    self._start()
                    return None
                self._phase, self._view, self._pos = "sizes", memoryview(bytearray(SIZE.size * n_frames)), 0
            elif self._phase == "sizes":
                self._sizes = [s for (s,) in SIZE.iter_unpack(self._view)]
                self._total = total = sum(self._sizes)
                allowed = self.max_bytes if self.limit is None else min(self.max_bytes, self.limit())
                if len(self._sizes) > self.max_frames:
                    self._error = f"a request of {len(self._sizes)} frames; the limit is {self.max_frames}"
                elif total > self.max_bytes:
                    self._error = f"a request of {total} bytes exceeds this server's --max-message of {self.max_bytes}"
                elif total > allowed:
                    self._error = (f"a request of {total} bytes exceeds the {allowed} this session may send in one "
                                   f"(what its buffers hold, and {FREE_BYTES >> 10} KiB)")
                if self._error is None:
                    self._phase = "reserve"
                else:  # keep the header of the first frame (to answer it), discard the rest unread
                    keep = min(self._sizes[0], KEEP_OF_FIRST_FRAME)
                    self._phase, self._view, self._pos = "first", memoryview(bytearray(keep)), 0
                    self._discard = total - keep
            elif self._phase == "first":  # answered now; its other bytes are read past after
                kept, error, rest = self._view, self._error, self._discard
                self._start()
                self._phase, self._discard = "discard", rest
                return [kept], error

    def _reserve(self) -> None:
        need = max(0, self._total - FREE_BYTES)
        if need and self.pool is not None and not self.pool.take(need):
            raise Parked()
        self.reserved = need if self.pool is not None else 0
        self._phase, self._pos = "body", 0
        self._body = bytearray(min(self._total, FREE_BYTES))

    def _read_body(self, recv_into: Callable) -> tuple[list[memoryview], None] | None:
        """Read into the body, grown as its bytes come (doubling up to the declared total)."""
        body = self._body
        while self._pos < self._total:
            if self._pos == len(body):
                body.extend(bytes(min(self._total, 2 * len(body)) - len(body)))
            with memoryview(body) as view:
                self._pos += self._recv(recv_into, view[self._pos:], len(body) - self._pos)
        frames, at = [], 0
        view = memoryview(body)
        for s in self._sizes:
            frames.append(view[at:at + s])
            at += s
        self.release()  # served now; what the server keeps longer it reserves again
        self._start()
        return frames, None


@dataclass(frozen=True)
class Framing:
    """How a listener's connections cut bytes into messages: ours (frames with a count, heartbeats
    while a client waits), or another protocol's (ggml-rpc's, :mod:`.ggml_server`)."""
    reader: type[MessageReader] = MessageReader
    head: Callable[[list[memoryview]], bytes] = message_head
    heartbeats: bool = True


PYGGML_FRAMING = Framing()


# -- the server's side ----------------------------------------------------------------------------

@dataclass(eq=False)
class Peer:
    """One connection, named by the listener's own counter: a client's, or (``outgoing``) the
    server's own to another server."""
    id: int
    sock: socket.socket
    address: str
    reader: MessageReader
    tls: bool
    handshaking: bool
    host: str = ""
    opened: float = field(default_factory=time.monotonic)
    last_active: float = field(default_factory=time.monotonic)  # its last message
    greeted: bool = False          # the server marks it once the client said HELLO
    closed: bool = False
    outgoing: bool = False         # dialled by this server (a link to another server)
    connecting: bool = False       # an outgoing connect not yet complete
    parked: bool = False           # its next message waits for the pool: not read meanwhile
    lock: threading.Lock = field(default_factory=threading.Lock)
    out: deque = field(default_factory=deque)  # (bytes to send, ends a message) in order
    queued: int = 0                # whole messages in ``out``
    queued_bytes: int = 0          # their bytes (an outgoing peer's are reserved from the pool)
    progress: float = field(default_factory=time.monotonic)  # the last time out was empty or shrank
    interest: int = 0              # what the selector watches for it (0: not registered)
    tls_context: ssl.SSLContext | None = None  # an outgoing peer's, until its handshake starts


@dataclass
class Message:
    peer: Peer
    frames: list[memoryview]
    error: str | None = None


@dataclass
class Disconnected:
    peer: Peer
    reason: str


class Listener:
    """The server's sockets: accepts, reads whole messages, sends without blocking, beats hearts.

    :meth:`poll` is called by the server's one thread and returns what happened; :meth:`send`
    queues a reply and sends what the socket takes now, or holds it for :meth:`send_held` (the
    server answers everything one poll read, then sends: a client waiting for a step's results
    is woken once); a peer with ``max_queued`` replies unsent gets ``False`` back (the server
    ends its session rather than wait for it).  ``allowance(peer)`` is the largest message the
    peer may send now, ``holds(peer)`` whether its session holds anything (a session that holds
    nothing may lose its slot when idle)."""

    def __init__(self, host: str, port: int, tls: ssl.SSLContext | None, max_frames: int, max_bytes: int,
                 max_peers: int = 512, max_queued: int = 16, max_per_address: int = 64,
                 pool: Pool | None = None, allowance: Callable[[Peer], int] | None = None,
                 holds: Callable[[Peer], bool] | None = None, idle_timeout: float = 600.0,
                 framing: Framing = PYGGML_FRAMING) -> None:
        self.tls = tls
        self.framing = framing
        self.max_frames, self.max_bytes = max_frames, max_bytes
        self.max_peers, self.max_queued, self.max_per_address = max_peers, max_queued, max_per_address
        self.pool = pool if pool is not None else Pool(max(2 * max_bytes, 256 << 20))
        self.allowance, self.holds, self.idle_timeout = allowance, holds, idle_timeout
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.sock = socket.socket(family, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.sock.listen(128)
        self.sock.setblocking(False)
        self.endpoint = f"{host}:{self.sock.getsockname()[1]}"
        self.sel = selectors.DefaultSelector()
        self.sel.register(self.sock, selectors.EVENT_READ, None)
        self.peers: dict[int, Peer] = {}        # every connection, outgoing ones too
        self.per_host: Counter[str] = Counter()  # clients' connections by address
        self._ids = count(1)
        self._again: set[Peer] = set()      # may have bytes the selector cannot see (TLS) or more messages
        self._parked: list[Peer] = []       # waiting for the pool
        self._dirty: set[Peer] = set()      # the heartbeat thread left bytes unsent: register for writing
        self._dirty_lock = threading.Lock()
        self._lost: list[Disconnected] = []  # connections a send found broken, reported by the next poll
        self._held_out: set[Peer] = set()   # with replies send() holds until send_held()
        self.serving: Peer | None = None    # whose request the server is working on (it gets heartbeats)
        self.held: set[Peer] = set()        # whose requests the server holds for now (they get them too)
        self._stop = threading.Event()
        self._beats: threading.Thread | None = None

    # -- the loop's side --------------------------------------------------------------------------
    def poll(self, timeout: float) -> list[Message | Disconnected]:
        events: list[Message | Disconnected] = self._lost
        self._lost = []
        with self._dirty_lock:
            dirty, self._dirty = self._dirty, set()
        for peer in dirty:
            with peer.lock:
                self._update_interest(peer)
        again, self._again = self._again, set()
        if self._parked and self.pool.freed:  # bytes were given back: those waiting try again
            self.pool.freed = False
            parked, self._parked = self._parked, []
            for peer in parked:
                with peer.lock:
                    peer.parked = False
                    self._update_interest(peer)
                again.add(peer)
        accept = False
        for key, mask in self.sel.select(0 if again else timeout):
            if key.data is None:  # after the reads: connections that ended free their slots first
                accept = True
                continue
            peer = key.data
            if mask & selectors.EVENT_WRITE:
                if peer.connecting:
                    self._connected(peer, events)
                else:
                    self._flush_and_mark(peer, events)
            if mask & selectors.EVENT_READ:
                again.discard(peer)
                self._read(peer, events)
        for peer in again:
            self._read(peer, events)
        if accept:
            self._accept(events)
        self._expire(events)
        return events

    # -- accepting, with slots bounded per address ---------------------------------------------------
    def _accept(self, events: list) -> None:
        for _ in range(64):
            try:
                sock, addr = self.sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:  # out of descriptors, for one: refuse this one, keep serving
                log.warning("cannot accept a connection: %s", e)
                return
            host = addr[0]
            address = f"{host}:{addr[1]}"
            if self.per_host[host] >= self.max_per_address:
                self._reap(host, events)
            if self.per_host[host] >= self.max_per_address:
                log.warning("refused a connection from %s: %d connections from that address (the limit)",
                            address, self.per_host[host])
                sock.close()
                continue
            if self._clients() >= self.max_peers and not self._make_room(events):
                log.warning("refused a connection from %s: %d clients are connected (the limit), none idle",
                            address, self._clients())
                sock.close()
                continue
            tune(sock)
            sock.setblocking(False)
            if self.tls is not None:
                sock = self.tls.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
            self._add(sock, address, host, handshaking=self.tls is not None)

    def _add(self, sock: socket.socket, address: str, host: str, handshaking: bool, outgoing: bool = False) -> Peer:
        peer = Peer(next(self._ids), sock, address, None, tls=isinstance(sock, ssl.SSLSocket),
                    handshaking=handshaking, host=host, outgoing=outgoing, greeted=outgoing,
                    connecting=outgoing)
        limit = (lambda: self.allowance(peer)) if self.allowance is not None and not outgoing else None
        reader = MessageReader if outgoing else self.framing.reader  # (links to other servers speak ours)
        peer.reader = reader(self.max_frames, self.max_bytes, limit, self.pool)
        self.peers[peer.id] = peer
        if not outgoing:
            self.per_host[host] += 1
        self._update_interest(peer)
        if peer.handshaking:
            self._again.add(peer)
        return peer

    def _reap(self, host: str, events: list) -> None:
        """Close the connections from ``host`` that its side has ended (reset or shut) but the
        loop has not read to their end yet: a client that reconnects at once gets its slot."""
        peers = [p for p in self.peers.values() if p.host == host and not p.outgoing and not p.closed]
        poller = select.poll()
        by_fd = {p.sock.fileno(): p for p in peers}
        for fd in by_fd:
            poller.register(fd, select.POLLRDHUP | select.POLLHUP | select.POLLERR)
        for fd, _ in poller.poll(0):
            peer = by_fd[fd]
            with peer.lock:
                self._close_locked(peer)
            events.append(Disconnected(peer, "the client ended the connection"))

    def _clients(self) -> int:
        return len(self.peers) - sum(1 for p in self.peers.values() if p.outgoing)

    def _make_room(self, events: list) -> bool:
        """Every slot is taken: free the slot of the oldest connection that has not said HELLO,
        else of the session idle longest that holds nothing.  False if there is none."""
        clients = [p for p in self.peers.values() if not p.outgoing and not p.closed]
        quiet = [p for p in clients if not p.greeted]
        reason = "its slot was given to a new connection: it had not said HELLO"
        if not quiet:
            quiet = [p for p in clients if not p.reader.partial and not p.out and not self._holds(p)]
            reason = "its slot was given to a new connection: its session was idle and held nothing"
        if not quiet:
            return False
        victim = min(quiet, key=lambda p: p.opened if not p.greeted else p.last_active)
        with victim.lock:
            self._close_locked(victim)
        events.append(Disconnected(victim, reason))
        return True

    def _holds(self, peer: Peer) -> bool:
        return self.holds(peer) if self.holds is not None else False

    # -- the server's own connections to other servers --------------------------------------------
    def dial(self, host: str, port: int, tls: ssl.SSLContext | None) -> Peer:
        """Connect to another server without waiting: the peer is returned at once, what is sent
        to it leaves once it is connected (and its TLS handshake done), and its replies come as
        Messages; a failure comes as a Disconnected.  Raises OSError if the connect fails at once."""
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setblocking(False)
        err = sock.connect_ex((host, port))
        if err not in (0, errno.EINPROGRESS):
            sock.close()
            raise OSError(err, "connect failed")
        peer = self._add(sock, f"{host}:{port}", host, handshaking=False, outgoing=True)
        peer.tls_context = tls
        return peer

    def _connected(self, peer: Peer, events: list) -> None:
        with peer.lock:
            if peer.closed:
                return
            err = peer.sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
            if not err:
                try:
                    tune(peer.sock)
                    peer.connecting = False
                    if peer.tls_context is not None:  # the handshake goes on in _read, as a client's does
                        self._set_interest(peer, 0)
                        peer.sock = peer.tls_context.wrap_socket(peer.sock, server_side=False,
                                                                 do_handshake_on_connect=False)
                        peer.tls = peer.handshaking = True
                except OSError as e:
                    err = e.errno or errno.EIO
            if err:
                self._close_locked(peer)
            else:
                peer.progress = time.monotonic()
                self._update_interest(peer)
                self._again.add(peer)
                return
        events.append(Disconnected(peer, errno.errorcode.get(err, str(err))))

    # -- reading ------------------------------------------------------------------------------------
    def _read(self, peer: Peer, events: list) -> None:
        """The peer's next messages: those already here, a few and a little at a time, so that
        one client's stream cannot keep the others waiting (the rest is read on the next poll)."""
        taken = 0
        with peer.lock:
            if peer.closed or peer.parked or peer.connecting:
                return
            try:
                if peer.handshaking:
                    peer.sock.do_handshake()
                    peer.handshaking = False
                    self._update_interest(peer)  # an outgoing peer's held bytes may leave now
                    if peer.out:
                        self._flush_locked(peer)
                for _ in range(READ_BATCH):
                    message = peer.reader.read(peer.sock.recv_into)
                    if message is None:  # a heartbeat: counted, so that a stream of them takes its turn
                        continue
                    frames, error = message
                    peer.last_active = time.monotonic()
                    events.append(Message(peer, frames, error))
                    taken += sum(f.nbytes for f in frames)
                    if taken >= READ_BATCH_BYTES:
                        break
            except (BlockingIOError, InterruptedError, ssl.SSLWantReadError, ssl.SSLWantWriteError):
                return
            except Parked:
                peer.parked = True
                self._parked.append(peer)
                self._update_interest(peer)  # (level-triggered: unread bytes would wake the loop for nothing)
                return
            except (Closed, OSError) as e:  # ssl.SSLError is an OSError: a failed handshake, a bad record
                reason = str(e) or type(e).__name__
                self._close_locked(peer)
            else:
                self._again.add(peer)  # more may be there, and TLS may hold it where select cannot see
                return
        events.append(Disconnected(peer, reason))

    def _expire(self, events: list) -> None:
        now = time.monotonic()
        for peer in list(self.peers.values()):
            if peer.outgoing:
                reason = (f"the other server took no bytes for {LINK_STALL_S:.0f} s"
                          if peer.out and now - peer.progress > LINK_STALL_S else None)
            elif not peer.greeted:
                reason = f"no HELLO within {GREETING_TIMEOUT_S:.0f} s" if now - peer.opened > GREETING_TIMEOUT_S else None
            elif peer.reader.partial and not peer.parked:
                reason = (f"a message stopped arriving: no byte for {STALL_S:.0f} s"
                          if now - peer.reader.last_byte > STALL_S else None)
            else:
                reason = (f"idle for {self.idle_timeout:.0f} s holding nothing"
                          if now - peer.last_active > self.idle_timeout and not peer.out and not self._holds(peer)
                          else None)
            if reason is not None:
                with peer.lock:
                    self._close_locked(peer)
                events.append(Disconnected(peer, reason))

    # -- sending ------------------------------------------------------------------------------------
    def send(self, peer: Peer, frames: list, now: bool = True, max_bytes: int | None = None) -> bool:
        """Queue a message and send what the socket takes; with ``now`` false, hold it until
        :meth:`send_held` (the replies to one read of a client's requests then leave in one
        system call, and wake the client once, not once each).  False if the peer has
        ``max_queued`` messages unsent, or (given ``max_bytes``: an outgoing link's bound) that
        many bytes, or the pool has no room for them."""
        views = [as_bytes(f) for f in frames]
        parts = [memoryview((message_head if peer.outgoing else self.framing.head)(views)), *views]
        size = sum(p.nbytes for p in parts)
        with peer.lock:
            if peer.closed:
                return True
            if peer.queued >= self.max_queued and max_bytes is None:
                return False
            if max_bytes is not None:
                if peer.queued_bytes + size > max_bytes or not self.pool.take(size):
                    return False
                peer.queued_bytes += size
            for i, part in enumerate(parts):
                peer.out.append((part, i == len(parts) - 1))
            peer.queued += 1
            if not now:
                self._held_out.add(peer)
                return True
            self._send_locked(peer)
        return True

    def send_held(self) -> None:
        """Send the replies :meth:`send` held, as far as each socket takes them now."""
        held, self._held_out = self._held_out, set()
        for peer in held:
            with peer.lock:
                if not peer.closed:
                    self._send_locked(peer)

    def _send_locked(self, peer: Peer) -> None:
        try:
            self._flush_locked(peer)
        except OSError as e:  # the client reset the connection: its session ends, the server goes on
            self._close_locked(peer)
            self._lost.append(Disconnected(peer, str(e) or type(e).__name__))
            return
        self._update_interest(peer)

    def _flush_and_mark(self, peer: Peer, events: list) -> None:
        with peer.lock:
            if peer.closed:
                return
            try:
                self._flush_locked(peer)
            except OSError as e:
                self._close_locked(peer)
                events.append(Disconnected(peer, str(e)))
                return
            self._update_interest(peer)

    def _flush_locked(self, peer: Peer) -> None:
        """Send what the socket takes now (raises OSError if the connection broke)."""
        if peer.connecting or peer.handshaking:  # an outgoing peer's bytes wait for its connection
            return
        before = peer.queued_bytes
        while peer.out:
            if not peer.out[0][0].nbytes:  # an empty frame has nothing to send
                peer.queued -= peer.out.popleft()[1]
                continue
            try:
                if peer.tls:
                    n = peer.sock.send(peer.out[0][0][:TLS_CHUNK])
                else:
                    n = peer.sock.sendmsg([part for part, _ in islice(peer.out, 64)])
            except (BlockingIOError, InterruptedError, ssl.SSLWantWriteError, ssl.SSLWantReadError):
                break
            if n:
                peer.progress = time.monotonic()
            while n and peer.out:
                part, last = peer.out[0]
                if n >= part.nbytes:
                    n -= part.nbytes
                    peer.out.popleft()
                    peer.queued -= last
                    if peer.queued_bytes:
                        peer.queued_bytes -= part.nbytes
                else:
                    peer.out[0] = (part[n:], last)
                    if peer.queued_bytes:
                        peer.queued_bytes -= n
                    n = 0
        if not peer.out:
            peer.progress = time.monotonic()
        self.pool.give(before - peer.queued_bytes)

    def _update_interest(self, peer: Peer) -> None:
        if peer.closed:
            return
        if peer.connecting:
            want = selectors.EVENT_WRITE
        else:
            want = (0 if peer.parked else selectors.EVENT_READ) | (selectors.EVENT_WRITE if peer.out else 0)
        self._set_interest(peer, want)

    def _set_interest(self, peer: Peer, want: int) -> None:
        if want == peer.interest:
            return
        if not peer.interest:
            self.sel.register(peer.sock, want, peer)
        elif not want:
            self.sel.unregister(peer.sock)
        else:
            self.sel.modify(peer.sock, want, peer)
        peer.interest = want

    def close_peer(self, peer: Peer) -> None:
        with peer.lock:
            self._close_locked(peer)

    def _close_locked(self, peer: Peer) -> None:
        if peer.closed:
            return
        peer.closed = True
        peer.out.clear()
        self.pool.give(peer.queued_bytes)
        peer.queued_bytes = 0
        peer.reader.release()
        try:
            self._set_interest(peer, 0)
        except (KeyError, ValueError):
            pass
        peer.sock.close()
        if self.peers.pop(peer.id, None) is not None and not peer.outgoing:
            self.per_host[peer.host] -= 1
            if self.per_host[peer.host] <= 0:
                del self.per_host[peer.host]

    def close(self) -> None:
        self._stop.set()
        if self._beats is not None:
            self._beats.join()
        for peer in list(self.peers.values()):
            self.close_peer(peer)
        self.sel.close()
        self.sock.close()

    # -- heartbeats -------------------------------------------------------------------------------
    def start_heartbeats(self) -> None:
        if not self.framing.heartbeats:
            return
        self._beats = threading.Thread(target=self._beat, name="pyggml-rpc-heartbeats", daemon=True)
        self._beats.start()

    def _beat(self) -> None:
        beat = memoryview(COUNT.pack(0))
        while not self._stop.wait(HEARTBEAT_S):
            for peer in self._waiting():
                with peer.lock:
                    if peer.closed or peer.out:  # bytes already on their way are as good as a beat
                        continue
                    peer.out.append((beat, False))
                    try:
                        self._flush_locked(peer)
                    except OSError:
                        continue  # the loop finds the broken connection when it reads
                    if peer.out:
                        with self._dirty_lock:
                            self._dirty.add(peer)

    def _waiting(self) -> list[Peer]:
        """Clients that wait for the server: the one it serves, those with requests not yet read."""
        peers = [p for p in list(self.peers.values()) if p.greeted and not p.closed and not p.outgoing]
        poller = select.poll()
        by_fd = {}
        for p in peers:
            fd = p.sock.fileno()
            if fd >= 0:
                by_fd[fd] = p
                poller.register(fd, select.POLLIN)
        waiting = {by_fd[fd] for fd, ev in poller.poll(0) if ev & select.POLLIN and fd in by_fd}
        serving = self.serving
        if serving is not None:
            waiting.add(serving)
        waiting.update(p for p in list(self.held) if not p.closed)
        return list(waiting)


# -- the client's side ----------------------------------------------------------------------------

class Channel:
    """A client's blocking connection: whole messages out, whole messages in, heartbeats skipped."""

    def __init__(self, sock: socket.socket, max_bytes: int = 1 << 34) -> None:
        self.sock = sock
        self.tls = isinstance(sock, ssl.SSLSocket)
        self.max_bytes = max_bytes  # what one reply may make us allocate
        self._head = memoryview(bytearray(COUNT.size))

    @classmethod
    def connect(cls, host: str, port: int, tls: ssl.SSLContext | None, timeout: float) -> Channel:
        sock = socket.create_connection((host, port), timeout=timeout)
        try:
            tune(sock)
            if tls is not None:
                sock = tls.wrap_socket(sock)  # the handshake, within the connect timeout
        except BaseException:
            sock.close()
            raise
        return cls(sock)

    def peer_address(self) -> str:
        """The server's numeric address as this connection reached it."""
        host, port = self.sock.getpeername()[:2]
        return f"{host}:{port}"

    def send(self, frames: list, timeout: float) -> int:
        """Send one message (raises OSError, TimeoutError); returns its size in bytes."""
        return self.send_messages([frames], timeout)

    def send_messages(self, messages: list[list], timeout: float) -> int:
        """Send messages one after another, in as few system calls as the socket allows."""
        parts, total = [], 0
        for frames in messages:
            views = [as_bytes(f) for f in frames]
            parts += [memoryview(message_head(views)), *(v for v in views if v.nbytes)]
            total += sum(v.nbytes for v in views)
        self.sock.settimeout(timeout)
        if self.tls:
            if total < CORK_TLS:  # one TLS record for a step's small messages, not one each
                parts = [memoryview(b"".join(parts))]
            for part in parts:
                self.sock.sendall(part)
        else:
            while parts:
                n = self.sock.sendmsg(parts[:64])
                while n:
                    if n >= parts[0].nbytes:
                        n -= parts.pop(0).nbytes
                    else:
                        parts[0], n = parts[0][n:], 0
        return total

    def recv(self, deadline: float, silence: float = HEARTBEAT_TIMEOUT_S) -> list[memoryview]:
        """The next message that is not a heartbeat.  TimeoutError when ``deadline`` (monotonic)
        passes or nothing at all arrives for ``silence`` seconds; Closed when the server closed."""
        while True:
            self._exact(self._head, deadline, silence)
            (n_frames,) = COUNT.unpack(self._head)
            if n_frames == 0:
                continue
            if n_frames > MAX_FRAME_COUNT:
                raise Closed(f"a reply of {n_frames} frames: not a pyggml server")
            sizes = memoryview(bytearray(SIZE.size * n_frames))
            self._exact(sizes, deadline, silence)
            lengths = [s for (s,) in SIZE.iter_unpack(sizes)]
            if sum(lengths) > self.max_bytes:
                raise Closed(f"a reply of {sum(lengths)} bytes: more than any request asks for")
            body = memoryview(bytearray(sum(lengths)))
            self._exact(body, deadline, silence)
            frames, at = [], 0
            for s in lengths:
                frames.append(body[at:at + s])
                at += s
            return frames

    def _exact(self, view: memoryview, deadline: float, silence: float) -> None:
        pos = 0
        while pos < len(view):
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("deadline")
            self.sock.settimeout(min(left, silence))
            try:
                n = self.sock.recv_into(view[pos:])
            except (TimeoutError, socket.timeout):
                if time.monotonic() < deadline:
                    raise TimeoutError("silence") from None
                raise TimeoutError("deadline") from None
            if n == 0:
                raise Closed("the server closed the connection")
            pos += n

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass
