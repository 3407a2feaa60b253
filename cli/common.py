"""What the command-line tools share: model options, errors as one line, logging."""
from __future__ import annotations

import functools
import logging
import os
import sys
from collections.abc import Callable
from typing import Any

import click

from pyggml.gguf import GGUFError


def fail(message: str, code: int = 1) -> None:
    click.echo(f"error: {message}", err=True)
    sys.exit(code)


class _DryRun(Exception):
    pass


def compile_kernels_once() -> None:
    """Compile every weight format's CPU kernels that this machine has not compiled yet, saying
    so (a server that does not know its models' weights; pyggml.Model compiles what its model
    needs while it loads)."""
    from pyggml.cpu import kernel_cache, warmup
    todo = warmup.missing(warmup.every_part())
    if todo:
        click.echo(f"Compiling the CPU kernels for this machine, once; later runs load them from "
                   f"{kernel_cache.FOLDER}", err=True)
        warmup.compile_in_parallel(todo)


def freeze_loaded_objects() -> None:
    """Leave what loading made (a model's ~10^5 objects, live as long as this process) out of
    the cyclic garbage collector's full passes: each new prompt length builds a graph and a plan,
    whose allocations set off such passes, ~50 ms each over everything loaded (gc.freeze: for the
    tools' own processes; a program embedding pyggml.Model decides for itself)."""
    import gc
    gc.freeze()


def load_model_or_exit(show_placement: bool = False, dry_run: bool = False, **kwargs: Any):
    """pyggml.Model(**kwargs), with every user-facing problem turned into one line and exit 1;
    ``show_placement`` prints the plan before loading, ``dry_run`` exits there."""
    from pyggml.models import Model, PlacementError

    def on_plan(description: str) -> None:
        if show_placement or dry_run:
            click.echo(description)
        if dry_run:
            raise _DryRun
    try:
        model = Model(on_plan=on_plan, **kwargs)
        freeze_loaded_objects()
        return model
    except _DryRun:
        sys.exit(0)
    except (GGUFError, PlacementError, FileNotFoundError, ValueError, RuntimeError) as e:  # RPCError included
        fail(str(e))


def rpc_devices_or_exit(rpc: str | None, rpc_key: str | None, discover_timeout: float | None = None) -> list:
    """The devices of the --rpc servers, or one line and exit 1 when one cannot be reached."""
    from pyggml.models.model import connect_rpc
    try:
        return connect_rpc(rpc, rpc_key, discover_timeout=discover_timeout)
    except (ValueError, OSError, RuntimeError) as e:
        fail(str(e))


def show_devices(rpc: str | None, rpc_key: str | None, loading: dict | None = None) -> None:
    """--show-devices / --list-devices: every device with its id for -ngl (an unreachable
    server is said before anything is listed; with --rpc auto, the servers found, each
    skipped one with why, are logged first)."""
    from pyggml.models.loader import default_devices
    devices = [*rpc_devices_or_exit(rpc, rpc_key, (loading or {}).get("discover_timeout")), *default_devices()]
    click.echo("devices:")
    for i, dev in enumerate(devices):
        free, total = dev.get_memory()
        click.echo(f"  {i}: {dev.get_name():<12} {dev.get_description()}  type {dev.get_type().name}  "
                   f"memory {free / 2**20:.0f} MiB free of {total / 2**20:.0f} MiB")


def show_devices_option(f: Callable) -> Callable:
    """--show-devices, and llama.cpp's name for it, --list-devices."""
    return click.option("--show-devices", "--list-devices", "show_devices", is_flag=True,
                        help="List the devices (with their ids for -ngl) and exit.")(f)


def version_option(f: Callable) -> Callable:
    """--version: the installed pyggml's, as every command prints it."""
    return click.version_option(package_name="pyggml", message="%(prog)s (pyggml) %(version)s")(f)


class Terminal:
    """Whether an answer being streamed to stdout has left its line open."""
    mid_line = False


class LineEndingHandler(logging.StreamHandler):
    """A log line never lands in the middle of a streamed answer's line: it ends that line on
    stderr first (stdout, the answer, is left as it is)."""

    def emit(self, record: logging.LogRecord) -> None:
        if Terminal.mid_line:
            Terminal.mid_line = False
            self.stream.write("\n")
        super().emit(record)


SPINS_PER_POLL = 6000  # --poll 50: libgomp's own default of 300000 spins


def set_poll(poll: int) -> None:
    """OpenMP workers spin for a while after each parallel region before they sleep (llama.cpp's
    --poll): ``poll`` * SPINS_PER_POLL spins.  GOMP_SPINCOUNT in the environment wins.  Must be
    set before numba loads libgomp (when the first backend starts its threads)."""
    os.environ.setdefault("GOMP_SPINCOUNT", str(SPINS_PER_POLL * poll))


def setup_logging(level: str) -> None:
    handler = LineEndingHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=getattr(logging, level.upper(), logging.WARNING), handlers=[handler])


def model_options(f: Callable | None = None, *, ctx_default: int | None = None) -> Callable:
    """-m, -c, -ngl, -ts, -sm, --show-placement, --dry-run, --rpc, --discover-timeout, --rpc-key, --rpc-spare,
    --failover,
    --threads, --log-level (shared by the tools that load a model).  The placement and
    failover flags reach the command as one ``loading`` dict, for load_model_or_exit.
    ``ctx_default``: the command's context size when -c is not given (its help says it)."""
    if f is None:
        return functools.partial(model_options, ctx_default=ctx_default)

    @functools.wraps(f)
    def command(*args: Any, tensor_split: str | None, split_mode: str, show_placement: bool, dry_run: bool,
                failover: bool, rpc_spare: str | None, use_mmap: bool | None, discover_timeout: float | None,
                place_by: str, **kwargs: Any) -> Any:
        return f(*args, loading={"tensor_split": tensor_split, "split_mode": split_mode, "show_placement": show_placement,
                                 "dry_run": dry_run, "failover": failover, "rpc_spare": rpc_spare,
                                 "use_mmap": use_mmap, "discover_timeout": discover_timeout, "place_by": place_by},
                 **kwargs)
    opts = [
        click.option("-m", "--model", "model", default=None, metavar="PATH|ALIAS",
                     help="GGUF file, or an alias: smollm2 (default, downloaded once), gemma3-270m."),
        click.option("-c", "--ctx-size", "ctx_size", type=click.IntRange(min=16), default=ctx_default,
                     show_default=ctx_default is not None, help="Context size in tokens."),
        click.option("-ngl", "--n-gpu-layers", "ngl", default=None, metavar="SPEC",
                     help="Layer placement, '[id:]spec[;id:spec]...' with spec = N | prolog | epilog | all "
                          "(comma-joined). Device ids: RPC endpoints, then GPUs, then the CPU. "
                          "Example: '0:prolog,epilog;1:all'. Unplaced layers run on the CPU. 'auto' (the "
                          "default with --rpc) spreads the layers over the devices by their free memory."),
        click.option("--place-by", "place_by", type=click.Choice(["speed", "memory"]), default="speed",
                     show_default=True,
                     help="What -ngl auto spreads the layers by: each device's measured speed through products "
                          "(an RPC server measures its devices when it starts), within its memory; or its free "
                          "memory, as llama.cpp does. Speed falls back to memory where a device's is unknown."),
        click.option("-ts", "--tensor-split", "tensor_split", default=None, metavar="P0,P1,...",
                     help="Spread the layers over the devices before the CPU in these proportions, e.g. '3,1'."),
        click.option("-sm", "--split-mode", "split_mode", type=click.Choice(["layer", "tensor", "auto"]), default="layer",
                     show_default=True,
                     help="How the model is divided among the RPC servers and GPUs: 'layer' gives each device "
                          "whole layers (they take turns); 'tensor' divides every layer's heads and rows among "
                          "them (they compute each step together; the logits are the same bits); 'auto' takes "
                          "'tensor' where each CPU device's share of a layer is large enough to pay for its "
                          "exchanges (--show-placement says which and why). -ts sets the shares of either."),
        click.option("--show-placement", is_flag=True,
                     help="Print which device gets which layers (weights, KV cache, free memory) before loading."),
        click.option("--dry-run", is_flag=True, help="Print the placement and exit without loading."),
        click.option("--rpc", default=None, metavar="ENDPOINTS",
                     help="RPC servers (pyggml-rpc-server), e.g. '8080;8081' or '10.0.0.2:8080'; a bare port "
                          "means 127.0.0.1. Their devices get the first ids. 'auto' finds the servers started "
                          "with --announce on this network (for --discover-timeout seconds); 'auto:N' waits "
                          "until N of them are found."),
        click.option("--discover-timeout", type=click.FloatRange(min=0.1), default=None, metavar="SECONDS",
                     help="How long --rpc auto looks for servers. [default: 3; with auto:N, up to 60]"),
        click.option("--rpc-key", default=None, metavar="FILE",
                     help="The RPC servers' client key (FILE.client from pyggml-rpc-server --gen-key FILE): TLS, "
                          "encrypted and authenticated both ways."),
        click.option("--failover", is_flag=True,
                     help="When an RPC server dies, move its layers onto the devices left, rebuild the cache "
                          "and go on generating (the output is that of an uninterrupted run)."),
        click.option("--rpc-spare", default=None, metavar="ENDPOINTS",
                     help="RPC servers held in reserve for --failover: the first one takes a lost server's place."),
        click.option("--mmap/--no-mmap", "use_mmap", default=None,
                     help="Keep the CPU's weights in the GGUF's memory map (--mmap: nothing copied, pages shared "
                          "between processes) or read them into memory in the order the layers use them "
                          "(--no-mmap: decodes faster). Default: read them, unless they would take more than "
                          "half of the free memory."),
        click.option("-t", "--threads", type=click.IntRange(min=1), default=None, help="CPU threads."),
        click.option("--log-level", type=click.Choice(["debug", "info", "warning", "error"]), default="warning",
                     show_default=True, help="Logging detail on stderr."),
    ]
    for opt in reversed(opts):
        command = opt(command)
    return command
