"""-ngl parsing as DESIGN.md describes it (chatllm.cpp syntax plus llama.cpp habits)."""
from __future__ import annotations

import pytest

from pyggml.models import PlacementError, parse_ngl

DEVICES = ["RPC[127.0.0.1:8080]", "RPC[127.0.0.1:8081]", "RPC[127.0.0.1:8082]", "CPU"]


def test_default_everything_on_the_cpu():
    p = parse_ngl(None, 4, DEVICES)
    assert (p.prolog, p.epilog, p.layers) == (3, 3, [3, 3, 3, 3])


def test_design_example():
    p = parse_ngl("0:prolog,epilog;1:20;2:all", 30, DEVICES)
    assert p.prolog == 0 and p.epilog == 0
    assert p.layers == [1] * 20 + [2] * 10


def test_bare_number_means_device_0_and_leaves_the_rest_on_the_cpu():
    p = parse_ngl("16", 30, DEVICES)
    assert p.layers == [0] * 16 + [3] * 14 and p.prolog == 3 and p.epilog == 3


@pytest.mark.parametrize("spec", ["all", "-1", "0:all"])
def test_all(spec):
    p = parse_ngl(spec, 5, DEVICES)
    assert p.layers == [0] * 5 and p.prolog == 0 and p.epilog == 0


def test_more_layers_than_there_are_places_the_head_too():
    p = parse_ngl(999, 5, DEVICES)
    assert p.layers == [0] * 5 and p.epilog == 0 and p.prolog == 3


def test_all_keeps_earlier_assignments():
    p = parse_ngl("0:prolog,epilog;1:all", 4, DEVICES)
    assert (p.prolog, p.epilog, p.layers) == (0, 0, [1, 1, 1, 1])
    assert p.device_of("token_embd.weight") == 0 and p.device_of("blk.2.attn_q.weight") == 1
    assert p.device_of("output_norm.weight") == 0


def test_errors_name_the_problem():
    with pytest.raises(PlacementError, match="unknown device id 7; devices are 0: RPC"):
        parse_ngl("7:all", 4, DEVICES)
    with pytest.raises(PlacementError, match="'middle' is not"):
        parse_ngl("0:middle", 4, DEVICES)
    with pytest.raises(PlacementError, match="not a device id"):
        parse_ngl("x:all", 4, DEVICES)
