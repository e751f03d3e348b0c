"""The disk tier: pages the host cache evicts live on in a local file, checked when read back.

Owns: ``arena`` (the file's regions), ``io`` (page reads and writes, direct where the file system
and the page allow, and their checks), ``tier`` (``DiskTier``: the disk's own index, written behind
the host cache, read back on a hit) and ``counters``.
May import: ``store`` (the index it reuses), ``host`` (regions, kept directories), ``copies`` (the
compiled check), ``config`` and ``errors``; never gRPC, ``core`` or above.
"""

from kvserver.disk.tier import DiskTier

__all__ = ["DiskTier"]
