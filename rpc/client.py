"""The client's connection to one RPC server: requests, replies, and bounded waiting.

A DEALER socket talks to the server's ROUTER.  Requests that need no answer
(``SET_TENSOR``) are pipelined; every other request waits for its reply - but never
forever: ZeroMQ heartbeats notice a server that stopped answering, the socket monitor
notices a closed connection at once, and an overall timeout bounds the rest.  Each of
these becomes an :class:`RPCError` naming the endpoint, and the connection is closed
for good (its buffers died with the server's session).
"""
from __future__ import annotations

import itertools
import logging
import os
import threading
import time

import zmq
import zmq.utils.monitor

from . import protocol as P
from .files import parse_listing
from .protocol import Command, RPCError, Status

log = logging.getLogger("pyggml.rpc.client")

CONNECT_TIMEOUT_S = float(os.environ.get("PYGGML_RPC_CONNECT_TIMEOUT", "5"))
REQUEST_TIMEOUT_S = float(os.environ.get("PYGGML_RPC_TIMEOUT", "600"))
HEARTBEAT_MS = 1000
HEARTBEAT_TIMEOUT_MS = 3000

_monitor_ids = itertools.count()  # pyzmq's default monitor address reuses socket fds, which can collide

_FAILURES = {
    zmq.EVENT_DISCONNECTED: "the server closed the connection (did it stop or crash?)",
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "the handshake failed (CurveZMQ key or protocol mismatch)",
    zmq.EVENT_HANDSHAKE_FAILED_AUTH: "the server refused our CurveZMQ credentials",
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "the handshake failed (wrong CurveZMQ server key, or not a pyggml server)",
}


def load_key(path: str | os.PathLike) -> bytes:
    """A Z85 CurveZMQ key from a file written by ``pyggml-rpc-server --gen-key``."""
    with open(path, "rb") as f:
        text = f.read().strip()
    for line in text.splitlines():  # zmq.auth's certificate format also works
        line = line.strip()
        if line.startswith((b"public-key", b"secret-key")):
            text = line.split(b"=", 1)[1].strip().strip(b'"')
            break
    if len(text) != 40:
        raise ValueError(f"{path}: not a CurveZMQ key (expected 40 Z85 characters)")
    return text


class Connection:
    """One server: HELLO on connect, then :meth:`request` / :meth:`send`."""

    def __init__(self, endpoint: str, server_key: bytes | None = None,
                 connect_timeout: float = CONNECT_TIMEOUT_S, timeout: float = REQUEST_TIMEOUT_S) -> None:
        self.endpoint = endpoint
        self.timeout = timeout
        self.seq = 0
        self.bytes_sent = 0
        self.bytes_received = 0
        self.closed_reason: str | None = None
        self.errors = 0  # error replies so far (an asynchronous request may have failed before them)
        self.wait_seconds = 0.0  # time spent waiting for answers (the server's work plus the network)
        self._lock = threading.Lock()
        ctx = zmq.Context.instance()
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_MS)
        self.sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
        self.sock.setsockopt(zmq.RECONNECT_IVL, -1)  # a lost server is an error, not something to wait for
        self.sock.setsockopt(zmq.IMMEDIATE, 1)
        # with the server gone a DEALER has no peer and send() would wait for one forever
        self.sock.setsockopt(zmq.SNDTIMEO, HEARTBEAT_TIMEOUT_MS + 2000)
        if server_key:
            public, secret = zmq.curve_keypair()
            self.sock.curve_serverkey = server_key
            self.sock.curve_publickey = public
            self.sock.curve_secretkey = secret
        self.monitor = self.sock.get_monitor_socket(addr=f"inproc://pyggml-rpc-monitor-{next(_monitor_ids)}")
        self.poller = zmq.Poller()
        self.poller.register(self.sock, zmq.POLLIN)
        self.poller.register(self.monitor, zmq.POLLIN)
        self.sock.connect(f"tcp://{endpoint}")
        self._await_connection(connect_timeout)
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

    def _await_connection(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not self.monitor.poll(int(left * 1000) + 1):
                self.close(f"cannot reach the server within {timeout:.0f} s")
                raise RPCError(self.endpoint, self.closed_reason)
            ev = zmq.utils.monitor.recv_monitor_message(self.monitor)
            if ev["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                return
            if ev["event"] == zmq.EVENT_CLOSED:  # refused, and we do not retry
                self.close("connection refused (is pyggml-rpc-server running there?)")
                raise RPCError(self.endpoint, self.closed_reason)
            if ev["event"] in _FAILURES:
                self.close(_FAILURES[ev["event"]])
                raise RPCError(self.endpoint, self.closed_reason)

    def close(self, reason: str = "closed") -> None:
        if self.closed_reason is None:
            self.closed_reason = reason
            # in this order: disable_monitor() after closing the monitor can block forever, and a
            # socket closed with its monitor still on leaves the monitor's address taken
            self.sock.disable_monitor()
            self.monitor.close(linger=0)
            self.sock.close(linger=0)

    def __del__(self) -> None:
        # a monitored socket left to the garbage collector can be closed after its monitor,
        # which wedges libzmq's reaper and with it every later socket close in the process
        try:
            self.close("garbage collected")
        except Exception:  # noqa: BLE001 - interpreter shutdown: nothing left to clean
            pass

    # -- messages -----------------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self.closed_reason is not None:
            raise RPCError(self.endpoint, f"connection unusable: {self.closed_reason}")

    def _check_monitor(self) -> None:
        """Raise at once if the monitor already saw the connection fail."""
        while self.monitor.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            ev = zmq.utils.monitor.recv_monitor_message(self.monitor)
            if ev["event"] in _FAILURES:
                self.close(_FAILURES[ev["event"]])
                raise RPCError(self.endpoint, self.closed_reason)

    def _send(self, cmd: Command, payload: bytes, frames: list, flags: int) -> int:
        self._check_open()
        self._check_monitor()
        self.seq = (self.seq + 1) & 0xFFFFFFFF
        head = P.HEADER.pack(cmd, flags, 0, self.seq) + payload
        self.bytes_sent += len(head) + sum(len(memoryview(f)) for f in frames)
        try:
            self.sock.send_multipart([head, *frames], copy=len(frames) == 0)
        except zmq.ZMQError as e:
            self._check_monitor()  # the usual cause: the server went away
            self.close(f"cannot send to the server: {e}")
            raise RPCError(self.endpoint, self.closed_reason) from None
        return self.seq

    def send(self, cmd: Command, payload: bytes, frames: list | tuple = ()) -> None:
        """A request without a reply; a failure comes back with the next :meth:`request`."""
        with self._lock:
            self._send(cmd, payload, list(frames), P.FLAG_NO_REPLY)

    def request(self, cmd: Command, payload: bytes = b"", frames: list | tuple = (), reply=None,
                timeout: float | None = None) -> tuple[tuple | memoryview, list[memoryview]]:
        """Send and wait for the answer: (unpacked ``reply`` struct or raw payload, data frames)."""
        with self._lock:
            seq = self._send(cmd, payload, list(frames), 0)
            t0 = time.perf_counter()
            try:
                parts = self._wait(seq, cmd, self.timeout if timeout is None else timeout)
            finally:
                self.wait_seconds += time.perf_counter() - t0
        head = parts[0]
        status, _, _, _ = P.HEADER.unpack_from(head)
        body = head[P.HEADER.size:]
        if status != Status.OK:
            self.errors += 1
            message = bytes(body).decode("utf-8", "replace")
            if cmd == Command.HELLO:
                self.close(message)
            raise RPCError(self.endpoint, f"{cmd.name} failed: {message}")
        if reply is not None:
            if len(body) != reply.size:
                self.close(f"malformed {cmd.name} reply")
                raise RPCError(self.endpoint, self.closed_reason)
            return reply.unpack_from(body), parts[1:]
        return body, parts[1:]

    def _wait(self, seq: int, cmd: Command, timeout: float) -> list[memoryview]:
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                self.close(f"no answer to {cmd.name} within {timeout:.0f} s")
                raise RPCError(self.endpoint, self.closed_reason)
            events = dict(self.poller.poll(int(min(left, 1.0) * 1000) + 1))
            if self.sock in events:
                frames = self.sock.recv_multipart(copy=False)
                parts = [f.buffer for f in frames]
                self.bytes_received += sum(len(p) for p in parts)
                if len(parts[0]) < P.HEADER.size:
                    self.close("malformed reply")
                    raise RPCError(self.endpoint, self.closed_reason)
                if P.HEADER.unpack_from(parts[0])[3] != seq:
                    continue  # an answer to a request that timed out earlier
                return parts
            if self.monitor in events:
                ev = zmq.utils.monitor.recv_monitor_message(self.monitor)
                if ev["event"] in _FAILURES:
                    self.close(_FAILURES[ev["event"]])
                    raise RPCError(self.endpoint, self.closed_reason)
