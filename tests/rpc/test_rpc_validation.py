"""Hostile requests to a real server process: each gets an error reply, nothing is touched
outside the client's buffers, and the server then answers a fresh client's HELLO."""
from __future__ import annotations

import os
import random

import numpy as np
import pytest

from pyggml.ops import Op
from pyggml.rpc import protocol as P
from pyggml.types import Type

from tests.rpc.rpc_helpers import RawClient, ServerProcess, tensor

C = P.Command
MEM_MIB = 64
MAX_MESSAGE_MIB = 4


@pytest.fixture(scope="module")
def server():
    s = ServerProcess("--mem", str(MEM_MIB), "--max-message", f"{MAX_MESSAGE_MIB}M")
    yield s
    s.stop()


@pytest.fixture
def client(server):
    c = RawClient(server.endpoint)
    yield c
    c.close()


def still_serving(server) -> None:
    assert server.alive(), "the server process died"
    fresh = RawClient(server.endpoint)  # asserts that HELLO is answered with OK
    status, body, _ = fresh.call(C.DEVICE_COUNT)
    assert status == P.Status.OK and P.U32.unpack(body)[0] == 1
    fresh.close()


def refused(client, server, cmd, payload=b"", frames=(), match: str = "") -> str:
    status, body, _ = client.call(cmd, payload, list(frames))
    message = body.decode()
    assert status == P.Status.ERROR, f"accepted: {message!r}"
    assert match.lower() in message.lower(), message
    still_serving(server)
    return message


def alloc(client, size: int = 4096) -> int:
    status, body, _ = client.call(C.ALLOC_BUFFER, P.ALLOC_BUFFER.pack(0, size))
    assert status == P.Status.OK, body
    return P.ALLOC_REPLY.unpack(body)[0]


def graph(nodes: list[int], tensors: list[bytes]) -> bytes:
    return (P.GRAPH.pack(0, 0, len(nodes), len(tensors)) + np.array(nodes, dtype="<u8").tobytes()
            + b"".join(tensors))


def set_data(client, handle: int, data: np.ndarray, type: int, ne, id: int = 1) -> bytes:
    t = tensor(type, ne, buffer=handle, id=id)
    raw = data.tobytes()
    status, body, _ = client.call(C.SET_TENSOR, t + P.SET_TENSOR.pack(0, len(raw), P.Codec.RAW, 0), [raw])
    assert status == P.Status.OK, body
    return t


def test_a_valid_session_works(client):
    h = alloc(client)
    t = set_data(client, h, np.arange(16, dtype=np.float32), Type.F32, (16, 1, 1, 1))
    status, _, frames = client.call(C.GET_TENSOR, t + P.GET_TENSOR.pack(0, 64, P.Codec.RAW))
    assert status == P.Status.OK
    assert np.array_equal(np.frombuffer(frames[0], dtype=np.float32), np.arange(16, dtype=np.float32))


def test_unknown_command(client, server):
    refused(client, server, 200, match="unknown command")


def test_hello_must_come_first(server):
    c = RawClient(server.endpoint, hello=False)
    refused(c, server, C.DEVICE_COUNT, match="HELLO")
    c.close()


def test_wrong_protocol_version(server):
    c = RawClient(server.endpoint, hello=False)
    refused(c, server, C.HELLO, P.HELLO.pack(P.MAGIC, P.PROTOCOL_VERSION + 1), match="protocol version")
    c.close()


@pytest.mark.parametrize("cmd,payload", [(C.GET_DEVICE_MEMORY, b"\0\0\0"), (C.GET_DEVICE_MEMORY, b"\0" * 5),
                                         (C.ALLOC_BUFFER, b"\1"), (C.FREE_BUFFER, b""),
                                         (C.INIT_TENSOR, b"\0" * (P.TENSOR.size - 1))])
def test_wrong_payload_size(client, server, cmd, payload):
    refused(client, server, cmd, payload)


def test_unknown_device(client, server):
    refused(client, server, C.ALLOC_BUFFER, P.ALLOC_BUFFER.pack(7, 16), match="unknown device")


def test_type_out_of_range(client, server):
    h = alloc(client)
    refused(client, server, C.INIT_TENSOR, tensor(type=99, nb=(4, 64, 64, 64), buffer=h), match="type 99")


def test_ne0_not_whole_blocks(client, server):
    h = alloc(client)
    refused(client, server, C.INIT_TENSOR, tensor(Type.Q4_0, (33, 1, 1, 1), nb=(18, 18, 18, 18), buffer=h),
            match="block size")


@pytest.mark.parametrize("ne,nb", [((-1, 1, 1, 1), (4, 4, 4, 4)), ((16, 1, 1, 1), (4, -4, 4, 4)),
                                   ((1 << 39, 1 << 39, 1 << 39, 1), (4, 4, 4, 4)),
                                   ((16, 2, 1, 1), (4, 1 << 62, 4, 4))])
def test_negative_or_overflowing_shapes(client, server, ne, nb):
    h = alloc(client)
    refused(client, server, C.INIT_TENSOR, tensor(Type.F32, ne, nb=nb, buffer=h))


@pytest.mark.parametrize("ne,nb,offset", [((256, 8, 1, 1), None, 0), ((16, 1, 1, 1), None, 4090),
                                          ((16, 2, 1, 1), (4, 4090, 64, 64), 0), ((16, 1, 1, 1), None, 1 << 63)])
def test_extent_outside_buffer(client, server, ne, nb, offset):
    h = alloc(client, 4096)
    refused(client, server, C.INIT_TENSOR, tensor(Type.F32, ne, nb=nb, buffer=h, offset=offset))


def test_data_without_buffer(client, server):
    raw = bytes(64)
    refused(client, server, C.SET_TENSOR, tensor(Type.F32) + P.SET_TENSOR.pack(0, 64, P.Codec.RAW, 0), [raw],
            match="no buffer")


def test_data_beyond_tensor_and_bad_frames(client, server):
    h = alloc(client)
    t = tensor(Type.F32, buffer=h)
    refused(client, server, C.SET_TENSOR, t + P.SET_TENSOR.pack(32, 64, P.Codec.RAW, 0), [bytes(64)],
            match="outside tensor")
    refused(client, server, C.SET_TENSOR, t + P.SET_TENSOR.pack(0, 64, P.Codec.RAW, 0), [bytes(60)], match="frame")
    refused(client, server, C.SET_TENSOR, t + P.SET_TENSOR.pack(0, 64, P.Codec.LZ4, 0), [os.urandom(40)])
    refused(client, server, C.SET_TENSOR, t + P.SET_TENSOR.pack(0, 64, P.Codec.RAW, 0), [], match="frame")


def test_other_clients_and_freed_handles(client, server):
    other = RawClient(server.endpoint)
    theirs = alloc(other)
    refused(client, server, C.BUFFER_CLEAR, P.BUFFER_CLEAR.pack(theirs, 0), match="unknown buffer")
    refused(client, server, C.INIT_TENSOR, tensor(Type.F32, buffer=theirs), match="unknown buffer")
    other.close()
    mine = alloc(client)
    assert client.call(C.FREE_BUFFER, P.U64.pack(mine))[0] == P.Status.OK
    refused(client, server, C.FREE_BUFFER, P.U64.pack(mine), match="unknown buffer")
    refused(client, server, C.INIT_TENSOR, tensor(Type.F32, buffer=mine), match="unknown buffer")


def test_a_tensor_the_server_knows_is_checked_again_once_its_buffer_is_gone(client, server):
    """The server keeps the wire tensors of SET_TENSOR and GET_TENSOR checked (a decoding step
    sends the same ones every time): the same bytes again read and write the data, and once
    their buffer is freed the same bytes are refused, as a tensor never seen would be."""
    h = alloc(client)
    for step in range(3):
        values = np.arange(16, dtype=np.float32) * step
        t = set_data(client, h, values, Type.F32, (16, 1, 1, 1))
        status, _, frames = client.call(C.GET_TENSOR, t + P.GET_TENSOR.pack(0, 64, P.Codec.RAW))
        assert status == P.Status.OK and np.array_equal(np.frombuffer(frames[0], dtype=np.float32), values)
    assert client.call(C.FREE_BUFFER, P.U64.pack(h))[0] == P.Status.OK
    raw = np.zeros(16, dtype=np.float32).tobytes()
    refused(client, server, C.SET_TENSOR, t + P.SET_TENSOR.pack(0, 64, P.Codec.RAW, 0), [raw], match="unknown buffer")
    refused(client, server, C.GET_TENSOR, t + P.GET_TENSOR.pack(0, 64, P.Codec.RAW), match="unknown buffer")


def test_node_id_zero_or_unknown(client, server):
    h = alloc(client)
    a = tensor(Type.F32, buffer=h, id=5)
    refused(client, server, C.GRAPH_COMPUTE, graph([0], [a]), match="node id")
    refused(client, server, C.GRAPH_COMPUTE, graph([77], [a]), match="node id")
    node = tensor(Type.F32, buffer=h, id=6, offset=64, op=Op.SCALE, src=[999])
    refused(client, server, C.GRAPH_COMPUTE, graph([6], [a, node]), match="source id")


def test_unsupported_op(client, server):
    h = alloc(client)
    a = tensor(Type.F32, buffer=h, id=5)
    node = tensor(Type.F32, (1, 1, 1, 1), buffer=h, id=6, offset=64, op=Op.SUM, src=[5])
    refused(client, server, C.GRAPH_COMPUTE, graph([6], [a, node]), match="not supported")
    node = tensor(Type.F32, buffer=h, id=6, offset=64, op=250, src=[5])
    refused(client, server, C.GRAPH_COMPUTE, graph([6], [a, node]), match="op 250")


def test_op_shape_checks_rerun(client, server):
    h = alloc(client, 1 << 16)
    a = tensor(Type.F32, (16, 4, 1, 1), buffer=h, id=5)
    b = tensor(Type.F32, (8, 4, 1, 1), buffer=h, id=6, offset=1024)
    mm = tensor(Type.F32, (4, 4, 1, 1), buffer=h, id=7, offset=2048, op=Op.MUL_MAT, src=[5, 6])
    refused(client, server, C.GRAPH_COMPUTE, graph([7], [a, b, mm]), match="inner dimensions")
    c = tensor(Type.F32, (16, 4, 1, 1), buffer=h, id=6, offset=1024)
    wrong = tensor(Type.F32, (5, 4, 1, 1), buffer=h, id=7, offset=2048, op=Op.MUL_MAT, src=[5, 6])
    refused(client, server, C.GRAPH_COMPUTE, graph([7], [a, c, wrong]), match="sources give")


@pytest.mark.parametrize("op", [Op.GET_ROWS, Op.SET_ROWS])
def test_row_indices_out_of_range(client, server, op):
    h = alloc(client, 1 << 16)
    table = set_data(client, h, np.zeros((4, 16), np.float32), Type.F32, (16, 4, 1, 1), id=5)
    idx_raw = np.array([1, 1000], dtype=np.int32).tobytes()
    idx = tensor(Type.I32, (2, 1, 1, 1), buffer=h, id=6, offset=4096)
    status, _, _ = client.call(C.SET_TENSOR, idx + P.SET_TENSOR.pack(0, 8, P.Codec.RAW, 0), [idx_raw])
    assert status == P.Status.OK
    if op == Op.GET_ROWS:
        node = tensor(Type.F32, (16, 2, 1, 1), buffer=h, id=7, offset=8192, op=Op.GET_ROWS, src=[5, 6])
        tensors = [table, idx, node]
    else:
        rows = tensor(Type.F32, (16, 2, 1, 1), buffer=h, id=8, offset=8192)
        node = tensor(Type.F32, (16, 4, 1, 1), buffer=h, id=7, offset=0, op=Op.SET_ROWS, src=[8, 6, 5], view_src=5)
        tensors = [table, idx, rows, node]
    refused(client, server, C.GRAPH_COMPUTE, graph([7], tensors), match="index out of range")


def test_copy_into_smaller_destination(client, server):
    h = alloc(client)
    src = tensor(Type.F32, (256, 1, 1, 1), buffer=h, id=5)
    dst = tensor(Type.F32, (128, 1, 1, 1), buffer=h, id=6, offset=1024)
    refused(client, server, C.COPY_TENSOR, src + dst, match="destination")


def test_allocation_over_mem(client, server):
    refused(client, server, C.ALLOC_BUFFER, P.ALLOC_BUFFER.pack(0, (MEM_MIB + 1) << 20), match="exceeds")
    h = alloc(client, (MEM_MIB // 2) << 20)
    refused(client, server, C.ALLOC_BUFFER, P.ALLOC_BUFFER.pack(0, (MEM_MIB // 2 + 1) << 20), match="exceeds")
    assert client.call(C.FREE_BUFFER, P.U64.pack(h))[0] == P.Status.OK


def test_message_over_size_cap(server):
    c = RawClient(server.endpoint)
    h = alloc(c)
    big = bytes((MAX_MESSAGE_MIB + 2) << 20)
    c.send_raw([P.HEADER.pack(C.SET_TENSOR, 0, 0, 9) + tensor(Type.F32, buffer=h)
                + P.SET_TENSOR.pack(0, len(big), P.Codec.RAW, 0), big])
    status, body, _ = c.recv(timeout=3)  # answered from the sizes; the bytes are read past, never kept
    assert status == P.Status.ERROR and b"--max-message" in body
    assert c.call(C.DEVICE_COUNT)[0] == P.Status.OK  # and the connection goes on
    c.close()
    still_serving(server)


def test_truncated_and_random_bytes(server):
    rng = random.Random(1234)
    c = RawClient(server.endpoint)
    c.send_raw([b"\x03"])  # shorter than a header
    reply = c.recv()
    assert reply is not None and reply[0] == P.Status.ERROR
    for _ in range(300):
        cmd = rng.randrange(0, 20)
        payload = bytes(rng.getrandbits(8) for _ in range(rng.choice([0, 3, 8, 12, 40, P.TENSOR.size,
                                                                        P.TENSOR.size + 18, 700])))
        frames = [os.urandom(rng.randrange(0, 300)) for _ in range(rng.randrange(0, 3))]
        c.send_raw([P.HEADER.pack(cmd, 0, 0, 1) + payload, *frames])
        reply = c.recv()
        assert reply is not None, "no answer to a random request"
    c.close()
    still_serving(server)


def test_disconnect_frees_buffers(server):
    def used_free():
        probe = RawClient(server.endpoint)
        free, _ = P.DEVICE_MEMORY.unpack(probe.call(C.GET_DEVICE_MEMORY, P.U32.pack(0))[1])
        probe.close()
        return free
    import time

    def settles_at(value):
        deadline = time.monotonic() + 5
        while used_free() != value and time.monotonic() < deadline:
            time.sleep(0.1)
        return used_free() == value

    before = used_free()
    c = RawClient(server.endpoint)
    alloc(c, 16 << 20)
    assert used_free() <= before - (16 << 20)
    c.close()  # vanishes without FREE_BUFFER
    assert settles_at(before)
    # gone in the middle of a command: the answer has nobody to go to, the buffers are freed
    c = RawClient(server.endpoint)
    h = alloc(c, 16 << 20)
    data = bytes(3 << 20)
    c.send_raw([P.HEADER.pack(C.SET_TENSOR, 0, 0, 7) + tensor(Type.F32, (len(data) // 4, 1, 1, 1), buffer=h)
                + P.SET_TENSOR.pack(0, len(data), P.Codec.RAW, 0), data])
    c.close()
    assert settles_at(before)
    still_serving(server)


def test_client_sends_big_tensors_in_pieces_under_the_cap(server):
    import pyggml as pg
    from pyggml.rpc import connect
    dev = connect(server.endpoint)[0]
    assert dev.conn.chunk_bytes <= (MAX_MESSAGE_MIB << 20) // 2
    t = pg.new_tensor(Type.F32, (1024, 3 * MAX_MESSAGE_MIB * 256), "big")  # 3x the cap
    buf = pg.alloc_tensors([t], dev.get_buffer_type())
    values = np.random.default_rng(0).standard_normal(t.ne[::-1][2:], dtype=np.float32)
    pg.tensor_set(t, values)
    assert np.array_equal(pg.tensor_array(t).reshape(values.shape), values)
    buf.free()
    dev.conn.close()


def test_a_failed_asynchronous_compute_is_reported_by_the_next_read(server):
    """GRAPH_COMPUTE is not waited for; its failure comes back with the next request that
    reads, and the connection goes on working afterwards."""
    import pyggml as pg
    from pyggml import ops
    from pyggml.rpc import RPCError, connect
    dev = connect(server.endpoint)[0]
    table = pg.new_tensor(Type.F32, (8, 4), "table")
    pg.alloc_tensors([table], dev.get_buffer_type())
    pg.tensor_set(table, np.arange(32, dtype=np.float32))
    idx = pg.new_tensor(Type.I32, (2,), "idx")
    out = ops.get_rows(table, idx)
    graph = pg.build_forward(out)
    sched = pg.Scheduler([dev.init_backend(), pg.cpu_device().init_backend()])
    sched.alloc_graph(graph)
    pg.tensor_set(idx, np.array([1, 9], np.int32))
    sched.graph_compute(graph)  # returns at once
    with pytest.raises(RPCError, match="index out of range"):
        pg.tensor_array(out)
    pg.tensor_set(idx, np.array([3, 0], np.int32))
    sched.graph_compute(graph)
    assert np.array_equal(pg.tensor_array(out).reshape(2, 8), np.arange(32, dtype=np.float32).reshape(4, 8)[[3, 0]])
    dev.conn.close()


def test_compressible_data_travels_compressed(server):
    import pyggml as pg
    from pyggml.rpc import connect
    dev = connect(server.endpoint)[0]
    t = pg.new_tensor(Type.F32, (1024, 1024), "zeros-and-a-ramp")
    buf = pg.alloc_tensors([t], dev.get_buffer_type())
    values = np.zeros((1024, 1024), np.float32)
    values[::64] = np.arange(1024, dtype=np.float32)
    sent = dev.conn.bytes_sent
    pg.tensor_set(t, values)
    assert dev.conn.bytes_sent - sent < values.nbytes // 20  # LZ4 on the wire, 4 MiB of mostly zeros
    received = dev.conn.bytes_received
    assert np.array_equal(pg.tensor_array(t).reshape(values.shape), values)
    assert dev.conn.bytes_received - received < values.nbytes // 20  # and compressed on the way back
    buf.free()
    dev.conn.close()
