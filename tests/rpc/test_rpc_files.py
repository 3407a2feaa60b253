"""Weights from the server's own disk (``pyggml-rpc-server --gguf``): a client loading the
same file sends almost nothing, a server holding another version gets an upload, ranges
outside the file's tensors are refused, and a warm start hashes nothing."""
from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

import pyggml as pg
from pyggml.models import hub
from pyggml.rpc.file_identity import file_identity
from pyggml.gguf import GGUFFile
from pyggml.rpc import protocol as P
from pyggml.rpc.protocol import Command as C

from tests.conftest import shared_model
from tests.rpc.rpc_helpers import RawClient, tensor
from tests.rpc.test_rpc_validation import alloc


@pytest.fixture(scope="module")
def smollm2():
    return hub.resolve("smollm2")


def test_a_cold_start_sends_under_one_percent_of_the_weights(start_server, smollm2):
    server = start_server("--gguf", str(smollm2))
    assert any("holds" in line and smollm2.name in line for line in server.banner)
    with pg.Model(smollm2, n_ctx=256, rpc=server.endpoint, ngl="all", progress=False) as m:
        conn = m.rpc_devices[0].conn
        weights = m.model.weights_nbytes()
        assert conn.loaded["disk"] == weights and conn.loaded["wire"] == 0
        assert conn.bytes_sent < 0.01 * weights
        summary = next(b for b in m.model.buffers if hasattr(b, "load_summary")).load_summary()
        assert summary == f"{weights / 2**20:.0f} MiB from its disk, 0 from its cache, 0 sent"  # the bar's words
        ids = m.tokenize("The capital of France is")
        assert np.array_equal(m.logits(ids), shared_model("smollm2").logits(ids))


def test_another_version_of_the_file_is_uploaded_and_said_once(start_server, smollm2, tmp_path, caplog):
    other = tmp_path / smollm2.name  # the same name, one byte of one tensor's data changed
    shutil.copy(smollm2, other)
    info = GGUFFile(other).tensors["blk.0.ffn_down.weight"]
    with open(other, "r+b") as f:
        f.seek(info.offset + 100)
        b = f.read(1)
        f.seek(info.offset + 100)
        f.write(bytes([b[0] ^ 1]))
    server = start_server("--gguf", str(other))
    with caplog.at_level(logging.WARNING, logger="pyggml.rpc"):
        with pg.Model(smollm2, n_ctx=256, rpc=server.endpoint, ngl="all", progress=False) as m:
            conn = m.rpc_devices[0].conn
            assert conn.loaded["disk"] == 0 and conn.loaded["wire"] == m.model.weights_nbytes()
            ids = m.tokenize("Hello")
            assert np.array_equal(m.logits(ids), shared_model("smollm2").logits(ids))
    said = [r for r in caplog.records if "another version" in r.getMessage()]
    assert len(said) == 1 and smollm2.name in said[0].getMessage()


def test_ranges_outside_the_files_tensors_are_refused(start_server, smollm2):
    server = start_server("--gguf", str(smollm2))
    f = GGUFFile(smollm2)
    info = f.tensors["blk.0.attn_norm.weight"]  # F32 [576]: 2304 bytes
    identity = file_identity(smollm2)
    c = RawClient(server.endpoint)
    try:
        handle = alloc(c, 4096)
        t = tensor(0, (576, 1, 1, 1), buffer=handle)

        def fill(offset: int, size: int, file_offset: int, ident: bytes = identity):
            return c.call(C.SET_TENSOR_FILE, t + P.SET_TENSOR_FILE.pack(offset, size, ident, file_offset))
        assert fill(0, info.nbytes, info.offset)[0] == P.Status.OK
        first_data = min(x.offset for x in f.tensors.values())
        for offset, size, file_offset, words in [
            (0, 2304, 0, "not inside one tensor's data"),               # the header and metadata
            (0, 2304, first_data - 16, "not inside one tensor's data"),  # straddles the start of the data
            (0, 2304, f.file_size, "not inside one tensor's data"),      # past the end of the file
            (0, 2304, 2 ** 64 - 8, "not inside one tensor's data"),
            (0, 4096, info.offset, "outside tensor"),                    # more than the tensor holds
        ]:
            status, body, _ = fill(offset, size, file_offset)
            assert status == P.Status.ERROR and words in body.decode(), body
        status, body, _ = fill(0, 16, info.offset, b"\x00" * 32)
        assert status == P.Status.ERROR and "no file with that identity" in body.decode()
        assert server.alive() and c.call(C.DEVICE_COUNT)[0] == P.Status.OK
    finally:
        c.close()


def test_a_warm_start_hashes_nothing(tmp_path, smollm2):
    """The identity is remembered by path, size and modification time: a second process hashes
    nothing; touching the file makes it hash again."""
    env = {**os.environ, "PYGGML_CACHE": str(tmp_path)}
    code = ("import sys, pyggml.rpc.file_identity as f; d = f.file_identity(sys.argv[1]); "
            "print(f.hashed_files, d.hex())")

    def run():
        r = subprocess.run([sys.executable, "-c", code, str(copy)], env=env, capture_output=True, text=True,
                           timeout=120)
        assert r.returncode == 0, r.stderr
        return r.stdout.split()
    copy = tmp_path / "model.gguf"
    shutil.copy(smollm2, copy)
    first = run()
    assert first[0] == "1"
    assert run() == ["0", first[1]]
    os.utime(copy, ns=(1, 1))
    assert run() == ["1", first[1]]
