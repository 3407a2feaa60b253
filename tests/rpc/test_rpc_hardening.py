"""What an attack run against a real server process found, each request sent as it was: the
server answers it with an error (or survives it) and then still answers a fresh client."""
from __future__ import annotations

import socket
import struct
import time

import numpy as np
import pytest

from pyggml.ops import GluOp, Op, UnaryOp
from pyggml.rpc import protocol as P
from pyggml.rpc import transport
from pyggml.types import Type

from tests.rpc.rpc_helpers import RawClient, ServerProcess, tensor
from tests.rpc.test_rpc_validation import (MAX_MESSAGE_MIB, MEM_MIB, alloc, client, graph, refused,  # noqa: F401 - fixtures
                                  server, set_data, still_serving)

C = P.Command


def framed(frames: list[bytes]) -> bytes:
    return transport.message_head([memoryview(f) for f in frames]) + b"".join(frames)


def free_memory(server) -> int:
    """The free memory the server reports for device 0, asked over a connection of its own."""
    probe = RawClient(server.endpoint)
    value = P.DEVICE_MEMORY.unpack(probe.call(C.GET_DEVICE_MEMORY, P.U32.pack(0))[1])[0]
    probe.close()
    return value


@pytest.mark.parametrize("op", ["gelu", "geglu"])
def test_gelu_of_nan_computes_nan(client, server, op):
    """NaN indexed the GELU table past its end: SIGSEGV in the server."""
    h = alloc(client)
    n = 64
    x = np.full(n, np.nan, np.float32)
    x[1::4] = np.inf
    x[2::4] = 1.0
    set_data(client, h, x, Type.F32, (n, 1, 1, 1), id=1)
    a = tensor(Type.F32, (n, 1, 1, 1), buffer=h, id=1)
    if op == "gelu":
        node = tensor(Type.F32, (n, 1, 1, 1), buffer=h, id=2, offset=1024, op=Op.UNARY, src=[1],
                      op_params=[int(UnaryOp.GELU)])
    else:
        node = tensor(Type.F32, (n, 1, 1, 1), buffer=h, id=2, offset=1024, op=Op.GLU, src=[1, 1],
                      op_params=[int(GluOp.GEGLU), 0])  # GEGLU of x with itself
    status, body, _ = client.call(C.GRAPH_COMPUTE, graph([2], [a, node]))
    assert status == P.Status.OK, body
    status, body, frames = client.call(C.GET_TENSOR, node + P.GET_TENSOR.pack(0, 4 * n, P.Codec.RAW))
    assert status == P.Status.OK, body
    out = np.frombuffer(frames[0], np.float32)
    assert np.isnan(out[0::4]).all() and np.isinf(out[1::4]).all()
    assert np.allclose(out[2::4], 0.8413, atol=1e-3)  # GELU(1), and GELU(1) * 1
    still_serving(server)


def test_a_zeromq_peer_claiming_routing_ids_cannot_take_the_server_down(server):
    """Under ZeroMQ a client that claimed the routing ids libzmq would hand out next, followed by
    ordinary clients, made libzmq assert and abort the server.  Connections are now named by the
    server alone; the same peers (a ZMTP 3.0 greeting announcing an id of the form libzmq hands out)
    get nothing, and the ordinary clients after them are served."""
    greeting = b"\xff" + bytes(8) + b"\x7f" + b"\x03\x00" + b"NULL".ljust(20, b"\0") + bytes(32)
    ready = b"\x04\x29\x05READY\x08Identity" + struct.pack(">I", 5) + b"\0\x6b\x8b\x45\x67"
    claimers = []
    for _ in range(32):
        sock = socket.create_connection(("127.0.0.1", server.port), timeout=5)
        sock.sendall(greeting + ready)
        claimers.append(sock)
    try:
        for _ in range(3):
            fresh = RawClient(server.endpoint)
            assert fresh.call(C.DEVICE_COUNT)[0] == P.Status.OK
            fresh.close()
        assert server.alive()
    finally:
        for sock in claimers:
            sock.close()
    still_serving(server)


def test_a_session_belongs_to_its_connection(server):
    """No name travels with a request: another connection cannot act in a session, even knowing
    its buffer handles."""
    owner = RawClient(server.endpoint)
    handle = alloc(owner)
    other = RawClient(server.endpoint, hello=False)
    status, body, _ = other.call(C.FREE_BUFFER, P.U64.pack(handle))
    assert status == P.Status.ERROR and b"HELLO must come first" in body
    status, body, _ = other.call(C.HELLO, P.HELLO.pack(P.MAGIC, P.PROTOCOL_VERSION))
    assert status == P.Status.OK
    status, body, _ = other.call(C.FREE_BUFFER, P.U64.pack(handle))
    assert status == P.Status.ERROR and b"unknown buffer handle" in body
    assert owner.call(C.FREE_BUFFER, P.U64.pack(handle))[0] == P.Status.OK
    owner.close(), other.close()
    still_serving(server)


@pytest.mark.parametrize("junk", [struct.pack("<I", 1 << 31), struct.pack("<I", transport.MAX_FRAME_COUNT + 1),
                                  b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"])
def test_what_is_not_a_message_ends_only_its_own_connection(server, junk):
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=5)
    sock.sendall(junk)
    sock.settimeout(5)
    try:
        assert sock.recv(16) == b""  # closed by the server
    except ConnectionResetError:  # closed with our bytes unread
        pass
    sock.close()
    still_serving(server)


def test_a_client_that_resets_its_connection_while_answers_are_sent_takes_only_its_session(server):
    """A client that pipelined requests and reset its connection made the server's next answer fail
    with ECONNRESET - which escaped the serving loop and ended the server for everyone."""
    before = free_memory(server)
    hello = framed([P.HEADER.pack(C.HELLO, 0, 0, 1) + P.HELLO.pack(P.MAGIC, P.PROTOCOL_VERSION)])
    work = framed([P.HEADER.pack(C.ALLOC_BUFFER, 0, 0, 2) + P.ALLOC_BUFFER.pack(0, 1 << 20)]) + b"".join(
        framed([P.HEADER.pack(C.DEVICE_COUNT, 0, 0, i)]) for i in range(3, 40))
    for _ in range(100):
        sock = socket.create_connection(("127.0.0.1", server.port), timeout=5)
        sock.sendall(hello + work)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close with a reset
        sock.close()
        assert server.alive(), "the server died of a reset connection"
    deadline = time.monotonic() + 10
    while free_memory(server) != before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert free_memory(server) == before, "the reset sessions' buffers are still held"
    still_serving(server)


def test_a_request_declaring_a_terabyte_is_refused_before_its_bytes_arrive(client, server):
    """The frame count and sizes come first: the server answers from them, keeps none of the rest,
    and reads past what the client goes on sending."""
    head = P.HEADER.pack(C.DEVICE_COUNT, 0, 0, 7)
    client.send_bytes(struct.pack("<IQ", 1, 1 << 40) + head + bytes(1 << 20))
    status, body, _ = client.recv(timeout=5)
    assert status == P.Status.ERROR and b"--max-message" in body
    still_serving(server)


def test_zero_strides_cannot_stand_for_2_40_elements(client, server):
    """A MUL_MAT over sources of 2**40 - 1 elements with zero strides in 4 bytes kept the
    server busy for minutes."""
    h = alloc(client)
    big = (1 << 40) - 1
    a = tensor(Type.F32, (1, big, 1, 1), nb=(4, 0, 4, 4), buffer=h, id=1)
    b = tensor(Type.F32, (1, 1, 1, 1), buffer=h, id=2, offset=64)
    node = tensor(Type.F32, (big, 1, 1, 1), nb=(0, 4, 4, 4), buffer=h, id=3, offset=128, op=Op.MUL_MAT, src=[1, 2])
    t0 = time.monotonic()
    refused(client, server, C.GRAPH_COMPUTE, graph([3], [a, b, node]), match="stride nb[1] is 0")
    assert time.monotonic() - t0 < 5


def test_small_strides_cannot_fold_many_elements_onto_few_bytes(client, server):
    """2**25 x 2 elements over a 4 KiB buffer made numpy copy them out (500 MB); strides that
    lay rows over one another can do the same without a zero."""
    h = alloc(client)
    zero = tensor(Type.F32, (2, 1 << 25, 1, 1), nb=(4, 0, 4, 4), buffer=h, id=1)
    refused(client, server, C.SET_TENSOR, zero + P.SET_TENSOR.pack(0, 8, P.Codec.RAW, 0), frames=[bytes(8)],
            match="stride nb[1] is 0")
    folded = tensor(Type.F32, (512, 512, 1, 1), nb=(4, 4, 4, 4), buffer=h, id=1)  # 2**18 values in 4092 bytes
    refused(client, server, C.SET_TENSOR, folded + P.SET_TENSOR.pack(0, 8, P.Codec.RAW, 0), frames=[bytes(8)],
            match="elements")
    b = tensor(Type.F32, (512, 1, 1, 1), buffer=h, id=2)
    node = tensor(Type.F32, (512, 1, 1, 1), buffer=h, id=3, offset=2048, op=Op.MUL_MAT, src=[1, 2])
    refused(client, server, C.GRAPH_COMPUTE, graph([3], [folded, b, node]), match="elements")


def test_scratch_counts_against_mem(client, server):
    """A node's float32 scratch (here an F16 -> F32 copy of 2M values: 16 MiB) must fit in what
    the server still offers; with 60 of its 64 MiB held, it does not."""
    n = 2 << 20
    h = alloc(client, 6 * n)
    hold = alloc(client, (MEM_MIB << 20) - 6 * n - (4 << 20))
    src = tensor(Type.F16, (n, 1, 1, 1), buffer=h, id=1)
    dst = tensor(Type.F32, (n, 1, 1, 1), buffer=h, id=2, offset=2 * n)
    node = tensor(Type.F32, (n, 1, 1, 1), buffer=h, id=3, offset=2 * n, op=Op.CPY, src=[1, 2], view_src=2)
    refused(client, server, C.GRAPH_COMPUTE, graph([3], [src, dst, node]), match="scratch")
    assert client.call(C.FREE_BUFFER, P.U64.pack(hold))[0] == P.Status.OK
    status, body, _ = client.call(C.GRAPH_COMPUTE, graph([3], [src, dst, node]))
    assert status == P.Status.OK, body


def test_the_work_of_a_graph_is_bounded_by_the_bytes_its_session_owns():
    """Checked in-process: no layout of distinct elements reaches the limit with test-sized
    buffers, which is the point - only overlapping strides did, and those are refused."""
    import pyggml as pg
    from pyggml import ops
    from pyggml.graph import Graph
    from pyggml.rpc import validate
    a = pg.new_tensor(Type.F32, (4096, 4096), "a")
    b = pg.new_tensor(Type.F32, (4096, 512), "b")
    g = Graph()
    g.nodes = [ops.mul_mat(a, b)]  # 2**33 multiply-adds
    validate.check_cost(g, owned=(4096 * 4096 + 4096 * 512 + 4096 * 512) * 4, free=1 << 40)
    with pytest.raises(P.ProtocolError, match="multiply-adds"):
        validate.check_cost(g, owned=(1 << 33) // validate.WORK_PER_BYTE - 1, free=1 << 40)
    with pytest.raises(P.ProtocolError, match="scratch"):
        validate.check_cost(g, owned=1 << 40, free=1 << 20)


def test_a_copy_into_a_quantized_type_costs_its_quantizer():
    """A K-quant's quantizer takes the time of thousands of multiply-adds per element: a graph
    of copies into Q4_K counted one per element could keep a server busy for hours within the
    bound; counted at its quantizer's cost it is refused where the same copies in F32 pass."""
    import pyggml as pg
    from pyggml import ops
    from pyggml.graph import Graph
    from pyggml.rpc import validate
    src = pg.new_tensor(Type.F32, (4096, 256), "src")
    owned = src.nbytes() + 4096 * 256 * 4
    for dst_type, passes in ((Type.F32, True), (Type.Q4_K, False), (Type.Q8_0, True)):
        dst = pg.new_tensor(dst_type, (4096, 256), "dst")
        g = Graph()
        g.nodes = [ops.cpy(src, dst) for _ in range(64)]
        if passes:
            validate.check_cost(g, owned=owned, free=1 << 40)
        else:
            with pytest.raises(P.ProtocolError, match="multiply-adds"):
                validate.check_cost(g, owned=owned, free=1 << 40)
    assert validate.node_cost(ops.cpy(src, pg.new_tensor(Type.Q4_K, (4096, 256), "q")))[0] >= 8192 * src.nelements()


def test_a_copy_into_a_type_with_no_quantizer_is_refused_up_front(client, server):
    """Q2_K has no quantizer here: a copy into it is refused when the graph arrives, saying
    which conversion, and the server goes on serving."""
    h = alloc(client)
    src = tensor(Type.F32, (256, 1, 1, 1), buffer=h, id=1)
    dst = tensor(Type.Q2_K, (256, 1, 1, 1), buffer=h, id=2, offset=1024)
    node = tensor(Type.Q2_K, (256, 1, 1, 1), buffer=h, id=3, offset=1024, op=Op.CPY, src=[1, 2], view_src=2)
    refused(client, server, C.GRAPH_COMPUTE, graph([3], [src, dst, node]), match="F32 to Q2_K not supported")
    ok = tensor(Type.Q8_0, (256, 1, 1, 1), buffer=h, id=4, offset=2048)
    node = tensor(Type.Q8_0, (256, 1, 1, 1), buffer=h, id=5, offset=2048, op=Op.CPY, src=[1, 4], view_src=4)
    status, body, _ = client.call(C.GRAPH_COMPUTE, graph([5], [src, ok, node]))
    assert status == P.Status.OK, body


def test_the_message_cap_bounds_the_whole_request(client, server):
    """Eight frames each under --max-message were read whole (4x the cap) and answered."""
    h = alloc(client)
    t = tensor(Type.F32, (16, 1, 1, 1), buffer=h)
    piece = bytes(1 << 20)
    refused(client, server, C.SET_TENSOR, t + P.SET_TENSOR.pack(0, 64, P.Codec.RAW, 0), frames=[piece] * 8,
            match="frames")
    refused(client, server, C.DEVICE_COUNT, b"", frames=[b"", b""], match="frames")
    over = bytes((MAX_MESSAGE_MIB << 20) + (256 << 10))  # one frame, just over the cap
    refused(client, server, C.SET_TENSOR, t + P.SET_TENSOR.pack(0, 64, P.Codec.RAW, 0), frames=[over],
            match="--max-message")


def test_buffers_per_session_are_limited(server):
    from pyggml.rpc.server import Limits
    c = RawClient(server.endpoint)
    handles = []
    batch = 4  # pipelined, far fewer unread answers than the limit
    for _ in range(Limits.buffers // batch):
        for _ in range(batch):
            c.seq += 1
            c.send_raw([P.HEADER.pack(C.ALLOC_BUFFER, 0, 0, c.seq) + P.ALLOC_BUFFER.pack(0, 1)])
        for _ in range(batch):
            status, body, _ = c.recv()
            assert status == P.Status.OK, body
            handles.append(P.ALLOC_REPLY.unpack(body)[0])
    refused(c, server, C.ALLOC_BUFFER, P.ALLOC_BUFFER.pack(0, 1), match="limit per session")
    assert c.call(C.FREE_BUFFER, P.U64.pack(handles[0]))[0] == P.Status.OK
    assert c.call(C.ALLOC_BUFFER, P.ALLOC_BUFFER.pack(0, 1))[0] == P.Status.OK
    c.close()


def test_graph_slots_per_session_are_limited(client, server):
    h = alloc(client)
    a = tensor(Type.F32, (16, 1, 1, 1), buffer=h, id=1)
    node = tensor(Type.F32, (16, 1, 1, 1), buffer=h, id=2, offset=64, op=Op.SCALE, src=[1], op_params=[0, 0])
    body = graph([2], [a, node])
    for slot in (1, P.GRAPH_SLOTS):
        status, reply, _ = client.call(C.GRAPH_COMPUTE, P.GRAPH.pack(0, slot, 1, 2) + body[P.GRAPH.size:])
        assert status == P.Status.OK, reply
    refused(client, server, C.GRAPH_COMPUTE, P.GRAPH.pack(0, P.GRAPH_SLOTS + 1, 1, 2) + body[P.GRAPH.size:],
            match=f"at most {P.GRAPH_SLOTS} graphs")


def test_a_client_that_never_reads_its_replies_loses_its_session(server):
    """The server waited forever to hand over answers nobody read, and every other client with it."""
    from pyggml.rpc.server import Limits

    before = free_memory(server)
    c = RawClient(server.endpoint)
    size = 1 << 20
    handle = alloc(c, size)
    t = tensor(Type.F32, (size // 4, 1, 1, 1), buffer=handle)
    request = framed([P.HEADER.pack(C.GET_TENSOR, 0, 0, 3) + t + P.GET_TENSOR.pack(0, size, P.Codec.RAW)])
    c.send_bytes(request * (Limits.pending_replies + 64))  # 80 MiB of answers, never read
    deadline = time.monotonic() + 20
    while free_memory(server) != before and time.monotonic() < deadline:
        time.sleep(0.2)
    assert free_memory(server) == before, "the session's buffer is still held"
    while c.recv(timeout=1) is not None:  # what did arrive, then the answer to a new request says why
        pass
    c.send_raw([P.HEADER.pack(C.DEVICE_COUNT, 0, 0, 99)])
    reply = c.recv(timeout=10)
    assert reply is not None and reply[0] == P.Status.ERROR and b"replies unread" in reply[1]
    c.close()
    still_serving(server)


def test_the_tensor_cache_keeps_to_its_size_and_to_what_a_session_holds(tmp_path):
    """50 MiB of cache-flagged writes into one 1 MiB buffer left 50 MiB of files."""
    s = ServerProcess("--cache-dir", str(tmp_path), "--cache-max", "3M")
    try:
        c = RawClient(s.endpoint)
        h = alloc(c, 1 << 20)
        t = tensor(Type.F32, (1 << 18, 1, 1, 1), buffer=h)
        rng = np.random.default_rng(0)
        for i in range(50):
            raw = rng.integers(0, 255, 1 << 20, dtype=np.uint8).tobytes()
            c.send_raw([P.HEADER.pack(C.SET_TENSOR, 0, 0, i) + t + P.SET_TENSOR.pack(0, len(raw), P.Codec.RAW,
                                                                                      P.FLAG_CACHE), raw])
            assert c.recv()[0] == P.Status.OK
        files = list(tmp_path.glob("*.bin"))
        assert len(files) == 1 and sum(f.stat().st_size for f in files) == 1 << 20  # what the session holds
        c.close()
    finally:
        s.stop()


def test_the_tensor_cache_evicts_what_was_used_least_recently(tmp_path):
    from pyggml.rpc.cache import TensorCache
    mib = 1 << 20
    cache = TensorCache(tmp_path, max_bytes=int(2.5 * mib))
    a, b, c, d = (bytes([i]) * mib for i in range(4))
    ka, kb = cache.put(a)[0], cache.put(b)[0]
    time.sleep(0.01)
    assert cache.get(ka, mib) == a      # a is now the most recently used
    kc = cache.put(c)[0]                # evicts b
    assert cache.get(kb, mib) is None and cache.size <= 2.5 * mib
    time.sleep(0.01)
    reopened = TensorCache(tmp_path, max_bytes=int(2.5 * mib))  # the order survives a restart
    reopened.put(d)                                              # evicts a (used before c was stored)
    assert reopened.get(ka, mib) is None and reopened.get(kc, mib) == c
    assert len(list(tmp_path.glob("*.bin"))) == 2
    assert not cache.put(bytes(3 * mib))[1]  # larger than the whole cache: not stored


@pytest.mark.parametrize("experts_type", [Type.F32, Type.Q8_0], ids=lambda t: t.name)
def test_expert_ids_outside_the_experts_are_refused_when_the_product_runs(start_server, experts_type):
    """MUL_MAT_ID's ids are data computed in the graph: the server checks each against the
    expert count before reading a weight (quantized experts: the table's route reads expert 0
    instead and the step raises after it), answers with the error and keeps serving."""
    import pyggml as pg
    from pyggml import ops
    from pyggml.backend import alloc_tensors
    from pyggml.rpc import RPCError, connect

    server = start_server()
    device = connect(server.endpoint)[0]
    experts = pg.new_tensor(experts_type, (32, 4, 3), "experts")
    alloc_tensors([experts], device.get_buffer_type())
    w = np.arange(32 * 4 * 3, dtype=np.float32).reshape(3, 4, 32) / 100
    if experts_type != Type.F32:
        w = pg.quants.dequantize(pg.quants.quantize(w.reshape(12, 32), experts_type), experts_type).reshape(3, 4, 32)
    pg.tensor_set(experts, pg.quants.quantize(w.reshape(12, 32), experts_type) if experts_type != Type.F32 else w)
    x = pg.new_tensor(Type.F32, (32, 1, 2), "x").set_input()
    ids = pg.new_tensor(Type.I32, (1, 2), "ids").set_input()
    out = ops.mul_mat_id(experts, x, ids).set_output()
    graph = pg.build_forward(out)
    sched = pg.Scheduler([device.init_backend(), pg.cpu_device().init_backend()])
    sched.alloc_graph(graph)
    xv = np.ones((2, 1, 32), np.float32)
    pg.tensor_set(x, xv)
    pg.tensor_set(ids, np.array([0, 7], np.int32))
    sched.graph_compute(graph)
    with pytest.raises(RPCError, match="expert id 7 outside 0..2"):
        pg.tensor_array(out)
    assert server.alive()
    pg.tensor_set(ids, np.array([2, 1], np.int32))
    sched.graph_compute(graph)
    got = pg.tensor_array(out).reshape(2, 4)
    assert np.allclose(got, [w[2] @ xv[0, 0], w[1] @ xv[1, 0]], rtol=1e-6 if experts_type == Type.F32 else 1e-2)
    device.conn.close()


def test_product_runs_that_do_not_rise_to_the_columns_are_refused_when_the_product_runs(start_server):
    """MUL_MAT's runs (ops.mul_mat) are data too: runs past the columns or falling are an
    error reply, the server keeps serving, and good runs then compute."""
    import pyggml as pg
    from pyggml import ops
    from pyggml.backend import alloc_tensors
    from pyggml.rpc import RPCError, connect

    server = start_server()
    device = connect(server.endpoint)[0]
    w = pg.new_tensor(Type.F32, (32, 4), "w")
    alloc_tensors([w], device.get_buffer_type())
    wv = np.arange(32 * 4, dtype=np.float32).reshape(4, 32) / 100
    pg.tensor_set(w, wv)
    x = pg.new_tensor(Type.F32, (32, 6), "x").set_input()
    runs = pg.new_tensor(Type.I32, (3,), "runs").set_input()
    out = ops.mul_mat(w, x, runs).set_output()
    graph = pg.build_forward(out)
    sched = pg.Scheduler([device.init_backend(), pg.cpu_device().init_backend()])
    sched.alloc_graph(graph)
    xv = np.ones((6, 32), np.float32)
    pg.tensor_set(x, xv)
    for bad in ([0, 4, 1 << 30], [0, 5, 2], [-3, 2, 6]):
        pg.tensor_set(runs, np.array(bad, np.int32))
        sched.graph_compute(graph)
        with pytest.raises(RPCError, match="MUL_MAT: runs"):
            pg.tensor_array(out)
        assert server.alive()
    pg.tensor_set(runs, np.array([0, 4, 6], np.int32))
    sched.graph_compute(graph)
    assert np.allclose(pg.tensor_array(out).reshape(6, 4), xv @ wv.T, rtol=1e-6)
