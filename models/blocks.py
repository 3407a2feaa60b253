"""Shared building blocks of the model graphs (llama.cpp's llm_graph_context).

An architecture file builds one forward pass from these: ``build_inp_embd``,
``build_norm``, ``build_attn`` (KV cache write + fused attention), ``build_ffn`` and
``build_output``.  Every intermediate tensor is named ``name-il`` like llama.cpp's
callback names (``attn_norm-3``, ``ffn_out-3`` ...), so graphs can be read and debugged.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from pyggml import Graph, Tensor, Type, new_tensor, ops
from pyggml.backend import tensor_set
from pyggml.opdefs import RopeMode

from .hparams import HParams
from .kv_cache import KVCache


@dataclass
class GraphInputs:
    """The tensors the caller fills before each compute (llm_graph_input_*)."""
    tokens: Tensor            # I32 [n_tokens]
    pos: Tensor               # I32 [n_tokens]
    kv_idxs: Tensor           # I32 [n_tokens]: cache cells to write
    kq_mask: Tensor           # F32 [n_kv, n_tokens]: 0 or -inf (causal)
    kq_mask_swa: Tensor | None  # same, also masking cells outside the sliding window
    out_ids: Tensor | None    # I32 [n_outputs]: rows whose logits are wanted (None: all)
    hist_ids: Tensor | None = None  # I32 [n_hist, n_outputs]: tokens whose logits come along with the top k
    # a batch of several sequences: where each one's tokens (and output rows) start, and the
    # count last - so that every product computes each sequence as it would alone (ops.mul_mat)
    token_runs: Tensor | None = None  # I32 [n_runs + 1]
    output_runs: Tensor | None = None  # I32 [n_output_runs + 1]

    def all(self) -> list[Tensor]:
        return [t for t in (self.tokens, self.pos, self.kv_idxs, self.kq_mask, self.kq_mask_swa, self.out_ids,
                            self.hist_ids, self.token_runs, self.output_runs) if t is not None]


@dataclass
class TopOutputs:
    """What a graph with ``n_top`` brings back instead of whole rows of logits: per output row
    the ids of the n_top largest logits (largest first) and their values, and the logits of
    the ``hist_ids`` tokens (for the sampler's penalties)."""
    ids: Tensor                # I32 [n_top, n_outputs]
    values: Tensor             # F32 [1, n_top, n_outputs]
    hist_values: Tensor | None  # F32 [1, n_hist, n_outputs]


def mask_type(devices: list) -> Type:
    """The type of the attention masks: F32, unless a device runs attention only with an F16
    mask (a llama.cpp server: ggml's CPU flash attention reads its mask as F16), asked through
    supports_op.  Masks hold 0 and -inf, exact in both."""
    q, kv = new_tensor(Type.F32, (64, 1, 1)), new_tensor(Type.F16, (64, 256, 1))
    probe = ops.flash_attn_ext(q, kv, kv, new_tensor(Type.F32, (256, 1)), 0.125)
    return Type.F32 if all(d.supports_op(probe) for d in devices) else Type.F16


@dataclass
class GraphBuilder:
    hp: HParams
    weights: dict[str, Tensor]
    kv: KVCache
    n_tokens: int
    n_kv: int
    n_outputs: int
    rope_mode: RopeMode = RopeMode.NORMAL
    n_top: int = 0   # > 0: the graph's result is the top n_top logits per row (TopOutputs), not the rows
    n_hist: int = 0
    n_runs: int = 0  # > 0: the batch's tokens come in this many runs of one sequence each (GraphInputs)
    n_output_runs: int = 0
    mask_type: Type = Type.F32  # (mask_type(): F16 where a device runs attention only with F16 masks)
    graph: Graph = field(default_factory=Graph)
    inputs: GraphInputs = field(init=False)
    top: TopOutputs | None = field(init=False, default=None)
    logits: Tensor | None = field(init=False, default=None)  # build_output's

    def __post_init__(self) -> None:
        n, n_kv = self.n_tokens, self.n_kv
        needs_swa = any(self.hp.is_swa(il) for il in range(self.hp.n_layer))
        self.inputs = GraphInputs(
            tokens=new_tensor(Type.I32, (n,), "inp_tokens").set_input(),
            pos=new_tensor(Type.I32, (n,), "inp_pos").set_input(),
            kv_idxs=new_tensor(Type.I32, (n,), "inp_kv_idxs").set_input(),
            kq_mask=new_tensor(self.mask_type, (n_kv, n), "inp_kq_mask").set_input(),
            kq_mask_swa=new_tensor(self.mask_type, (n_kv, n), "inp_kq_mask_swa").set_input() if needs_swa else None,
            out_ids=new_tensor(Type.I32, (self.n_outputs,), "inp_out_ids").set_input()
            if self.n_outputs < n else None,
            hist_ids=new_tensor(Type.I32, (self.n_hist, self.n_outputs), "inp_hist_ids").set_input()
            if self.n_top and self.n_hist else None,
            token_runs=new_tensor(Type.I32, (self.n_runs + 1,), "inp_token_runs").set_input() if self.n_runs else None,
            output_runs=new_tensor(Type.I32, (self.n_output_runs + 1,), "inp_output_runs").set_input()
            if self.n_output_runs else None,
        )

    # -- helpers ------------------------------------------------------------------------------------
    def w(self, name: str, il: int | None = None) -> Tensor | None:
        """A weight by its GGUF name (``blk.{il}.`` prefixed for a layer), or None if absent."""
        return self.weights.get(f"blk.{il}.{name}" if il is not None else name)

    @staticmethod
    def cb(t: Tensor, name: str, il: int | None = None) -> Tensor:
        return t.set_name(f"{name}-{il}" if il is not None else name)

    def gathered(self, t: Tensor, name: str, il: int | None = None) -> Tensor:
        """``t`` whole: on one device it is; a tensor split's builder (tensor_split.py) holds
        its device's rows of it and concatenates every device's."""
        return t

    def linear(self, x: Tensor, name: str, il: int | None = None) -> Tensor:
        """x @ W (+ bias when the file has one)."""
        return self.with_bias(*self.product_and_bias(x, name, il))

    @staticmethod
    def with_bias(y: Tensor, b: Tensor | None) -> Tensor:
        return ops.add(y, b) if b is not None else y

    def product_and_bias(self, x: Tensor, name: str, il: int | None = None) -> tuple[Tensor, Tensor | None]:
        """linear's two parts: x @ W, and the bias (None when the file has none)."""
        w = self.w(f"{name}.weight", il)
        if w is None:
            raise KeyError(f"model has no tensor {f'blk.{il}.' if il is not None else ''}{name}.weight")
        return ops.mul_mat(w, x, self.inputs.token_runs), self.w(f"{name}.bias", il)

    # -- blocks -------------------------------------------------------------------------------------
    def build_inp_embd(self, scale: float = 1.0) -> Tensor:
        cur = ops.get_rows(self.weights["token_embd.weight"], self.inputs.tokens)
        if scale != 1.0:
            cur = ops.scale(cur, scale)
        return self.cb(cur, "inp_embd")

    def build_norm(self, x: Tensor, weight: Tensor | None, name: str, il: int | None = None,
                   eps: float | None = None) -> Tensor:
        cur = ops.rms_norm(x, self.hp.norm_eps if eps is None else eps)
        if weight is not None:
            cur = ops.mul(cur, weight)
        return self.cb(cur, name, il)

    def build_rope(self, x: Tensor, il: int) -> Tensor:
        hp = self.hp
        base = hp.rope_freq_base_swa if hp.is_swa(il) else hp.rope_freq_base
        scale = hp.rope_freq_scale_swa if hp.is_swa(il) else hp.rope_freq_scale
        return ops.rope_ext(x, self.inputs.pos, self.w("rope_freqs.weight"), hp.rope_dims, self.rope_mode,
                            hp.n_ctx_orig_yarn or hp.n_ctx_train, base, scale, hp.rope_ext_factor, hp.rope_attn_factor)

    def build_attn(self, q: Tensor, k: Tensor, v: Tensor, il: int, kq_scale: float,
                   sinks: Tensor | None = None) -> Tensor:
        """Write this batch's k, v ([head_dim, n_head_kv, n_tokens]) into the cache, attend
        with q ([head_dim, n_head, n_tokens]) over the first n_kv cells, project with attn_output.
        ``sinks`` (gpt-oss: a logit per head that takes its share of the softmax)."""
        hp, kv = self.hp, self.kv
        n = self.n_tokens
        k_cache, v_cache = kv.k[il], kv.v[il]
        # the writes are expanded into the graph now, so they run before the attention reads
        self.graph.build_forward_expand(self.cb(
            ops.set_rows(k_cache, ops.reshape(k, hp.n_embd_k_gqa, n), self.inputs.kv_idxs), "k_write", il))
        self.graph.build_forward_expand(self.cb(
            ops.set_rows(v_cache, ops.reshape(v, hp.n_embd_v_gqa, n), self.inputs.kv_idxs), "v_write", il))
        row_k, row_v = k_cache.nb[1], v_cache.nb[1]
        keys = ops.view(k_cache, (hp.n_embd_head_k, self.n_kv, hp.n_head_kv),
                        (row_k, k_cache.type.row_size(hp.n_embd_head_k)))
        values = ops.view(v_cache, (hp.n_embd_head_v, self.n_kv, hp.n_head_kv),
                          (row_v, v_cache.type.row_size(hp.n_embd_head_v)))
        mask = self.inputs.kq_mask_swa if hp.is_swa(il) else self.inputs.kq_mask
        attn = ops.flash_attn_ext(ops.permute(q, 0, 2, 1, 3), keys, values, mask, kq_scale,
                                  logit_softcap=hp.attn_softcap, sinks=sinks)
        cur = self.gathered(self.cb(ops.reshape(attn, hp.n_embd_head_v * hp.n_head, n), "kqv_out", il), "kqv_out", il)
        return self.gathered(self.cb(self.linear(cur, "attn_output", il), "attn_out", il), "attn_out", il)

    def build_qkv(self, cur: Tensor, il: int, qk_norm: bool = False) -> tuple[Tensor, Tensor, Tensor]:
        """Project to q, k, v heads; optionally RMS-normalize q and k per head; apply RoPE."""
        hp, n = self.hp, self.n_tokens
        # the three products go into the graph together (their biases after them), as llama.cpp's
        # build_attn puts them: nothing in between, so a backend may run them as one (the CPU's
        # plans do, fusion.py)
        parts = [self.product_and_bias(cur, f"attn_{x}", il) for x in "qkv"]
        for y, _ in parts:
            self.graph.build_forward_expand(y)
        q, k, v = (self.cb(self.with_bias(*part), name, il) for part, name in zip(parts, ("Qcur", "Kcur", "Vcur")))
        q = ops.reshape(q, hp.n_embd_head_k, hp.n_head, n)
        k = ops.reshape(k, hp.n_embd_head_k, hp.n_head_kv, n)
        v = ops.reshape(v, hp.n_embd_head_v, hp.n_head_kv, n)
        if qk_norm:
            q = self.build_norm(q, self.w("attn_q_norm.weight", il), "Qcur_normed", il)
            k = self.build_norm(k, self.w("attn_k_norm.weight", il), "Kcur_normed", il)
        q = self.cb(self.build_rope(q, il), "Qcur_rope", il)
        k = self.cb(self.build_rope(k, il), "Kcur_rope", il)
        return q, k, v

    def build_ffn(self, x: Tensor, il: int, act: Callable[[Tensor, Tensor], Tensor] = ops.swiglu) -> Tensor:
        """Gated feed-forward: down(act(gate(x)) * up(x))."""
        gate = self.cb(self.linear(x, "ffn_gate", il), "ffn_gate", il)
        up = self.cb(self.linear(x, "ffn_up", il), "ffn_up", il)
        cur = self.gathered(self.cb(act(gate, up), "ffn_act", il), "ffn_act", il)
        return self.gathered(self.cb(self.linear(cur, "ffn_down", il), "ffn_out", il), "ffn_out", il)

    def build_moe_ffn(self, x: Tensor, il: int, norm_weights: bool = True) -> Tensor:
        """Mixture-of-experts feed-forward, as llama.cpp's build_moe_ffn with softmax gating:
        router probabilities over the experts, the top n_expert_used per token (largest
        first), their probabilities as weights (renormalized to sum 1 with ``norm_weights``),
        each chosen expert's SwiGLU FFN, and the weighted sum of their outputs."""
        hp, n = self.hp, self.n_tokens
        n_expert, n_used = hp.n_expert, hp.n_expert_used
        runs = self.inputs.token_runs
        logits = self.cb(ops.mul_mat(self.w("ffn_gate_inp.weight", il), x, runs), "ffn_moe_logits", il)  # [n_expert, n]
        probs = self.cb(ops.soft_max(logits), "ffn_moe_probs", il)
        selected = self.cb(ops.top_k(probs, n_used), "ffn_moe_topk", il)                       # I32 [n_used, n]
        weights = self.cb(ops.get_rows(ops.reshape(probs, 1, n_expert, n), selected), "ffn_moe_weights", il)
        if norm_weights:
            weights = ops.reshape(weights, n_used, n)
            total = ops.clamp(ops.sum_rows(weights), 6.103515625e-5, float("inf"))  # llama.cpp's floor
            weights = self.cb(ops.reshape(ops.div(weights, total), 1, n_used, n), "ffn_moe_weights_norm", il)
        cur = ops.reshape(x, hp.n_embd, 1, n)
        up = self.cb(ops.mul_mat_id(self.w("ffn_up_exps.weight", il), cur, selected, runs), "ffn_moe_up", il)
        gate = self.cb(ops.mul_mat_id(self.w("ffn_gate_exps.weight", il), cur, selected, runs), "ffn_moe_gate", il)
        act = self.cb(ops.swiglu(gate, up), "ffn_moe_swiglu", il)                               # [n_ff, n_used, n]
        act = self.gathered(act, "ffn_moe_act", il)
        experts = self.cb(ops.mul_mat_id(self.w("ffn_down_exps.weight", il), act, selected, runs), "ffn_moe_down", il)
        experts = self.cb(ops.mul(experts, weights), "ffn_moe_weighted", il)                   # [n_embd, n_used, n]
        return self.gathered(self.sum_experts(experts, il), "ffn_moe_out", il)

    def sum_experts(self, experts: Tensor, il: int) -> Tensor:
        """The weighted experts' outputs [n_embd, n_used, n] added in slot order, as llama.cpp
        adds its views -> [n_embd, n]."""
        n_embd, n_used, n = experts.ne[:3]
        out = None
        for e in range(n_used):
            view = ops.view(experts, (n_embd, n), (experts.nb[2],), e * experts.nb[1])
            out = view if out is None else ops.add(out, view)
        if n_used == 1:
            out = ops.cont(out)
        return self.cb(out, "ffn_moe_out", il)

    def build_output(self, cur: Tensor) -> Tensor:
        """Keep only the wanted rows, final norm, output head (tied to the embedding when the
        file has no ``output.weight``), optional final soft-capping; with ``n_top``, the top
        logits of each row and those of the history tokens instead of whole rows, so that the
        vocabulary stays on the head's device."""
        if self.inputs.out_ids is not None:
            cur = self.cb(ops.get_rows(cur, self.inputs.out_ids), "out_rows")
        cur = self.build_norm(cur, self.weights["output_norm.weight"], "result_norm")
        logits = ops.mul_mat(self.head_weight(), cur, self.inputs.output_runs)
        cap = self.hp.final_softcap
        if cap:
            logits = ops.scale(ops.tanh(ops.scale(logits, 1.0 / cap)), cap)
        logits = self.cb(logits, "result_output")
        self.logits = logits
        if not self.n_top:
            logits.set_output()
            self.graph.build_forward_expand(logits)
            return logits
        as_rows = ops.reshape(logits, 1, logits.ne[0], logits.ne[1])  # one logit per row: GET_ROWS picks them
        ids = self.cb(ops.top_k(logits, self.n_top), "top_ids").set_output()
        values = self.cb(ops.get_rows(as_rows, ids), "top_values").set_output()
        hist = None
        if self.inputs.hist_ids is not None:
            hist = self.cb(ops.get_rows(as_rows, self.inputs.hist_ids), "hist_values").set_output()
        for t in (ids, values, hist):
            if t is not None:
                self.graph.build_forward_expand(t)
        self.top = TopOutputs(ids, values, hist)
        return logits

    def head_weight(self) -> Tensor:
        """The output head (the embedding, tied, when the file has no ``output.weight``)."""
        head = self.weights.get("output.weight")
        return head if head is not None else self.weights["token_embd.weight"]

    # -- what the caller reads (models/context.py) ----------------------------------------------------
    def set_hist(self, hist: np.ndarray) -> None:
        """The history tokens [n_outputs, n_hist] whose logits come along with the top k."""
        tensor_set(self.inputs.hist_ids, np.ascontiguousarray(hist, dtype=np.int32))

    def result_tensors(self) -> list[Tensor]:
        """The tensors a step reads back: the logits, or the top k's ids, values and history's."""
        t = self.top
        if t is None:
            return [self.logits]
        return [t.ids, t.values] + ([t.hist_values] if t.hist_values is not None else [])

    def results(self, arrays: list[np.ndarray], wanted: int, hist: np.ndarray | None = None):
        """result_tensors' arrays as the step returns them: logits [wanted, n_vocab], or the
        top k's (ids, values, history's values), each [wanted, ...]."""
        arrays = [a.reshape(self.n_outputs, -1)[:wanted] for a in arrays]  # (a padded piece's extra rows last)
        if self.top is None:
            return arrays[0]
        return arrays[0], arrays[1], arrays[2] if len(arrays) > 2 else np.zeros((wanted, 0), np.float32)
