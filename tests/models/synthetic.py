"""Tiny random models written with the gguf package, and a plain numpy forward pass of them.

For architectures without a real model in the reference set (qwen2, qwen3): the GGUF holds
random F32 weights in the llama.cpp tensor layout, and :func:`reference_logits` computes the
same transformer in float64 numpy, written from the architectures' definitions (not from
pyggml's graph code), so that the two can be compared.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np


@dataclass
class Shape:
    n_embd: int = 64
    n_layer: int = 2
    n_ff: int = 96
    n_head: int = 4
    n_head_kv: int = 2
    n_vocab: int = 128
    eps: float = 1e-6
    rope_base: float = 10000.0
    n_expert: int = 6       # qwen3moe: experts per layer, each token routed to n_expert_used
    n_expert_used: int = 2
    n_ff_exp: int = 48

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head


def expert_types(weights: dict, qtype: str | None, down: str | None = None) -> dict[str, str]:
    """write_model's ``types`` for a mixture of experts: every expert tensor stored as ``qtype``
    (none: as they are), the down experts as ``down`` if given."""
    return {n: (down if down and "ffn_down_exps." in n else qtype) for n in weights
            if qtype and "_exps." in n and n.endswith(".weight")}  # (gpt-oss's expert biases stay F32)


def random_weights(arch: str, s: Shape, seed: int = 0, moe: bool | None = None) -> dict[str, np.ndarray]:
    """numpy arrays shaped [rows, cols] (GGUF's ne reversed), named as llama.cpp names them;
    ``moe`` (qwen3moe's default) puts a router and experts in place of every FFN (a
    Mixtral-style llama with arch "llama")."""
    moe = arch == "qwen3moe" if moe is None else moe
    rng = np.random.default_rng(seed)

    def mat(rows: int, cols: int, scale: float = 0.5) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) * scale / np.sqrt(cols)).astype(np.float32)

    def vec(n: int, center: float = 1.0) -> np.ndarray:
        return (center + 0.1 * rng.standard_normal(n)).astype(np.float32)

    kv = s.n_head_kv * s.head_dim
    w = {"token_embd.weight": mat(s.n_vocab, s.n_embd, 1.0 * np.sqrt(s.n_embd)),
         "output_norm.weight": vec(s.n_embd), "output.weight": mat(s.n_vocab, s.n_embd)}
    for il in range(s.n_layer):
        p = f"blk.{il}."
        w |= {p + "attn_norm.weight": vec(s.n_embd), p + "attn_q.weight": mat(s.n_embd, s.n_embd),
              p + "attn_k.weight": mat(kv, s.n_embd), p + "attn_v.weight": mat(kv, s.n_embd),
              p + "attn_output.weight": mat(s.n_embd, s.n_embd), p + "ffn_norm.weight": vec(s.n_embd)}
        if arch == "gpt-oss":  # biases everywhere, sinks, a norm after attention, biased router and experts
            ff = s.n_ff_exp
            w[p + "post_attention_norm.weight"] = w.pop(p + "ffn_norm.weight")
            w |= {p + "attn_q.bias": vec(s.n_embd, 0.0), p + "attn_k.bias": vec(kv, 0.0),
                  p + "attn_v.bias": vec(kv, 0.0), p + "attn_output.bias": vec(s.n_embd, 0.0),
                  p + "attn_sinks.weight": (rng.standard_normal(s.n_head) * 2).astype(np.float32),
                  p + "ffn_gate_inp.bias": vec(s.n_expert, 0.0),
                  p + "ffn_gate_exps.bias": np.stack([vec(ff, 0.0) for _ in range(s.n_expert)]),
                  p + "ffn_up_exps.bias": np.stack([vec(ff, 0.0) for _ in range(s.n_expert)]),
                  p + "ffn_down_exps.bias": np.stack([vec(s.n_embd, 0.0) for _ in range(s.n_expert)])}
        if moe:  # a router and stacked experts [n_expert, rows, cols] in place of the FFN
            ff = s.n_ff_exp if arch in ("qwen3moe", "gpt-oss") else s.n_ff  # Mixtral's are feed_forward_length wide
            w |= {p + "ffn_gate_inp.weight": mat(s.n_expert, s.n_embd, 4.0),
                  p + "ffn_gate_exps.weight": np.stack([mat(ff, s.n_embd) for _ in range(s.n_expert)]),
                  p + "ffn_up_exps.weight": np.stack([mat(ff, s.n_embd) for _ in range(s.n_expert)]),
                  p + "ffn_down_exps.weight": np.stack([mat(s.n_embd, ff) for _ in range(s.n_expert)])}
        else:
            w |= {p + "ffn_gate.weight": mat(s.n_ff, s.n_embd), p + "ffn_up.weight": mat(s.n_ff, s.n_embd),
                  p + "ffn_down.weight": mat(s.n_embd, s.n_ff)}
        if arch == "qwen2":
            w |= {p + "attn_q.bias": vec(s.n_embd, 0.0), p + "attn_k.bias": vec(kv, 0.0),
                  p + "attn_v.bias": vec(kv, 0.0)}
        if arch in ("qwen3", "qwen3moe"):
            w |= {p + "attn_q_norm.weight": vec(s.head_dim), p + "attn_k_norm.weight": vec(s.head_dim)}
    return w


GPT_OSS_WINDOW = 8          # tokens a sliding-window layer sees: the 24-token tests cross it
GPT_OSS_YARN = (4.0, 64)    # YaRN factor, original context


def write_model(path: Path, arch: str, s: Shape, weights: dict[str, np.ndarray],
                types: dict[str, str] | None = None, vocab: bool = False) -> Path:
    """The GGUF file; ``types`` stores the named weights quantized (e.g. {"blk.0.ffn_up.weight": "Q4_K"});
    ``vocab`` adds a SentencePiece vocabulary (<unk> <s> </s>, then whole words: no byte
    pieces, so that llama-server reports every token's probability) for llama.cpp to load
    the file too."""
    import gguf

    import pyggml as pg
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"tiny-{arch}")
    w.add_context_length(512)
    w.add_embedding_length(s.n_embd)
    w.add_block_count(s.n_layer)
    w.add_feed_forward_length(s.n_ff)
    w.add_head_count(s.n_head)
    w.add_head_count_kv(s.n_head_kv)
    w.add_rope_freq_base(s.rope_base)
    w.add_layer_norm_rms_eps(s.eps)
    w.add_vocab_size(s.n_vocab)
    if vocab:
        words = s.n_vocab - 3
        w.add_tokenizer_model("llama")
        w.add_token_list(["<unk>", "<s>", "</s>"] + [f"\u2581w{i}" for i in range(words)])
        w.add_token_scores([0.0] * 3 + [-float(i) for i in range(words)])
        w.add_token_types([2, 3, 3] + [1] * words)
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        w.add_unk_token_id(0)
    if arch == "gpt-oss":  # sliding windows on even layers, YaRN on every layer
        w.add_sliding_window(GPT_OSS_WINDOW)
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(GPT_OSS_YARN[0])
        w.add_rope_scaling_orig_ctx_len(GPT_OSS_YARN[1])
    if "blk.0.ffn_gate_inp.weight" in weights:
        w.add_expert_count(s.n_expert)
        w.add_expert_used_count(s.n_expert_used)
        w.add_expert_feed_forward_length(s.n_ff_exp)
    for name, value in weights.items():
        qtype = (types or {}).get(name)
        if qtype is None:
            w.add_tensor(name, value)
        else:
            rows = pg.quants.quantize(value.reshape(-1, value.shape[-1]), qtype)  # stacked experts: row by row
            w.add_tensor(name, np.asarray(rows).reshape(value.shape[:-1] + (-1,)),
                         raw_dtype=gguf.GGMLQuantizationType(int(pg.Type[qtype])))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _rms_norm(x: np.ndarray, g: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * g


def _rope(x: np.ndarray, pos: np.ndarray, base: float, neox: bool) -> np.ndarray:
    """x [tokens, heads, d] rotated by position: pairs (i, i + d/2) (neox) or (2i, 2i + 1)."""
    d = x.shape[-1]
    theta = pos[:, None] * base ** (-np.arange(0, d, 2) / d)      # [tokens, d/2]
    cos, sin = np.cos(theta)[:, None, :], np.sin(theta)[:, None, :]
    if neox:
        a, b = x[..., : d // 2], x[..., d // 2:]
        return np.concatenate([a * cos - b * sin, a * sin + b * cos], axis=-1)
    out = np.empty_like(x)
    a, b = x[..., 0::2], x[..., 1::2]
    out[..., 0::2], out[..., 1::2] = a * cos - b * sin, a * sin + b * cos
    return out


def _moe(h: np.ndarray, w: dict[str, np.ndarray], p: str, n_used: int) -> np.ndarray:
    """Softmax router, the top n_used experts per token, their probabilities renormalized to
    sum 1, the weighted sum of their SwiGLU FFNs (Qwen3-MoE's definition)."""
    out = np.zeros_like(h)
    for t in range(h.shape[0]):
        logits = w[p + "ffn_gate_inp.weight"] @ h[t]
        probs = np.exp(logits - logits.max())
        probs /= probs.sum()
        top = np.argsort(-probs, kind="stable")[:n_used]
        for e, weight in zip(top, probs[top] / probs[top].sum()):
            gate, up = w[p + "ffn_gate_exps.weight"][e] @ h[t], w[p + "ffn_up_exps.weight"][e] @ h[t]
            out[t] += weight * (w[p + "ffn_down_exps.weight"][e] @ (gate / (1 + np.exp(-gate)) * up))
    return out


def reference_logits(arch: str, s: Shape, weights: dict[str, np.ndarray], tokens: list[int]) -> np.ndarray:
    """float64 logits [len(tokens), n_vocab] of the causal transformer the weights describe."""
    w = {k: v.astype(np.float64) for k, v in weights.items()}
    n, hd, group = len(tokens), s.head_dim, s.n_head // s.n_head_kv
    neox = arch in ("qwen2", "qwen3", "qwen3moe")
    pos = np.arange(n, dtype=np.float64)
    x = w["token_embd.weight"][tokens]
    causal = np.triu(np.full((n, n), -np.inf), k=1)
    for il in range(s.n_layer):
        p = f"blk.{il}."
        h = _rms_norm(x, w[p + "attn_norm.weight"], s.eps)
        q = h @ w[p + "attn_q.weight"].T + w.get(p + "attn_q.bias", 0.0)
        k = h @ w[p + "attn_k.weight"].T + w.get(p + "attn_k.bias", 0.0)
        v = h @ w[p + "attn_v.weight"].T + w.get(p + "attn_v.bias", 0.0)
        q, k, v = q.reshape(n, s.n_head, hd), k.reshape(n, s.n_head_kv, hd), v.reshape(n, s.n_head_kv, hd)
        if arch in ("qwen3", "qwen3moe"):
            q = _rms_norm(q, w[p + "attn_q_norm.weight"], s.eps)
            k = _rms_norm(k, w[p + "attn_k_norm.weight"], s.eps)
        q, k = _rope(q, pos, s.rope_base, neox), _rope(k, pos, s.rope_base, neox)
        heads = []
        for hh in range(s.n_head):
            scores = q[:, hh] @ k[:, hh // group].T / np.sqrt(hd) + causal
            probs = np.exp(scores - scores.max(-1, keepdims=True))
            probs /= probs.sum(-1, keepdims=True)
            heads.append(probs @ v[:, hh // group])
        x = x + np.concatenate(heads, axis=-1) @ w[p + "attn_output.weight"].T
        h = _rms_norm(x, w[p + "ffn_norm.weight"], s.eps)
        if p + "ffn_gate_inp.weight" in w:
            x = x + _moe(h, w, p, s.n_expert_used)
            continue
        gate, up = h @ w[p + "ffn_gate.weight"].T, h @ w[p + "ffn_up.weight"].T
        x = x + (gate / (1 + np.exp(-gate)) * up) @ w[p + "ffn_down.weight"].T
    return _rms_norm(x, w["output_norm.weight"], s.eps) @ w["output.weight"].T
