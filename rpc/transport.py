"""Messages over TCP for the RPC server and client: frames with lengths, connections named by the server.

Why not ZeroMQ, which carried these messages before: a ROUTER socket lets a connecting peer
choose its own routing id and numbers the other peers from a counter of its own; when the counter
reaches a number some peer chose, libzmq asserts (``routing_socket_base_t::add_out_pipe``) and
aborts the whole process, and no socket option refuses chosen ids.  Any client that could connect
could take the server down for everyone.  Here a connection is named by the server alone (a
counter that never repeats), so no peer can take another's name, and a peer that sends garbage
loses only its own connection.  ggml-rpc speaks plain TCP too.

A message is a list of frames, sent as::

    u32 frame count | u64 size of each frame | the frames' bytes, one after another

A message of no frames is a heartbeat.  The receiver checks the count and the sizes' total against
its limits before it reads any frame, so what one message can make the server hold is bounded
before its bytes arrive; a message over the limits is read past (its bytes discarded, never kept)
and delivered at once as an error carrying the first bytes of its first frame, where the request
header with its sequence number is, so the sender gets an answer and the connection stays usable.

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

import logging
import select
import selectors
import socket
import ssl
import struct
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import count, islice

log = logging.getLogger("pyggml.rpc.transport")

COUNT = struct.Struct("<I")
SIZE = struct.Struct("<Q")
MAX_FRAME_COUNT = 1024  # a count beyond this is not a message but garbage: the connection is closed
KEEP_OF_FIRST_FRAME = 64  # bytes of the first frame kept from a refused message (the request header)
CORK_TLS = 1 << 20
TLS_CHUNK = 16 << 10    # one TLS record: a partial non-blocking write is retried with the same bytes
HEARTBEAT_S = 1.0
HEARTBEAT_TIMEOUT_S = 3.0  # a client waiting for an answer gives up after this long without a byte
READ_BATCH, READ_BATCH_BYTES = 16, 1 << 20  # messages (and bytes) taken from one peer per poll
GREETING_TIMEOUT_S = 10.0  # a connection must finish its TLS handshake and say HELLO within this


class Closed(Exception):
    """The connection ended: the peer closed it, it broke, or it sent what is not a message."""


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
    returns ``(frames, error)`` for a whole message, or raises whatever ``recv_into`` raises when
    nothing more can be read now (the state is kept for the next call)."""

    def __init__(self, max_frames: int, max_bytes: int) -> None:
        self.max_frames = max_frames
        self.max_bytes = max_bytes
        self._scratch: memoryview | None = None  # for refused bytes, made when first needed
        self._start()

    def _start(self) -> None:
        self._phase = "count"
        self._view = memoryview(bytearray(COUNT.size))
        self._pos = 0
        self._sizes: list[int] = []
        self._error: str | None = None
        self._discard = 0

    def read(self, recv_into: Callable) -> tuple[list[memoryview], str | None]:
        while True:
            if self._phase == "discard":  # the rest of a refused message, already answered
                if self._scratch is None:
                    self._scratch = memoryview(bytearray(64 << 10))
                while self._discard:
                    n = recv_into(self._scratch, min(len(self._scratch), self._discard))
                    if n == 0:
                        raise Closed("the peer closed the connection")
                    self._discard -= n
                self._start()
            want = len(self._view) - self._pos
            if want:
                n = recv_into(self._view[self._pos:], want)
                if n == 0:
                    raise Closed("the peer closed the connection")
                self._pos += n
                if n < want:
                    continue
            if self._phase == "count":
                (n_frames,) = COUNT.unpack(self._view)
                if n_frames > MAX_FRAME_COUNT:
                    raise Closed(f"a message of {n_frames} frames: not a pyggml peer")
                if n_frames == 0:  # a heartbeat
                    self._start()
                    continue
                self._phase, self._view, self._pos = "sizes", memoryview(bytearray(SIZE.size * n_frames)), 0
            elif self._phase == "sizes":
                self._sizes = [s for (s,) in SIZE.iter_unpack(self._view)]
                total = sum(self._sizes)
                if len(self._sizes) > self.max_frames:
                    self._error = f"a request of {len(self._sizes)} frames; the limit is {self.max_frames}"
                elif total > self.max_bytes:
                    self._error = f"a request of {total} bytes exceeds this server's --max-message of {self.max_bytes}"
                if self._error is None:
                    self._phase, self._view, self._pos = "frames", memoryview(bytearray(total)), 0
                else:  # keep the header of the first frame (to answer it), discard the rest unread
                    keep = min(self._sizes[0], KEEP_OF_FIRST_FRAME)
                    self._phase, self._view, self._pos = "first", memoryview(bytearray(keep)), 0
                    self._discard = total - keep
            elif self._phase == "first":  # answered now; its other bytes are read past after
                kept, error, rest = self._view, self._error, self._discard
                self._start()
                self._phase, self._discard = "discard", rest
                return [kept], error
            else:
                frames, at = [], 0
                for s in self._sizes:
                    frames.append(self._view[at:at + s])
                    at += s
                self._start()
                return frames, None


# -- the server's side ----------------------------------------------------------------------------

@dataclass(eq=False)
class Peer:
    """One client connection, named by the listener's own counter."""
    id: int
    sock: socket.socket
    address: str
    reader: MessageReader
    tls: bool
    handshaking: bool
    opened: float = field(default_factory=time.monotonic)
    greeted: bool = False          # the server marks it once the client said HELLO
    closed: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)
    out: deque = field(default_factory=deque)  # (bytes to send, ends a message) in order
    queued: int = 0                # whole messages in ``out``
    writing: bool = False          # registered for EVENT_WRITE


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
    ends its session rather than wait for it)."""

    def __init__(self, host: str, port: int, tls: ssl.SSLContext | None, max_frames: int, max_bytes: int,
                 max_peers: int = 512, max_queued: int = 16) -> None:
        self.tls = tls
        self.max_frames, self.max_bytes = max_frames, max_bytes
        self.max_peers, self.max_queued = max_peers, max_queued
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.sock = socket.socket(family, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.sock.listen(128)
        self.sock.setblocking(False)
        self.endpoint = f"{host}:{self.sock.getsockname()[1]}"
        self.sel = selectors.DefaultSelector()
        self.sel.register(self.sock, selectors.EVENT_READ, None)
        self.peers: dict[int, Peer] = {}
        self._ids = count(1)
        self._again: set[Peer] = set()      # may have bytes the selector cannot see (TLS) or more messages
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
        for key, mask in self.sel.select(0 if again else timeout):
            if key.data is None:
                self._accept()
                continue
            peer = key.data
            if mask & selectors.EVENT_WRITE:
                self._flush_and_mark(peer, events)
            if mask & selectors.EVENT_READ:
                again.discard(peer)
                self._read(peer, events)
        for peer in again:
            self._read(peer, events)
        self._expire(events)
        return events

    def _accept(self) -> None:
        for _ in range(64):
            try:
                sock, addr = self.sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:  # out of descriptors, for one: refuse this one, keep serving
                log.warning("cannot accept a connection: %s", e)
                return
            address = f"{addr[0]}:{addr[1]}"
            if len(self.peers) >= self.max_peers:
                log.warning("refused a connection from %s: %d clients are connected (the limit)", address,
                            len(self.peers))
                sock.close()
                continue
            tune(sock)
            sock.setblocking(False)
            if self.tls is not None:
                sock = self.tls.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
            peer = Peer(next(self._ids), sock, address, MessageReader(self.max_frames, self.max_bytes),
                        tls=self.tls is not None, handshaking=self.tls is not None)
            self.peers[peer.id] = peer
            self.sel.register(sock, selectors.EVENT_READ, peer)
            if peer.handshaking:
                self._again.add(peer)

    def _read(self, peer: Peer, events: list) -> None:
        """The peer's next messages: those already here, a few and a little at a time, so that
        one client's stream cannot keep the others waiting (the rest is read on the next poll)."""
        taken = 0
        with peer.lock:
            if peer.closed:
                return
            try:
                if peer.handshaking:
                    peer.sock.do_handshake()
                    peer.handshaking = False
                for _ in range(READ_BATCH):
                    frames, error = peer.reader.read(peer.sock.recv_into)
                    events.append(Message(peer, frames, error))
                    taken += sum(f.nbytes for f in frames)
                    if taken >= READ_BATCH_BYTES:
                        break
            except (BlockingIOError, InterruptedError, ssl.SSLWantReadError, ssl.SSLWantWriteError):
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
        for peer in [p for p in self.peers.values() if not p.greeted and now - p.opened > GREETING_TIMEOUT_S]:
            with peer.lock:
                self._close_locked(peer)
            events.append(Disconnected(peer, f"no HELLO within {GREETING_TIMEOUT_S:.0f} s"))

    def send(self, peer: Peer, frames: list, now: bool = True) -> bool:
        """Queue a reply and send what the socket takes; with ``now`` false, hold it until
        :meth:`send_held` (the replies to one read of a client's requests then leave in one
        system call, and wake the client once, not once each)."""
        views = [as_bytes(f) for f in frames]
        parts = [memoryview(message_head(views)), *views]
        with peer.lock:
            if peer.closed:
                return True
            if peer.queued >= self.max_queued:
                return False
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
                return
            while n and peer.out:
                part, last = peer.out[0]
                if n >= part.nbytes:
                    n -= part.nbytes
                    peer.out.popleft()
                    peer.queued -= last
                else:
                    peer.out[0] = (part[n:], last)
                    n = 0

    def _update_interest(self, peer: Peer) -> None:
        want = bool(peer.out)
        if want != peer.writing and not peer.closed:
            peer.writing = want
            self.sel.modify(peer.sock, selectors.EVENT_READ | (selectors.EVENT_WRITE if want else 0), peer)

    def close_peer(self, peer: Peer) -> None:
        with peer.lock:
            self._close_locked(peer)

    def _close_locked(self, peer: Peer) -> None:
        if peer.closed:
            return
        peer.closed = True
        peer.out.clear()
        try:
            self.sel.unregister(peer.sock)
        except (KeyError, ValueError):
            pass
        peer.sock.close()
        self.peers.pop(peer.id, None)

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
        """Peers that wait for the server: the one it serves, those with requests not yet read."""
        peers = [p for p in list(self.peers.values()) if p.greeted and not p.closed]
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
