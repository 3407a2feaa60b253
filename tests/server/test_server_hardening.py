"""pyggml-server against hostile or careless clients: each bad request gets its 4xx in OpenAI's
shape (never a 500), costly requests are bounded, a client that trickles its headers is cut
off, an empty --api-key refuses to start - and the server goes on serving after each."""
from __future__ import annotations

import socket
import subprocess
import sys
import time

import httpx
import pytest

from tests.server.test_server import served


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    yield from served(tmp_path_factory, "hardening.log", "-m", "smollm2", "-c", "512", "-np", "2",
                      "--header-timeout", "1")


def refused(r: httpx.Response, status: int, says: str) -> None:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["code"] == status and isinstance(err["type"], str) and says in err["message"], err


def still_serves(server) -> None:
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "The capital of France is", "max_tokens": 2,
                                                         "temperature": 0}, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2, r.text


def post(server, path: str, content: bytes | None = None, **kw) -> httpx.Response:
    headers = {"content-type": "application/json"}
    return httpx.post(server.url + path, content=content, headers=headers, timeout=60, **kw)


def test_an_empty_api_key_is_an_error_at_start():
    """An unset variable in a start script (--api-key "$KEY") must not turn the key off."""
    r = subprocess.run([sys.executable, "-m", "pyggml.cli.server", "-m", "smollm2", "--port", "0", "--api-key", ""],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "--api-key is empty" in r.stderr, r.stderr[-2000:]


def test_deeply_nested_json_is_a_400(server):
    deep = b"[" * 100_000 + b"]" * 100_000
    refused(post(server, "/v1/chat/completions", deep), 400, "nests too deeply")
    nested = b'{"messages": ' + b"[" * 5000 + b"]" * 5000 + b"}"
    r = post(server, "/v1/chat/completions", nested)
    assert r.status_code == 400 and r.json()["error"]["code"] == 400, r.text
    still_serves(server)


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi \\ud800 there"}], "max_tokens": 2}'),
    ("/v1/completions", b'{"prompt": "\\udfff", "max_tokens": 2}'),
    ("/tokenize", b'{"content": "a\\ud800b"}'),
])
def test_a_lone_surrogate_is_a_400(server, path, body):
    refused(post(server, path, body), 400, "not valid Unicode")
    still_serves(server)


def test_token_ids_beyond_any_integer_are_a_400(server):
    big = 2 ** 70
    refused(post(server, "/v1/completions", json={"prompt": [1, big], "max_tokens": 2}), 400, "outside the vocabulary")
    refused(post(server, "/v1/completions", json={"prompt": [-1], "max_tokens": 2}), 400, "outside the vocabulary")
    refused(post(server, "/detokenize", json={"tokens": [big]}), 400, "outside the vocabulary")
    still_serves(server)


def test_tokenize_is_bounded_by_what_its_reply_costs(server):
    from pyggml.server.app import MAX_PIECES_CHARS, MAX_TOKENIZE_CHARS
    text = "word " * (MAX_PIECES_CHARS // 5 + 1)
    refused(post(server, "/tokenize", json={"content": text, "with_pieces": True}), 400, "at most")
    r = post(server, "/tokenize", json={"content": text})  # without pieces the same text is fine
    assert r.status_code == 200 and len(r.json()["tokens"]) > MAX_PIECES_CHARS // 5
    refused(post(server, "/tokenize", json={"content": "x" * (MAX_TOKENIZE_CHARS + 1)}), 400, "at most")
    refused(post(server, "/tokenize", json={"content": "x", "with_pieces": "yes"}), 400, "true or false")
    r = post(server, "/tokenize", json={"content": "Hello world", "with_pieces": True})
    assert r.status_code == 200 and "".join(t["piece"] for t in r.json()["tokens"]) == "Hello world"
    still_serves(server)


def test_a_client_that_trickles_its_headers_is_cut_off(server):
    """Headers sent a byte every 0.2 s: the server (--header-timeout 1) answers 408 in OpenAI's
    shape and closes long before they could end; a keep-alive connection's next request has the
    same deadline."""
    host, port = server.url.removeprefix("http://").split(":")
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nX-Slow: " + b"a" * 200
    with socket.create_connection((host, int(port)), timeout=10) as s:
        got, sent = b"", 0
        for byte in head:  # about 50 s of headers, were they let through
            try:
                s.sendall(bytes([byte]))
            except OSError:
                break
            sent += 1
            time.sleep(0.2)
            s.setblocking(False)
            try:
                chunk = s.recv(4096)
            except BlockingIOError:
                chunk = None
            finally:
                s.setblocking(True)
            if chunk is not None:
                got += chunk
                if not chunk:
                    break
        assert got.startswith(b"HTTP/1.1 408") and b'"code":408' in got, got
        assert sent < 40, sent
    # a keep-alive connection: one request answered, then the next one's headers trickle
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        first = b""
        while b'{"status":"ok"}' not in first:
            chunk = s.recv(4096)
            assert chunk, first
            first += chunk
        assert first.startswith(b"HTTP/1.1 200"), first
        s.sendall(b"GET /hea")
        s.settimeout(5)
        rest = b""
        while True:
            chunk = s.recv(4096)
            if not chunk:
                break
            rest += chunk
        assert rest.startswith(b"HTTP/1.1 408"), rest
    still_serves(server)


def test_logit_bias_has_openai_semantics(server):
    """logit_bias is added to the logits before top-k (so a token far down the row can be
    forced, and the top one banned), with OpenAI's bounds: ids of the vocabulary, values in
    [-100, 100]."""
    from tests.conftest import shared_model
    local = shared_model("smollm2")
    prompt = "The capital of France is"
    ids = local.tokenize(prompt)
    local.context.clear()
    first = next(iter(local.generate(ids, max_tokens=1, temperature=0)))
    forced = local.tokenize(" banana")[-1]

    def complete(bias: dict) -> dict:
        r = post(server, "/v1/completions", json={"prompt": prompt, "max_tokens": 4, "temperature": 0,
                                                  "logit_bias": bias})
        assert r.status_code == 200, r.text
        return r.json()
    assert complete({str(forced): 100})["choices"][0]["text"] == local.detokenize([forced] * 4)
    banned = complete({str(first): -100})["choices"][0]["text"]
    local.context.clear()
    want = list(local.generate(ids, max_tokens=4, temperature=0, logit_bias={first: -100}))
    assert first not in want and banned == local.detokenize(want)
    # the same through the Python API
    local.context.clear()
    assert local.create_completion(prompt, max_tokens=3, temperature=0, logit_bias={forced: 100})["choices"][0][
        "text"] == local.detokenize([forced] * 3)
    n_vocab = local.n_vocab
    for bias, says in [({str(n_vocab): 1}, "not a token id"), ({"-1": 1}, "not a token id"), ({"x": 1}, "not a token"),
                       ({"5": 101}, "[-100, 100]"), ({"5": "high"}, "[-100, 100]"), ([1, 2], "must be an object")]:
        refused(post(server, "/v1/completions", json={"prompt": prompt, "max_tokens": 1, "logit_bias": bias}),
                400, says)
    still_serves(server)
