"""Fixtures of the RPC tests only (those the other folders share are in tests/conftest.py)."""
from __future__ import annotations

import pytest

from tests.rpc.rpc_helpers import ServerProcess


@pytest.fixture(scope="session")
def zmq_rpc_pair():
    """Two servers on the ZeroMQ transport (``zmq://`` endpoints)."""
    servers = [ServerProcess("--transport", "zmq") for _ in range(2)]
    yield servers
    for s in servers:
        s.stop()
