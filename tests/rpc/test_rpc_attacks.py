"""The second attack run against a real ``pyggml-rpc-server`` (the TCP transport, links between
servers, ``--gguf`` files), each attack sent as it was: the server stays within its bounds, and a
fresh honest client - from another address where the attack filled one address's slots - is
served within one second while the attack goes on."""
from __future__ import annotations

import os
import shutil
import socket
import struct
import threading
import time
from contextlib import contextmanager

import numpy as np
import pytest

from pyggml.models import hub
from pyggml.rpc.file_identity import file_identity
from pyggml.gguf import GGUFFile
from pyggml.ops import Op
from pyggml.rpc import keys, transport
from pyggml.rpc import protocol as P
from pyggml.rpc.files import parse_listing
from pyggml.types import Type

from tests.rpc.rpc_helpers import RawClient, ServerProcess, tensor
from tests.rpc.test_rpc_validation import alloc, graph, set_data

C = P.Command
SERVED_WITHIN_S = 1.0


def rss_mib(server: ServerProcess) -> float:
    with open(f"/proc/{server.proc.pid}/status") as f:
        line = next(x for x in f if x.startswith("VmRSS:"))
    return int(line.split()[1]) / 1024


def honest(server: ServerProcess, source: str = "127.0.0.1") -> float:
    """Seconds a fresh client from ``source`` takes to connect, say HELLO and be answered."""
    t0 = time.monotonic()
    c = RawClient(server.endpoint, source=source)
    status, body, _ = c.call(C.DEVICE_COUNT, timeout=SERVED_WITHIN_S)
    c.close()
    assert status == P.Status.OK, body
    return time.monotonic() - t0


def served(server: ServerProcess, source: str = "127.0.0.1") -> None:
    assert server.alive(), "the server died"
    took = honest(server, source)
    assert took < SERVED_WITHIN_S, f"an honest client waited {took:.2f} s"


def head_only(sizes: list[int]) -> bytes:
    return struct.pack("<I", len(sizes)) + b"".join(struct.pack("<Q", s) for s in sizes)


def no_reply(cmd: int, payload: bytes, seq: int = 0) -> bytes:
    return P.HEADER.pack(cmd, P.FLAG_NO_REPLY, 0, seq) + payload


@pytest.fixture(scope="module")
def server():
    s = ServerProcess("--mem", "512M")
    yield s
    s.stop()


@contextmanager
def sockets(n: int, source: str = "127.0.0.1", port: int = 0, send: bytes = b""):
    """``n`` connections held open from ``source`` (those the server refused are closed by it)."""
    held = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind((source, 0))
            s.settimeout(5)
            try:
                s.connect(("127.0.0.1", port))
                if send:
                    s.sendall(send)
            except OSError:
                s.close()
                continue
            held.append(s)
        yield held
    finally:
        for s in held:
            s.close()


# -- 1. memory grows with the bytes received, within a server-wide bound -----------------------------

def test_heads_declaring_512_mib_cost_nothing_until_their_bytes_come(server):
    """Three 12-byte heads declaring 512 MiB took the server from 103 to 1639 MiB, and 640 MiB
    stayed after the clients left.  Before HELLO a message may be 64 KiB; a session may send in
    one message what it holds in buffers; and what it is allowed grows only as bytes arrive."""
    before = rss_mib(server)
    header = P.HEADER.pack(C.DEVICE_COUNT, 0, 0, 1)
    with sockets(3, port=server.port, send=head_only([len(header), 500 << 20]) + header) as raw:
        replies = [transport.Channel(s).recv(time.monotonic() + 5) for s in raw]
        served(server)
        assert all(b"exceeds the 65536 this session may send" in bytes(r[0]) for r in replies), replies
    owners = [RawClient(server.endpoint) for _ in range(3)]
    for c in owners:  # each holds 100 MiB of buffers and declares 100 MiB, sends 1 MiB of it
        h = alloc(c, 100 << 20)
        t = tensor(Type.F32, (25 << 20, 1, 1, 1), buffer=h)
        head = P.HEADER.pack(C.SET_TENSOR, 0, 0, 1) + t + P.SET_TENSOR.pack(0, 100 << 20, P.Codec.RAW, 0)
        c.send_bytes(head_only([len(head), 100 << 20]) + head + bytes(1 << 20))
    time.sleep(0.5)
    served(server)
    grown = rss_mib(server) - before
    assert grown < 40, f"the server grew by {grown:.0f} MiB for 3 MiB received"
    for c in owners:
        c.close()
    deadline = time.monotonic() + 5
    while rss_mib(server) - before > 40 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert rss_mib(server) - before < 40
    served(server)


def test_messages_in_transit_share_one_server_wide_bound_and_a_waiting_one_goes_on_later():
    """--max-transit 8M: a second 6 MiB message waits, unread, until the first is served; small
    requests never wait."""
    server = ServerProcess("--mem", "64M", "--max-transit", "8M")
    try:
        clients = [RawClient(server.endpoint) for _ in range(2)]
        data = [np.full(6 << 18, i + 1, np.float32) for i in range(2)]
        messages = []
        for i, c in enumerate(clients):
            t = tensor(Type.F32, (6 << 18, 1, 1, 1), buffer=alloc(c, 8 << 20))
            head = P.HEADER.pack(C.SET_TENSOR, 0, 0, 5) + t + P.SET_TENSOR.pack(0, 6 << 20, P.Codec.RAW, 0)
            messages.append((t, head_only([len(head), 6 << 20]) + head + data[i].tobytes()))
        clients[0].send_bytes(messages[0][1][:4 << 20])  # begun: 6 MiB reserved of 8
        time.sleep(0.3)
        second = threading.Thread(target=clients[1].send_bytes, args=(messages[1][1],))
        second.start()  # cannot reserve: parked, its bytes left in the socket
        time.sleep(0.5)
        assert clients[1].recv(0.3) is None
        served(server)
        clients[0].send_bytes(messages[0][1][4 << 20:])
        assert clients[0].recv()[0] == P.Status.OK
        assert clients[1].recv()[0] == P.Status.OK  # the pool had room again
        second.join()
        for c, (t, _), want in zip(clients, messages, data):
            status, _, frames = c.call(C.GET_TENSOR, t + P.GET_TENSOR.pack(0, 6 << 20, P.Codec.RAW))
            assert status == P.Status.OK and np.array_equal(np.frombuffer(frames[0], np.float32), want)
        served(server)
    finally:
        server.stop()


# -- 2. slots ------------------------------------------------------------------------------------------

def test_connections_that_never_say_hello_cannot_lock_out_another_address(server):
    """530 connections that never said HELLO locked honest clients out."""
    with sockets(530, port=server.port) as raw:
        assert raw
        served(server, source="127.0.0.2")
    served(server)


def test_greeted_idle_connections_cannot_lock_out_another_address_nor_fill_every_slot(server):
    """512 greeted idle connections locked honest clients out forever: one address may hold 64
    slots, and when every slot is taken a session that holds nothing gives its slot up."""
    greeted = []
    try:
        for a in range(2, 11):  # 9 addresses of 64 connections: more than the 512 slots
            for _ in range(64):
                try:
                    greeted.append(RawClient(server.endpoint, source=f"127.0.0.{a}"))
                except (AssertionError, OSError):
                    pass  # refused: the address's or the server's slots are full
        assert 500 <= len(greeted) <= 9 * 64
        served(server, source="127.0.0.200")
        served(server)
    finally:
        for c in greeted:
            c.close()


def test_a_session_that_holds_nothing_is_closed_when_idle_and_one_that_holds_buffers_is_kept():
    server = ServerProcess("--idle-timeout", "1")
    try:
        idle, owner = RawClient(server.endpoint), RawClient(server.endpoint)
        alloc(owner)
        time.sleep(2.5)
        assert idle.recv(1.0) is None and idle.sock.recv(1) == b""  # closed by the server
        assert owner.call(C.DEVICE_COUNT)[0] == P.Status.OK
        served(server)
    finally:
        server.stop()


@pytest.mark.skipif(shutil.which("openssl") is None, reason="making TLS keys needs the openssl command")
def test_stalled_tls_handshakes_cannot_lock_out_tls_clients(tmp_path):
    """520 TLS handshakes that never went on spent every slot before a certificate was checked."""
    server_key, client_key = keys.generate(tmp_path / "k")
    server = ServerProcess("--key", str(server_key))
    try:
        ctx = keys.context(client_key, server_side=False)
        with sockets(520, port=server.port) as raw:
            assert raw
            t0 = time.monotonic()
            sock = socket.create_connection(("127.0.0.1", server.port), timeout=5, source_address=("127.0.0.2", 0))
            channel = transport.Channel(ctx.wrap_socket(sock))
            hello = P.HEADER.pack(C.HELLO, 0, 0, 1) + P.HELLO.pack(P.MAGIC, P.PROTOCOL_VERSION)
            channel.send([hello], timeout=5)
            reply = channel.recv(time.monotonic() + SERVED_WITHIN_S)
            assert P.HEADER.unpack_from(reply[0])[0] == P.Status.OK
            assert time.monotonic() - t0 < SERVED_WITHIN_S
            channel.close()
    finally:
        server.stop()


# -- 3. fairness -------------------------------------------------------------------------------------

@pytest.mark.parametrize("empty", [struct.pack("<I", 0),                           # heartbeats
                                   struct.pack("<IQ", 1, 0)],                      # a frame of nothing
                         ids=["heartbeats", "empty-frames"])
def test_a_stream_of_empty_messages_does_not_keep_the_loop(server, empty):
    """A client streaming empty messages kept the loop on itself: others waited 8 s."""
    stop = threading.Event()
    flood = RawClient(server.endpoint)
    burst = empty * 4096

    def pump():
        while not stop.is_set():
            try:
                flood.send_bytes(burst)
            except OSError:
                return
    t = threading.Thread(target=pump, daemon=True)
    t.start()
    try:
        time.sleep(0.5)
        for _ in range(3):
            served(server)
    finally:
        stop.set()
        t.join(10)
        flood.close()


# -- 4 and 7. links to other servers: never blocking, bounded, one error for every failure --------------

class FakeServer:
    """A listening socket that does one thing with what connects: ``silent`` accepts and never
    answers, ``close`` accepts and closes, ``stop_reading`` answers HELLO and PEER_AUTH with OK
    and then reads nothing more."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.endpoint = f"127.0.0.1:{self.port}"
        self.conns: list[socket.socket] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        self.sock.settimeout(0.2)
        while not self.stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except (TimeoutError, OSError):
                continue
            if self.mode == "close":
                conn.close()
                continue
            self.conns.append(conn)
            if self.mode == "stop_reading":
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
                ch = transport.Channel(conn)
                for _ in range(2):  # HELLO, PEER_AUTH
                    seq = P.HEADER.unpack_from(ch.recv(time.monotonic() + 5)[0])[3]
                    reply = P.HEADER.pack(P.Status.OK, 0, 0, seq) + (
                        P.HELLO_REPLY.pack(P.PROTOCOL_VERSION, 1, 1 << 20, 0) if seq == 1 else b"")
                    ch.send([reply], timeout=5)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)
        for c in self.conns:
            c.close()
        self.sock.close()


def link_to(client: RawClient, endpoint: str, timeout: float = 10.0, token: bytes = bytes(32)):
    return client.call(C.PEER_CONNECT, P.PEER_CONNECT.pack(token), [endpoint.encode()], timeout=timeout)


def test_links_to_a_silent_port_or_to_the_server_itself_never_stall_other_clients(server):
    """PEER_CONNECT to a port that never answers held the loop ~3 s a time (16 per session,
    sessions unlimited); to the server's own port it waited for its own HELLO answer."""
    silent = FakeServer("silent")
    try:
        attackers = [RawClient(server.endpoint) for _ in range(4)]
        for a in attackers:  # sent, not waited for
            a.send_raw([P.HEADER.pack(C.PEER_CONNECT, 0, 0, 1) + P.PEER_CONNECT.pack(bytes(32)),
                        silent.endpoint.encode()])
        time.sleep(0.2)
        for _ in range(3):
            served(server)
        # a link to itself, with a real token of its own: made, while others are served
        receiver, sender = RawClient(server.endpoint), RawClient(server.endpoint)
        token = receiver.call(C.PEER_TOKEN)[1]
        status, body, _ = link_to(sender, server.endpoint, timeout=SERVED_WITHIN_S, token=token)
        assert status == P.Status.OK, body
        answers = [a.recv(10) for a in attackers]
        assert all(r is not None and r[0] == P.Status.ERROR and r[1] == f"cannot link to {silent.endpoint}".encode()
                   for r in answers), answers
    finally:
        silent.close()
    served(server)


def test_every_way_a_link_fails_gets_the_same_answer(server):
    """"refused", "closed" and "silent" told apart let a client scan the server's network."""
    closed_port = socket.create_server(("127.0.0.1", 0))
    refused_endpoint = f"127.0.0.1:{closed_port.getsockname()[1]}"
    closed_port.close()
    closing, silent = FakeServer("close"), FakeServer("silent")
    try:
        c = RawClient(server.endpoint)
        answers = {}
        for name, endpoint in [("refused", refused_endpoint), ("closed", closing.endpoint),
                               ("silent", silent.endpoint), ("a pyggml server, a bad token", server.endpoint)]:
            status, body, _ = link_to(c, endpoint)
            assert status == P.Status.ERROR
            answers[name] = body.decode().replace(endpoint, "ENDPOINT")
        assert len(set(answers.values())) == 1, answers
    finally:
        closing.close()
        silent.close()


def test_links_are_made_a_few_at_a_time_server_wide_and_only_to_its_own_networks():
    server = ServerProcess()
    silent = FakeServer("silent")
    try:
        sessions = [RawClient(server.endpoint) for _ in range(24)]
        for c in sessions:
            c.send_raw([P.HEADER.pack(C.PEER_CONNECT, 0, 0, 1) + P.PEER_CONNECT.pack(bytes(32)),
                        silent.endpoint.encode()])
        served(server)
        answers = [c.recv(10) for c in sessions]
        bodies = [r[1].decode() for r in answers]
        assert sum("too many links" in b for b in bodies) >= 24 - 16, bodies
        assert sum("cannot link to" in b for b in bodies) <= 16
        status, body, _ = link_to(sessions[0], "10.255.255.1:50052")
        assert status == P.Status.ERROR and b"not on this server's networks" in body
    finally:
        silent.close()
        server.stop()
    widened = ServerProcess("--peer-allow", "192.0.2.0/24")
    try:
        status, body, _ = link_to(RawClient(widened.endpoint), "192.0.2.1:9")
        assert status == P.Status.ERROR and body == b"cannot link to 192.0.2.1:9"  # tried: it is allowed
    finally:
        widened.stop()


def test_copies_to_a_server_that_stops_reading_never_stall_other_clients(server):
    """COPY_TO_PEER to a peer that stopped reading held the loop 5 s a copy (8 links per session)."""
    sink = FakeServer("stop_reading")
    try:
        c = RawClient(server.endpoint)
        status, body, _ = link_to(c, sink.endpoint)
        assert status == P.Status.OK, body
        link = P.U32.unpack(body)[0]
        n = 1 << 20  # 4 MiB of random floats (LZ4 cannot shrink them): far more than the socket takes
        src = set_data(c, alloc(c, 4 * n), np.random.default_rng(0).random(n, np.float32), Type.F32, (n, 1, 1, 1))
        for i in range(8):
            c.send_raw([no_reply(C.COPY_TO_PEER, P.COPY_TO_PEER.pack(link, i) + src + tensor(0))])
        time.sleep(0.2)
        served(server)
        time.sleep(transport.LINK_STALL_S + 1.5)  # then the link is closed: the copy is refused by name
        status, body, _ = c.call(C.COPY_TO_PEER, P.COPY_TO_PEER.pack(link, 99) + src + tensor(0))
        assert status == P.Status.ERROR and b"is gone" in body and b"took no bytes" in body, body
        served(server)
    finally:
        sink.close()


# -- 5. requests held while a session waits ------------------------------------------------------------

def test_requests_held_while_waiting_count_against_what_the_session_holds(server):
    """Three sessions that owned no buffer made the server hold +720 MiB of requests."""
    before = rss_mib(server)
    waiting = []
    for _ in range(3):
        w = RawClient(server.endpoint)
        token = w.call(C.PEER_TOKEN)[1]
        link = RawClient(server.endpoint)  # the attacker's own "server", so that a wait is allowed
        assert link.call(C.PEER_AUTH, token)[0] == P.Status.OK
        w.send_raw([no_reply(C.WAIT_PEER, P.U32.pack(1))])
        filler = no_reply(C.DEVICE_COUNT, b"") + bytes(60 << 10)
        w.send_bytes(b"".join(transport.message_head([memoryview(filler)]) + filler for _ in range(1000)))
        waiting.append((w, link))
    served(server)
    grown = rss_mib(server) - before
    assert grown < 60, f"the server grew by {grown:.0f} MiB holding requests"
    for w, _ in waiting:  # the wait ended with an error
        status, body, _ = w.call(C.DEVICE_COUNT, timeout=10)
        assert status == P.Status.ERROR and b"piled up" in body, body
    for w, link in waiting:
        w.close(), link.close()
    served(server)


# -- 6. held files that change -----------------------------------------------------------------------

@pytest.fixture
def held_copy(tmp_path, monkeypatch):
    """A copy of SmolLM2's GGUF and a server holding it (its own identity index)."""
    monkeypatch.setenv("PYGGML_CACHE", str(tmp_path / "cache"))
    copy = tmp_path / "model.gguf"
    shutil.copy(hub.resolve("smollm2"), copy)
    server = ServerProcess("--mem", "256M", "--gguf", str(copy), env={"PYGGML_CACHE": str(tmp_path / "cache")})
    yield copy, server
    server.stop()


def listing(c: RawClient) -> dict[bytes, str]:
    status, body, frames = c.call(C.HELLO, P.HELLO.pack(P.MAGIC, P.PROTOCOL_VERSION))
    return parse_listing(frames[0]) if frames else {}


def test_a_file_rewritten_in_place_is_refused_then_offered_under_its_new_identity(held_copy):
    copy, server = held_copy
    f = GGUFFile(copy)
    info = f.tensors["blk.0.attn_norm.weight"]  # F32 [576]
    offset, nbytes = info.offset, info.nbytes
    f.close()
    old = file_identity(copy)
    c = RawClient(server.endpoint)
    t = tensor(0, (576, 1, 1, 1), buffer=alloc(c, 4096))

    def fill(identity):
        return c.call(C.SET_TENSOR_FILE, t + P.SET_TENSOR_FILE.pack(0, nbytes, identity, offset))
    assert fill(old)[0] == P.Status.OK
    st = os.stat(copy)
    new_values = np.full(576, 3.5, np.float32)
    with open(copy, "r+b") as out:  # in place: same inode, same size, and the old mtime put back
        out.seek(offset)
        out.write(new_values.tobytes())
    os.utime(copy, ns=(st.st_atime_ns, st.st_mtime_ns))
    status, body, _ = fill(old)
    assert status == P.Status.ERROR and b"changed on this server's disk" in body, body
    deadline = time.monotonic() + 60
    while old in (held := listing(c)) or not held:
        assert time.monotonic() < deadline, "the changed file was never offered again"
        time.sleep(0.2)
    (new,) = held
    assert new == file_identity(copy) != old
    assert fill(new)[0] == P.Status.OK
    status, _, frames = c.call(C.GET_TENSOR, t + P.GET_TENSOR.pack(0, nbytes, P.Codec.RAW))
    assert np.array_equal(np.frombuffer(frames[0], np.float32), new_values)
    served(server)


def test_a_restart_after_a_rewrite_that_keeps_size_and_mtime_hashes_again(held_copy):
    copy, server = held_copy
    old = file_identity(copy)
    server.stop()
    st = os.stat(copy)
    with open(copy, "r+b") as out:
        out.seek(st.st_size - 16)
        out.write(b"\x01" * 16)
    os.utime(copy, ns=(st.st_atime_ns, st.st_mtime_ns))
    again = ServerProcess("--gguf", str(copy), env={"PYGGML_CACHE": os.environ["PYGGML_CACHE"]})
    try:
        banner = "\n".join(again.banner)
        assert old.hex()[:16] not in banner and file_identity(copy).hex()[:16] in banner
    finally:
        again.stop()


def test_a_truncated_file_is_an_error_not_a_crash(held_copy):
    """SIGBUS when the last tensor of a truncated file was asked for."""
    copy, server = held_copy
    f = GGUFFile(copy)
    last = max(f.tensors.values(), key=lambda i: i.offset)
    f.close()
    identity = file_identity(copy)
    os.truncate(copy, last.offset + 64)
    c = RawClient(server.endpoint)
    h = alloc(c, last.nbytes)
    t = tensor(0, (last.nbytes // 4, 1, 1, 1), buffer=h)
    status, body, _ = c.call(C.SET_TENSOR_FILE, t + P.SET_TENSOR_FILE.pack(0, last.nbytes, identity, last.offset))
    assert status == P.Status.ERROR and b"changed" in body, body
    served(server)


# -- 8. TOP_K past 256 on rows with NaN -----------------------------------------------------------------

def test_top_k_past_256_on_a_row_with_nan_is_computed(server):
    c = RawClient(server.endpoint)
    n, k = 512, 300
    row = np.random.default_rng(1).standard_normal(n).astype(np.float32)
    row[::2] = np.nan  # the 300th largest is a NaN
    h = alloc(c, 8192)
    a = set_data(c, h, row, Type.F32, (n, 1, 1, 1))
    node = tensor(Type.I32, (k, 1, 1, 1), buffer=h, id=2, offset=4096, op=Op.TOP_K, src=[1])
    status, body, _ = c.call(C.GRAPH_COMPUTE, graph([2], [a, node]))
    assert status == P.Status.OK, body
    status, body, frames = c.call(C.GET_TENSOR, node + P.GET_TENSOR.pack(0, 4 * k, P.Codec.RAW))
    got = np.frombuffer(frames[0], np.int32)
    key = np.where(np.isnan(row), -np.inf, row)  # NaN ranks below every number
    want = np.lexsort((np.arange(n), -key))[:k]
    assert np.array_equal(got, want)
    served(server)
