"""The CUDA backend (CuPy + our kernels in ``kernels/``), present when CuPy finds a GPU.

CuPy is an optional extra (``pip install -e .[cuda]``).  Without it, without a GPU, or with
``PYGGML_NO_CUDA=1`` set, :func:`cuda_devices` is empty and nothing else changes.
"""
from __future__ import annotations

import logging
import os

log = logging.getLogger("pyggml.cuda")


def cuda_devices() -> list:
    """One :class:`CUDADevice` per GPU CuPy can see (none when CuPy or a GPU is missing)."""
    if os.environ.get("PYGGML_NO_CUDA"):
        return []
    try:
        import cupy
        n = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:  # noqa: BLE001 - no CuPy, no driver, no device: all mean "no CUDA here"
        log.debug("CUDA unavailable: %s", e)
        return []
    from .device import CUDADevice
    return [CUDADevice(i) for i in range(n)]


__all__ = ["cuda_devices"]
