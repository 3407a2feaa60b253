"""Servers that pass tensors to each other: a split's input goes from the server that computed
it straight to the server that needs it, not through the client.

The client introduces two servers.  Server B, the receiver, gives the client a one-time token
for the client's session on B (``PEER_TOKEN``); the client asks server A, the sender, to connect
to B and present it (``PEER_CONNECT``, then A's ``PEER_AUTH`` on its new connection).  So B lets
in one connection per token, which can do nothing but write tensors of that one session
(``PEER_SET``), and A connects only where a client of its own asks it to (and not at all when it
was started with ``--no-peers``).  With TLS, A connects with its own key file: its certificate
is signed by the same authority, for both ends of a connection.

Each step the client tells A to send a tensor over the link, with a tag (``COPY_TO_PEER``, in
order after A's compute on the same connection), and tells B to hold that session's following
requests until the tag has arrived (``WAIT_PEER``).  B writes a tensor only when the client's
own requests reach its WAIT_PEER - a tensor that comes earlier is kept until then - because A
may run ahead: the ubatches of a long prompt go out without waiting, and A's second ubatch can
reach B before B computed the first.  Neither server waits on the other: A's send
does not block on B, and B keeps serving every other connection while a session waits - so two
servers that send each other tensors within one step cannot deadlock, and the client waits only
for the step's result.  A tag that never comes ends the wait after ``PEER_WAIT_S`` with an error
for the client's next reply.

A client's PEER_CONNECT makes this server open a TCP connection, so it is bounded like any
request (:class:`LinkPolicy`): only to numeric addresses on the server's own networks by default
(loopback when it is bound to loopback; ``--peer-allow`` widens that), a few at a time and a few
per second server-wide, within ``LINK_TIMEOUT_S``, and every failure - refused, closed, silent,
not a pyggml server, a refused token - gets the same answer, so that the error cannot map the
ports of the server's network.  The connection runs in the server's loop (transport.Listener.dial):
it never keeps other clients waiting.
"""
from __future__ import annotations

import fcntl
import ipaddress
import os
import secrets
import socket
import struct
import time
from dataclasses import dataclass, field

from .protocol import TOKEN_BYTES

PEER_WAIT_S = float(os.environ.get("PYGGML_RPC_PEER_WAIT", "30"))  # a session's longest wait for a tagged tensor
TOKEN_TTL_S = 60.0       # a token not presented by then is forgotten
MAX_TOKENS = 16          # live tokens per session
MAX_LINKS = 8            # links a session may have its server open to others
MAX_HELD = 4096          # requests a waiting session may have held (a prompt's micro-batches queue up) ...
MAX_HELD_BYTES = 256 << 20  # ... and their bytes
MAX_ARRIVED = 1024       # tagged tensors kept before their WAIT_PEER comes ...
MAX_ARRIVED_BYTES = 64 << 20  # ... and their bytes (or as many as the session holds in buffers)
HELD_FREE_BYTES = 4 << 20  # what a session that holds few buffers may have held or kept anyway
LINK_TIMEOUT_S = 5.0     # connect, handshake, HELLO and PEER_AUTH of a new link, together
LINK_QUEUE_BYTES = 256 << 20  # bytes waiting to be sent over one link (or what its session holds)
MAX_DIALS = 16           # links being made at once, server-wide ...
DIALS_PER_S = 4.0        # ... and how fast new ones may start (a burst of MAX_DIALS)
LINK_FAILED = "cannot link to {endpoint}"  # one answer for every way a link can fail


@dataclass
class Tokens:
    """One-time tokens, each for one session of this server."""
    issued: dict[bytes, tuple[int, float]] = field(default_factory=dict)  # token -> (session, deadline)

    def issue(self, session: int) -> bytes:
        now = time.monotonic()
        self.issued = {t: v for t, v in self.issued.items() if v[1] > now}
        if sum(1 for s, _ in self.issued.values() if s == session) >= MAX_TOKENS:
            raise ValueError(f"this session holds {MAX_TOKENS} unused peer tokens, the limit")
        token = secrets.token_bytes(TOKEN_BYTES)
        self.issued[token] = (session, now + TOKEN_TTL_S)
        return token

    def take(self, token: bytes) -> int | None:
        """The session a token was issued for, once; None for a token unknown, used or expired."""
        entry = self.issued.pop(bytes(token), None)
        if entry is None or entry[1] < time.monotonic():
            return None
        return entry[0]

    def forget(self, session: int) -> None:
        self.issued = {t: v for t, v in self.issued.items() if v[0] != session}


Network = ipaddress.IPv4Network | ipaddress.IPv6Network


def interface_networks() -> list[Network]:
    """The networks of this host's interfaces (Linux: their IPv4 address and mask, and
    /proc/net/if_inet6); empty where they cannot be read."""
    nets: list[Network] = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            packed = struct.pack("256s", name.encode()[:15])
            try:
                addr = socket.inet_ntoa(fcntl.ioctl(s.fileno(), 0x8915, packed)[20:24])  # SIOCGIFADDR
                mask = socket.inet_ntoa(fcntl.ioctl(s.fileno(), 0x891B, packed)[20:24])  # SIOCGIFNETMASK
            except OSError:
                continue
            nets.append(ipaddress.ip_network(f"{addr}/{mask}", strict=False))
    try:
        with open("/proc/net/if_inet6") as f:
            for line in f:
                hexaddr, _, plen = line.split()[:3]
                addr = ipaddress.IPv6Address(bytes.fromhex(hexaddr))
                nets.append(ipaddress.ip_network(f"{addr}/{int(plen, 16)}", strict=False))
    except (OSError, ValueError):
        pass
    return nets


def own_networks(bound: str, interfaces: list[Network] | None = None) -> list[Network]:
    """Where a server bound to ``bound`` links by default: loopback when bound to loopback,
    the networks of the interface that has the address when bound to one, every interface's
    when bound to all."""
    loopback = [ipaddress.ip_network("127.0.0.0/8"), ipaddress.ip_network("::1/128")]
    try:
        ip = ipaddress.ip_address(bound.strip("[]"))
    except ValueError:
        ip = ipaddress.ip_address(socket.gethostbyname(bound))
    if ip.is_loopback:
        return loopback
    interfaces = interface_networks() if interfaces is None else interfaces
    if ip.is_unspecified:
        return loopback + [n for n in interfaces if not n.network_address.is_loopback]
    return [n for n in interfaces if ip in n] or [ipaddress.ip_network(ip)]


def parse_networks(spec: str) -> list[Network]:
    """``--peer-allow``: CIDR,CIDR,... (a bare address is its own /32 or /128)."""
    out = []
    for item in spec.replace(";", ",").split(","):
        if item.strip():
            try:
                out.append(ipaddress.ip_network(item.strip(), strict=False))
            except ValueError:
                raise ValueError(f"--peer-allow: {item.strip()!r} is not an address or a network like 10.0.0.0/24") from None
    return out


@dataclass
class LinkPolicy:
    """Where and how fast this server may link to other servers."""
    networks: list[Network]
    dialing: int = 0  # links being made now
    _tokens: float = float(MAX_DIALS)
    _refilled: float = field(default_factory=time.monotonic)

    def check(self, endpoint: str) -> tuple[str, int]:
        """(host, port) of a numeric endpoint on an allowed network; ValueError otherwise."""
        host, _, port = endpoint.rpartition(":")
        try:
            ip = ipaddress.ip_address(host.strip("[]"))
        except ValueError:
            raise ValueError(f"a link takes a numeric address, not {host!r}") from None
        if not any(ip in n for n in self.networks):
            raise ValueError(f"{ip} is not on this server's networks (widen them with --peer-allow)")
        return str(ip), int(port)

    def start(self) -> None:
        """A new link may start now (ValueError if too many are being made)."""
        now = time.monotonic()
        self._tokens = min(float(MAX_DIALS), self._tokens + (now - self._refilled) * DIALS_PER_S)
        self._refilled = now
        if self.dialing >= MAX_DIALS or self._tokens < 1:
            raise ValueError("too many links to other servers are being made on this server: try again shortly")
        self._tokens -= 1
        self.dialing += 1
