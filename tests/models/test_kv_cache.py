"""The KV cache's cell bookkeeping: what it keeps between steps (the pages each sequence owns,
the end of the cells in use) is what the cells' tags say, whatever the order of operations."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
from hypothesis import example, given, settings
from hypothesis import strategies as st

import pyggml as pg
from pyggml.batch_rules import BATCH_RULES
from pyggml.models.kv_cache import FREE, KVCache

PAGE = BATCH_RULES.kv_page


def small_cache(n_ctx: int) -> KVCache:
    hp = SimpleNamespace(n_embd_k_gqa=32, n_embd_v_gqa=32, n_layer=1, n_swa=0)
    return KVCache(hp, n_ctx, [pg.cpu_device().get_buffer_type()])


def fresh(kv: KVCache) -> tuple[dict, int]:
    """owned() and n_kv() worked out from the tags alone."""
    kv._owner = kv._end = None
    return dict(kv.owned()), kv.n_kv()


# an operation: append tokens to a sequence, drop a sequence's tail, or clear everything
ops = st.lists(st.one_of(st.tuples(st.just("add"), st.integers(0, 3), st.integers(1, 90)),
                         st.tuples(st.just("rm"), st.integers(0, 3), st.integers(0, 130)),
                         st.tuples(st.just("clear"), st.just(0), st.just(0))), max_size=25)


@settings(max_examples=150, deadline=None)
@given(ops)
@example([("add", 0, 90), ("rm", 0, 0)])                      # a sequence's pages all freed
@example([("add", 1, 70), ("add", 2, 60), ("rm", 2, 0), ("add", 3, 5)])  # the last cells freed, a page taken again
def test_what_the_cache_keeps_about_its_cells_is_what_the_tags_say(steps):
    kv = small_cache(5 * PAGE + 17)  # a last page cut short
    length = {s: 0 for s in range(4)}
    for op, seq, n in steps:
        if op == "add":
            pos = np.arange(length[seq], length[seq] + n, dtype=np.int32)
            seqs = np.full(n, seq, dtype=np.int32)
            cells = kv.find_cells(seqs, pos)
            if cells is None:  # full: nothing taken
                continue
            for start in range(0, n, 32):  # occupied a piece at a time, as a context's ubatches are
                kv.occupy(cells[start:start + 32], seqs[start:start + 32], pos[start:start + 32])
            length[seq] += n
        elif op == "rm":
            kv.seq_rm(seq, min(n, length[seq]))
            length[seq] = min(n, length[seq])
        else:
            kv.clear()
            length = {s: 0 for s in range(4)}
        kept = dict(kv.owned()), kv.n_kv()
        assert kept == fresh(kv)
        used = kv.cell_seq != FREE
        assert sorted(length.values()) == sorted(int((kv.cell_seq == s).sum()) for s in range(4))
        assert not used.any() or kv.n_kv() >= int(np.flatnonzero(used)[-1]) + 1
