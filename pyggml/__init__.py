"""pyggml: a ggml-style tensor runtime in Python.

The pieces mirror ggml's: :class:`Type` and :mod:`pyggml.quants` (formats),
:class:`Tensor` and :mod:`pyggml.ops` (the graph IR), :class:`Graph`, the backend
interfaces in :mod:`pyggml.backend`, :class:`GraphAllocator`, :class:`Scheduler`, GGUF
loading in :mod:`pyggml.gguf`, and the devices listed by :func:`devices`.
"""
from __future__ import annotations

from . import ops, quants
from .alloc import GraphAllocator, alloc_graph
from .backend import (Backend, Buffer, BufferType, Device, DeviceType, Registry, alloc_tensors, tensor_array,
                      tensor_arrays, tensor_copy, tensor_get, tensor_memset, tensor_set)
from .graph import Graph, build_forward
from .opdefs import GluOp, Op, RopeMode, UnaryOp
from .sched import Scheduler
from .tensor import Tensor, TensorFlag, new_tensor
from .types import QK_K, Type

__version__ = "0.1.0"

registry = Registry()


def _register_builtin_devices() -> None:
    from .cpu import CPUDevice
    from .cuda import cuda_devices
    registry.register(CPUDevice())
    for dev in cuda_devices():
        registry.register(dev)


def devices() -> list[Device]:
    """Every device this process can use (the CPU always; GPUs when their backend loads)."""
    if not registry.devices():
        _register_builtin_devices()
    return registry.devices()


def __getattr__(name: str):
    # the model API pulls in tokenizers and jinja2: imported only when asked for
    if name == "Model":
        from .models import Model
        return Model
    if name in ("gguf", "hub"):  # reached as pyggml.gguf and pyggml.hub (the models' downloads) in examples
        import importlib
        return importlib.import_module({"gguf": ".gguf", "hub": ".models.hub"}[name], __name__)
    raise AttributeError(f"module 'pyggml' has no attribute {name!r}")


def cpu_device() -> Device:
    return next(d for d in devices() if d.get_type() == DeviceType.CPU)


__all__ = [
    "Backend", "Buffer", "Model", "BufferType", "Device", "DeviceType", "Graph", "GraphAllocator", "GluOp", "Op",
    "QK_K", "Registry", "RopeMode", "Scheduler", "Tensor", "TensorFlag", "Type", "UnaryOp", "alloc_graph",
    "alloc_tensors", "build_forward", "cpu_device", "devices", "new_tensor", "ops", "quants", "registry",
    "tensor_array", "tensor_arrays", "tensor_copy", "tensor_get", "tensor_memset", "tensor_set",
]
