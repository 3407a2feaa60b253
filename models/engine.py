"""Continuous batching: many requests served by one model at once (llama-server's slots).

``Engine(model, n_parallel=4)`` owns the model's context.  Requests wait in a bounded queue
and are admitted in arrival order into ``n_parallel`` slots; slot i is KV-cache sequence i.
One thread runs the step loop: each step decodes one batch holding the next token of every
generating sequence plus chunks of waiting prompts (at most ``n_batch`` tokens in all, so
that running streams keep flowing while a long prompt is read), then samples each
sequence's token with its own parameters and seed and hands the text to its request.
Every weight is read once per step for all the sequences in it.

A slot keeps its last conversation's cells while nobody needs them: a request whose prompt
shares a prefix with an idle slot's tokens goes to that slot and skips the shared part
(``cached_tokens``); when cells run short, idle slots give theirs up, least recently used
first.  A request is admitted only when its prompt fits beside the prompts already being
read, so prompts never wait on each other for cells; a generating sequence that finds no
free cell ends with ``finish_reason`` "length".

The engine has no HTTP in it: ``submit`` returns OpenAI-shaped chunks (or the whole reply)
and may be called from any thread; ``start`` is the lower level that delivers events to a
callback (what the HTTP server uses).  When a device is lost (an RPC server died) the
requests in flight end with an error naming it, and the engine refuses new ones, saying why;
unless the model has ``failover``: then its layers move, the cache is rebuilt from the
batches that wrote its live cells (time that grows with what is live, not with how long the
engine has served), and the requests go on - a server lost during that is one more loss.
A thread tries the lost servers every ``REATTACH_INTERVAL_S``; one that answers again is
taken back into the placement at the next step boundary, while requests run.  If the model
no longer fits on what is alive, the requests in flight end with that error and new ones are
refused ("recovering") until enough servers are back, then the engine serves again.

A sequence decoded beside others gets the bits it gets alone, so a greedy answer is the one
it gets alone and from ``Model.create_completion``: the KV cache hands out cells in pages so
that every sequence's cells sit at their solo offsets, the attention takes its single-token
path per sequence (kv_cache.py, cpu/nn.py::attention), each product computes every
sequence's run of columns as that sequence alone would (llama.cpp's K-quant kernels change
with a batch's width: ops.mul_mat's runs, which Context passes for a batch of several
sequences), and prompts are read in pieces that keep every token's kernels those of a whole
read (context.py: prompt_cut, reusable_prefix).
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .completion import Shape, TextStream, Usage
from .context import Batch, ContextFullError, prompt_cut, reusable_prefix
from .kv_cache import PAGE
from .sampling import Sampler, SamplingParams, checked_logit_bias

log = logging.getLogger("pyggml.engine")

DEFAULT_MAX_QUEUE = 64
REATTACH_INTERVAL_S = 2.0


class QueueFullError(RuntimeError):
    """Every slot is busy and the queue is full."""


class EngineStopped(RuntimeError):
    """The engine no longer serves (closed, or a device was lost: the message says which)."""


@dataclass
class Event:
    """What a request hears from the engine: text ("piece"), the end ("done", with
    ``finish`` and ``usage``) or a failure ("error")."""
    kind: str
    text: str = ""
    logprobs: list[dict[str, Any]] = field(default_factory=list)
    finish: str | None = None
    usage: Usage | None = None
    error: str = ""


@dataclass
class Options:
    """A request's generation settings (OpenAI's names, llama.cpp's sampler)."""
    max_tokens: int | None = None           # None or <= 0: until the context is full
    sampling: SamplingParams = field(default_factory=SamplingParams)
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    logprobs: int | None = None             # None: off; k: the token's and the top k's logprobs


class Request:
    def __init__(self, engine: Engine, ids: list[int], options: Options, sink: Callable[[Event], None]) -> None:
        self.engine, self.ids, self.options, self.sink = engine, ids, options, sink
        self.usage = Usage(prompt_tokens=len(ids))
        self.cancelled = False
        self.t_submit = time.monotonic()

    def cancel(self) -> None:
        """Stop generating (the client went away): the slot is freed at the next step."""
        self.cancelled = True
        self.engine._wake()


class Slot:
    def __init__(self, seq: int) -> None:
        self.seq = seq
        self.tokens: list[int] = []       # what the cache holds for this sequence, in order
        self.req: Request | None = None
        self.last_used = 0.0
        # per request
        self.sampler: Sampler | None = None
        self.stream: TextStream | None = None
        self.history: list[int] = []
        self.pending: int | None = None   # sampled, to be decoded in the next step
        self.n_gen = 0
        self.limit = 0
        self.logprobs: list[dict[str, Any]] = []

    @property
    def prefilling(self) -> bool:
        return self.req is not None and self.pending is None

    def prompt_left(self) -> int:
        return len(self.req.ids) - len(self.tokens) if self.req is not None and self.pending is None else 0


@dataclass
class Stats:
    requests: int = 0
    prompt_tokens: int = 0       # evaluated (cached ones not counted)
    cached_tokens: int = 0
    generated_tokens: int = 0
    steps: int = 0
    step_seconds: float = 0.0
    errors: int = 0
    losses: int = 0              # devices lost (failover)
    recoveries: int = 0          # placements made anew after a loss or to take servers back
    reattached: int = 0          # servers taken back
    recovery_seconds: float = 0.0  # the last re-placement's


class Engine:
    def __init__(self, model, n_parallel: int = 4, n_batch: int = 128, max_queue: int = DEFAULT_MAX_QUEUE) -> None:
        if n_parallel < 1:
            raise ValueError(f"n_parallel must be at least 1, not {n_parallel}")
        if n_batch < n_parallel:
            raise ValueError(f"n_batch ({n_batch}) must hold a token of each of the {n_parallel} slots")
        if n_batch > model.context.n_ubatch:
            raise ValueError(f"n_batch ({n_batch}) must fit in the context's ubatch ({model.context.n_ubatch} tokens): "
                             f"a step is one ubatch, so that no sequence's tokens are cut between two")
        if getattr(model, "engine", None) is not None:
            raise RuntimeError("this model is already served by an Engine")
        self.model = model
        self.ctx = model.context
        self.ctx.clear_cache()
        self.n_ctx = self.ctx.n_ctx
        if self.n_ctx % PAGE:
            raise ValueError(f"an Engine needs a context of whole {PAGE}-cell pages, not {self.n_ctx} cells")
        self.n_batch = n_batch
        self.max_queue = max_queue
        self.slots = [Slot(i) for i in range(n_parallel)]
        self.queue: deque[Request] = deque()
        self.stats = Stats()
        self.failure: str | None = None
        self.recovering: str | None = None  # what is being placed anew now (the steps wait meanwhile)
        self._closed = False
        self._returned: list = []  # devices of lost servers that answer again, for the next step boundary
        self._cond = threading.Condition()
        model.engine = self
        self._thread = threading.Thread(target=self._loop, name="pyggml-engine", daemon=True)
        self._thread.start()
        # lost servers are tried again in the background, with failover or without: a server
        # that comes back is taken back (without failover the engine serves again only then)
        self._prober = threading.Thread(target=self._probe, name="pyggml-reattach", daemon=True)
        self._prober.start()

    # -- submitting ---------------------------------------------------------------------------------
    @property
    def n_parallel(self) -> int:
        return len(self.slots)

    def prompt_ids(self, prompt: str | Sequence[int] | None = None,
                   messages: Sequence[dict[str, Any]] | None = None) -> list[int]:
        """The tokens of a completion prompt (text or ids) or of a chat (through the template)."""
        if messages is not None:
            return self.model.apply_chat_template(messages)
        if isinstance(prompt, str):
            return self.model.tokenize(prompt)
        return [int(t) for t in prompt or []]

    def check_prompt(self, ids: list[int]) -> None:
        if not ids:
            raise ValueError("the prompt has no tokens")
        if len(ids) > self.n_ctx:
            raise ValueError(f"the prompt has {len(ids)} tokens, more than the context of {self.n_ctx} "
                             f"(-c/--ctx-size) can hold")
        self.ctx.check_tokens(np.asarray(ids, dtype=np.int64))

    def start(self, ids: list[int], options: Options, sink: Callable[[Event], None]) -> Request:
        """Queue a request; ``sink`` is called from the engine's thread with each Event."""
        self.check_prompt(ids)
        req = Request(self, ids, options, sink)
        with self._cond:
            if self.failure is not None or self._closed:
                raise EngineStopped(self.failure or "the engine is closed")
            if len(self.queue) >= self.max_queue:
                raise QueueFullError(f"all {self.n_parallel} slots are busy and {len(self.queue)} requests wait")
            self.queue.append(req)
            self.stats.requests += 1
            self._cond.notify_all()
        return req

    def submit(self, prompt: str | Sequence[int] | None = None, *, messages: Sequence[dict[str, Any]] | None = None,
               stream: bool = True, max_tokens: int | None = None, temperature: float = 0.8, top_k: int = 40,
               top_p: float = 0.95, min_p: float = 0.05, repeat_penalty: float = 1.0,
               frequency_penalty: float = 0.0, presence_penalty: float = 0.0, seed: int | None = None,
               stop: str | Sequence[str] | None = None, logprobs: int | None = None,
               include_usage: bool = False, logit_bias: dict[int, float] | None = None):
        """Complete ``prompt`` or answer ``messages``: an iterator of OpenAI-shaped chunks
        (``stream``) or the whole reply as a dict.  Safe to call from several threads;
        closing the iterator early cancels the request."""
        kind = "chat" if messages is not None else "text"
        ids = self.prompt_ids(prompt, messages)
        options = Options(max_tokens, SamplingParams(temperature, top_k, top_p, min_p, repeat_penalty,
                                                     frequency_penalty=frequency_penalty,
                                                     presence_penalty=presence_penalty,
                                                     logit_bias=checked_logit_bias(logit_bias, self.model.n_vocab)),
                          seed, [stop] if isinstance(stop, str) else list(stop or []), logprobs)
        events: queue.Queue[Event] = queue.Queue()
        req = self.start(ids, options, events.put)
        shape = Shape(kind, self.model.name)
        replies = Replies(shape, kind, self.model.tokenizer, include_usage)
        if not stream:
            try:
                while True:
                    ev = events.get()
                    if ev.kind == "error":
                        raise EngineStopped(ev.error)
                    replies.add(ev)
                    if ev.kind == "done":
                        return replies.reply()
            finally:
                req.cancel()
        return self._chunks(req, events, replies)

    @staticmethod
    def _chunks(req: Request, events: queue.Queue, replies: Replies) -> Iterator[dict[str, Any]]:
        try:
            yield from replies.first()
            while True:
                ev = events.get()
                if ev.kind == "error":
                    raise EngineStopped(ev.error)
                yield from replies.chunks(ev)
                if ev.kind == "done":
                    return
        finally:
            req.cancel()  # a no-op once it is done; frees the slot of an abandoned stream

    # -- state --------------------------------------------------------------------------------------
    @property
    def busy_slots(self) -> int:
        return sum(s.req is not None for s in self.slots)

    @property
    def queued(self) -> int:
        return len(self.queue)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout=30)
        if self._prober is not None:
            self._prober.join(timeout=10)
        for d in self._returned:
            d.conn.close("the engine closed")
        self.model.engine = None

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _wake(self) -> None:
        with self._cond:
            self._cond.notify_all()

    # -- the step loop ------------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._cond:
                while (not self._closed and not self._returned
                       and not (self.failure is None and (self.queue or any(s.req for s in self.slots)))):
                    self._cond.wait()
                if self._closed:
                    self._fail_all("the server is shutting down")
                    return
                returned, self._returned = self._returned, []
                if not returned:
                    self._admit()
            if returned:  # at a step boundary: the requests running pause while the model is placed anew
                self._attach(returned)
                continue
            try:
                self.step()
            except Exception as e:  # a lost device, or a bug: no request may hang on it
                if not self._fail_over(e):
                    self._on_step_failure(e)

    def _probe(self) -> None:
        """(a thread of its own) Try the lost servers every REATTACH_INTERVAL_S; hand those
        that answer to the step loop.  Connecting may take seconds: no step waits on it."""
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._closed, timeout=REATTACH_INTERVAL_S)
                if self._closed:
                    return
                if self._returned or not self.model.lost_endpoints:
                    continue
            back = self.model.probe_lost()
            if back:
                with self._cond:
                    self._returned += back
                    self._cond.notify_all()

    def _attach(self, devices: list) -> None:
        from pyggml.rpc import RPCError
        names = ", ".join(dict.fromkeys(d.conn.endpoint for d in devices))
        self.recovering = f"taking {names} back"
        t0 = time.perf_counter()
        try:
            back = self.model.attach(devices)
        except RPCError as e:  # lost while placing anew: a loss like any other
            self.recovering = None
            if not self._fail_over(e):
                self._on_step_failure(e)
            return
        except Exception as e:  # noqa: BLE001 - the model stays as it was placed: keep serving
            log.warning("taking %s back failed: %s", names, e)
            self.recovering = None
            return
        self.recovering = None
        self.ctx = self.model.context
        if back:
            self.stats.reattached += len(back)
            self._recovered(time.perf_counter() - t0)
            log.warning("reattached %s", ", ".join(back))

    def _recovered(self, seconds: float) -> None:
        self.stats.recoveries += 1
        self.stats.recovery_seconds = seconds
        with self._cond:
            if self.failure is not None:  # placed again: new requests are welcome
                log.warning("serving again")
                self.failure = None
                self._cond.notify_all()

    def _fail_over(self, e: Exception) -> bool:
        """A lost RPC server with the model's ``failover`` on: the model moves its layers and
        rebuilds the live cells (every sequence's bits as before), and the failed step runs
        again; the requests in flight only see a pause.  If no placement fits what is left,
        they end with that error, and the engine waits for servers to come back."""
        from pyggml.rpc import RPCError
        if not (isinstance(e, RPCError) and self.model.failover):
            return False
        self.stats.losses += 1
        last = self.stats.recovery_seconds
        self.recovering = f"lost {e.endpoint}" + (f"; recovering, expected within {last + 1:.0f} s" if last else "")
        t0 = time.perf_counter()
        try:
            self.model._recover(e)
        except Exception as again:  # noqa: BLE001 - no room left: fail what runs, wait for servers
            self.recovering = None
            self._on_step_failure(again)
            return True
        self.recovering = None
        self.ctx = self.model.context
        self._recovered(time.perf_counter() - t0)
        return True

    def _on_step_failure(self, e: Exception) -> None:
        from pyggml.rpc import RPCError
        message = str(e) or type(e).__name__
        log.error("decoding failed: %s", message, exc_info=not isinstance(e, RPCError))
        self.stats.errors += 1
        if isinstance(e, RPCError) and not self.model.failover:
            try:  # the lost server joins lost_endpoints, which the prober tries again
                self.model._drop_dead(self.model._culprit(e))
            except Exception as again:  # noqa: BLE001 - closing what is gone
                log.debug("forgetting the lost server: %s", again)
        with self._cond:
            if isinstance(e, RPCError):
                self.failure = f"lost a device: {message}"
                if self.model.failover:  # the prober keeps trying the lost servers
                    self.failure = (f"recovering: {self.failure}; serving again once enough servers are back "
                                    f"(tried every {REATTACH_INTERVAL_S:.0f} s)")
                else:
                    self.failure += (f"; serving again when it is back (tried every {REATTACH_INTERVAL_S:.0f} s): "
                                     f"restart it, or restart this server, or use --failover to go on with "
                                     f"the servers left")
            self._fail_all(message if self.failure is None else self.failure, queued=self.failure is not None)
        for s in self.slots:  # their cells may hold half-written steps
            s.tokens = []
        try:
            self.model.forget_history()
        except Exception as again:  # noqa: BLE001 - the cache's servers may be gone: nothing to keep
            log.debug("clearing the cache after a failure: %s", again)

    def _fail_all(self, message: str, queued: bool = True) -> None:
        for s in self.slots:
            if s.req is not None:
                s.req.sink(Event("error", error=message))
                self._release(s)
        while queued and self.queue:
            self.queue.popleft().sink(Event("error", error=message))

    # cells come in pages (kv_cache.PAGE); the bookkeeping below counts pages
    def _pages_needed(self, s: Slot, owned: dict) -> int:
        """Pages an admitted request still needs: the rest of its prompt and one token more."""
        start = len(s.tokens)
        end = len(s.req.ids) + 1 if s.pending is None else start + 1
        return self.ctx.kv.pages_for(s.seq, start, end, owned)

    def _admit(self) -> None:
        """Move queued requests into idle slots, in arrival order (called holding the lock)."""
        kv = self.ctx.kv
        while self.queue:
            req = self.queue[0]
            if req.cancelled:
                self.queue.popleft()
                continue
            idle = [s for s in self.slots if s.req is None]
            if not idle:
                return
            slot = max(idle, key=lambda s: (_common(s.tokens, req.ids), -s.last_used))
            cached = reusable_prefix(_common(slot.tokens, req.ids), len(req.ids), self.ctx.n_ubatch)
            owned = kv._owned()
            kept = -(-cached // PAGE)  # the slot's pages that the shared prefix keeps
            need = len(req.ids) // PAGE - cached // PAGE + 1 - (1 if cached % PAGE else 0)
            room = (kv.free_pages + kv.seq_pages(slot.seq) - kept
                    + sum(kv.seq_pages(s.seq) for s in idle if s is not slot)
                    - sum(self._pages_needed(s, owned) for s in self.slots if s.req is not None))
            if need > room:
                return  # waits until running requests give cells back
            self.queue.popleft()
            self._assign(slot, req, cached)

    def _assign(self, slot: Slot, req: Request, cached: int) -> None:
        self.ctx.seq_rm(slot.seq, cached)
        slot.tokens = slot.tokens[:cached]
        slot.req = req
        o = req.options
        slot.sampler = Sampler(o.sampling, o.seed)
        slot.stream = TextStream(self.model.tokenizer, o.stop)
        slot.history = list(req.ids)
        slot.pending = None
        slot.n_gen = 0
        slot.limit = o.max_tokens if o.max_tokens is not None and o.max_tokens > 0 else self.n_ctx
        slot.logprobs = []
        req.usage.cached_tokens = cached
        self.stats.cached_tokens += cached

    def _release(self, slot: Slot) -> None:
        slot.req = None
        slot.sampler = slot.stream = None
        slot.pending = None
        slot.last_used = time.monotonic()

    def _make_room(self, pages: int) -> None:
        """Free idle slots' cells, least recently used first, until ``pages`` pages are free."""
        kv = self.ctx.kv
        for s in sorted((s for s in self.slots if s.req is None and s.tokens), key=lambda s: s.last_used):
            if kv.free_pages >= pages:
                return
            self.ctx.seq_rm(s.seq, 0)
            s.tokens = []

    def step(self) -> None:
        """Decode one batch and hand each sequence its next token."""
        for s in self.slots:
            if s.req is not None and s.req.cancelled:
                self._release(s)
        generating = [s for s in self.slots if s.req is not None and s.pending is not None]
        prefilling = sorted((s for s in self.slots if s.prefilling), key=lambda s: s.req.t_submit)
        if not generating and not prefilling:
            return
        kv = self.ctx.kv
        owned = kv._owned()
        self._make_room(sum(self._pages_needed(s, owned) for s in generating + prefilling))
        owned = kv._owned()
        free = kv.free_pages
        gen_pages = [kv.pages_for(s.seq, len(s.tokens), len(s.tokens) + 1, owned) for s in generating]
        while sum(gen_pages) > free:  # no cell left for its next token
            gen_pages.pop()
            self._finish(generating.pop(), "length")
        free -= sum(gen_pages)
        budget = self.n_batch - len(generating)
        parts: list[tuple[Slot, list[int]]] = [(s, [s.pending]) for s in generating]
        for s in prefilling:
            done, left = len(s.tokens), len(s.req.ids) - len(s.tokens)
            # positions that fit: the rest of the page holding `done`, if the slot owns it, and free pages
            room = free * PAGE + ((PAGE - done % PAGE) if done % PAGE else 0)
            n = prompt_cut(done, len(s.req.ids), min(budget, room), self.ctx.n_ubatch)
            if n == 0 and len(parts) == len(generating):  # a budget under 16: progress before bits
                n = min(budget, left, room)
            if n <= 0:
                continue
            free -= kv.pages_for(s.seq, done, done + n, owned)
            budget -= n
            parts.append((s, s.req.ids[done:done + n]))
        if not parts:
            return
        batch = Batch(np.array([t for _, c in parts for t in c], dtype=np.int32),
                      np.array([len(s.tokens) + i for s, c in parts for i in range(len(c))], dtype=np.int32),
                      np.array([s.seq for s, c in parts for _ in c], dtype=np.int32),
                      np.array([i == len(c) - 1 and (s.pending is not None or len(s.tokens) + len(c) == len(s.req.ids))
                                for s, c in parts for i in range(len(c))], dtype=bool))
        out_slots = [s for (s, c) in parts if s.pending is not None or len(s.tokens) + len(c) == len(s.req.ids)]
        n_top, hist = self._top_request(out_slots)
        t0 = time.perf_counter()
        try:
            logits = self.ctx.decode_batch(batch, n_top, hist)
        except ContextFullError:  # cannot happen with the room made above; said loudly if it does
            raise RuntimeError("KV cache bookkeeping error: a batch found fewer free cells than counted") from None
        self.stats.steps += 1
        self.stats.step_seconds += time.perf_counter() - t0
        row = 0
        for s, chunk in parts:
            s.tokens.extend(chunk)
            if s.pending is None:
                self.stats.prompt_tokens += len(chunk)
                if len(s.tokens) < len(s.req.ids):
                    continue  # more of the prompt to read
            if n_top:
                ids, values, hist_values = logits.row(row)
                token = s.sampler.sample_top(ids, values, hist[row], hist_values, s.history)
                self._take(s, token, None)
            else:
                self._take(s, s.sampler.sample(logits[row], s.history), logits[row])
            row += 1

    def _top_request(self, out_slots: list[Slot]) -> tuple[int, np.ndarray | None]:
        """What the step's output rows need of the vocabulary: the top n_top logits of each
        row and the logits of each row's recent tokens (for the penalties), or - when a row
        samples from the whole row or wants logprobs - whole rows (n_top 0)."""
        vocab = self.model.n_vocab
        needs = [s.sampler.n_top(vocab) if s.req.options.logprobs is None else 0 for s in out_slots]
        if not needs or min(needs) == 0:
            return 0, None
        n_hist = max(s.sampler.n_watched(self.n_ctx) for s in out_slots)
        hist = np.stack([s.sampler.watched(s.history, n_hist) for s in out_slots])
        return max(needs), hist

    def _take(self, s: Slot, token: int, logits: np.ndarray | None) -> None:
        req = s.req
        if self.model.tokenizer.is_eog(token):
            self._finish(s, "stop")
            return
        s.n_gen += 1
        req.usage.completion_tokens += 1
        self.stats.generated_tokens += 1
        s.history.append(token)
        if req.options.logprobs is not None:
            s.logprobs.append(self._logprob_entry(logits, token, req.options.logprobs))
        piece = s.stream.push(token)
        if piece:
            req.sink(Event("piece", piece, s.logprobs))
            s.logprobs = []
        if s.stream.stopped:
            self._finish(s, "stop")
        elif s.n_gen >= s.limit:
            self._finish(s, "length")
        else:
            s.pending = token

    def _logprob_entry(self, logits: np.ndarray, token: int, k: int) -> dict[str, Any]:
        z = logits.astype(np.float64)
        lse = float(np.log(np.exp(z - z.max()).sum()) + z.max())
        top = np.argpartition(-z, k - 1)[:k] if 0 < k < z.size else np.arange(0)
        top = top[np.argsort(-z[top], kind="stable")]
        text = self.model.tokenizer.detokenize
        return {"id": token, "token": text([token]), "logprob": float(z[token] - lse),
                "top": [(int(t), text([int(t)]), float(z[t] - lse)) for t in top]}

    def _finish(self, s: Slot, reason: str) -> None:
        req = s.req
        tail = s.stream.flush()  # text held back for a stop string that never came
        if tail or s.logprobs:
            req.sink(Event("piece", tail, s.logprobs))
        req.sink(Event("done", finish=reason, usage=req.usage))
        self._release(s)


def _common(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class Replies:
    """Engine events -> OpenAI chunks (streamed) or one reply (not streamed)."""

    def __init__(self, shape: Shape, kind: str, tokenizer, include_usage: bool = False) -> None:
        self.shape, self.kind, self.include_usage = shape, kind, include_usage
        self.parts: list[str] = []
        self.logprobs: list[dict[str, Any]] = []
        self.finish: str | None = None
        self.usage: Usage | None = None
        self.offset = 0

    def _lp(self, entries: list[dict[str, Any]]) -> dict[str, Any] | None:
        if not entries:
            return None
        if self.kind == "chat":
            return {"content": [{"token": e["token"], "logprob": e["logprob"], "bytes": list(e["token"].encode()),
                                 "top_logprobs": [{"token": t, "logprob": lp, "bytes": list(t.encode())}
                                                  for _, t, lp in e["top"]]} for e in entries]}
        offsets = []
        for e in entries:
            offsets.append(self.offset)
            self.offset += len(e["token"])
        return {"tokens": [e["token"] for e in entries], "token_logprobs": [e["logprob"] for e in entries],
                "top_logprobs": [{t: lp for _, t, lp in e["top"]} for e in entries], "text_offset": offsets}

    def first(self) -> list[dict[str, Any]]:
        role = self.shape.role_chunk()
        return [role] if role is not None else []

    def chunks(self, ev: Event) -> list[dict[str, Any]]:
        if ev.kind == "piece":
            return [self.shape.chunk(ev.text, None, self._lp(ev.logprobs))]
        out = [self.shape.chunk(None, ev.finish)]
        if self.include_usage:
            out.append(self.shape.usage_chunk(ev.usage))
        return out

    def add(self, ev: Event) -> None:
        if ev.kind == "piece":
            self.parts.append(ev.text)
            self.logprobs.extend(ev.logprobs)
        elif ev.kind == "done":
            self.finish, self.usage = ev.finish, ev.usage

    def reply(self) -> dict[str, Any]:
        has_lp = bool(self.logprobs)
        lp = self._lp(self.logprobs) if has_lp else None
        return self.shape.reply("".join(self.parts), self.finish, self.usage, lp)
