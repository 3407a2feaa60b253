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
"""
from __future__ import annotations

import os
import secrets
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
