"""The numpy CPU device and backend."""
from __future__ import annotations

import os
import platform
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..backend import Backend, BufferType, Device, DeviceType
from ..batch_rules import BATCH_RULES, COLUMNWISE_RULES, BatchRules
from ..graph import Graph
from ..opdefs import VIEW_OPS, Op, UnaryParams
from ..ops import converts
from ..quants import DEQUANTIZABLE, QUANTIZABLE
from ..tensor import Tensor
from ..types import Type
from .buffer import CPUBufferType
from .fusion import fused_plan
from .kinds import COLUMNWISE
from .ops import OP_TABLE, UNARY, Step
from .plan import plan_runs

if TYPE_CHECKING:
    from .warmup import Compiling

_threads_configured = False


def configure_threads(n_threads: int | None = None) -> int:
    """Give numba's kernels the cores and keep BLAS to one thread.

    numba's OpenMP workers and OpenBLAS's workers both spin while idle; running both
    pools on the same cores makes each wait for the other, so the numba pool owns the
    cores and BLAS calls stay single-threaded.
    """
    global _threads_configured
    import numba
    from threadpoolctl import threadpool_limits

    n = n_threads or numba.config.NUMBA_NUM_THREADS
    numba.set_num_threads(max(1, min(n, numba.config.NUMBA_NUM_THREADS)))
    if not _threads_configured:
        threadpool_limits(limits=1, user_api="blas")
        _threads_configured = True
    return numba.get_num_threads()


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _host_memory() -> tuple[int, int]:
    try:
        info = {}
        with open("/proc/meminfo") as f:
            for line in f:
                key, val = line.split(":", 1)
                info[key] = int(val.split()[0]) * 1024
        return info.get("MemAvailable", info["MemFree"]), info["MemTotal"]
    except (OSError, KeyError, ValueError):
        pages, size = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
        return pages * size, pages * size


def cpu_batch_rules(products: Collection[Type]) -> BatchRules:
    """The CPU's batch rules for products of weights of these types (a pyggml server's CPU
    too): a prompt cut anywhere where no product tiles its columns (kinds.COLUMNWISE)."""
    return COLUMNWISE_RULES if products and COLUMNWISE.issuperset(products) else BATCH_RULES


class CPUDevice(Device):
    """The host CPU.  Several instances with different names may exist (tests use two to
    stand in for two machines); each has its own buffer type, so the scheduler treats
    them as different devices."""

    def __init__(self, name: str = "CPU", n_threads: int | None = None) -> None:
        self.name = name
        self.n_threads = n_threads
        self.buft = CPUBufferType(self, name)

    def get_name(self) -> str:
        return self.name

    def get_description(self) -> str:
        return _cpu_name()

    def get_memory(self) -> tuple[int, int]:
        return _host_memory()

    def get_type(self) -> DeviceType:
        return DeviceType.CPU

    def batch_rules(self, products: Collection[Type] = ()) -> BatchRules:
        return cpu_batch_rules(products)

    def init_backend(self) -> CPUBackend:
        return CPUBackend(self)

    def get_buffer_type(self) -> BufferType:
        return self.buft

    def supports_op(self, op: Tensor) -> bool:
        if op.op == Op.UNARY:  # (ggml's unary ops that came after ours: not here)
            try:
                return UnaryParams.of(op).op in UNARY
            except ValueError:
                return False
        if converts(op):  # a quantizer for the type written, a decoder for the source's (pyggml.quants)
            return op.type in QUANTIZABLE and op.src[0].type in DEQUANTIZABLE and op.op in OP_TABLE
        return op.op in VIEW_OPS or op.op in OP_TABLE

    def supports_buft(self, buft: BufferType) -> bool:
        return buft.is_host()


    def prepare_for(self, weights: Sequence[tuple[str, Type, tuple[int, ...]]], gate: str | None,
                    say: Callable[[str], None] | None = None) -> Compiling | None:
        """The kernels of these weights' formats and of the gate, compiled into the cache in
        other processes where this machine has not compiled them yet (warmup.compile_for_model)."""
        from .warmup import compile_for_model
        return compile_for_model(weights, say, gate)


class CPUBackend(Backend):
    def __init__(self, device: CPUDevice) -> None:
        self.device = device
        self.n_threads = configure_threads(device.n_threads)
        self.profile: OpProfile | None = None  # set one to time every step of every plan, by op

    def get_name(self) -> str:
        return self.device.get_name()

    def get_device(self) -> CPUDevice:
        return self.device

    def set_n_threads(self, n: int) -> None:
        self.n_threads = configure_threads(n)

    def graph_plan_create(self, graph: Graph) -> CPUPlan:
        shared: dict = {}
        nodes = [node for node in graph.nodes if node.op not in VIEW_OPS]
        steps, ops, outputs = fused_plan(nodes, shared, bind)  # some nodes run as one step (fusion.py)
        return CPUPlan(graph, steps, ops, plan_runs(steps, outputs))  # most steps as one table (plan.py)

    def graph_plan_compute(self, plan: CPUPlan) -> None:
        if self.profile is not None:
            self.profile.run(plan)
            return
        for run in plan.runs:
            run()

    def graph_compute(self, graph: Graph) -> None:
        """Op by op: each node bound and run (what a plan does once, then runs again and again)."""
        for node in graph.nodes:
            if node.op not in VIEW_OPS:
                bind(node, {})()


@dataclass
class CPUPlan:
    """A graph's nodes bound to their steps (ops/), made once and run at every compute;
    the steps hold the views of every tensor they read and write."""
    graph: Graph
    steps: list[Step]
    ops: list[str]  # each step's op
    runs: list[Step]  # what a compute calls: the steps, consecutive table steps as one (plan.py)


@dataclass
class OpProfile:
    """Seconds and calls per op over the plans a backend ran while it held this profile."""
    seconds: dict[str, float] = field(default_factory=dict)
    calls: dict[str, int] = field(default_factory=dict)
    graphs: int = 0

    def run(self, plan: CPUPlan) -> None:
        clock, seconds, calls = time.perf_counter, self.seconds, self.calls
        for op, step in zip(plan.ops, plan.steps):
            t0 = clock()
            step()
            seconds[op] = seconds.get(op, 0.0) + clock() - t0
            calls[op] = calls.get(op, 0) + 1
        self.graphs += 1


def bind(node: Tensor, shared: dict) -> Step:
    binder = OP_TABLE.get(node.op)
    if binder is None:
        raise NotImplementedError(f"CPU backend: op {node.op.name} is not implemented")
    if node.buffer is None:
        raise ValueError(f"CPU backend: node {node.name or node.op.name} has no buffer (graph not allocated)")
    return binder(node, shared)


__all__ = ["CPUBackend", "CPUDevice", "CPUPlan", "OpProfile", "configure_threads"]
