"""llama.cpp's ggml-rpc protocol 7.0.0 on the wire, and its translation to and from ours.

Both sides of pyggml speak it through a translation, not a second implementation: the server
(``pyggml-rpc-server --protocol ggml``, :mod:`.ggml_server`) turns each ggml-rpc request into
the request of our protocol that means the same and runs our handler, with our checks; the
client (``--rpc ggml://HOST:PORT``, :mod:`.ggml_client`) turns the requests of our backend into
ggml-rpc's.  This module holds what both need: the command numbers, the structs, the 296-byte
tensor record, and the address mapping.

How the two protocols differ, and how the translation bridges it:

- Framing: a request is ``cmd u8 | size u64 | payload``, a reply ``size u64 | payload``, and
  only some commands have a reply (:data:`REPLIES`).  No sequence numbers, no status: an error
  closes the connection.
- A tensor's place: ggml-rpc sends ``data``, an address in the server's memory (the buffer's
  base, from BUFFER_GET_BASE, plus an offset); ours sends the buffer handle and the offset.  A
  pyggml server gives each buffer a base of its own (:func:`base_of`), never a real address,
  and turns ``data`` back into an offset checked against the buffer.
- ``ne``/``nb`` are u32 there (i64 here); op numbers are the same (:mod:`pyggml.opdefs`).
- MUL_MAT and FLASH_ATTN_EXT carry a precision request (``GGML_PREC_F32`` = 10) in a slot our
  records leave at 0: the server accepts it and clears it (our kernels accumulate in float32).
- Every node a llama.cpp server should compute must carry ``GGML_TENSOR_FLAG_COMPUTE``: its CPU
  backend skips nodes without it.  The client sets it on every node.
- Weights over 10 MiB are offered by their FNV-1a hash (SET_TENSOR_HASH) where the server has a
  cache (``-c``); ours keys the cache by SHA-256, so the server keeps a small FNV index beside it.
"""
from __future__ import annotations

import enum
import struct

import numba
import numpy as np

from pyggml.opdefs import MAX_OP_PARAMS, Op

from .protocol import MAX_SRC, NAME_BYTES, ProtocolError, WireTensor

MAJOR, MINOR, PATCH = 7, 0, 0


class GgmlCommand(enum.IntEnum):
    ALLOC_BUFFER = 0
    GET_ALIGNMENT = 1
    GET_MAX_SIZE = 2
    BUFFER_GET_BASE = 3
    FREE_BUFFER = 4
    BUFFER_CLEAR = 5
    SET_TENSOR = 6
    SET_TENSOR_HASH = 7
    GET_TENSOR = 8
    COPY_TENSOR = 9
    GRAPH_COMPUTE = 10
    GET_DEVICE_MEMORY = 11
    INIT_TENSOR = 12
    GET_ALLOC_SIZE = 13
    HELLO = 14
    DEVICE_COUNT = 15
    GRAPH_RECOMPUTE = 16
    MEMSET_TENSOR = 17


# commands answered with a reply (the others are answered by nothing, or by a closed connection)
REPLIES = frozenset({GgmlCommand.ALLOC_BUFFER, GgmlCommand.GET_ALIGNMENT, GgmlCommand.GET_MAX_SIZE,
                     GgmlCommand.BUFFER_GET_BASE, GgmlCommand.SET_TENSOR_HASH, GgmlCommand.GET_TENSOR,
                     GgmlCommand.COPY_TENSOR, GgmlCommand.GET_DEVICE_MEMORY, GgmlCommand.GET_ALLOC_SIZE,
                     GgmlCommand.HELLO, GgmlCommand.DEVICE_COUNT})

REQUEST_HEAD = struct.Struct("<BQ")   # command, payload size
REPLY_HEAD = struct.Struct("<Q")      # payload size
CAPS_BYTES = 24                       # HELLO's transport capabilities (RDMA; none over plain TCP)
HELLO_REPLY = struct.Struct(f"<BBBB{CAPS_BYTES}s")  # major, minor, patch, padding, capabilities
# id, type, buffer, ne[4] u32, nb[4] u32, op, op_params[16], flags, src[10], view_src, view_offs,
# data (an address in the server's memory), name, use_count
TENSOR = struct.Struct(f"<QIQ4I4II{MAX_OP_PARAMS}ii{MAX_SRC}QQQQ{NAME_BYTES}si")
assert TENSOR.size == 296
U8, U32, U64 = struct.Struct("<B"), struct.Struct("<I"), struct.Struct("<Q")
ALLOC_BUFFER = struct.Struct("<IQ")          # device, size -> ALLOC_REPLY
ALLOC_REPLY = struct.Struct("<QQ")           # remote_ptr (0: could not), size
BUFFER_CLEAR = struct.Struct("<QB")          # remote_ptr, value
SET_TENSOR_TAIL = struct.Struct("<BQ")       # after the tensor: cache flag, offset (then the data)
SET_TENSOR_HASH_TAIL = struct.Struct("<QQ")  # after the tensor: offset, hash -> U8 found
GET_TENSOR_TAIL = struct.Struct("<QQ")       # after the tensor: offset, size -> the bytes
MEMSET_TAIL = struct.Struct("<QQB")          # after the tensor: offset, size, value
DEVICE_MEMORY = struct.Struct("<QQ")         # free, total
GRAPH_HEAD = struct.Struct("<II")            # device, n_nodes (then node ids, n_tensors u32, tensors)
HASH_THRESHOLD = 10 << 20                    # weights larger than this are offered by hash first

FLAG_COMPUTE = 16   # GGML_TENSOR_FLAG_COMPUTE
PREC_F32 = 10       # GGML_PREC_F32
PREC_SLOTS = {Op.MUL_MAT: 0, Op.FLASH_ATTN_EXT: 3}  # op -> the slot holding its precision request

# A pyggml server's buffers live at made-up addresses: the handle's bits above BASE_SHIFT, with
# the top bit set (never 0, never a real address).  A buffer may hold up to 2**BASE_SHIFT bytes.
BASE_SHIFT = 40
MAX_BUFFER = 1 << BASE_SHIFT


def base_of(handle: int) -> int:
    return ((handle >> BASE_SHIFT) << BASE_SHIFT) | (1 << 63)


def from_ggml(data: bytes | memoryview, at: int, base: callable, clear_prec: bool = False) -> WireTensor:
    """The ggml tensor record at ``at`` as our :class:`WireTensor` (``base(buffer)`` maps a
    buffer to the address its data starts at).  With ``clear_prec``, a precision request
    (MUL_MAT, FLASH_ATTN_EXT: 0 or GGML_PREC_F32) is accepted and cleared."""
    if at < 0 or at + TENSOR.size > len(data):
        raise ProtocolError(f"truncated ggml tensor: need {TENSOR.size} bytes at {at}, have {len(data)}")
    v = TENSOR.unpack_from(data, at)
    (tid, ttype, buffer), ne, nb, op = v[0:3], v[3:7], v[7:11], v[11]
    p = 12 + MAX_OP_PARAMS
    op_params = list(v[12:p])
    flags, src = v[p], v[p + 1:p + 1 + MAX_SRC]
    view_src, view_offs, addr, name = v[p + 1 + MAX_SRC:p + 5 + MAX_SRC]
    slot = PREC_SLOTS.get(op) if clear_prec else None
    if slot is not None:
        if op_params[slot] not in (0, PREC_F32):
            raise ProtocolError(f"op {op}: precision {op_params[slot]} is neither default nor F32")
        op_params[slot] = 0
    offset = 0
    if buffer:
        start = base(buffer)
        if not start <= addr < start + MAX_BUFFER:
            raise ProtocolError(f"tensor data address {addr:#x} is not in buffer {buffer:#x}")
        offset = addr - start
    elif addr:
        raise ProtocolError("a tensor without a buffer has a data address")
    return WireTensor(id=tid, type=ttype, op=op, buffer=buffer, ne=tuple(ne), nb=tuple(nb),
                      op_params=tuple(op_params), flags=flags & 7, src=tuple(src), view_src=view_src,
                      view_offs=view_offs, offset=offset, name=name.rstrip(b"\0").decode("utf-8", "replace"))


def to_ggml(w: WireTensor, base: callable, compute: bool = False) -> bytes:
    """Our :class:`WireTensor` as ggml's record; ``compute`` flags a graph node to be computed."""
    if any(n >= 1 << 32 for n in w.ne) or any(b >= 1 << 32 for b in w.nb):
        raise ValueError(f"tensor {w.name!r}: ne {list(w.ne)} / nb {list(w.nb)} do not fit ggml-rpc's u32 fields")
    addr = base(w.buffer) + w.offset if w.buffer else 0
    flags = w.flags | (FLAG_COMPUTE if compute else 0)
    return TENSOR.pack(w.id, w.type, w.buffer, *w.ne, *w.nb, w.op, *w.op_params, flags, *w.src,
                       w.view_src, w.view_offs, addr, w.name.encode("utf-8", "replace")[:NAME_BYTES], 0)


@numba.njit(cache=True, nogil=True)
def _fnv1a(data: np.ndarray) -> np.uint64:
    h = np.uint64(0xcbf29ce484222325)
    prime = np.uint64(0x100000001b3)
    for b in data:
        h = (h ^ np.uint64(b)) * prime
    return h


def fnv1a(data) -> int:
    """The 64-bit FNV-1a of a bytes-like object: ggml-rpc's key for its tensor cache."""
    return int(_fnv1a(np.frombuffer(memoryview(data).cast("B"), dtype=np.uint8)))
