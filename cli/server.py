"""pyggml-server: an OpenAI-compatible HTTP server with continuous batching (llama-server's flags)."""
from __future__ import annotations

import errno
import logging
import socket
import sys
import threading

import click

from .common import (fail, freeze_loaded_objects, load_model_or_exit, model_options, set_poll, setup_logging,
                     show_devices_option, version_option)
from .common import show_devices as list_devices
from .rpc_server import LOCAL_HOSTS

SWITCH_INTERVAL_S = 0.0005  # the GIL handed between the event loop and the step loop (main)
CTX_PAD = 256  # the context is rounded up to whole KV_PAD cells, as llama.cpp pads n_ctx


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@version_option
@model_options(ctx_default=4096)
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to bind. Any other than 127.0.0.1 is reachable from the network: set --api-key.")
@click.option("--port", type=click.IntRange(0, 65535), default=8080, show_default=True, help="Port to listen on.")
@click.option("-np", "--parallel", "n_parallel", type=click.IntRange(1, 256), default=4, show_default=True,
              help="Slots: requests decoded together; more wait in the queue.")
@click.option("-b", "--batch-size", "n_batch", type=click.IntRange(min=1), default=128, show_default=True,
              help="Most tokens per step (every generating slot's next token plus chunks of prompts).")
@click.option("--prompt-chunk", type=click.IntRange(min=0), default=16, show_default=True, metavar="N",
              help="Prompt tokens a step reads while other slots generate, so that their streams do not stop "
                   "for a long prompt (0: up to -b, the prompt's first token sooner and the streams stopped "
                   "while it is read). Prompts arriving at an idle server are read in whole steps; a "
                   "request answered from a slot's stored row goes first when the prompts arriving with it "
                   "fit N.")
@click.option("--max-queue", type=click.IntRange(min=0), default=64, show_default=True,
              help="Requests that may wait for a slot; beyond that the server answers 503.")
@click.option("--api-key", default=None, metavar="KEY",
              help="Require 'Authorization: Bearer KEY' on every endpoint but /health.")
@click.option("--alias", default=None, help="Model name shown by /v1/models and in replies (default: the file name).")
@click.option("--header-timeout", type=click.FloatRange(min=0.1), default=10.0, show_default=True, metavar="SECONDS",
              help="A request's headers must arrive within this time (of the connection, or of the previous "
                   "response); else 408 and the connection is closed.")
@click.option("--poll", type=click.IntRange(0, 1000), default=500, show_default=True,
              help="How long idle compute threads busy-wait for the next kernel, on pyggml-rpc-server's scale "
                   "(50: OpenMP's default). The default keeps them awake for a fraction of a second after each "
                   "step, so that a request that comes soon after another does not wait for sleeping threads to "
                   "wake (tens of ms on some VMs); 0 lets them sleep at once.")
@show_devices_option
def main(model, ctx_size, ngl, rpc, rpc_key, threads, log_level, loading, host, port, n_parallel, n_batch, prompt_chunk,
         max_queue, api_key, alias, header_timeout, poll, show_devices) -> None:
    """Serve a GGUF model over HTTP with OpenAI's API: /v1/chat/completions, /v1/completions
    (streamed as server-sent events or not), /v1/models, /health, /metrics (Prometheus),
    /tokenize and /detokenize.

    -c is the size of the whole KV cache, shared by the -np slots (default 4096). The model
    may be placed on GPUs and RPC servers with -ngl and --rpc as in pyggml-chat.

    \b
    Example:
      pyggml-server -m smollm2 -c 4096 -np 4
      curl http://127.0.0.1:8080/v1/chat/completions -H 'Content-Type: application/json' \\
           -d '{"messages": [{"role": "user", "content": "Hello"}]}'
    """
    setup_logging(log_level)
    set_poll(poll)  # (a request's first step after an idle spell: the threads are still awake)
    if show_devices:
        return list_devices(rpc, rpc_key, loading)
    try:
        import uvicorn

        from pyggml.server import State, create_app
        from pyggml.server.protocol import with_header_deadline
    except ImportError as e:
        fail(f"pyggml-server needs the server extra: pip install 'pyggml[server]' ({e})")
    if api_key is not None and not api_key.strip():
        fail("--api-key is empty (an unset variable?): give a key, or leave --api-key out to serve without one")
    if n_batch < n_parallel:
        fail(f"-b/--batch-size ({n_batch}) must be at least -np/--parallel ({n_parallel})")
    n_ctx = -(-(ctx_size or 4096) // CTX_PAD) * CTX_PAD
    model_args = dict(path_or_alias=model, n_ctx=n_ctx, ngl=ngl, rpc=rpc, rpc_key=rpc_key, n_threads=threads,
                      n_batch=max(n_batch, 256), tensor_split=loading["tensor_split"],
                      split_mode=loading["split_mode"],
                      failover=loading["failover"], rpc_spare=loading["rpc_spare"], use_mmap=loading["use_mmap"],
                      discover_timeout=loading["discover_timeout"], place_by=loading["place_by"])
    if loading["dry_run"]:
        load_model_or_exit(dry_run=True, **model_args)  # prints the plan and exits
    sock = bind_or_exit(host, port)  # before the model loads: a port in use is said at once
    if host not in LOCAL_HOSTS:
        click.echo(f"WARNING: binding {host}: this server is reachable from the network and anyone who can "
                   f"connect may use it" + ("" if api_key else "; consider --api-key"), err=True)
    if log_level not in ("error", "critical"):
        logging.getLogger("pyggml.server.access").setLevel(logging.INFO)  # a line per request, as llama-server
    state = State(alias, api_key)
    app = create_app(state)
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level if log_level != "warning" else "warning",
                            lifespan="off", access_log=log_level in ("debug", "info"),
                            http=with_header_deadline(header_timeout))
    server = uvicorn.Server(config)

    def load() -> None:
        from pyggml.gguf import GGUFError
        from pyggml.models import Model, PlacementError
        from pyggml.models.engine import Engine
        try:
            m = Model(**model_args, on_plan=click.echo if loading["show_placement"] else None)
            state.engine = Engine(m, n_parallel=n_parallel, n_batch=n_batch, max_queue=max_queue,
                                  prompt_budget=prompt_chunk or None)
            # the decoding steps' graphs are built before the first request (a few seconds at
            # most), then left out of the garbage collector's passes with the model
            state.engine.wait_built_ahead(timeout=120)
            freeze_loaded_objects()
            # two threads take turns at the GIL here: the event loop (HTTP, text out) and the
            # engine's step loop (whose kernels run without it).  A thread that wants it waits
            # out the holder's switch interval, 5 ms by default - several such waits between a
            # request's arrival and its first token, which a stored answer gives in ~1 ms
            sys.setswitchinterval(SWITCH_INTERVAL_S)
        except (GGUFError, PlacementError, FileNotFoundError, ValueError, RuntimeError, OSError) as e:
            state.load_error = str(e)
            click.echo(f"error: {e}", err=True)
            server.should_exit = True
            return
        while not server.started and not server.should_exit:
            threading.Event().wait(0.05)
        if server.started and not server.should_exit:
            # (the graphs built ahead may take longer than a short run: by then the server may
            # be stopping, its sockets closed)
            sockets = server.servers[0].sockets if server.servers else ()
            bound = sockets[0].getsockname() if sockets else (host, port)
            e = state.engine
            click.echo(f"pyggml-server: {e.model.path.name} ({n_ctx} cells, {n_parallel} slots) "
                       f"listening on http://{host}:{bound[1]}", err=True)
            sys.stderr.flush()

    threading.Thread(target=load, name="pyggml-load", daemon=True).start()
    try:
        server.run(sockets=[sock])
    except KeyboardInterrupt:  # uvicorn stops on Ctrl-C, then raises it again: the stop is clean
        pass
    finally:
        if state.engine is not None:
            state.engine.close()
            state.engine.model.close()
    if state.load_error is not None:
        sys.exit(1)
    click.echo("pyggml-server: stopped", err=True)


def bind_or_exit(host: str, port: int) -> socket.socket:
    """The listening socket, bound now, or a one-line error (a port in use, an address this
    machine does not have)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        fail(f"--host {host}: {e.strerror}")
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            fail(f"port {port} is in use on {host}; choose another with --port")
        fail(f"cannot listen on {host}:{port}: {e.strerror}")
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


if __name__ == "__main__":
    logging.captureWarnings(True)
    main()
