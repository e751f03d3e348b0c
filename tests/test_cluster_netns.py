"""The cluster tier across a network: two "nodes" in network namespaces joined by a veth pair, the
Mooncake master and daemon A on one, daemon B on the other, each finding its own address from the
route to the master. A prefix stored through A is a bit-exact hit through B, pulled across the veth;
docs/integrations.md's commands run as written on such two nodes."""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import time

import grpc
import numpy as np
import pytest
from cache_engine import CacheEngine, scattered
from daemon_proc import DaemonProcess
from mooncake_master import MooncakeMaster, needs_mooncake
from netns import two_hosts
from test_cluster_tier import cluster_stat, keys_of, published, store, wait_joined

from kvserver.v1 import kvserver_pb2 as pb
from kvserver.v1 import kvserver_pb2_grpc as pb_grpc


def test_a_prefix_crosses_the_veth_bit_exact(tmp_path):
    needs_mooncake()
    with two_hosts() as ((ns_a, ip_a), (ns_b, _)):
        master = MooncakeMaster(ip_a, netns=ns_a, ports=(15151, 15152, 15153))
        daemons: list[DaemonProcess] = []
        try:
            for name, ns in (("a", ns_a), ("b", ns_b)):
                d = DaemonProcess(str(tmp_path / f"{name}.sock"), "--cluster-master", master.address,
                                  "--cluster-metadata", master.metadata, host_memory="256MiB",
                                  prefix=("ip", "netns", "exec", ns))
                daemons.append(d)
                wait_joined(d)
            a, b = daemons
            keys = keys_of("veth", 200)
            with CacheEngine(a.address, pages=256) as ea:
                store(ea, keys)
                published(a, 200)
            with CacheEngine(b.address, pages=256) as eb:
                found = eb.lookup(keys)
                assert (found.pages, found.cluster_pages) == (200, 200)
                pages = scattered(np.random.default_rng(4), 200, 256)
                assert eb.get(keys, pages) == 200
                assert eb.wrong(keys, pages) == []
            assert cluster_stat(b).promoted_pages == 200
        finally:
            for d in daemons:
                d.kill()
            master.kill()


def test_the_documented_two_node_commands_run_as_written(tmp_path, default_socket_lock):
    """docs/integrations.md's master and daemon lines, as written, on two nodes whose veth ends are
    10.0.0.1 and 10.0.0.2: the master on the first, the daemon line on the second (the node's
    default socket), and a second daemon on the first with the same flags on a socket of its own;
    a prefix stored on 10.0.0.1 is a bit-exact hit on 10.0.0.2."""
    needs_mooncake()
    from test_docs_readme import ROOT_SOCKET, VENV_BIN, block, command

    if os.path.exists(ROOT_SOCKET):
        pytest.skip(f"something holds the node's default socket {ROOT_SOCKET}")
    master_line, daemon_line = [command(line) for line in block("cluster-nodes").splitlines()
                                if command(line)]
    assert master_line.endswith("&")
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("KVSERVER_")},
           "PATH": f"{VENV_BIN}:{os.environ['PATH']}", "KVSERVER_LOG_LEVEL": "WARNING"}
    procs: list[subprocess.Popen] = []
    with two_hosts("10.0.0") as ((ns_a, _), (ns_b, _)):
        try:
            procs.append(subprocess.Popen(["ip", "netns", "exec", ns_a, *shlex.split(master_line[:-1])],
                                          env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            procs.append(subprocess.Popen(["ip", "netns", "exec", ns_b, *shlex.split(daemon_line)], env=env,
                                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            other = str(tmp_path / "a.sock")
            procs.append(subprocess.Popen(["ip", "netns", "exec", ns_a, *shlex.split(daemon_line),
                                           "--socket", other], env=env,
                                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            for sock in (ROOT_SOCKET, other):
                _joined(f"unix://{sock}", procs)
            keys = keys_of("documented", 100)
            with CacheEngine(f"unix://{other}", pages=128) as ea:
                store(ea, keys)
                _until(lambda: _cluster(f"unix://{other}").written_pages >= 100)
            with CacheEngine(f"unix://{ROOT_SOCKET}", pages=128) as eb:
                assert eb.lookup(keys).cluster_pages == 100
                pages = scattered(np.random.default_rng(6), 100, 128)
                assert eb.get(keys, pages) == 100 and eb.wrong(keys, pages) == []
        finally:
            for p in reversed(procs):
                p.send_signal(signal.SIGTERM)
            for p in reversed(procs):
                try:
                    p.wait(15)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()


def _cluster(address: str):
    with grpc.insecure_channel(address) as ch:
        stats = pb_grpc.KVServerStub(ch).Stats(pb.StatsRequest(), timeout=5)
    return next(t for t in stats.tiers if t.name == "cluster")


def _joined(address: str, procs: list[subprocess.Popen], timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while True:
        assert all(p.poll() is None for p in procs), "a documented command exited"
        try:
            if _cluster(address).available:
                return
        except grpc.RpcError:
            pass
        assert time.monotonic() < deadline, f"{address} did not join the cluster"
        time.sleep(0.1)


def _until(pred, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "not reached in time"
        time.sleep(0.05)
