"""Write tests/data/moe-llamacpp.json: llama.cpp's next-token log-probabilities and greedy
continuations on the tiny random mixture-of-experts models of tests/models/synthetic.py (qwen3moe,
and a Mixtral-style llama), which tests/models/test_moe.py holds pyggml to.

    python tools/moe_reference.py ~/.cache/llama.cpp-ref/build/bin/llama-server [NAME ...]

(with names: only those models, the others' answers kept as the file has them)

(``../shared/bin/build-llamacpp`` builds llama-server; a reference tool, never a dependency.)
The models are rebuilt from their seeds by the test, so only llama.cpp's answers are stored.
"""
from __future__ import annotations

import json
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.models.synthetic import Shape, expert_types, random_weights, write_model  # noqa: E402

# name -> (arch, seed, type of the expert weights, type of the down experts if another)
MODELS = {"qwen3moe": ("qwen3moe", 8, None, None), "llama-moe": ("llama", 9, None, None),
          "qwen3moe-q8_0": ("qwen3moe", 10, "Q8_0", None), "llama-moe-q4_0": ("llama", 11, "Q4_0", None),
          "qwen3moe-q4_k": ("qwen3moe", 12, "Q4_K", "Q6_K"), "llama-moe-q6_k": ("llama", 13, "Q6_K", None),
          "gpt-oss-mxfp4": ("gpt-oss", 14, "MXFP4", None)}
SHAPE = dict(n_vocab=320, n_ff_exp=64)  # expert rows in whole 32-element blocks, for the quantized ones
K_SHAPE = dict(n_embd=256, n_ff=256, n_ff_exp=256)  # ... and in whole 256-element super-blocks for the K-quants



def model_shape(qtype: str | None) -> dict:
    """The shape's fields that differ from SHAPE for experts of ``qtype``."""
    return K_SHAPE if qtype and qtype.endswith("_K") else {}
N_PROBS = 5


def sequence(seed: int, n: int = 24) -> list[int]:
    import numpy as np
    return [1] + [int(t) for t in np.random.default_rng(seed).integers(3, SHAPE["n_vocab"], n - 1)]


def post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    return json.load(urllib.request.urlopen(req, timeout=60))


def main() -> None:
    server_bin, only = sys.argv[1], sys.argv[2:]
    target = ROOT / "tests" / "data" / "moe-llamacpp.json"
    out = {"shape": SHAPE, "n_probs": N_PROBS, "models": {}}
    if only:
        out["models"] = json.loads(target.read_text())["models"]
    with tempfile.TemporaryDirectory() as tmp:
        for name, (arch, seed, qtype, down) in MODELS.items():
            if only and name not in only:
                continue
            s = Shape(**{**SHAPE, **model_shape(qtype)})
            weights = random_weights(arch, s, seed=seed, moe=True)
            path = write_model(Path(tmp) / f"{name}.gguf", arch, s, weights, expert_types(weights, qtype, down),
                               vocab=True)
            with socket.socket() as sock:
                sock.bind(("127.0.0.1", 0))
                port = sock.getsockname()[1]
            # gpt-oss: attention with sinks as pyggml computes it, llama.cpp's unfused path (KQ, softmax, V)
            unfused = ["-fa", "off"] if arch == "gpt-oss" else []
            proc = subprocess.Popen([server_bin, "-m", str(path), "--port", str(port), "-c", "128", "-np", "1",
                                     "-t", "2", "--no-webui", *unfused], stdout=subprocess.DEVNULL,
                                    stderr=open(Path(tmp) / f"{name}.log", "w"))
            url = f"http://127.0.0.1:{port}"
            try:
                for _ in range(100):
                    try:
                        if json.load(urllib.request.urlopen(url + "/health", timeout=2)).get("status") == "ok":
                            break
                    except OSError:
                        pass
                    if proc.poll() is not None:
                        raise RuntimeError((Path(tmp) / f"{name}.log").read_text()[-2000:])
                    time.sleep(0.2)
                tokens = sequence(seed)
                positions = []
                for n in range(1, len(tokens) + 1):
                    r = post(url + "/completion", {"prompt": tokens[:n], "n_predict": 1, "temperature": 0,
                                                   "n_probs": N_PROBS, "post_sampling_probs": False, "ignore_eos": True,
                                                   "cache_prompt": False})
                    if "completion_probabilities" not in r:
                        raise RuntimeError(f"{name}, prefix {n}: {str(r)[:300]}")
                    top = r["completion_probabilities"][0]["top_logprobs"]
                    positions.append([[t["id"], t["logprob"]] for t in top])
                r = post(url + "/completion", {"prompt": tokens[:8], "n_predict": 16, "temperature": 0,
                                               "ignore_eos": True, "return_tokens": True, "cache_prompt": False})
                out["models"][name] = {"arch": arch, "seed": seed, "experts": qtype, "down_experts": down,
                                       "shape": model_shape(qtype), "tokens": tokens, "top": positions,
                                       "greedy_prompt": tokens[:8], "greedy": r["tokens"]}
            finally:
                proc.terminate()
                proc.wait(10)
    target.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {target}")


if __name__ == "__main__":
    main()
