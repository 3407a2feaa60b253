"""numba's cache of the CPU kernels follows every source they are built from."""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from pyggml.cpu.kernel_cache import kernel_digest, kernel_sources
from pyggml.types import Type


def test_the_sources_include_the_files_the_products_inline():
    names = {p.name for p in kernel_sources()}
    assert {"qdot.py", "blockdot.py", "simd.py", "qdecode.py", "activations.py", "types.py"} <= names


def test_a_change_to_any_source_or_to_the_code_settings_changes_the_folder(tmp_path, monkeypatch):
    monkeypatch.delenv("PYGGML_DOTS", raising=False)
    copies = []
    for i, p in enumerate(kernel_sources()):  # two of them are __init__.py
        (tmp_path / str(i)).mkdir()
        copies.append(Path(shutil.copy(p, tmp_path / str(i) / p.name)))
    before = kernel_digest(copies)
    assert kernel_digest(copies) == before
    blockdot = next(c for c in copies if c.name == "blockdot.py")
    blockdot.write_text(blockdot.read_text() + "\n# a comment changes nothing, but numba cannot know\n")
    changed = kernel_digest(copies)
    assert changed != before
    monkeypatch.delenv("NUMBA_BOUNDSCHECK", raising=False)
    monkeypatch.setenv("PYGGML_DOTS", "plain")
    plain = kernel_digest(copies)
    assert plain not in (before, changed)
    monkeypatch.setenv("NUMBA_BOUNDSCHECK", "1")  # the checked build: a folder of its own
    assert kernel_digest(copies) not in (before, changed, plain)


@pytest.mark.skipif(bool(os.environ.get("NUMBA_CACHE_DIR")), reason="NUMBA_CACHE_DIR set: the user's folder is kept")
def test_the_kernels_are_cached_in_the_folder_of_their_sources():
    from pyggml.cpu import rows
    from pyggml.cache import cache_dir
    folder = cache_dir() / "numba" / kernel_digest(kernel_sources())
    assert os.path.commonpath([rows.run_table._cache._cache_path, folder]) == str(folder)


def test_a_cold_cache_is_said_and_compiled_while_the_model_loads(tmp_path, monkeypatch, capsys, smollm2_path):
    """A machine that never compiled what a model needs: pyggml.Model says so in one line,
    starts compiling exactly the model's parts in other processes before it loads, and waits
    for them before it is ready; once they are marked compiled, nothing is said or started."""
    import pyggml
    from pyggml.cpu import kernel_cache, warmup
    monkeypatch.setattr(kernel_cache, "FOLDER", tmp_path)
    events = []

    class Started:
        def wait_for_first_answer(self) -> None:
            events.append("waited")

    def start(parts):
        events.append(list(parts))
        return Started()
    monkeypatch.setattr(warmup, "start_compiling", start)
    pyggml.Model(smollm2_path, n_ctx=64, progress=None)
    assert events == [warmup.parts_for_file(smollm2_path, "swiglu"), "waited"]  # llama's gate, not GeGLU's
    assert "geglu" not in events[0]
    assert "compiling the CPU kernels of this model's weight types, once" in capsys.readouterr().err
    warmup.mark_compiled(events[0])
    assert warmup.missing(events[0]) == []
    pyggml.Model(smollm2_path, n_ctx=64, progress=None)
    assert len(events) == 2 and "compiling" not in capsys.readouterr().err
    from pyggml.models.model import _prepare_cpu
    assert _prepare_cpu(tmp_path / "missing.gguf", None) is None  # the load says what is wrong


def test_old_versions_of_the_cache_are_pruned(tmp_path):
    from pyggml.cpu.kernel_cache import prune
    folders = []
    for i in range(12):
        f = tmp_path / f"{i:016x}"
        (f / "cpu_x").mkdir(parents=True)
        os.utime(f, (1000 + i, 1000 + i))
        folders.append(f)
    (tmp_path / "not-a-version").mkdir()
    prune(folders[0], keep=4)  # the oldest, now used again
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == sorted([folders[0].name, *(f.name for f in folders[9:]), "not-a-version"])


def test_a_model_compiles_the_formats_it_has_and_no_other():
    """A product compiles the code of its own weight format (qdot.product_kernel), so the parts a
    model needs name exactly the formats of its weights, and the loop around every format's
    rows once (``products``; ``experts``, and the router's kernels, for stacked experts): SmolLM2 is Q4_1 with a Q8_0
    embedding that is also its output; Gemma 3's Q4_K come in multiples of 8 rows (repacked).
    Of the feed-forward gates, the one its architecture names (both where it is not known)."""
    from pyggml.cpu.warmup import GATES, LAYERS, parts_for_tensors
    smollm2 = [("token_embd.weight", Type.Q8_0, (576, 49152)), ("output_norm.weight", Type.F32, (576,)),
               ("blk.0.attn_q.weight", Type.Q4_1, (576, 576)), ("blk.0.ffn_down.weight", Type.Q4_1, (1536, 576))]
    assert parts_for_tensors(smollm2, "swiglu") == [*LAYERS, "swiglu", "decoder:Q8_0", "product:Q8_0", "tiles:Q8_0",
                                                    "products", "product:Q4_1", "tiles:Q4_1"]
    other = [("blk.0.ffn_up.weight", Type.Q4_K, (2048, 640)), ("blk.0.ffn_down.weight", Type.Q4_K, (256, 9)),
             ("blk.0.ffn_gate_exps.weight", Type.Q6_K, (256, 64, 8)), ("blk.0.attn_v.weight", Type.F16, (64, 64))]
    assert parts_for_tensors(other) == [*LAYERS, *GATES, "product:Q4_K_X8", "tiles:Q4_K_X8", "products", "product:Q4_K",
                                        "tiles:Q4_K", "softmax", "router", "product:Q6_K", "tiles:Q6_K", "experts",
                                        "f16", "fused:F16", "decoder:F16"]


LOADS_WITHOUT_COMPILING = """
import sys
from numba.core import event

class Compiled(event.Listener):
    names = []

    def on_start(self, e):
        self.names.append(e.data["dispatcher"].py_func.__qualname__)

    def on_end(self, e):
        pass

event.register("numba:compile", Compiled())
from pyggml.cpu.warmup import warm_up
warm_up(sys.argv[1:])
print(Compiled.names)
"""


def test_parts_compile_in_other_processes_into_the_cache_and_are_marked(tmp_path, monkeypatch):
    """compile_in_parallel's processes write numba's cache in this version's folder (here under
    a fresh PYGGML_CACHE) and mark each part done, so that the next start finds nothing missing
    and compiles nothing.  Two kinds' kernels compiled at once in two processes keep an index
    each (kinds.kernel_of_kind): with one index between them, the read-modify-write of one
    process could drop the other's entry, and a first answer would compile it after all."""
    from pyggml.cpu import kernel_cache, warmup
    monkeypatch.delenv("NUMBA_CACHE_DIR", raising=False)
    monkeypatch.setenv("PYGGML_CACHE", str(tmp_path))
    folder = tmp_path / "numba" / kernel_digest(kernel_sources())
    monkeypatch.setattr(kernel_cache, "FOLDER", folder)
    parts = ["decoder:Q8_0", "decoder:Q4_K"]
    assert warmup.missing(parts) == parts
    warmup.compile_in_parallel(parts)
    assert warmup.missing(parts) == []
    assert len(list(folder.rglob("*_kernels_rows_*.nbi"))) == 2  # one index per kind
    import subprocess
    import sys
    done = subprocess.run([sys.executable, "-c", LOADS_WITHOUT_COMPILING, *parts], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "[]"


def test_a_first_answer_waits_for_all_but_the_tiled_rows_which_a_thread_then_loads(tmp_path, monkeypatch):
    """Compiling.wait_for_first_answer waits for the parts a first step runs, not for the
    formats' tiled rows (compiled last): their products take a column at a time by the format's
    slot until a thread of the process - one it waits for before it exits - loads each tiled
    rows as it is marked and puts them in the slot."""
    import threading
    from pyggml.cpu import kernel_cache, qdot, warmup
    from pyggml.cpu.kinds import Fmt
    monkeypatch.setattr(kernel_cache, "FOLDER", tmp_path)
    monkeypatch.setattr(qdot, "_DEFERRED", set())
    monkeypatch.setattr(qdot, "_SLOTS", np.zeros_like(qdot._SLOTS))
    parts = ["norms", "product:Q4_1", "tiles:Q4_1"]
    warmup.mark_compiled(["norms", "product:Q4_1"])
    released = threading.Event()

    class Process:  # compiling the tiled rows until released
        def poll(self):
            return 0 if released.is_set() else None

        def wait(self, timeout=None):
            released.wait()

    compiling = warmup.Compiling([Process()], str(tmp_path / "claims"), 60.0, parts)
    compiling.wait_for_first_answer()  # returns with the tiled rows still compiling
    fmt = int(Fmt.Q4_1)
    assert fmt in qdot._DEFERRED and qdot._SLOTS[fmt] == qdot.column_rows(fmt).rows_at
    thread = next(t for t in threading.enumerate() if t.name == "pyggml-tiles")
    assert not thread.daemon  # (the process waits for it before it exits)
    warmup.mark_compiled(["tiles:Q4_1"])
    released.set()
    thread.join(60)
    assert fmt not in qdot._DEFERRED and qdot._SLOTS[fmt] == qdot.product_kernel(fmt).rows_at


def test_each_part_is_compiled_by_the_first_process_to_claim_it(tmp_path, monkeypatch):
    """start_compiling's processes all go through every part and each compiles those it claims
    first (a file in the call's folder), so that a process with cheap parts goes on to the next
    while another still compiles a costly one; none compiles a part twice."""
    from pyggml.cpu import warmup
    done = []
    monkeypatch.setattr(warmup, "part", lambda name: ((lambda: done.append(name)), 1.0))
    monkeypatch.setattr(warmup, "mark_compiled", lambda names: None)
    assert warmup._claim(str(tmp_path), "product:Q4_1")  # another process took it first
    warmup._compile_and_mark(["norms", "product:Q4_1", "top_k"], str(tmp_path))
    assert done == ["norms", "top_k"]
    warmup._compile_and_mark(["attention", "norms", "product:Q4_1", "top_k"], str(tmp_path))
    assert done == ["norms", "top_k", "attention"]


def test_a_compiling_process_compiles_the_products_at_o3_and_the_other_parts_at_o1(monkeypatch):
    """The products and their activations' quantizer ran a decoding step 15% slower at -O1; the
    other parts are as fast at -O1 and compile sooner.  A compiling process sets NUMBA_OPT
    (which numba reads again before each compile) per part, unless the user set it; it lowers
    its priority before the first deferred part."""
    from pyggml.cpu import warmup
    levels = {}
    monkeypatch.delenv("NUMBA_OPT", raising=False)  # (restored after the test, whatever the calls set)
    niced = []
    monkeypatch.setattr(os, "nice", lambda inc: niced.append((inc, sorted(levels))))
    monkeypatch.setattr(warmup, "part", lambda name: ((lambda: levels.__setitem__(name, os.environ["NUMBA_OPT"])), 1.0))
    monkeypatch.setattr(warmup, "mark_compiled", lambda names: None)
    warmup._compile_and_mark(["attention", "products", "norms", "product:Q4_1", "activations", "experts", "top_k",
                              "tiles:Q4_1", "tiles:Q8_0"], levels=True, nice_deferred=True)
    assert levels == {"attention": "1", "products": "3", "norms": "1", "product:Q4_1": "3", "activations": "3",
                      "experts": "3", "top_k": "1", "tiles:Q4_1": "3", "tiles:Q8_0": "3"}
    # the deferred parts (a format's tiled rows, compiled while the model answers) at the lowest priority
    assert niced == [(warmup.DEFERRED_NICE, sorted(p for p in levels if not p.startswith("tiles:")))]


KERNELS_AFTER_WARM_UP = """
import gc, json, sys
from numba.core.registry import CPUDispatcher
import pyggml
from pyggml.cpu.warmup import parts_for_file, warm_up
from pyggml.models.loader import open_gguf
from pyggml.server.openai import submit

def overloads():
    # issubclass of the type: isinstance would ask a dead weak proxy (numba's cfuncs leave some) and raise
    return {d: len(d.overloads) for d in gc.get_objects() if issubclass(type(d), CPUDispatcher)}

path = sys.argv[1]
warm_up(parts_for_file(path, open_gguf(path)[1].gate_name))  # the model's own gate only
before = overloads()
if sys.argv[2] == "model":
    m = pyggml.Model(path, n_ctx=256, progress=False)
    ids = m.tokenize("The history of the printing press begins in the fifteenth century")
    list(m.generate(ids, max_tokens=3, temperature=0))          # a prompt, then single tokens
    list(m.generate(ids[:5], max_tokens=2, temperature=0.8, top_k=40, seed=1))  # sampled
    m.logits(ids[:9])                                             # every position's logits
    engine = pyggml.models.Engine(m, n_parallel=2)                # two sequences in one batch (runs)
    streams = [submit(engine, t, max_tokens=3, temperature=0) for t in ("Hello", "One two three")]
    for s in streams:
        list(s)
    engine.close()
else:  # a file without a tokenizer: token ids straight into a context
    from pyggml.models import Context, load_model
    ctx = Context(load_model(path), n_ctx=64)
    ctx.decode(list(range(3, 15)), all_logits=True)
    ctx.decode([5], n_top=4)
    ctx.decode([6])
new = {d.py_func.__qualname__: [str(sig) for sig in d.overloads][before.get(d, 0):]
       for d, n in overloads().items() if n > before.get(d, 0)}
print(json.dumps(new))
"""


def moe_file(tmp_path: Path, name: str) -> Path:
    """A tiny mixture of experts of test_moe.py's (tests/models/synthetic.py)."""
    import json

    from tests.models.synthetic import Shape, expert_types, random_weights, write_model
    reference = json.loads((Path(__file__).resolve().parents[1] / "data" / "moe-llamacpp.json").read_text())
    ref = reference["models"][name]
    s = Shape(**{**reference["shape"], **ref.get("shape", {})})
    weights = random_weights(ref["arch"], s, seed=ref["seed"], moe=True)
    types = expert_types(weights, ref.get("experts"), ref.get("down_experts"))
    return write_model(tmp_path / f"{name}.gguf", ref["arch"], s, weights, types, vocab=True)


@pytest.mark.parametrize("alias", ["smollm2", "gemma3-270m", "qwen3moe-q4_k", "llama-moe-q4_0"])
def test_after_the_warm_up_a_model_compiles_nothing(alias, request, tmp_path):
    """Every kernel a model runs - prompts, single tokens, sampling, every position's logits, a
    batch of two sequences - is among the parts parts_for_file names for it, for the very
    argument types the model passes (a kernel compiled for a writable array is compiled again
    for a read-only one: the products' runs once cost a second compile of their kernel).  In a
    process of its own, so that nothing an earlier test ran counts."""
    import json
    import subprocess
    import sys
    if alias in ("smollm2", "gemma3-270m"):
        path, how = request.getfixturevalue("smollm2_path" if alias == "smollm2" else "gemma3_path"), "model"
    else:
        path, how = moe_file(tmp_path, alias), "context"
    done = subprocess.run([sys.executable, "-c", KERNELS_AFTER_WARM_UP, str(path), how], capture_output=True,
                          text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == {}
