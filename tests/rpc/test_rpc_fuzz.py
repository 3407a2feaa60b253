"""Mutations of valid requests against a real server process (hypothesis drives them).

Every request starts as one a real client sends - a graph of each op the server runs, with its
tensors in the session's own buffers, a tensor command, a tensor filled from a file the server
holds (``--gguf``), or a step of servers passing tensors to each other (a token, a link made -
to the server itself, or to a port where nothing listens - a tagged copy over it, a wait for the
tag) - and then has fields of its tensor records, its graph header, node list, op parameters,
frames, size or command changed.  The
server must answer every one of them (with a result or an error), never crash or hang: a
watchdog thread greets the server from a fresh connection every half second and fails the test
if a HELLO goes unanswered for 5 s.  The server runs with numba's bounds checks on, so a
mutation that was accepted and then indexed past an array inside a kernel shows up in its log
(numpy views cannot reach past their buffer; the validation keeps extents inside it).

``PYGGML_FUZZ_EXAMPLES`` sets the number of requests (default 10,000, in a fixed order so a CI
failure reproduces); any value other than the default also draws a fresh order each run.
"""
from __future__ import annotations

import os
import struct
from collections import Counter
import threading
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

import pyggml as pg
from pyggml import Type, ops
from pyggml.ops import GluOp, RopeMode, UnaryOp
from pyggml.rpc import RPCError, connect
from pyggml.rpc import protocol as P
from pyggml.rpc import steps
from pyggml.rpc.backend import serialize_graph, wire

from tests.rpc.rpc_helpers import RawClient, ServerProcess

C = P.Command
EXAMPLES = int(os.environ.get("PYGGML_FUZZ_EXAMPLES", "10000"))
HELLO_TIMEOUT_S = 5.0


def base_graphs() -> list[pg.Tensor]:
    """One small graph per op the server runs (the output tensor of each)."""
    def t(type, *ne, name="x"):
        return pg.new_tensor(type, ne, name).set_input()
    out = []
    a, b = t(Type.F32, 16, 4), t(Type.F32, 16, 1, name="b")
    out += [ops.add(a, b), ops.mul(a, b), ops.sub(a, b), ops.div(a, b), ops.scale(a, 2.0, 0.5)]
    out += [ops.unary(t(Type.F32, 32, 3), u) for u in UnaryOp]
    g, u = t(Type.F32, 32, 3), t(Type.F32, 32, 3, name="up")
    out += [ops.glu(g, u, op) for op in GluOp] + [ops.glu(t(Type.F32, 64, 2), None, GluOp.SWIGLU, True)]
    out += [ops.rms_norm(t(Type.F32, 32, 5), 1e-5), ops.norm(t(Type.F32, 32, 5), 1e-5)]
    out += [ops.soft_max_ext(t(Type.F32, 32, 4, 2), t(Type.F16, 32, 4, name="mask"), 0.5)]
    for mode in (RopeMode.NORMAL, RopeMode.NEOX):
        out.append(ops.rope_ext(t(Type.F32, 16, 2, 3), t(Type.I32, 3, name="pos"), None, 16, mode))
    for wtype, k in ((Type.F32, 64), (Type.F16, 64), (Type.Q4_0, 64), (Type.Q8_0, 96), (Type.Q4_K, 256),
                     (Type.Q6_K, 256), (Type.Q5_1, 64)):
        out.append(ops.mul_mat(t(wtype, k, 8, name="w"), t(Type.F32, k, 5)))
    out += [ops.get_rows(t(Type.F32, 16, 8), t(Type.I32, 3, name="idx")),
            ops.get_rows(t(Type.Q4_0, 32, 8), t(Type.I32, 3, name="idx"))]
    out.append(ops.set_rows(t(Type.F16, 16, 8, name="dst"), t(Type.F32, 16, 2), t(Type.I32, 2, name="idx")))
    out.append(ops.cpy(t(Type.F32, 16, 4), t(Type.F16, 16, 4, name="dst")))
    out.append(ops.cont(ops.permute(t(Type.F32, 8, 4, 2), 1, 0, 2, 3)))
    out.append(ops.concat(t(Type.F32, 8, 4), t(Type.F32, 8, 3, name="b"), 1))
    out.append(ops.argmax(t(Type.F32, 16, 4)))
    q, k, v = t(Type.F32, 64, 2, 4, name="q"), t(Type.F16, 64, 64, 2, name="k"), t(Type.F16, 64, 64, 2, name="v")
    out.append(ops.flash_attn_ext(q, k, v, t(Type.F16, 64, 2, name="mask"), 0.125))
    out.append(ops.flash_attn_ext(q, k, v, None, 0.125, logit_softcap=30.0))
    return out


def fill_inputs(graph: pg.Graph, rng: np.random.Generator) -> None:
    """Values for every input: small indices for I32, normal floats, random quantized blocks."""
    for n in graph.nodes:
        for s in n.src:
            if s is None or s.view_src is not None or s.op != pg.Op.NONE:
                continue
            if s.type == Type.I32:
                pg.tensor_set(s, rng.integers(0, 2, s.nelements(), dtype=np.int32))
            elif s.type.is_quantized:
                pg.tensor_set(s, rng.integers(0, 256, s.type.row_size(s.ne[0]) * s.nrows(), dtype=np.uint8))
            else:
                pg.tensor_set(s, rng.standard_normal(s.nelements()).astype(s.type.np_dtype))


class Session:
    """A real client's session on the server: buffers holding every base graph, and the bytes of
    the requests a client sends for them."""

    def __init__(self, endpoint: str, held_file: tuple[bytes, int, int] | None = None) -> None:
        self.dev = connect(endpoint, connect_timeout=HELLO_TIMEOUT_S)[0]
        self.dev.conn.timeout = 10.0
        backend = self.dev.init_backend()
        rng = np.random.default_rng(0)
        self.requests: list[tuple[int, bytes, list[bytes]]] = []
        self.handles: list[int] = []
        self.scheds = []
        for out in base_graphs():
            graph = pg.build_forward(out)
            sched = pg.Scheduler([backend])
            sched.alloc_graph(graph)
            fill_inputs(graph, rng)
            self.scheds.append(sched)
            self.requests.append((C.GRAPH_COMPUTE, serialize_graph(graph, 0, 0), []))
            leaf = next(s for s in out.src if s is not None)
            for t in (out, leaf):
                w = wire(t).pack()
                n = t.nbytes()
                self.requests += [
                    (C.GET_TENSOR, w + P.GET_TENSOR.pack(0, n, P.Codec.RAW), []),
                    (C.SET_TENSOR, w + P.SET_TENSOR.pack(0, n, P.Codec.RAW, 0), [bytes(rng.bytes(n))]),
                    (C.MEMSET_TENSOR, w + P.MEMSET.pack(0, n, 0), []),
                    (C.COPY_TENSOR, w + wire(leaf if t is out else out).pack(), []),
                    (C.GET_ALLOC_SIZE, P.U32.pack(0) + wire(t, with_buffer=False).pack(), []),
                    (C.INIT_TENSOR, w, []),
                ]
            self.handles.append(out.buffer.handle)
            if len(self.handles) == 1:
                self.firsts = (out, leaf)
        conn = self.dev.conn
        tokens = [bytes(conn.request(C.PEER_TOKEN)[0]) for _ in range(3)]
        # a link from this session to itself, through the server's own connection to itself
        for attempt in range(40):  # (links are made 4 a second server-wide: replays of PEER_CONNECT spend them)
            try:
                link = conn.request(C.PEER_CONNECT, P.PEER_CONNECT.pack(tokens[0]), [endpoint.encode()],
                                    reply=P.U32)[0][0]
                break
            except RPCError as e:
                if "too many links" not in str(e) or attempt == 39:
                    raise
                time.sleep(0.25)
        first_out, first_leaf = self.firsts  # ADD of F32 16 x 4 and its F32 16 x 4 input
        out = wire(first_out).pack()
        self.requests += [(C.PEER_TOKEN, b"", []),
                          (C.PEER_CONNECT, P.PEER_CONNECT.pack(tokens[1]), [endpoint.encode()]),
                          (C.PEER_CONNECT, P.PEER_CONNECT.pack(tokens[2]), [b"127.0.0.1:1"]),
                          (C.COPY_TO_PEER, P.COPY_TO_PEER.pack(link, 7) + out + out, []),
                          (C.WAIT_PEER, P.U32.pack(7), []),
                          (C.STEP_STORE, P.STEP.pack(1), [steps.encode([
                              (C.GRAPH_RECOMPUTE, P.RECOMPUTE.pack(0, 1)),
                              (C.COPY_TO_PEER, P.COPY_TO_PEER.pack(link, 8) + out + out),
                              (C.WAIT_PEER, P.U32.pack(8))])]),
                          (C.STEP_RUN, P.STEP.pack(1), [])]
        if held_file is not None:  # (identity, offset, bytes) of an F32 tensor of the file: 16 x 4 here
            identity, offset, size = held_file
            leaf = wire(first_leaf).pack()
            self.requests.append((C.SET_TENSOR_FILE, leaf + P.SET_TENSOR_FILE.pack(0, size, identity, offset), []))
        self.requests += [(C.GRAPH_RECOMPUTE, P.RECOMPUTE.pack(0, 1), []), (C.DEVICE_COUNT, b"", []),
                          (C.GET_DEVICE_INFO, P.U32.pack(0), []), (C.GET_DEVICE_MEMORY, P.U32.pack(0), []),
                          (C.BUFFER_CLEAR, P.BUFFER_CLEAR.pack(self.handles[0], 0), []),
                          (C.FREE_BUFFER, P.U64.pack(12345), [])]

    def close(self) -> None:
        self.dev.conn.close()


# -- mutations ------------------------------------------------------------------------------------

FIELD_KINDS = [c for c in "QIIQ" + "q" * 8 + "i" * P.MAX_OP_PARAMS + "i" + "Q" * P.MAX_SRC + "QQQ"]
RANGES = {"Q": (0, (1 << 64) - 1), "q": (-(1 << 63), (1 << 63) - 1), "i": (-(1 << 31), (1 << 31) - 1),
          "I": (0, (1 << 32) - 1)}
SPECIAL = [0, 1, 2, 3, 4, 16, 31, 32, 255, 256, 4095, 1 << 20, (1 << 31) - 1, 1 << 31, 1 << 32, (1 << 40) - 1,
           1 << 40, 1 << 48, (1 << 62), (1 << 63) - 1, -1, -2, -(1 << 31), -(1 << 63)]


def _fit(kind: str, value: int) -> int:
    lo, hi = RANGES[kind]
    return value if lo <= value <= hi else value % (hi - lo + 1) + lo


def records(cmd: int, payload: bytes) -> list[int]:
    """Byte offsets of the tensor records in a payload."""
    if cmd == C.GRAPH_COMPUTE and len(payload) >= P.GRAPH.size:
        n_nodes, n_tensors = P.GRAPH.unpack_from(payload)[2:]  # as mutated: up to 2**32 - 1 each
        start = P.GRAPH.size + 8 * n_nodes
        fits = max(0, (len(payload) - start) // P.TENSOR.size)
        return [start + i * P.TENSOR.size for i in range(min(n_tensors, fits))]
    start = {C.GET_ALLOC_SIZE: P.U32.size, C.COPY_TO_PEER: P.COPY_TO_PEER.size}.get(cmd, 0)
    return [o for o in (start, start + P.TENSOR.size) if o + P.TENSOR.size <= len(payload)]


@st.composite
def mutation(draw, session: Session):
    cmd, payload, frames = draw(st.sampled_from(session.requests))
    payload, frames = bytearray(payload), list(frames)
    for _ in range(draw(st.integers(0, 3))):
        kind = draw(st.sampled_from(["field", "field", "field", "header", "bytes", "size", "frames", "command"]))
        recs = records(cmd, bytes(payload))
        if kind == "field" and recs:
            at = draw(st.sampled_from(recs))
            values = list(P.TENSOR.unpack_from(payload, at))
            j = draw(st.integers(0, len(FIELD_KINDS) - 1))
            others = [v for o in recs for v in P.TENSOR.unpack_from(payload, o)[:1]] + session.handles
            new = draw(st.one_of(st.sampled_from(SPECIAL), st.sampled_from(others),
                                 st.integers(-4, 4).map(lambda d, v=values[j]: v + d),
                                 st.integers(*RANGES[FIELD_KINDS[j]]), st.just(values[j] * 2)))
            values[j] = _fit(FIELD_KINDS[j], new)
            P.TENSOR.pack_into(payload, at, *values)
        elif kind == "header" and cmd == C.GRAPH_COMPUTE and len(payload) >= P.GRAPH.size:
            values = list(P.GRAPH.unpack_from(payload))
            j = draw(st.integers(0, 3))
            values[j] = _fit("I", draw(st.one_of(st.sampled_from(SPECIAL), st.integers(0, P.GRAPH_SLOTS + 2),
                                                 st.integers(-2, 2).map(lambda d, v=values[j]: v + d))))
            struct.pack_into(P.GRAPH.format, payload, 0, *values)
        elif kind == "bytes" and payload:
            at = draw(st.integers(0, len(payload) - 1))
            payload[at] = draw(st.integers(0, 255))
        elif kind == "size":
            cut = draw(st.integers(0, len(payload) + 8))
            payload = payload[:cut] if cut <= len(payload) else payload + bytes(draw(st.binary(max_size=64)))
        elif kind == "frames":
            frames = draw(st.one_of(st.just([]), st.lists(st.binary(max_size=256), max_size=3),
                                    st.just(frames[:1] + frames[:1])))
        elif kind == "command":
            cmd = draw(st.integers(0, max(C) + 1))
    return cmd, bytes(payload), frames


class AnyCommand(int):
    """A command number as Connection.request takes it, known to the protocol or not."""

    @property
    def name(self) -> str:
        return C(self).name if self in C._value2member_map_ else f"command {int(self)}"


# -- the watchdog ---------------------------------------------------------------------------------

class Watchdog(threading.Thread):
    """Greets the server from a fresh connection every half second; records a HELLO that goes
    unanswered for HELLO_TIMEOUT_S."""

    def __init__(self, endpoint: str) -> None:
        super().__init__(daemon=True)
        self.endpoint, self.failure, self.greetings = endpoint, None, 0
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.wait(0.5):
            try:
                client = RawClient(self.endpoint, hello=False)
                client.send_raw([P.HEADER.pack(C.HELLO, 0, 0, 1) + P.HELLO.pack(P.MAGIC, P.PROTOCOL_VERSION)])
                answered = client.recv(HELLO_TIMEOUT_S) is not None
                client.close()
            except OSError:
                answered = False
            if not answered:
                self.failure = f"a fresh HELLO went unanswered for {HELLO_TIMEOUT_S:.0f} s"
                return
            self.greetings += 1


def small_gguf(path) -> tuple[bytes, int, int]:
    """A GGUF of two F32 tensors; (its identity, the offset and size of the first's data)."""
    import gguf
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tensor("a", np.arange(64, dtype=np.float32))
    writer.add_tensor("b", np.ones(32, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    from pyggml.rpc.file_identity import file_identity
    from pyggml.gguf import GGUFFile
    info = GGUFFile(path).tensors["a"]
    return file_identity(path), info.offset, info.nbytes


@pytest.fixture(scope="module")
def fuzz_server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("fuzz")
    log = folder / "server.log"
    held = small_gguf(folder / "small.gguf")
    # a wait for a tag that never comes ends soon: a mutated WAIT_PEER holds the session 0.3 s
    server = ServerProcess("--mem", "256", "--max-message", "4M", "--log-level", "info", "--gguf",
                           str(folder / "small.gguf"), env={"NUMBA_BOUNDSCHECK": "1", "PYGGML_RPC_PEER_WAIT": "0.3"},
                           log=log)
    yield server, log, held
    server.stop()


def test_mutated_requests_never_crash_or_hang_the_server(fuzz_server):
    server, log, held = fuzz_server
    session = Session(server.endpoint, held)
    session.dev.conn.timeout = 600.0  # each request once as sent, to compile the server's kernels (the
    for cmd, payload, frames in session.requests:  # checked build's cache may be cold) before the clock runs
        if cmd == C.PEER_CONNECT:  # (its token is good once: spent here, no draw could be accepted)
            continue
        try:
            session.dev.conn.request(cmd, payload, frames)
        except RPCError as e:  # some are refused as they are (a copy between sizes, no such handle)
            assert session.dev.conn.closed_reason is None, str(e)
    session.dev.conn.timeout = 10.0
    watchdog = Watchdog(server.endpoint)
    watchdog.start()
    counts = {"accepted": 0, "refused": 0}
    accepted_by: Counter[int] = Counter()
    last: list = []
    started = time.monotonic()
    deadline = started + 1200  # bounded whatever happens

    failures: list[str] = []  # raised after the run: hypothesis would replay a failing request
                               # against a server whose state has moved on

    @settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=EXAMPLES == 10000,
              phases=[Phase.generate], suppress_health_check=list(HealthCheck))
    @given(st.data())
    def one_request(data):
        nonlocal session
        cmd, payload, frames = data.draw(mutation(session))  # drawn even when unused: hypothesis
        if watchdog.failure is not None and not failures:     # checks that a replay draws the same
            failures.append(f"{watchdog.failure}; the request being served: {last}")
        if time.monotonic() > deadline and not failures:
            failures.append("the fuzz run took too long")
        if failures:
            return
        last[:] = [cmd, payload.hex(), [len(f) for f in frames]]
        try:
            session.dev.conn.request(AnyCommand(cmd), payload, frames)
            counts["accepted"] += 1
            accepted_by[cmd] += 1
        except RPCError as e:
            counts["refused"] += 1
            if "no answer" in str(e) or "closed the connection" in str(e):
                failures.append(f"{e}; the request: {last}")
            elif session.dev.conn.closed_reason is not None:  # e.g. a HELLO refused: start again
                session = Session(server.endpoint, held)

    try:
        one_request()
    finally:
        watchdog.stop.set()
        watchdog.join(10)
        session.close()
    assert not failures, failures[0]
    assert watchdog.failure is None, f"{watchdog.failure}; the request being served: {last}"
    assert server.alive(), "the server process died"
    assert watchdog.greetings > 0 or time.monotonic() - started < 2, "the watchdog never got an answer"
    text = log.read_text()
    assert "out of bounds" not in text, "a kernel indexed past an array:\n" + text[-3000:]
    at = text.find("unexpected error")
    assert at < 0, "an error the validation should have caught:\n" + text[at:at + 3000]
    print(f"fuzz: {counts}, {watchdog.greetings} greetings answered")
    assert counts["accepted"] + counts["refused"] >= EXAMPLES
    assert counts["accepted"] > EXAMPLES // 20 and counts["refused"] > EXAMPLES // 20, counts
    # after all that, the peer and file commands are still served, not only refused (a fresh session's
    # own requests, as sent: a random draw leaves them unmutated too rarely to count on)
    fresh = Session(server.endpoint, held)
    try:
        for cmd, payload, frames in fresh.requests:
            if cmd in (C.PEER_TOKEN, C.PEER_CONNECT, C.COPY_TO_PEER, C.WAIT_PEER, C.SET_TENSOR_FILE):
                try:  # (one PEER_CONNECT names a port nobody listens on: refused, as it should be)
                    fresh.dev.conn.request(cmd, payload, frames)
                    accepted_by[cmd] += 1
                except RPCError as e:
                    assert fresh.dev.conn.closed_reason is None, str(e)
    finally:
        fresh.close()
    for cmd in (C.PEER_TOKEN, C.PEER_CONNECT, C.COPY_TO_PEER, C.WAIT_PEER, C.SET_TENSOR_FILE):
        assert accepted_by[cmd] > 0, f"no {cmd.name} was accepted: {dict(accepted_by)}"
