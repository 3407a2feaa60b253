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

The engine has no HTTP and no OpenAI in it: ``start`` queues a request (from any thread) and
delivers its events - text pieces, the end, an error - to a callback; server/openai.py makes
OpenAI's objects of them (``submit``: the engine's requests as OpenAI's chunks or replies).  When a device is lost (an RPC server died) the
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
read (pyggml.batch_rules: BatchRules.prompt_cut, reusable_prefix).
"""
from __future__ import annotations

import bisect
import gc
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .completion import Usage
from .context import ContextFullError, Padding
from .kv_cache import KV_PAD, KV_PAD_MAX, kv_padded
from .runner import Generation, Runner, Took, shape_bucket
from .scheduler import Scheduler, Slot, StepPlan
from .sampling import Sampler, SamplingParams

log = logging.getLogger("pyggml.engine")

DEFAULT_MAX_QUEUE = 64
REATTACH_INTERVAL_S = 2.0
MAX_EVENTS = 64
CLUSTER_REFRESH_S = 2.0
IDLE_CHECK_S = 2.0  # an idle engine asks its RPC servers this often whether they are leaving
KEPT_PROMPT_GRAPHS = 16  # graphs kept beside the decoding steps' (Context.keep_graphs): prompts' and mixed steps'
# a step of generating streams that would read prompts with a graph of a new shape decodes the
# streams alone and prepares one part of that graph (Context.prepare_part); after this many
# such steps in a row the prompts are read anyway (the shapes kept changing under it)
MAX_DEFERRED_STEPS = 8
# steps that read prompts are padded to a few shapes, built while idle (Context.padding), so
# that a prompt of a new length builds no graph; off, each new length is a graph built (beside
# the streams' steps, as above)
PAD_PROMPT_SHAPES = True
# an idle engine's first admission waits at most ADMIT_WINDOW_S for a burst to arrive, and no
# longer than ADMIT_QUIET_S after the last request of it (Engine._gather): short, since a prompt
# that comes later is read beside the streams in chunks, from a copy of a shared prefix, and
# every ms here is a ms more to a first token
ADMIT_WINDOW_S = 0.015
ADMIT_QUIET_S = 0.003
COPY_SHAPE = "copy"  # _warm_shapes' mark for Context.prepare_copy's graph
SLOW_STEP_S = 0.05  # a step slower than this is logged (at debug level), with what it held
STEP_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)  # seconds: a step's wall time, for Stats


class GCPauses:
    """How long Python's garbage collector stopped the process (every thread: the step loop
    too), by generation, from ``gc.callbacks``; installed once, by the first Engine."""

    def __init__(self) -> None:
        self.seconds = [0.0, 0.0, 0.0]
        self.collections = [0, 0, 0]
        self._t0 = 0.0
        self._installed = False

    def install(self) -> None:
        if not self._installed:
            gc.callbacks.append(self._callback)
            self._installed = True

    def _callback(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        elif phase == "stop":
            g = info.get("generation", 0)
            self.seconds[g] += time.perf_counter() - self._t0
            self.collections[g] += 1


GC_PAUSES = GCPauses()


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
    departures: int = 0          # servers that left (SIGTERM) and were let go
    joined: int = 0              # servers found on the network while serving (--rpc auto), taken in
    recoveries: int = 0          # placements made anew after a loss or to take servers back
    reattached: int = 0          # servers taken back
    recovery_seconds: float = 0.0  # the last re-placement's
    # where a step's time goes (bench/serve.py --profile reads them from /metrics): admission
    # and batch making, graphs of new shapes (inside step_seconds), sampling and handing out text
    schedule_seconds: float = 0.0
    graph_builds: int = 0            # in steps: a step waited for them
    graph_builds_decoding: int = 0   # of those, in steps that read no prompt (only the shapes ahead avoid them)
    graph_builds_streaming: int = 0  # of those, in steps of streams already generating (a stall they see)
    graph_seconds: float = 0.0
    graphs_ahead: int = 0            # built while idle
    graph_parts_beside: int = 0      # steps that left their prompts for later, preparing a part of their graph
    copied_tokens: int = 0           # of the cached ones, copied from another slot holding the same prefix
    prompts_answered: int = 0        # requests whose first token came from the stored answer to their prompt
    mixed_steps: int = 0             # steps that read prompts beside generating streams (which wait for them)
    lane_steps: int = 0              # decoding steps sent while another was on the servers (pipelined lanes)
    sample_seconds: float = 0.0
    # steps by wall time, from admission to the last token handed out: counts per STEP_BUCKETS
    # bound (the last one unbounded) - a stall is a step in the top buckets
    step_buckets: list[int] = field(default_factory=lambda: [0] * (len(STEP_BUCKETS) + 1))
    slowest_step: float = 0.0

    def count_step(self, seconds: float) -> None:
        self.step_buckets[bisect.bisect_left(STEP_BUCKETS, seconds)] += 1
        self.slowest_step = max(self.slowest_step, seconds)


@dataclass
class InFlight:
    """A decoding step of one lane, sent to the servers and not yet read back (Engine._lane_step)."""
    parts: list[tuple[Slot, list[int]]]
    out_slots: list[Slot]
    gens: list[Generation]
    n_top: int
    hist: np.ndarray | None
    collect: Callable[[], Any]   # Context.submit_batch's: the step's logits, or their top
    t_start: float
    t_sent: float


class Engine:
    def __init__(self, model, n_parallel: int = 4, n_batch: int = 128, max_queue: int = DEFAULT_MAX_QUEUE,
                 prompt_budget: int | None = None) -> None:
        if n_parallel < 1:
            raise ValueError(f"n_parallel must be at least 1, not {n_parallel}")
        if n_batch < n_parallel:
            raise ValueError(f"n_batch ({n_batch}) must hold a token of each of the {n_parallel} slots")
        if n_batch > model.context.n_ubatch:
            raise ValueError(f"n_batch ({n_batch}) must fit in the context's ubatch ({model.context.n_ubatch} tokens): "
                             f"a step is one ubatch, so that no sequence's tokens are cut between two")
        if model.engine is not None:
            raise RuntimeError("this model is already served by an Engine")
        self.model = model
        self.ctx = model.context
        self.ctx.clear_cache()
        self.n_ctx = self.ctx.n_ctx
        self.rules = self.ctx.rules
        if self.n_ctx % self.rules.kv_page:
            raise ValueError(f"an Engine needs a context of whole {self.rules.kv_page}-cell pages, "
                             f"not {self.n_ctx} cells")
        self.n_batch = n_batch
        self.prompt_budget = prompt_budget
        self.max_queue = max_queue
        self.runner = Runner(model.n_vocab, self.n_ctx)
        self.slots = [Slot(i) for i in range(n_parallel)]
        self._use_context(self.ctx)
        self.queue: deque[Request] = deque()
        self.stats = Stats()
        self.events: deque[dict[str, Any]] = deque(maxlen=MAX_EVENTS)  # joined, left, lost, placed anew
        self._cluster: list[dict[str, Any]] = []  # cluster_devices(), refreshed by the step loop
        self._cluster_at = 0.0
        self._watcher = None
        self.failure: str | None = None
        self._deferred = 0  # steps in a row that left their prompts for later (_prepare_beside)
        self._in_flight: deque[InFlight] = deque()  # lanes' steps on the servers, oldest first
        self._lane_read = 0.0  # when the last lane's step was read back
        self.recovering: str | None = None  # what is being placed anew now (the steps wait meanwhile)
        self._closed = False
        self._returned: list = []  # devices of lost servers that answer again, for the next step boundary
        self._cond = threading.Condition()
        model.engine = self
        GC_PAUSES.install()
        # the decoding steps' likely shapes, built while the engine is idle (_loop), so that a
        # stream joining or leaving does not stop the others while a graph is built
        self._warm: deque[tuple[int, ...]] = self._warm_shapes()
        self.ctx.keep_graphs(len(self._warm) + KEPT_PROMPT_GRAPHS)
        self._thread = threading.Thread(target=self._loop, name="pyggml-engine", daemon=True)
        self._thread.start()
        # lost servers are tried again in the background, with failover or without: a server
        # that comes back is taken back (without failover the engine serves again only then)
        self._prober = threading.Thread(target=self._probe, name="pyggml-reattach", daemon=True)
        self._prober.start()
        # a model placed over the servers found on the network (--rpc auto) takes in those that
        # appear later, at a step boundary, as it takes back lost ones
        if model.discovers:
            from pyggml.rpc.discovery import Watcher
            self._watcher = Watcher(self._found)

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
        if not self.scheduler.fits(len(ids)):
            raise ValueError(f"the prompt has {len(ids)} tokens, more than the context of {self.n_ctx} "
                             f"(-c/--ctx-size) can hold with a token of the answer")
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
        if self._watcher is not None:
            self._watcher.close()
        self._thread.join(timeout=30)
        if self._prober is not None:
            self._prober.join(timeout=10)
        for d in self._returned:
            d.conn.close("the engine closed")
        self.ctx.padding = None
        self.model.engine = None

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _wake(self) -> None:
        with self._cond:
            self._cond.notify_all()

    # -- graphs built ahead -------------------------------------------------------------------------
    def _warm_shapes(self) -> deque[tuple[int, ...]]:
        """The shapes of decoding steps (one token of each of 1 .. n_parallel sequences) over
        the cells read while few tokens are live (up to KV_PAD_MAX), with the top of greedy and
        of the default sampling: most likely first."""
        tops = dict.fromkeys(self._top_of(p) for p in (SamplingParams(temperature=0.0), SamplingParams()))
        n_kvs = dict.fromkeys(min(self.n_ctx, kv_padded(cells)) for cells in range(1, KV_PAD_MAX + 1, KV_PAD))
        # and the padded shapes of steps that read prompts (Context.padding), beside streams or not
        sizes = self.ctx.padding.tokens if self.ctx.padding is not None else ()
        outputs = self.ctx.padding.output_counts(self.n_parallel) if self.ctx.padding is not None else ()
        shapes = (shape for n_kv in n_kvs for top in tops
                  for shape in [*(self.ctx.decode_shape(g, n_kv, top) for g in range(1, self.n_parallel + 1)),
                                *(self.ctx.prompt_shape(n, n_kv, top, n_outputs=k) for k in outputs for n in sizes)])
        # first the largest step (every token of the batch, every cell, whole rows of logits):
        # the compute buffers take its size at once, as llama.cpp's scheduler reserves them;
        # a buffer that grew later would leave every kept graph to be planned again
        p = self.n_parallel
        largest = (self.n_batch, self.n_ctx, p, 0, 0, p, p)
        # and the copy of a page of a slot's prefix to another (Scheduler's donors: a system prompt)
        copy = (COPY_SHAPE, self.rules.kv_page) if self.scheduler.seq_cp is not None else None
        return deque(dict.fromkeys(s for s in (largest, *shapes, copy) if s is not None))

    def _top_of(self, params: SamplingParams) -> int:
        """The top k of the vocabulary a step asks for where ``params`` sample (Runner.top_request)."""
        return shape_bucket(Sampler(params).n_top(self.model.n_vocab))

    def wait_built_ahead(self, timeout: float | None = None) -> bool:
        """Wait until the shapes built ahead are all built (True), or ``timeout`` seconds."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._warm or self._closed, timeout)

    @property
    def warming(self) -> int:
        """Shapes still to be built ahead (0: every decoding step of the usual shapes finds its graph)."""
        return len(self._warm)

    def _build_ahead(self, shape: tuple) -> None:
        try:
            if self.ctx.prepare_copy(shape[1]) if shape[0] == COPY_SHAPE else self.ctx.prepare(shape):
                self.stats.graphs_ahead += 1
        except Exception as e:  # noqa: BLE001 - a step of that shape will build it, and say what fails
            log.debug("building the graph of %s ahead failed: %s", shape, e)
        if not self._warm:
            self._wake()  # wait_built_ahead

    # -- the step loop ------------------------------------------------------------------------------
    def _has_work(self) -> bool:
        return self.failure is None and bool(self.queue or any(s.req for s in self.slots))

    def _loop(self) -> None:
        while True:
            ahead = idle = None
            with self._cond:
                while not self._closed and not self._returned and not self._has_work():
                    if self._warm:  # idle: build a shape a step would otherwise wait for
                        ahead = self._warm.popleft()
                        break
                    if not self._cond.wait(IDLE_CHECK_S) and self.model.rpc_devices:
                        idle = True  # nothing to do for a while: are the servers staying?
                        break
            if ahead is not None:
                self._build_ahead(ahead)
                continue
            if idle:
                self._check_leaving()
                self._refresh_cluster()
                continue
            with self._cond:
                if self._closed:
                    self._drop_in_flight()
                    self._fail_all("the server is shutting down")
                    return
                returned, self._returned = self._returned, []
                t_step = time.perf_counter()
                if not returned and self.busy_slots == 0 and self.queue and not self._answerable(self.queue[0]):
                    self._gather(t_step)
                if not returned:
                    self._admit()
            if returned:  # at a step boundary: the requests running pause while the model is placed anew
                try:
                    self._drain()
                except Exception as e:  # noqa: BLE001 - the placement anew replays what was computed
                    log.debug("reading the lanes' last steps before placing anew: %s", e)
                    self._drop_in_flight()
                self._attach(returned)
                continue
            try:
                self.step(t_step)
                self._refresh_cluster()
            except Exception as e:  # a lost device, or a bug: no request may hang on it
                self._drop_in_flight()  # (their tokens are decoded again, at the next step)
                e = self._blamed(e)
                if not self._fail_over(e):
                    self._on_step_failure(e)

    def _gather(self, t0: float) -> None:
        """(holding the lock; the engine was idle) Requests arriving together - a burst of
        clients - are admitted together, so that their prompts are read before any of them
        generates: a prompt read beside a generating stream stops it for as long.  Wait while
        requests keep coming, each within ADMIT_QUIET_S of the last, for ADMIT_WINDOW_S at most;
        a request alone waits ADMIT_QUIET_S."""
        while True:
            left = t0 + ADMIT_WINDOW_S - time.perf_counter()
            if left <= 0:
                return
            n = len(self.queue)
            self._cond.wait(min(ADMIT_QUIET_S, left))
            if len(self.queue) == n or self._closed:
                return

    def _answerable(self, req: Request) -> bool:
        """Whether an idle slot holds the answer to ``req``'s very prompt: it reads nothing, so
        its first token goes out at once, without waiting for a burst (a prompt that comes
        after it is read beside its stream, in chunks of the prompt budget)."""
        return any(s.req is None and len(s.tokens) >= len(req.ids) and s.tokens[:len(req.ids)] == req.ids
                   and self._answered(s, req) for s in self.slots)

    def _blamed(self, e: Exception) -> Exception:
        """An RPC error naming the server to blame (Recovery.blame asks every server once: a
        leaving one says so), anything else as it is."""
        from pyggml.rpc import RPCError
        return self.model.recovery.blame(e) if isinstance(e, RPCError) else e

    def _found(self, found) -> None:
        """(the discovery's thread) A server announced itself: connect, and hand its devices to
        the step loop, which places the model anew over them at the next step boundary."""
        from pyggml.models.model import connect_rpc
        if self._closed or found.endpoint in {d.conn.endpoint for d in self.model.rpc_devices}:
            return
        devices = connect_rpc(found.endpoint, self.model.rpc_key, connect_timeout=5.0)
        log.warning("found %s: taking it in", found.describe())
        self._event("joined", found.endpoint)
        with self._cond:
            self.stats.joined += 1
            self._returned += devices
            self._cond.notify_all()

    def _check_leaving(self) -> None:
        """(idle) Ask each server whether it still serves; one that is leaving (SIGTERM) is let
        go now, its layers placed on the others, rather than at the next request - by then it
        may have given up waiting and gone."""
        from pyggml.rpc import ServerLeaving
        for conn in {id(d.conn): d.conn for d in self.model.rpc_devices}.values():
            if conn.closed_reason is None and conn.answers(timeout=2.0) and conn.leaving:
                self._fail_over(ServerLeaving(conn.endpoint, "leaving (asked while idle)"))
                return

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
            back = self.model.recovery.probe_lost()
            if back:
                with self._cond:
                    self._returned += back
                    self._cond.notify_all()

    def _attach(self, devices: list) -> None:
        from pyggml.rpc import RPCError
        names = ", ".join(dict.fromkeys(d.conn.endpoint for d in devices))
        returning = any(d.conn.endpoint in self.model.lost_endpoints for d in devices)  # else: found new
        self.recovering = f"taking {names} {'back' if returning else 'in'}"
        t0 = time.perf_counter()
        try:
            back = self.model.recovery.attach(devices)
        except RPCError as e:  # lost while placing anew: a loss like any other
            self.recovering = None
            if not self._fail_over(e):
                self._on_step_failure(e)
            return
        except Exception as e:  # noqa: BLE001 - the model stays as it was placed: keep serving
            log.warning("taking %s in failed: %s", names, e)
            self.recovering = None
            return
        self.recovering = None
        self._use_context(self.model.context)
        if back:
            self.stats.reattached += len(back)
            self._recovered(time.perf_counter() - t0)
            log.warning("%s %s", "reattached" if returning else "attached", ", ".join(back))

    def _event(self, kind: str, text: str) -> None:
        self.events.append({"time": time.time(), "event": kind, "detail": text})

    def cluster(self) -> dict[str, Any]:
        """The devices (what each holds, memory, bytes over its link: as the step loop last
        read them, every CLUSTER_REFRESH_S at most) and the recent events, for /cluster."""
        st = self.stats
        return {"devices": list(self._cluster), "events": list(self.events),
                "placing": self.recovering,
                "counts": {"joined": st.joined, "left": st.departures, "lost": st.losses,
                           "placed_anew": st.recoveries},
                "tokens_generated": st.generated_tokens, "decode_seconds": st.step_seconds, "steps": st.steps}

    def _refresh_cluster(self, force: bool = False) -> None:
        """(the step loop) Read the devices' state for cluster(), at most every CLUSTER_REFRESH_S."""
        now = time.monotonic()
        if not force and now - self._cluster_at < CLUSTER_REFRESH_S:
            return
        self._cluster_at = now
        try:
            self._cluster = self.model.cluster_devices()
        except Exception as e:  # noqa: BLE001 - a server lost meanwhile: the next step says so
            log.debug("reading the cluster's state: %s", e)

    def _recovered(self, seconds: float) -> None:
        self._event("placed anew", f"in {seconds:.1f} s: " + "; ".join(line.strip() for line in
                                                                        self.model.placement_lines()))
        self._refresh_cluster(force=True)
        self._warm = self._warm_shapes()  # a new context: its graphs are built again
        self.ctx.keep_graphs(len(self._warm) + KEPT_PROMPT_GRAPHS)
        self.stats.recoveries += 1
        self.stats.recovery_seconds = seconds
        with self._cond:
            if self.failure is not None:  # placed again: new requests are welcome
                log.warning("serving again")
                self.failure = None
                self._cond.notify_all()

    def _fail_over(self, e: Exception) -> bool:
        """A lost RPC server with the model's ``failover`` on, or one leaving (SIGTERM) either
        way: the model moves its layers and rebuilds the live cells (every sequence's bits as
        before), and the failed step runs again; the requests in flight only see a pause.  If
        no placement fits what is left, they end with that error, and the engine waits for
        servers to come back."""
        from pyggml.rpc import RPCError, ServerLeaving
        if not (isinstance(e, RPCError) and (self.model.failover or isinstance(e, ServerLeaving))):
            return False
        leaving = isinstance(e, ServerLeaving)
        if leaving:
            self.stats.departures += 1
        else:
            self.stats.losses += 1
        self._event("left" if leaving else "lost", e.endpoint)
        last = self.stats.recovery_seconds
        self.recovering = (f"{e.endpoint} is leaving" if leaving else f"lost {e.endpoint}") + \
            (f"; placing the model anew, expected within {last + 1:.0f} s" if last else "")
        t0 = time.perf_counter()
        try:
            self.model.recovery.recover(e)
        except Exception as again:  # noqa: BLE001 - no room left: fail what runs, wait for servers
            self.recovering = None
            self._on_step_failure(again)
            return True
        self.recovering = None
        self._use_context(self.model.context)
        self._recovered(time.perf_counter() - t0)
        return True

    def _on_step_failure(self, e: Exception) -> None:
        from pyggml.rpc import RPCError
        message = str(e) or type(e).__name__
        log.error("decoding failed: %s", message, exc_info=not isinstance(e, RPCError))
        self.stats.errors += 1
        if isinstance(e, RPCError) and not self.model.failover:
            try:  # the lost server joins lost_endpoints, which the prober tries again
                self.model.recovery.drop_dead(e)
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

    def _use_context(self, ctx) -> None:
        """The model's context (a new one after it was placed anew), and the scheduler over its cache."""
        self.ctx = ctx
        # pieces that read prompts padded to the shapes built ahead (not over pipelined servers:
        # a step's pieces are groups of its sequences there)
        greedy = self._top_of(SamplingParams(temperature=0.0))
        ctx.padding = (Padding.for_server(self.n_batch, self.n_parallel, greedy, ctx.hp.head_share)
                       if PAD_PROMPT_SHAPES and not ctx.n_micro else None)
        # (prefixes are copied between slots where steps are not pipelined over servers)
        self.scheduler = Scheduler(self.slots, ctx.kv, self.rules, self.n_batch, ctx.n_ubatch, ctx.seq_rm,
                                   self.prompt_budget, self._seq_cp if not ctx.n_micro else None)

    def _admit(self) -> None:
        """Move queued requests into idle slots, in arrival order (called holding the lock).
        One answered from its stored row takes its first token at once, and the prompts
        admitted with it are read beside its stream - as they would be had they come a moment
        later - where the prompt budget bounds that read: a step of one chunk at most, the stop
        in a stream this server accepts for any prompt that joins it (--prompt-chunk).  Beyond
        that (or with no budget) requests admitted together start together: it waits while the
        others' prompts are read, in steps where no stream generates, as a burst read in one
        batch would, and no stream of the burst stops after its first token for the others'."""
        admitted = self.scheduler.admit(self.queue, self._answered)
        reading = [(slot, req) for slot, req, _ in admitted if not slot.answering]
        to_read = sum(len(req.ids) - cached for slot, req, cached in admitted if not slot.answering)
        budget = self.scheduler.prompt_budget
        held_by = reading if budget is None or to_read > budget else []
        for slot, _, _ in admitted:
            slot.held_by = held_by if slot.answering else []
        for slot, req, cached in admitted:
            o = req.options
            slot.gen = Generation(slot.seq, req.ids, Sampler(o.sampling, o.seed), self.model.tokenizer, o.stop,
                                  o.max_tokens if o.max_tokens is not None and o.max_tokens > 0 else self.n_ctx,
                                  o.logprobs, special=self.model.harmony)
            req.usage.cached_tokens = cached
            self.stats.cached_tokens += cached

    def _seq_cp(self, src: int, dst: int, p0: int, p1: int) -> bool:
        if not self.ctx.seq_cp(src, dst, p0, p1):
            return False
        self.stats.copied_tokens += p1 - p0
        return True

    def _answered(self, slot: Slot, req: Request) -> bool:
        """Whether ``slot`` holds the answer to ``req``'s very prompt, usable by its sampler."""
        a = slot.answer
        if a is None or a.ids != tuple(req.ids):
            return False
        o = req.options
        return self.runner.answers(a, Sampler(o.sampling, o.seed), req.ids, o.logprobs is not None)

    def _release(self, slot: Slot) -> None:
        self.scheduler.release(slot)

    def step(self, t_start: float | None = None) -> None:
        """Decode one batch and hand each sequence its next token (``t_start``: when the
        step's admission began, for Stats)."""
        t_start = time.perf_counter() if t_start is None else t_start
        for s in self.slots:
            if s.req is not None and s.req.cancelled and not s.in_flight:
                self._release(s)
        for s in self.slots:
            if s.req is not None and s.answering and not any(o.req is r and o.prefilling for o, r in s.held_by):
                s.held_by = []  # its prompt's output is stored: no token read
                self.stats.prompts_answered += 1
                self._take(s, *self.runner.draw_answer(s.answer, s.gen))
        if self._lane_step(t_start):
            return
        plan = self.scheduler.plan()
        for s in plan.out_of_cells:
            self._finish(s, "length")
        if not plan.parts:
            return
        batch, out_slots = plan.batch()
        gens = [s.gen for s in out_slots]
        n_top, hist = self.runner.top_request(gens)
        if self._prepare_beside(plan, batch, n_top, hist):  # the streams alone, this step
            plan = StepPlan([(s, c) for s, c in plan.parts if s.pending is not None], [])
            batch, out_slots = plan.batch()
            gens = [s.gen for s in out_slots]
            n_top, hist = self.runner.top_request(gens)
        parts = plan.parts
        generating = [s for s, _ in parts if s.pending is not None]
        prompt_pieces = [c for s, c in parts if s.pending is None]
        t0 = time.perf_counter()
        timings = self.ctx.timings
        builds, graph_seconds = timings.graph_builds, timings.graph_seconds
        try:
            logits = self.ctx.decode_batch(batch, n_top, hist)
        except ContextFullError:  # cannot happen with the room made above; said loudly if it does
            raise RuntimeError("KV cache bookkeeping error: a batch found fewer free cells than counted") from None
        t1 = time.perf_counter()
        st = self.stats
        st.steps += 1
        st.step_seconds += t1 - t0
        st.schedule_seconds += t0 - t_start
        st.graph_builds += timings.graph_builds - builds
        if not prompt_pieces:
            st.graph_builds_decoding += timings.graph_builds - builds
        if generating:
            st.graph_builds_streaming += timings.graph_builds - builds
            st.mixed_steps += bool(prompt_pieces)
        st.graph_seconds += timings.graph_seconds - graph_seconds
        drawn = self.runner.sample(logits, gens, n_top, hist) if gens else []
        for i, s in enumerate(out_slots):
            if s.pending is None:  # its prompt's last token: the row is kept for the same prompt again
                s.answer = self.runner.answer_of(s.req.ids, logits, i, n_top, hist)
        self._hand_out(parts, drawn)
        t2 = time.perf_counter()
        st.sample_seconds += t2 - t1
        st.count_step(t2 - t_start)
        if t2 - t_start > SLOW_STEP_S and log.isEnabledFor(logging.DEBUG):
            log.debug("slow step: %.0f ms (batching %.0f, decoding %.0f of which %d new graphs %.0f, sampling %.0f): "
                      "%d generating, prompt pieces %s", 1e3 * (t2 - t_start), 1e3 * (t0 - t_start), 1e3 * (t1 - t0),
                      timings.graph_builds - builds, 1e3 * (timings.graph_seconds - graph_seconds), 1e3 * (t2 - t1),
                      len(generating), [len(c) for c in prompt_pieces])

    # -- pipelined lanes ----------------------------------------------------------------------------
    def _lane_step(self, t_start: float) -> bool:
        """With the layers over several servers (Context.n_groups), streams decode in lanes
        that do not wait for each other: a lane's step is sent, then the lane sent before it
        is read back and sampled, so that while the client reads one lane and sends its next
        step, the servers work on the other - each on a different lane, as a pipeline that
        never drains between steps.  (Within a step, decode_batch's groups pipeline too, but
        the step ends when its last group leaves the last server: with two servers, three
        stage times for two.)  True if this step was a lane's; False when the step must read
        prompts or too few streams run: the lanes are read back first (_drain) and the step
        is an ordinary one.  Each sequence's bits are its own whatever its lane.

        A lane may be one sequence: unlike the groups of one step (MIN_GROUP_TOKENS), lanes
        keep every server busy, so a lane of fewer columns costs no more than the whole batch
        would take to pass through the servers one after another."""
        lanes = self.ctx.n_groups
        if lanes < 2:
            return False
        plan = self.scheduler.plan()
        streams = len(plan.parts) + sum(len(f.out_slots) for f in self._in_flight)
        if any(s.pending is None for s, _ in plan.parts) or streams < lanes:
            self._drain()
            return False
        for s in plan.out_of_cells:
            self._finish(s, "length")
        parts = plan.parts
        if not self._in_flight:  # the first lane now; the others at the next steps
            parts = parts[:-(-len(parts) // lanes)]
        if parts:
            self._send_lane(parts, t_start)
        if self._in_flight and (len(self._in_flight) >= lanes or not parts):
            self._read_lane()
        return True

    def _send_lane(self, parts: list[tuple[Slot, list[int]]], t_start: float) -> None:
        batch, out_slots = StepPlan(parts, []).batch()
        gens = [s.gen for s in out_slots]
        n_top, hist = self.runner.top_request(gens)
        t_sent = time.perf_counter()
        collect = self.ctx.submit_batch(batch, n_top, hist)
        for s in out_slots:
            s.in_flight = True
        self._in_flight.append(InFlight(parts, out_slots, gens, n_top, hist, collect, t_start, t_sent))
        self.stats.lane_steps += 1

    def _read_lane(self) -> None:
        """The oldest lane's step read back, sampled and handed out."""
        f = self._in_flight[0]
        logits = f.collect()  # (if it fails, _drop_in_flight clears every lane's)
        self._in_flight.popleft()
        for s in f.out_slots:
            s.in_flight = False
        t1 = time.perf_counter()
        st = self.stats
        st.steps += 1
        st.step_seconds += t1 - max(f.t_sent, self._lane_read)  # (the lanes' times overlap: counted once)
        self._lane_read = t1
        drawn = self.runner.sample(logits, f.gens, f.n_top, f.hist)
        self._hand_out(f.parts, drawn)
        t2 = time.perf_counter()
        st.sample_seconds += t2 - t1
        st.count_step(t2 - f.t_start)

    def _drain(self) -> None:
        while self._in_flight:
            self._read_lane()

    def _drop_in_flight(self) -> None:
        """A step failed: the lanes' steps on the servers are given up (their sequences' next
        tokens are sent again; a placement anew rebuilds the cache from what was read back)."""
        for f in self._in_flight:
            for s in f.out_slots:
                s.in_flight = False
        self._in_flight.clear()

    def _prepare_beside(self, plan: StepPlan, batch, n_top: int, hist) -> bool:
        """Whether this step decodes its generating streams alone: it would also read prompts,
        with a graph not yet built and planned.  Building and planning one takes several times
        a decoding step; done whole inside the step, every stream would stall for it.  Instead
        each such step prepares one part of it (Context.prepare_part) beside the streams' own
        step, and the prompts are read once it is ready - up to MAX_DEFERRED_STEPS in a row."""
        if all(s.pending is None for s, _ in plan.parts) or all(s.pending is not None for s, _ in plan.parts):
            self._deferred = 0
            return False
        if self._deferred >= MAX_DEFERRED_STEPS:
            self._deferred = 0
            return False
        for shape in self.ctx.batch_shapes(batch, n_top, hist):
            if not self.ctx.prepare_part(shape):
                self.stats.graph_parts_beside += 1
                self._deferred += 1
                return True
        self._deferred = 0
        return False

    def _hand_out(self, parts: list[tuple[Slot, list[int]]], drawn: list[tuple[int, np.ndarray | None]]) -> None:
        """A step's results: each sequence's chunk counted in, and its drawn token taken."""
        row = 0
        for s, chunk in parts:
            s.tokens.extend(chunk)
            if s.pending is None:
                self.stats.prompt_tokens += len(chunk)
                if len(s.tokens) < len(s.req.ids):
                    continue  # more of the prompt to read
            self._take(s, *drawn[row])
            row += 1

    def _take(self, s: Slot, token: int, logits: np.ndarray | None) -> None:
        """The token drawn for a sequence: its text delivered, and decoded at the next step."""
        took = s.gen.take(token, logits)
        if took.counted:
            s.req.usage.completion_tokens += 1
            self.stats.generated_tokens += 1
        self._deliver(s, took)
        if took.finish is None:
            s.pending = token

    def _deliver(self, s: Slot, took: Took) -> None:
        """What a token gave, as the request's events; the slot freed at the end."""
        req = s.req
        if took.text or took.logprobs:
            req.sink(Event("piece", took.text, took.logprobs))
        if took.finish is not None:
            req.sink(Event("done", finish=took.finish, usage=req.usage))
            self._release(s)

    def _finish(self, s: Slot, reason: str) -> None:
        self._deliver(s, s.gen.end(reason))
