"""What the daemon takes from libcuda itself, through ctypes: the real extent of an opened
allocation (CuPy's runtime module has no cudaMemGetAddressRange), and what the compiled data plane
calls the driver with (its entry points, a stream's context); and the copy kernel's functions for
the plane, which CuPy loads.

``allocation_range`` needs a current context on the calling thread: the runtime's primary context
is current inside ``with cupy.cuda.Device(...)`` once a runtime call (``ipcOpenMemHandle``) has run.
"""

from __future__ import annotations

import ctypes
import functools
import threading

CUDA_SUCCESS = 0


class DriverError(RuntimeError):
    """A libcuda call returned an error."""


@functools.cache
def _libcuda() -> ctypes.CDLL:
    lib = ctypes.CDLL("libcuda.so.1")
    lib.cuMemGetAddressRange_v2.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_size_t),
                                            ctypes.c_uint64]
    lib.cuMemGetAddressRange_v2.restype = ctypes.c_int
    lib.cuGetErrorName.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
    lib.cuGetErrorName.restype = ctypes.c_int
    return lib


def allocation_range(ptr: int) -> tuple[int, int]:
    """(base, size) of the device allocation that contains ``ptr`` (cuMemGetAddressRange_v2)."""
    lib = _libcuda()
    base, size = ctypes.c_uint64(), ctypes.c_size_t()
    status = lib.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), ctypes.c_uint64(ptr))
    if status != CUDA_SUCCESS:
        name = ctypes.c_char_p()
        lib.cuGetErrorName(status, ctypes.byref(name))
        raise DriverError(f"cuMemGetAddressRange failed: {(name.value or b'CUresult %d' % status).decode()}")
    return base.value, size.value


# The driver's entry points the compiled data plane calls for a CUDA pool's copies, in the order of
# kv_cuda_driver (kvserver/lane/csrc/cuda.h): libcuda's exported names.
PLANE_ENTRY_POINTS = ("cuCtxSetCurrent", "cuMemcpyAsync", "cuStreamWaitEvent", "cuEventRecord",
                      "cuEventQuery", "cuEventCreate", "cuEventDestroy_v2", "cuLaunchKernel")


def plane_entry_points() -> tuple[int, ...]:
    """The addresses of PLANE_ENTRY_POINTS in libcuda, for ``Gate.set_cuda``."""
    lib = _libcuda()
    return tuple(ctypes.cast(getattr(lib, name), ctypes.c_void_p).value for name in PLANE_ENTRY_POINTS)


def stream_context(stream: int) -> int:
    """The CUcontext a stream belongs to (cuStreamGetCtx): the device's primary context for a
    runtime stream, which the plane's thread makes current before it calls the driver. Asked of
    the stream, not of the calling thread, which may have no context current."""
    lib = _libcuda()
    ctx = ctypes.c_void_p()
    status = lib.cuStreamGetCtx(ctypes.c_void_p(stream), ctypes.byref(ctx))
    if status != CUDA_SUCCESS or not ctx.value:
        raise DriverError(f"cuStreamGetCtx failed (CUresult {status}) or gave no context")
    return ctx.value


# The copy kernel's functions the plane was given, per device: a CUfunction is valid only while its
# module is loaded, and a CuPy Function keeps its module; CuPy's own caches do not always (CuPy 13
# may drop, and so unload, a module two threads compiled at once). Kept for the daemon's life.
_plane_kernels: dict[int, tuple] = {}
_plane_kernels_lock = threading.Lock()


def kernel_functions(cupy, ordinal: int) -> tuple[int, ...]:
    """The copy kernel's CUfunction for a word of 8, 4, 2 and 1 bytes, loaded for device
    ``ordinal`` (CuPy compiles and loads each on first use), for ``Gate.set_cuda_kernels``."""
    from kvserver.media.cuda.kernels import copy_rows_kernel

    with _plane_kernels_lock:
        functions = _plane_kernels.get(ordinal)
        if functions is None:
            with cupy.cuda.Device(ordinal):
                functions = tuple(copy_rows_kernel(cupy, word).kernel for word in (8, 4, 2, 1))
            _plane_kernels[ordinal] = functions
    return tuple(int(f.ptr) for f in functions)
