"""The numpy CPU backend (numba kernels for quantized matrix products)."""
from .kernel_cache import use_versioned_cache

use_versioned_cache()  # before the kernels below are defined: their cache must match their sources

from .buffer import CPUBuffer, CPUBufferType, tensor_rows, tensor_view  # noqa: E402
from .device import CPUBackend, CPUDevice, OpProfile, configure_threads  # noqa: E402
from .ops import OP_TABLE  # noqa: E402
from .warmup import warm_up  # noqa: E402

__all__ = ["CPUBuffer", "CPUBufferType", "CPUBackend", "CPUDevice", "OP_TABLE", "OpProfile", "configure_threads",
           "tensor_rows", "tensor_view", "warm_up"]
