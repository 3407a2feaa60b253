"""The high-level Python API: ``pyggml.Model`` (shaped like llama-cpp-python's ``Llama``)."""
from __future__ import annotations

import logging
import os
import ssl
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

import pyggml
from pyggml.backend import Preparation

from . import hub

from .chat import ChatTemplate
from .completion import Usage, stop_list
from .harmony import HarmonyStream, is_harmony
from .context import Context, ContextFullError
from .loader import LoadedModel, default_devices, load_model
from .placement import spans
from .failover import Recovery
from .runner import Generation, Runner, Took
from .sampling import Sampler, SamplingParams, checked_logit_bias
from .tokenizer import Tokenizer

log = logging.getLogger("pyggml.models")


_tokenizers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _tokenizer_of(gguf) -> Tokenizer:
    """One tokenizer per opened GGUF (built in 0.1-0.3 s; shared, it holds no per-sequence state)."""
    tk = _tokenizers.get(gguf)
    if tk is None:
        tk = _tokenizers[gguf] = Tokenizer(gguf)
    return tk


def _prepare_cpu(path, progress: bool | None) -> Preparation | None:
    """What the CPU prepares for a GGUF file's model (its kernels compiled in other processes
    while this one loads: Device.prepare_for); None if the file's header cannot be read (the
    load that follows says why) or there is nothing to prepare."""
    from .loader import open_gguf
    try:
        f, arch = open_gguf(path)  # parsed once: the load that follows takes it from open_gguf's cache
    except (OSError, ValueError):
        return None
    return pyggml.cpu_device().prepare_for([(t.name, t.type, t.ne) for t in f.tensors.values()], arch.gate_name,
                                           None if progress is False else hub.say)


def connect_rpc(rpc: str | Sequence[str] | None, key: str | os.PathLike | ssl.SSLContext | None = None,
                connect_timeout: float | None = None, discover_timeout: float | None = None) -> list:
    """The devices of the RPC servers named by ``rpc`` (none when it is empty); ``key``: the
    clients' key file from ``pyggml-rpc-server --gen-key`` (or a TLS context made from it).
    ``"auto"`` / ``"auto:N"``: the servers announced on the network (rpc/discovery.py), looked
    for ``discover_timeout`` seconds."""
    if not rpc:
        return []
    from pyggml.rpc import connect, load_key
    from pyggml.rpc.discovery import connect_auto, parse_auto
    if isinstance(key, (str, os.PathLike)):
        key = load_key(key)
    if parse_auto(rpc) is not None:
        return connect_auto(rpc, key=key, timeout=discover_timeout, connect_timeout=connect_timeout)
    return connect(rpc, key=key, connect_timeout=connect_timeout)




@dataclass
class History:
    """What rebuilds a cache: the batches that wrote its live cells (Context.log), sequence
    0's tokens, and the context's shape."""
    log: list | None
    tokens: list[int]
    n_ctx: int
    n_ubatch: int
    timings: Any


class Model:
    """A GGUF model ready to tokenize, score and generate.

    ``path_or_alias``: a GGUF file or a known alias (``smollm2``, ``gemma3-270m``; None =
    the default model, downloaded once).  ``ngl``: layer placement as in ``pyggml-chat -ngl``
    (``"auto"``: spread by free memory, the default when ``rpc`` is given; otherwise None:
    everything on the CPU).  ``tensor_split``: proportions per device, as ``-ts 3,1``.
    ``split_mode``: "layer" (default: each device runs whole layers) or "tensor" (every
    layer's heads and rows divided among the RPC servers and GPUs, which then compute each
    step together; the logits are those of one device) or "auto" (tensor where each CPU
    device's share of a layer is large enough to pay for its exchanges: the plan says why).
    ``rpc``: RPC servers (``"8080;8081"``, ``"host:port"`` or a list), whose devices come
    first in the device ids, or ``"auto"`` (``"auto:N"``): those announced on the network
    (``pyggml-rpc-server --announce``), looked for ``discover_timeout`` seconds (default 3; with
    N, until N are found, up to 60); ``rpc_key``: the clients' key file (``FILE.client`` from
    ``pyggml-rpc-server --gen-key FILE``) when the servers use TLS.  ``seed``: default seed of sampling (None: random).
    ``place_by``: what ``"auto"`` spreads the layers by: "speed" (each device's measured GB/s
    through products, within its memory; memory where a speed is unknown) or "memory".
    ``on_plan``: called with the placement's description before any weight moves.
    ``failover``: when an RPC server dies mid-generation, move its layers onto the devices
    left (``rpc_spare`` endpoints first), rebuild the cache and go on; the output is that
    of an uninterrupted run.  ``pre_tokenizer``: a llama.cpp pre-tokenizer name to use
    instead of the file's ``tokenizer.ggml.pre`` (e.g. "gpt-2" for a name llama.cpp lacks).
    ``use_mmap``: True keeps the weights the CPU runs in the file's memory map (nothing
    copied, pages shared between processes); False reads them into memory in the order the
    graphs read them (decoding runs faster); None (default): False unless they would take
    more than half of the free memory.
    """

    def __init__(self, path_or_alias: str | os.PathLike | None = None, n_ctx: int = 2048,
                 ngl: str | int | None = None, rpc: str | Sequence[str] | None = None, seed: int | None = None,
                 n_threads: int | None = None, n_batch: int = 256, progress: bool | None = None,
                 rpc_key: str | os.PathLike | ssl.SSLContext | None = None, tensor_split: str | None = None,
                 on_plan: Callable[[str], None] | None = None, failover: bool = False,
                 rpc_spare: str | Sequence[str] | None = None, pre_tokenizer: str | None = None,
                 use_mmap: bool | None = None, split_mode: str = "layer", discover_timeout: float | None = None,
                 place_by: str = "speed") -> None:
        self.path = hub.resolve(path_or_alias)
        self.split_mode = split_mode
        self.place_by = place_by
        self.rpc_key = rpc_key
        self.failover = failover
        # --rpc auto: the servers were found on the network, and a server (an Engine) keeps looking
        self.discovers = isinstance(rpc, str) and rpc.strip().lower().startswith("auto")
        self.lost_endpoints: list[str] = []
        self.recoveries: list[tuple[float, str, float]] = []  # (when, why, seconds) of each re-placement
        self.recovery = Recovery(self)  # failover.py: losses, departures, servers back or new
        self._placed = False
        self._unplaced_history: History | None = None
        if rpc_spare:
            from pyggml.rpc import parse_endpoints
            self.spare_endpoints = parse_endpoints(rpc_spare)
        else:
            self.spare_endpoints = []
        self.n_threads, self.progress, self.use_mmap = n_threads, progress, use_mmap
        compiling = _prepare_cpu(self.path, progress)  # in other processes, while this one loads
        try:
            # every server reached before any weights move
            self.rpc_devices = connect_rpc(rpc, rpc_key, discover_timeout=discover_timeout)
            if ngl is None and self.rpc_devices:
                ngl = "auto"
            try:
                self._place(ngl, tensor_split, n_ctx, n_batch, on_plan)
            except BaseException:
                self._disconnect()
                raise
            self.tokenizer = Tokenizer(self.model.gguf, pre_tokenizer) if pre_tokenizer else \
                _tokenizer_of(self.model.gguf)
        finally:
            if compiling is not None:
                compiling.wait_for_first_answer()
        tk = self.tokenizer
        self.chat_template = ChatTemplate(self.model.gguf.get("tokenizer.chat_template"), self.model.hp.arch,
                                          tk.token_text(tk.bos_id) if tk.bos_id is not None else "",
                                          tk.token_text(tk.eos_id) if tk.eos_id is not None else "")
        self.seed = seed
        self.finish_reason: str | None = None
        self.engine = None  # an Engine serving this model owns its context

    def _place(self, ngl, tensor_split, n_ctx: int, n_batch: int, on_plan=None) -> None:
        """Load the weights onto the devices by the plan, and make a fresh context."""
        self.model: LoadedModel = load_model(self.path, ngl, [*self.rpc_devices, *default_devices()],
                                             progress=self.progress, n_ctx=n_ctx, n_ubatch=n_batch,
                                             tensor_split=tensor_split, on_plan=on_plan, use_mmap=self.use_mmap,
                                             split_mode=self.split_mode, place_by=self.place_by)
        try:
            self.context = Context(self.model, n_ctx=n_ctx, n_ubatch=n_batch)
        except BaseException:
            self.model.free()
            raise
        self._placed = True
        if self.n_threads:
            for backend in self.context.backends:
                backend.set_n_threads(self.n_threads)

    # -- failover -----------------------------------------------------------------------------------
    def history(self) -> History:
        """What rebuilds the cache as it is (the batches that wrote its live cells): the
        context's, or - while the model is not placed (a recovery not done) - what it had."""
        if self._placed:
            c = self.context
            return History(c.log, list(c.tokens), c.n_ctx, c.n_ubatch, c.timings)
        return self._unplaced_history

    def forget_history(self) -> None:
        """The cache's contents are of no use any more (their requests ended): a recovery
        rebuilds an empty cache."""
        h = self.history()
        self._unplaced_history = History([], [], h.n_ctx, h.n_ubatch, h.timings)
        if self._placed:
            self.context.clear_cache()

    def _unplace(self) -> None:
        """Free the weights, the cache and the compute buffers (once; the history is kept)."""
        if not self._placed:
            return
        self._unplaced_history = self.history()
        self._placed = False
        old = self.context
        for free in [old.free, *(buf.free for buf in old.kv.buffers), self.model.free]:
            try:
                free()
            except Exception as e:  # noqa: BLE001 - a lost server's buffers are gone with it
                log.debug("freeing after a loss: %s", e)

    @property
    def placed(self) -> bool:
        """Whether the weights are loaded (not while a recovery places them anew)."""
        return self._placed

    def place_anew(self, history: History) -> None:
        """Place the model anew over the RPC devices now connected (and the local ones), load
        it, and rebuild the cache from ``history`` (taken before the first try: a try that
        failed while it replayed leaves a cache that holds only part of it)."""
        self._unplace()
        self._place("auto", None, history.n_ctx, history.n_ubatch)
        self.context.timings = history.timings
        if history.log is not None:
            self.context.replay(history.log, history.tokens)
        else:  # too long a history to keep: sequence 0 read again in one go, other bits
            log.warning("the cache's history was too long to replay: rebuilt from its tokens, and the "
                        "logits that follow may differ in their last bits")
            if history.tokens:
                self.context.decode(history.tokens)
        self._unplaced_history = None

    def attach(self, devices: list) -> list[str]:
        """Take servers' devices (a lost server back, a new one) into the placement: the model
        is placed anew over every device and goes on where it was.  Returns their endpoints."""
        return self.recovery.attach(devices)

    def reconnect(self) -> list[str]:
        """Attach again the servers lost to failover that answer now.  Returns their endpoints."""
        return self.recovery.attach(self.recovery.probe_lost())

    def _shares(self) -> list[tuple[Any, list[int], str | None]]:
        """Per device: the device, its layers, and what it holds in words (None: nothing)."""
        m = self.model
        out = []
        for i, dev in enumerate(m.devices):
            layers = [il for il, d in enumerate(m.placement.layers) if d == i] if not m.shards else []
            if m.shards:
                share = next((s.describe() for s in m.shards if s.device == i), None)
            else:
                ends = [x for x, on in (("prolog", m.placement.prolog == i), ("epilog", m.placement.epilog == i)) if on]
                share = ", ".join(([f"layers {spans(layers)}"] if layers else []) + ends) or None
            out.append((dev, layers, share))
        return out

    def placement_lines(self) -> list[str]:
        """Each device and what it holds, one line each: every RPC server connected (a spare
        the plan did not need says so) and the local devices that hold something."""
        return [f"  {dev.get_name()}: {share or 'nothing (the others hold the whole model)'}"
                for dev, _, share in self._shares() if share is not None or dev.connection() is not None]

    def cluster_devices(self) -> list[dict[str, Any]]:
        """Each device with what it holds and its memory now (asks every RPC server: call it
        from the thread that decodes), for /cluster."""
        out = []
        busy = self.context.sched.busy_seconds
        for dev, layers, share in self._shares():
            conn = dev.connection()
            if share is None and conn is None:
                continue
            free, total = dev.get_memory()
            out.append({"name": dev.get_name(), "endpoint": conn.endpoint if conn is not None else None,
                        "holds": share or "nothing", "layers": layers, "memory_free": free, "memory_total": total,
                        "bytes_sent": conn.bytes_sent if conn is not None else 0,
                        "bytes_received": conn.bytes_received if conn is not None else 0,
                        "compute_seconds": busy.get(dev.get_name(), 0.0)})
        return out

    # -- properties ---------------------------------------------------------------------------------
    @property
    def n_vocab(self) -> int:
        return self.model.hp.n_vocab

    @property
    def n_ctx(self) -> int:
        return self.context.n_ctx

    @property
    def name(self) -> str:
        return self.model.name

    def describe(self) -> str:
        """The file, its ``general.name`` as written, its size class and type, e.g.
        ``SmolLM2-135M-Instruct.Q4_1.gguf ("Smollm2 135M ...", 135M, Q4_1, 90 MiB)``."""
        g = self.model.gguf
        parts = [f'"{g.get("general.name")}"'] if g.get("general.name") else []
        if g.get("general.size_label"):
            parts.append(str(g.get("general.size_label")))
        kind = g.get("general.file_type")
        if kind is not None:
            try:
                import gguf
                parts.append(gguf.LlamaFileType(int(kind)).name.removeprefix("MOSTLY_"))
            except ValueError:
                pass
        parts.append(f"{self.path.stat().st_size / 2**20:.0f} MiB")
        return f"{self.path.name} ({', '.join(parts)})"

    @property
    def timings(self):
        return self.context.timings

    # -- tokens -------------------------------------------------------------------------------------
    def tokenize(self, text: str, add_bos: bool | None = None, special: bool = False) -> list[int]:
        return self.tokenizer.tokenize(text, add_bos=add_bos, special=special)

    def detokenize(self, ids: Sequence[int], special: bool = False) -> str:
        return self.tokenizer.detokenize(list(ids), special=special)

    # -- evaluation ---------------------------------------------------------------------------------
    def logits(self, ids: Sequence[int]) -> np.ndarray:
        """float32 [len(ids), n_vocab]: the next-token logits after each token of a fresh sequence."""
        self._check_free()

        def score() -> np.ndarray:
            self.context.clear()
            return self.context.decode(list(ids), all_logits=True)
        return self.recovery.guarded(score)

    def generate(self, ids: Sequence[int], max_tokens: int = 256, temperature: float = 0.8, top_k: int = 40,
                 top_p: float = 0.95, min_p: float = 0.05, repeat_penalty: float = 1.0,
                 seed: int | None = None, logit_bias: dict[int, float] | None = None) -> Iterator[int]:
        """Yield sampled token ids after ``ids``; stops at an end-of-generation token, after
        ``max_tokens``, or when the context is full (``finish_reason`` says which)."""
        for token, _ in self._run(ids, max_tokens, (), temperature=temperature, top_k=top_k, top_p=top_p,
                                  min_p=min_p, repeat_penalty=repeat_penalty, seed=seed, logit_bias=logit_bias):
            if token is not None:
                yield token

    def _run(self, ids: Sequence[int], max_tokens: int, stop: Sequence[str], temperature: float = 0.8,
             top_k: int = 40, top_p: float = 0.95, min_p: float = 0.05, repeat_penalty: float = 1.0,
             seed: int | None = None, logit_bias: dict[int, float] | None = None) -> Iterator[tuple[int | None, Took]]:
        """The runner (runner.py) with one sequence, the context's sequence 0: each token drawn
        with what it gave, until the generation ends (the last may be no token: the end, with
        the text held back until then)."""
        self._check_free()
        ids = list(ids)
        if not ids:
            raise ValueError("generate: the prompt has no tokens")
        if len(ids) > self.n_ctx:
            raise ContextFullError(f"the prompt has {len(ids)} tokens, more than the context of {self.n_ctx}")
        params = SamplingParams(temperature, top_k, top_p, min_p, repeat_penalty,
                                logit_bias=checked_logit_bias(logit_bias, self.n_vocab))
        gen = Generation(0, ids, Sampler(params, seed if seed is not None else self.seed), self.tokenizer, stop,
                         max(max_tokens, 0), special=self.harmony)
        runner = Runner(self.n_vocab, self.n_ctx)
        self.finish_reason = None

        def decode(run: Callable[..., Any]) -> Callable[[int, np.ndarray | None], Any]:
            return lambda n_top, hist: self.recovery.guarded(lambda: run(n_top=n_top, hist=hist))
        step = decode(lambda **kw: self.context.eval_prefix(ids, **kw))  # the cached prefix reused
        while True:
            if max_tokens <= 0:
                runner.draw(step, [gen])
                self.finish_reason = "length"
                return
            (token, logits), = runner.draw(step, [gen])
            took = gen.take(token, logits)
            if took.finish is None and self.context.n_past >= self.n_ctx:
                yield token, took
                took = gen.end("length")  # no cell left for the next token
                token = None
            yield (token if took.counted else None), took
            if took.finish is not None:
                self.finish_reason = took.finish
                return
            step = decode(lambda last=token, **kw: self.context.decode([last], **kw))

    def _check_free(self) -> None:
        if self.engine is not None:
            raise RuntimeError("this model's context belongs to the Engine serving it: submit requests there")

    # -- OpenAI-shaped completions ------------------------------------------------------------------
    def _stream(self, ids: list[int], max_tokens: int | None, stop: str | Sequence[str] | None,
                usage: Usage, **sampling: Any) -> Iterator[str]:
        limit = max_tokens if max_tokens is not None and max_tokens > 0 else self.n_ctx
        usage.prompt_tokens = len(ids)
        usage.cached_tokens = self.context.reused_prefix(ids)
        for _, took in self._run(ids, limit, stop_list(stop), **sampling):
            usage.completion_tokens += took.counted
            if took.text:
                yield took.text

    def complete_text(self, prompt: str | Sequence[int], max_tokens: int | None = None,
                      stop: str | Sequence[str] | None = None, **sampling: Any) -> Iterator[str]:
        """The continuation of ``prompt`` (text, or token ids), as pieces of text as they are
        generated (what pyggml-chat prints); ``sampling``: generate's settings."""
        ids = list(prompt) if not isinstance(prompt, str) else self.tokenize(prompt)
        self.usage = Usage()
        yield from self._stream(ids, max_tokens, stop, self.usage, **sampling)

    def answer(self, messages: Sequence[dict[str, Any]], max_tokens: int | None = None,
               stop: str | Sequence[str] | None = None, **sampling: Any) -> Iterator[tuple[str, str]]:
        """The answer to a conversation, as pieces of (reasoning, answer) text as they are
        generated: the reasoning is a harmony model's analysis channel (gpt-oss), "" for others."""
        channels = HarmonyStream() if self.harmony else None
        self.usage = Usage()
        for piece in self._stream(self.apply_chat_template(messages), max_tokens, stop, self.usage, **sampling):
            if channels is None:
                yield "", piece
                continue
            reasoning, answer = channels.push(piece)
            if reasoning or answer:
                yield reasoning, answer
        if channels is not None and any(rest := channels.flush()):
            yield rest

    def _completion(self, kind: str, ids: list[int], stream: bool, max_tokens: int | None, stop, **sampling):
        from pyggml.server.openai import Shape, usage_object
        shape = Shape(kind, self.path.name, reasoning=self.harmony)
        usage = Usage()
        self.usage = usage
        pieces = self._stream(ids, max_tokens, stop, usage, **sampling)
        if not stream:
            text = "".join(pieces)
            return shape.reply(text, self.finish_reason, usage)

        def chunks() -> Iterator[dict[str, Any]]:
            first = shape.role_chunk()
            if first is not None:
                yield first
            for piece in pieces:
                yield shape.chunk(piece)
            yield {**shape.chunk(None, self.finish_reason), "usage": usage_object(usage)}
        return chunks()

    def create_completion(self, prompt: str | Sequence[int], max_tokens: int | None = 16, temperature: float = 0.8,
                          top_p: float = 0.95, top_k: int = 40, min_p: float = 0.05, repeat_penalty: float = 1.0,
                          stop: str | Sequence[str] | None = None, seed: int | None = None, stream: bool = False,
                          logit_bias: dict[int, float] | None = None):
        """Continue ``prompt`` (text, or token ids); a dict like OpenAI's, or chunks with ``stream``.
        ``logit_bias``: token id -> a value in [-100, 100] added to its logit before sampling."""
        ids = list(prompt) if not isinstance(prompt, str) else self.tokenize(prompt)
        return self._completion("text", ids, stream, max_tokens, stop, temperature=temperature, top_k=top_k,
                                top_p=top_p, min_p=min_p, repeat_penalty=repeat_penalty, seed=seed,
                                logit_bias=logit_bias)

    @property
    def harmony(self) -> bool:
        """Whether the model answers in harmony's channels (gpt-oss): its text is decoded with the
        channel markers, and a chat answer's reasoning comes apart (models/harmony.py)."""
        return is_harmony(self.chat_template.source)

    def apply_chat_template(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True) -> list[int]:
        text = self.chat_template.render(messages, add_generation_prompt=add_generation_prompt)
        return self.tokenize(text, special=True)

    def create_chat_completion(self, messages: Sequence[dict[str, Any]], max_tokens: int | None = None,
                               temperature: float = 0.8, top_p: float = 0.95, top_k: int = 40, min_p: float = 0.05,
                               repeat_penalty: float = 1.0, stop: str | Sequence[str] | None = None,
                               seed: int | None = None, stream: bool = False,
                               logit_bias: dict[int, float] | None = None):
        """Answer a conversation (``[{"role": "user", "content": ...}, ...]``) with the model's
        chat template; a dict like OpenAI's, or chunks with ``stream``."""
        ids = self.apply_chat_template(messages)
        return self._completion("chat", ids, stream, max_tokens, stop, temperature=temperature, top_k=top_k,
                                top_p=top_p, min_p=min_p, repeat_penalty=repeat_penalty, seed=seed,
                                logit_bias=logit_bias)

    def close(self) -> None:
        self._unplace()
        self._disconnect()

    def _disconnect(self) -> None:
        for conn in {id(d.conn): d.conn for d in self.rpc_devices}.values():
            conn.close()

    def __enter__(self) -> Model:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
