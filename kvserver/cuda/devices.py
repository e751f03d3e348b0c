"""Devices by UUID: the engine's ordinal means nothing in the daemon's process."""

from __future__ import annotations

import functools

from kvserver.cuda.handles import normalize_uuid, uuid_from_bytes
from kvserver.errors import InvalidArgument

CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM = 91  # cudaDevAttrCanUseHostPointerForRegisteredMem


@functools.cache
def uuid_to_ordinal(cupy) -> dict[str, int]:
    rt = cupy.cuda.runtime
    out = {}
    for i in range(rt.getDeviceCount()):
        props = rt.getDeviceProperties(i)
        if "uuid" in props:
            out[uuid_from_bytes(bytes(props["uuid"]))] = i
        else:  # CuPy builds without the field: torch reports the same UUID
            import torch

            out[normalize_uuid(str(torch.cuda.get_device_properties(i).uuid))] = i
    return out


def ordinal_for(cupy, device_uuid: str, pci_bus_id: str = "") -> int:
    uuid = normalize_uuid(device_uuid)
    table = uuid_to_ordinal(cupy)
    if uuid in table:
        return table[uuid]
    if pci_bus_id:
        try:
            return cupy.cuda.runtime.deviceGetByPCIBusId(pci_bus_id)
        except Exception:
            pass
    raise InvalidArgument(
        f"device {uuid} is not visible to the daemon (it sees {sorted(table)}): give the daemon "
        "access to every GPU its engines use"
    )
