"""The CUDA device and backend: graphs run through one op table (kernels.py), and a graph that
comes back runs from what its earlier runs recorded (replay.py), kept in the graph's plan.

A plan (ggml's ``graph_plan``) is what this backend derives from one graph: the norms fused
with their weights, and the recorded launches or captured CUDA graph.  The scheduler makes one
per split and keeps it while the split lives; a graph computed without a plan gets one kept
here for as long as the graph exists.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass, field

from ..backend import Backend, BufferType, Device, DeviceType
from ..graph import Graph
from ..opdefs import VIEW_OPS
from ..tensor import Tensor
from . import kernels, replay
from .buffer import CUDABufferType, cupy_module


@dataclass
class CUDAPlan:
    graph: Graph
    fusions: dict[int, Tensor]           # id(RMS_NORM node) -> the MUL computed with it (kernels.fusions)
    replay: replay.Replay = field(default_factory=replay.Replay)


class CUDADevice(Device):
    def __init__(self, index: int) -> None:
        cp = cupy_module()
        self.index = index
        props = cp.cuda.runtime.getDeviceProperties(index)
        self.description = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
        self.buft = CUDABufferType(self)

    def get_name(self) -> str:
        return f"CUDA{self.index}"

    def get_description(self) -> str:
        return self.description

    def get_memory(self) -> tuple[int, int]:
        cp = cupy_module()
        with cp.cuda.Device(self.index):
            free, total = cp.cuda.runtime.memGetInfo()
        return int(free), int(total)

    def get_type(self) -> DeviceType:
        return DeviceType.GPU

    def init_backend(self) -> CUDABackend:
        return CUDABackend(self)

    def get_buffer_type(self) -> BufferType:
        return self.buft

    def supports_op(self, op: Tensor) -> bool:
        return op.op in VIEW_OPS or (op.op in kernels.OP_TABLE and kernels.supports(op))

    def supports_buft(self, buft: BufferType) -> bool:
        return buft is self.buft


class CUDABackend(Backend):
    def __init__(self, device: CUDADevice) -> None:
        self.device = device
        self._plans: weakref.WeakKeyDictionary[Graph, CUDAPlan] = weakref.WeakKeyDictionary()

    def get_name(self) -> str:
        return self.device.get_name()

    def get_device(self) -> CUDADevice:
        return self.device

    def graph_plan_create(self, graph: Graph) -> CUDAPlan:
        return CUDAPlan(graph, kernels.fusions(graph))

    def graph_plan_compute(self, plan: CUDAPlan) -> None:
        with cupy_module().cuda.Device(self.device.index):
            replay.compute(plan.replay, lambda: kernels.run_ops(plan.graph, plan.fusions))
            kernels.check_errors()  # what the kernels flagged (an index out of range), once per graph

    def graph_compute(self, graph: Graph) -> None:
        plan = self._plans.get(graph)
        if plan is None:
            plan = self._plans[graph] = self.graph_plan_create(graph)
        self.graph_plan_compute(plan)

    def synchronize(self) -> None:
        cupy_module().cuda.Device(self.device.index).synchronize()
