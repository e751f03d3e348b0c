"""Pages outlive their writer: an engine SIGKILLed and started again finds its old prefixes. Tenants
never share pages, even for equal keys (tenant tokens, and the uid of a process without one), and
each tenant is held under its quota (--tenant-quota, or its token's own)."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile

import grpc
import numpy as np
import pytest
from cache_engine import CacheEngine, prompt_keys, put_and_hang, replica, scattered
from checks import error_of
from daemon_proc import DaemonProcess

from kvclient import KVClientError

N = 32
PAGE_BYTES = 16 * 256 * 2 * 4
NOBODY = 65534


def recv(out, what: str):
    try:
        kind, payload = out.get(timeout=60)
    except queue.Empty:
        pytest.fail(f"no answer for {what}")
    assert kind != "error", payload
    return kind, payload


def test_killed_engine_restarted_hits_its_prefix_and_other_tenants_do_not(tmp_path) -> None:
    tokens_file = tmp_path / "tenants"
    tokens_file.write_text("other tok-other-0123456789\n")
    sock_dir = tempfile.mkdtemp(prefix="kvc-")
    os.chmod(sock_dir, 0o755)  # lets another uid reach the socket (group access below)
    d = DaemonProcess(os.path.join(sock_dir, "kv.sock"), "--tenant-tokens", str(tokens_file),
                      "--socket-group-access", host_memory="128MiB")
    ctx = mp.get_context("spawn")
    try:
        tokens = np.random.default_rng(0).integers(0, 50000, N * 16 + 7)
        out = ctx.Queue()
        writer = ctx.Process(target=put_and_hang, args=(d.address, tokens, out), daemon=True)
        writer.start()
        assert recv(out, "the first engine's Put") == ("put", (N, 0, 0))
        os.kill(writer.pid, signal.SIGKILL)
        writer.join(10)
        d.wait_for(lambda s: s.reclaimed_clients == 1 and s.num_clients == 0, timeout=10)
        (space,) = d.stats().spaces
        assert (space.counters.pages, space.counters.bytes) == (N, N * PAGE_BYTES), "pages outlive the writer"

        steps, out = ctx.Queue(), ctx.Queue()
        again = ctx.Process(target=replica, args=(d.address, tokens, 5, steps, out), daemon=True)
        again.start()
        try:
            assert recv(out, "the restarted engine") == ("ready", N)
            steps.put(("lookup",))
            assert recv(out, "lookup") == ("lookup", N)
            steps.put(("get",))
            kind, (got, wrong, rest_zero) = recv(out, "get")
            assert (got, wrong, rest_zero) == (N, [], True)
            steps.put(("stop",))
            recv(out, "stop")
        finally:
            again.join(30)
            if again.is_alive():
                again.kill()
        assert again.exitcode == 0

        keys = prompt_keys(tokens)
        with CacheEngine(d.address, tenant_token="tok-other-0123456789") as other:
            assert other.lookup(keys).pages == 0, "another tenant hit the same keys"
            assert all(s.tenant == "other" for s in other.client.stats().spaces)
            pages = scattered(np.random.default_rng(3), N, other.num_pages)
            other.wipe()
            assert other.get(keys, pages) == 0 and other.zero(pages)
            # Its own copy of the same keys is its own: stored again, not deduplicated.
            other.fill(keys, pages)
            assert other.put(keys, pages).stored == N
        tenants = {t.tenant: t.counters.pages for t in d.stats().tenants}
        assert tenants == {f"uid:{os.getuid()}": N, "other": N}, tenants
        code, _ = error_of(lambda: CacheEngine(d.address, tenant_token="tok-unknown-0123456789"))
        assert code == grpc.StatusCode.UNAUTHENTICATED

        if os.geteuid() == 0:  # another uid, without a tenant token: its own tenant
            got = lookup_as(NOBODY, d.socket, keys)
            assert got == {"uid": NOBODY, "tenant": f"uid:{NOBODY}", "pages": 0}, got
            # The control: the same lookup from this uid hits.
            assert lookup_as(os.getuid(), d.socket, keys)["pages"] == N
    finally:
        d.stop()
        shutil.rmtree(sock_dir, ignore_errors=True)


def lookup_as(uid: int, socket: str, keys: list[bytes]) -> dict:
    here = os.path.join(os.path.dirname(__file__), "cache_engine.py")
    res = subprocess.run([sys.executable, here, str(uid), socket, b"".join(keys).hex()],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


def test_quotas_hold(tmp_path) -> None:
    tokens_file = tmp_path / "tenants"
    small, plain = "tok-small-0123456789", "tok-plain-0123456789"  # tokens are at least 16 characters
    tokens_file.write_text(f"# name token [quota]\nsmall {small} 1MiB\nplain {plain}\n")
    d = DaemonProcess(str(tmp_path / "kv.sock"), "--tenant-tokens", str(tokens_file),
                      "--tenant-quota", "2MiB", host_memory="128MiB")
    try:
        rng = np.random.default_rng(4)
        keys = prompt_keys(rng.integers(0, 50000, 100 * 16))
        want = {f"uid:{os.getuid()}": (None, 64), "small": (small, 32), "plain": (plain, 64)}
        for tenant, (token, fits) in want.items():
            with CacheEngine(d.address, tenant_token=token, pages=100) as eng:
                pages = np.arange(100)
                eng.fill(keys, pages)
                r = eng.put(keys, pages)
                assert (r.stored, r.dropped) == (fits, 100 - fits), (tenant, r)
                assert eng.lookup(keys).pages == fits
                # More pages evict the tenant's own least recently used ones, never exceed the quota.
                more = prompt_keys(rng.integers(0, 50000, 16 * 16))
                eng.fill(more, pages[:16])
                assert eng.put(more, pages[:16]).stored == 16
                assert eng.lookup(keys).pages == fits - 16, "the prefix loses its end"
                own = eng.client.stats().tenants
                assert [t.tenant for t in own] == [tenant], "a tenant sees only its own totals"
                assert own[0].counters.bytes == fits * PAGE_BYTES
                assert own[0].quota_bytes == fits * PAGE_BYTES
        stats = d.stats()
        assert {t.tenant: t.counters.bytes for t in stats.tenants} == {
            t: fits * PAGE_BYTES for t, (_, fits) in want.items()}
        assert stats.cache_bytes <= stats.capacity_bytes
        with pytest.raises(KVClientError):
            CacheEngine(d.address, tenant_token="tok-nobody-has-0123456789")
    finally:
        d.stop()
