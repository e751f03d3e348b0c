"""Older import path of the device pools: they now live in ``kvserver.media``."""

from kvserver.media import MAX_POOL_TOKENS, DevicePool, ShmAccess, ShmDevicePool, open_pool, wide_dtype

__all__ = ["MAX_POOL_TOKENS", "DevicePool", "ShmAccess", "ShmDevicePool", "open_pool", "wide_dtype"]
