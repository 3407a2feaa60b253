"""The HTTP face of an Engine: OpenAI's endpoints and llama-server's extras, as a Starlette app.

Handlers never touch the model: they parse and check the request, submit it to the
engine and relay its events, so a slow client never stalls decoding.  Events cross from
the engine's thread into the event loop through ``call_soon_threadsafe``; a client that
goes away (mid-stream, or while waiting for a whole reply) cancels its request and frees
its slot at the engine's next step.
"""
from __future__ import annotations

import asyncio
import hmac
import itertools
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from importlib import resources
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from pyggml.models.engine import GC_PAUSES, STEP_BUCKETS, Engine, EngineStopped, Event, QueueFullError

from .openai import Replies, Shape
from .requests import BadRequest, Completion, parse_completion

log = logging.getLogger("pyggml.server")
access = logging.getLogger("pyggml.server.access")  # one line per request (pyggml-server logs it by default)
QUIET_PATHS = {"/health", "/metrics"}  # polled by monitors: not logged, as llama-server does not log /health

MAX_BODY = 8 << 20  # bytes of one request body
# /tokenize: characters of text it reads; with pieces, each token's reply costs ~50 bytes and
# as many Python objects, so fewer
MAX_TOKENIZE_CHARS = 1 << 20
MAX_PIECES_CHARS = 1 << 18
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               405: "invalid_request_error", 413: "invalid_request_error", 500: "server_error",
               503: "unavailable_error"}


def error(status: int, message: str) -> JSONResponse:
    """An error in OpenAI's shape."""
    return JSONResponse({"error": {"message": message, "type": ERROR_TYPES.get(status, "server_error"),
                                   "code": status}}, status_code=status)


# the engine's counters (models/engine.py Stats): (metric, help, Stats field)
ENGINE_COUNTERS = [
    ("pyggml_prompt_tokens", "Prompt tokens evaluated", "prompt_tokens"),
    ("pyggml_cached_prompt_tokens", "Prompt tokens reused from the KV cache", "cached_tokens"),
    ("pyggml_generated_tokens", "Tokens generated", "generated_tokens"),
    ("pyggml_decode_steps", "Batches decoded", "steps"),
    ("pyggml_decode_seconds", "Time spent decoding batches", "step_seconds"),
    ("pyggml_device_losses", "RPC servers lost while serving", "losses"),
    ("pyggml_server_departures", "RPC servers that left (SIGTERM) and were let go", "departures"),
    ("pyggml_recoveries", "Placements made anew (after a loss, or to take a server back)", "recoveries"),
    ("pyggml_reattached_servers", "Lost RPC servers taken back", "reattached"),
    # llama-server's names, where they mean the same, for the dashboards that read them (its
    # prompt and predict seconds are not: a step here decodes both at once)
    ("llamacpp:prompt_tokens", "Number of prompt tokens processed.", "prompt_tokens"),
    ("llamacpp:tokens_predicted", "Number of generation tokens processed.", "generated_tokens"),
    ("llamacpp:n_decode", "Total number of llama_decode() calls", "steps"),
    ("pyggml_graph_builds", "Graphs a step built for a batch shape not kept", "graph_builds"),
    ("pyggml_graph_builds_decoding", "Of those, graphs built in steps that read no prompt", "graph_builds_decoding"),
    ("pyggml_graph_builds_streaming", "Of those, graphs built in steps of streams already generating (a stall they see)",
     "graph_builds_streaming"),
    ("pyggml_graph_parts_beside", "Parts of a new graph for prompts prepared between decoding steps, not in one",
     "graph_parts_beside"),
    ("pyggml_mixed_steps", "Steps that read prompts beside generating streams", "mixed_steps"),
    ("pyggml_lane_steps", "Decoding steps sent while another lane's was on the servers (pipelined)", "lane_steps"),
    ("pyggml_prompts_answered", "Requests whose first token came from the stored answer to the same prompt",
     "prompts_answered"),
    ("pyggml_copied_tokens", "Prompt tokens whose cells were copied from another slot holding the same prefix",
     "copied_tokens"),
    ("pyggml_graphs_ahead", "Graphs built while idle, for steps to come", "graphs_ahead"),
]


class State:
    """What the handlers share: the engine once the model is loaded, or why there is none."""

    def __init__(self, alias: str | None, api_key: str | None) -> None:
        self.alias = alias
        self.api_key = api_key
        self.engine: Engine | None = None
        self.load_error: str | None = None
        self.started = int(time.time())

    @property
    def model_id(self) -> str:
        if self.alias:
            return self.alias
        return self.engine.model.path.name if self.engine is not None else "loading"

    def unavailable(self, health: bool = False) -> JSONResponse | None:
        """The 503 to answer while there is no working engine (for ``health``, also while the
        model is being placed anew: requests sent meanwhile wait in the queue)."""
        if self.load_error is not None:
            return error(503, f"the model failed to load: {self.load_error}")
        if self.engine is None:
            return error(503, "Loading model")
        if self.engine.failure is not None:
            return error(503, self.engine.failure)
        if health and self.engine.recovering is not None:
            return error(503, f"recovering: {self.engine.recovering}")
        return None


class EngineMetrics:
    """Prometheus collector reading the engine's counters when scraped."""

    def __init__(self, state: State) -> None:
        self.state = state

    def collect(self):
        e = self.state.engine
        if e is None:
            return
        st = e.stats
        for name, doc, field in ENGINE_COUNTERS:
            yield CounterMetricFamily(name, doc, value=getattr(st, field))
        yield GaugeMetricFamily("pyggml_tokens_per_second", "Generated tokens per second of decoding",
                                value=st.generated_tokens / st.step_seconds if st.step_seconds else 0.0)
        yield GaugeMetricFamily("pyggml_busy_slots", "Slots serving a request", value=e.busy_slots)
        yield GaugeMetricFamily("pyggml_slots", "Slots (-np)", value=e.n_parallel)
        yield GaugeMetricFamily("pyggml_queued_requests", "Requests waiting for a slot", value=e.queued)
        yield GaugeMetricFamily("pyggml_kv_cells_used", "KV cache cells in use", value=e.ctx.kv.n_used)
        yield GaugeMetricFamily("pyggml_kv_cells", "KV cache cells (-c)", value=e.n_ctx)
        yield GaugeMetricFamily("pyggml_last_recovery_seconds", "How long the last placement anew took",
                                value=st.recovery_seconds)
        yield GaugeMetricFamily("pyggml_recovering", "1 while the model is being placed anew",
                                value=int(e.recovering is not None))
        yield GaugeMetricFamily("llamacpp:kv_cache_usage_ratio", "KV-cache usage. 1 means 100 percent usage.",
                                value=e.ctx.kv.n_used / e.n_ctx if e.n_ctx else 0.0)
        yield GaugeMetricFamily("llamacpp:kv_cache_tokens", "KV-cache tokens.", value=e.ctx.kv.n_used)
        yield GaugeMetricFamily("llamacpp:requests_processing", "Number of requests processing.", value=e.busy_slots)
        yield GaugeMetricFamily("llamacpp:requests_deferred", "Number of requests deferred.", value=e.queued)
        phases = CounterMetricFamily("pyggml_step_phase_seconds", "Where the steps' time went: admission and "
                                     "batching, graphs of new shapes (part of decode), decode, sampling and text",
                                     labels=["phase"])
        for phase, seconds in (("schedule", st.schedule_seconds), ("graph", st.graph_seconds),
                               ("decode", st.step_seconds), ("sample", st.sample_seconds)):
            phases.add_metric([phase], seconds)
        yield phases
        yield GaugeMetricFamily("pyggml_graphs_to_build_ahead", "Decoding steps' graphs still to build while idle",
                                value=e.warming)
        cumulative = list(itertools.accumulate(st.step_buckets))
        yield HistogramMetricFamily(
            "pyggml_step_seconds", "Wall time of a step, from admission to the last token handed out",
            buckets=[(f"{b:g}", n) for b, n in zip(STEP_BUCKETS, cumulative)] + [("+Inf", cumulative[-1])],
            sum_value=st.schedule_seconds + st.step_seconds + st.sample_seconds)
        yield GaugeMetricFamily("pyggml_slowest_step_seconds", "The slowest step so far", value=st.slowest_step)
        gc_seconds = CounterMetricFamily("pyggml_gc_pause_seconds", "Time the garbage collector stopped the process",
                                         labels=["generation"])
        gc_runs = CounterMetricFamily("pyggml_gc_collections", "Garbage collections", labels=["generation"])
        for g in range(3):
            gc_seconds.add_metric([str(g)], GC_PAUSES.seconds[g])
            gc_runs.add_metric([str(g)], GC_PAUSES.collections[g])
        yield gc_seconds
        yield gc_runs
        dev = CounterMetricFamily("pyggml_device_seconds", "Compute time per device", labels=["device"])
        for name, seconds in sorted(e.ctx.sched.busy_seconds.items()):
            dev.add_metric([name], seconds)
        yield dev


def create_app(state: State) -> Starlette:
    registry = CollectorRegistry()
    requests_total = Counter("pyggml_requests", "HTTP requests by endpoint and status", ["endpoint", "status"],
                             registry=registry)
    registry.register(EngineMetrics(state))

    async def body_of(request: Request) -> Any:
        size = request.headers.get("content-length")
        if size is not None and (not size.isdigit() or int(size) > MAX_BODY):
            raise HTTPException(413, f"the request body is larger than {MAX_BODY} bytes")
        data = bytearray()
        async for chunk in request.stream():
            data += chunk
            if len(data) > MAX_BODY:
                raise HTTPException(413, f"the request body is larger than {MAX_BODY} bytes")
        try:
            body = json.loads(data)
        except (ValueError, UnicodeDecodeError) as e:
            raise BadRequest(f"the request body is not valid JSON: {e}") from None
        except RecursionError:
            raise BadRequest("the request body nests too deeply") from None
        try:  # a lone surrogate (\ud800) is valid JSON but no text: it reaches no tokenizer
            json.dumps(body, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError as e:
            raise BadRequest(f"the request body holds a string that is not valid Unicode ({e.reason}: "
                             f"{e.object[e.start:e.end]!r})") from None
        except RecursionError:
            raise BadRequest("the request body nests too deeply") from None
        return body

    def endpoint(name: str, needs_engine: bool = True, needs_key: bool = True) -> Callable:
        """Wrap a handler with the key check, the 503 while loading, errors in OpenAI's shape
        and the request counter."""
        def wrap(handler: Callable) -> Callable:
            async def run(request: Request) -> Response:
                request.state.t0 = time.perf_counter()
                response = await _run(request)
                requests_total.labels(name, str(response.status_code)).inc()
                if not getattr(request.state, "streaming", False):  # (a stream says its line as it ends)
                    log_request(request, response.status_code, getattr(request.state, "usage", None))
                return response

            async def _run(request: Request) -> Response:
                if needs_key and state.api_key is not None:
                    auth = request.headers.get("authorization", "")
                    given = auth[7:] if auth.lower().startswith("bearer ") else ""
                    if not hmac.compare_digest(given.encode(), state.api_key.encode()):
                        return error(401, "invalid or missing API key (Authorization: Bearer ...)")
                if needs_engine:
                    down = state.unavailable()
                    if down is not None:
                        return down
                try:
                    return await handler(request)
                except BadRequest as e:
                    return error(400, str(e))
                except HTTPException as e:
                    return error(e.status_code, e.detail)
                except QueueFullError as e:
                    return error(503, str(e))
                except EngineStopped as e:
                    return error(503, str(e))
                except Exception as e:  # a bug: say so, keep serving
                    log.exception("%s failed", name)
                    return error(500, f"internal error: {type(e).__name__}: {e}")
            return run
        return wrap

    async def completion(request: Request, kind: str) -> Response:
        engine = state.engine
        c: Completion = parse_completion(await body_of(request), kind, engine.model.n_vocab)
        # any model name is served by the one model, as llama-server does (OpenAI code names its
        # own); the reply's "model" says which one answered
        try:
            ids = await asyncio.to_thread(engine.prompt_ids, c.prompt, c.messages)
            engine.check_prompt(ids)
        except ValueError as e:  # template errors, ids outside the vocabulary, too long
            raise BadRequest(str(e)) from None
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[Event] = asyncio.Queue()
        req = engine.start(ids, c.options, lambda ev: loop.call_soon_threadsafe(events.put_nowait, ev))
        replies = Replies(Shape(c.kind, state.model_id, reasoning=engine.model.harmony), c.kind,
                          engine.model.tokenizer, c.include_usage)
        if not c.stream:
            try:
                while True:
                    try:
                        ev = await asyncio.wait_for(events.get(), timeout=1.0)
                    except asyncio.TimeoutError:
                        if await request.is_disconnected():
                            return Response(status_code=499)
                        continue
                    if ev.kind == "error":
                        return error(503 if engine.failure else 500, ev.error)
                    replies.add(ev)
                    if ev.kind == "done":
                        request.state.usage = replies.usage
                        return JSONResponse(replies.reply())
            finally:
                req.cancel()

        request.state.streaming = True
        usage = None

        async def sse() -> AsyncIterator[bytes]:
            nonlocal usage
            try:
                for chunk in replies.first():
                    yield _sse(chunk)
                while True:
                    ev = await events.get()
                    if ev.kind == "error":
                        yield _sse({"error": {"message": ev.error, "type": "server_error", "code": 500}})
                        return
                    for chunk in replies.chunks(ev):
                        yield _sse(chunk)
                    if ev.kind == "done":
                        usage = ev.usage
                        yield b"data: [DONE]\n\n"
                        return
            finally:
                req.cancel()  # the client went away, or the reply ended: the slot is free either way
                log_request(request, 200, usage, "" if usage is not None else " (ended early)")
        return StreamingResponse(sse(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    @endpoint("chat_completions")
    async def chat_completions(request: Request) -> Response:
        return await completion(request, "chat")

    @endpoint("completions")
    async def completions(request: Request) -> Response:
        return await completion(request, "text")

    @endpoint("models", needs_engine=False)
    async def models(request: Request) -> Response:
        data = {"id": state.model_id, "object": "model", "created": state.started, "owned_by": "pyggml"}
        if state.engine is not None:
            m = state.engine.model
            data["meta"] = {"n_ctx": state.engine.n_ctx, "n_ctx_train": m.model.hp.n_ctx_train,
                            "n_vocab": m.n_vocab, "n_parallel": state.engine.n_parallel, "file": m.path.name}
        return JSONResponse({"object": "list", "data": [data]})

    @endpoint("health", needs_engine=False, needs_key=False)
    async def health(request: Request) -> Response:
        down = state.unavailable(health=True)
        return down if down is not None else JSONResponse({"status": "ok"})

    @endpoint("metrics", needs_engine=False)
    async def metrics(request: Request) -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    @endpoint("tokenize")
    async def tokenize(request: Request) -> Response:
        body = await body_of(request)
        if not isinstance(body, dict) or not isinstance(body.get("content"), str):
            raise BadRequest("'content' must be a string")
        add_special, with_pieces = body.get("add_special", False), body.get("with_pieces", False)
        if not isinstance(add_special, bool) or not isinstance(with_pieces, bool):
            raise BadRequest("'add_special' and 'with_pieces' must be true or false")
        limit = MAX_PIECES_CHARS if with_pieces else MAX_TOKENIZE_CHARS
        if len(body["content"]) > limit:
            raise BadRequest(f"'content' holds {len(body['content'])} characters; /tokenize reads at most {limit}"
                             + (" with pieces" if with_pieces else ""))
        m = state.engine.model

        def tokens() -> bytes:  # off the event loop, the reply's encoding too: a long text takes a while
            ids = m.tokenize(body["content"], add_special or None, True)
            out = [{"id": t, "piece": m.detokenize([t], special=True)} for t in ids] if with_pieces else ids
            return json.dumps({"tokens": out}, ensure_ascii=False, separators=(",", ":")).encode()
        return Response(await asyncio.to_thread(tokens), media_type="application/json")

    @endpoint("detokenize")
    async def detokenize(request: Request) -> Response:
        body = await body_of(request)
        ids = body.get("tokens") if isinstance(body, dict) else None
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise BadRequest("'tokens' must be a list of token ids")
        m = state.engine.model
        bad = [t for t in ids if not 0 <= t < m.n_vocab]
        if bad:
            raise BadRequest(f"token id {bad[0]} is outside the vocabulary (0..{m.n_vocab - 1})")
        return JSONResponse({"content": await asyncio.to_thread(m.detokenize, ids)})

    pages = {name: (resources.files("pyggml.server") / "static" / f"{name}.html").read_bytes()
             for name in ("chat", "cluster")}

    def page(name: str) -> Response:
        """A page: one file of the package (no CDN: it works offline), speaking to this API."""
        return Response(pages[name], media_type="text/html; charset=utf-8", headers={
            "Content-Security-Policy": "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
                                       "connect-src 'self'; img-src 'self' data:; frame-ancestors 'none'",
            "X-Content-Type-Options": "nosniff", "Cache-Control": "no-cache"})

    async def chat_page(request: Request) -> Response:
        """The chat page; it asks for the key itself when the API answers 401."""
        return page("chat")

    @endpoint("cluster")
    async def cluster_json(request: Request) -> Response:
        return JSONResponse({"model": state.model_id, **state.engine.cluster()})

    async def cluster(request: Request) -> Response:
        """GET /cluster: the devices, what they hold, their memory and links, and the recent
        events (joined, left, lost, placed anew) - JSON, or for a browser (which asks for HTML)
        the live view that polls the JSON."""
        accept = request.headers.get("accept", "")
        if "text/html" in accept and "application/json" not in accept:
            return page("cluster")
        return await cluster_json(request)

    async def not_found(request: Request, exc: Exception) -> Response:
        status = getattr(exc, "status_code", 404)
        if status == 405:
            return error(405, f"{request.method} is not allowed on {request.url.path}")
        return error(status, f"no such endpoint: {request.method} {request.url.path}")

    routes = [
        Route("/", chat_page, methods=["GET"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/completions", completions, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/models", models, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/cluster", cluster, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/tokenize", tokenize, methods=["POST"]),
        Route("/detokenize", detokenize, methods=["POST"]),
    ]
    return Starlette(routes=routes, exception_handlers={404: not_found, 405: not_found})


def log_request(request: Request, status: int, usage=None, note: str = "") -> None:
    """llama-server's line per request: who, what, the status, the tokens, the time."""
    if not access.isEnabledFor(logging.INFO) or request.url.path in QUIET_PATHS:
        return
    tokens = f" {usage.prompt_tokens} prompt + {usage.completion_tokens} generated tokens" if usage else ""
    ms = (time.perf_counter() - getattr(request.state, "t0", time.perf_counter())) * 1000
    client = request.client.host if request.client else "-"
    access.info("%s %s %s %d%s %.0f ms%s", client, request.method, request.url.path, status, tokens, ms, note)


def _sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"
