"""The disk tier (--disk-cache): pages the host cache evicts are found on disk, counted by Lookup,
read back by a Get bit-exact; the disk has its own LRU and quotas; its index outlives the daemon; a
full, truncated or changed disk, or a directory another user owns, costs misses, never wrong KV
and never the daemon. Real daemons, real engines over shared memory, real files."""

from __future__ import annotations

import contextlib
import logging
import os
import time

import numpy as np
import pytest
from cache_engine import CacheEngine
from test_store_kept import small_tmpfs

MiB = 1 << 20
PAGE_BYTES = 32 * 1024  # CacheEngine's pages: 16 tokens x 256 B x K and V x 4 layers


def keys_of(prefix: str, n: int, start: int = 0) -> list[bytes]:
    return [f"{prefix}-{i:06d}".encode() for i in range(start, start + n)]


def store(eng: CacheEngine, keys: list[bytes], batch: int = 100, d=None) -> int:
    """Puts ``keys`` a batch at a time; with the daemon ``d``, each batch once the disk tier has
    written the last (a Put faster than the disk has its pages skipped past the write queue)."""
    stored = 0
    for i in range(0, len(keys), batch):
        chunk = keys[i : i + batch]
        pages = np.arange(len(chunk))
        eng.fill(chunk, pages)
        r = eng.put(chunk, pages)
        stored += r.stored + r.present
        if d is not None:
            written(d, 0)
    return stored


def written(d, n: int, timeout: float = 30) -> None:
    """Waits until the disk tier has written (or given up on) at least ``n`` pages."""
    deadline = time.monotonic() + timeout
    while True:
        c = d.run(lambda: d.core.disk.counters)
        done = c.written_pages + c.skipped_pages + c.write_errors
        if done >= n and d.run(lambda: d.core.disk.queued_bytes) == 0:
            return
        assert time.monotonic() < deadline, f"the disk tier wrote {done} of {n} pages"
        time.sleep(0.02)


def load_checked(eng: CacheEngine, keys: list[bytes], rng) -> int:
    """Loads the stored prefix of ``keys`` into scattered wiped device pages, 200 at a time;
    asserts every loaded byte is the key's; returns the pages loaded."""
    total = 0
    for i in range(0, len(keys), 200):
        chunk = keys[i : i + 200]
        n = eng.load_checked(chunk, rng)
        total += n
        if n < len(chunk):
            break
    return total


def tiers(eng: CacheEngine) -> dict:
    return {t.name: t for t in eng.client.stats(True).tiers}


@pytest.fixture
def disk_dir(tmp_path):
    path = str(tmp_path / "disk")
    yield path


def test_pages_evicted_from_host_memory_come_back_from_disk_bit_exact(daemon_factory, disk_dir):
    d = daemon_factory(host_memory=24 * MiB, disk_cache=disk_dir, disk_size=128 * MiB)
    rng = np.random.default_rng(1)
    keys = keys_of("evict", 1200)  # 37.5 MiB: far past host memory, well inside the disk
    with CacheEngine(d.address, pages=256) as eng:
        assert store(eng, keys, d=d) == 1200
        written(d, 1200)
        t = tiers(eng)
        assert t["host"].evicted_pages > 0 and t["host"].pages < 1200
        assert t["disk"].pages == 1200 and t["disk"].written_pages == 1200
        assert t["disk"].written_bytes == 1200 * PAGE_BYTES and t["disk"].direct_io
        found = eng.lookup(keys)
        assert found.pages == 1200 and found.disk_pages == 1200 - t["host"].pages
        assert found.host_pages == t["host"].pages
        # The oldest keys are on disk only: a Get reads them back, then loads them, bit-exact.
        assert load_checked(eng, keys, rng) == 1200
        t = tiers(eng)
        assert t["disk"].promoted_pages >= found.disk_pages and t["disk"].bad_checks == 0
        assert t["disk"].hits >= found.disk_pages and t["host"].hits >= found.host_pages


def test_a_lookup_counts_a_prefix_across_tiers_and_a_miss_ends_it(daemon_factory, disk_dir):
    d = daemon_factory(host_memory=24 * MiB, disk_cache=disk_dir, disk_size=128 * MiB)
    with CacheEngine(d.address, pages=256) as eng:
        old, new = keys_of("old", 600), keys_of("new", 300)
        store(eng, old, d=d)
        store(eng, new, d=d)
        written(d, 900)
        mixed = old[:50] + new[:50] + [b"neverstore"] + new[50:60]
        got = eng.lookup(mixed)
        assert got.pages == 100 and got.disk_pages == 50  # old ones on disk, new ones in memory
        pinned = eng.lookup(mixed, pin_ms=5000)
        assert pinned.pages == 100 and pinned.lease_id  # the host pages are pinned, not the disk's
        assert eng.client.release(pinned.lease_id) == 1


def test_the_disk_evicts_its_least_recently_used_pages(daemon_factory, disk_dir):
    d = daemon_factory(host_memory=24 * MiB, disk_cache=disk_dir, disk_size=40 * MiB)
    rng = np.random.default_rng(2)
    with CacheEngine(d.address, pages=256) as eng:
        a, b = keys_of("a", 500), keys_of("b", 300)
        store(eng, a, d=d)
        written(d, 500)
        store(eng, b, d=d)
        written(d, 800)
        assert load_checked(eng, a[:100], rng) == 100  # a[:100] read back: used now, on disk too
        c = keys_of("c", 600)
        store(eng, c, d=d)
        written(d, 1400)
        t = tiers(eng)
        assert t["disk"].evicted_pages > 0 and t["disk"].bytes <= 40 * MiB
        assert eng.lookup(a[:100]).pages == 100  # used recently: kept
        assert eng.lookup(c).pages == 600
        assert eng.lookup(a[100:]).pages == 0  # the least recently used went first
        assert load_checked(eng, a[:100] + c, rng) == 700


def test_a_tenants_disk_quota_is_its_share_of_host_memory(daemon_factory, disk_dir):
    d = daemon_factory(host_memory=32 * MiB, disk_cache=disk_dir, disk_size=128 * MiB, tenant_quota="50%")
    quota = d.run(lambda: d.core.disk.cache.tenants.quota_of(f"uid:{os.geteuid()}"))
    assert quota == 64 * MiB  # half of host memory: half of the disk
    with CacheEngine(d.address, pages=256) as eng:
        keys = keys_of("q", 3000)  # 94 MiB
        store(eng, keys, d=d)
        written(d, 3000)
        t = tiers(eng)
        assert t["disk"].slab_bytes <= 64 * MiB and t["disk"].evicted_pages > 0
        assert eng.lookup(keys[-500:]).pages == 500


def test_a_restarted_daemon_finds_its_disk_pages(daemon_factory, disk_dir):
    rng = np.random.default_rng(3)
    keys = keys_of("restart", 800)
    d = daemon_factory(host_memory=24 * MiB, disk_cache=disk_dir, disk_size=128 * MiB)
    with CacheEngine(d.address, pages=256) as eng:
        store(eng, keys, d=d)
        written(d, 800)
    d.stop()
    again = daemon_factory(host_memory=24 * MiB, disk_cache=disk_dir, disk_size=128 * MiB)
    # A scheduler's Lookup of the whole space, before any engine registered again: the disk's
    # parts answer for it (host memory has none yet).
    from cache_engine import DTYPE, LAYOUT, MODEL, PAGE

    from kvclient import CacheView

    with CacheView(again.address, model=MODEL, layout=LAYOUT, dtype=DTYPE, page_size=PAGE, num_layers=4,
                   timeout=5) as view:
        found = view.lookup(keys)
        assert (found.pages, found.disk_pages) == (800, 800)
    with CacheEngine(again.address, pages=256) as eng:
        t = tiers(eng)
        assert t["disk"].kept.adopted_pages == 800 and t["disk"].kept.torn_pages == 0
        found = eng.lookup(keys)
        assert found.pages == 800 and found.disk_pages == 800  # host memory started empty
        assert load_checked(eng, keys, rng) == 800


def test_other_weights_never_share_a_disk_page(daemon_factory, disk_dir):
    d = daemon_factory(host_memory=24 * MiB, disk_cache=disk_dir, disk_size=128 * MiB)
    keys = keys_of("w", 700)
    with CacheEngine(d.address, pages=256, weights="rev-a") as eng:
        store(eng, keys, d=d)
        written(d, 700)
        assert eng.lookup(keys).disk_pages > 0
    with CacheEngine(d.address, pages=256, weights="rev-b") as eng:
        assert eng.lookup(keys).pages == 0
        eng.wipe()
        assert eng.get(keys[:100], np.arange(100)) == 0 and eng.zero(np.arange(100))


def test_a_part_number_the_catalog_gives_another_part_never_serves_the_first_ones_pages(daemon_factory,
                                                                                        disk_dir):
    """A disk page's check is bound to what its part is (its space's key and its own), not to the
    part's number: records whose number the catalog now gives another part (a number given again
    after two power cuts lost a catalog line and then the reset of its records, or a changed
    line) are never served as that part's."""
    keys = keys_of("gid", 300)
    d = daemon_factory(host_memory=24 * MiB, disk_cache=disk_dir, disk_size=128 * MiB)
    with CacheEngine(d.address, pages=256, weights="rev-a") as eng:
        store(eng, keys, d=d)
        written(d, 300)
    d.stop()
    catalog = os.path.join(disk_dir, "catalog")
    with open(catalog) as f:
        text = f.read()
    assert text.count('"weights": "rev-a"') == 1
    with open(catalog, "w") as f:
        f.write(text.replace('"weights": "rev-a"', '"weights": "rev-b"'))
    again = daemon_factory(host_memory=24 * MiB, disk_cache=disk_dir, disk_size=128 * MiB)
    with CacheEngine(again.address, pages=256, weights="rev-b") as eng:
        eng.wipe()
        assert eng.get(keys[:100], np.arange(100)) == 0 and eng.zero(np.arange(100))
        t = tiers(eng)
        assert t["disk"].bad_checks >= 1 and t["disk"].promoted_pages == 0


def _evicted_to_disk(d, eng: CacheEngine, keys: list[bytes]) -> int:
    """Stores ``keys`` and more after them until the first keys are on disk only; returns how many
    of the first keys the disk alone holds."""
    store(eng, keys, d=d)
    store(eng, keys_of("filler", 700), d=d)
    written(d, len(keys) + 700)
    return eng.lookup(keys).disk_pages


def test_a_truncated_disk_file_costs_misses_never_wrong_kv(daemon_factory, disk_dir):
    d = daemon_factory(host_memory=24 * MiB, disk_cache=disk_dir, disk_size=128 * MiB)
    rng = np.random.default_rng(4)
    keys = keys_of("trunc", 300)
    with CacheEngine(d.address, pages=256) as eng:
        assert _evicted_to_disk(d, eng, keys) == 300
        os.truncate(os.path.join(disk_dir, "data"), 0)  # something else cut the file under the daemon
        assert load_checked(eng, keys, rng) == 0
        t = tiers(eng)
        assert t["disk"].read_errors > 0 and t["disk"].bad_checks == 0
        assert eng.lookup(keys).pages == 0  # the pages that could not be read are gone from the index
        # The daemon serves on: new pages are stored and loaded, from memory and from disk.
        more = keys_of("after", 100)
        assert store(eng, more, d=d) == 100
        assert load_checked(eng, more, rng) == 100


def test_changed_bytes_on_disk_fail_their_check_and_are_never_served(daemon_factory, disk_dir):
    d = daemon_factory(host_memory=24 * MiB, disk_cache=disk_dir, disk_size=128 * MiB)
    rng = np.random.default_rng(5)
    keys = keys_of("flip", 300)
    with CacheEngine(d.address, pages=256) as eng:
        assert _evicted_to_disk(d, eng, keys) == 300
        # Another process writes into the file where some of those pages lie (one byte each).
        ids = d.run(lambda: d.core.disk.cache.pages.find(
            next(iter(d.core.disk.cache._parts.values())).gid,
            __import__("kvserver.store", fromlist=["Keys"]).Keys.of(keys[100:])))
        offsets = d.run(lambda: d.core.disk.cache.pages.offset[ids].copy())
        fd = os.open(os.path.join(disk_dir, "data"), os.O_WRONLY)
        try:
            for off in offsets.tolist():
                os.pwrite(fd, b"\xff", off + 1000)
        finally:
            os.close(fd)
        os.posix_fadvise(os.open(os.path.join(disk_dir, "data"), os.O_RDONLY), 0, 0, os.POSIX_FADV_DONTNEED)
        assert load_checked(eng, keys, rng) == 100  # the first changed page ends the hit
        t = tiers(eng)
        assert t["disk"].bad_checks >= 1 and t["disk"].read_errors == 0
        assert eng.lookup(keys).pages == 100


def test_a_full_disk_costs_pages_never_the_daemon(daemon_factory, tmp_path):
    rng = np.random.default_rng(6)
    with small_tmpfs(tmp_path, "12m") as mnt:
        path = os.path.join(mnt, "disk")
        d = daemon_factory(host_memory=24 * MiB, disk_cache=path, disk_size=256 * MiB)  # more than it has
        with CacheEngine(d.address, pages=256) as eng:
            keys = keys_of("full", 1000)
            assert store(eng, keys, d=d) == 1000  # host memory takes every Put
            written(d, 1000)
            t = tiers(eng)
            # The file system refuses slabs past its 12 MiB: the disk holds what fits, its least
            # recently used pages evicted for newer ones, as a smaller disk would.
            assert 0 < t["disk"].pages < 1000 and t["disk"].slab_bytes <= 12 * MiB
            assert t["disk"].evicted_pages > 0 and t["disk"].write_errors == 0
            assert eng.lookup(keys[-t["disk"].pages :]).pages == t["disk"].pages
            n = eng.lookup(keys).pages
            assert load_checked(eng, keys, rng) == n
            assert store(eng, keys_of("more", 100), d=d) == 100
        d.stop()


def test_a_disk_directory_another_uid_owns_is_refused_and_the_daemon_serves(daemon_factory, tmp_path, caplog):
    if os.geteuid() != 0:
        pytest.skip("giving a directory to another uid needs root")
    path = str(tmp_path / "theirs")
    os.mkdir(path, 0o700)
    os.chown(path, 4321, 4321)
    with caplog.at_level(logging.ERROR, logger="kvserver.core.kvcore"):
        d = daemon_factory(host_memory=24 * MiB, disk_cache=path, disk_size=64 * MiB)
    assert any("no disk cache" in r.getMessage() and "uid 4321" in r.getMessage() for r in caplog.records)
    assert os.listdir(path) == []  # nothing was made there
    with CacheEngine(d.address, pages=64) as eng:
        assert [t.name for t in eng.client.stats(True).tiers] == ["host"]
        keys = keys_of("serve", 50)
        assert store(eng, keys) == 50
        assert load_checked(eng, keys, np.random.default_rng(7)) == 50


def test_the_daemon_flags_and_variables_name_the_disk(tmp_path, monkeypatch):
    from kvserver.__main__ import build_parser, config_from_args

    path = str(tmp_path / "d")
    cfg = config_from_args(build_parser().parse_args(["--disk-cache", path, "--disk-size", "3GiB"]))
    assert (cfg.disk_cache, cfg.disk_size) == (path, 3 << 30)
    monkeypatch.setenv("KVSERVER_DISK_CACHE", path)
    monkeypatch.setenv("KVSERVER_DISK_SIZE", "50%")
    cfg = config_from_args(build_parser().parse_args([]))
    st = os.statvfs(str(tmp_path))
    assert cfg.disk_cache == path and cfg.disk_size == st.f_blocks * st.f_frsize // 2
    monkeypatch.delenv("KVSERVER_DISK_CACHE")
    assert config_from_args(build_parser().parse_args([])).disk_cache is None
    with contextlib.suppress(SystemExit), pytest.raises(ValueError):
        config_from_args(build_parser().parse_args(["--disk-cache", path, "--disk-size", "1MiB"]))


def test_stats_and_metrics_count_each_tier_alike(daemon_factory, disk_dir):
    import socket as so

    from test_api_metrics import scrape, value

    with so.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    d = daemon_factory(host_memory=24 * MiB, disk_cache=disk_dir, disk_size=128 * MiB,
                       metrics_listen=f"127.0.0.1:{port}")
    rng = np.random.default_rng(8)
    with CacheEngine(d.address, pages=256) as eng:
        keys = keys_of("metrics", 900)
        store(eng, keys, d=d)
        written(d, 900)
        load_checked(eng, keys[:200], rng)
        t = tiers(eng)
        m = scrape(port)
    for name in ("host", "disk"):
        assert value(m, "kvserver_tier_pages", tier=name) == t[name].pages
        assert value(m, "kvserver_tier_bytes", tier=name) == t[name].bytes
        assert value(m, "kvserver_tier_capacity_bytes", tier=name) == t[name].capacity_bytes
        assert value(m, "kvserver_tier_hits_total", tier=name) == t[name].hits
        assert value(m, "kvserver_tier_evicted_pages_total", tier=name) == t[name].evicted_pages
    disk = t["disk"]
    assert disk.written_pages == 900 and disk.promoted_pages > 0 and t["host"].evicted_pages > 0
    assert value(m, "kvserver_disk_written_pages_total") == disk.written_pages == 900
    assert value(m, "kvserver_disk_written_bytes_total") == 900 * PAGE_BYTES
    assert value(m, "kvserver_disk_promoted_pages_total") == disk.promoted_pages
    assert value(m, "kvserver_disk_promoted_bytes_total") == disk.promoted_pages * PAGE_BYTES
    for sample in ("skipped_pages", "write_errors", "read_errors", "bad_checks"):
        assert value(m, f"kvserver_disk_{sample}_total") == 0
    assert value(m, "kvserver_disk_adopted_pages") == 0
