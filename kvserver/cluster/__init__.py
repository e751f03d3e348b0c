"""The cluster tier: the node-wide cache shared with other nodes' daemons through Mooncake Store.

Owns: ``tier`` (ClusterTier: written through, read on a miss, within deadlines, behind a
breaker), ``store`` (the Mooncake client), ``names`` (what a page is called in the cluster) and
``breaker``.
May import: ``store`` (the index's parts and keys), ``host``, ``config`` and ``errors``; never gRPC.
"""

from kvserver.cluster.store import MooncakeClient, check_installed, local_address
from kvserver.cluster.tier import ClusterCounters, ClusterTier

__all__ = ["ClusterCounters", "ClusterTier", "MooncakeClient", "check_installed", "local_address"]
