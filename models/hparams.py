"""Hyper-parameters of a model, read from its GGUF metadata (``{arch}.block_count`` ...)."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from pyggml.gguf import GGUFError, GGUFFile


def _scalar(value: Any) -> Any:
    """Some keys may hold one value per layer; the models we support use one for all."""
    if isinstance(value, np.ndarray):
        return value[0].item() if len(value) else None
    if isinstance(value, (list, tuple)):
        return value[0] if value else None
    return value


EXPERT_UP = "blk.0.ffn_up_exps.weight"


@dataclass
class HParams:
    arch: str
    n_vocab: int
    n_ctx_train: int
    n_embd: int
    n_layer: int
    n_head: int
    n_head_kv: int
    n_embd_head_k: int
    n_embd_head_v: int
    n_ff: int
    norm_eps: float
    rope_dims: int
    rope_freq_base: float
    rope_freq_scale: float          # 1 / the scaling factor (linear or YaRN)
    rope_freq_base_swa: float       # RoPE base of the sliding-window layers (Gemma 3: 10 000)
    n_swa: int = 0                  # sliding-window size, 0 = none
    swa_pattern: int = 0            # every swa_pattern-th layer is global (Gemma 3: 6)
    attn_softcap: float = 0.0
    final_softcap: float = 0.0
    attn_scale: float = 0.0         # query scale; 0 = 1/sqrt(n_embd_head_k)
    n_expert: int = 0               # mixture of experts: experts per layer (0: a dense FFN)
    n_expert_used: int = 0          # experts each token is routed to
    n_ff_exp: int = 0               # an expert's hidden rows, as its tensors hold them (0: no experts)
    rope_freq_scale_swa: float = 1.0  # the sliding-window layers' (gpt-oss: the others')
    # YaRN (rope.scaling.type "yarn"), as llama.cpp's context sets it up: 0 / 1 / the training context without
    rope_ext_factor: float = 0.0
    rope_attn_factor: float = 1.0
    n_ctx_orig_yarn: int = 0

    @property
    def n_embd_k_gqa(self) -> int:
        return self.n_embd_head_k * self.n_head_kv

    @property
    def n_embd_v_gqa(self) -> int:
        return self.n_embd_head_v * self.n_head_kv

    @property
    def head_share(self) -> float:
        """A row of the output head's multiply-adds over a token's through the layers (their
        products; a mixture's used experts): what one output row more adds to a step, in tokens."""
        attn = self.n_embd * (self.n_head * self.n_embd_head_k + self.n_embd_k_gqa + self.n_embd_v_gqa) \
            + self.n_head * self.n_embd_head_v * self.n_embd
        ffn = 3 * self.n_embd * (self.n_ff_exp * self.n_expert_used if self.n_expert else self.n_ff)
        return self.n_vocab * self.n_embd / max(1, self.n_layer * (attn + ffn))

    def is_swa(self, il: int) -> bool:
        """Sliding-window layer?  With a pattern of 6, layers 5, 11, 17 ... are global."""
        return self.n_swa > 0 and self.swa_pattern > 0 and il % self.swa_pattern < self.swa_pattern - 1

    def kq_scale(self) -> float:
        return self.attn_scale or 1.0 / math.sqrt(self.n_embd_head_k)

    @classmethod
    def from_gguf(cls, f: GGUFFile, arch: str) -> HParams:
        def get(key: str, default: Any = None, required: bool = False) -> Any:
            value = _scalar(f.get(f"{arch}.{key}", default))
            if value is None and required:
                raise GGUFError(f.path, f"missing metadata {arch}.{key}")
            return value

        n_embd = int(get("embedding_length", required=True))
        n_head = int(get("attention.head_count", required=True))
        head_k = int(get("attention.key_length", n_embd // n_head))
        n_vocab = get("vocab_size") or len(f.get("tokenizer.ggml.tokens", [])) or \
            f.tensors["token_embd.weight"].ne[1]
        scaling = str(get("rope.scaling.type", "none"))
        factor = float(get("rope.scaling.factor", 1.0) or 1.0)
        scaled = scaling in ("linear", "yarn") and factor > 0
        ext_factor, attn_factor = (1.0, yarn_attn_factor(factor)) if scaling == "yarn" and factor > 0 else (0.0, 1.0)
        attn_factor = float(np.float32(attn_factor) * np.float32(get("rope.scaling.attn_factor", 1.0) or 1.0))
        return cls(
            arch=arch,
            n_vocab=int(n_vocab),
            n_ctx_train=int(get("context_length", 2048)),
            n_embd=n_embd,
            n_layer=int(get("block_count", required=True)),
            n_head=n_head,
            n_head_kv=int(get("attention.head_count_kv", n_head)),
            n_embd_head_k=head_k,
            n_embd_head_v=int(get("attention.value_length", head_k)),
            n_ff=int(get("feed_forward_length", required=True)),
            norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)),
            rope_dims=int(get("rope.dimension_count", head_k)),
            rope_freq_base=float(get("rope.freq_base", 10000.0)),
            rope_freq_scale=float(np.float32(1.0) / np.float32(factor)) if scaled else 1.0,
            rope_freq_base_swa=float(get("rope.freq_base_swa", 10000.0)),
            n_swa=int(get("attention.sliding_window", 0) or 0),
            attn_softcap=float(get("attn_logit_softcapping", 0.0) or 0.0),
            final_softcap=float(get("final_logit_softcapping", 0.0) or 0.0),
            n_expert=int(get("expert_count", 0) or 0),
            n_expert_used=int(get("expert_used_count", 0) or 0),
            # (from the tensors: a Mixtral-style file's experts are feed_forward_length wide, whatever
            # else its metadata says)
            n_ff_exp=int(f.tensors[EXPERT_UP].ne[1]) if EXPERT_UP in f.tensors else 0,
            rope_ext_factor=ext_factor,
            rope_attn_factor=attn_factor,
            n_ctx_orig_yarn=int(get("rope.scaling.original_context_length", 0) or 0),
        )


def yarn_attn_factor(factor: float) -> float:
    """llama.cpp's YaRN attention factor without a log multiplier: its mscale, 1 + 0.1 ln(factor),
    times the cancelling 1 / (1 + 0.1 ln(factor)) its rope kernel's own mscale calls for - one
    in float32 arithmetic, as llama_context computes it (not always exactly 1)."""
    f32 = np.float32
    log = f32(np.log(f32(factor)))
    mscale = f32(f32(0.1) * log) + f32(1.0) if factor > 1.0 else f32(1.0)
    return float(f32(mscale * f32(f32(1.0) / f32(f32(1.0) + f32(f32(0.1) * log)))))
