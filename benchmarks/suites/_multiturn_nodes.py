"""Two nodes behind a router that places each request at random: each of the two DP replicas on a
daemon of its own (two "nodes" on loopback), without and with the cluster tier (a Mooncake Store
master, both daemons with --cluster-master). Without it a replica finds only what its own node
computed; with it, a history computed on either node is a hit on both.

``cluster_available`` says whether Mooncake Store is installed here (the ``cluster`` extra); the
rows are left out of a run without it.
"""

from __future__ import annotations

import os
import tempfile
import time

from _multiturn_dp import CacheReplica, RemoteReplica, serve_dp
from _multiturn_router import EventRouter
from daemon_proc import DaemonProcess
from mooncake_master import MooncakeMaster, master_binary


def cluster_available() -> bool:
    try:
        import mooncake.store  # noqa: F401
    except ImportError:
        return False
    return master_binary() is not None


def _cluster(d: DaemonProcess):
    return next(t for t in d.stats().tiers if t.name == "cluster")


def serve_nodes(w, reqs, geom, dev_pages: int, keys, budget_mib: int, bar, *,
                cluster: bool, router: bool = False) -> tuple[list, dict]:
    """The dp2 trace with replica 0 on node A and replica 1 on node B, each node's daemon of
    ``budget_mib``; requests placed at random, or with ``router`` by a router that follows the
    nodes' KV events (``EventRouter``: to the node holding the longest prefix); ``cluster``: the
    daemons share a Mooncake Store cluster whose segments (as large as host memory, each) hold
    every history."""
    with tempfile.TemporaryDirectory(prefix="kv-multiturn-nodes-") as tmp:
        master = MooncakeMaster() if cluster else None
        nodes: list[DaemonProcess] = []
        remote = local = None
        try:
            for name in ("a", "b"):
                flags = (["--cluster-master", master.address, "--cluster-segment", f"{budget_mib}MiB"]
                         if master is not None else [])
                nodes.append(DaemonProcess(os.path.join(tmp, f"{name}.sock"), *flags,
                                           host_memory=f"{budget_mib}MiB"))
            if master is not None:
                deadline = time.monotonic() + 30
                while not all(_cluster(d).joined for d in nodes):
                    if time.monotonic() > deadline:
                        raise RuntimeError("the daemons did not join the cluster")
                    time.sleep(0.05)
            # Spawned: this process has gRPC channels and threads by now, which a fork does not survive.
            remote = RemoteReplica(nodes[1].address, geom, dev_pages, w.seed, spawn=True)
            local = CacheReplica(nodes[0].address, geom, dev_pages, w.seed)
            remote.wait_ready()
            place = None
            if router:
                events_router = EventRouter([d.address for d in nodes], geom)
                prompt_keys = lambda req: keys[req.client][: w.prompt_pages(req.round)]  # noqa: E731
                place = lambda req: events_router.place(prompt_keys(req), req.replica)  # noqa: E731
            records = serve_dp(w, reqs, [local, remote], dev_pages, keys, bar, place=place)
            ch = [local.checks(), remote.checks()]
            checks = {"pages_checked": sum(c[0] for c in ch), "pages_wrong": sum(c[1] for c in ch),
                      "pages_dropped": sum(c[2] for c in ch)}
            if router:
                checks["router_events"] = events_router.events
                checks["placed_off_the_trace"] = sum(r.replica != q.replica for r, q in zip(records, reqs,
                                                                                          strict=True))
                events_router.close()
            if master is not None:
                tiers = [_cluster(d) for d in nodes]
                checks.update(cluster_published_pages=sum(t.written_pages for t in tiers),
                              cluster_pulled_pages=sum(t.promoted_pages for t in tiers),
                              cluster_get_errors=sum(t.read_errors for t in tiers))
                if not checks["cluster_published_pages"]:
                    raise RuntimeError(f"nothing was stored in the cluster: {tiers}")
        finally:
            if local is not None:
                local.close()
            if remote is not None:
                remote.close()
            for d in nodes:
                d.stop()
            if master is not None:
                master.kill()
    return records, checks
