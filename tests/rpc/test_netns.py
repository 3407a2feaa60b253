"""The cluster across two network namespaces joined by a veth pair: the client here, the
servers there, bound to their namespace's address - placement, weights from the servers'
disks, and failover over a real (virtual) link rather than loopback."""
from __future__ import annotations

import numpy as np
import pytest

import pyggml as pg
from pyggml.models import hub

from tests.conftest import shared_model
from tests.rpc.rpc_helpers import HostedServers, namespaces_or_skip, network_namespace


@pytest.fixture(scope="module")
def netns():
    """(namespace name, the servers' address); skipped where namespaces cannot be made."""
    yield from namespaces_or_skip(network_namespace)


@pytest.fixture
def remote(netns):
    """Start servers in the other namespace; all are stopped afterwards."""
    servers = HostedServers()
    yield lambda *args: servers.start(*netns, *args)
    servers.stop()


def test_auto_placement_and_disk_weights_across_namespaces(remote):
    path = hub.resolve("smollm2")
    servers = [remote("--mem", "100M", "--gguf", str(path)), remote("--mem", "300M", "--gguf", str(path))]
    assert all(s.endpoint.startswith("10.77.") for s in servers)
    with pg.Model(path, n_ctx=256, rpc=[s.endpoint for s in servers], progress=False, place_by="memory") as m:
        layers = m.model.placement.layers
        assert 0 < layers.count(0) < layers.count(1)
        sent = sum(d.conn.bytes_sent for d in m.rpc_devices)
        assert sent < 0.01 * m.model.weights_nbytes()
        ids = m.tokenize("The capital of France is")
        assert np.array_equal(m.logits(ids), shared_model("smollm2").logits(ids))


@pytest.mark.parametrize("alias", ["smollm2", "gemma3-270m"])
def test_failover_across_namespaces(remote, alias):
    local = shared_model(alias)
    local.context.clear()  # the prompt read in one call, as the fresh model reads it
    ids = local.tokenize("Once upon a time, in a land far away,")
    want = list(local.generate(ids, max_tokens=24, temperature=0))
    servers = [remote(), remote()]
    with pg.Model(alias, n_ctx=256, rpc=[s.endpoint for s in servers], progress=False, failover=True) as m:
        got = []
        for i, token in enumerate(m.generate(ids, max_tokens=24, temperature=0)):
            got.append(token)
            if i == 6:
                servers[0].kill()
        assert got == want
