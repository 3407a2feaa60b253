"""pyggml-perplexity: perplexity of a text file, computed as llama.cpp's perplexity tool does.

The text is cut into chunks of the context size; each chunk is evaluated from a fresh
context (starting with BOS where the model uses one), and only the second half of each
chunk is scored, so every scored token has at least half a context of history.
"""
from __future__ import annotations

import math
import time

import click
import numpy as np

from .common import fail, load_model_or_exit, model_options, setup_logging, show_devices_option, version_option
from .common import show_devices as list_devices


def chunk_nll(logits: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """Negative log-likelihood of each target under the logits of the position before it."""
    z = logits.astype(np.float64)
    top = z.max(axis=1)
    lse = top + np.log(np.exp(z - top[:, None]).sum(axis=1))
    return lse - z[np.arange(len(targets)), targets]


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@version_option
@model_options(ctx_default=512)
@click.option("-f", "--file", "path", type=click.Path(dir_okay=False), help="Text file to score (required).")
@click.option("--chunks", type=int, default=-1, show_default=True, help="Most chunks to score (-1: all).")
@show_devices_option
def main(model, ctx_size, ngl, rpc, rpc_key, threads, log_level, loading, path, chunks, show_devices) -> None:
    """Perplexity of a text file (-c: chunk size, default 512)."""
    setup_logging(log_level)
    if show_devices:
        return list_devices(rpc, rpc_key, loading)
    if path is None:
        fail("-f/--file: the text file to score is required")
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            text = fh.read()
    except OSError as e:
        fail(f"{path}: {e.strerror or e}")
    n_ctx = ctx_size or 512
    m = load_model_or_exit(**loading, path_or_alias=model, n_ctx=n_ctx, ngl=ngl, rpc=rpc, rpc_key=rpc_key,
                           n_threads=threads)
    tokens = m.tokenize(text, add_bos=False)
    n_chunk = len(tokens) // n_ctx
    if chunks > 0:
        n_chunk = min(n_chunk, chunks)
    if n_chunk == 0:
        fail(f"{path}: {len(tokens)} tokens is less than one chunk of {n_ctx}; use a longer file or a smaller -c")
    bos = m.tokenizer.bos_id if m.tokenizer.add_bos else None
    first = n_ctx // 2
    click.echo(f"perplexity: {len(tokens)} tokens, {n_chunk} chunks of {n_ctx}, scoring the last {n_ctx - first - 1} "
               f"of each", err=True)
    nll_sum, count, nll2 = 0.0, 0, 0.0
    t0 = time.perf_counter()
    for c in range(n_chunk):
        chunk = list(tokens[c * n_ctx:(c + 1) * n_ctx])
        if bos is not None:
            chunk[0] = bos  # like llama.cpp: the chunk's first token is replaced by BOS
        try:
            logits = m.logits(chunk)
        except RuntimeError as e:  # an RPC server lost mid-run
            fail(str(e))
        nll = chunk_nll(logits[first:n_ctx - 1], np.asarray(chunk[first + 1:]))
        nll_sum += nll.sum()
        nll2 += (nll ** 2).sum()
        count += nll.size
        click.echo(f"[{c + 1}]{math.exp(nll_sum / count):.4f},", nl=False)
    mean = nll_sum / count
    var = max(nll2 / count - mean * mean, 0.0)
    err = math.exp(mean) * math.sqrt(var / max(count - 1, 1))
    dt = time.perf_counter() - t0
    click.echo(f"\nFinal estimate: PPL = {math.exp(mean):.4f} +/- {err:.5f}")
    click.echo(f"scored {count} tokens in {dt:.1f} s ({n_chunk * n_ctx / dt:.1f} tokens/s)", err=True)


if __name__ == "__main__":
    main()
