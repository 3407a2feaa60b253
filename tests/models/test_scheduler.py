"""The engine's scheduler (models/scheduler.py) without a model: requests arrive, are cancelled
and generate, over a small real KV cache whose cells the simulated steps take as a decoding
step would, and the scheduler's promises hold at every step."""
from __future__ import annotations

from collections import deque
from types import SimpleNamespace

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

import pyggml as pg
from pyggml.batch_rules import BATCH_RULES
from pyggml.models.kv_cache import KVCache
from pyggml.models.scheduler import Scheduler, Slot

RULES = BATCH_RULES
N_BATCH = N_UBATCH = 64
BASE = list(range(1000, 1400))  # prompts share prefixes of it, so that slots' cells are reused


def small_cache(n_pages: int) -> KVCache:
    hp = SimpleNamespace(n_embd_k_gqa=32, n_embd_v_gqa=32, n_layer=1, n_swa=0)
    return KVCache(hp, n_pages * RULES.kv_page, [pg.cpu_device().get_buffer_type()])


# an event: a request arrives (prompt: a shared prefix and its own tail; tokens it generates),
# a request is cancelled, or a step runs
events = st.lists(st.one_of(
    st.tuples(st.just("submit"), st.integers(0, 200), st.integers(1, 150), st.integers(1, 40)),
    st.tuples(st.just("cancel"), st.integers(0, 30), st.just(0), st.just(0)),
    st.tuples(st.just("step"), st.just(0), st.just(0), st.just(0))), max_size=60)


class Simulation:
    def __init__(self, n_slots: int, n_pages: int, prompt_budget: int | None = None) -> None:
        self.kv = small_cache(n_pages)
        self.slots = [Slot(i) for i in range(n_slots)]
        # prefixes copied between slots as Context.seq_cp copies them (the cells' tags)
        self.sched = Scheduler(self.slots, self.kv, RULES, N_BATCH, N_UBATCH, self.kv.seq_rm, prompt_budget,
                               lambda src, dst, p0, p1: self.kv.copy_cells(src, dst, p0, p1) is not None)
        self.prompt_budget = prompt_budget
        self.queue: deque = deque()
        self.requests: list = []
        self.clock = 0

    def submit(self, shared: int, own: int, wants: int) -> None:
        self.clock += 1
        ids = BASE[:shared] + [self.clock * 1000 + i for i in range(own)]
        if not self.sched.fits(len(ids)):
            return  # refused at once (Engine.check_prompt)
        req = SimpleNamespace(ids=ids, cancelled=False, t_submit=self.clock, wants=wants, read=None, got=0, ended=None)
        self.requests.append(req)
        self.queue.append(req)

    def cancel(self, i: int) -> None:
        if self.requests:
            self.requests[i % len(self.requests)].cancelled = True

    def end(self, s: Slot, reason: str) -> None:
        s.req.ended = reason
        self.sched.release(s)

    def step(self) -> bool:
        """One engine step; False when there was nothing to do."""
        for s in self.slots:
            if s.req is not None and s.req.cancelled:
                self.end(s, "cancelled")
        waiting = [r for r in self.queue if not r.cancelled]
        admitted = self.sched.admit(self.queue)
        # arrival order: the admitted are the first of those waiting, in order
        assert [r for _, r, _ in admitted] == waiting[:len(admitted)]
        for slot, req, cached in admitted:
            assert slot.tokens == req.ids[:cached] and cached < len(req.ids)
            # its cells hold those positions, its own or copied from another slot's
            assert sorted(self.kv.cell_pos[self.kv.cell_seq == slot.seq].tolist()) == list(range(cached))
            req.read = list(req.ids[:cached])
        plan = self.sched.plan()
        for s in plan.out_of_cells:
            self.end(s, "length")
        if not plan.parts:
            return bool(admitted)
        batch, outs = plan.batch()
        assert 0 < len(batch) <= N_BATCH
        generating = [s for s in self.slots if s.req is not None and s.pending is not None]
        assert [s for s, _ in plan.parts[:len(generating)]] == generating  # every generating sequence, one token each
        assert all(c == [s.pending] for s, c in plan.parts[:len(generating)])
        prompts = plan.parts[len(generating):]
        if generating and self.prompt_budget is not None:  # chunked prefill beside the streams
            assert sum(len(c) for _, c in prompts) <= max(self.prompt_budget, 2 * RULES.piece_align)
        assert [s.req.t_submit for s, _ in prompts] == sorted(s.req.t_submit for s, _ in prompts)  # oldest first
        for k, (s, c) in enumerate(prompts):
            done = len(s.tokens)
            assert c == s.req.ids[done:done + len(c)] and c  # the prompt continues where its cells end
            # cut as a whole read's ubatches would be (unless a starved step's first piece)
            assert RULES.prompt_cut(done, len(s.req.ids), len(c), N_UBATCH) == len(c) or k == 0
        # the cells were counted right: the batch finds room, as the context would
        cells = self.kv.find_cells(batch.seq, batch.pos)
        assert cells is not None
        self.kv.occupy(cells, batch.seq, batch.pos)
        for s, c in plan.parts:
            if s.pending is None:
                s.req.read += c
            s.tokens.extend(c)
        for s in outs:
            req = s.req
            if s.pending is None:
                assert req.read == req.ids  # the whole prompt, each token once, in order
            req.got += 1
            if req.got >= req.wants:
                self.end(s, "done")
            else:
                s.pending = 7 + req.got
        return True

    def busy(self) -> bool:
        return any(s.req is not None for s in self.slots) or any(not r.cancelled for r in self.queue)


@settings(max_examples=120, deadline=None)
@given(events, st.integers(1, 4), st.integers(3, 10), st.one_of(st.none(), st.integers(0, 40)))
def test_the_schedulers_promises_hold_at_every_step(ops, n_slots, n_pages, prompt_budget):
    sim = Simulation(n_slots, n_pages, prompt_budget)
    for kind, a, b, c in ops:
        if kind == "submit":
            sim.submit(a, b, c)
        elif kind == "cancel":
            sim.cancel(a)
        else:
            sim.step()
    # every request that fits the cache ends: nothing starves
    for _ in range(4000):
        if not sim.busy():
            break
        sim.step()
    assert not sim.busy()
    assert all(r.ended in ("done", "length") for r in sim.requests if not r.cancelled)


def test_a_request_takes_the_idle_slot_sharing_its_prefix_and_skips_it():
    sim = Simulation(2, 8)
    sim.submit(200, 10, 1)
    while sim.busy():
        sim.step()
    sim.submit(200, 20, 1)  # the same 200 tokens first
    slot, req, cached = sim.sched.admit(sim.queue)[0]
    assert slot.seq == 0 and cached == RULES.reusable_prefix(200, len(req.ids), N_UBATCH) and cached >= 192


def test_a_slot_holding_a_whole_prompt_is_kept_for_it_while_an_empty_slot_is_idle():
    """A slot whose cells hold a whole prompt it read, with that read's answer, serves the same
    prompt again or its conversation's next turn at no cost: a prompt sharing only its first
    tokens (a chat template's) takes an empty slot rather than overwrite it; the next turn of
    its conversation takes it."""
    from pyggml.models.runner import PromptAnswer
    kv = small_cache(8)
    slots = [Slot(0), Slot(1)]
    sched = Scheduler(slots, kv, RULES, N_BATCH, N_UBATCH, kv.seq_rm)
    first = BASE[:40]
    slots[0].tokens = first + [7, 8, 9]  # the prompt read whole, then what it generated
    kv.occupy(np.arange(len(slots[0].tokens), dtype=np.int32), np.zeros(len(slots[0].tokens), np.int32),
              np.arange(len(slots[0].tokens), dtype=np.int32))
    slots[0].answer = PromptAnswer(tuple(first))

    def admitted(ids: list[int]) -> Slot:
        req = SimpleNamespace(ids=ids, cancelled=False, t_submit=0)
        [(slot, _, _)] = sched.admit(deque([req]))
        return slot
    other = BASE[:25] + [5000 + i for i in range(15)]  # shares the template's 25 tokens
    assert admitted(other) is slots[1] and slots[0].tokens[:40] == first
    sched.release(slots[1])
    slots[1].tokens, slots[1].answer = BASE[:25] + [6000], PromptAnswer(tuple(BASE[:25] + [6000]))
    assert admitted(first + [7, 8, 9, 10, 11]) is slots[0]  # the next turn of its conversation
