"""Real RPC server processes for tests, and a raw client that can send any bytes."""
from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import socket
import time
from contextlib import contextmanager

from pyggml.rpc import protocol as P
from pyggml.rpc import transport


def _server_log(path: str | os.PathLike | None = None):
    """Servers' stderr: into ``path``, else discarded, or appended to $PYGGML_TEST_SERVER_LOG when
    debugging."""
    path = path or os.environ.get("PYGGML_TEST_SERVER_LOG")
    return open(path, "a") if path else subprocess.DEVNULL


class NamespaceUnavailable(RuntimeError):
    """Network namespaces cannot be made here (not root, no iproute2): the reason."""


def _ip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)


@contextmanager
def network_namespace(rate: str | None = None):
    """Another host, for servers: a network namespace joined to this one by a veth pair, each
    end shaped to ``rate`` (tc's tbf, e.g. "100mbit") if given.  Yields (the namespace's name,
    its address); servers started with ``ServerProcess("-H", address, prefix=("ip", "netns",
    "exec", name))`` are reached only over the pair.  Raises NamespaceUnavailable with the
    reason where it cannot be made."""
    subnet = 10 + os.getpid() % 200  # 10.77.SUBNET.0/24: unique enough for parallel runs
    name, veth = f"pyggml-{os.getpid()}", f"pg{os.getpid() % 100000}"
    r = _ip("netns", "add", name)
    if r.returncode != 0:
        raise NamespaceUnavailable(f"cannot create network namespaces here (needs root and iproute2): "
                                   f"{r.stderr.strip()}")
    try:
        inside = ("netns", "exec", name)
        steps = [("link", "add", f"{veth}c", "type", "veth", "peer", "name", f"{veth}s"),
                 ("link", "set", f"{veth}s", "netns", name),
                 ("addr", "add", f"10.77.{subnet}.1/24", "dev", f"{veth}c"),
                 ("link", "set", f"{veth}c", "up"),
                 (*inside, "ip", "addr", "add", f"10.77.{subnet}.2/24", "dev", f"{veth}s"),
                 (*inside, "ip", "link", "set", f"{veth}s", "up"),
                 (*inside, "ip", "link", "set", "lo", "up")]
        for step in steps:
            r = _ip(*step)
            if r.returncode != 0:
                raise NamespaceUnavailable(f"cannot set up the veth pair: ip {' '.join(step)}: {r.stderr.strip()}")
        if rate:
            _shape(veth, name, rate)
        yield name, f"10.77.{subnet}.2"
    finally:
        _ip("link", "del", f"{veth}c")
        _ip("netns", "del", name)


def _shape(veth: str, namespace: str, rate: str) -> None:
    """Both ends of a veth pair (``veth``c here, ``veth``s in ``namespace``) shaped to ``rate``
    (tc's tbf, e.g. "1gbit"): traffic each way goes through one of them."""
    shape = ["root", "tbf", "rate", rate, "burst", "256kb", "latency", "100ms"]
    for cmd in (["tc", "qdisc", "add", "dev", f"{veth}c", *shape],
                ["ip", "netns", "exec", namespace, "tc", "qdisc", "add", "dev", f"{veth}s", *shape]):
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
        if r.returncode != 0:
            raise NamespaceUnavailable(f"cannot shape the link to {rate}: {' '.join(cmd)}: {r.stderr.strip()}")


@contextmanager
def bridged_namespaces(n: int, rate: str | None = None):
    """``n`` other hosts on one LAN with this one: a network namespace each, joined to a bridge
    here by a veth pair (multicast flows over it, as mDNS needs), each pair shaped to ``rate``
    if given.  Yields [(namespace, its address)]; this namespace is on the bridge at .1.
    Raises NamespaceUnavailable with the reason where it cannot be made."""
    pid = os.getpid()
    subnet = 10 + pid % 200
    bridge = f"pgbr{pid % 100000}"
    r = _ip("link", "add", bridge, "type", "bridge", "mcast_snooping", "0")
    if r.returncode != 0:
        raise NamespaceUnavailable(f"cannot create a bridge here (needs root and iproute2): {r.stderr.strip()}")
    made: list[tuple[str, str]] = []
    try:
        for step in [("addr", "add", f"10.78.{subnet}.1/24", "dev", bridge), ("link", "set", bridge, "up")]:
            r = _ip(*step)
            if r.returncode != 0:
                raise NamespaceUnavailable(f"cannot set up the bridge: ip {' '.join(step)}: {r.stderr.strip()}")
        for i in range(n):
            name, veth, addr = f"pyggml-{pid}-{i}", f"pb{pid % 10000}x{i}", f"10.78.{subnet}.{i + 2}"
            r = _ip("netns", "add", name)
            if r.returncode != 0:
                raise NamespaceUnavailable(f"cannot create network namespaces here: {r.stderr.strip()}")
            made.append((name, veth))
            inside = ("netns", "exec", name, "ip")
            for step in [("link", "add", f"{veth}c", "type", "veth", "peer", "name", f"{veth}s"),
                         ("link", "set", f"{veth}s", "netns", name),
                         ("link", "set", f"{veth}c", "master", bridge), ("link", "set", f"{veth}c", "up"),
                         (*inside, "addr", "add", f"{addr}/24", "dev", f"{veth}s"),
                         (*inside, "link", "set", f"{veth}s", "up"), (*inside, "link", "set", "lo", "up"),
                         # mDNS is sent to 224.0.0.251: a route for it, as a LAN's default route gives
                         (*inside, "route", "add", "224.0.0.0/4", "dev", f"{veth}s")]:
                r = _ip(*step)
                if r.returncode != 0:
                    raise NamespaceUnavailable(f"cannot join namespace {i} to the bridge: ip {' '.join(step)}: "
                                               f"{r.stderr.strip()}")
            if rate:
                _shape(veth, name, rate)
        yield [(name, f"10.78.{subnet}.{i + 2}") for i, (name, _) in enumerate(made)]
    finally:
        for name, veth in made:
            _ip("link", "del", f"{veth}c")
            _ip("netns", "del", name)
        _ip("link", "del", bridge)


def namespaces_or_skip(make):
    """A fixture's body: yield what the context manager ``make()`` gives (network namespaces),
    or skip, saying why, where they cannot be made."""
    import pytest
    try:
        with make() as made:
            yield made
    except NamespaceUnavailable as e:
        pytest.skip(str(e))


class HostedServers:
    """Servers started on other hosts (network namespaces), each ``start(namespace, address,
    *args)``; ``stop()`` stops them all (a fixture's teardown)."""

    def __init__(self) -> None:
        self.started: list[ServerProcess] = []

    def start(self, namespace: str, address: str, *args: str) -> ServerProcess:
        s = ServerProcess("-H", address, *args, prefix=("ip", "netns", "exec", namespace))
        self.started.append(s)
        return s

    def stop(self) -> None:
        for s in self.started:
            s.stop()


class ServerProcess:
    """``pyggml-rpc-server`` on a free port of 127.0.0.1 (the server picks it and prints it)."""

    def __init__(self, *args: str, env: dict | None = None, log: str | os.PathLike | None = None,
                 prefix: tuple[str, ...] = ()) -> None:
        # prefix: what runs the server, e.g. ("ip", "netns", "exec", NAME) for another network namespace
        # several servers share a test machine's cores: they busy-wait little (--poll)
        poll = () if any(a.startswith("--poll") for a in args) else ("--poll", "3")
        self.proc = subprocess.Popen([*prefix, sys.executable, "-m", "pyggml.cli.rpc_server", "-p", "0", *poll,
                                      *args], stdout=subprocess.PIPE, stderr=_server_log(log),
                                     env={**os.environ, **(env or {})})
        self.banner = self._read_banner(180)  # a first start on a machine compiles the kernels first
        first = self.banner[0]
        scheme = "zmq://" if "zmq://" in first else "tcp://"
        self.endpoint = first.split(scheme, 1)[1].split(",", 1)[0]
        if scheme == "zmq://":  # (clients name the ZeroMQ transport by its scheme)
            self.endpoint = "zmq://" + self.endpoint

    def _read_banner(self, timeout: float) -> list[str]:
        """The lines printed on start, up to the blank line that ends them."""
        text = b""
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and b"\n\n" not in text:
            ready, _, _ = select.select([fd], [], [], 0.5)
            if ready:
                chunk = os.read(fd, 4096)
                if not chunk:
                    break
                text += chunk
            elif self.proc.poll() is not None:
                break
        if b"\n\n" in text:
            return text.decode().split("\n\n", 1)[0].splitlines()
        self.proc.kill()
        raise RuntimeError(f"server did not start: {text.decode()!r}")

    @property
    def port(self) -> int:  # (of either transport)
        return int(self.endpoint.rsplit(":", 1)[1])

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.alive():
            self.proc.send_signal(sig)

    def stop(self) -> None:
        """SIGTERM; a server that clients still use waits for them to move (leaving), so a
        second SIGTERM after a moment: that one exits at once."""
        if self.alive():
            self.proc.send_signal(signal.SIGCONT)
            self.proc.terminate()
            try:
                self.proc.wait(0.3)
                return
            except subprocess.TimeoutExpired:
                self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


class RawClient:
    """A plain TCP connection that speaks the protocol by hand, to send crafted requests."""

    def __init__(self, endpoint: str, hello: bool = True, source: str | None = None) -> None:
        # source: another address of the loopback network (127.0.0.0/8), to come from another host
        host, _, port = endpoint.rpartition(":")
        self.sock = socket.create_connection((host, int(port)), timeout=5,
                                             source_address=(source, 0) if source else None)
        self.channel = transport.Channel(self.sock)
        self.seq = 0
        if hello:
            status, body, _ = self.call(P.Command.HELLO, P.HELLO.pack(P.MAGIC, P.PROTOCOL_VERSION))
            assert status == P.Status.OK, body

    def send_raw(self, frames: list[bytes]) -> None:
        """One message of these frames, framed as the transport does."""
        self.send_bytes(transport.message_head([memoryview(f) for f in frames]) + b"".join(frames))

    def send_bytes(self, data: bytes) -> None:
        self.sock.settimeout(5)
        self.sock.sendall(data)

    def recv(self, timeout: float = 10.0) -> tuple[int, bytes, list[bytes]] | None:
        """The next reply (heartbeats skipped), or None if none comes within ``timeout`` or the
        server closed the connection."""
        try:
            parts = self.channel.recv(time.monotonic() + timeout, silence=timeout)
        except (TimeoutError, transport.Closed, OSError):
            return None
        status = P.HEADER.unpack_from(parts[0])[0]
        return status, bytes(parts[0][P.HEADER.size:]), [bytes(p) for p in parts[1:]]

    def call(self, cmd: int, payload: bytes = b"", frames: list[bytes] = (), timeout: float = 10.0):
        self.seq += 1
        self.send_raw([P.HEADER.pack(cmd, 0, 0, self.seq) + payload, *frames])
        reply = self.recv(timeout)
        assert reply is not None, f"no reply to command {cmd}"
        return reply

    def close(self) -> None:
        self.sock.close()


def tensor(type: int = 0, ne=(16, 1, 1, 1), nb=None, buffer: int = 0, offset: int = 0, op: int = 0,
           src=(), id: int = 1, name: str = "t", op_params=(), view_src: int = 0) -> bytes:
    """A wire tensor with every field under the test's control."""
    from pyggml.types import Type
    if nb is None:
        t = Type(type)
        nb0 = t.type_size
        nb1 = nb0 * (ne[0] // t.block_size)
        nb = (nb0, nb1, nb1 * ne[1], nb1 * ne[1] * ne[2])
    params = tuple(op_params) + (0,) * (P.MAX_OP_PARAMS - len(op_params))
    src = tuple(src) + (0,) * (P.MAX_SRC - len(src))
    return P.WireTensor(id, type, op, buffer, tuple(ne), tuple(nb), params, 0, src, view_src, 0, offset, name).pack()


# -- llama.cpp's own tools (../shared/bin/build-llamacpp), for the ggml-rpc tests -----------------

LLAMACPP_BIN = os.path.expanduser(os.environ.get("PYGGML_LLAMACPP_BIN", "~/.cache/llama.cpp-ref/build/bin"))


def llamacpp_tool(name: str) -> str:
    """The path of one of llama.cpp's binaries, or a skip saying how to build them."""
    import pytest
    path = os.path.join(LLAMACPP_BIN, name)
    if not os.access(path, os.X_OK):
        pytest.skip(f"llama.cpp's {name} is not built here ({path}): run ../shared/bin/build-llamacpp "
                    f"(or set PYGGML_LLAMACPP_BIN)")
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LlamaRpcServer:
    """llama.cpp's ``ggml-rpc-server`` (CPU, one thread) on a free port of 127.0.0.1."""

    def __init__(self, threads: int = 1) -> None:
        self.port = free_port()
        self.proc = subprocess.Popen([llamacpp_tool("ggml-rpc-server"), "-H", "127.0.0.1", "-p", str(self.port),
                                      "-t", str(threads)], stdout=subprocess.DEVNULL, stderr=_server_log())
        self.endpoint = f"ggml://127.0.0.1:{self.port}"
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return
            except OSError:
                if self.proc.poll() is not None:
                    break
                time.sleep(0.1)
        self.proc.kill()
        raise RuntimeError("llama.cpp's ggml-rpc-server did not start")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        if self.alive():
            self.proc.kill()
        self.proc.wait(10)

    stop = kill


def assert_keyed_model_is_exact(endpoint: str, client_key) -> None:
    """SmolLM2 over the keyed server at ``endpoint`` (TLS or CurveZMQ) gives the local logits."""
    import numpy as np

    import pyggml as pg
    from tests.conftest import shared_model
    with pg.Model("smollm2", n_ctx=64, rpc=endpoint, rpc_key=str(client_key), ngl="all", progress=False) as m:
        ids = m.tokenize("Secret")
        assert np.array_equal(m.logits(ids), shared_model("smollm2").logits(ids))
