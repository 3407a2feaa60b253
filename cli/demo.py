"""pyggml-demo: load a real GGUF and run a graph on it (until the chat tool lands).

It builds the smallest meaningful graph from a model's own weights - token embedding,
the final RMS norm and the output head - runs it on the CPU backend, and prints the
head's top tokens for each input token.
"""
from __future__ import annotations

import sys
import time

import click
import numpy as np

import pyggml as pg
from pyggml import hub, ops
from pyggml.gguf import GGUFError, GGUFFile


def _tokens_for(words: list[str], vocab: list[str]) -> list[int]:
    index = {tok: i for i, tok in enumerate(vocab)}
    ids = []
    for w in words:
        for candidate in ("Ġ" + w, "▁" + w, w):  # GPT-2 and SentencePiece word-start markers
            if candidate in index:
                ids.append(index[candidate])
                break
    return ids


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("-m", "--model", default=None, help="GGUF path or alias (smollm2, gemma3-270m); default smollm2.")
@click.option("-w", "--words", default="The capital of France is", show_default=True, help="Words to look up.")
@click.option("--top", default=5, show_default=True, help="How many top tokens to print per word.")
def main(model: str | None, words: str, top: int) -> None:
    """Run embedding -> final norm -> output head of a real GGUF model on the CPU backend."""
    try:
        path = hub.resolve(model)
        f = GGUFFile(path)
    except (GGUFError, ValueError, RuntimeError) as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(1)
    arch = f.architecture
    vocab = [str(t) for t in f.get("tokenizer.ggml.tokens", [])]
    for dev in pg.devices():
        free, total = dev.get_memory()
        click.echo(f"device {dev.get_name()}: {dev.get_description()} ({free / 2**30:.1f} of {total / 2**30:.1f} GiB free)")
    click.echo(f"model {path.name}: {arch}, {len(f.tensors)} tensors")

    names = ["token_embd.weight", "output_norm.weight"] + (["output.weight"] if "output.weight" in f.tensors else [])
    weights = {n: f.new_tensor(n) for n in names}
    t0 = time.perf_counter()
    f.load(weights.values(), pg.cpu_device().get_buffer_type())
    head = weights.get("output.weight", weights["token_embd.weight"])  # tied embeddings reuse the table

    ids = _tokens_for(words.split(), vocab)
    if not ids:
        click.echo("error: none of the words is a token of this model", err=True)
        sys.exit(1)
    inp = pg.new_tensor(pg.Type.I32, (len(ids),), "inp_tokens").set_input()
    cur = ops.get_rows(weights["token_embd.weight"], inp).set_name("inp_embd")
    cur = ops.mul(ops.rms_norm(cur, float(f.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6))),
                  weights["output_norm.weight"]).set_name("result_norm")
    logits = ops.mul_mat(head, cur).set_name("result_output")
    graph = pg.build_forward(logits)
    sched = pg.Scheduler([pg.cpu_device().init_backend()])
    sched.alloc_graph(graph)
    pg.tensor_set(inp, np.array(ids, dtype=np.int32))
    t1 = time.perf_counter()
    sched.graph_compute(graph)
    t2 = time.perf_counter()
    values = pg.tensor_array(logits)[0, 0]
    for i, tok in enumerate(ids):
        best = np.argsort(-values[i])[:top]
        click.echo(f"{vocab[tok]!r:>14} -> " + ", ".join(f"{vocab[j]!r}" for j in best))
    click.echo(f"loaded {sum(w.nbytes() for w in weights.values()) / 2**20:.1f} MiB in {t1 - t0:.2f} s; "
               f"graph of {graph.n_nodes} nodes computed in {(t2 - t1) * 1000:.1f} ms")


if __name__ == "__main__":
    main()
