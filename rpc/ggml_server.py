"""``pyggml-rpc-server --protocol ggml``: llama.cpp's clients served by our handlers.

Each ggml-rpc request (see :mod:`.ggml_wire`) becomes the request of our protocol that means
the same, and the server's own handler serves it: the same checks (:mod:`.validate`), the same
bounds per session, the same op table.  Only the translation lives here.  What ggml-rpc's
server does differently, on purpose:

- it serves several clients at once, each in its own session (llama.cpp's serves one at a time);
- a bad request closes only its own connection (ggml-rpc has no error replies: its client treats
  a closed connection as the error), and the server serves on;
- a buffer's address (BUFFER_GET_BASE) is made up (:func:`.ggml_wire.base_of`): a client learns
  nothing of the server's memory, and every ``data`` it sends is checked against its buffer;
- ALLOC_BUFFER beyond the memory the server offers answers "no buffer" (remote_ptr 0), as
  ggml-rpc's does when an allocation fails, rather than closing the connection.
"""
from __future__ import annotations

import logging
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from . import ggml_wire as G
from . import protocol as P
from .cache import TensorCache
from .ggml_wire import GgmlCommand
from .protocol import Command, ProtocolError, unpack
from .transport import Closed, Framing, Message, MessageReader
from .validate import MAX_GRAPH_TENSORS

log = logging.getLogger("pyggml.rpc.server")


class GgmlReader(MessageReader):
    """ggml-rpc's requests, ``cmd u8 | size u64 | payload``, read within the same bounds as ours
    (what the session may send, the server-wide pool); one beyond them closes the connection.
    A message comes out as two frames: the command byte, and the payload."""

    def _start(self) -> None:
        super()._start()
        self._view = memoryview(bytearray(G.REQUEST_HEAD.size))
        self._cmd = b""

    def read(self, recv_into: Callable) -> tuple[list[memoryview], None]:
        while True:
            if self._phase == "reserve":
                self._reserve()
                continue
            if self._phase == "body":
                cmd = self._cmd
                done = self._read_body(recv_into)
                if done is not None:
                    return [memoryview(cmd), *done[0]], None
                continue
            while self._pos < len(self._view):
                self._pos += self._recv(recv_into, self._view[self._pos:], len(self._view) - self._pos)
            cmd, size = G.REQUEST_HEAD.unpack(self._view)
            allowed = self.max_bytes if self.limit is None else min(self.max_bytes, self.limit())
            if size > allowed:
                raise Closed(f"a ggml-rpc request of {size} bytes exceeds the {allowed} this session may send")
            self._cmd = bytes([cmd])
            self._sizes, self._total, self._phase = [size], size, "reserve"


def _reply_head(views: list[memoryview]) -> bytes:
    return G.REPLY_HEAD.pack(sum(v.nbytes for v in views))


GGML_FRAMING = Framing(GgmlReader, _reply_head, heartbeats=False)


class FnvIndex:
    """ggml-rpc names cached weights by FNV-1a; our cache (:class:`.cache.TensorCache`) by
    SHA-256 and size.  A small file per FNV hash, beside the cache's entries, says which entry
    it is; the entry is verified by its SHA-256 when read, as always.  (FNV-1a is no
    cryptographic hash: clients that share a server's cache trust each other not to forge one.)"""

    def __init__(self, cache: TensorCache) -> None:
        self.dir = cache.dir

    def _path(self, fnv: int) -> Path:
        return self.dir / f"fnv-{fnv:016x}"

    def get(self, fnv: int) -> tuple[bytes, int] | None:
        try:
            raw = self._path(fnv).read_bytes()
        except OSError:
            return None
        if len(raw) != 40:
            return None
        return raw[:32], int.from_bytes(raw[32:], "little")

    def put(self, fnv: int, key: bytes, size: int) -> None:
        fd, tmp = tempfile.mkstemp(dir=self.dir, prefix=".incoming-", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(key + size.to_bytes(8, "little"))
            os.replace(tmp, self._path(fnv))
        except OSError as e:
            log.warning("tensor cache: cannot index %016x: %s", fnv, e)
            Path(tmp).unlink(missing_ok=True)


class GgmlFrontend:
    """Serves one server's ggml-rpc connections (``RPCServer(protocol="ggml")``)."""

    def __init__(self, server) -> None:
        from .server import Session
        self.server = server
        self.session_type = Session
        self.fnv = FnvIndex(server.cache) if server.cache is not None else None
        self.serve_command: dict[GgmlCommand, Callable] = {
            GgmlCommand.DEVICE_COUNT: self._device_count,
            GgmlCommand.ALLOC_BUFFER: self._alloc_buffer,
            GgmlCommand.GET_ALIGNMENT: self._same(Command.GET_ALIGNMENT),
            GgmlCommand.GET_MAX_SIZE: self._get_max_size,
            GgmlCommand.GET_DEVICE_MEMORY: self._same(Command.GET_DEVICE_MEMORY),
            GgmlCommand.BUFFER_GET_BASE: self._buffer_get_base,
            GgmlCommand.FREE_BUFFER: self._same(Command.FREE_BUFFER),
            GgmlCommand.BUFFER_CLEAR: self._same(Command.BUFFER_CLEAR),
            GgmlCommand.INIT_TENSOR: self._init_tensor,
            GgmlCommand.GET_ALLOC_SIZE: self._get_alloc_size,
            GgmlCommand.SET_TENSOR: self._set_tensor,
            GgmlCommand.SET_TENSOR_HASH: self._set_tensor_hash,
            GgmlCommand.GET_TENSOR: self._get_tensor,
            GgmlCommand.COPY_TENSOR: self._copy_tensor,
            GgmlCommand.MEMSET_TENSOR: self._memset_tensor,
            GgmlCommand.GRAPH_COMPUTE: self._graph_compute,
            GgmlCommand.GRAPH_RECOMPUTE: self._graph_recompute,
        }

    # -- the loop's side ------------------------------------------------------------------------
    def serve(self, message: Message) -> None:
        server, peer = self.server, message.peer
        cmd_frame, payload = message.frames
        server.counters.bytes_in += G.REQUEST_HEAD.size + len(payload)
        name = f"command {cmd_frame[0]}"
        try:
            cmd = GgmlCommand(cmd_frame[0])
            name = cmd.name
            t0 = time.perf_counter()
            if cmd == GgmlCommand.HELLO:
                reply = self._hello(peer, payload)
            else:
                session = server.sessions.get(peer.id)
                if session is None:
                    raise ProtocolError("HELLO must come first")
                reply = self.serve_command[cmd](session, payload)
            if (cmd in G.REPLIES) != (reply is not None):  # (a bug here: its connection ends, not the server)
                raise RuntimeError(f"{cmd.name}: a reply where ggml-rpc has none, or none where it has one")
            server.counters.served(f"ggml {name}", time.perf_counter() - t0)
        except Exception as e:  # noqa: BLE001 - ggml-rpc's answer to any error: the connection closes
            if not isinstance(e, (ProtocolError, ValueError, IndexError, MemoryError)):
                log.exception("unexpected error serving a ggml-rpc request")
            log.info("closed ggml-rpc client %d (%s): %s refused: %s", peer.id, peer.address, name,
                     str(e) or type(e).__name__)
            server.counters.refused += 1
            self.drop(peer)
            return
        if reply is not None:
            server.counters.bytes_out += G.REPLY_HEAD.size + len(reply)
            server.listener.send(peer, [reply], now=False)

    def drop(self, peer) -> None:
        session = self.server.sessions.get(peer.id)
        if session is not None:
            self.server._end_session(session)
        self.server.listener.close_peer(peer)

    def _run(self, session, cmd: Command, payload: bytes | memoryview, frames: list | None = None) -> tuple:
        return self.server.handlers[cmd](session, memoryview(payload), frames or [])

    def _same(self, cmd: Command) -> Callable:
        """A command whose payload and reply are the same in both protocols."""
        def serve(session, payload: memoryview) -> bytes | None:
            body, _ = self._run(session, cmd, payload)
            return bytes(body) if body else None
        return serve

    def _tensor(self, payload: memoryview, at: int = 0, clear_prec: bool = False) -> bytes:
        """The ggml tensor record at ``at``, as ours."""
        return G.from_ggml(payload, at, G.base_of, clear_prec).pack()

    # -- commands -------------------------------------------------------------------------------
    def _hello(self, peer, payload: memoryview) -> bytes:
        if len(payload) != G.CAPS_BYTES:
            raise ProtocolError(f"HELLO of {len(payload)} bytes: this server speaks ggml-rpc {G.MAJOR}.x")
        if peer.id in self.server.sessions:
            raise ProtocolError("HELLO twice")
        self.server.sessions[peer.id] = self.session_type(peer)
        peer.greeted = True
        log.info("ggml-rpc client %d connected from %s", peer.id, peer.address)
        return G.HELLO_REPLY.pack(G.MAJOR, G.MINOR, G.PATCH, 0, bytes(G.CAPS_BYTES))  # no transport upgrade

    def _device_count(self, session, payload: memoryview) -> bytes:
        return bytes(self._run(session, Command.DEVICE_COUNT, payload)[0])

    def _alloc_buffer(self, session, payload: memoryview) -> bytes:
        device, size = unpack(G.ALLOC_BUFFER, payload)
        self.server._device(device)  # (an unknown device is an error; too little memory is a "no")
        if size > G.MAX_BUFFER:
            return G.ALLOC_REPLY.pack(0, 0)
        try:
            body, _ = self._run(session, Command.ALLOC_BUFFER, payload)
        except ProtocolError as e:
            log.info("ggml-rpc client %d: no buffer of %d bytes: %s", session.peer.id, size, e)
            return G.ALLOC_REPLY.pack(0, 0)
        return bytes(body)

    def _get_max_size(self, session, payload: memoryview) -> bytes:
        (size,) = P.U64.unpack(self._run(session, Command.GET_MAX_SIZE, payload)[0])
        return P.U64.pack(min(size, G.MAX_BUFFER))

    def _buffer_get_base(self, session, payload: memoryview) -> bytes:
        (handle,) = unpack(G.U64, payload)
        session.lookup(handle)
        return G.U64.pack(G.base_of(handle))

    def _init_tensor(self, session, payload: memoryview) -> None:
        if len(payload) != G.TENSOR.size:
            raise ProtocolError("INIT_TENSOR payload has the wrong size")
        self._run(session, Command.INIT_TENSOR, self._tensor(payload))

    def _get_alloc_size(self, session, payload: memoryview) -> bytes:
        # device, the tensor, and its sources: our alloc sizes depend on the tensor alone
        if len(payload) != G.U32.size + (1 + P.MAX_SRC) * G.TENSOR.size:
            raise ProtocolError("GET_ALLOC_SIZE payload has the wrong size")
        ours = payload[:G.U32.size].tobytes() + self._tensor(payload, G.U32.size)
        return bytes(self._run(session, Command.GET_ALLOC_SIZE, ours)[0])

    def _set_tensor(self, session, payload: memoryview) -> None:
        at = G.TENSOR.size + G.SET_TENSOR_TAIL.size
        if len(payload) < at:
            raise ProtocolError("SET_TENSOR payload is shorter than its header")
        cache_flag, offset = G.SET_TENSOR_TAIL.unpack_from(payload, G.TENSOR.size)
        data = payload[at:]
        head = self._tensor(payload) + P.SET_TENSOR.pack(offset, len(data), P.Codec.RAW, 0)
        self._run(session, Command.SET_TENSOR, head, [data])
        if cache_flag and self.fnv is not None:
            key = self.server.cache_weights(session, data)
            if key is not None:
                self.fnv.put(G.fnv1a(data), key, len(data))

    def _set_tensor_hash(self, session, payload: memoryview) -> bytes:
        if len(payload) != G.TENSOR.size + G.SET_TENSOR_HASH_TAIL.size:
            raise ProtocolError("SET_TENSOR_HASH payload has the wrong size")
        offset, fnv = G.SET_TENSOR_HASH_TAIL.unpack_from(payload, G.TENSOR.size)
        entry = self.fnv.get(fnv) if self.fnv is not None else None
        if entry is None:
            return G.U8.pack(0)
        key, size = entry
        body, _ = self._run(session, Command.SET_TENSOR_HASH,
                            self._tensor(payload) + P.SET_TENSOR_HASH.pack(offset, size, key))
        return bytes(body)

    def _get_tensor(self, session, payload: memoryview) -> bytes:
        if len(payload) != G.TENSOR.size + G.GET_TENSOR_TAIL.size:
            raise ProtocolError("GET_TENSOR payload has the wrong size")
        offset, size = G.GET_TENSOR_TAIL.unpack_from(payload, G.TENSOR.size)
        _, frames = self._run(session, Command.GET_TENSOR,
                              self._tensor(payload) + P.GET_TENSOR.pack(offset, size, P.Codec.RAW))
        return bytes(frames[0])

    def _copy_tensor(self, session, payload: memoryview) -> bytes:
        if len(payload) != 2 * G.TENSOR.size:
            raise ProtocolError("COPY_TENSOR payload has the wrong size")
        ours = self._tensor(payload) + self._tensor(payload, G.TENSOR.size)
        return bytes(self._run(session, Command.COPY_TENSOR, ours)[0])

    def _memset_tensor(self, session, payload: memoryview) -> None:
        if len(payload) != G.TENSOR.size + G.MEMSET_TAIL.size:
            raise ProtocolError("MEMSET_TENSOR payload has the wrong size")
        self._run(session, Command.MEMSET_TENSOR, self._tensor(payload) + payload[G.TENSOR.size:].tobytes())

    def _graph_compute(self, session, payload: memoryview) -> None:
        """ggml's graph (device, nodes, tensors) as ours, kept in the device's slot: ggml-rpc's
        GRAPH_RECOMPUTE runs the device's last graph again."""
        device, n_nodes = unpack(G.GRAPH_HEAD, payload, exact=False)
        at = G.GRAPH_HEAD.size + 8 * n_nodes
        if n_nodes > MAX_GRAPH_TENSORS or len(payload) < at + 4:
            raise ProtocolError(f"graph of {n_nodes} nodes in {len(payload)} bytes")
        ids = payload[G.GRAPH_HEAD.size:at].tobytes()
        (n_tensors,) = G.U32.unpack_from(payload, at)
        at += 4
        if len(payload) != at + n_tensors * G.TENSOR.size:
            raise ProtocolError(f"graph payload of {len(payload)} bytes where {at + n_tensors * G.TENSOR.size} "
                                f"were expected")
        tensors = b"".join(self._tensor(payload, at + i * G.TENSOR.size, clear_prec=True) for i in range(n_tensors))
        ours = P.GRAPH.pack(device, device + 1, n_nodes, n_tensors) + ids + tensors
        self._run(session, Command.GRAPH_COMPUTE, ours)

    def _graph_recompute(self, session, payload: memoryview) -> None:
        (device,) = unpack(G.U32, payload)
        self._run(session, Command.GRAPH_RECOMPUTE, P.RECOMPUTE.pack(device, device + 1))
