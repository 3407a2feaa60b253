"""pyggml-server as a real process on 127.0.0.1, spoken to with the official ``openai``
client and raw HTTP: OpenAI's shapes, streaming, errors, the key, metrics, continuous
batching (concurrent streams equal to their solo greedy answers), slots freed by clients
that go away, and a model placed on RPC servers."""
from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import shared_model

CHAT = [{"role": "user", "content": "Name the capital of France."}]
QUESTIONS = ["Name the capital of France.", "What is 2+2?", "Write a haiku about the sea.", "List three colours.",
             "Who wrote Hamlet?", "What is the largest planet?", "Say hello in Spanish.", "What is water made of?"]


class HTTPServer:
    """``pyggml-server`` on a free port (it prints the URL once the model is loaded)."""

    def __init__(self, *args: str, log_path, timeout: float = 180) -> None:
        self.log_path = log_path
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen([sys.executable, "-m", "pyggml.cli.server", "--port", "0", *args],
                                     stdout=subprocess.DEVNULL, stderr=self.log)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            m = re.search(r"listening on (http://\S+)", open(log_path).read())
            if m:
                self.url = m.group(1)
                return
            if self.proc.poll() is not None:
                break
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"pyggml-server did not start: {open(log_path).read()}")

    def client(self, key: str = "none", **kw) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=key, max_retries=0, **kw)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def served(tmp_path_factory, log_name: str, *args: str):
    """A module's pyggml-server with ``args``, its log in a folder of its own (a fixture's body)."""
    s = HTTPServer(*args, log_path=tmp_path_factory.mktemp("http") / log_name)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    yield from served(tmp_path_factory, "server.log", "-m", "smollm2", "-c", "2048", "-np", "4", "--max-queue", "16")


@pytest.fixture(scope="module")
def keyed(tmp_path_factory):
    """One slot, one place in the queue, and an API key."""
    s = HTTPServer("-m", "smollm2", "-c", "1024", "-np", "1", "--max-queue", "1", "--api-key", "sesame",
                   "--alias", "smol", log_path=tmp_path_factory.mktemp("http") / "keyed.log")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def solo():
    """Greedy answers of the same model in this process, one request at a time."""
    m = shared_model("smollm2")
    return {q: m.create_chat_completion([{"role": "user", "content": q}], max_tokens=24, temperature=0)
            for q in QUESTIONS}


def stream_text(chunks) -> str:
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


# -- OpenAI shapes ----------------------------------------------------------------------------------

def test_chat_completion_equals_the_python_api(server, solo):
    r = server.client().chat.completions.create(model="smollm2", messages=CHAT, max_tokens=24, temperature=0)
    want = solo[CHAT[0]["content"]]
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == want["choices"][0]["message"]["content"]
    assert r.choices[0].finish_reason == want["choices"][0]["finish_reason"] == "stop"
    prompt = len(shared_model("smollm2").apply_chat_template(CHAT))
    assert r.usage.prompt_tokens == prompt == want["usage"]["prompt_tokens"]
    assert r.usage.completion_tokens == want["usage"]["completion_tokens"]
    assert r.usage.total_tokens == prompt + r.usage.completion_tokens


def test_completion_length_and_usage(server):
    m = shared_model("smollm2")
    prompt = "The capital of France is"
    r = server.client().completions.create(model="smollm2", prompt=prompt, max_tokens=8, temperature=0)
    assert r.object == "text_completion"
    assert r.choices[0].finish_reason == "length" and "Paris" in r.choices[0].text
    assert r.usage.prompt_tokens == len(m.tokenize(prompt)) and r.usage.completion_tokens == 8
    ids = m.tokenize(prompt)
    want = m.detokenize(list(m.generate(ids, max_tokens=8, temperature=0)))
    assert r.choices[0].text == want


def test_chat_stream_shape(server):
    c = server.client()
    whole = c.chat.completions.create(messages=CHAT, model="smollm2", max_tokens=24, temperature=0)
    chunks = list(c.chat.completions.create(messages=CHAT, model="smollm2", max_tokens=24, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert len({ch.id for ch in chunks}) == 1 and chunks[0].id.startswith("chatcmpl-")
    assert all(ch.object == "chat.completion.chunk" for ch in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    content = [ch for ch in chunks if ch.choices]
    assert all(ch.choices[0].finish_reason is None for ch in content[:-1])
    assert content[-1].choices[0].finish_reason == "stop"
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == whole.usage.total_tokens
    assert stream_text(chunks) == whole.choices[0].message.content


def test_raw_stream_ends_with_done(server):
    with httpx.stream("POST", server.url + "/v1/completions", timeout=60,
                      json={"prompt": "Once upon a time", "max_tokens": 4, "temperature": 0, "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [ln for ln in r.iter_lines() if ln]
    assert all(ln.startswith("data: ") for ln in lines) and lines[-1] == "data: [DONE]"
    chunks = [json.loads(ln[6:]) for ln in lines[:-1]]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert "usage" not in chunks[-1]  # only with stream_options.include_usage


def test_stop_strings_are_never_in_the_output(server):
    c = server.client()
    free = c.completions.create(model="smollm2", prompt="Count: one, two, three, four,", max_tokens=16, temperature=0).choices[0].text
    stop = free.strip().split()[1]  # a word that comes after the first one
    r = c.completions.create(model="smollm2", prompt="Count: one, two, three, four,", max_tokens=16, temperature=0, stop=[stop, "zzz"])
    assert r.choices[0].finish_reason == "stop"
    assert stop not in r.choices[0].text and free.startswith(r.choices[0].text)
    streamed = "".join(ch.choices[0].text for ch in c.completions.create(model="smollm2", 
        prompt="Count: one, two, three, four,", max_tokens=16, temperature=0, stop=stop, stream=True))
    assert streamed == r.choices[0].text


def test_same_seed_same_text(server):
    c = server.client()

    def draw(seed):
        return c.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "Tell me a story."}], max_tokens=16,
                                         temperature=1.0, seed=seed).choices[0].message.content
    first = draw(1234)
    assert draw(1234) == first
    assert any(draw(s) != first for s in (1, 2, 3))


def test_logprobs(server):
    r = server.client().chat.completions.create(model="smollm2", messages=CHAT, max_tokens=4, temperature=0, logprobs=True,
                                                top_logprobs=3)
    entries = r.choices[0].logprobs.content
    assert len(entries) == r.usage.completion_tokens == 4
    for e in entries:
        assert len(e.top_logprobs) == 3 and e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob
        assert e.token == e.top_logprobs[0].token and e.logprob == pytest.approx(e.top_logprobs[0].logprob)
        assert e.logprob <= 0
    assert "".join(e.token for e in entries) == r.choices[0].message.content


def test_cached_prompt_tokens(server):
    c = server.client()
    messages = [{"role": "user", "content": "Describe a cat in one sentence, please, with colour."}]
    first = c.chat.completions.create(model="smollm2", messages=messages, max_tokens=8, temperature=0)
    again = c.chat.completions.create(model="smollm2", messages=messages, max_tokens=8, temperature=0)
    assert again.choices[0].message.content == first.choices[0].message.content
    # the slot keeps the output of the prompt's whole read: the same prompt reads no token again
    assert again.usage.prompt_tokens_details.cached_tokens == again.usage.prompt_tokens
    messages = [{"role": "user", "content": "Describe a cat in one sentence, please, with stripes."}]
    other = c.chat.completions.create(model="smollm2", messages=messages, max_tokens=8, temperature=0)
    cached, n = other.usage.prompt_tokens_details.cached_tokens, other.usage.prompt_tokens
    # the rest reads as in a fresh run (pyggml.batch_rules): for SmolLM2's Q4_1 from where the
    # prompts part (" stripes" against " colour"), two tokens at the least
    ids = [shared_model("smollm2").apply_chat_template(messages) for messages in (
        [{"role": "user", "content": "Describe a cat in one sentence, please, with colour."}], messages)]
    shared = next(i for i, (x, y) in enumerate(zip(*ids)) if x != y)
    assert len(ids[1]) == n and cached == min(shared, n - 2)


def test_models_health_tokenize(server):
    models = server.client().models.list()
    assert [m.id for m in models.data] == ["SmolLM2-135M-Instruct.Q4_1.gguf"]
    assert models.data[0].owned_by == "pyggml" and models.data[0].meta["n_ctx"] == 2048
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    m = shared_model("smollm2")
    ids = httpx.post(server.url + "/tokenize", json={"content": "Hello world"}).json()["tokens"]
    assert ids == m.tokenize("Hello world", special=True)
    assert httpx.post(server.url + "/detokenize", json={"tokens": ids}).json() == {"content": "Hello world"}


def test_metrics_parse_and_move(server):
    def scrape():
        text = httpx.get(server.url + "/metrics").text
        return {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples
                if not s.labels or s.name == "pyggml_device_seconds_total"}
    before = scrape()
    server.client().completions.create(model="smollm2", prompt="Hello", max_tokens=3, temperature=0)
    after = scrape()
    assert after["pyggml_generated_tokens_total"] == before["pyggml_generated_tokens_total"] + 3
    assert after["pyggml_prompt_tokens_total"] > before["pyggml_prompt_tokens_total"]
    assert after["pyggml_slots"] == 4 and after["pyggml_kv_cells"] == 2048
    assert after["pyggml_device_seconds_total"] > before.get("pyggml_device_seconds_total", 0)
    # llama-server's names too, for its dashboards
    assert after["llamacpp:tokens_predicted_total"] == before["llamacpp:tokens_predicted_total"] + 3
    assert after["llamacpp:prompt_tokens_total"] == after["pyggml_prompt_tokens_total"]
    assert after["llamacpp:n_decode_total"] > before["llamacpp:n_decode_total"]
    assert 0 < after["llamacpp:kv_cache_usage_ratio"] <= 1 and after["llamacpp:kv_cache_tokens"] > 0
    assert after["llamacpp:requests_processing"] == 0 and after["llamacpp:requests_deferred"] == 0
    text = httpx.get(server.url + "/metrics").text
    assert re.search(r'pyggml_requests_total\{endpoint="completions",status="200"\} [1-9]', text)
    # where the steps' time goes (bench/serve.py --profile): the phases, the steps by wall time
    steps = after["pyggml_decode_steps_total"] - before["pyggml_decode_steps_total"]
    assert after["pyggml_step_seconds_count"] - before["pyggml_step_seconds_count"] == steps > 0
    assert after["pyggml_step_seconds_sum"] > before["pyggml_step_seconds_sum"]
    phases = {s.labels["phase"]: s.value for fam in text_string_to_metric_families(text) for s in fam.samples
              if s.name == "pyggml_step_phase_seconds_total"}
    assert set(phases) == {"schedule", "graph", "decode", "sample"} and phases["decode"] > phases["graph"]
    assert after["pyggml_graphs_to_build_ahead"] == 0 and after["pyggml_graphs_ahead_total"] > 0


# -- errors -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("path, body, status, words", [
    ("/v1/chat/completions", b"{not json", 400, "not valid JSON"),
    ("/v1/chat/completions", {"messages": "hi"}, 400, "'messages'"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 3}]}, 400, "content"),
    ("/v1/chat/completions", {"messages": CHAT, "temperature": "hot"}, 400, "'temperature' must be a number"),
    ("/v1/chat/completions", {"messages": CHAT, "temperature": 5}, 400, "at most 2"),
    ("/v1/chat/completions", {"messages": CHAT, "top_p": 0}, 400, "'top_p'"),
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": -5}, 400, "'max_tokens'"),
    ("/v1/chat/completions", {"messages": CHAT, "n": 2}, 400, "'n' must be 1"),
    ("/v1/chat/completions", {"messages": CHAT, "stop": [1]}, 400, "'stop'"),
    ("/v1/chat/completions", {"messages": CHAT, "stop": ["x" * 300]}, 400, "longer than 256"),
    ("/v1/completions", {"prompt": "word " * 3000}, 400, "more than the context"),
    ("/v1/completions", {"prompt": [1, 2, 10 ** 9]}, 400, "outside the vocabulary"),
    ("/v1/completions", {"prompt": ["a", "b"]}, 400, "one prompt per request"),
    ("/v1/nothing", {}, 404, "no such endpoint"),
])
def test_errors_have_openais_shape(server, path, body, status, words):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(server.url + path, content=content, headers={"Content-Type": "application/json"}, timeout=30)
    assert r.status_code == status
    err = r.json()["error"]
    assert words in err["message"] and err["code"] == status and isinstance(err["type"], str)
    assert httpx.get(server.url + "/health").status_code == 200  # and it keeps serving


def test_any_model_name_is_served_by_the_one_model(server):
    """As llama-server: existing OpenAI code names its own model; the reply says which served it."""
    client = server.client()
    served = client.models.list().data[0].id
    r = client.chat.completions.create(model="gpt-4o-mini", messages=CHAT, max_tokens=2, temperature=0)
    assert r.model == served and r.usage.completion_tokens == 2


def test_openai_client_sees_the_errors(server):
    with pytest.raises(openai.BadRequestError, match="'n' must be 1"):
        server.client().chat.completions.create(model="smollm2", messages=CHAT, n=3)
    with pytest.raises(openai.NotFoundError):  # (any model name is served: a route that is not)
        server.client().models.retrieve("no-such-model")


def test_api_key(keyed):
    with pytest.raises(openai.AuthenticationError):
        keyed.client("wrong").chat.completions.create(messages=CHAT, model="smol", max_tokens=2)
    assert httpx.get(keyed.url + "/v1/models").status_code == 401
    assert httpx.get(keyed.url + "/health").status_code == 200  # no key needed
    r = keyed.client("sesame").chat.completions.create(messages=CHAT, model="smol", max_tokens=2, temperature=0)
    assert r.model == "smol" and r.usage.completion_tokens == 2
    assert [m.id for m in keyed.client("sesame").models.list().data] == ["smol"]


# -- continuous batching ----------------------------------------------------------------------------

def test_eight_concurrent_streams_equal_their_solo_answers(server, solo):
    """Four slots, eight requests at once: four are decoded together, four wait in the queue;
    each greedy answer is the one the same model gives alone."""
    c = server.client(timeout=300)
    out: dict[str, str] = {}
    errors: list[BaseException] = []

    def ask(q):
        try:
            out[q] = stream_text(c.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": q}], max_tokens=24,
                                                           temperature=0, stream=True))
        except BaseException as e:  # reported below
            errors.append(e)
    threads = [threading.Thread(target=ask, args=(q,)) for q in QUESTIONS]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not errors
    for q in QUESTIONS:
        assert out[q] == solo[q]["choices"][0]["message"]["content"], q


def _metric(url: str, name: str, key: str = "sesame") -> float:
    text = httpx.get(url + "/metrics", headers={"Authorization": f"Bearer {key}"}).text
    return next(s.value for fam in text_string_to_metric_families(text) for s in fam.samples if s.name == name)


def test_dropped_stream_frees_its_slot_for_the_queue(keyed):
    """One slot: a long stream holds it, a second request waits, a third finds the queue full
    (503); the first client goes away and the waiting request is served."""
    c = keyed.client("sesame", timeout=120)
    stream = c.completions.create(model="smol", prompt="Once upon a time", max_tokens=1000, temperature=0,
                                  stream=True)
    next(iter(stream))
    waiting: dict = {}
    t = threading.Thread(target=lambda: waiting.update(r=c.completions.create(
        model="smol", prompt="The capital of France is", max_tokens=4, temperature=0)))
    t.start()
    deadline = time.monotonic() + 30
    while _metric(keyed.url, "pyggml_queued_requests") < 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _metric(keyed.url, "pyggml_busy_slots") == 1 and _metric(keyed.url, "pyggml_queued_requests") == 1
    r = httpx.post(keyed.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2},
                   headers={"Authorization": "Bearer sesame"})
    assert r.status_code == 503 and "busy" in r.json()["error"]["message"]
    stream.close()  # the client goes away mid-stream
    t.join(60)
    assert waiting["r"].usage.completion_tokens == 4
    assert _metric(keyed.url, "pyggml_busy_slots") == 0


def test_health_is_503_while_loading():
    """The app before its engine exists (what /health answers while the model loads)."""
    from starlette.testclient import TestClient

    from pyggml.server import State, create_app
    state = State(None, None)
    with TestClient(create_app(state)) as tc:
        r = tc.get("/health")
        assert r.status_code == 503 and r.json()["error"]["message"] == "Loading model"
        r = tc.post("/v1/completions", json={"prompt": "hi"})
        assert r.status_code == 503
        state.load_error = "no such file"
        assert "no such file" in tc.get("/health").json()["error"]["message"]


# -- placed on RPC servers --------------------------------------------------------------------------

def test_served_over_two_rpc_servers(start_server, tmp_path, solo):
    servers = [start_server(), start_server()]
    rpc = ";".join(s.endpoint for s in servers)
    s = HTTPServer("-m", "smollm2", "-c", "1024", "-np", "2", "--rpc", rpc, "-ngl", "0:prolog,epilog;1:all",
                   log_path=tmp_path / "rpc.log")
    try:
        c = s.client(timeout=120)
        out = {}
        threads = [threading.Thread(target=lambda q=q: out.update({q: c.chat.completions.create(model="smollm2", 
            messages=[{"role": "user", "content": q}], max_tokens=24, temperature=0).choices[0].message.content}))
            for q in QUESTIONS[:2]]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        for q in QUESTIONS[:2]:
            assert out[q] == solo[q]["choices"][0]["message"]["content"]
        servers[1].kill()  # a lost server: the request ends with an error naming it, the HTTP server stays
        r = httpx.post(s.url + "/v1/completions", json={"prompt": "Hello", "max_tokens": 4}, timeout=120)
        assert r.status_code == 503 and servers[1].endpoint in r.json()["error"]["message"]
        health = httpx.get(s.url + "/health")
        assert health.status_code == 503 and servers[1].endpoint in health.json()["error"]["message"]
    finally:
        s.stop()



def test_failover_keeps_streams_going(start_server, tmp_path):
    """--failover: an RPC server killed while two streams are decoded together; both streams
    complete with the text an uninterrupted run gives, and the server stays healthy."""
    prompts = ["Once upon a time, in a land far away,", "The history of the clock begins"]
    m = shared_model("smollm2")
    want = {}
    for p in prompts:
        m.context.clear()  # each prompt read in one call, as the server reads it
        want[p] = m.create_completion(p, max_tokens=40, temperature=0)["choices"][0]["text"]
    servers = [start_server(), start_server()]
    s = HTTPServer("-m", "smollm2", "-c", "1024", "-np", "2", "--rpc", ";".join(x.endpoint for x in servers),
                   "--failover", log_path=tmp_path / "failover.log")
    try:
        c = s.client(timeout=120)
        streams = {p: c.completions.create(model="smollm2", prompt=p, max_tokens=40, temperature=0, stream=True)
                   for p in prompts}
        text = {p: "" for p in prompts}
        iters = {p: iter(st) for p, st in streams.items()}
        for p in prompts:  # both have begun
            text[p] += next(iters[p]).choices[0].text
        servers[1].kill()
        for p in prompts:
            text[p] += "".join(ch.choices[0].text for ch in iters[p])
        assert text == want
        assert httpx.get(s.url + "/health").json() == {"status": "ok"}
        assert "lost" in (tmp_path / "failover.log").read_text()
        back = start_server("-p", str(servers[1].port))  # it comes back: taken back within a few seconds
        r = c.completions.create(model="smollm2", prompt=prompts[0], max_tokens=40, temperature=0)
        assert r.choices[0].text == want[prompts[0]]
        deadline = time.monotonic() + 20
        while f"reattached {back.endpoint}" not in (tmp_path / "failover.log").read_text():
            assert time.monotonic() < deadline, "the server that came back was not taken back"
            time.sleep(0.2)
        r = c.completions.create(model="smollm2", prompt=prompts[1], max_tokens=40, temperature=0)
        assert r.choices[0].text == want[prompts[1]]
    finally:
        s.stop()


def test_without_failover_a_server_that_comes_back_is_taken_back(start_server, tmp_path):
    """No --failover: a lost RPC server makes the server answer 503 saying what to do (wait,
    restart, or --failover); when the RPC server is back, it is taken back and requests are
    served again, with the text of an uninterrupted run - no restart needed."""
    prompt = "The history of the clock begins"
    m = shared_model("smollm2")
    m.context.clear()
    want = m.create_completion(prompt, max_tokens=12, temperature=0)["choices"][0]["text"]
    servers = [start_server(), start_server()]
    s = HTTPServer("-m", "smollm2", "-c", "1024", "-np", "1", "--rpc", ";".join(x.endpoint for x in servers),
                   log_path=tmp_path / "nofailover.log")
    try:
        c = s.client(timeout=120)
        assert c.completions.create(model="x", prompt=prompt, max_tokens=12, temperature=0).choices[0].text == want
        servers[1].kill()
        r = httpx.post(s.url + "/v1/completions", json={"prompt": prompt, "max_tokens": 12}, timeout=120)
        assert r.status_code in (500, 503)  # the request in flight fails with the loss
        r = httpx.post(s.url + "/v1/completions", json={"prompt": prompt, "max_tokens": 12}, timeout=120)
        assert r.status_code == 503, r.text
        message = r.json()["error"]["message"]
        assert servers[1].endpoint in message and "--failover" in message and "when it is back" in message
        start_server("-p", str(servers[1].port))
        deadline = time.monotonic() + 30
        while httpx.get(s.url + "/health").status_code != 200:
            assert time.monotonic() < deadline, "the server that came back was not taken back"
            time.sleep(0.2)
        assert c.completions.create(model="x", prompt=prompt, max_tokens=12, temperature=0).choices[0].text == want
    finally:
        s.stop()
