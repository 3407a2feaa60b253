"""pyggml.rpc: remote devices over TCP, as ggml-rpc does for llama.cpp.

- :mod:`.protocol` - the wire format (struct-packed, versioned, nothing pickled)
- :mod:`.transport` - messages over TCP, connections named by the server, heartbeats, bounds
- :mod:`.zmq_transport` - the same messages over ZeroMQ (``--transport zmq``, ``zmq://``)
- :mod:`.keys` - TLS and CurveZMQ keys (``--gen-key``)
- :mod:`.peers` - servers passing tensors to each other, and where they may link
- :mod:`.server` - :class:`RPCServer`, behind ``pyggml-rpc-server``
- :mod:`.backend` - :class:`RPCDevice` / buffer type / buffer / backend for clients
- :mod:`.validate` - what the server checks before touching memory
- :mod:`.cache` - the server's tensor cache
"""
from __future__ import annotations

from .backend import RPCBackend, RPCBuffer, RPCBufferType, RPCDevice, connect
from .client import Connection, load_key
from .protocol import PROTOCOL_VERSION, ProtocolError, RPCError, ServerLeaving, parse_endpoint, parse_endpoints

__all__ = ["PROTOCOL_VERSION", "Connection", "ProtocolError", "RPCBackend", "RPCBuffer", "RPCBufferType",
           "RPCDevice", "RPCError", "ServerLeaving", "connect", "load_key", "parse_endpoint", "parse_endpoints"]
