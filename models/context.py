"""Running a loaded model (llama_context): the KV cache, graphs per batch shape, decoding.

A graph is built per (batch size, cells read, rows of logits) and kept: while those do
not change - every generated token for KV_PAD positions at a time - decoding only writes
the new inputs (token, position, cache cell, mask) and computes the same graph again,
so the scheduler's split and allocation are reused as well.
"""
from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from pyggml import Scheduler, tensor_array, tensor_set
from pyggml.backend import Backend

from .blocks import GraphBuilder
from .kv_cache import KVCache
from .loader import LoadedModel

MAX_CACHED_GRAPHS = 4


class ContextFullError(ValueError):
    pass


@dataclass
class Timings:
    prompt_tokens: int = 0
    prompt_seconds: float = 0.0
    gen_tokens: int = 0
    gen_seconds: float = 0.0

    def reset(self) -> None:
        self.prompt_tokens = self.gen_tokens = 0
        self.prompt_seconds = self.gen_seconds = 0.0


class Context:
    def __init__(self, model: LoadedModel, n_ctx: int = 2048, n_ubatch: int = 256) -> None:
        if n_ctx < 1:
            raise ValueError(f"n_ctx must be positive, not {n_ctx}")
        self.model = model
        self.hp = model.hp
        self.n_ctx = n_ctx
        self.n_ubatch = max(1, n_ubatch)
        cpu = len(model.devices) - 1
        used = [i for i in model.placement.used() if i != cpu]
        self.backends: list[Backend] = [model.devices[i].init_backend() for i in used] + \
            [model.devices[cpu].init_backend()]
        self.sched = Scheduler(self.backends)
        self.kv = KVCache(self.hp, n_ctx, [model.layer_device(il).get_buffer_type() for il in range(self.hp.n_layer)])
        self.tokens: list[int] = []  # the tokens whose keys and values the cache holds, in order
        self._graphs: OrderedDict[tuple[int, int, int], GraphBuilder] = OrderedDict()
        self.timings = Timings()

    @property
    def n_past(self) -> int:
        return self.kv.n_past

    def clear(self) -> None:
        self.truncate(0)

    def free(self) -> None:
        """Release the compute buffers and forget the graphs (the KV cache is the caller's)."""
        self.sched.free()
        self._graphs.clear()

    def truncate(self, n: int) -> None:
        """Forget every cached token after the first ``n``."""
        n = max(0, min(n, len(self.tokens)))
        self.tokens = self.tokens[:n]
        self.kv.n_past = n

    # -- graphs -------------------------------------------------------------------------------------
    def _graph(self, n_tokens: int, n_kv: int, n_outputs: int) -> GraphBuilder:
        key = (n_tokens, n_kv, n_outputs)
        b = self._graphs.get(key)
        if b is not None:
            self._graphs.move_to_end(key)
            return b
        b = GraphBuilder(self.hp, self.model.weights, self.kv, n_tokens, n_kv, n_outputs,
                         rope_mode=self.model.arch.ROPE_MODE)
        self.model.arch.build(b)
        self._graphs[key] = b
        if len(self._graphs) > MAX_CACHED_GRAPHS:
            self._graphs.popitem(last=False)
        return b

    def _set_inputs(self, b: GraphBuilder, tokens: np.ndarray, n_outputs: int) -> None:
        n, n_past, n_kv = len(tokens), self.kv.n_past, b.n_kv
        pos = np.arange(n_past, n_past + n, dtype=np.int32)
        inp = b.inputs
        tensor_set(inp.tokens, tokens.astype(np.int32))
        tensor_set(inp.pos, pos)
        tensor_set(inp.kv_idxs, pos)  # cell i holds position i
        distance = pos[:, None] - np.arange(n_kv, dtype=np.int32)[None, :]  # query pos - cell pos
        tensor_set(inp.kq_mask, np.where(distance >= 0, 0.0, -np.inf).astype(np.float32))
        if inp.kq_mask_swa is not None:
            visible = (distance >= 0) & (distance < self.hp.n_swa)
            tensor_set(inp.kq_mask_swa, np.where(visible, 0.0, -np.inf).astype(np.float32))
        if inp.out_ids is not None:
            tensor_set(inp.out_ids, np.arange(n - n_outputs, n, dtype=np.int32))

    # -- decoding -----------------------------------------------------------------------------------
    def decode(self, tokens: Sequence[int], all_logits: bool = False) -> np.ndarray:
        """Append ``tokens`` to the sequence; return float32 logits [n, n_vocab] for every
        token (``all_logits``) or [1, n_vocab] for the last one."""
        ids = np.asarray(tokens, dtype=np.int64).reshape(-1)
        if ids.size == 0:
            raise ValueError("decode: no tokens")
        if ids.min() < 0 or ids.max() >= self.hp.n_vocab:
            bad = int(ids[(ids < 0) | (ids >= self.hp.n_vocab)][0])
            raise ValueError(f"token id {bad} is outside the vocabulary (0..{self.hp.n_vocab - 1})")
        if self.kv.n_past + ids.size > self.n_ctx:
            raise ContextFullError(f"the context of {self.n_ctx} tokens is full ({self.kv.n_past} cached + "
                                   f"{ids.size} new); use a larger n_ctx")
        t0 = time.perf_counter()
        outs = []
        for start in range(0, ids.size, self.n_ubatch):
            chunk = ids[start:start + self.n_ubatch]
            last = start + chunk.size == ids.size
            n_outputs = chunk.size if all_logits else 1  # earlier chunks' single row is dropped
            b = self._graph(chunk.size, self.kv.n_kv(chunk.size), n_outputs)
            self.sched.alloc_graph(b.graph)
            self._set_inputs(b, chunk, n_outputs)
            self.sched.graph_compute(b.graph)
            self.kv.n_past += chunk.size
            self.tokens.extend(int(t) for t in chunk)
            if all_logits or last:
                outs.append(tensor_array(b.graph.output()).reshape(n_outputs, -1))
        dt = time.perf_counter() - t0
        if ids.size == 1:
            self.timings.gen_tokens += 1
            self.timings.gen_seconds += dt
        else:
            self.timings.prompt_tokens += ids.size
            self.timings.prompt_seconds += dt
        return outs[0] if len(outs) == 1 else np.concatenate(outs)

    def eval_prefix(self, tokens: Sequence[int]) -> np.ndarray:
        """Make the cache hold exactly ``tokens``, reusing the longest cached prefix; return
        the logits after the last token (as decode does)."""
        tokens = list(tokens)
        common = 0
        for a, b in zip(self.tokens, tokens):
            if a != b:
                break
            common += 1
        common = min(common, len(tokens) - 1)  # the last token is always evaluated, for its logits
        self.truncate(common)
        return self.decode(tokens[common:])
