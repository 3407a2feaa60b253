"""Steps kept on the servers: a decoding step's requests sent once, then run by one request.

Why: a tensor split (models/tensor_split.py) computes each layer in a few small graphs per
server with activations passed between the servers after each: about ten requests per layer
and server, every step - GRAPH_RECOMPUTE, COPY_TO_PEER, WAIT_PEER.  Sent one by one they cost
the client more time than the servers spend computing, and keep the servers waiting for it.
Yet they are the same requests every step: only the inputs (token, position, mask) change, and
those go to each server before its first graph.

So the scheduler records the second run of a graph (the first may still send graphs and make
links), and each server keeps its share as step N (``STEP_STORE``).  From then on a step is the
inputs' SET_TENSORs and one ``STEP_RUN`` per server: the server serves the kept requests as if
they had just come, each checked as it runs, a WAIT_PEER holding the rest until its tensor
arrived.  The client sends one request per server per step, as it does for one device.

A kept step names graph slots: it is run only while each still holds the graph it held when
recorded (:meth:`KeptStep.valid`); else the scheduler runs the graph request by request again,
and records it anew.  The peer tags recorded are used again every step: a step's tensors are
all written before the next step's can come (each server reads its tensors in order).
"""
from __future__ import annotations

from dataclasses import dataclass

from . import protocol as P
from .protocol import Command


@dataclass
class KeptStep:
    """One server's share of a recorded step: its number there, the graph slots it runs and
    what each held when recorded, and the connection's error count then."""
    number: int
    slots: dict[int, int]  # slot -> its generation
    errors: int
    serial: int  # steps kept on the connection when this one was: MAX_STEPS later, its number is another's


def encode(requests: list[tuple[Command, bytes]]) -> bytes:
    """STEP_STORE's frame: each request's command, payload length and payload."""
    return b"".join(P.STEP_ENTRY.pack(cmd, len(payload)) + payload for cmd, payload in requests)


def slots_of(requests: list[tuple[Command, bytes]]) -> set[int]:
    """The graph slots a step's GRAPH_RECOMPUTEs run."""
    return {P.RECOMPUTE.unpack(payload)[1] for cmd, payload in requests if cmd == Command.GRAPH_RECOMPUTE}
