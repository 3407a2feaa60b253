"""Tensor shape helpers and graph building, against their definitions."""
from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from pyggml import ops
from pyggml.graph import Graph
from pyggml.opdefs import Op
from pyggml.tensor import Tensor, TensorFlag, contiguous_strides, new_tensor
from pyggml.types import Type


@settings(max_examples=300, deadline=None)
@given(st.sampled_from([Type.F32, Type.F16, Type.Q4_0, Type.Q4_K]),
       st.lists(st.integers(1, 4), min_size=4, max_size=4),
       st.lists(st.integers(0, 3), min_size=4, max_size=4))
def test_is_contiguous_is_the_definition(type, ne, stretch):
    """Contiguous: the first stride is an element's (a block's) size and every dimension of more
    than one element has contiguous_strides' stride; strides are stretched here at random."""
    ne = [ne[0] * type.block_size] + ne[1:]
    want = contiguous_strides(type, ne)
    nb = [w * (1 + s) if i else w + s for i, (w, s) in enumerate(zip(want, stretch))]
    t = Tensor(type, ne, nb)
    expected = nb[0] == want[0] and all(n == 1 or s == w for n, s, w in zip(ne[1:], nb[1:], want[1:]))
    assert t.is_contiguous() == expected


def _reference_order(outputs: list[Tensor]) -> list[Tensor]:
    """ggml_visit_parents' order: depth first, sources in order before their user, once each."""
    order: list[Tensor] = []
    seen: set[int] = set()

    def visit(t: Tensor) -> None:
        if id(t) in seen:
            return
        for s in t.src:
            if s is not None:
                visit(s)
        if id(t) not in seen:
            seen.add(id(t))
            order.append(t)

    for out in outputs:
        visit(out)
    return order


def test_build_forward_expand_orders_as_ggml_does():
    """Random graphs of shared sources, repeated operands and several outputs expanded one after
    another: every tensor once, sources first, in ggml's order, parameters among the nodes."""
    rng = random.Random(7)
    for _ in range(50):
        leafs = [new_tensor(Type.F32, [4, 3], name=f"leaf{i}") for i in range(3)]
        leafs[0].flags |= TensorFlag.PARAM
        pool = list(leafs)
        for _ in range(rng.randint(1, 30)):
            a, b = rng.choice(pool), rng.choice(pool)
            pool.append(rng.choice([ops.add, ops.mul])(a, b))
        outputs = rng.sample(pool[3:], k=min(3, len(pool) - 3))
        graph = Graph()
        for out in outputs:
            graph.build_forward_expand(out)
        order = _reference_order(outputs)
        assert graph.nodes == [t for t in order if t.op != Op.NONE or t.flags & TensorFlag.PARAM]
        assert graph.leafs == [t for t in order if t.op == Op.NONE and not t.flags & TensorFlag.PARAM]
