"""The wire protocol shared by the RPC server and client (ggml-rpc's, over TCP).

A request is one message of frames (see :mod:`.transport`): frame 0 is a fixed header followed by the
command's struct-packed, little-endian payload; bulk bytes (tensor data, names) travel as
frames of their own, so large arrays are sent without being copied into the payload.
A reply has the same shape with a status instead of a command.  Nothing is pickled:
every field has a fixed width and is checked by the receiver.

Commands mirror the buffer/backend interfaces one to one (``ALLOC_BUFFER`` is
``BufferType.alloc_buffer``, ``SET_TENSOR`` is ``Buffer.set_tensor`` ...).  ``SET_TENSOR``
and ``MEMSET_TENSOR`` are sent without waiting for a reply (as ggml-rpc does): the server
keeps the first error of such a command and reports it in its next reply.
"""
from __future__ import annotations

import enum
import struct
from dataclasses import dataclass

import lz4.block
import numpy as np

PROTOCOL_VERSION = 7  # 3: our own framing over TCP (ZeroMQ before); 4: servers pass tensors to each other;
                      # 5: devices tell their measured speed (DEVICE_INFO); 6: ggml 7.0.0's op numbers;
                      # 7: activations in blocks (MUL_MAT's second operand, CONCAT, a CPY of one source)
MAGIC = b"PYGM"


class Command(enum.IntEnum):
    HELLO = 0
    DEVICE_COUNT = 1
    GET_DEVICE_MEMORY = 2
    ALLOC_BUFFER = 3
    GET_ALIGNMENT = 4
    GET_MAX_SIZE = 5
    GET_ALLOC_SIZE = 6
    BUFFER_CLEAR = 7
    FREE_BUFFER = 8
    INIT_TENSOR = 9
    SET_TENSOR = 10
    SET_TENSOR_HASH = 11
    GET_TENSOR = 12
    COPY_TENSOR = 13
    MEMSET_TENSOR = 14
    GRAPH_COMPUTE = 15
    GRAPH_RECOMPUTE = 16
    GET_DEVICE_INFO = 17
    SET_TENSOR_FILE = 18
    # servers that pass tensors to each other (see rpc/peers.py)
    PEER_TOKEN = 19      # client -> B: a one-time token that lets another server write into this session
    PEER_CONNECT = 20    # client -> A: connect to B and present the token; the reply numbers the link
    PEER_AUTH = 21       # A -> B, on A's new connection: the token; the connection then only writes
    COPY_TO_PEER = 22    # client -> A (no reply): send a tensor of this session over a link, tagged
    PEER_SET = 23        # A -> B (no reply): the tagged bytes for a tensor of the session that gave the token
    WAIT_PEER = 24       # client -> B (no reply): hold this session's next requests until that tag arrived
    # a step's requests kept on the server and run again by one request (see rpc/steps.py)
    STEP_STORE = 25      # (no reply) keep the frame's requests as step N of this session
    STEP_RUN = 26        # (no reply) serve step N's requests, in order, as if they had come now


class Status(enum.IntEnum):
    OK = 0
    ERROR = 1
    LEAVING = 2  # the server is shutting down (SIGTERM): its clients move their work elsewhere


class Codec(enum.IntEnum):
    RAW = 0
    LZ4 = 1
    FAILED = 255  # PEER_SET only: no tensor - the sender's session had failed; the frame says why


FLAG_NO_REPLY = 1   # header flag: the client does not wait for an answer
FLAG_CACHE = 1      # SET_TENSOR flag: weights worth keeping in the server's tensor cache
SERVER_HAS_CACHE = 1  # HELLO reply flag: the server keeps a tensor cache (SET_TENSOR_HASH can hit)
SERVER_HAS_FILES = 2  # HELLO reply flag: a frame lists the GGUF files the server holds (SET_TENSOR_FILE)

HEADER = struct.Struct("<BBHI")      # command (or status), flags, reserved, sequence number
HELLO = struct.Struct("<4sI")        # magic, protocol version
HELLO_REPLY = struct.Struct("<IIQI")  # protocol version, number of devices, largest request, server flags
U8 = struct.Struct("<B")
U32 = struct.Struct("<I")
U64 = struct.Struct("<Q")
DEVICE_MEMORY = struct.Struct("<QQ")                 # free, total
DEVICE_INFO = struct.Struct("<IQQQQBf")  # type, free, total, alignment, max size, exact alloc size, GB/s (pyggml.speed)
ALLOC_BUFFER = struct.Struct("<IQ")                  # device, size
ALLOC_REPLY = struct.Struct("<QQ")                   # handle, size
BUFFER_CLEAR = struct.Struct("<QB")                  # handle, value
SET_TENSOR = struct.Struct("<QQBB")                  # offset, size, codec, flags
SET_TENSOR_HASH = struct.Struct("<QQ32s")            # offset, size, digest
SET_TENSOR_FILE = struct.Struct("<QQ32sQ")           # offset, size, file identity, offset in the file
GET_TENSOR = struct.Struct("<QQB")                   # offset, size, accepted codec
GET_REPLY = struct.Struct("<QB")                     # size, codec
MEMSET = struct.Struct("<QQB")                       # offset, size, value
TOKEN_BYTES = 32
PEER_CONNECT = struct.Struct(f"<{TOKEN_BYTES}s")      # the token (the endpoint follows as a frame)
COPY_TO_PEER = struct.Struct("<II")                  # link, tag (then the source and destination tensors)
PEER_SET = struct.Struct("<IB")                      # tag, codec (after the destination; the bytes as a frame)
GRAPH = struct.Struct("<IIII")                       # device, slot, n_nodes, n_tensors
RECOMPUTE = struct.Struct("<II")                     # device, slot

MAX_SRC = 10
MAX_OP_PARAMS = 16
NAME_BYTES = 64
# one tensor: id, type, op, buffer handle, ne[4], nb[4], op_params[16], flags, src ids[10],
# view_src id, view_offs, offset of its data in the buffer, name
TENSOR = struct.Struct(f"<QIIQ4q4q{MAX_OP_PARAMS}ii{MAX_SRC}QQQQ{NAME_BYTES}s")

STEP = struct.Struct("<I")                           # step number
STEP_ENTRY = struct.Struct("<BH")                    # a kept request: command, payload length (then the payload)
STEP_COMMANDS = frozenset({Command.GRAPH_RECOMPUTE, Command.COPY_TO_PEER, Command.WAIT_PEER})  # what a step may hold
MAX_STEPS = 64                       # steps a session keeps ...
MAX_STEP_REQUESTS = 1 << 14          # ... of at most this many requests each ...
MAX_STEP_BYTES = 8 << 20             # ... and this many bytes together
GRAPH_SLOTS = 1024                   # graphs a session may keep on the server for GRAPH_RECOMPUTE (a tensor
                                     # split runs a few per layer and step) ...
HELD_GRAPH_TENSORS = 1 << 22         # ... holding at most this many tensors together (the memory they take)
DEFAULT_MAX_MESSAGE = 512 << 20      # the server refuses bigger requests; the client chunks below it
MAX_FRAMES = 2                       # frames of a request: the header, and at most one of data
DEFAULT_CACHE_MAX = 20 << 30         # the tensor cache's size, least recently used entries evicted
CHUNK_BYTES = 64 << 20               # tensor data is sent in pieces of at most this size


class RPCError(RuntimeError):
    """A remote device failed: unreachable, dead, too slow, refused a request, or another
    protocol version.  The message names the endpoint."""

    def __init__(self, endpoint: str, message: str) -> None:
        super().__init__(f"RPC[{endpoint}]: {message}")
        self.endpoint = endpoint


class ServerLeaving(RPCError):
    """The server said it is leaving (stopped with SIGTERM or Ctrl-C): not a failure, a hand-off.
    A model places itself anew without it - failover or not - and the server exits once its
    clients are gone."""


class ProtocolError(ValueError):
    """A request the server refuses (answered with an error; the server keeps serving)."""


@dataclass
class WireTensor:
    """One tensor as sent: plain integers, checked by the server before it is believed."""
    id: int
    type: int
    op: int
    buffer: int
    ne: tuple[int, int, int, int]
    nb: tuple[int, int, int, int]
    op_params: tuple[int, ...]
    flags: int
    src: tuple[int, ...]
    view_src: int
    view_offs: int
    offset: int
    name: str

    def pack(self) -> bytes:
        return TENSOR.pack(self.id, self.type, self.op, self.buffer, *self.ne, *self.nb, *self.op_params,
                           self.flags, *self.src, self.view_src, self.view_offs, self.offset,
                           self.name.encode("utf-8", "replace")[:NAME_BYTES])

    @classmethod
    def unpack_from(cls, data: bytes | memoryview, offset: int = 0) -> WireTensor:
        if offset < 0 or offset + TENSOR.size > len(data):
            raise ProtocolError(f"truncated tensor: need {TENSOR.size} bytes at {offset}, have {len(data)}")
        v = TENSOR.unpack_from(data, offset)
        p = MAX_OP_PARAMS
        return cls(id=v[0], type=v[1], op=v[2], buffer=v[3], ne=tuple(v[4:8]), nb=tuple(v[8:12]),
                   op_params=tuple(v[12:12 + p]), flags=v[12 + p], src=tuple(v[13 + p:13 + p + MAX_SRC]),
                   view_src=v[13 + p + MAX_SRC], view_offs=v[14 + p + MAX_SRC], offset=v[15 + p + MAX_SRC],
                   name=v[16 + p + MAX_SRC].rstrip(b"\0").decode("utf-8", "replace"))


def unpack(st: struct.Struct, data: bytes | memoryview, offset: int = 0, exact: bool = True) -> tuple:
    """``st.unpack_from`` with the size checked: a short (or, with ``exact``, long) payload
    is a :class:`ProtocolError`, never an exception from deep inside."""
    end = offset + st.size
    if len(data) < end or (exact and len(data) != end):
        raise ProtocolError(f"payload of {len(data) - offset} bytes where {st.size} were expected")
    return st.unpack_from(data, offset)


# -- bulk data ------------------------------------------------------------------------------------

_SAMPLE = 8 << 10


def compress(data: memoryview | bytes | np.ndarray, level: str = "auto") -> tuple[Codec, object]:
    """LZ4 when it makes the bytes smaller by at least an eighth; judged on a sample first,
    since quantized weights hardly compress and compressing them would only cost time."""
    view = memoryview(data).cast("B") if not isinstance(data, memoryview) else data.cast("B")
    n = len(view)
    if level == "off" or n < 4096:
        return Codec.RAW, view
    if n > 2 * _SAMPLE:
        sample = bytes(view[:_SAMPLE])
        if len(lz4.block.compress(sample, store_size=False)) > _SAMPLE * 7 // 8:
            return Codec.RAW, view
    packed = lz4.block.compress(view, store_size=False)
    if len(packed) > n * 7 // 8:
        return Codec.RAW, view
    return Codec.LZ4, packed


def decompress(codec: int, frame: memoryview | bytes, size: int) -> memoryview | bytes:
    """The ``size`` bytes a frame carries; the size was checked against the destination
    first, so a hostile frame cannot make us allocate more than the tensor holds."""
    if codec == Codec.RAW:
        if len(frame) != size:
            raise ProtocolError(f"data frame has {len(frame)} bytes, the request says {size}")
        return frame
    if codec == Codec.LZ4:
        try:
            out = lz4.block.decompress(frame, uncompressed_size=size)
        except lz4.block.LZ4BlockError as e:
            raise ProtocolError(f"corrupt LZ4 data: {e}") from None
        if len(out) != size:
            raise ProtocolError(f"LZ4 data holds {len(out)} bytes, the request says {size}")
        return out
    raise ProtocolError(f"unknown codec {codec}")


def parse_endpoint(text: str) -> str:
    """'8080' -> '127.0.0.1:8080'; 'host:port' and 'tcp://host:port' as given (TCP, the default);
    'zmq://host:port' (the ZeroMQ transport) and 'ggml://host:port' (a llama.cpp rpc-server)
    keep their scheme."""
    text = text.strip()
    for scheme in ("zmq://", "ggml://"):
        if text.startswith(scheme):
            return scheme + parse_endpoint(text.removeprefix(scheme))
    text = text.removeprefix("tcp://")
    host, sep, port = text.rpartition(":")
    if not sep:
        host, port = "127.0.0.1", text
    if not port.isdigit():
        raise ValueError(f"bad RPC endpoint {text!r}: expected PORT, HOST:PORT, zmq://HOST:PORT or ggml://HOST:PORT")
    if not 0 < int(port) < 65536:
        raise ValueError(f"bad RPC endpoint {text!r}: port {int(port)} is out of range (1..65535)")
    return f"{host or '127.0.0.1'}:{int(port)}"


def parse_endpoints(spec: str | list[str] | tuple[str, ...] | None) -> list[str]:
    """``--rpc`` lists: joined by ';' or ',' (llama.cpp's habit), or already a list."""
    if not spec:
        return []
    items = spec if isinstance(spec, (list, tuple)) else str(spec).replace(",", ";").split(";")
    return [parse_endpoint(s) for s in items if str(s).strip()]
