"""Write tests/data/moe-llamacpp.json: llama.cpp's next-token log-probabilities and greedy
continuations on the tiny random mixture-of-experts models of tests/synthetic.py (qwen3moe,
and a Mixtral-style llama), which tests/test_moe.py holds pyggml to.

    python tools/moe_reference.py ~/.cache/llama.cpp-ref/build/bin/llama-server

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

from tests.synthetic import Shape, random_weights, write_model  # noqa: E402

MODELS = {"qwen3moe": ("qwen3moe", 8), "llama-moe": ("llama", 9)}  # name -> (arch, seed)
SHAPE = dict(n_vocab=320)
N_PROBS = 5


def sequence(seed: int, n: int = 24) -> list[int]:
    import numpy as np
    return [1] + [int(t) for t in np.random.default_rng(seed).integers(3, SHAPE["n_vocab"], n - 1)]


def post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    return json.load(urllib.request.urlopen(req, timeout=60))


def main() -> None:
    server_bin = sys.argv[1]
    out = {"shape": SHAPE, "n_probs": N_PROBS, "models": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for name, (arch, seed) in MODELS.items():
            s = Shape(**SHAPE)
            path = write_model(Path(tmp) / f"{name}.gguf", arch, s, random_weights(arch, s, seed=seed, moe=True),
                               vocab=True)
            with socket.socket() as sock:
                sock.bind(("127.0.0.1", 0))
                port = sock.getsockname()[1]
            proc = subprocess.Popen([server_bin, "-m", str(path), "--port", str(port), "-c", "128", "-np", "1",
                                     "-t", "2", "--no-webui"], stdout=subprocess.DEVNULL,
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
                out["models"][name] = {"arch": arch, "seed": seed, "tokens": tokens, "top": positions,
                                       "greedy_prompt": tokens[:8], "greedy": r["tokens"]}
            finally:
                proc.terminate()
                proc.wait(10)
    target = ROOT / "tests" / "data" / "moe-llamacpp.json"
    target.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {target}")


if __name__ == "__main__":
    main()
