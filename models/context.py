"""Running a loaded model (llama_context): the KV cache, graphs per batch shape, decoding.

A graph is built per (batch size, cells read, rows of logits) and kept: while those do
not change - every generated token until the cells read grow (kv_cache.py: n_kv) - decoding only writes
the new inputs (token, position, cache cell, mask) and computes the same graph again,
so the scheduler's split and allocation are reused as well.

``decode`` appends to one sequence (sequence 0, whose tokens the context remembers for
prefix reuse); ``decode_batch`` takes tokens of several sequences at once (llama_batch:
token, position, sequence, and whether its logits are wanted), which is how a server
decodes every running sequence's next token in one step.
"""
from __future__ import annotations

import os
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from pyggml import Graph, Scheduler, Type, new_tensor, ops, tensor_set
from pyggml.backend import Backend, tensor_arrays_async

from .blocks import GraphBuilder, mask_type
from .kv_cache import KVCache
from .loader import LoadedModel
from .tensor_split import build_split_graph, local_hparams, takes_blocks

MAX_CACHED_GRAPHS = 12  # prompt and decode shapes, top-k and whole-row outputs, a server's batch sizes
MAX_LOG_TOKENS = 1 << 20


class ContextFullError(ValueError):
    pass


@dataclass
class TopResult:
    """decode_batch's answer with n_top: per output row, the top ids and logits, and the
    logits of the history tokens asked for."""
    ids: np.ndarray          # int32 [outputs, n_top]
    values: np.ndarray       # float32 [outputs, n_top]
    hist_values: np.ndarray  # float32 [outputs, n_hist]

    def row(self, i: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return self.ids[i], self.values[i], self.hist_values[i]


@dataclass
class Batch:
    """Tokens to decode together (llama_batch): per token its id, position, sequence and
    whether its logits are wanted."""
    tokens: np.ndarray   # int32 [n]
    pos: np.ndarray      # int32 [n]
    seq: np.ndarray      # int32 [n]
    output: np.ndarray   # bool [n]

    @classmethod
    def of(cls, tokens: Sequence[int], pos0: int, seq: int = 0, output: str = "last") -> Batch:
        """One sequence's tokens from position ``pos0``; logits of the ``last`` or ``all``."""
        ids = np.asarray(tokens, dtype=np.int32).reshape(-1)
        out = np.zeros(ids.size, dtype=bool)
        if output == "all":
            out[:] = True
        elif ids.size:
            out[-1] = True
        return cls(ids, np.arange(pos0, pos0 + ids.size, dtype=np.int32), np.full(ids.size, seq, np.int32), out)

    def __len__(self) -> int:
        return int(self.tokens.size)

    def slice(self, start: int, stop: int) -> Batch:
        return Batch(self.tokens[start:stop], self.pos[start:stop], self.seq[start:stop], self.output[start:stop])


PAD_SEQ = -2  # the sequence of a padded piece's padding tokens (KVCache tags free cells -1)


def padded_sizes(limit: int) -> tuple[int, ...]:
    """Token counts a padded piece is rounded up to, up to ``limit``: multiples of 8 to 32, of
    16 to 64, of 32 to 128, of 64 to 256 ..., so that padding adds at most a third of a piece's
    tokens, and at most 7 to a short one (a chunk of a prompt beside a few streams), while a
    server's batches take few shapes."""
    sizes, n, step = [], 8, 8
    while n < limit:
        sizes.append(n)
        if n >= 4 * step:
            step *= 2
        n += step
    return (*sizes, limit)


@dataclass(frozen=True)
class Padding:
    """How a server's pieces that read prompts are padded to a few shapes (Context.padding).

    A graph is built per shape, and a new one costs tens of milliseconds of Python (build,
    split, allocate, plan) - in a server, a prompt of a length not seen before.  Padded, every
    such piece is one of a few shapes, built while the server is idle (Engine._warm_shapes):
    its tokens rounded up to one of ``tokens`` by padding tokens of a sequence of their own
    (PAD_SEQ: a run of their own in every product, writing the scratch cell of the cache,
    seeing cell 0), its runs and output runs to ``runs`` (the unused ones empty), its output
    rows to ``outputs(n)`` (the extra ones a run of their own, of a padding row's - or, with
    no padding token, a real row's - hidden state).  Every sequence's tokens are computed as
    they would be alone whatever else is in their piece (the products' runs, attention's
    single rows: sequence_groups), so padding changes no bit of theirs."""
    tokens: tuple[int, ...]
    runs: int
    min_outputs: int
    top: int  # the top k a piece with no output row asked for computes (nobody reads it)

    @classmethod
    def for_server(cls, n_batch: int, n_seqs: int, top: int, head_rows_per_token: float = 0.0) -> Padding:
        """Pieces of up to ``n_batch`` tokens of up to ``n_seqs`` sequences: output rows at
        least min(n_seqs, 8), more in powers of two - or at least min(n_seqs, 2) where a row of
        the output head costs more than half a token of the layers (``head_rows_per_token``:
        hp.head_share; Gemma 3's 262144-row head, 1.7 tokens' worth): padding a step of one
        stream and a prompt's last token to 8 rows of that head would take longer than the
        step."""
        return cls(padded_sizes(n_batch), n_seqs + 1, min(n_seqs, 2 if head_rows_per_token > 0.5 else 8), top)

    def output_counts(self, n_seqs: int) -> list[int]:
        """Every output row count a piece of up to ``n_seqs`` sequences is padded to."""
        return sorted({self.outputs(n) for n in range(1, n_seqs + 1)})

    def n_tokens(self, n: int) -> int | None:
        return next((size for size in self.tokens if size >= n), None)

    def outputs(self, n: int) -> int:
        return self.min_outputs if n <= self.min_outputs else 1 << (n - 1).bit_length()


@dataclass
class Piece:
    """One graph's share of a batch (Context._piece): its shape (_graph's key), the tokens it
    computes (the batch's, then any padding: ``n_real`` are the batch's), the output rows asked
    of it, its runs and which rows its outputs are."""
    shape: tuple[int, ...]
    batch: Batch
    n_real: int
    wanted: int
    runs: tuple[np.ndarray, np.ndarray] | None
    out_ids: np.ndarray


def padded_runs(seq: np.ndarray, n_runs: int) -> np.ndarray | None:
    """runs_of(seq) with empty runs after the last up to ``n_runs``; None where there are more."""
    runs = runs_of(seq)
    if len(runs) - 1 > n_runs:
        return None
    return np.concatenate([runs, np.full(n_runs + 1 - len(runs), len(seq), np.int32)]).astype(np.int32)


@dataclass
class Timings:
    prompt_tokens: int = 0
    prompt_seconds: float = 0.0
    gen_tokens: int = 0
    gen_seconds: float = 0.0
    # graphs of a shape not seen before (or evicted): built, assigned, split, allocated and
    # planned on the decoding thread - what a step with a new shape waits for
    graph_builds: int = 0
    graph_seconds: float = 0.0

    def reset(self) -> None:
        self.prompt_tokens = self.gen_tokens = 0
        self.prompt_seconds = self.gen_seconds = 0.0


def runs_of(seq: np.ndarray) -> np.ndarray:
    """Where each run of equal sequence ids starts, and the count last (ops.mul_mat's runs)."""
    cuts = np.flatnonzero(seq[1:] != seq[:-1]) + 1
    return np.concatenate([[0], cuts, [len(seq)]]).astype(np.int32)


PIPELINE_MICRO = int(os.environ.get("PYGGML_PIPELINE_MICRO", "64"))  # 0: no pipelining


def pipeline_micro_batch(model: LoadedModel) -> int:
    """Tokens per micro-batch of a prompt whose layers lie on several remote servers (0: no
    micro-batches).  A ubatch is then read in pieces that do not wait for each other: each
    server works on piece i while the one before it works on piece i + 1, their activations
    passed straight between them (rpc/peers.py) - llama.cpp's pipeline parallelism.  The pieces
    follow BatchRules.prompt_cut's rule, so every token meets the kernels of the whole ubatch, and the
    bits are those of a run without pipelining.  Not for a mixture of experts: an expert's share
    of the tokens decides its kernels there, and a micro-batch holds fewer."""
    return PIPELINE_MICRO if layer_servers(model) > 1 and not model.hp.n_expert else 0


def layer_servers(model: LoadedModel) -> int:
    """How many remote servers hold the model's layers (the stages of a pipeline)."""
    return len({model.layer_device(il).connection() for il in range(model.hp.n_layer)} - {None})


# A pipelined batch of several sequences (a server's decode step) is cut into one group of
# sequences per server, so that each server works on one group while the next server works on
# the one before; but into no group of fewer than MIN_GROUP_TOKENS tokens: every group reads
# every weight again and pays each op's fixed cost again, which a few columns do not win back
# (bench/rpc.py --pipeline shows what the cut gains at 8 and 32 sequences).
MIN_GROUP_TOKENS = 4


def sequence_groups(seq: np.ndarray, n_groups: int) -> list[tuple[int, int]]:
    """(start, end) of at most ``n_groups`` pieces of a batch, each a run of whole sequences
    (runs_of), of about equal numbers of tokens.  A sequence's tokens are computed as they would
    be alone whatever else is in their batch (the products' runs, attention's single rows), so
    any such cut keeps the bits."""
    runs = runs_of(seq)
    total, cuts = len(seq), [0]
    for i in range(1, n_groups):
        target = total * i // n_groups
        cut = int(runs[np.searchsorted(runs, target)])  # the first run start at or after it
        if cuts[-1] < cut < total:
            cuts.append(cut)
    return list(zip(cuts, cuts[1:] + [total]))


class Context:
    def __init__(self, model: LoadedModel, n_ctx: int = 2048, n_ubatch: int = 256) -> None:
        if n_ctx < 1:
            raise ValueError(f"n_ctx must be positive, not {n_ctx}")
        self.model = model
        self.hp = model.hp
        self.n_ctx = n_ctx
        self.n_ubatch = max(1, n_ubatch)
        cpu = len(model.devices) - 1
        used = [i for i in model.used_devices() if i != cpu]
        self.backends: list[Backend] = [model.devices[i].init_backend() for i in used] + \
            [model.devices[cpu].init_backend()]
        self.sched = Scheduler(self.backends)
        self.mask_type = mask_type([model.devices[i] for i in used])
        self._backend_of = {dev: i for i, dev in enumerate(used + [cpu])}  # device id -> scheduler backend
        self.rules = model.batch_rules
        if model.shards:
            self.kv = KVCache(self.hp, n_ctx, [], shards=[(model.devices[s.device].get_buffer_type(),
                                                          local_hparams(self.hp, s)) for s in model.shards],
                              page=self.rules.kv_page)
        else:
            self.kv = KVCache(self.hp, n_ctx,
                              [model.layer_device(il).get_buffer_type() for il in range(self.hp.n_layer)],
                              page=self.rules.kv_page)
        self.tokens: list[int] = []  # the tokens whose keys and values the cache holds, in order
        # the batches that wrote the cells the cache holds now, in order, less the runs of rows
        # whose cells were all freed since (seq_rm prunes them: a sequence's rows get the bits
        # they get alone, so the other rows of a batch keep theirs without them); a run freed in
        # part stays whole, with the seq_rm after it (the width of a run decides its products'
        # bits).  Replaying it rebuilds the cache bit for bit elsewhere (failover), in time that
        # grows with what is live, not with history.  None once it grew past MAX_LOG_TOKENS
        # (the cache can then only be rebuilt approximately)
        self.log: list[tuple] | None = []
        self._log_tokens = 0
        self._graphs: OrderedDict[tuple[int, ...], GraphBuilder] = OrderedDict()
        self._copy_graphs: dict[int, tuple] = {}  # seq_cp's, by cells copied
        self._copy_split: tuple[list, list] | None = None  # seq_cp's caches: in host memory, elsewhere
        self.max_graphs = MAX_CACHED_GRAPHS
        self.timings = Timings()
        self.n_micro = pipeline_micro_batch(model)
        self.n_groups = layer_servers(model) if self.n_micro else 0  # one group per server
        # a server's (Engine): pieces that read prompts padded to a few shapes.  Not with
        # pipelining over servers, whose pieces are groups of a step's sequences
        self.padding: Padding | None = None

    @property
    def n_past(self) -> int:
        """Tokens cached for sequence 0 (the one ``decode`` appends to)."""
        return len(self.tokens)

    def clear(self) -> None:
        self.truncate(0)

    def free(self) -> None:
        """Release the compute buffers and forget the graphs (the KV cache is the caller's)."""
        self.sched.free()
        self._graphs.clear()
        self._copy_graphs.clear()

    def truncate(self, n: int) -> None:
        """Forget every token of sequence 0 cached after the first ``n``."""
        n = max(0, min(n, len(self.tokens)))
        self.tokens = self.tokens[:n]
        self.seq_rm(0, n)

    def seq_rm(self, seq: int, p0: int = 0) -> None:
        """Free the cells of sequence ``seq`` from position ``p0`` on (llama_memory_seq_rm)."""
        self.kv.seq_rm(seq, p0)
        self._logged(("rm", seq, p0), 0)

    def seq_cp(self, src: int, dst: int, p0: int, p1: int) -> bool:
        """Give sequence ``dst`` the keys and values of sequence ``src`` at positions p0 .. p1 - 1
        (llama_memory_seq_cp, as a copy: a page of the cache is one sequence's), bit for bit
        and at the same offsets of its pages: ``dst`` then holds what ``src`` read there, as if
        it had read it itself.  False, with nothing changed, where ``src`` lacks a position or
        the cells run out."""
        if p1 <= p0 or self.kv.type not in (Type.F16, Type.F32):  # (a quantized cache would round again)
            return p1 <= p0
        cells = self.kv.copy_cells(src, dst, p0, p1)
        if cells is None:
            return False
        self._copy_cells(*cells)
        self._logged(("cp", src, dst, p0, p1), 0)
        return True

    def _copy_cells(self, source: np.ndarray, target: np.ndarray) -> None:
        """Every layer's keys and values at cells ``source`` written to cells ``target``: in host
        memory by numpy (a graph's ops would cost more than the copy), on other devices by a
        graph of GET_ROWS then SET_ROWS (F16 to F32 and back is exact), one per page-rounded
        count (its padding copies the scratch cell onto itself)."""
        host, devices = self._copy_targets()
        for rows in host:
            rows[target] = rows[source]
        if not devices:
            return
        page = self.kv.page
        n = -(-len(source) // page) * page
        fill = np.full(n - len(source), self.kv.scratch, np.int32)
        graph, src_idx, dst_idx = self._copy_graph(n)
        self.sched.alloc_graph(graph)
        tensor_set(src_idx, np.concatenate([source, fill]).astype(np.int32))
        tensor_set(dst_idx, np.concatenate([target, fill]).astype(np.int32))
        self.sched.graph_compute(graph)

    def _copy_targets(self) -> tuple[list[np.ndarray], list[Any]]:
        """The caches seq_cp copies in: host memory's as [cells, row] arrays, the others' tensors."""
        if self._copy_split is None:
            from pyggml.cpu.buffer import CPUBuffer, tensor_view
            host, devices = [], []
            for t in [*self.kv.k, *self.kv.v, *(t for part in self.kv.parts for t in part.k + part.v)]:
                if isinstance(t.buffer, CPUBuffer):
                    host.append(tensor_view(t).reshape(t.ne[1], t.ne[0]))
                else:
                    devices.append(t)
            self._copy_split = host, devices
        return self._copy_split

    def prepare_copy(self, n_cells: int) -> bool:
        """Build and plan seq_cp's graph for ``n_cells`` cells (rounded up to pages) now, unless
        it is kept or every cache is in host memory: True if it was built."""
        if not self._copy_targets()[1]:
            return False
        page = self.kv.page
        n = -(-n_cells // page) * page
        built = n not in self._copy_graphs
        self.sched.alloc_graph(self._copy_graph(n)[0])
        return built

    def _copy_graph(self, n: int) -> tuple[Graph, Any, Any]:
        got = self._copy_graphs.get(n)
        if got is None:
            graph = Graph()
            src_idx = new_tensor(Type.I32, (n,), "cp_src").set_input()
            dst_idx = new_tensor(Type.I32, (n,), "cp_dst").set_input()
            for cache in self._copy_targets()[1]:
                graph.build_forward_expand(ops.set_rows(cache, ops.get_rows(cache, src_idx), dst_idx))
            got = self._copy_graphs[n] = (graph, src_idx, dst_idx)
        return got

    def clear_cache(self) -> None:
        """Free every cell of every sequence."""
        self.kv.clear()
        self.tokens = []
        self._logged(("clear",), 0)

    def _logged(self, op: tuple, n_tokens: int) -> None:
        if self.kv.n_used == 0:
            self.log, self._log_tokens = [], 0  # nothing to rebuild
            return
        if op[0] == "rm" and not self._prune(op[1], op[2]):
            return
        if self.log is not None:
            self._log_tokens += n_tokens
            if self._log_tokens > MAX_LOG_TOKENS:
                self.log = None
            else:
                self.log.append(op)

    def _prune(self, seq: int, p0: int) -> bool:
        """Drop from the log the runs of ``seq``'s rows whose cells (positions from ``p0`` on)
        were all freed, and the copies into ``seq`` whose cells were; True if one was freed
        only in part (the seq_rm must then be logged).  What a later copy (seq_cp) read from
        ``seq`` stays: a replay writes it again before it copies it."""
        if self.log is None:
            return False
        reads = [(i, op[3], op[4]) for i, op in enumerate(self.log) if op[0] == "cp" and op[1] == seq]

        def read_later(i: int, pos: np.ndarray) -> bool:
            return any(j > i and ((pos >= lo) & (pos < hi)).any() for j, lo, hi in reads)
        kept, partial = [], False
        for i, op in enumerate(self.log):
            if op[0] == "cp" and op[2] == seq and op[4] > p0:  # a copy into seq, its cells freed in part or all
                if op[3] < p0 or read_later(i, np.arange(op[3], op[4])):
                    kept.append(op)
                    partial = True
                continue
            if op[0] != "b":
                kept.append(op)
                continue
            batch = op[1]
            mine = batch.seq == seq
            dead = mine & (batch.pos >= p0)
            if not dead.any():
                kept.append(op)
            elif (mine & ~dead).any() or read_later(i, batch.pos[dead]):  # (a sequence's rows are one run)
                kept.append(op)
                partial = True
            elif not mine.all():
                keep = ~mine
                kept.append(("b", Batch(batch.tokens[keep], batch.pos[keep], batch.seq[keep], batch.output[keep])))
        self.log = kept
        self._log_tokens = sum(len(op[1]) for op in kept if op[0] == "b")
        return partial

    def replay(self, log: list[tuple], tokens: list[int]) -> None:
        """Rebuild the cache from another context's ``log`` (sequence 0 holding ``tokens``):
        the same operations in the same order give the same bits."""
        self.clear_cache()
        for op in log:
            if op[0] == "b":
                self.decode_batch(op[1])
            elif op[0] == "cp":
                self.seq_cp(*op[1:])
            else:
                self.seq_rm(op[1], op[2])
        self.tokens = list(tokens)

    # -- graphs -------------------------------------------------------------------------------------
    def _graph(self, n_tokens: int, n_kv: int, n_outputs: int, n_top: int = 0, n_hist: int = 0, n_runs: int = 0,
               n_output_runs: int = 0) -> GraphBuilder:
        key = (n_tokens, n_kv, n_outputs, n_top, n_hist, n_runs, n_output_runs)
        b = self._graphs.get(key)
        if b is not None:
            self._graphs.move_to_end(key)
            return b
        shape = dict(n_tokens=n_tokens, n_kv=n_kv, n_outputs=n_outputs, rope_mode=self.model.arch.rope_mode,
                     n_top=n_top, n_hist=n_hist, n_runs=n_runs, n_output_runs=n_output_runs, mask_type=self.mask_type)
        model = self.model
        if model.shards:
            b = build_split_graph(model.arch, self.hp, model.shards, model.shard_weights, self.kv.parts,
                                  [self._backend_of[s.device] for s in model.shards],
                                  blocks=all(takes_blocks(model.devices[s.device]) for s in model.shards), **shape)
        else:
            b = GraphBuilder(self.hp, model.weights, self.kv, **shape)
            model.arch.build(b)
        self.timings.graph_builds += 1
        self._graphs[key] = b
        if len(self._graphs) > self.max_graphs:
            self._graphs.popitem(last=False)
        return b

    def exchanged_bytes(self) -> list[int] | None:
        """Split mode tensor: the bytes each device receives from the others in a one-token step
        (tensor_split.Exchange); None without a tensor split or before such a step was built."""
        step = next((b for shape, b in self._graphs.items() if shape[0] == 1), None)
        return list(step.exchange.received) if step is not None and hasattr(step, "exchange") else None

    def keep_graphs(self, n: int) -> None:
        """Keep the graphs (and their scheduler partitions) of ``n`` shapes, not fewer than the
        default: what a server that builds its decoding steps' shapes ahead (Engine) needs."""
        self.max_graphs = max(MAX_CACHED_GRAPHS, n)
        self.sched.max_partitions = max(self.sched.max_partitions, self.max_graphs + 4)

    def decode_shape(self, n_seqs: int, n_kv: int, n_top: int = 0, n_hist: int = 0) -> tuple[int, ...] | None:
        """The shape of the graph that decodes one token of each of ``n_seqs`` sequences with
        ``n_kv`` cells read (decode_batch's key), or None where such a batch is cut into several
        graphs (pipelining over servers)."""
        if self.n_groups and min(self.n_groups, n_seqs // MIN_GROUP_TOKENS) > 1:
            return None
        several = n_seqs if n_seqs > 1 else 0
        return (n_seqs, min(n_kv, self.n_ctx), n_seqs, min(n_top, self.hp.n_vocab), n_hist if n_top else 0,
                several, several)

    def prepare(self, shape: tuple[int, ...]) -> bool:
        """Build and plan the graph of ``shape`` (decode_shape's) now, unless it is kept: then a
        step of that shape finds it ready.  True if it was built."""
        if self.has_graph(shape):
            return False
        b = self._graph(*shape)
        self.sched.alloc_graph(b.graph)
        return True

    def has_graph(self, shape: tuple[int, ...]) -> bool:
        return shape in self._graphs

    def _set_inputs(self, b: GraphBuilder, piece: Piece, cells: np.ndarray) -> None:
        inp, batch = b.inputs, piece.batch
        tensor_set(inp.tokens, batch.tokens)
        tensor_set(inp.pos, batch.pos)
        tensor_set(inp.kv_idxs, cells)
        causal, swa = self.kv.masks(batch.seq, batch.pos, b.n_kv, inp.kq_mask_swa is not None)
        for mask in (causal, swa) if swa is not None else (causal,):
            mask[piece.n_real:, 0] = 0  # padding sees one cell: no row of only hidden cells
        as_type = np.float16 if self.mask_type == Type.F16 else np.float32
        tensor_set(inp.kq_mask, causal.astype(as_type, copy=False))
        if swa is not None:
            tensor_set(inp.kq_mask_swa, swa.astype(as_type, copy=False))
        if inp.out_ids is not None:
            tensor_set(inp.out_ids, piece.out_ids)
        if piece.runs is not None:
            tensor_set(inp.token_runs, piece.runs[0])
            tensor_set(inp.output_runs, piece.runs[1])

    # -- decoding -----------------------------------------------------------------------------------
    def check_tokens(self, ids: np.ndarray) -> None:
        if ids.size and (ids.min() < 0 or ids.max() >= self.hp.n_vocab):
            bad = int(ids[(ids < 0) | (ids >= self.hp.n_vocab)][0])
            raise ValueError(f"token id {bad} is outside the vocabulary (0..{self.hp.n_vocab - 1})")

    def decode_batch(self, batch: Batch, n_top: int = 0, hist: np.ndarray | None = None):
        """Decode a batch of tokens of any sequences (each must follow its sequence's cached
        positions); return float32 logits [number of outputs, n_vocab], in batch order.
        With ``n_top``, return a TopResult instead: per output row the ids and logits of the
        n_top largest (largest first, ties lowest id first) and the logits of the tokens
        ``hist`` [outputs, n_hist] names - all the vocabulary a sampler with top-k needs, so
        that the rest stays on the device of the head.
        Runs in ubatches of at most ``n_ubatch`` tokens; raises ContextFullError, leaving the
        cache as it was, when too few cells are free."""
        return self.submit_batch(batch, n_top, hist)()

    def submit_batch(self, batch: Batch, n_top: int = 0, hist: np.ndarray | None = None) -> Callable[[], Any]:
        """decode_batch in two halves: the batch's graphs sent (on servers, computed while the
        caller goes on) and its cells taken now; its results when the returned function is called.
        Batches of other sequences may be submitted before that: each server computes its requests
        in order, and every result is asked for right after its graph (Engine's pipelined lanes)."""
        if len(batch) == 0:
            raise ValueError("decode: no tokens")
        self.check_tokens(batch.tokens)
        n_top = min(n_top, self.hp.n_vocab)
        n_hist = hist.shape[1] if n_top and hist is not None else 0
        if n_hist:
            self.check_tokens(hist)
        all_cells = self.kv.find_cells(batch.seq, batch.pos)
        if all_cells is None:
            raise ContextFullError(f"the context of {self.n_ctx} tokens is full ({self.kv.n_used} cached + "
                                   f"{len(batch)} new); use a larger n_ctx")
        reads = []  # per piece with outputs: (rows, top-k or whole rows, their read)
        row = 0  # output rows handed out so far
        for start, end in self._pieces(batch):
            cells = all_cells[start:end]
            piece = self._piece(batch.slice(start, end), self.kv.n_kv(cells), n_top, n_hist)
            wanted = piece.wanted
            self.kv.occupy(cells, batch.seq[start:end], batch.pos[start:end])
            t_graph = time.perf_counter()
            builds = self.timings.graph_builds
            b = self._graph(*piece.shape)
            self.sched.alloc_graph(b.graph)
            if self.timings.graph_builds != builds:
                self.timings.graph_seconds += time.perf_counter() - t_graph
            n_pad = len(piece.batch) - piece.n_real
            self._set_inputs(b, piece, np.concatenate([cells, np.full(n_pad, self.kv.scratch, np.int32)]) if n_pad
                             else cells)
            rows_hist = None
            if b.inputs.hist_ids is not None:
                rows_hist = hist[row:row + wanted] if hist is not None else np.zeros((wanted, n_hist), np.int32)
                b.set_hist(np.concatenate([rows_hist, np.zeros((b.n_outputs - wanted, rows_hist.shape[1]), np.int32)])
                           if b.n_outputs > wanted else rows_hist)
            self.sched.graph_compute(b.graph)
            if wanted:
                # asked for now, read once every piece is on its way: a server that holds the
                # head answers between this piece's graph and the next, while the servers
                # before it already work on the next piece (pipelining)
                reads.append((wanted, b, rows_hist, tensor_arrays_async(b.result_tensors())))
            row += wanted
        return lambda: self._collect(batch, reads, n_top, n_hist)

    def _collect(self, batch: Batch, reads: list, n_top: int, n_hist: int):
        outs = [b.results(read(), wanted, rows_hist) for wanted, b, rows_hist, read in reads]
        self._logged(("b", batch), len(batch))  # (once it is computed: a failover rebuilds what was)
        if n_top:
            parts = list(zip(*outs)) if outs else [[np.zeros((0, n_top), np.int32)], [np.zeros((0, n_top), np.float32)],
                                                  [np.zeros((0, n_hist), np.float32)]]
            return TopResult(*(np.concatenate(p) for p in parts))
        if not outs:
            return np.zeros((0, self.hp.n_vocab), dtype=np.float32)
        return outs[0] if len(outs) == 1 else np.concatenate(outs)

    def _piece(self, ub: Batch, n_kv: int, n_top: int, n_hist: int) -> Piece:
        """A piece's graph: its shape, the tokens and runs it computes, and its output rows.
        A graph has an output: a piece with none asked for computes its last row, which
        nobody reads.  With ``padding``, a piece that reads a prompt is padded (Padding)."""
        wanted = int(ub.output.sum())
        padded = self._padded(ub, wanted, n_kv, n_top, n_hist)
        if padded is not None:
            return padded
        if not wanted:
            ub = Batch(ub.tokens, ub.pos, ub.seq, np.eye(1, len(ub), len(ub) - 1, dtype=bool)[0])
        top = n_top if wanted else 0
        # several sequences: each one's products computed as they would be for it alone
        runs = (runs_of(ub.seq), runs_of(ub.seq[ub.output])) if (ub.seq != ub.seq[0]).any() else None
        n_runs = (len(runs[0]) - 1, len(runs[1]) - 1) if runs else (0, 0)
        return Piece((len(ub), n_kv, max(1, wanted), top, n_hist if top else 0, *n_runs), ub, len(ub), wanted, runs,
                     np.flatnonzero(ub.output).astype(np.int32))

    def _padded(self, ub: Batch, wanted: int, n_kv: int, n_top: int, n_hist: int) -> Piece | None:
        """``ub`` padded to one of ``padding``'s shapes, or None: no padding, a piece of one
        token per sequence (a decoding step: Engine builds those shapes ahead as they are), or
        one that fits no padded shape."""
        pad = self.padding
        if pad is None or wanted == len(ub):
            return None
        n, n_out = pad.n_tokens(len(ub)), pad.outputs(wanted)
        if n is None or n_out >= n:
            return None
        if not wanted:  # (a prompt's piece before its last: the top of a shape built ahead)
            n_top, n_hist = min(pad.top, self.hp.n_vocab), 0
        n_pad, extra = n - len(ub), n_out - wanted
        seq = np.concatenate([ub.seq, np.full(n_pad, PAD_SEQ, np.int32)])
        real_out = np.flatnonzero(ub.output).astype(np.int32)
        out_ids = np.concatenate([real_out, np.full(extra, n - 1, np.int32)])
        runs = padded_runs(seq, pad.runs), padded_runs(np.concatenate([ub.seq[real_out], np.full(extra, PAD_SEQ)]),
                                                        pad.runs)
        if runs[0] is None or runs[1] is None:
            return None
        zeros = np.zeros(n_pad, np.int32)
        batch = Batch(np.concatenate([ub.tokens, zeros]), np.concatenate([ub.pos, zeros]), seq,
                      np.concatenate([ub.output, np.zeros(n_pad, bool)]))
        return Piece((n, n_kv, n_out, n_top, n_hist if n_top else 0, pad.runs, pad.runs), batch, len(ub), wanted,
                     runs, out_ids)

    def prompt_shape(self, n_tokens: int, n_kv: int, n_top: int = 0, n_hist: int = 0,
                     n_outputs: int | None = None) -> tuple[int, ...] | None:
        """The padded shape of a piece that reads prompts, of up to ``n_tokens`` tokens and
        ``n_outputs`` output rows as ``padding`` pads them (the fewest it gives by default: what
        Engine builds ahead), or None."""
        pad = self.padding
        if pad is None or pad.n_tokens(n_tokens) is None:
            return None
        n_top = min(n_top, self.hp.n_vocab)
        outputs = pad.min_outputs if n_outputs is None else pad.outputs(n_outputs)
        return (pad.n_tokens(n_tokens), min(n_kv, self.n_ctx), outputs, n_top, n_hist if n_top else 0,
                pad.runs, pad.runs)

    def batch_shapes(self, batch: Batch, n_top: int = 0, hist: np.ndarray | None = None) -> list[tuple[int, ...]]:
        """The shapes of the graphs decode_batch would compute ``batch`` in, piece by piece,
        found without touching the cache (none when it has no room for the batch)."""
        n_top = min(n_top, self.hp.n_vocab)
        n_hist = hist.shape[1] if n_top and hist is not None else 0
        all_cells = self.kv.find_cells(batch.seq, batch.pos)
        if all_cells is None or len(batch) == 0:
            return []
        shapes = []
        for start, end in self._pieces(batch):
            n_kv = self.kv.n_kv(all_cells[:end])  # the pieces before it occupied their cells too
            shapes.append(self._piece(batch.slice(start, end), n_kv, n_top, n_hist).shape)
        return shapes

    def prepare_part(self, shape: tuple[int, ...]) -> bool:
        """One part of the work that a graph of a new shape needs before a step can compute it
        at once: build it (the model's builder), then split, allocate and plan it (the
        scheduler).  True when none is left.  A server decoding streams does one part between
        two of their steps, so that no step waits for all of it (Engine.step)."""
        b = self._graphs.get(shape)
        if b is None:
            self._graph(*shape)
            return False
        if not self.sched.is_placed(b.graph):
            self.sched.alloc_graph(b.graph)
            return False
        return True

    def _pieces(self, batch: Batch) -> list[tuple[int, int]]:
        """(start, end) of each graph a batch is computed in: ubatches of n_ubatch tokens, and
        with pipelining (n_micro) the ubatches of one sequence in micro-batches, those of several
        sequences in groups of sequences (n_groups)."""
        pieces = []
        for start in range(0, len(batch), self.n_ubatch):
            end = min(start + self.n_ubatch, len(batch))
            seq = batch.seq[start:end]
            several = (seq != seq[0]).any()
            if several and self.n_groups:
                n_groups = min(self.n_groups, len(seq) // MIN_GROUP_TOKENS)
                pieces += [(start + a, start + b) for a, b in sequence_groups(seq, max(n_groups, 1))]
                continue
            if several or not self.n_micro or end - start <= self.n_micro:
                pieces.append((start, end))
                continue
            done = 0
            while done < end - start:
                n = self.rules.prompt_cut(done, end - start, self.n_micro, self.n_ubatch) or end - start - done
                pieces.append((start + done, start + done + n))
                done += n
        return pieces

    def decode(self, tokens: Sequence[int], all_logits: bool = False, n_top: int = 0,
               hist: np.ndarray | None = None):
        """Append ``tokens`` to sequence 0; return float32 logits [n, n_vocab] for every
        token (``all_logits``) or [1, n_vocab] for the last one - or, with ``n_top``, the
        last token's TopResult (decode_batch)."""
        ids = np.asarray(tokens, dtype=np.int64).reshape(-1)
        if ids.size == 0:
            raise ValueError("decode: no tokens")
        t0 = time.perf_counter()
        logits = self.decode_batch(Batch.of(ids, len(self.tokens), 0, "all" if all_logits and not n_top else "last"),
                                   n_top, hist)
        self.tokens.extend(int(t) for t in ids)
        dt = time.perf_counter() - t0
        if ids.size == 1:
            self.timings.gen_tokens += 1
            self.timings.gen_seconds += dt
        else:
            self.timings.prompt_tokens += ids.size
            self.timings.prompt_seconds += dt
        return logits

    def common_prefix(self, tokens: Sequence[int]) -> int:
        """How many leading ``tokens`` sequence 0 already holds."""
        common = 0
        for a, b in zip(self.tokens, tokens):
            if a != b:
                break
            common += 1
        return common

    def reused_prefix(self, tokens: Sequence[int]) -> int:
        """How many leading ``tokens`` eval_prefix takes from the cache (reusable_prefix of those
        cached)."""
        return self.rules.reusable_prefix(self.common_prefix(tokens), len(tokens), self.n_ubatch)

    def eval_prefix(self, tokens: Sequence[int], n_top: int = 0, hist: np.ndarray | None = None):
        """Make the cache hold exactly ``tokens``, reusing the longest cached prefix; return
        the logits after the last token (as decode does)."""
        tokens = list(tokens)
        common = self.reused_prefix(tokens)
        self.truncate(common)
        return self.decode(tokens[common:], n_top=n_top, hist=hist)
