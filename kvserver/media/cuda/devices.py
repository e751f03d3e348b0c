"""Devices by UUID or PCI bus id: the engine's ordinal means nothing in the daemon's process.

CuPy reports a device's UUID through ``getDeviceProperties``, which hands the 16-byte
``cudaUUID_t`` to Python as a C string: it ends at the first zero byte, so some devices' UUIDs
arrive short (and one without a zero byte may run on into the next field: its first 16 bytes are
the UUID). Short ones are left out of the UUID table, and the PCI bus id the client sends as well
(``deviceGetPCIBusId`` is exact) finds those devices.
"""

from __future__ import annotations

import functools
import logging

from kvserver.errors import InvalidArgument
from kvserver.protocol.cuda_ipc import normalize_pci_bus_id, normalize_uuid, uuid_from_bytes

logger = logging.getLogger(__name__)

UUID_BYTES = 16


@functools.cache
def device_table(cupy) -> tuple[dict[str, int], dict[str, int]]:
    """(UUID -> ordinal, PCI bus id -> ordinal) for the devices the daemon sees."""
    rt = cupy.cuda.runtime
    by_uuid, by_pci = {}, {}
    for i in range(rt.getDeviceCount()):
        raw = rt.getDeviceProperties(i).get("uuid", b"")
        if isinstance(raw, bytes | bytearray) and len(raw) >= UUID_BYTES:
            by_uuid[uuid_from_bytes(bytes(raw[:UUID_BYTES]))] = i
        else:
            logger.info("device %d: CuPy gives no full UUID; it is found by PCI bus id", i)
        by_pci[normalize_pci_bus_id(rt.deviceGetPCIBusId(i))] = i
    return by_uuid, by_pci


def ordinal_for(cupy, device_uuid: str, pci_bus_id: str = "") -> int:
    """The daemon's ordinal of the engine's device: by UUID, else by PCI bus id."""
    uuid = normalize_uuid(device_uuid)
    pci = normalize_pci_bus_id(pci_bus_id)
    by_uuid, by_pci = device_table(cupy)
    if uuid in by_uuid:
        return by_uuid[uuid]
    if pci in by_pci:
        return by_pci[pci]
    raise InvalidArgument(
        f"device {uuid}{f' at {pci}' if pci else ''} is not visible to the daemon (it sees "
        f"{sorted(by_uuid) or 'no full UUIDs'} at {sorted(by_pci)}): give the daemon access to every "
        "GPU its engines use"
    )
