"""The client's connection to one RPC server: requests, replies, and bounded waiting.

Requests that need no answer (``SET_TENSOR``, ``GRAPH_RECOMPUTE``) are held back and leave
together with the next request that waits for one, in one system call (the server is woken once
for a decode step's inputs, its graph and its first read); several reads can be asked at once
(:meth:`Connection.request_many`).  Every request that needs a reply waits for it - but never
forever: a closed connection is seen at once, the server's heartbeats tell a busy server from a
stopped one (see :mod:`.transport`), and an overall timeout bounds the rest.
Each of these becomes an :class:`RPCError` naming the endpoint, and the connection is closed
for good (its buffers died with the server's session).
"""
from __future__ import annotations

import os
import socket
import ssl
import threading
import time
import weakref
from collections import Counter
from collections.abc import Callable

from . import keys
from . import protocol as P
from . import transport
from .files import parse_listing
from .protocol import Command, RPCError, ServerLeaving, Status

CONNECT_TIMEOUT_S = float(os.environ.get("PYGGML_RPC_CONNECT_TIMEOUT", "5"))
REQUEST_TIMEOUT_S = float(os.environ.get("PYGGML_RPC_TIMEOUT", "600"))
SEND_TIMEOUT_S = transport.HEARTBEAT_TIMEOUT_S + 2  # a server that takes no bytes for this long is gone
CORK_BYTES = 64 << 10  # requests without replies are held back (copied) up to this much


def load_key(path: str | os.PathLike) -> keys.ClientKey:
    """A client's keys (TLS, and CurveZMQ for ``zmq://`` servers) from the ``FILE.client`` that
    ``pyggml-rpc-server --gen-key FILE`` wrote."""
    tls = keys.context(path, server_side=False)
    try:
        curve = keys.curve(path)
    except ValueError:
        curve = None
    return keys.ClientKey(str(path), tls, curve)


def _split(endpoint: str) -> tuple[str, int]:
    host, _, port = endpoint.removeprefix("zmq://").rpartition(":")
    return host.strip("[]"), int(port)


RECORDING_PASSES = frozenset({Command.SET_TENSOR})  # sent while a step records (its inputs), not part of it


class Connection:
    """One server: HELLO on connect, then :meth:`request` / :meth:`send`."""

    compression = "auto"      # LZ4 for tensor data where it pays (P.compress)
    pyggml_extensions = True  # the server runs our additions to ggml's ops (MUL_MAT's runs)
    inits_tensors = False     # INIT_TENSOR is nothing on our servers: not sent

    def __init__(self, endpoint: str, key: keys.ClientKey | ssl.SSLContext | None = None,
                 connect_timeout: float = CONNECT_TIMEOUT_S, timeout: float = REQUEST_TIMEOUT_S) -> None:
        self.endpoint = endpoint
        self.timeout = timeout
        self.seq = 0
        self.bytes_sent = 0
        self.bytes_received = 0
        self.closed_reason: str | None = None
        self.errors = 0  # error replies so far (an asynchronous request may have failed before them)
        self.leaving = False  # the server said it is leaving (Status.LEAVING)
        self.wait_seconds = 0.0  # time spent waiting for answers (the server's work plus the network)
        self._lock = threading.Lock()
        self.round_trips = 0  # times we waited for answers
        self.sent: Counter[Command] = Counter()  # requests sent, by command
        self._corked: list[list] = []  # messages held back until the next request with a reply
        self._corked_bytes = 0
        # requests sent whose answers nobody has read yet (request_many_async), and answers that
        # came while another was awaited: kept until their reader asks
        self._unread: set[int] = set()
        self._early: dict[int, list[memoryview]] = {}
        # servers that send this one tensors themselves (rpc/backend.py peer_copy): their
        # Connection -> the link number on their side, 0 where they cannot (weak: a connection
        # closed and collected must not lend its entry to a new one); the last tag used
        self.links_from: weakref.WeakKeyDictionary[Connection, int] = weakref.WeakKeyDictionary()
        self.peer_tag = 0
        # a step being recorded to keep on the server (rpc/steps.py): its requests, and whether
        # one that a step cannot hold went out meanwhile
        self.recording: list[tuple[Command, bytes]] | None = None
        self.recording_spoiled = False
        self.steps_kept = 0  # step numbers handed out (rpc/steps.py)
        self.channel: transport.Channel | None = None
        if endpoint.startswith("zmq://"):
            self._connect_zmq(key, connect_timeout)
        try:
            if self.channel is None:
                tls = key.tls if isinstance(key, keys.ClientKey) else key
                self.channel = transport.Channel.connect(*_split(endpoint), tls, connect_timeout)
        except ConnectionRefusedError:
            self._fail("connection refused (is pyggml-rpc-server running there?)")
        except (TimeoutError, socket.timeout):
            self._fail(f"cannot reach the server within {connect_timeout:.0f} s")
        except ssl.SSLError as e:
            self._fail(f"the TLS handshake failed ({e.reason or e}): wrong key, or not a TLS server")
        except OSError as e:
            self._fail(f"cannot connect: {e.strerror or e}")
        (_, self.n_devices, max_message, flags), listing = self.request(
            Command.HELLO, P.HELLO.pack(P.MAGIC, P.PROTOCOL_VERSION), reply=P.HELLO_REPLY, timeout=connect_timeout)
        # tensor data goes in pieces well under the server's cap (a bigger request would be dropped)
        self.chunk_bytes = max(1 << 16, min(P.CHUNK_BYTES, max_message // 2))
        self.server_has_cache = bool(flags & P.SERVER_HAS_CACHE)
        try:  # identity -> name of the GGUF files the server holds (--gguf)
            self.server_files = parse_listing(listing[0]) if flags & P.SERVER_HAS_FILES and listing else {}
        except ValueError as e:
            self.close(f"malformed HELLO reply: {e}")
            raise RPCError(self.endpoint, self.closed_reason) from None
        # where the weights of loads came from: the server's files, its tensor cache, the wire
        self.loaded = {"disk": 0, "cache": 0, "wire": 0}
        self.warned_versions: set[str] = set()
        self.rtt = self.round_trip_time()

    def round_trip_time(self, tries: int = 3) -> float:
        """Seconds of the quickest of ``tries`` request-and-answer exchanges (the link's share of
        every step that waits on this server: --show-placement says it)."""
        best = float("inf")
        for _ in range(tries):
            t0 = time.perf_counter()
            self.request(Command.DEVICE_COUNT)
            best = min(best, time.perf_counter() - t0)
        return best

    def _connect_zmq(self, key: keys.ClientKey | ssl.SSLContext | None, timeout: float) -> None:
        """A ``zmq://`` server: CurveZMQ with the key file's keys (its HELLO answers whether it admits them)."""
        from .zmq_transport import ZmqChannel
        curve = key.curve if isinstance(key, keys.ClientKey) else None
        if key is not None and curve is None:
            self._fail("this key holds no CurveZMQ keys (pass the key file, made by --gen-key of this pyggml)")
        self.channel = ZmqChannel.connect(*_split(self.endpoint), curve, timeout)

    def limitations(self) -> list[str]:
        return []

    @property
    def numeric_endpoint(self) -> str:
        """The server's address as this connection reached it (what another server is told to link to)."""
        return self.channel.peer_address()

    def _fail(self, reason: str) -> None:
        self.close(reason)
        raise RPCError(self.endpoint, reason) from None

    def close(self, reason: str = "closed") -> None:
        if self.closed_reason is None:
            self.closed_reason = reason
            if self.channel is not None:
                self.channel.close()

    # -- messages -----------------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self.closed_reason is not None:
            raise RPCError(self.endpoint, f"connection unusable: {self.closed_reason}")

    def _send(self, cmd: Command, payload: bytes, frames: list, flags: int, more: bool = False) -> int:
        """Queue one message; send the queue unless it is a small one without a reply, or
        ``more`` requests follow it."""
        self._check_open()
        if self.recording is not None:
            if flags & P.FLAG_NO_REPLY and cmd in P.STEP_COMMANDS and not frames:
                self.recording.append((cmd, bytes(payload)))
            elif cmd not in RECORDING_PASSES:  # (the step's inputs are uploaded anew every time)
                self.recording_spoiled = True
        self.seq = (self.seq + 1) & 0xFFFFFFFF
        self.sent[cmd] += 1
        message = [P.HEADER.pack(cmd, flags, 0, self.seq) + payload, *frames]
        size = sum(memoryview(f).nbytes for f in message)
        if flags & P.FLAG_NO_REPLY and self._corked_bytes + size <= CORK_BYTES:
            # the caller may reuse its arrays once we return: hold a copy
            self._corked.append([bytes(memoryview(f).cast("B")) if not isinstance(f, bytes) else f
                                 for f in message])
            self._corked_bytes += size
            return self.seq
        self._corked.append(message)
        if not more:
            self._flush()
        return self.seq

    def _flush(self) -> None:
        messages, self._corked, self._corked_bytes = self._corked, [], 0
        if not messages:
            return
        try:
            self.bytes_sent += self.channel.send_messages(messages, SEND_TIMEOUT_S)
        except (TimeoutError, socket.timeout):
            self._fail(f"the server took no bytes for {SEND_TIMEOUT_S:.0f} s (is it stopped?)")
        except (transport.Closed, OSError) as e:
            self._fail(self._broken(e))

    @staticmethod
    def _broken(e: BaseException) -> str:
        if isinstance(e, ssl.SSLError):
            return f"the server refused our TLS key ({e.reason or e})"
        if isinstance(e, transport.Closed) and "refused" in str(e):
            return str(e)
        if isinstance(e, (transport.Closed, ConnectionResetError, BrokenPipeError)):
            return "the server closed the connection (did it stop or crash?)"
        return f"the connection broke: {e.strerror or e}" if isinstance(e, OSError) else str(e)

    def answers(self, timeout: float = 5.0) -> bool:
        """Whether the server still answers a request (a closed connection does not)."""
        if self.closed_reason is not None:
            return False
        try:
            self.request(Command.DEVICE_COUNT, timeout=timeout)
        except RPCError:
            return self.closed_reason is None  # an error reply is an answer
        return True

    def flush(self) -> None:
        """Send the requests held back now, without waiting for anything."""
        with self._lock:
            self._flush()

    def send(self, cmd: Command, payload: bytes, frames: list | tuple = ()) -> None:
        """A request without a reply; a failure comes back with the next :meth:`request`."""
        with self._lock:
            self._send(cmd, payload, list(frames), P.FLAG_NO_REPLY)

    def request(self, cmd: Command, payload: bytes = b"", frames: list | tuple = (), reply=None,
                timeout: float | None = None) -> tuple[tuple | memoryview, list[memoryview]]:
        """Send and wait for the answer: (unpacked ``reply`` struct or raw payload, data frames)."""
        return self.request_many([(cmd, payload, frames)], reply, timeout)[0]

    def request_many(self, requests: list[tuple[Command, bytes, list | tuple]], reply=None,
                     timeout: float | None = None) -> list[tuple[tuple | memoryview, list[memoryview]]]:
        """Several requests sent together, their answers read in order: one round trip.  The
        first error is raised after every answer has been read."""
        return self.request_many_async(requests, reply, timeout)()

    def request_many_async(self, requests: list[tuple[Command, bytes, list | tuple]], reply=None,
                           timeout: float | None = None
                           ) -> Callable[[], list[tuple[tuple | memoryview, list[memoryview]]]]:
        """request_many's requests sent now; the function returned reads their answers (as
        request_many returns them) when called.  Meanwhile the connection serves other requests,
        in order: the server answers these after everything sent before them and before
        everything sent after (so a result read this way is the one computed before it was
        asked for, whatever runs after it)."""
        with self._lock:
            seqs = [self._send(cmd, payload, list(frames), 0, more=i + 1 < len(requests))
                    for i, (cmd, payload, frames) in enumerate(requests)]
            self._unread.update(seqs)

        def answers() -> list[tuple[tuple | memoryview, list[memoryview]]]:
            with self._lock:
                self.round_trips += 1
                t0 = time.perf_counter()
                try:
                    parts = [self._wait(seq, cmd, self.timeout if timeout is None else timeout)
                             for seq, (cmd, _, _) in zip(seqs, requests)]
                finally:
                    self.wait_seconds += time.perf_counter() - t0
                    self._unread.difference_update(seqs)
                    for seq in seqs:  # (after an error: answers kept for the ones not reached)
                        self._early.pop(seq, None)
            results, error = [], None
            for (cmd, _, _), p in zip(requests, parts):
                try:
                    results.append(self._answer(cmd, p, reply))
                except RPCError as e:
                    error = error or e
            if error is not None:
                raise error
            return results
        return answers

    def _answer(self, cmd: Command, parts: list[memoryview], reply) -> tuple[tuple | memoryview, list[memoryview]]:
        head = parts[0]
        status, _, _, _ = P.HEADER.unpack_from(head)
        body = head[P.HEADER.size:]
        if status != Status.OK:
            self.errors += 1
            message = bytes(body).decode("utf-8", "replace")
            if cmd == Command.HELLO:
                self.close(message)
            if status == Status.LEAVING:
                self.leaving = True
                raise ServerLeaving(self.endpoint, message)
            raise RPCError(self.endpoint, f"{cmd.name} failed: {message}")
        if reply is not None:
            if len(body) != reply.size:
                self.close(f"malformed {cmd.name} reply")
                raise RPCError(self.endpoint, self.closed_reason)
            return reply.unpack_from(body), parts[1:]
        return body, parts[1:]

    def _wait(self, seq: int, cmd: Command, timeout: float) -> list[memoryview]:
        if seq in self._early:
            return self._early.pop(seq)
        deadline = time.monotonic() + timeout
        while True:
            try:
                parts = self.channel.recv(deadline)
            except TimeoutError as e:
                if str(e) == "silence":
                    self._fail(f"the server stopped answering: no heartbeat for "
                               f"{transport.HEARTBEAT_TIMEOUT_S:.0f} s during {cmd.name}")
                self._fail(f"no answer to {cmd.name} within {timeout:.0f} s")
            except (transport.Closed, OSError) as e:
                self._fail(self._broken(e))
            self.bytes_received += sum(len(p) for p in parts)
            if len(parts[0]) < P.HEADER.size:
                self._fail("malformed reply")
            answered = P.HEADER.unpack_from(parts[0])[3]
            if answered == seq:
                return parts
            if answered in self._unread:  # asked earlier, read later (request_many_async)
                self._early[answered] = parts
            # else: an answer to a request that timed out earlier
