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


# -- -ngl auto and -ts ------------------------------------------------------------------------------

from pyggml.models.placement import MiB, Placement, Sizes, describe, parse_split, plan_auto  # noqa: E402


def sizes(n_layer=10, layer=10 * MiB, kv=2 * MiB):
    return Sizes([layer] * n_layer, [kv] * n_layer, prolog=5 * MiB, epilog=1 * MiB, tied_head=5 * MiB,
                 compute=4 * MiB, head_compute=1 * MiB)


def test_auto_spreads_layers_in_proportion_to_free_memory():
    names = ["RPC[a]", "RPC[b]", "CPU"]
    p = plan_auto(sizes(), names, [104 * MiB, 304 * MiB, 10 ** 12])
    assert p.layers == [0] * 3 + [1] * 7  # 100 : 300 after the compute buffers
    assert p.prolog == 0 and p.epilog == 1


def test_auto_never_exceeds_a_devices_memory():
    """Over a grid of free memories: every plan fits its devices, or the planner says it
    cannot; where the plain proportions would overfill a device (the embedding, the head's
    copy and the head's buffer are not proportional), layers move to the neighbour."""
    names = ["RPC[a]", "RPC[b]", "CPU"]
    s = Sizes([10 * MiB] * 10, [2 * MiB] * 10, prolog=5 * MiB, epilog=1 * MiB, tied_head=30 * MiB,
              compute=4 * MiB, head_compute=1 * MiB)
    moved = refused = 0
    for f0 in range(40, 200, 7):
        for f1 in range(40, 200, 7):
            free = [f0 * MiB, f1 * MiB, 10 ** 12]
            try:
                p = plan_auto(s, names, free)
            except PlacementError:
                refused += 1
                for k in range(1, 10):  # no split of the layers between the two fits
                    split = Placement(0, 1, [0] * k + [1] * (10 - k))
                    assert s.total(split, 0) > free[0] or s.total(split, 1) > free[1], (f0, f1, k)
                continue
            assert all(s.total(p, d) <= free[d] for d in (0, 1))
            plain = plan_auto(s, names, [10 ** 12] * 3, [f0 - 4, f1 - 4]).layers
            moved += plain != p.layers
    assert moved and refused


def test_auto_with_only_the_cpu_keeps_everything_there():
    p = plan_auto(sizes(), ["CPU"], [10 ** 12])
    assert p.layers == [0] * 10 and p.prolog == p.epilog == 0


def test_too_large_says_what_is_missing_where():
    with pytest.raises(PlacementError, match=r"RPC\[a\] would need .* MiB and has 50 MiB free .* MiB missing"):
        plan_auto(sizes(), ["RPC[a]", "CPU"], [50 * MiB, 10 ** 12])


def test_tensor_split_gives_the_proportions():
    p = plan_auto(sizes(), ["RPC[a]", "RPC[b]", "CPU"], [10 ** 12] * 3, parse_split("3,1", 2))
    assert p.layers == [0] * 8 + [1] * 2
    p = plan_auto(sizes(), ["RPC[a]", "RPC[b]", "CPU"], [10 ** 12] * 3, parse_split("0,1", 2))
    assert p.layers == [1] * 10 and p.prolog == 1
    for bad in ("3,x", "1,2,3", "0,0", "-1,2"):
        with pytest.raises(PlacementError):
            parse_split(bad, 2)


def test_describe_lists_every_device_used():
    p = plan_auto(sizes(), ["RPC[a]", "RPC[b]", "CPU"], [104 * MiB, 304 * MiB, 10 ** 12])
    text = describe(p, sizes(), ["RPC[a]", "RPC[b]", "CPU"], [104 * MiB, 304 * MiB, 10 ** 12])
    rows = text.splitlines()
    assert len(rows) == 3 and "RPC[a]" in rows[1] and "0-2,prolog" in rows[1] and "3-9,epilog" in rows[2]
    assert "35.0 M" in rows[1]  # 3 layers of 10 MiB and the 5 MiB embedding
