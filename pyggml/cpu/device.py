"""The numpy CPU device and backend."""
from __future__ import annotations

import os
import platform
from collections.abc import Callable
from dataclasses import dataclass

from ..backend import Backend, BufferType, Device, DeviceType
from ..graph import Graph
from ..opdefs import VIEW_OPS
from ..tensor import Tensor
from .buffer import CPUBufferType
from .kernels import OP_TABLE

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

    def init_backend(self) -> CPUBackend:
        return CPUBackend(self)

    def get_buffer_type(self) -> BufferType:
        return self.buft

    def supports_op(self, op: Tensor) -> bool:
        return op.op in VIEW_OPS or op.op in OP_TABLE

    def supports_buft(self, buft: BufferType) -> bool:
        return buft.is_host()


class CPUBackend(Backend):
    def __init__(self, device: CPUDevice) -> None:
        self.device = device
        self.n_threads = configure_threads(device.n_threads)

    def get_name(self) -> str:
        return self.device.get_name()

    def get_device(self) -> CPUDevice:
        return self.device

    def set_n_threads(self, n: int) -> None:
        self.n_threads = configure_threads(n)

    def graph_plan_create(self, graph: Graph) -> CPUPlan:
        return CPUPlan(graph, [(kernel_of(node), node) for node in graph.nodes if node.op not in VIEW_OPS])

    def graph_plan_compute(self, plan: CPUPlan) -> None:
        for kernel, node in plan.steps:
            kernel(node)

    def graph_compute(self, graph: Graph) -> None:
        for node in graph.nodes:
            compute_node(node)


@dataclass
class CPUPlan:
    """A graph's kernels, looked up and checked once: what the scheduler keeps per split."""
    graph: Graph
    steps: list[tuple[Callable[[Tensor], None], Tensor]]


def kernel_of(node: Tensor) -> Callable[[Tensor], None]:
    kernel = OP_TABLE.get(node.op)
    if kernel is None:
        raise NotImplementedError(f"CPU backend: op {node.op.name} is not implemented")
    if node.buffer is None:
        raise ValueError(f"CPU backend: node {node.name or node.op.name} has no buffer (graph not allocated)")
    return kernel


def compute_node(node: Tensor) -> None:
    if node.op not in VIEW_OPS:
        kernel_of(node)(node)


__all__ = ["CPUBackend", "CPUDevice", "CPUPlan", "configure_threads"]
