"""What the Engine decodes at each step: continuous batching's scheduling, with no model in it.

- **Admission.**  Queued requests go into idle slots in arrival order; slot i is KV-cache
  sequence i.  A request goes to the idle slot whose last conversation shares the longest
  prefix with its prompt (then the least recently used), and skips the part of that prefix
  the batch rules let it reuse.  It is admitted only when its prompt and one token more fit
  beside what the admitted requests still need, so prompts never wait on each other for cells.
- **Cells.**  The cache hands out cells in pages (BatchRules.kv_page); the counting below is
  in pages.  An idle slot keeps its cells until they are needed, then gives them up, least
  recently used first.
- **A step.**  One token of every generating sequence (but those whose last step is still on
  the servers: the Engine's pipelined lanes), then pieces of the prompts being read,
  oldest request first, within ``n_batch`` tokens (within ``prompt_budget`` prompt tokens
  while sequences generate).  Each piece is cut by
  BatchRules.prompt_cut, so that every token meets the kernels of a whole read.  A generating
  sequence that finds no free cell for its next token ends ("length").
"""
from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from pyggml.batch_rules import BatchRules

from .context import Batch
from .kv_cache import KVCache


class Slot:
    """One of the engine's sequences: what the cache holds for it, and the request it serves."""

    def __init__(self, seq: int) -> None:
        self.seq = seq
        self.tokens: list[int] = []       # what the cache holds for this sequence, in order
        self.req: Any = None              # the Request served (engine.py), None when idle
        self.last_used = 0.0
        self.gen: Any = None              # the request's Generation (runner.py)
        self.pending: int | None = None   # sampled, to be decoded in the next step
        self.answer: Any = None           # the output row of the last prompt it read whole (runner.PromptAnswer)
        self.in_flight = False            # its step is on the servers, not yet read back (Engine's lanes)
        self.held_by: list[tuple[Slot, Any]] = []  # answering: the (slot, request)s admitted with it, read first

    @property
    def prefilling(self) -> bool:
        return self.req is not None and self.pending is None

    @property
    def answering(self) -> bool:
        """Admitted with its whole prompt cached: its first token comes from the stored answer."""
        return self.prefilling and len(self.tokens) == len(self.req.ids)

    def prompt_left(self) -> int:
        return len(self.req.ids) - len(self.tokens) if self.req is not None and self.pending is None else 0


@dataclass
class StepPlan:
    parts: list[tuple[Slot, list[int]]]  # each slot's tokens this step: the generating ones first
    out_of_cells: list[Slot]             # generating sequences left without a cell: they end ("length")

    def batch(self) -> tuple[Batch, list[Slot]]:
        """The step's batch, and the slots with an output row, in the batch's order: every
        generating sequence, and each prompt whose last token is in this step."""
        parts = self.parts
        ends = [s.pending is not None or len(s.tokens) + len(c) == len(s.req.ids) for s, c in parts]
        batch = Batch(np.array([t for _, c in parts for t in c], dtype=np.int32),
                      np.array([len(s.tokens) + i for s, c in parts for i in range(len(c))], dtype=np.int32),
                      np.array([s.seq for s, c in parts for _ in c], dtype=np.int32),
                      np.array([i == len(c) - 1 and end for (s, c), end in zip(parts, ends) for i in range(len(c))],
                               dtype=bool))
        return batch, [s for (s, _), end in zip(parts, ends) if end]


class Scheduler:
    def __init__(self, slots: Sequence[Slot], kv: KVCache, rules: BatchRules, n_batch: int, n_ubatch: int,
                 seq_rm: Callable[[int, int], None], prompt_budget: int | None = None,
                 seq_cp: Callable[[int, int, int, int], bool] | None = None) -> None:
        """``seq_rm(seq, p0)`` frees a sequence's cells from position p0 on (Context.seq_rm:
        the cache's history records it); ``seq_cp(src, dst, p0, p1)`` gives sequence dst the
        cells of src at positions p0 .. p1 - 1 (Context.seq_cp; False where it cannot), so that
        a prompt sharing a prefix with another slot's (a system prompt) is read from there.  ``prompt_budget``: prompt tokens a step reads beside
        generating sequences (None: up to n_batch), so that a long prompt arriving does not stop
        the streams for the time it takes to read it whole (chunked prefill); at least
        rules.min_budget, the least with which every prompt_cut makes progress."""
        self.slots, self.kv, self.rules = list(slots), kv, rules
        self.n_batch, self.n_ubatch = n_batch, n_ubatch
        self.prompt_budget = None if prompt_budget is None else max(prompt_budget, rules.min_budget)
        self.seq_rm = seq_rm
        self.seq_cp = seq_cp

    def fits(self, n_prompt: int) -> bool:
        """Whether a prompt of ``n_prompt`` tokens and a token after it fit in the cache at all:
        one that does not would wait at the head of the queue for ever."""
        return 0 < n_prompt < self.kv.n_ctx

    def pages_needed(self, s: Slot, owned: dict) -> int:
        """Pages an admitted request still needs: the rest of its prompt and one token more."""
        start = len(s.tokens)
        end = len(s.req.ids) + 1 if s.pending is None else start + 1
        return self.kv.pages_for(s.seq, start, end, owned)

    def admit(self, queue: deque, answered: Callable[[Slot, Any], bool] | None = None) -> list[tuple[Slot, Any, int]]:
        """Take queued requests into idle slots, in arrival order, while they fit: (slot,
        request, cached tokens) each, the slot's cells past the cached prefix freed.  A
        cancelled request at the head of the queue is dropped.  ``answered(slot, request)``:
        whether the slot holds the answer to this very prompt (its output row, stored when
        the slot read it whole): then every token is cached, none read again."""
        kv, page = self.kv, self.kv.page
        taken = []
        while queue:
            req = queue[0]
            if req.cancelled:
                queue.popleft()
                continue
            idle = [s for s in self.slots if s.req is None]
            if not idle:
                break
            slot = max(idle, key=lambda s: slot_rank(s, req.ids))
            shared = common_prefix(slot.tokens, req.ids)
            if shared == len(req.ids) and answered is not None and answered(slot, req):
                cached = shared
            else:
                cached = self.rules.reusable_prefix(shared, len(req.ids), self.n_ubatch)
            owned = kv.owned()
            kept = -(-cached // page)  # the slot's pages that the shared prefix keeps
            need = len(req.ids) // page - cached // page + 1 - (1 if cached % page else 0)
            room = (kv.free_pages + kv.seq_pages(slot.seq) - kept
                    + sum(kv.seq_pages(s.seq) for s in idle if s is not slot)
                    - sum(self.pages_needed(s, owned) for s in self.slots if s.req is not None))
            if need > room:
                break  # waits until running requests give cells back
            queue.popleft()
            self.seq_rm(slot.seq, cached)
            slot.tokens = slot.tokens[:cached]
            donor, upto = self._donor(slot, req.ids, cached)
            if donor is not None and self.seq_cp(donor.seq, slot.seq, cached, upto):
                slot.tokens, cached = list(req.ids[:upto]), upto
            slot.req, slot.pending = req, None
            taken.append((slot, req, cached))
        return taken

    def _donor(self, slot: Slot, ids: Sequence[int], cached: int) -> tuple[Slot | None, int]:
        """The other slot whose cells hold the longest prefix of ``ids`` that a read can follow
        (reusable_prefix), if longer than the ``cached`` tokens ``slot`` keeps, and how long."""
        best, upto = None, cached
        if self.seq_cp is None:
            return best, upto
        for d in self.slots:
            if d is not slot and d.tokens:
                c = self.rules.reusable_prefix(common_prefix(d.tokens, ids), len(ids), self.n_ubatch)
                if c > upto:
                    best, upto = d, c
        return best, upto

    def release(self, slot: Slot) -> None:
        """The slot's request ended: it keeps its cells for a prompt that shares them."""
        slot.req = slot.gen = slot.pending = None
        slot.last_used = time.monotonic()

    def make_room(self, pages: int) -> None:
        """Free idle slots' cells, least recently used first, until ``pages`` pages are free."""
        for s in sorted((s for s in self.slots if s.req is None and s.tokens), key=lambda s: s.last_used):
            if self.kv.free_pages >= pages:
                return
            self.seq_rm(s.seq, 0)
            s.tokens = []

    def plan(self) -> StepPlan:
        """What the next step decodes (nothing when no slot has work)."""
        generating = [s for s in self.slots if s.req is not None and s.pending is not None and not s.in_flight]
        prefilling = sorted((s for s in self.slots if s.prefilling and not s.answering), key=lambda s: s.req.t_submit)
        if not generating and not prefilling:
            return StepPlan([], [])
        kv, page = self.kv, self.kv.page
        owned = kv.owned()
        self.make_room(sum(self.pages_needed(s, owned) for s in generating + prefilling))
        owned = kv.owned()
        free = kv.free_pages
        gen_pages = [kv.pages_for(s.seq, len(s.tokens), len(s.tokens) + 1, owned) for s in generating]
        out_of_cells = []
        while sum(gen_pages) > free:  # no cell left for its next token
            gen_pages.pop()
            out_of_cells.append(generating.pop())
        free -= sum(gen_pages)
        budget = self.n_batch - len(generating)
        if generating and self.prompt_budget is not None:
            budget = min(budget, self.prompt_budget)
        parts: list[tuple[Slot, list[int]]] = [(s, [s.pending]) for s in generating]
        for s in prefilling:
            done, left = len(s.tokens), len(s.req.ids) - len(s.tokens)
            # positions that fit: the rest of the page holding `done`, if the slot owns it, and free pages
            room = free * page + ((page - done % page) if done % page else 0)
            n = self.rules.prompt_cut(done, len(s.req.ids), min(budget, room), self.n_ubatch)
            if n == 0 and len(parts) == len(generating):  # a budget under min_budget: progress before bits
                n = min(budget, left, room)
            if n <= 0:
                continue
            free -= kv.pages_for(s.seq, done, done + n, owned)
            budget -= n
            parts.append((s, s.req.ids[done:done + n]))
        return StepPlan(parts, out_of_cells)


def slot_rank(s: Slot, ids: Sequence[int]) -> tuple[bool, int, float]:
    """How well an idle slot suits a prompt (the highest is taken): the longest shared prefix,
    then the least recently used - but a slot still holding a whole prompt it read, with that
    read's answer (the prompt again, or the next turn of its conversation, is read from it at
    no cost), comes after every other when the prompt would overwrite part of it: a prompt that
    shares only a chat template's first tokens with it takes an empty slot instead."""
    shared = common_prefix(s.tokens, ids)
    a = s.answer
    keeps_other = (a is not None and shared < len(a.ids) <= len(s.tokens)
                   and common_prefix(s.tokens, a.ids) == len(a.ids))
    return not keeps_other, shared, -s.last_used


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
