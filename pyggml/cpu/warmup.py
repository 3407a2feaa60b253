"""Compile the numba kernels a model needs before its first answer, in a few processes at once.

The kernels are compiled once per machine and loaded from numba's on-disk cache after that
(kernel_cache.py).  Each kernel is a *part* (registered beside the kernel: parts.py), named so
that another process can compile it: the layers' kernels (``norms``, ``attention``,
``activations``, ...) and, for each weight
format a model has, its product's rows (``product:Q4_1`` a column at a time, ``tiles:Q4_1``
tiled), its decoder (``decoder:Q8_0``, the
row lookups of an embedding) and so on - a product compiles the code of its own format only
(qdot.py), so a model compiles the formats it has, not all of them, and the parallel loop that
calls every format's rows is one part (``products``) compiled once.

:func:`start_compiling` runs parts in one process per core (numba compiles one function at a
time per process), each part marked done in the cache folder when it is; :func:`missing` says
which are not done yet; :func:`parts_for_tensors` what a model's weights need.  pyggml.Model
starts compiling what its file needs before it loads, and waits for it before its first step
(compile_for_model) - for all but the formats' tiled rows, which go on compiling while it
answers (Compiling.wait_for_first_answer); the first answer then loads every kernel from the
cache.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path

from ..types import Type
from . import kernel_cache, qdot
# the modules whose kernels register their parts (parts.py), imported for that
from . import activations, experts, fusion, nn, ops, qdecode, router, rows  # noqa: F401
from .kinds import DECODER, EXACT, VEC_DOT, Dec, Fmt
from .parts import GATES, KINDS, LAYERS, OTHERS
from .qmatmul import product_format


def part(name: str) -> tuple[Callable[[], None], float]:
    """The function compiling part ``name``, and its rough cost in seconds."""
    if name in LAYERS or name in GATES or name in OTHERS:
        return {**LAYERS, **GATES, **OTHERS}[name]
    what, _, kind = name.partition(":")
    if what not in KINDS or kind not in KINDS[what][0].__members__:
        raise ValueError(f"no kernel part {name!r}")
    enum, fn, cost = KINDS[what]
    member = enum[kind]
    return (lambda: fn(member)), cost(member)


def parts_for_tensors(tensors: Iterable[tuple[str, Type, tuple[int, ...]]], gate: str | None = None) -> list[str]:
    """The parts a model of these tensors (name, type, ne) runs: the layers' kernels, its
    feed-forward's ``gate`` (a GATES name; both when not known), each weight format's product
    rows and the loop around them (the experts' own loop and their routers' softmax for
    stacked experts), the embedding's
    decoder, F16 values read as floats where there are F16 tensors."""
    if gate is not None and gate not in GATES:
        raise ValueError(f"no kernel part for the gate {gate!r}")
    parts = dict.fromkeys([*LAYERS, *([gate] if gate else GATES)])
    for name, qtype, ne in tensors:
        if len(ne) == 3:
            parts["softmax"] = parts["router"] = None
        if qtype == Type.F16:
            parts["f16"] = None
        if name.startswith("token_embd") and qtype in DECODER:  # GET_ROWS decodes the rows it picks
            parts[f"decoder:{DECODER[qtype].name}"] = None
        if len(ne) < 2 or qtype not in DECODER:
            continue
        if qtype in EXACT:  # the format's rows (a column at a time, and tiled), and the loop around them
            fmt = product_format(qtype, ne[1]).name
            parts[f"product:{fmt}"] = parts[f"tiles:{fmt}"] = None
            parts["experts" if len(ne) == 3 else "products"] = None
        else:  # decoded and dotted: few columns fused, many decoded for BLAS
            parts[f"fused:{DECODER[qtype].name}"] = None
            parts[f"decoder:{DECODER[qtype].name}"] = None
    return list(parts)


def parts_for_file(path: str | os.PathLike, gate: str | None = None) -> list[str]:
    """parts_for_tensors of a GGUF file's tensors (its header only is read)."""
    from ..gguf import GGUFFile
    f = GGUFFile(path)
    return parts_for_tensors(((t.name, t.type, t.ne) for t in f.tensors.values()), gate)


def every_part() -> list[str]:
    """Every part: what a server that does not know its models' weights compiles."""
    exact = [f.name for f in Fmt if f <= Fmt.Q4_K_X8 or f == Fmt.MXFP4]  # (the others: batch formats of these)
    return [*LAYERS, *GATES, *OTHERS, *(f"{kind}:{f}" for kind in ("product", "tiles") for f in exact),
            *(f"decoder:{d.name}" for d in Dec),
            *(f"fused:{DECODER[t].name}" for t in VEC_DOT if t not in EXACT)]  # the weights decoded and dotted


def warm_up(parts: Iterable[str] | None = None) -> None:
    """Compile (or load from the cache) ``parts`` in this process: by default, the layers'."""
    for name in ([*LAYERS, *GATES] if parts is None else parts):
        part(name)[0]()


def missing(parts: Iterable[str]) -> list[str]:
    """The parts not yet compiled into this version's cache (each leaves a mark beside it);
    none where numba keeps no cache we know of (a process then compiles what it uses)."""
    folder = _marks()
    return [] if folder is None else [p for p in parts if not (folder / _mark_name(p)).exists()]


def mark_compiled(names: Iterable[str]) -> None:
    """Mark parts as compiled into this version's cache (missing() then leaves them out)."""
    folder = _marks()
    if folder is not None:
        folder.mkdir(parents=True, exist_ok=True)
        for name in names:
            (folder / _mark_name(name)).touch()


def deferred(name: str) -> bool:
    """Whether a first answer leaves part ``name`` to compile on: a format's tiled rows, which
    its products do without until then (qdot.tiles_deferred)."""
    return name.startswith("tiles:")


class Compiling:
    """Processes compiling parts into the cache (start_compiling's), and the folder where they
    claim them."""

    def __init__(self, procs: list[subprocess.Popen], claims: str, timeout: float, parts: Iterable[str] = ()) -> None:
        self.procs, self.claims, self.deadline = procs, claims, time.monotonic() + timeout
        self.parts = list(parts)

    def wait(self, parts: Iterable[str] | None = None) -> None:
        """Until every process is done (past the timeout, they are stopped: what they did not
        compile is compiled in this process when first used); with ``parts``, until those are
        marked compiled (or no process is left)."""
        if parts is not None:
            parts = list(parts)
            while (missing(parts) and time.monotonic() < self.deadline
                   and any(proc.poll() is None for proc in self.procs)):
                time.sleep(0.02)
            return
        for proc in self.procs:
            try:
                proc.wait(max(0.0, self.deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        shutil.rmtree(self.claims, ignore_errors=True)

    def wait_for_first_answer(self) -> None:
        """Until the parts a model's first step needs are compiled.  The formats' tiled rows
        (deferred parts, compiled last) go on compiling: until each is done its products take
        a column at a time (the same bits), and a thread of this process then loads it for
        them (qdot.tiles_deferred, tiles_ready) - on a new machine, the first answer comes
        seconds sooner.  The process waits for that thread before it exits, so that what the
        processes compile is not lost."""
        later = [p for p in self.parts if deferred(p)]
        self.wait([p for p in self.parts if not deferred(p)])
        if not later:
            self.wait()
            return
        kinds = [Fmt[p.partition(":")[2]] for p in later]
        for kind in kinds:
            qdot.tiles_deferred(kind)

        def finish() -> None:
            for part, kind in zip(later, kinds):
                self.wait([part])
                qdot.tiles_ready(kind)  # (loaded from the cache; compiled here if a process failed)
            self.wait()
        threading.Thread(target=finish, name="pyggml-tiles", daemon=False).start()


def start_compiling(parts: Iterable[str], timeout: float = 600.0) -> Compiling:
    """Compile ``parts`` in one process per core this process may run on, each writing numba's
    cache and marking its parts; this process loads them from the cache as it uses them.  Every
    process goes through the parts - those a first answer waits for first (not deferred()),
    costliest first - and takes the next one no other process has
    claimed (a file in a folder of this call's), so that none waits idle while another still has
    parts to compile, whatever the parts really cost on this machine."""
    parts = sorted(parts, key=lambda p: (deferred(p), -part(p)[1]))  # what a first answer waits for first
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    n = max(1, min(len(parts), cores))
    claims = tempfile.mkdtemp(prefix="pyggml-compiling-")
    return Compiling([subprocess.Popen([sys.executable, "-m", "pyggml.cpu.warmup", "--claims", claims, *parts],
                                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                      for _ in range(n)], claims, timeout, parts)


def compile_in_parallel(parts: Iterable[str], timeout: float = 600.0) -> None:
    """start_compiling, and wait for it."""
    start_compiling(parts, timeout).wait()


def compile_for_model(tensors: Iterable[tuple[str, Type, tuple[int, ...]]], say: Callable[[str], None] | None,
                      gate: str | None = None) -> Compiling | None:
    """Start compiling what a model of these tensors (and feed-forward ``gate``) needs and this
    machine has not compiled yet (saying so in one line through ``say``), or None when there is
    nothing to compile.  The caller loads the model meanwhile and waits before its first step."""
    todo = missing(parts_for_tensors(tensors, gate))
    if not todo:
        return None
    if say is not None:
        say(f"pyggml: compiling the CPU kernels of this model's weight types, once for this machine "
            f"(later runs load them from {kernel_cache.FOLDER or _marks()})")
    return start_compiling(todo)


def _marks() -> Path | None:
    """Where the parts compiled into this version's cache are marked."""
    if kernel_cache.FOLDER is not None:
        return kernel_cache.FOLDER / "compiled"
    import numba
    if numba.config.CACHE_DIR:  # the user's folder: the marks of each version apart
        return Path(numba.config.CACHE_DIR) / "pyggml-compiled" / kernel_cache.kernel_digest(kernel_cache.kernel_sources())
    return None


def _mark_name(name: str) -> str:
    return name.replace(":", "-")


def _claim(folder: str, name: str) -> bool:
    """Whether this process is the first to claim part ``name`` in ``folder``."""
    try:
        os.close(os.open(os.path.join(folder, _mark_name(name)), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    return True


# LLVM's optimization level per part in the compiling processes, unless NUMBA_OPT says
# otherwise: -O3 (numba's default) for the products and the quantizer of their activations,
# which ran a decoding step 15% slower at -O1; -O1 for the others, as fast at either level
# (bench/generate.py --profile) and compiled sooner.  Any level gives the same bits: numba
# allows LLVM no fast-math.
FULL_OPT = ("products", "experts", "activations", "product:", "tiles:")


def _opt_level(name: str) -> str:
    return "3" if name.startswith(FULL_OPT) else "1"


# how much less of the CPU a compiling process asks for once at the deferred parts (os.nice):
# the model's process is answering by then, and its parallel loops wait for every thread
DEFERRED_NICE = 19


def _compile_and_mark(names: list[str], claims: str | None = None, levels: bool = False,
                      nice_deferred: bool = False) -> None:
    """Compile and mark the parts ``names`` (those this process claims first in ``claims``);
    with ``levels``, each at its own LLVM level (_opt_level), set in this process's environment,
    which numba reads again before each compile; with ``nice_deferred``, the deferred parts at
    the lowest priority (DEFERRED_NICE).  Both for a compiling process only."""
    niced = False
    for name in names:
        if claims is None or _claim(claims, name):
            if levels:
                os.environ["NUMBA_OPT"] = _opt_level(name)
            if nice_deferred and deferred(name) and not niced and hasattr(os, "nice"):
                os.nice(DEFERRED_NICE)
                niced = True
            part(name)[0]()
            mark_compiled([name])


if __name__ == "__main__":
    args, levels = sys.argv[1:], "NUMBA_OPT" not in os.environ  # the user's NUMBA_OPT holds for every part
    if args[:1] == ["--claims"]:
        _compile_and_mark(args[2:], args[1], levels, nice_deferred=True)  # (start_compiling's processes)
    else:
        _compile_and_mark(args, levels=levels)
