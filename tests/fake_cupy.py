"""A stand-in for CuPy on a machine without a GPU, for testing the daemon's CUDA path logic.

"Device memory" is host memory (numpy buffers), so every copy the daemon plans through IPC
pointers, the copy kernel or DMA really moves bytes and can be checked bit for bit. Every runtime
call is logged in order, so event ordering and the release of every resource can be checked too.
What it cannot show (real IPC, pinning, kernel speed) is for scripts/gpu_check.py on a GPU.
"""

from __future__ import annotations

import contextlib
import ctypes
import types

import numpy as np

UUID_HEX = "1a2b3c4d5e6f7a8b9c0d112233445566"
UUID = "GPU-1a2b3c4d-5e6f-7a8b-9c0d-112233445566"


class FakeRuntime:
    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.allocations: dict[bytes, np.ndarray] = {}
        self._next = 1

    def _id(self) -> int:
        self._next += 1
        return self._next

    def export(self, nbytes: int) -> tuple[bytes, np.ndarray]:
        """An engine's cudaMalloc: returns (IPC handle, its memory)."""
        mem = np.zeros(nbytes, dtype=np.uint8)
        handle = self._id().to_bytes(8, "little") * 8
        self.allocations[handle] = mem
        return handle, mem

    def getDeviceCount(self):
        return 1

    def getDeviceProperties(self, i):
        return {"uuid": bytes.fromhex(UUID_HEX)}

    def deviceGetByPCIBusId(self, bus):
        raise RuntimeError("no such bus")

    def ipcOpenMemHandle(self, handle, flags=1):
        self.calls.append(("ipcOpenMemHandle", handle))
        return self.allocations[handle].ctypes.data

    def ipcCloseMemHandle(self, ptr):
        self.calls.append(("ipcCloseMemHandle", ptr))

    def hostRegister(self, ptr, size, flags):
        self.calls.append(("hostRegister", ptr, size, flags))

    def hostUnregister(self, ptr):
        self.calls.append(("hostUnregister", ptr))

    def pointerGetAttributes(self, ptr):
        return types.SimpleNamespace(devicePointer=ptr)  # UVA: the host address works on the device

    def streamCreateWithFlags(self, flags):
        return self._id()

    def streamDestroy(self, stream):
        self.calls.append(("streamDestroy", stream))

    def streamSynchronize(self, stream):
        self.calls.append(("streamSynchronize", stream))

    def streamWaitEvent(self, stream, event, flags=0):
        self.calls.append(("streamWaitEvent", event))

    def eventCreateWithFlags(self, flags):
        return self._id()

    def eventDestroy(self, event):
        self.calls.append(("eventDestroy", event))

    def ipcGetEventHandle(self, event):
        return event.to_bytes(8, "little") * 8

    def ipcOpenEventHandle(self, handle):
        self.calls.append(("ipcOpenEventHandle", handle))
        return int.from_bytes(handle[:8], "little") + 100_000

    def eventRecord(self, event, stream):
        self.calls.append(("eventRecord", event))

    def eventSynchronize(self, event):
        self.calls.append(("eventSynchronize", event))

    def memcpyAsync(self, dst, src, size, kind, stream):
        self.calls.append(("memcpyAsync", size))
        ctypes.memmove(dst, src, size)


class FakeKernel:
    def __init__(self, runtime: FakeRuntime) -> None:
        self.runtime = runtime

    def __call__(self, grid, block, args):
        dst_bases, src_bases, count, dst_off, src_off, n, words = args
        self.runtime.calls.append(("kernel", int(count), int(n)))
        for b in range(int(count)):
            for r in range(int(n)):
                ctypes.memmove(int(dst_bases[b]) + int(dst_off[r]), int(src_bases[b]) + int(src_off[r]),
                               int(words) * 8)


class FakeCupy:
    """Hashable, like the cupy module (the daemon caches per-module lookups)."""

    def __init__(self) -> None:
        runtime = FakeRuntime()
        self.cuda = types.SimpleNamespace(
            runtime=runtime,
            Device=lambda ordinal: contextlib.nullcontext(),
            ExternalStream=lambda ptr: contextlib.nullcontext(),
            is_available=lambda: True,
        )
        self.asarray = np.asarray
        self.RawKernel = lambda source, name: FakeKernel(runtime)


def make_fake_cupy() -> FakeCupy:
    return FakeCupy()
