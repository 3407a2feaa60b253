"""The high-level Python API: ``pyggml.Model`` (shaped like llama-cpp-python's ``Llama``)."""
from __future__ import annotations

import logging
import os
import ssl
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from pyggml import hub

from .chat import ChatTemplate
from .completion import Shape, TextStream, Usage, stop_list
from .context import Context, ContextFullError
from .loader import LoadedModel, default_devices, load_model
from .placement import spans
from .sampling import Sampler, SamplingParams
from .tokenizer import Tokenizer

log = logging.getLogger("pyggml.models")


_tokenizers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _tokenizer_of(gguf) -> Tokenizer:
    """One tokenizer per opened GGUF (built in 0.1-0.3 s; shared, it holds no per-sequence state)."""
    tk = _tokenizers.get(gguf)
    if tk is None:
        tk = _tokenizers[gguf] = Tokenizer(gguf)
    return tk


def _compile_kernels(path, progress: bool | None):
    """warmup.compile_for_model for a GGUF file (None if its header cannot be read: the load
    that follows says why)."""
    from pyggml.cpu import warmup
    from .loader import open_gguf
    try:
        f, arch = open_gguf(path)  # parsed once: the load that follows takes it from open_gguf's cache
    except (OSError, ValueError):
        return None
    return warmup.compile_for_model(((t.name, t.type, t.ne) for t in f.tensors.values()),
                                    None if progress is False else hub.say, gate_part(arch))


def gate_part(arch) -> str | None:
    """The kernel part (warmup.GATES) of an architecture's feed-forward gate, None if unknown."""
    act = getattr(arch, "FFN_ACT", None)
    return act.__name__ if act is not None else None


def connect_rpc(rpc: str | Sequence[str] | None, key: str | os.PathLike | ssl.SSLContext | None = None) -> list:
    """The devices of the RPC servers named by ``rpc`` (none when it is empty); ``key``: the
    clients' key file from ``pyggml-rpc-server --gen-key`` (or a TLS context made from it)."""
    if not rpc:
        return []
    from pyggml.rpc import connect, load_key
    if isinstance(key, (str, os.PathLike)):
        key = load_key(key)
    return connect(rpc, key=key)


class Model:
    """A GGUF model ready to tokenize, score and generate.

    ``path_or_alias``: a GGUF file or a known alias (``smollm2``, ``gemma3-270m``; None =
    the default model, downloaded once).  ``ngl``: layer placement as in ``pyggml-chat -ngl``
    (``"auto"``: spread by free memory, the default when ``rpc`` is given; otherwise None:
    everything on the CPU).  ``tensor_split``: proportions per device, as ``-ts 3,1``.
    ``rpc``: RPC servers (``"8080;8081"``, ``"host:port"`` or a list), whose devices come
    first in the device ids; ``rpc_key``: the clients' key file (``FILE.client`` from
    ``pyggml-rpc-server --gen-key FILE``) when the servers use TLS.  ``seed``: default seed of sampling (None: random).
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
                 use_mmap: bool | None = None) -> None:
        self.path = hub.resolve(path_or_alias)
        self.rpc_key = rpc_key
        self.failover = failover
        self.lost_endpoints: list[str] = []
        if rpc_spare:
            from pyggml.rpc import parse_endpoints
            self.spare_endpoints = parse_endpoints(rpc_spare)
        else:
            self.spare_endpoints = []
        self.n_threads, self.progress, self.use_mmap = n_threads, progress, use_mmap
        compiling = _compile_kernels(self.path, progress)  # in other processes, while this one loads
        try:
            self.rpc_devices = connect_rpc(rpc, rpc_key)  # every server reached before any weights move
            if ngl is None and self.rpc_devices:
                ngl = "auto"
            self._place(ngl, tensor_split, n_ctx, n_batch, on_plan)
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
        try:
            self.model: LoadedModel = load_model(self.path, ngl, [*self.rpc_devices, *default_devices()],
                                                 progress=self.progress, n_ctx=n_ctx, n_ubatch=n_batch,
                                                 tensor_split=tensor_split, on_plan=on_plan, use_mmap=self.use_mmap)
        except BaseException:
            self._disconnect()
            raise
        self.context = Context(self.model, n_ctx=n_ctx, n_ubatch=n_batch)
        if self.n_threads:
            for backend in self.context.backends:
                if hasattr(backend, "set_n_threads"):
                    backend.set_n_threads(self.n_threads)

    # -- failover -----------------------------------------------------------------------------------
    def _rebuild(self) -> None:
        """Place the model anew over the RPC devices now connected (and the local ones), load
        it, and rebuild the cache by replaying what built it (context.py's log)."""
        old = self.context
        old.free()
        for buf in old.kv.buffers:
            buf.free()
        self.model.free()
        self._place("auto", None, old.n_ctx, old.n_ubatch)
        self.context.timings = old.timings
        if old.log is not None:
            self.context.replay(old.log, old.tokens)
        else:  # too long a history to keep: sequence 0 read again in one go, other bits
            log.warning("the cache's history was too long to replay: rebuilt from its tokens, and the "
                        "logits that follow may differ in their last bits")
            if old.tokens:
                self.context.decode(old.tokens)

    def reconnect(self) -> list[str]:
        """Attach again the servers lost to failover that answer now; the model is placed
        anew over every device and goes on where it was.  Returns the endpoints attached."""
        back = []
        for endpoint in list(self.lost_endpoints):
            try:
                back += connect_rpc(endpoint, self.rpc_key)
            except (RuntimeError, ValueError, OSError) as e:
                log.info("%s is still unreachable: %s", endpoint, e)
                continue
            self.lost_endpoints.remove(endpoint)
        if back:
            self.rpc_devices += back
            self._rebuild()
        return [d.conn.endpoint for d in back]

    def _guarded(self, step: Callable[[], Any]) -> Any:
        """Run a decoding step; with ``failover``, a lost RPC server is replaced and the step
        runs again on the new placement."""
        from pyggml.rpc import RPCError
        while True:
            try:
                return step()
            except RPCError as e:
                e = self._culprit(e)
                if not self.failover:
                    raise e from None
                self._recover(e)

    def _culprit(self, error):
        """The error, naming the server that failed: a server that waited for another's tensor
        reports that one gone, and still answers itself."""
        from pyggml.rpc import RPCError
        conns = {d.conn.endpoint: d.conn for d in self.rpc_devices}
        named = conns.get(error.endpoint)
        if named is None or not named.answers():
            return error
        dead = [ep for ep, c in conns.items() if ep != error.endpoint and not c.answers()]
        return RPCError(dead[0], f"lost (reported by {error.endpoint}): {str(error).split(': ', 1)[-1]}") \
            if dead else error

    def _recover(self, error: Exception) -> None:
        """Move the lost server's layers onto the devices left (a spare first), load them,
        and rebuild the cache by replaying the calls that built it: the same calls give the
        same bits, so greedy and seeded generation go on exactly as if nothing happened."""
        t0 = time.perf_counter()
        # the server that reports a failure may not be the one that failed (a server waiting
        # for another's tensor reports that one gone): ask each whether it still answers
        conns = {id(d.conn): d.conn for d in self.rpc_devices}.values()
        dead = {c.endpoint for c in conns if not c.answers()}
        lost = [d for d in self.rpc_devices if d.conn.endpoint in dead]
        if not lost:
            raise error
        lost_names = {d.get_name() for d in lost}
        lost_layers = [il for il, dev in enumerate(self.model.placement.layers)
                       if self.model.devices[dev].get_name() in lost_names]
        for d in lost:
            d.conn.close(f"lost: {error}")
        self.rpc_devices = [d for d in self.rpc_devices if d not in lost]
        spare = []
        while self.spare_endpoints and not spare:
            endpoint = self.spare_endpoints.pop(0)
            try:
                spare = connect_rpc(endpoint, self.rpc_key)
            except (RuntimeError, ValueError, OSError) as e:
                log.warning("spare %s cannot be used: %s", endpoint, e)
        self.rpc_devices = spare + self.rpc_devices
        self.lost_endpoints += [d.conn.endpoint for d in lost]
        try:
            self._rebuild()
        except Exception as e:
            raise type(error)(error.endpoint, f"{str(error).split(': ', 1)[-1]}; failover found no room: {e}") \
                from None
        where = sorted({self.model.devices[self.model.placement.layers[il]].get_name() for il in lost_layers})
        log.warning("%s lost (%s); its layers %s moved to %s; recovered in %.1f s", ", ".join(sorted(lost_names)),
                    str(error).split(": ", 1)[-1], spans(lost_layers), ", ".join(where),
                    time.perf_counter() - t0)

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
        return self._guarded(score)

    def generate(self, ids: Sequence[int], max_tokens: int = 256, temperature: float = 0.8, top_k: int = 40,
                 top_p: float = 0.95, min_p: float = 0.05, repeat_penalty: float = 1.0,
                 seed: int | None = None) -> Iterator[int]:
        """Yield sampled token ids after ``ids``; stops at an end-of-generation token, after
        ``max_tokens``, or when the context is full (``finish_reason`` says which)."""
        self._check_free()
        ids = list(ids)
        if not ids:
            raise ValueError("generate: the prompt has no tokens")
        if len(ids) > self.n_ctx:
            raise ContextFullError(f"the prompt has {len(ids)} tokens, more than the context of {self.n_ctx}")
        params = SamplingParams(temperature, top_k, top_p, min_p, repeat_penalty)
        sampler = Sampler(params, seed if seed is not None else self.seed)
        self.finish_reason = None
        history = ids
        # with top-k (or greedy), only the top of the row and the recent tokens' logits come back
        n_top = sampler.n_top(self.n_vocab)
        n_hist = min(sampler.window(), self.n_ctx) if n_top and params.penalizes else 0

        def step(run: Callable[..., Any]) -> int:
            if not n_top:
                return sampler.sample(self._guarded(run)[-1], history)
            hist = sampler.recent(history, n_hist)[None, :]
            top = self._guarded(lambda: run(n_top=n_top, hist=hist))
            return sampler.sample_top(top.ids[0], top.values[0], hist[0], top.hist_values[0], history)

        token = step(lambda **kw: self.context.eval_prefix(ids, **kw))
        for n in range(max_tokens):
            if self.tokenizer.is_eog(token):
                self.finish_reason = "stop"
                return
            history.append(token)
            yield token
            if n + 1 == max_tokens:
                break
            if self.context.n_past >= self.n_ctx:
                self.finish_reason = "length"
                return
            token = step(lambda last=token, **kw: self.context.decode([last], **kw))
        self.finish_reason = "length"

    def _check_free(self) -> None:
        if self.engine is not None:
            raise RuntimeError("this model's context belongs to the Engine serving it: submit requests there")

    # -- OpenAI-shaped completions ------------------------------------------------------------------
    def _stream(self, ids: list[int], max_tokens: int | None, stop: str | Sequence[str] | None,
                usage: Usage, **sampling: Any) -> Iterator[str]:
        stream = TextStream(self.tokenizer, stop_list(stop))
        limit = max_tokens if max_tokens is not None and max_tokens > 0 else self.n_ctx
        usage.prompt_tokens = len(ids)
        usage.cached_tokens = self.context.reused_prefix(ids)
        for token in self.generate(ids, max_tokens=limit, **sampling):
            usage.completion_tokens += 1
            piece = stream.push(token)
            if piece:
                yield piece
            if stream.stopped:
                self.finish_reason = "stop"
                return
        tail = stream.flush()
        if tail:
            yield tail

    def _completion(self, kind: str, ids: list[int], stream: bool, max_tokens: int | None, stop, **sampling):
        shape = Shape(kind, self.path.name)
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
            yield {**shape.chunk(None, self.finish_reason), "usage": usage.as_dict()}
        return chunks()

    def create_completion(self, prompt: str | Sequence[int], max_tokens: int | None = 16, temperature: float = 0.8,
                          top_p: float = 0.95, top_k: int = 40, min_p: float = 0.05, repeat_penalty: float = 1.0,
                          stop: str | Sequence[str] | None = None, seed: int | None = None, stream: bool = False):
        """Continue ``prompt`` (text, or token ids); a dict like OpenAI's, or chunks with ``stream``."""
        ids = list(prompt) if not isinstance(prompt, str) else self.tokenize(prompt)
        return self._completion("text", ids, stream, max_tokens, stop, temperature=temperature, top_k=top_k,
                                top_p=top_p, min_p=min_p, repeat_penalty=repeat_penalty, seed=seed)

    def apply_chat_template(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True) -> list[int]:
        text = self.chat_template.render(messages, add_generation_prompt=add_generation_prompt)
        return self.tokenize(text, special=True)

    def create_chat_completion(self, messages: Sequence[dict[str, Any]], max_tokens: int | None = None,
                               temperature: float = 0.8, top_p: float = 0.95, top_k: int = 40, min_p: float = 0.05,
                               repeat_penalty: float = 1.0, stop: str | Sequence[str] | None = None,
                               seed: int | None = None, stream: bool = False):
        """Answer a conversation (``[{"role": "user", "content": ...}, ...]``) with the model's
        chat template; a dict like OpenAI's, or chunks with ``stream``."""
        ids = self.apply_chat_template(messages)
        return self._completion("chat", ids, stream, max_tokens, stop, temperature=temperature, top_k=top_k,
                                top_p=top_p, min_p=min_p, repeat_penalty=repeat_penalty, seed=seed)

    def close(self) -> None:
        self.model.free()
        for buf in self.context.kv.buffers:
            buf.free()
        self.context.free()
        self._disconnect()

    def _disconnect(self) -> None:
        for conn in {id(d.conn): d.conn for d in self.rpc_devices}.values():
            conn.close()

    def __enter__(self) -> Model:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
