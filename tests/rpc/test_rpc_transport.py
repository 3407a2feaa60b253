"""The RPC transport on its own: framing, limits checked before bytes are read, connections the
server names, heartbeats, unread replies, TLS - a real listener and real sockets on 127.0.0.1."""
from __future__ import annotations

import queue
import shutil
import socket
import struct
import threading
import time

import numpy as np
import pytest

from pyggml.rpc import keys, transport
from pyggml.rpc.transport import COUNT, Channel, Disconnected, Listener, Message, MessageReader


class Loop(threading.Thread):
    """Polls a listener the way the server does and hands every event to the test."""

    def __init__(self, listener: Listener) -> None:
        super().__init__(daemon=True)
        self.listener, self.events, self.stop = listener, queue.Queue(), threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            for event in self.listener.poll(0.05):
                self.events.put(event)

    def next(self, kind: type = object, timeout: float = 5.0):
        deadline = time.monotonic() + timeout
        while True:
            event = self.events.get(timeout=max(0.01, deadline - time.monotonic()))
            if isinstance(event, kind):
                return event


@pytest.fixture
def loop():
    listener = Listener("127.0.0.1", 0, None, max_frames=4, max_bytes=1 << 20, max_peers=4, max_queued=4)
    thread = Loop(listener)
    thread.start()
    yield thread
    thread.stop.set()
    thread.join()
    listener.close()


def connect(loop: Loop) -> Channel:
    host, port = loop.listener.endpoint.rsplit(":", 1)
    return Channel.connect(host, int(port), None, 5)


def test_messages_keep_their_frames_both_ways(loop):
    ch = connect(loop)
    data = np.arange(1000, dtype=np.float32)
    ch.sock.sendall(COUNT.pack(0))  # a heartbeat from the client: skipped
    ch.send([b"head", data, b""], timeout=5)
    msg = loop.next(Message)
    assert msg.error is None and [bytes(f) for f in msg.frames] == [b"head", data.tobytes(), b""]
    assert loop.listener.send(msg.peer, [b"reply", memoryview(b"x" * 70000)])
    assert [bytes(f) for f in ch.recv(time.monotonic() + 5)] == [b"reply", b"x" * 70000]
    ch.close()
    assert loop.next(Disconnected).peer is msg.peer


def test_held_replies_leave_together_when_sent(loop):
    """The server holds the replies to one read of a client's requests and sends them in one
    go: nothing reaches the client before send_held, then every reply in order."""
    ch = connect(loop)
    ch.send([b"ask"], timeout=5)
    peer = loop.next(Message).peer
    assert loop.listener.send(peer, [b"first"], now=False)
    assert loop.listener.send(peer, [b"second", memoryview(b"y" * 5000)], now=False)
    ch.sock.settimeout(0.2)
    with pytest.raises((TimeoutError, socket.timeout)):
        ch.sock.recv(1, socket.MSG_PEEK)  # held: not one byte sent yet
    loop.listener.send_held()
    assert [bytes(f) for f in ch.recv(time.monotonic() + 5)] == [b"first"]
    assert [bytes(f) for f in ch.recv(time.monotonic() + 5)] == [b"second", b"y" * 5000]
    ch.close()


def test_connections_are_numbered_by_the_listener_and_never_share_a_number(loop):
    seen = set()
    for _ in range(3):
        chans = [connect(loop) for _ in range(3)]
        for ch in chans:
            ch.send([b"hi"], timeout=5)
        peers = [loop.next(Message).peer for _ in chans]
        assert len({p.id for p in peers}) == 3 and not seen & {p.id for p in peers}
        seen |= {p.id for p in peers}
        for ch in chans:
            ch.close()
        for _ in chans:
            loop.next(Disconnected)


def test_limits_are_checked_before_a_byte_of_the_frames_is_read():
    """A message declaring a terabyte: answered from its sizes, nothing of that size allocated."""
    wire = bytearray(struct.pack("<IQQ", 2, 12, 1 << 40) + b"header+seq..")
    allocated = []

    def recv_into(view, n):
        allocated.append(view.nbytes)
        if not wire:
            raise BlockingIOError
        n = min(n, len(wire))
        view[:n] = wire[:n]
        del wire[:n]
        return n

    reader = MessageReader(max_frames=2, max_bytes=1 << 20)
    frames, error = reader.read(recv_into)
    assert "exceeds" in error and bytes(frames[0]) == b"header+seq.."
    assert max(allocated) <= 64 << 10  # the small reads and the discard scratch, never the declared size
    wire += b"z" * 100000  # what does arrive of it is read past
    with pytest.raises(BlockingIOError):
        reader.read(recv_into)
    assert max(allocated) <= 64 << 10 and not wire


def test_the_rest_of_a_refused_message_is_read_past_and_the_next_one_read():
    wire = bytearray(struct.pack("<IQQ", 2, 12, 200000) + b"header+seq.." + b"z" * 200000
                     + struct.pack("<IQ", 1, 2) + b"ok")

    def recv_into(view, n):
        if not wire:
            raise BlockingIOError
        n = min(n, len(wire), 7000)  # in pieces, as a socket gives them
        view[:n] = wire[:n]
        del wire[:n]
        return n

    reader = MessageReader(max_frames=2, max_bytes=1 << 16)
    assert "exceeds" in reader.read(recv_into)[1]
    frames, error = reader.read(recv_into)
    assert error is None and [bytes(f) for f in frames] == [b"ok"]


def test_too_many_frames_or_bytes_are_refused_and_the_connection_goes_on(loop):
    ch = connect(loop)
    ch.send([b"12345678"] * 5, timeout=5)
    assert "5 frames" in loop.next(Message).error
    ch.send([b"12345678", bytes((1 << 20) + 1)], timeout=5)
    msg = loop.next(Message)
    assert "exceeds" in msg.error and bytes(msg.frames[0]) == b"12345678"
    ch.send([b"fine"], timeout=5)
    msg = loop.next(Message)
    assert msg.error is None and bytes(msg.frames[0]) == b"fine"
    ch.close()


def test_what_is_not_a_message_closes_only_its_connection(loop):
    bad = socket.create_connection(("127.0.0.1", int(loop.listener.endpoint.rsplit(":", 1)[1])))
    good = connect(loop)
    bad.sendall(struct.pack("<I", transport.MAX_FRAME_COUNT + 1))
    assert "not a pyggml peer" in loop.next(Disconnected).reason
    good.send([b"still here"], timeout=5)
    assert bytes(loop.next(Message).frames[0]) == b"still here"
    bad.close(), good.close()


def connect_from(loop: Loop, source: str) -> socket.socket:
    """A plain connection from another address of the loopback network (127.0.0.0/8 is all ours)."""
    sock = socket.socket()
    sock.bind((source, 0))
    sock.connect(("127.0.0.1", int(loop.listener.endpoint.rsplit(":", 1)[1])))
    return sock


def closed_by_server(sock: socket.socket) -> bool:
    sock.settimeout(5)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def test_a_full_listener_gives_the_slot_of_the_oldest_silent_connection_and_closes_silent_ones(loop, monkeypatch):
    silent = [connect_from(loop, f"127.0.0.{i + 2}") for i in range(4)]  # (4 slots, 4 addresses)
    time.sleep(0.1)
    newcomer = connect(loop)
    first = loop.next(Disconnected)
    assert "had not said HELLO" in first.reason and first.peer.host == "127.0.0.2"
    assert closed_by_server(silent[0])
    newcomer.send([b"in"], timeout=5)
    assert bytes(loop.next(Message).frames[0]) == b"in"
    assert len(loop.listener.peers) == 4
    monkeypatch.setattr(transport, "GREETING_TIMEOUT_S", 0.3)
    reasons = [loop.next(Disconnected).reason for _ in range(4)]  # the newcomer too: it never said HELLO
    assert all("no HELLO" in r for r in reasons)
    for sock in silent:
        sock.close()
    newcomer.close()


def test_slots_are_bounded_per_address_and_in_all_when_every_session_holds_something():
    listener = Listener("127.0.0.1", 0, None, max_frames=4, max_bytes=1 << 20, max_peers=3, max_per_address=2,
                        holds=lambda peer: True)
    loop = Loop(listener)
    loop.start()
    try:
        mine = [connect(loop) for _ in range(2)]
        assert closed_by_server(connect(loop).sock)  # a third from 127.0.0.1
        other = connect_from(loop, "127.0.0.2")  # another address gets in
        other.sendall(transport.message_head([memoryview(b"x")]) + b"x")
        assert loop.next(Message).peer.host == "127.0.0.2"
        for peer in listener.peers.values():
            peer.greeted = True  # said HELLO, and (holds) each holds buffers: nothing to give up
        assert closed_by_server(connect_from(loop, "127.0.0.3"))
        assert len(listener.peers) == 3
        for ch in mine:
            ch.close()
        other.close()
    finally:
        loop.stop.set()
        loop.join()
        listener.close()


def test_a_session_that_holds_nothing_is_closed_when_idle(monkeypatch):
    held = {"yes": False}
    listener = Listener("127.0.0.1", 0, None, max_frames=4, max_bytes=1 << 20, idle_timeout=0.5,
                        holds=lambda peer: held["yes"])
    loop = Loop(listener)
    loop.start()
    try:
        ch = connect(loop)
        ch.send([b"hello"], timeout=5)
        peer = loop.next(Message).peer
        peer.greeted = True
        held["yes"] = True
        time.sleep(1.0)
        assert not peer.closed  # it holds something: kept however idle
        held["yes"] = False
        assert "idle" in loop.next(Disconnected, timeout=3).reason
        ch.close()
    finally:
        loop.stop.set()
        loop.join()
        listener.close()


def test_heartbeats_go_to_peers_that_wait_and_only_to_them(loop):
    waiting, idle = connect(loop), connect(loop)
    waiting.send([b"waiting"], timeout=5)
    idle.send([b"idle"], timeout=5)
    peers = {bytes(m.frames[0]): m.peer for m in (loop.next(Message), loop.next(Message))}
    for peer in loop.listener.peers.values():
        peer.greeted = True
    loop.listener.start_heartbeats()
    loop.listener.serving = peers[b"waiting"]
    waiting.sock.settimeout(3)
    assert waiting.sock.recv(4) == COUNT.pack(0)
    idle.sock.settimeout(2.5)
    with pytest.raises(TimeoutError):
        idle.sock.recv(4)
    loop.listener.serving = None
    waiting.close(), idle.close()


def test_a_peer_that_reads_nothing_is_told_apart_by_its_unsent_replies(loop):
    ch = connect(loop)
    ch.send([b"req"], timeout=5)
    peer = loop.next(Message).peer
    big = bytes(8 << 20)  # more than the kernel's buffers take
    results = [loop.listener.send(peer, [b"r", big]) for _ in range(loop.listener.max_queued + 2)]
    assert results[0] and not results[-1]
    ch.close()


@pytest.mark.skipif(shutil.which("openssl") is None, reason="making TLS keys needs the openssl command")
def test_tls_both_ways_and_a_stranger_refused(tmp_path):
    server_file, client_file = keys.generate(tmp_path / "k")
    other_server, other_client = keys.generate(tmp_path / "other")
    listener = Listener("127.0.0.1", 0, keys.context(server_file, server_side=True), max_frames=4,
                        max_bytes=1 << 20)
    loop = Loop(listener)
    loop.start()
    try:
        port = int(listener.endpoint.rsplit(":", 1)[1])
        ch = Channel.connect("127.0.0.1", port, keys.context(client_file, server_side=False), 5)
        payload = bytes(range(256)) * 400  # several TLS records
        ch.send([b"hello", payload], timeout=5)
        msg = loop.next(Message)
        assert [bytes(f) for f in msg.frames] == [b"hello", payload]
        assert listener.send(msg.peer, [b"back", payload])
        assert [bytes(f) for f in ch.recv(time.monotonic() + 5)] == [b"back", payload]
        ch.close()
        with pytest.raises((OSError, transport.Closed)):  # another pair's client key
            stranger = Channel.connect("127.0.0.1", port, keys.context(other_client, server_side=False), 5)
            stranger.send([b"hello"], timeout=5)
            stranger.recv(time.monotonic() + 5)
        with pytest.raises(OSError):  # the other pair's server is not ours: the client refuses it
            other = Listener("127.0.0.1", 0, keys.context(other_server, server_side=True), 4, 1 << 20)
            other_loop = Loop(other)
            other_loop.start()
            try:
                Channel.connect("127.0.0.1", int(other.endpoint.rsplit(":", 1)[1]),
                                keys.context(client_file, server_side=False), 5)
            finally:
                other_loop.stop.set()
                other_loop.join()
                other.close()
    finally:
        loop.stop.set()
        loop.join()
        listener.close()
