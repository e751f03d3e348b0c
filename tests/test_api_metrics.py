"""Prometheus metrics (--metrics-listen): a real daemon's /metrics endpoint, scraped over HTTP and
parsed, says what an engine did and agrees with the Stats RPC; off by default; bad addresses refused;
docs/metrics.md's curl line runs as written."""

from __future__ import annotations

import os
import re
import secrets
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import pytest
import torch
from daemon_proc import ADMIN, ADMIN_TOKEN, DaemonProcess
from light_engine import LightEngine
from prometheus_client.parser import text_string_to_metric_families

from kvclient import KVClient, KVLayout, ShmKVPool
from kvclient._transport.fd_socket import fd_socket_path, get_ticket
from kvserver.__main__ import main
from kvserver.config import ServerConfig, parse_metrics_listen
from kvserver.v1 import kvserver_pb2 as pb
from kvserver.v1 import kvserver_pb2_grpc as pb_grpc

REPO = Path(__file__).resolve().parents[1]
LAYOUT = KVLayout.mha(2, 8)
DTYPE = torch.float16
LAYERS = 4
PAGE = 16
POOL_TOKENS = 256
TOKEN_BYTES = LAYOUT.token_bytes(DTYPE) * LAYOUT.num_parts * LAYERS  # every layer and part


def scrape(port: int, host: str = "127.0.0.1", types: dict | None = None) -> dict[str, list]:
    """name -> samples [(sample name, labels, value)] of every family of /metrics (``types``, if
    given, gets name -> the family's type)."""
    with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=10) as resp:
        assert resp.status == 200
        text = resp.read().decode()
    families = list(text_string_to_metric_families(text))
    if types is not None:
        types.update({f.name: f.type for f in families})
    return {f.name: [(s.name, s.labels, s.value) for s in f.samples] for f in families}


def value(metrics: dict, sample: str, **labels: str) -> float:
    """The value of one sample (its full name, e.g. kvserver_cache_hits_total) matching ``labels``."""
    family = re.sub(r"(_total|_count|_sum|_bucket|_created)$", "", sample)
    samples = metrics.get(family, []) + (metrics.get(sample, []) if sample != family else [])
    found = [v for name, ls, v in samples
             if name == sample and all(ls.get(k) == want for k, want in labels.items())]
    assert len(found) == 1, f"{sample}{labels}: {found} in {metrics.get(family)}"
    return found[0]


def keys(n: int, salt: bytes = b"") -> list[bytes]:
    return [i.to_bytes(8, "little") + salt.ljust(8, b"\0") for i in range(n)]


def fill(pool: ShmKVPool, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for layer in pool.buffers:
        for buf in layer:
            buf.view(torch.uint8).copy_(torch.randint(0, 256, buf.view(torch.uint8).shape, generator=g))


def test_scrape_counts_what_the_engine_did_and_agrees_with_stats(daemon_factory):
    d = daemon_factory(metrics_listen="127.0.0.1:0", metrics_per_space=True, reclaim_grace=0.1,
                       admin_token=ADMIN_TOKEN)
    port = d.daemon.metrics.port
    assert port
    before = scrape(port)
    assert value(before, "kvserver_clients") == 0
    assert value(before, "kvserver_host_memory_bytes") == d.core.arena.capacity
    assert value(before, "kvserver_operation_duration_seconds_count", op="Write") == 0

    n = 64  # tokens: 4 pages
    with ShmKVPool(LAYOUT, DTYPE, LAYERS, POOL_TOKENS) as pool, KVClient(d.address) as client:
        fill(pool, 1)
        client.register(model="metrics-model", pool=pool, start_layer=0, end_layer=LAYERS,
                        num_layers=LAYERS, host_tokens=128, page_size=PAGE)
        host = client.alloc(n)
        dev = torch.arange(n)
        assert client.write(host_indices=host, device_indices=dev) == n * TOKEN_BYTES
        client.load(host_indices=host, device_indices=dev).wait()
        client.load(host_indices=host, device_indices=dev).wait()

        ks = keys(6)
        assert client.lookup(ks[:4]).pages == 0  # 4 misses
        put = client.put(ks[:4], torch.arange(4))
        assert put.stored == 4
        assert client.put(ks[:4], torch.arange(4)).present == 4  # dedup: nothing copied
        assert client.lookup(ks).pages == 4  # 4 hits, 2 misses
        got = client.get(ks[:4], torch.arange(4, 8))
        got.wait()
        assert got.pages() == 4

        m = scrape(port)
        stats = _admin_stats(d)  # the same numbers through Stats
        page_bytes = PAGE * TOKEN_BYTES
        expect = {"write": (1, n * TOKEN_BYTES), "load": (2, 2 * n * TOKEN_BYTES),
                  "put": (1, 4 * page_bytes), "get": (1, 4 * page_bytes)}
        for direction, (ops, nbytes) in expect.items():
            # The client takes the fast lane on a Unix socket (docs/lane.md): every transfer is "ring".
            assert value(m, "kvserver_transfers_total", direction=direction, lane="ring") == ops, direction
            assert value(m, "kvserver_transfer_bytes_total", direction=direction, lane="ring") == nbytes
            assert value(m, "kvserver_transfers_total", direction=direction, lane="grpc") == 0
        t = stats.transfers
        assert t.bytes_written == expect["write"][1] + expect["put"][1]
        assert t.bytes_loaded == expect["load"][1] + expect["get"][1]
        assert (t.write_ops, t.load_ops) == (2, 3)

        assert value(m, "kvserver_clients") == stats.num_clients == 1
        assert value(m, "kvserver_host_memory_bytes") == stats.capacity_bytes
        assert value(m, "kvserver_host_memory_reserved_bytes") == stats.reserved_bytes
        assert value(m, "kvserver_host_memory_room_bytes") == stats.room_bytes == 0
        assert value(m, "kvserver_host_memory_used_bytes") == stats.used_bytes == n * TOKEN_BYTES
        assert value(m, "kvserver_cache_slab_bytes") == stats.cache_bytes > 0
        assert value(m, "kvserver_copy_queue_depth") == 0
        assert value(m, "kvserver_copies_waiting", direction="load") == 0
        assert value(m, "kvserver_copies_waiting", direction="write") == 0
        assert value(m, "kvserver_reclaims_total") == stats.reclaimed_clients == 0
        tenant = f"uid:{os.getuid()}"
        assert value(m, "kvserver_client_memory_bytes", tenant=tenant,
                     model="metrics-model") == 128 * TOKEN_BYTES
        assert value(m, "kvserver_client_memory_used_bytes", tenant=tenant,
                     model="metrics-model") == n * TOKEN_BYTES

        (space,) = [s for s in stats.spaces if s.space.model == "metrics-model"]
        (tstat,) = [t for t in stats.tenants if t.tenant == tenant]
        labels = dict(tenant=tenant, model="metrics-model", layout="mha:2x8", dtype="float16",
                      page_size=str(PAGE), num_layers=str(LAYERS), tp_size="1", pp_size="1", weights="")
        c = space.counters
        assert (c.hits, c.misses, c.pages, c.dedup_pages) == (4, 6, 4, 4)
        assert value(m, "kvserver_cache_hits_total", **labels) == c.hits
        assert value(m, "kvserver_cache_misses_total", **labels) == c.misses
        assert value(m, "kvserver_cache_pages", **labels) == c.pages
        assert value(m, "kvserver_cache_bytes", **labels) == c.bytes == 4 * page_bytes
        assert value(m, "kvserver_cache_evictions_total", **labels) == c.evictions == 0
        assert value(m, "kvserver_cache_dedup_pages_total", **labels) == c.dedup_pages
        assert value(m, "kvserver_cache_dropped_pages_total", **labels) == c.dropped == 0
        assert value(m, "kvserver_tenant_cache_bytes", tenant=tenant) == c.bytes
        assert value(m, "kvserver_tenant_cache_pages", tenant=tenant) == c.pages
        quota = [v for _, ls, v in m.get("kvserver_tenant_quota_bytes", []) if ls.get("tenant") == tenant]
        assert quota == ([tstat.quota_bytes] if tstat.quota_bytes else [])  # no quota: no sample

        for op in ("Register", "Alloc", "Write", "Lookup", "Put"):
            assert value(m, "kvserver_operation_duration_seconds_count", op=op) >= 1, op
        assert value(m, "kvserver_operation_duration_seconds_count", op="Load") == 2
        assert value(m, "kvserver_operation_duration_seconds_count", op="Get") == 1
        assert value(m, "kvserver_operation_duration_seconds_sum", op="Load") > 0
        assert value(m, "kvserver_time_to_first_layer_seconds_count", op="Load") == 2
        assert value(m, "kvserver_time_to_first_layer_seconds_count", op="Get") == 1
        assert value(m, "kvserver_time_to_first_layer_seconds_bucket", op="Get", le="+Inf") == 1
        client.unregister()

    # Gone with its client: the gauges drop, the counters do not.
    after = scrape(port)
    assert value(after, "kvserver_clients") == 0
    assert value(after, "kvserver_host_memory_used_bytes") == 0
    for direction, (ops, nbytes) in expect.items():
        assert value(after, "kvserver_transfers_total", direction=direction, lane="ring") == ops
        assert value(after, "kvserver_transfer_bytes_total", direction=direction, lane="ring") == nbytes
    assert value(after, "kvserver_cache_hits_total", **labels) == 4  # the cache outlives its writer
    assert value(after, "kvserver_operation_duration_seconds_count", op="Unregister") == 1
    assert value(after, "kvserver_operation_duration_seconds_count", op="Stats") >= 1

    # An engine whose session drops is reclaimed: counted.
    eng = LightEngine(d.address, f"kvtest-metrics-{secrets.token_hex(4)}")
    try:
        assert value(scrape(port), "kvserver_clients") == 1
        eng.session.cancel()
        deadline = time.monotonic() + 10
        while value(m := scrape(port), "kvserver_reclaims_total") < 1:
            assert time.monotonic() < deadline, "the reclaim never showed"
            time.sleep(0.05)
        assert value(m, "kvserver_reclaims_total") == 1
        assert _admin_stats(d).reclaimed_clients == 1
    finally:
        eng.drop()


@pytest.mark.parametrize("op", ["load", "put"])
def test_copies_the_data_plane_runs_are_counted_in_flight(daemon_factory, op):
    """The copy queue gauges count the copy workers' copies, which the loop runs; an engine on its
    lane has nearly every copy run by the compiled data plane, and a daemon busy with nothing but
    those read as idle. kvserver_plane_copies_in_flight counts the plane's: its own (Loads) and
    those the loop plans for a call it was handed and the plane's thread runs at once (a Put
    larger than the plane's stash)."""
    d = daemon_factory(metrics_listen="127.0.0.1:0", host_memory=256 << 20)
    if d.core.plane is None:
        pytest.skip("the compiled data plane is not built")
    port = d.daemon.metrics.port
    layout, layers, tokens = KVLayout.mha(8, 128), 32, 512  # 128 KiB a token: 64 MiB a Load
    stop = threading.Event()
    seen: list[float] = []
    with ShmKVPool(layout, DTYPE, layers, tokens) as pool, KVClient(d.address) as client:
        client.register(model="metrics-model", pool=pool, start_layer=0, end_layer=layers,
                        num_layers=layers, host_tokens=tokens, page_size=PAGE)
        assert client.lane is not None
        host, dev = client.alloc(tokens), torch.arange(tokens)
        client.write(host_indices=host, device_indices=dev)
        alone = d.core.copier.alone_copies

        def loads() -> None:
            i = 0
            while not stop.is_set():
                if op == "load":
                    client.load(host_indices=host, device_indices=dev).wait()
                else:  # 32 pages of 2 MiB of new keys: 64 MiB, more than the plane's stash
                    client.put([f"k{i}-{j}".encode().ljust(16, b".") for j in range(32)], torch.arange(32))
                    i += 1

        t = threading.Thread(target=loads, daemon=True)
        t.start()
        try:
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and not any(seen):
                seen.append(value(scrape(port), "kvserver_plane_copies_in_flight"))
                time.sleep(0.01)
        finally:
            stop.set()
            t.join(30)
        assert any(seen), f"{len(seen)} scrapes while 64 MiB {op}s ran back to back read 0"
        assert op == "load" or d.core.copier.alone_copies > alone  # (the path the Puts took)
        assert value(scrape(port), "kvserver_plane_copies_in_flight") == 0
        client.unregister()


def test_the_event_loops_lag_is_a_histogram(daemon_factory):
    """kvserver_event_loop_lag_seconds: a timer due every 50 ms, observed as it runs late. Holding
    the loop 0.4 s shows as one observation past 0.25 s."""
    d = daemon_factory(metrics_listen="127.0.0.1:0")
    port = d.daemon.metrics.port
    types: dict[str, str] = {}
    time.sleep(0.3)
    before = scrape(port, types=types)
    assert types["kvserver_event_loop_lag_seconds"] == "histogram"
    assert value(before, "kvserver_event_loop_lag_seconds_count") >= 2
    slow_before = value(before, "kvserver_event_loop_lag_seconds_count") - value(
        before, "kvserver_event_loop_lag_seconds_bucket", le="0.25")
    d.run(lambda: time.sleep(0.4))  # on the daemon's loop
    time.sleep(0.2)
    after = scrape(port)
    slow = value(after, "kvserver_event_loop_lag_seconds_count") - value(
        after, "kvserver_event_loop_lag_seconds_bucket", le="0.25")
    assert slow - slow_before >= 1  # the 0.4 s hold (a busy machine may add others)
    assert value(after, "kvserver_event_loop_lag_seconds_sum") >= 0.3


def _admin_stats(d) -> pb.StatsResponse:
    """The Stats RPC as the admin sees it: every tenant's spaces."""
    with grpc.insecure_channel(d.address) as channel:
        return pb_grpc.KVServerStub(channel).Stats(pb.StatsRequest(), metadata=ADMIN, timeout=10)


def test_two_daemons_in_one_process_have_their_own_registries(daemon_factory):
    a = daemon_factory(metrics_listen="127.0.0.1:0", metrics_per_space=True, host_memory=64 << 20)
    b = daemon_factory(metrics_listen="127.0.0.1:0", metrics_per_space=True, host_memory=128 << 20)
    assert a.daemon.metrics.registry is not b.daemon.metrics.registry
    assert value(scrape(a.daemon.metrics.port), "kvserver_host_memory_bytes") == 64 << 20
    assert value(scrape(b.daemon.metrics.port), "kvserver_host_memory_bytes") == 128 << 20
    # A model name is the engine's: quotes, backslashes and newlines come back as they were sent.
    odd = 'od"d\\mo\ndel'
    with grpc.insecure_channel(a.address) as channel:
        stub = pb_grpc.KVServerStub(channel)
        opened = stub.OpenSpace(pb.OpenSpaceRequest(space=pb.KVSpace(
            model=odd, layout=pb.KVLayout(mha=pb.MHALayout(num_heads=2, head_dim=8)),
            dtype=pb.DTYPE_BFLOAT16, page_size=16, num_layers=2),
            peer_ticket=get_ticket(fd_socket_path(a.address), [])), timeout=10)
        # A space only opened adds no series; one that was asked something does.
        before = scrape(a.daemon.metrics.port).get("kvserver_cache_misses", [])
        assert not [ls for _, ls, _ in before if ls.get("model") == odd]
        stub.Lookup(pb.LookupRequest(space_id=opened.space_id, keys=b"k" * 16, key_bytes=16), timeout=10)
    m = scrape(a.daemon.metrics.port)
    assert value(m, "kvserver_cache_pages", model=odd, dtype="bfloat16") == 0
    assert value(m, "kvserver_cache_misses_total", model=odd, dtype="bfloat16") == 1
    port = a.daemon.metrics.port
    a.stop()  # the endpoint goes with its daemon
    with pytest.raises(urllib.error.URLError):
        scrape(port)


def _listening_tcp_inodes() -> set[str]:
    out = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        if os.path.exists(table):
            with open(table) as f:
                for line in f.readlines()[1:]:
                    cols = line.split()
                    if cols[3] == "0A":  # LISTEN
                        out.add(cols[9])
    return out


def test_by_default_no_series_names_a_tenant_or_a_model(daemon_factory):
    # Stats shows tenants and models only to the admin; /metrics has no token, so its per-tenant,
    # per-model and per-space series are opt-in (--metrics-per-space).
    d = daemon_factory(metrics_listen="127.0.0.1:0")
    pool = ShmKVPool(LAYOUT, DTYPE, LAYERS, POOL_TOKENS)
    try:
        with KVClient(d.address, timeout=10) as client:
            client.register(model="secret-model", pool=pool, start_layer=0, end_layer=LAYERS,
                            num_layers=LAYERS, host_tokens=0, page_size=PAGE)
            assert client.put(keys(2), [0, 1]).stored == 2
            types: dict = {}
            m = scrape(d.daemon.metrics.port, types=types)
            assert value(m, "kvserver_clients") == 1 and value(m, "kvserver_state_collected") == 1
            labels = {k for samples in m.values() for _, ls, _ in samples for k in ls}
            assert not labels & {"tenant", "model"}, labels
            assert types["kvserver_transfers"] == types["kvserver_transfer_bytes"] == "counter"
            assert types["kvserver_clients"] == "gauge"
            assert types["kvserver_operation_duration_seconds"] == "histogram"
            client.unregister()
    finally:
        pool.close()


def test_metrics_are_off_by_default(tmp_path):
    assert ServerConfig().metrics_listen is None
    d = DaemonProcess(str(tmp_path / "kv.sock"))
    try:
        assert d.stats().num_clients == 0  # serving
        fds = os.listdir(f"/proc/{d.pid}/fd")
        sockets = set()
        for fd in fds:
            try:
                link = os.readlink(f"/proc/{d.pid}/fd/{fd}")
            except OSError:
                continue
            if link.startswith("socket:["):
                sockets.add(link[len("socket:["):-1])
        assert not sockets & _listening_tcp_inodes(), "a daemon without --metrics-listen listens on TCP"
    finally:
        assert d.stop() == 0


@pytest.mark.parametrize("address", ["9400", "localhost", "127.0.0.1:99999", "host:port", "a b:1"])
def test_a_malformed_metrics_address_is_refused(address, tmp_path, capsys):
    with pytest.raises(ValueError, match="HOST:PORT"):
        ServerConfig(metrics_listen=address)
    assert main(["--socket", str(tmp_path / "kv.sock"), "--metrics-listen", address]) == 2
    err = capsys.readouterr().err
    assert "HOST:PORT" in err and repr(address) in err


def test_addresses_parse():
    assert parse_metrics_listen("127.0.0.1:9400") == ("127.0.0.1", 9400)
    assert parse_metrics_listen("[::1]:0") == ("::1", 0)
    assert parse_metrics_listen("0.0.0.0:9400") == ("0.0.0.0", 9400)
    with pytest.raises(ValueError, match="names no host"):  # every interface only when asked by name
        parse_metrics_listen(":9400")


def test_a_taken_metrics_port_stops_the_daemon(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVSERVER_")}
        env["KVSERVER_METRICS_LISTEN"] = f"127.0.0.1:{port}"
        res = subprocess.run([sys.executable, "-m", "kvserver", "--socket", str(tmp_path / "kv.sock")],
                             capture_output=True, text=True, timeout=60, env=env)
    assert res.returncode == 1
    assert f"cannot serve metrics on 127.0.0.1:{port}" in res.stderr


DOC_PORT = 9400


def _doc_blocks() -> dict[str, str]:
    """docs/metrics.md's bash blocks by first line."""
    text = (REPO / "docs" / "metrics.md").read_text()
    return {body.splitlines()[0]: body for lang, body in
            re.findall(r"^```(\w*)\n(.*?)^```", text, re.MULTILINE | re.DOTALL) if lang == "bash"}


def test_the_docs_curl_line_runs_as_written(tmp_path, default_socket_lock):
    blocks = _doc_blocks()
    start = blocks["kvserver --metrics-listen 127.0.0.1:9400"].strip()
    curl = blocks["curl -s http://127.0.0.1:9400/metrics | grep '^kvserver_clients'"].strip()
    with socket.socket() as s:
        if s.connect_ex(("127.0.0.1", DOC_PORT)) == 0:
            pytest.skip(f"port {DOC_PORT}, which docs/metrics.md uses, is taken")
    (tmp_path / "run").mkdir(mode=0o700)
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSERVER_")}
    bin_dir = Path(sys.executable).parent
    env.update(HOME=str(tmp_path), XDG_RUNTIME_DIR=str(tmp_path / "run"),
               PATH=f"{bin_dir}:{os.environ['PATH']}")
    if os.geteuid() == 0 and os.path.exists("/run/kvserver/kvserver.sock"):
        with socket.socket(socket.AF_UNIX) as s:
            if s.connect_ex("/run/kvserver/kvserver.sock") == 0:
                pytest.skip("a daemon already serves the default socket")
    log = open(tmp_path / "log", "wb")
    proc = subprocess.Popen(["bash", "-c", start], env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        while "metrics on http://127.0.0.1:9400/metrics" not in (tmp_path / "log").read_text():
            assert proc.poll() is None, (tmp_path / "log").read_text()
            assert time.monotonic() < deadline, (tmp_path / "log").read_text()
            time.sleep(0.05)
        res = subprocess.run(["bash", "-c", curl], env=env, capture_output=True, text=True, timeout=30)
        assert res.returncode == 0, res.stderr
        assert res.stdout.strip() == "kvserver_clients 0.0"
    finally:
        proc.terminate()
        assert proc.wait(timeout=30) == 0
        log.close()


def test_a_copy_that_ends_while_its_client_is_released_is_counted_in_stats(daemon_factory):
    """A 32 MiB Write of one layer on gRPC (a copy stops at a layer's end: this one, once begun, ends
    whole), its client unregistered while the copy runs: a Write answered OK is
    counted in Stats' daemon-wide transfers, as in /metrics. Before, the release folded the client's
    counters into the totals as soon as its copies ended, a loop turn before the Write's own task
    counted its bytes into the client that was gone: Stats stayed one Write short for good."""
    import threading

    d = daemon_factory(host_memory=128 << 20, metrics_listen="127.0.0.1:0")
    port = d.daemon.metrics.port
    layout, tokens, layers = KVLayout.mha(8, 128), 8192, 1
    counted = 0
    with ShmKVPool(layout, DTYPE, layers, tokens) as pool, grpc.insecure_channel(d.address) as ch:
        stub = pb_grpc.KVServerStub(ch)
        for _ in range(20):
            c = KVClient(d.address, lane="grpc", resilient=False)
            c.register(model="race", pool=pool, start_layer=0, end_layer=layers, num_layers=layers,
                       host_tokens=tokens, page_size=PAGE)
            host = c.alloc(tokens)
            client_id = c._core.registration.client_id
            out: dict = {}

            def write(c=c, host=host, out=out) -> None:
                try:
                    out["bytes"] = c.write(host_indices=host, device_indices=torch.arange(tokens))
                except Exception as exc:  # its client unregistered before it began
                    out["error"] = exc

            t = threading.Thread(target=write)
            t.start()
            deadline = time.monotonic() + 5
            while not d.run(lambda: d.core.copier.queued) and t.is_alive() and time.monotonic() < deadline:
                time.sleep(0.0005)
            stub.Unregister(pb.UnregisterRequest(client_id=client_id), timeout=10)
            t.join(10)
            c.close()
            counted += bool(out.get("bytes"))
            stats = stub.Stats(pb.StatsRequest(), timeout=10).transfers
            metrics = scrape(port)
            scraped = value(metrics, "kvserver_transfers_total", direction="write", lane="grpc")
            assert stats.write_ops == scraped == counted
            assert stats.bytes_written == counted * 32 << 20
            if counted >= 3:
                break
    assert counted >= 3, "no Write ended while its client was released"


def test_scrapes_of_a_held_loop_each_wait_one_scrape_timeout_at_most(daemon_factory, monkeypatch, caplog):
    """The loop held 3.5 s and three scrapes at once: each answers within one SCRAPE_TIMEOUT (here
    1 s), with kvserver_state_collected 0. Before, they queued on the collector's lock and each
    waited its own timeout in turn (1, 2 and 3 s; with two Prometheus servers and the default 5 s,
    one scrape past Prometheus's own 10 s timeout)."""
    import threading

    from kvserver.api import metrics as metrics_module

    monkeypatch.setattr(metrics_module, "SCRAPE_TIMEOUT", 1.0)
    d = daemon_factory(metrics_listen="127.0.0.1:0")
    port = d.daemon.metrics.port
    d.loop.call_soon_threadsafe(time.sleep, 3.5)
    time.sleep(0.1)
    took: dict[int, tuple[float, float]] = {}

    def one(i: int) -> None:
        t0 = time.monotonic()
        got = scrape(port)
        took[i] = (time.monotonic() - t0, value(got, "kvserver_state_collected"))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert sorted(v for _, v in took.values()) == [0, 0, 0], took
    assert max(s for s, _ in took.values()) < 1.8, took
    said = [r for r in caplog.records if "its loop did not answer" in r.getMessage()]
    assert len(said) == 1, [r.getMessage() for r in said]  # one snapshot given up on: said once
    time.sleep(2.6)  # the loop answers again: the next scrape reads it
    assert value(scrape(port), "kvserver_state_collected") == 1


def test_a_snapshot_that_fails_is_logged_with_why(daemon_factory, monkeypatch, caplog):
    """A reader of the daemon's state that raises: the scrape says kvserver_state_collected 0, and
    the daemon's log says why (before, only a snapshot still pending at its deadline was logged:
    one that failed was logged nowhere)."""
    import logging

    from kvserver.api import metrics as metrics_module

    d = daemon_factory(metrics_listen="127.0.0.1:0")
    port = d.daemon.metrics.port
    assert value(scrape(port), "kvserver_state_collected") == 1

    def broken(core):
        raise RuntimeError("a reader of the daemon's state failed")

    monkeypatch.setattr(metrics_module, "tier_stats", broken)
    with caplog.at_level(logging.WARNING, logger=metrics_module.__name__):
        assert value(scrape(port), "kvserver_state_collected") == 0
    failed = [r for r in caplog.records if "could not read the daemon's state" in r.getMessage()]
    assert failed and failed[0].exc_info, [r.getMessage() for r in caplog.records]
    assert "a reader of the daemon's state failed" in str(failed[0].exc_info[1])
