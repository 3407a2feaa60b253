"""Kernel launches by parameter name (pyggml/cuda/runtime.py), checked against the C sources.
No GPU needed: the signatures are read from kernels/*.cu, the launches made into a stand-in."""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from pyggml.cuda import runtime
from pyggml.cuda.kernels import QUANT_KERNELS

ROOT = Path(__file__).resolve().parents[2]


def launched_kernels() -> list[tuple[str, str]]:
    """Every (source, kernel) the op table launches: literal names, and the f-strings over the
    weight types."""
    text = (ROOT / "pyggml" / "cuda" / "kernels.py").read_text()
    found = set(re.findall(r'function\("(\w+\.cu)", "(\w+)"\)', text))
    for source, template in re.findall(r'function\("(\w+\.cu)", f"([^"]+)"\)', text):
        for qtype in QUANT_KERNELS.values():
            for suffix in ("f16", "f32"):
                for single in ("", "_1"):
                    name = template.replace("{QUANT_KERNELS[qtype]}", qtype).replace(
                        "{QUANT_KERNELS[a.type]}", qtype).replace("{suffix}", suffix).replace("{single}", single)
                    found.add((source, name))
    # kernel = "a" if ... else "b", then function("rows.cu", kernel): the next such call's source
    for first, second, source in re.findall(r'kernel = "(\w+)" if .* else "(\w+)"\n(?:.*\n)*?.*function\("(\w+\.cu)", kernel\)',
                                            text):
        found |= {(source, first), (source, second)}
    return sorted(found)


def test_every_kernel_the_op_table_launches_has_a_signature_from_its_source():
    kernels = launched_kernels()
    assert len(kernels) > 30
    for source, name in kernels:
        params = runtime.signature(source, name)
        assert params and all(isinstance(p, str) for p, _ in params), (source, name)


@pytest.mark.parametrize("source", sorted(p.name for p in (ROOT / "kernels").glob("*.cu")))
def test_every_parameter_of_every_kernel_is_a_type_a_launch_can_pass(source):
    kernels = runtime._kernels_of(runtime.kernel_source(source))
    assert kernels, source
    for name, params in kernels.items():
        for pname, ctype in params:
            assert ctype == "*" or ctype in runtime._SCALARS, (source, name, pname, ctype)
        assert len({p for p, _ in params}) == len(params), f"{name}: a parameter name twice"


class Recorder:
    def __init__(self):
        self.calls = []

    def __call__(self, grid, block, args):
        self.calls.append((grid, block, args))


def test_a_launch_passes_arguments_in_the_c_order_as_their_c_types():
    kernel = Recorder()
    launch = runtime.Launcher("norm.cu", "rms_norm_f32", kernel, runtime.signature("norm.cu", "rms_norm_f32"))
    x, y = np.zeros(4, np.float32), np.zeros(4, np.float32)
    launch((1,), (32,), eps=1e-6, y=y, x=x, w=None, ne0=4, ne1=1, ne2=1, xs1=4, xs2=4, xs3=4, ys1=4, ys2=4, ys3=4)
    (_, _, args), = kernel.calls
    assert args[0] is x and args[1] is None and args[2] is y
    assert type(args[3]) is np.int32 and type(args[4]) is np.int64 and type(args[-1]) is np.float32


def test_a_missing_or_unknown_argument_is_an_error_that_names_it():
    launch = runtime.Launcher("norm.cu", "norm_f32", Recorder(), runtime.signature("norm.cu", "norm_f32"))
    ok = dict(x=None, y=None, ne0=4, ne1=1, ne2=1, xs1=4, xs2=4, xs3=4, ys1=4, ys2=4, ys3=4, eps=1e-6)
    with pytest.raises(TypeError, match=r"missing \['eps'\]"):
        launch((1,), (32,), **{k: v for k, v in ok.items() if k != "eps"})
    with pytest.raises(TypeError, match=r"unknown \['epsilon'\]"):
        launch((1,), (32,), **{**{k: v for k, v in ok.items() if k != "eps"}, "epsilon": 1e-6})
    with pytest.raises(KeyError, match="defines no kernel"):
        runtime.signature("norm.cu", "no_such_kernel")


def test_kernels_made_by_macros_are_found_by_name():
    assert [p for p, _ in runtime.signature("mmvq.cu", "mul_mat_vec_q6_k_1")][:3] == ["W", "x", "dst"]
    assert [p for p, _ in runtime.signature("rows.cu", "set_rows_f16")][:3] == ["x", "ids", "y"]
    assert runtime.signature("dequantize.cu", "dequantize_q5_k_f32") == runtime.signature(
        "dequantize.cu", "dequantize_q4_0_f16")
