"""The numpy CPU backend (numba kernels for quantized matrix products)."""
from .buffer import CPUBuffer, CPUBufferType, tensor_rows, tensor_view
from .device import CPUBackend, CPUDevice, configure_threads
from .kernels import OP_TABLE
from .warmup import warm_up

__all__ = ["CPUBuffer", "CPUBufferType", "CPUBackend", "CPUDevice", "OP_TABLE", "configure_threads",
           "tensor_rows", "tensor_view", "warm_up"]
