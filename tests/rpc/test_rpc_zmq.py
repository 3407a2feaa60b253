"""The ZeroMQ transport (``--transport zmq``, ``zmq://`` endpoints): CurveZMQ keys that admit only
their client, no server off loopback without them, the routing-id sequence that aborted a
ZeroMQ server refused, and handshakes at a bounded rate.  (Real models over two ZeroMQ servers,
and failover, run in test_rpc_models.py and test_failover.py for both transports.)"""
from __future__ import annotations

import ctypes
import subprocess
import sys
import time

import pytest
import zmq

from pyggml.rpc import RPCError, connect, keys, load_key
from pyggml.rpc import protocol as P

from tests.rpc.rpc_helpers import assert_keyed_model_is_exact


@pytest.fixture(scope="module")
def key_pair(tmp_path_factory):
    folder = tmp_path_factory.mktemp("zmq-keys")
    return keys.generate(folder / "k")


def test_curve_admits_its_client_key_and_refuses_a_wrong_key_and_a_plain_client(start_server, key_pair, tmp_path):
    server_key, client_key = key_pair
    server = start_server("--transport", "zmq", "--key", str(server_key))
    assert "CurveZMQ on" in server.banner[0]
    assert_keyed_model_is_exact(server.endpoint, client_key)
    with pytest.raises(RPCError, match="refused this client"):
        connect(server.endpoint, connect_timeout=3)  # no key: plain ZeroMQ
    _, other_client = keys.generate(tmp_path / "other")
    with pytest.raises(RPCError, match="refused this client"):
        connect(server.endpoint, key=load_key(other_client), connect_timeout=3)
    assert server.alive()
    connect(server.endpoint, key=load_key(client_key), connect_timeout=3)  # and it still serves


REFUSED_THEN_ADMITTED = """
import sys
from pyggml.rpc import RPCError, connect, load_key
endpoint, right, wrong = sys.argv[1:]
for round in range(60):
    for key in (None, load_key(wrong)):
        try:
            connect(endpoint, key=key, connect_timeout=3)
            sys.exit("admitted without the key")
        except RPCError as e:
            if "refused this client" not in str(e):
                sys.exit(f"round {round}: {e}")
    try:
        connect(endpoint, key=load_key(right), connect_timeout=3)
    except RPCError as e:
        sys.exit(f"round {round}: {e}")
print("60 rounds")
"""


def test_refused_clients_leave_the_client_process_able_to_connect(start_server, key_pair, tmp_path):
    """A channel closed after its handshake failed closed its monitor under libzmq's I/O thread,
    which then blocked for ever on the next event, and with it every later ZeroMQ connection of
    the client's process: the CI run's keyed tests all hung after a refusal.  (A process of its
    own: how soon it shows depends on when the dropped connections are collected.)"""
    server_key, client_key = key_pair
    server = start_server("--transport", "zmq", "--key", str(server_key))
    _, other_client = keys.generate(tmp_path / "other")
    r = subprocess.run([sys.executable, "-c", REFUSED_THEN_ADMITTED, server.endpoint, str(client_key),
                        str(other_client)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "60 rounds" in r.stdout, r.stderr[-2000:]


def test_zmq_off_loopback_needs_a_key():
    r = subprocess.run([sys.executable, "-m", "pyggml.cli.rpc_server", "--transport", "zmq", "-H", "0.0.0.0",
                        "-p", "0"], capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "needs --key" in r.stderr


def unseeded_routing_ids(n: int, sockets: int = 3) -> list[bytes]:
    """The ids a ROUTER hands out when C's rand() was never seeded: a zero byte, then a 32-bit
    counter from ``rand() | rand() << 31`` - glibc's first two draws for the first ROUTER (or
    REP) a process makes, the next two for the second...: ``n`` from each of the first ``sockets``."""
    libc = ctypes.CDLL(None)
    libc.srand(1)  # glibc's rand() unseeded is rand() seeded with 1
    ids = []
    for _ in range(sockets):
        low, high = libc.rand(), libc.rand()
        start = (low | (high << 31)) & 0xFFFFFFFF
        ids += [b"\0" + ((start + i) & 0xFFFFFFFF).to_bytes(4, "big") for i in range(n)]
    return ids


def claimers(endpoint: str, ids: list[bytes], curve: keys.CurveKeys | None) -> list[zmq.Socket]:
    ctx = zmq.Context.instance()
    out = []
    for rid in ids:
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        if rid:
            s.setsockopt(zmq.ROUTING_ID, rid)
        if curve is not None:
            s.curve_secretkey, s.curve_publickey, s.curve_serverkey = curve.secret, curve.public, curve.peer
        s.connect(endpoint.replace("zmq://", "tcp://"))
        try:  # (never waits: a connection refused at the handshake leaves a DEALER with no peer, where a
            # blocking send would wait for ever; the connection's claim is what counts, not the message)
            s.send_multipart([P.HEADER.pack(P.Command.HELLO, 0, 0, 1) + P.HELLO.pack(P.MAGIC, P.PROTOCOL_VERSION)],
                             flags=zmq.NOBLOCK)
        except zmq.Again:
            pass
        out.append(s)
    return out


def test_the_routing_id_sequence_cannot_abort_a_keyed_server(start_server, key_pair):
    """300 connections claiming the ids an unseeded libzmq hands out next, then anonymous ones,
    aborted a ZeroMQ server.  Without the key they are refused at the handshake; with it, the
    ids they claim are not the ones this server hands out (rand() is seeded); the server lives,
    and serves its client."""
    server_key, client_key = key_pair
    server = start_server("--transport", "zmq", "--key", str(server_key))
    ids = unseeded_routing_ids(100)
    anonymous = claimers(server.endpoint, ids, None)  # no key at all
    time.sleep(1.0)
    for s in anonymous:
        assert not s.poll(0)  # nothing answered: refused at the handshake
    holder = keys.curve(client_key)
    holders = claimers(server.endpoint, unseeded_routing_ids(20), holder)  # a key holder, within the ZAP rate
    time.sleep(0.5)
    try:
        for _ in range(5):  # fresh anonymous-id clients, which libzmq numbers itself
            conn = connect(server.endpoint, key=load_key(client_key), connect_timeout=10)[0].conn
            conn.request(P.Command.DEVICE_COUNT)
            conn.close()
        assert server.alive()
    finally:
        for s in anonymous + holders:
            s.close(linger=0)


def test_handshakes_are_admitted_at_a_bounded_rate(start_server, key_pair):
    """Even a key holder cannot sweep libzmq's counter quickly: the ZAP handler admits a burst of
    64 handshakes, then 20 a second (those refused try again, as ZeroMQ does)."""
    from pyggml.rpc import zmq_transport
    server_key, client_key = key_pair
    server = start_server("--transport", "zmq", "--key", str(server_key))
    holder = keys.curve(client_key)
    t0 = time.monotonic()
    many = claimers(server.endpoint, [b""] * 150, holder)  # (an empty id: libzmq numbers them)
    try:
        time.sleep(1.0)
        answered = sum(1 for s in many if s.poll(0))
        elapsed = time.monotonic() - t0
        assert 20 <= answered <= zmq_transport.ZAP_BURST + zmq_transport.ZAP_PER_S * elapsed + 5, answered
        assert server.alive()
    finally:
        for s in many:
            s.close(linger=0)
