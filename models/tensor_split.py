"""Tensor parallelism (``split_mode="tensor"``): every layer's work divided among the devices.

Attention is divided by query heads (each device holds the rows of Q, K and V for its heads,
the keys and values of those heads in its own cache, and a share of the output projection's
rows); the feed-forward by its hidden rows (gate and up) and the down projection by its output
rows.  Where a head group has fewer KV heads than devices, the devices that share a KV head
each hold it (its rows of K and V, and its cache), so that every query head finds its keys.

Why gathers and not all-reduce: Megatron's split sums partial products on every device, which
changes the order of the additions, and so the bits.  Here every product is split by its
*output* rows, so each output element is computed by the same kernel over the same K as on one
device; the slices are then gathered (concatenated) on every device, in device order.  Four
gathers per layer: the attention's heads before the output projection, the projection's rows,
the feed-forward's hidden rows before the down projection, and its rows.  The first and third
go in the blocks their product quantizes them to anyway (PRODUCT_OF), the others as float32.
The norms and the residual stream are computed on every device (replicated), the embedding on
the first device (the lead).  The output head is split by vocabulary rows and not gathered: the caller reads
each device's logits (or its top k, merged exactly: :meth:`ShardBuilder.results`).

A mixture of experts is divided the same way: every device holds its rows of every expert (gate
and up by hidden rows, down by output rows), and the router, so that each picks the same
experts; the experts' hidden rows and their weighted sum are the layer's last two gathers.

What is not bit for bit: a product of an F32 or F16 weight with several columns is BLAS's
(pyggml/cpu/ops/matmul.py), whose sums depend on the matrix's rows, so a file with such weights
split gives one device's greedy text and logits equal to a few ulps.  The block products of the
quantized types compute every output element the same way whatever the rows.

How the graph is built (SPMD, as Megatron and exo do it): the architecture's ``build`` runs
once per device on a :class:`ShardBuilder` - the same code as on one device, with that device's
weights, cache and head counts.  Where the blocks gather (``GraphBuilder.gathered``), a builder
takes its own slice and a placeholder for each other device's; once every device's graph is
built, the placeholders are pointed at the other devices' slices, and the nodes are ordered by
the exchanges before them, then by device, so that the scheduler cuts one split per device
between two exchanges and copies each slice straight to the devices that read it
(rpc/peers.py between servers).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from pyggml import Graph, Tensor, ops
from pyggml.backend import DeviceType
from pyggml.types import ACTIVATION_BLOCKS, Type
from pyggml.opdefs import VIEW_OPS

from .blocks import GraphBuilder, GraphInputs
from .hparams import HParams


class SplitError(ValueError):
    pass


Range = tuple[int, int]


@dataclass(frozen=True)
class Shard:
    """One device's share of every layer."""
    device: int          # the model's device id
    q_heads: Range       # query heads [first, end)
    kv_heads: Range      # the KV heads those query heads read
    ff_rows: Range       # hidden rows of the feed-forward (gate, up)
    embd_rows: Range     # output rows of the attention's and the feed-forward's projections
    vocab_rows: Range    # rows of the output head: the logits of these tokens
    ff_exp_rows: Range = (0, 0)  # hidden rows of every expert (gate, up), for a mixture of experts

    def describe(self) -> str:
        def r(x: Range) -> str:
            return f"{x[0]}-{x[1] - 1}" if x[1] - x[0] > 1 else f"{x[0]}"
        experts = f"expert rows {r(self.ff_exp_rows)}" if self.ff_exp_rows[1] else f"ffn rows {r(self.ff_rows)}"
        return f"heads {r(self.q_heads)} (kv {r(self.kv_heads)}), {experts}, " \
               f"embd rows {r(self.embd_rows)}, vocab {r(self.vocab_rows)}"


class FileSlice(NamedTuple):
    """Rows of a file tensor: ``nbytes`` bytes from ``start`` into its data, in ``count``
    pieces of equal size ``stride`` apart (the same rows of every expert in a stack)."""
    name: str
    start: int
    nbytes: int
    count: int = 1
    stride: int = 0


# Rows of a product are cut in whole eights: llama.cpp repacks a Q4_K matrix of a multiple of 8
# rows and multiplies it with other kernels than one of other rows (cpu/qmatmul.product_format),
# so a share of, say, 214 of 640 rows would not give the whole's bits.  The feed-forward's hidden
# rows are cut in whole 32s, which also makes them whole Q8_0 / Q8_1 blocks on the wire (in
# eights where they are not whole 32s).  A width that is not a multiple of 8 is cut row by row,
# and then no share is a multiple of 8 either: it would be repacked where the whole is not.
ROW_UNIT = 8
FF_UNIT = 32


def cuts(n: int, weights: list[float], unit: int = 1) -> list[Range]:
    """[first, end) of ``n`` rows shared in proportion to ``weights`` in whole ``unit``s of rows
    where ``n`` is whole units (else single rows), every share at least one unit (largest
    remainders), in order."""
    k = len(weights)
    if unit > 1:
        for u in sorted({unit, ROW_UNIT}, reverse=True):
            if n % u == 0 and n // u >= k:
                return [(a * u, b * u) for a, b in cuts(n // u, weights)]
        rows = cuts(n, weights)
        return rows if n % ROW_UNIT == 0 else none_in_eights(rows)
    if n < k:
        raise SplitError(f"{n} units cannot be shared among {k} devices")
    total = sum(weights)
    exact = [n * w / total for w in weights]
    counts = [max(1, int(x)) for x in exact]
    while sum(counts) > n:  # the floors of one unit each took too many: from the largest share
        counts[max((i for i in range(k) if counts[i] > 1), key=lambda i: counts[i] - exact[i])] -= 1
    while sum(counts) < n:
        counts[max(range(k), key=lambda i: exact[i] - counts[i])] += 1
    out, at = [], 0
    for c in counts:
        out.append((at, at + c))
        at += c
    return out


def none_in_eights(rows: list[Range]) -> list[Range]:
    """``rows`` (of a width that is not a multiple of ROW_UNIT) moved by a row here and there so
    that no share is a multiple of ROW_UNIT: each share takes the kernels the whole takes."""
    counts = [b - a for a, b in rows]
    for i in range(len(counts) - 1):  # each share but the last gives a row to the next
        if counts[i] % ROW_UNIT == 0:
            counts[i] -= 1
            counts[i + 1] += 1
    if len(counts) > 1 and counts[-1] % ROW_UNIT == 0:  # the last trades with the one before it
        step = 1 if (counts[-2] + 1) % ROW_UNIT else -1  # (one of the two keeps it off a multiple)
        counts[-2] += step
        counts[-1] -= step
    out, at = [], rows[0][0]
    for c in counts:
        out.append((at, at + c))
        at += c
    return out


def plan_tensor_split(hp: HParams, devices: list[int], weights: list[float]) -> list[Shard]:
    """Each device's heads and rows, in proportion to ``weights``.  Query heads are split on
    whole groups of a KV head when there are at least as many KV heads as devices; else the
    devices are shared out among the KV heads and each group's query heads among its devices
    (which then all hold that KV head)."""
    n = len(devices)
    g = hp.n_head // hp.n_head_kv
    if hp.n_head_kv >= n:
        q = [(a * g, b * g) for a, b in cuts(hp.n_head_kv, weights)]
    else:
        if g * hp.n_head_kv != hp.n_head:
            raise SplitError(f"{hp.n_head} query heads over {hp.n_head_kv} KV heads do not form groups")
        q = []
        for kv, (a, b) in enumerate(cuts(n, [1.0] * hp.n_head_kv)):
            if b - a > g:
                raise SplitError(f"{n} devices cannot share {hp.n_head} query heads in {hp.n_head_kv} groups of {g}")
            q += [(kv * g + x, kv * g + y) for x, y in cuts(g, weights[a:b])]
    ff, embd, vocab = cuts(hp.n_ff, weights, FF_UNIT), cuts(hp.n_embd, weights, ROW_UNIT), cuts(hp.n_vocab, weights, ROW_UNIT)
    ff_exp = cuts(hp.n_ff_exp, weights, ROW_UNIT) if hp.n_expert else [(0, 0)] * n
    return [Shard(dev, q[i], (q[i][0] // g, (q[i][1] - 1) // g + 1), ff[i], embd[i], vocab[i], ff_exp[i])
            for i, dev in enumerate(devices)]


# the rows of each split weight (and of its bias): which of a shard's ranges, in units of what.
# Experts are divided by rows, each expert's the same ones (not whole experts per device): which
# experts a token takes is known only as it runs, while rows keep every device's work even and
# the slices' shapes fixed.  The router is every device's (each one picks the same experts).
SPLIT_ROWS = {"attn_q": ("q_heads", "k"), "attn_k": ("kv_heads", "k"), "attn_v": ("kv_heads", "v"),
              "attn_sinks": ("q_heads", None), "attn_output": ("embd_rows", None),
              "ffn_gate": ("ff_rows", None), "ffn_up": ("ff_rows", None), "ffn_down": ("embd_rows", None),
              "ffn_gate_exps": ("ff_exp_rows", None), "ffn_up_exps": ("ff_exp_rows", None),
              "ffn_down_exps": ("embd_rows", None)}


def shard_rows(name: str, shard: Shard, hp: HParams) -> Range | None:
    """The rows of weight ``name`` (elements, for a bias) that ``shard`` holds; None: all of it
    (a norm, replicated; the embedding, which the lead alone holds)."""
    if name == "output.weight":
        return shard.vocab_rows
    parts = name.split(".")
    if len(parts) < 4 or parts[0] != "blk" or parts[2] not in SPLIT_ROWS:
        return None
    which, per_head = SPLIT_ROWS[parts[2]]
    a, b = getattr(shard, which)
    unit = {"k": hp.n_embd_head_k, "v": hp.n_embd_head_v, None: 1}[per_head]
    return a * unit, b * unit


def shard_tensor(t: Tensor, rows: Range) -> tuple[Tensor, FileSlice]:
    """A tensor of ``t``'s rows [a, b) - of every matrix, in a stack of experts; elements of a
    vector, or of every expert's bias vector - and where they lie in its bytes."""
    a, b = rows
    if t.name.endswith(".bias") or t.ne[1:] == (1, 1, 1):  # vectors: rows are elements
        if t.type.block_size != 1:
            raise SplitError(f"{t.name}: a vector of {t.type.name} cannot be cut by elements")
        size = t.type.row_size(1)
        ne, at, piece = (b - a, *t.ne[1:]), a * size, (b - a) * size
        count, stride = t.ne[1] * t.ne[2] * t.ne[3], t.nb[1]
    else:
        ne, at, piece = (t.ne[0], b - a, *t.ne[2:]), a * t.nb[1], (b - a) * t.nb[1]
        count, stride = t.ne[2] * t.ne[3], t.nb[2]
    return Tensor(t.type, ne, name=t.name), FileSlice(t.name, at, piece * count, count, stride if count > 1 else 0)


def local_hparams(hp: HParams, shard: Shard) -> HParams:
    """The head counts one device's graph sees."""
    return dataclasses.replace(hp, n_head=shard.q_heads[1] - shard.q_heads[0],
                               n_head_kv=shard.kv_heads[1] - shard.kv_heads[0])


# -- the graph ---------------------------------------------------------------------------------------

# the gathers that a product reads whole, and its weight: sent in the blocks that product
# quantizes its activations to anyway (ggml's vec_dot_type), where every device's rows are whole
# blocks - each block is quantized alone, so a device's rows give the bytes of those rows of the
# whole, and the product takes them as they are (ops.mul_mat).  Q8_0 is 34 bytes per 32 values
# where float32 is 128.  (An expert's hidden rows go to MUL_MAT_ID, which takes floats only.)
PRODUCT_OF = {"kqv_out": "attn_output", "ffn_act": "ffn_down"}


def takes_blocks(device) -> bool:
    """Whether a device's products take activations in blocks (ops.mul_mat) and it joins blocks
    (ops.concat): our CPU, here or behind our RPC server - not a GPU (its kernels quantize to
    their own q8_1), nor llama.cpp's server (whose CONCAT takes plain types only)."""
    conn = getattr(device, "conn", None)
    return device.get_type() == DeviceType.CPU and (conn is None or conn.pyggml_extensions)


@dataclass
class Exchange:
    """The slices the builders gather: what each one made, the placeholders the others took, and
    the bytes each device receives in a step.  ``blocks``: slices that feed a product may go in
    its activations' blocks (PRODUCT_OF; the devices' kernels take them: Context)."""
    shards: list[Shard]
    blocks: bool = False
    made: list[dict[str, Tensor]] = field(default_factory=list)
    wanted: list[tuple[Tensor, int, str]] = field(default_factory=list)  # (placeholder, shard, key)
    received: list[int] = field(default_factory=list)  # bytes of the other devices' slices, per device

    def __post_init__(self) -> None:
        self.made = [{} for _ in self.shards]
        self.received = [0] * len(self.shards)

    def wire_type(self, key: str, weight: Tensor | None, hp: HParams) -> Type | None:
        """The blocks a gathered slice goes in (None: as it is): those its product's weight takes,
        where every device's rows are whole blocks of them."""
        kind = weight.type.vec_dot_type if self.blocks and weight is not None else None
        if kind not in ACTIVATION_BLOCKS or any(self.rows(key, j, hp) % kind.block_size for j in range(len(self.shards))):
            return None
        return kind

    def rows(self, key: str, j: int, hp: HParams) -> int:
        s = self.shards[j]
        kind = key.rsplit("-", 1)[0]
        if kind == "kqv_out":
            return (s.q_heads[1] - s.q_heads[0]) * hp.n_embd_head_v
        if kind == "ffn_act":
            return s.ff_rows[1] - s.ff_rows[0]
        if kind == "ffn_moe_act":
            return s.ff_exp_rows[1] - s.ff_exp_rows[0]
        if kind in ("attn_out", "ffn_out", "ffn_moe_out"):
            return s.embd_rows[1] - s.embd_rows[0]
        raise KeyError(key)

    def placeholder(self, like: Tensor, j: int, key: str, rows: int, reader: int) -> Tensor:
        t = Tensor(like.type, (rows, *like.ne[1:]), name=f"{key}@{j}")
        self.wanted.append((t, j, key))
        self.received[reader] += t.nbytes()
        return t


class ShardBuilder(GraphBuilder):
    """One device's graph of a tensor split (see the module's text)."""

    def __init__(self, *args, exchange: Exchange, index: int, global_hp: HParams, **kw) -> None:
        super().__init__(*args, **kw)
        self.exchange, self.index, self.global_hp = exchange, index, global_hp
        # the step's results are every device's: the lead's builder answers for them all
        self.parts: list[ShardBuilder] = [self]
        self.n_top_all = self.n_top  # (n_top: this device's, no more than its rows)

    @property
    def lead(self) -> bool:
        return self.index == 0

    def gathered(self, t: Tensor, name: str, il: int | None = None) -> Tensor:
        key = f"{name}-{il}"
        ex = self.exchange
        kind = ex.wire_type(key, self.w(f"{PRODUCT_OF[name]}.weight", il), self.global_hp) if name in PRODUCT_OF else None
        if kind is not None:
            t = self.cb(ops.cast(t, kind), f"{name}_{kind.name.lower()}", il)
        ex.made[self.index][key] = t
        out = None
        for j in range(len(ex.shards)):
            part = t if j == self.index else ex.placeholder(t, j, key, ex.rows(key, j, self.global_hp), self.index)
            out = part if out is None else ops.concat(out, part, 0)
        return self.cb(out, f"{name}_all", il)

    def build_inp_embd(self, scale: float = 1.0) -> Tensor:
        if self.lead:
            t = super().build_inp_embd(scale)
            self.exchange.made[0]["inp_embd"] = t
            return t
        t = Tensor(self.exchange.made[0]["inp_embd"].type, (self.hp.n_embd, self.n_tokens), name="inp_embd@0")
        self.exchange.wanted.append((t, 0, "inp_embd"))
        self.exchange.received[self.index] += t.nbytes()
        return t

    @property
    def shard(self) -> Shard:
        return self.exchange.shards[self.index]

    def head_weight(self) -> Tensor:
        head = super().head_weight()
        a, b = self.shard.vocab_rows
        if head.ne[1] != b - a:  # the lead's whole embedding, tied to the head: its rows of it
            head = ops.view(head, (head.ne[0], b - a), (head.nb[1],), a * head.nb[1])
        return head

    def set_hist(self, hist: np.ndarray) -> None:
        """Each device picks the history's logits from its rows: an id outside them reads its
        first row, a value :meth:`results` drops."""
        for p in self.parts:
            a, b = p.shard.vocab_rows
            GraphBuilder.set_hist(p, np.clip(hist, a, b - 1) - a)

    def result_tensors(self) -> list[Tensor]:
        return [t for p in self.parts for t in GraphBuilder.result_tensors(p)]

    def results(self, arrays: list[np.ndarray], wanted: int, hist: np.ndarray | None = None):
        """Every device's logits side by side; or the top k of every device's top k (a token
        among the whole top k is among its device's: ``n_top`` above it on its device are above
        it on all), largest first and ties lowest id first as on one device, and each history
        token's logit from the device that holds it."""
        per, at = [], 0
        for p in self.parts:
            n = len(GraphBuilder.result_tensors(p))
            per.append(GraphBuilder.results(p, arrays[at:at + n], wanted))
            at += n
        if self.top is None:
            return np.concatenate(per, axis=1)
        starts = [p.shard.vocab_rows[0] for p in self.parts]
        ids = np.concatenate([r[0].astype(np.int64) + a for r, a in zip(per, starts)], axis=1)
        values = np.concatenate([r[1] for r in per], axis=1)
        best = np.lexsort((ids, -values), axis=-1)[:, :self.n_top_all]
        hist_values = np.zeros((wanted, 0), np.float32)
        if hist is not None:
            hist_values = np.zeros(hist.shape, np.float32)
            for r, p in zip(per, self.parts):
                a, b = p.shard.vocab_rows
                mine = (hist >= a) & (hist < b)
                hist_values[mine] = r[2][mine]
        return (np.take_along_axis(ids, best, axis=1).astype(np.int32), np.take_along_axis(values, best, axis=1),
                hist_values)


def merge_by_stage(orders: list[list[Tensor]], owner: dict[int, int]) -> list[Tensor]:
    """One order of every device's nodes.  A node depends on its sources and, where it reads
    memory that a node before it on its device wrote in place (the attention reads the cache
    the SET_ROWS before it wrote), on that writer.  Its stage is the number of exchanges on the
    longest path to it (a dependency on another device adds one, and so does one on a tensor
    that another device reads: see below); nodes are sorted by stage,
    then device, then their own order - every slice before its readers, each writer before its
    readers, and one split per device and stage for the scheduler."""
    deps: dict[int, list[Tensor]] = {}
    for nodes in orders:
        wrote: dict[int, Tensor] = {}  # memory root -> the last node that wrote into it
        for t in nodes:
            mine = [s for s in t.src if s is not None and id(s) in owner]
            for s in t.src:
                if s is not None and id(s.data_root()) in wrote and wrote[id(s.data_root())] is not t:
                    mine.append(wrote[id(s.data_root())])
            deps[id(t)] = mine
            if t.view_src is not None and t.op not in VIEW_OPS:
                wrote[id(t.data_root())] = t
    # a tensor another device reads ends its split on its own device too: it is sent as soon as
    # it is made, not after whatever else its device computes next (else the devices take turns)
    sent = {id(d) for nodes in orders for t in nodes for d in deps[id(t)] if owner[id(d)] != owner[id(t)]}
    stage: dict[int, int] = {}
    for nodes in orders:
        for root in nodes:
            stack = [root]
            while stack:
                t = stack[-1]
                if id(t) in stage:
                    stack.pop()
                    continue
                waiting = [d for d in deps[id(t)] if id(d) not in stage]
                if waiting:
                    stack.extend(waiting)
                    continue
                stage[id(t)] = max([stage[id(d)] + (owner[id(d)] != owner[id(t)] or id(d) in sent)
                                    for d in deps[id(t)]], default=0)
                stack.pop()
    index = {id(t): k for nodes in orders for k, t in enumerate(nodes)}
    merged = [t for nodes in orders for t in nodes]
    merged.sort(key=lambda t: (stage[id(t)], owner[id(t)], index[id(t)]))
    return merged


def build_split_graph(arch, hp: HParams, shards: list[Shard], weights: list[dict[str, Tensor]], kv: list,
                      backend_of: list[int], blocks: bool = False, **shape) -> GraphBuilder:
    """The one graph of a step over every shard: the lead's builder (its inputs are the graph's,
    its outputs the step's), with ``graph`` holding every device's nodes, ordered by exchange
    and device, and ``graph.pinned`` naming each node's scheduler backend (``backend_of[i]``
    for shard i); ``exchange`` its Exchange.  ``blocks``: the devices' products take activations
    in blocks (Exchange)."""
    ex = Exchange(shards, blocks)
    builders = []
    shared: GraphInputs | None = None
    for i, shard in enumerate(shards):
        vocab = shard.vocab_rows[1] - shard.vocab_rows[0]
        local = dict(shape, n_top=min(shape.get("n_top", 0), vocab))
        b = ShardBuilder(local_hparams(hp, shard), weights[i], kv[i], exchange=ex, index=i, global_hp=hp, **local)
        if shared is None:
            shared = b.inputs
        # each device reads the step's inputs from a copy of its own, made once per step (a read
        # of the host's input would be copied anew into every split that makes it); the history's
        # ids are each device's own (its rows of the head: set_hist)
        own_hist = b.inputs.hist_ids
        b.inputs = GraphInputs(**{f.name: ops.cont(getattr(shared, f.name)) if getattr(shared, f.name) is not None
                                  else None for f in dataclasses.fields(GraphInputs)})
        b.inputs.hist_ids = own_hist
        arch.build(b)
        builders.append(b)
    # each device's nodes in its own builder's order (which puts the cache writes before the
    # attention that reads the cache: an order no source names), taken before the placeholders
    # are pointed at the other devices' slices
    own = [Graph() for _ in builders]
    for i, b in enumerate(builders):
        for t in list(b.graph.nodes) + list(ex.made[i].values()):
            own[i].build_forward_expand(t)
    owner = {id(t): i for i, g in enumerate(own) for t in g.nodes}
    actual = {id(p): ex.made[j][key] for p, j, key in ex.wanted}
    for g in own:
        for t in g.nodes:
            for k, s in enumerate(t.src):
                if s is not None and id(s) in actual:
                    real = actual[id(s)]
                    if real.ne != s.ne:
                        raise AssertionError(f"{s.name}: the slice made is {real.ne}, the one expected {s.ne}")
                    t.src[k] = real
    merged = Graph()
    merged.nodes = merge_by_stage([g.nodes for g in own], owner)
    result = builders[0].graph.nodes[-1]  # last, as graph.output() expects (nothing reads it)
    merged.nodes.remove(result)
    merged.nodes.append(result)
    merged.leafs = list({id(x): x for g in own for x in g.leafs if id(x) not in actual}.values())
    merged.pinned = {id(t): backend_of[owner[id(t)]] for t in merged.nodes}
    lead = builders[0]
    lead.graph = merged
    lead.inputs = shared
    lead.parts = builders
    lead.n_top_all = shape.get("n_top", 0)
    return lead
