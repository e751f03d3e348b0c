"""A host cache kept in files (--host-memory-dir): what a daemon killed with SIGKILL, or stopped,
leaves is adopted by the next one, bit-exact and nothing torn; files it cannot trust are started
over or refused, and the daemon serves either way.

The first daemon of each test is a forked child that is SIGKILLed (or kills itself): the same
end as ``kill -9``, with the writes it made in its mappings and nothing else."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
import signal
import subprocess
import sys

import numpy as np
import pytest

from kvserver.core.kvcore import KVCore
from kvserver.disk.arena import DiskArena
from kvserver.errors import NoCapacity
from kvserver.host.kept import KeptDir
from kvserver.host.regions import aligned_capacity
from kvserver.protocol.layout import KVLayout, dtype_named
from kvserver.store.keep import kept_shape
from kvserver.store.keys import Keys
from kvserver.store.spaces import PartKey, SpaceKey

MB = 1 << 20
LAYOUT = KVLayout.mha(2, 64)
PAGE_BYTES = 16 * 256 * 2 * 4  # 16 tokens of 256 B per part, K and V, 4 layers: 32 KiB


@pytest.fixture
def kept_dir():
    path = f"/dev/shm/kvserver-test-kept-{os.getpid()}-{os.urandom(3).hex()}"
    yield path
    shutil.rmtree(path, ignore_errors=True)


def space(weights: str = "", tenant: str = "t") -> SpaceKey:
    return SpaceKey(tenant, "m", LAYOUT, dtype_named("float16"), 16, 4, 1, 1, weights)


def part_of(core: KVCore, weights: str = "", page_bytes: int = PAGE_BYTES, tenant: str = "t"):
    c = core.cache
    return c.part(c.space(space(weights, tenant)), PartKey(0, 0, 0, 4, page_bytes))


def content(key: bytes, n: int) -> np.ndarray:
    seed = int.from_bytes(key[:8].ljust(8, b"\0"), "little")
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def keys_of(prefix: bytes, n: int) -> list[bytes]:
    return [prefix + i.to_bytes(4, "little") for i in range(n)]


def put(core: KVCore, part, keys: list[bytes], ok: bool = True):
    """Stores ``keys`` with their content (``ok``: the copy completes); returns the plan."""
    plan = core.cache.prepare_put(part, keys)
    arena = core.arena.view(np.uint8)
    for pos, off in zip(plan.positions.tolist(), plan.offsets.tolist(), strict=True):
        arena[off : off + part.key.page_bytes] = content(keys[pos], part.key.page_bytes)
    if ok is not None:
        core.cache.complete_put(plan, ok)
    return plan


def found(core: KVCore, part, keys: list[bytes]) -> tuple[int, bool]:
    """How many leading keys hit, and whether their bytes are exactly what was stored."""
    plan = core.cache.prepare_get(part, keys)
    arena = core.arena.view(np.uint8)
    exact = all(np.array_equal(arena[off : off + part.key.page_bytes], content(k, part.key.page_bytes))
                for k, off in zip(keys, plan.offsets.tolist(), strict=False))
    core.cache.complete_get(plan, True)
    return plan.pages, exact


def _killed_after(body, args) -> None:
    body(*args)
    os.kill(os.getpid(), signal.SIGKILL)


def in_child(body, *args) -> None:
    """Runs ``body(*args)`` (a module-level function) in a new process that is then SIGKILLed: the
    files keep what it wrote. Spawned, not forked: a fork of this process, whose threads (copy
    workers, gRPC) may hold locks, can hang."""
    import multiprocessing as mp

    proc = mp.get_context("spawn").Process(target=_killed_after, args=(body, args))
    proc.start()
    proc.join(120)
    if proc.is_alive():
        proc.kill()
        proc.join(10)
    assert proc.exitcode == -signal.SIGKILL, f"child ended with {proc.exitcode}"


# ---- the first daemons' lives (run in a child that is then killed) -------------------------------


def store(kept_dir: str, keys: list[bytes], part_kw: dict | None = None) -> None:
    core = KVCore(64 * MB, host_memory_dir=kept_dir)
    part = part_of(core, **(part_kw or {}))
    if part.key.page_bytes == PAGE_BYTES:
        put(core, part, keys)
    else:  # pages that fill a slab each 8 keys: one Put a slab
        for i in range(0, len(keys), 8):
            put(core, part, keys[i : i + 8])


def store_torn_and_failed(kept_dir: str, stored, failed, torn) -> None:
    core = KVCore(64 * MB, host_memory_dir=kept_dir)
    part = part_of(core)
    put(core, part, stored)
    put(core, part, failed, ok=False)  # a copy that failed: its pages were freed
    put(core, part, torn, ok=None)  # bytes written, never committed: killed in the middle


def store_hot_then_old(kept_dir: str, page: int, hot, old) -> None:
    core = KVCore(22 * MB, host_memory_dir=kept_dir)
    part = part_of(core, page_bytes=page)
    put(core, part, hot)
    put(core, part, old)
    assert found(core, part, hot)[0] == 8  # hot is now the more recently used


def grow_killed(kept_dir: str, confirmed, field: str) -> None:
    core = KVCore(64 * MB, host_memory_dir=kept_dir)
    part = part_of(core)
    put(core, part, keys_of(b"x", 512), ok=False)  # a failed Put over two slabs: both released
    put(core, part, confirmed)  # a new slab takes the ids of one of them
    p = core.cache.pages
    real = getattr(p, field)

    class KilledOnWrite:
        def __getitem__(self, i):
            return real[i]

        def __setitem__(self, i, v):
            os.kill(os.getpid(), signal.SIGKILL)

    setattr(p, field, KilledOnWrite())
    put(core, part, keys_of(b"B", 256))  # the next slab's grow is killed midway


def store_then_empty_spaces(kept_dir: str, keys) -> None:
    core = KVCore(64 * MB, host_memory_dir=kept_dir)
    put(core, part_of(core), keys)
    for i in range(300):  # spaces opened over the daemon's life, all empty
        part_of(core, weights=f"w{i}")


def store_in_a_space_made_again(kept_dir: str, keys) -> None:
    import gc

    core = KVCore(64 * MB, host_memory_dir=kept_dir)
    part_of(core, weights="S")  # empty: dropped once the tenant has too many spaces
    for i in range(256):
        part_of(core, weights=f"w{i}")
    gc.collect()
    put(core, part_of(core, weights="S"), keys)  # the same part again, under a new number


def store_across_spaces_made_without_end(kept_dir: str, keys) -> None:
    import gc

    from kvserver.store import cache as cache_module

    cache_module.CATALOG_SLACK = 16
    core = KVCore(64 * MB, host_memory_dir=kept_dir)
    put(core, part_of(core), keys)
    held = part_of(core, weights="H")  # empty: dropped with the others, but held
    most = 0
    for i in range(1500):  # a new name each time (an adapter, new weights): dropped while empty
        part_of(core, weights=f"w{i}")
        if i % 100 == 99:
            gc.collect()
            with open(os.path.join(kept_dir, "catalog")) as f:
                most = max(most, len(f.read().splitlines()))
    # Twice what a compaction kept, and the slack: 258 parts held, and up to the 100 of spaces
    # dropped since the last collection (not yet freed: a compaction keeps their lines).
    assert most <= 2 * (258 + 100) + 16 + 1, f"the catalog reached {most} lines for at most 358 parts"
    keep, compactions = core.cache.keep, []
    compact = keep.compact
    keep.compact = lambda parts: (compactions.append(1), compact(parts))
    gc.disable()  # dropped spaces (a cycle with their parts) stay alive, as between collections
    try:
        for i in range(1500):
            part_of(core, weights=f"v{i}")
    finally:
        gc.enable()
    # Not a compaction at every new part (each writes the whole file on the event loop).
    assert len(compactions) <= 20, f"{len(compactions)} compactions in 1500 new parts"
    put(core, held, keys_of(b"H", 10))  # under the number its line kept


def overflowing_slab_record(kept_dir: str, big: int) -> None:
    from kvserver.store.pages import COMMITTED, UNUSED

    core = KVCore(64 * MB, host_memory_dir=kept_dir)
    part = part_of(core)
    put(core, part, keys_of(b"A", 4))
    huge = core.cache.part(core.cache.space(space("big")), PartKey(0, 0, 0, 4, big))
    p, k = core.cache.pages, core.cache.keep
    sid = int(p.slab[0])
    r = k.slabs[sid : sid + 1]
    ids = core.cache.slabs.slabs[sid].pages
    p.state[ids] = UNUSED
    a, b = int(ids[0]), int(ids[1])
    r["pages"], r["page_bytes"] = 2, big  # 2 * 2**62 wraps around in int64
    p.offset[a], p.offset[b] = int(r["offset"][0]), int(r["offset"][0]) + big
    p.state[[a, b]] = COMMITTED
    p.index.owner[[a, b]] = huge.gid


def fail_adoption_then_die(kept_dir: str) -> None:
    """Fails to adopt, and is killed before it starts the files over."""
    from kvserver.host.kept import KeptDir
    from kvserver.store import keep as keep_module

    def failing(cache, keep, rec):
        raise RuntimeError("adoption failed")

    keep_module._adopt = failing
    KeptDir.start_over = lambda self, reason: os.kill(os.getpid(), signal.SIGKILL)
    KVCore(64 * MB, host_memory_dir=kept_dir)


def test_a_killed_daemons_pages_are_adopted_bit_exact_and_torn_ones_never(kept_dir):
    stored, torn, failed = keys_of(b"ok", 100), keys_of(b"torn", 5), keys_of(b"fail", 5)

    in_child(store_torn_and_failed, kept_dir, stored, failed, torn)
    core = KVCore(64 * MB, host_memory_dir=kept_dir)
    rec = core.recovery
    assert rec.reason == "" and rec.adopted_pages == 100 and rec.adopted_bytes == 100 * PAGE_BYTES
    assert rec.torn == 5 and rec.dropped == 0
    part = part_of(core)
    assert found(core, part, stored) == (100, True)
    assert found(core, part, torn)[0] == 0 and found(core, part, failed)[0] == 0
    space_stats, tenants = core.cache.stats()
    assert space_stats[0].counters.pages == 100 and tenants[0].counters.bytes == 100 * PAGE_BYTES
    # What was torn is stored again, and the cache goes on as any other.
    assert put(core, part, torn).positions.size == 5
    assert found(core, part, stored + torn) == (105, True)


def test_keys_of_up_to_32_bytes_come_back_whole_after_a_kill_and_wider_ones_as_digests(kept_dir):
    """SGLang's and vLLM's 32-byte keys are kept whole in the index's files: after a kill the
    adopted pages are found by them and still name them (what KV events report); a 48-byte key is
    kept as its digest: found, but its bytes are not kept."""
    k32, k48 = keys_of(b"x" * 28, 20), keys_of(b"y" * 44, 20)

    in_child(store, kept_dir, k32 + k48)
    core = KVCore(64 * MB, host_memory_dir=kept_dir)
    assert core.recovery.adopted_pages == 40 and core.recovery.dropped == 0
    part = part_of(core)
    assert found(core, part, k32) == (20, True) and found(core, part, k48) == (20, True)
    ids = core.cache.pages.find(part.gid, Keys.of(k32 + k48))
    assert (ids >= 0).all()
    assert core.cache.pages.keys_of(ids).as_bytes() == k32 + [None] * 20


def test_every_kept_table_has_its_memory_for_every_id_handed_out(kept_dir):
    """The files' memory is taken ahead for the ids handed out (a write into a hole of a full
    tmpfs is a SIGBUS): every kept table, a key's four index words included, has it."""
    core = KVCore(64 * MB, host_memory_dir=kept_dir)
    put(core, part_of(core), keys_of(b"a" * 28, 10))
    pages = core.cache.pages
    tables = [(f"pages.{n}", getattr(pages, n)) for n in pages.kept_names]
    tables += [(f"index.{n}", getattr(pages.index, n)) for n in ("words", "lens", "owner")]
    assert 0 < pages.high <= pages._allocated
    for name, table in tables:
        per_id = table.nbytes // len(table)
        taken = os.stat(os.path.join(kept_dir, name)).st_blocks * 512  # fallocated, written or not
        assert taken >= pages._allocated * per_id, name
    asyncio.run(core.close())


def test_a_stopped_daemon_keeps_its_cache_and_the_next_adopts_it_again(kept_dir):
    keys = keys_of(b"k", 50)
    core = KVCore(64 * MB, host_memory_dir=kept_dir)
    put(core, part_of(core), keys)
    asyncio.run(core.close())
    for _ in range(2):  # adopted, stopped, adopted again
        core = KVCore(64 * MB, host_memory_dir=kept_dir)
        assert core.recovery.adopted_pages == 50
        assert found(core, part_of(core), keys) == (50, True)
        asyncio.run(core.close())


def test_recency_survives_the_restart_and_eviction_takes_the_least_recently_used(kept_dir):
    page = 1 * MB  # 8 pages a slab of 8 MiB; 22 MiB hold two such slabs, not three
    old, hot = keys_of(b"old", 8), keys_of(b"hot", 8)

    in_child(store_hot_then_old, kept_dir, page, hot, old)
    core = KVCore(22 * MB, host_memory_dir=kept_dir)
    assert core.recovery.adopted_pages == 16
    part = part_of(core, page_bytes=page)
    new = keys_of(b"new", 8)
    plan = put(core, part, new)
    assert plan.positions.size == 8 and plan.dropped == 0
    assert found(core, part, hot) == (8, True), "the recently used pages were evicted"
    assert found(core, part, old)[0] == 0
    assert found(core, part, new) == (8, True)


def test_other_weights_never_share_a_kept_page(kept_dir):
    keys = keys_of(b"w", 10)

    in_child(store, kept_dir, keys, {"weights": "rev-a"})
    core = KVCore(64 * MB, host_memory_dir=kept_dir)
    assert found(core, part_of(core, weights="rev-b"), keys)[0] == 0
    assert found(core, part_of(core, weights="rev-a"), keys) == (10, True)


def test_tenants_and_quotas_hold_for_adopted_pages(kept_dir):
    keys = keys_of(b"q", 40)

    in_child(store, kept_dir, keys, {"tenant": "alice"})
    core = KVCore(64 * MB, host_memory_dir=kept_dir, tenant_quotas={"alice": 16 * MB})
    assert found(core, part_of(core, tenant="bob"), keys)[0] == 0
    alice = part_of(core, tenant="alice")
    assert found(core, alice, keys) == (40, True)
    # Past her quota, alice's Puts evict her own pages: she never holds more than it.
    put(core, alice, keys_of(b"more", 1000))
    held = core.cache.slabs.held(core.cache.tenants.get("alice").tid, 16 * MB)
    assert 8 * MB < held <= 16 * MB
    asyncio.run(core.close())
    # Adopted under a smaller quota: her least recently used slabs go at once.
    core = KVCore(64 * MB, host_memory_dir=kept_dir, tenant_quotas={"alice": 9 * MB})
    assert core.recovery.evicted > 0
    assert core.cache.slabs.held(core.cache.tenants.get("alice").tid, 9 * MB) <= 9 * MB


def test_files_of_another_format_or_shape_start_empty_and_say_why(kept_dir, caplog):
    keys = keys_of(b"f", 10)

    in_child(store, kept_dir, keys)
    header = os.path.join(kept_dir, "format.json")
    with open(header) as f:
        shape = json.load(f)
    with open(header, "w") as f:
        json.dump({**shape, "format": 99}, f)
    with caplog.at_level(logging.WARNING, logger="kvserver.core.kvcore"):
        core = KVCore(64 * MB, host_memory_dir=kept_dir)
    assert "format 99" in core.recovery.reason and core.recovery.adopted_pages == 0
    assert "starts empty" in caplog.text and "format 99" in caplog.text
    assert found(core, part_of(core), keys)[0] == 0
    put(core, part_of(core), keys)
    asyncio.run(core.close())
    # Another --host-memory: the tables have another shape.
    core = KVCore(32 * MB, host_memory_dir=kept_dir)
    assert "capacity" in core.recovery.reason and core.recovery.adopted_pages == 0
    asyncio.run(core.close())
    core = KVCore(32 * MB, host_memory_dir=kept_dir)  # and what it wrote is the format from now on
    assert core.recovery.reason == ""


def test_a_header_or_a_catalog_line_nested_past_the_parsers_depth_is_not_read(kept_dir, caplog):
    """JSON nested deeper than the parser goes raised RecursionError, which only ValueError was
    caught around: the daemon stopped at start instead of starting empty (a header) or dropping
    the line's pages (a catalog line)."""
    keys = keys_of(b"A", 10)
    in_child(store, kept_dir, keys)
    with open(os.path.join(kept_dir, "catalog"), "a") as f:
        f.write("[" * 100_000 + "\n")
    core = KVCore(64 * MB, host_memory_dir=kept_dir)
    assert core.recovery.reason == "" and core.recovery.adopted_pages == 10
    asyncio.run(core.close())
    with open(os.path.join(kept_dir, "format.json"), "w") as f:
        f.write("[" * 100_000)
    with caplog.at_level(logging.WARNING):
        core = KVCore(64 * MB, host_memory_dir=kept_dir)
    assert "cannot be read" in core.recovery.reason and core.recovery.adopted_pages == 0
    assert found(core, part_of(core), keys) == (0, True)  # and it serves


def test_the_files_of_an_earlier_format_are_removed_with_it(kept_dir):
    """A directory of format 1 (a key in two word files, index.w0 and index.w1) is not adopted, and
    the files this format no longer maps are removed: their memory goes back to tmpfs."""
    in_child(store, kept_dir, keys_of(b"f", 10))
    header = os.path.join(kept_dir, "format.json")
    with open(header) as f:
        shape = json.load(f)
    with open(header, "w") as f:
        json.dump({**shape, "format": 1}, f)
    for name in ("index.w0", "index.w1"):
        with open(os.path.join(kept_dir, name), "wb") as f:
            f.write(os.urandom(1 << 16))
    core = KVCore(64 * MB, host_memory_dir=kept_dir)
    assert "format 1" in core.recovery.reason and core.recovery.adopted_pages == 0
    assert not {"index.w0", "index.w1"} & set(os.listdir(kept_dir))
    assert "index.words" in os.listdir(kept_dir)
    asyncio.run(core.close())


def test_a_truncated_file_is_started_over_and_the_daemon_serves(kept_dir, caplog):
    keys = keys_of(b"t", 10)

    in_child(store, kept_dir, keys)
    os.truncate(os.path.join(kept_dir, "pages.state"), 4096)
    with caplog.at_level(logging.WARNING, logger="kvserver.core.kvcore"):
        core = KVCore(64 * MB, host_memory_dir=kept_dir)
    assert "starting it over" in caplog.text
    assert core.recovery.adopted_pages == 0 and "changed by something other" in core.recovery.reason
    part = part_of(core)
    assert found(core, part, keys)[0] == 0
    put(core, part, keys)
    assert found(core, part, keys) == (10, True)


def test_records_that_disagree_are_dropped_and_the_rest_adopted(kept_dir):
    a, b = keys_of(b"a", 8), keys_of(b"b", 8)
    page = 1 * MB

    in_child(store, kept_dir, a + b, {"page_bytes": page})  # two slabs of 8 pages
    slabs = np.memmap(os.path.join(kept_dir, "slabs"), dtype=np.dtype(
        [("offset", "<i8"), ("nbytes", "<i8"), ("page_bytes", "<i8"), ("pages", "<i4"), ("live", "<i4")]))
    live = np.flatnonzero(slabs["live"] == 1)
    assert len(live) == 2
    first_slab = live[np.argmax(slabs["offset"][live])]  # slabs are taken from the top: a's
    slabs["offset"][first_slab] += 4096  # no longer aligned: its pages cannot be trusted
    slabs.flush()
    del slabs
    core = KVCore(64 * MB, host_memory_dir=kept_dir)
    assert core.recovery.adopted_pages == 8 and core.recovery.dropped == 8
    part = part_of(core, page_bytes=page)
    assert found(core, part, a)[0] == 0
    assert found(core, part, b) == (8, True)


def test_an_entry_whose_words_run_past_its_key_is_not_adopted(kept_dir):
    """Every key the index files is zero past its bytes (or past its digest, for a key over 32
    bytes): an entry in the files that is not was written by something else, and its page is
    dropped; the rest are adopted."""
    short, k32, k48 = keys_of(b"s", 4), keys_of(b"x" * 28, 4), keys_of(b"y" * 44, 4)

    in_child(store, kept_dir, short + k32 + k48)
    words = np.memmap(os.path.join(kept_dir, "index.words"), dtype=np.uint8, mode="r+")
    lens = np.memmap(os.path.join(kept_dir, "index.lens"), dtype=np.uint8, mode="r")
    for length, byte in ((5, 5), (48, 16)):  # a short key's padding; a 48-byte key past its digest
        entry = int(np.flatnonzero(lens == length)[0])
        words[entry * 32 + byte] = 1
    words.flush()
    del words, lens
    core = KVCore(64 * MB, host_memory_dir=kept_dir)
    assert core.recovery.adopted_pages == 10 and core.recovery.dropped == 2
    part = part_of(core)
    assert found(core, part, k32) == (4, True)
    assert sum(found(core, part, [k])[0] for k in short + k48) == 6


@pytest.mark.skipif(os.geteuid() != 0, reason="changing a directory's owner needs root")
def test_a_directory_another_uid_controls_is_never_adopted(kept_dir, caplog):
    os.mkdir(kept_dir, 0o700)
    os.chown(kept_dir, 65534, 65534)
    with caplog.at_level(logging.ERROR, logger="kvserver.core.kvcore"):
        core = KVCore(16 * MB, host_memory_dir=kept_dir)
    assert core.recovery is None and "belongs to uid 65534" in caplog.text
    part = part_of(core)
    put(core, part, keys_of(b"x", 4))  # the cache works, in the daemon's own memory
    assert found(core, part, keys_of(b"x", 4)) == (4, True)
    assert os.listdir(kept_dir) == []  # nothing was written there


def test_a_directory_others_may_reach_a_link_or_a_file_of_another_name_is_refused(kept_dir, caplog):
    os.mkdir(kept_dir, 0o755)
    with caplog.at_level(logging.ERROR, logger="kvserver.core.kvcore"):
        assert KVCore(16 * MB, host_memory_dir=kept_dir).recovery is None
    assert "mode 0755" in caplog.text
    os.chmod(kept_dir, 0o700)
    link = kept_dir + "-link"
    os.symlink(kept_dir, link)
    try:  # a link is never followed, even to a directory of the daemon's own
        caplog.clear()
        with caplog.at_level(logging.ERROR, logger="kvserver.core.kvcore"):
            assert KVCore(16 * MB, host_memory_dir=link).recovery is None
        assert "is a link" in caplog.text
        core = KVCore(16 * MB, host_memory_dir=kept_dir)
        assert core.recovery is not None
        asyncio.run(core.close())
        # A file with a second name could be changed through the other one: refused.
        os.link(os.path.join(kept_dir, "slabs"), os.path.join(kept_dir, "other-name"))
        caplog.clear()
        with caplog.at_level(logging.ERROR, logger="kvserver.core.kvcore"):
            core = KVCore(16 * MB, host_memory_dir=kept_dir)
        assert "2 names" in caplog.text
    finally:
        os.unlink(link)


def test_a_parent_directory_others_may_write_is_refused(tmp_path, caplog):
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)  # writable by everyone, not sticky: the entry could be swapped
    with caplog.at_level(logging.ERROR, logger="kvserver.core.kvcore"):
        core = KVCore(16 * MB, host_memory_dir=str(shared / "kv"))
    assert core.recovery is None and "not sticky" in caplog.text


def test_a_second_daemon_on_the_same_directory_does_not_use_it(kept_dir, caplog):
    first = KVCore(16 * MB, host_memory_dir=kept_dir)
    with caplog.at_level(logging.ERROR, logger="kvserver.core.kvcore"):
        second = KVCore(16 * MB, host_memory_dir=kept_dir)
    assert first.recovery is not None and second.recovery is None
    assert "another daemon keeps its cache" in caplog.text
    asyncio.run(first.close())
    asyncio.run(second.close())


def test_files_are_the_daemons_own_and_no_one_elses(kept_dir):
    core = KVCore(16 * MB, host_memory_dir=kept_dir)
    put(core, part_of(core), keys_of(b"m", 4))
    st = os.stat(kept_dir)
    assert st.st_uid == os.geteuid() and st.st_mode & 0o777 == 0o700
    for name in os.listdir(kept_dir):
        st = os.stat(os.path.join(kept_dir, name))
        assert st.st_uid == os.geteuid() and st.st_mode & 0o777 == 0o600, name
    asyncio.run(core.close())


@contextlib.contextmanager
def _mounted(path: str, commands: list[list[str]], why: str):
    """``path`` made and mounted by ``commands`` (run in turn) for the test, unmounted after; the
    test is skipped (``why``) where one cannot run: not root, a tool missing, a container that
    may not mount."""
    os.makedirs(path, exist_ok=True)

    def ran(command: list[str]) -> bool:
        if shutil.which(command[0]) is None:
            return False
        return subprocess.run(command, capture_output=True).returncode == 0

    made = os.geteuid() == 0 and all(ran(c) for c in commands)
    if not made:
        pytest.skip(why)
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", path], check=False)


def small_tmpfs(tmp_path, size: str):
    """A tmpfs of ``size`` mounted for the test (its path)."""
    path = str(tmp_path / "small")
    return _mounted(path, [["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "kvtest", path]],
                    "mounting a small tmpfs needs root (and a kernel that lets this container mount)")


def test_a_full_file_system_costs_dropped_pages_never_the_daemon(tmp_path):
    with small_tmpfs(tmp_path, "40m") as mnt:
        core = KVCore(256 * MB, host_memory_dir=os.path.join(mnt, "kv"))
        part = part_of(core, page_bytes=1 * MB)
        plan = put(core, part, keys_of(b"big", 200))  # 200 MiB do not fit the 40 MiB file system
        assert 0 < plan.positions.size < 40 and plan.dropped == 200 - plan.positions.size
        n = plan.positions.size
        assert found(core, part, keys_of(b"big", 200)) == (n, True)
        asyncio.run(core.close())
        core = KVCore(256 * MB, host_memory_dir=os.path.join(mnt, "kv"))
        assert core.recovery.adopted_pages == n
        asyncio.run(core.close())


def test_the_daemon_flag_and_variable_name_the_directory():
    from kvserver.__main__ import build_parser, config_from_args

    args = build_parser().parse_args(["--host-memory-dir", "/dev/shm/kv"])
    assert config_from_args(args).host_memory_dir == "/dev/shm/kv"
    code = ("import os; os.environ['KVSERVER_HOST_MEMORY_DIR'] = '/dev/shm/kv2';"
            "from kvserver.__main__ import build_parser, config_from_args;"
            "print(config_from_args(build_parser().parse_args([])).host_memory_dir)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "/dev/shm/kv2"


# ---- found by review: each failed on the first version ------------------------------------------


@pytest.mark.parametrize("field", ["offset", "slab"])  # the kept fields a grow writes before the state
def test_a_kill_while_a_slab_grows_loses_no_other_slabs_pages(kept_dir, field):
    """Page ids of a released slab keep their old slab number: a kill while they are being given
    to a new slab must not make the old number's live slab look like it has more pages."""
    confirmed = keys_of(b"A", 256)

    in_child(grow_killed, kept_dir, confirmed, field)
    core = KVCore(64 * MB, host_memory_dir=kept_dir)
    assert core.recovery.adopted_pages == 256 and core.recovery.dropped == 0
    assert found(core, part_of(core), confirmed) == (256, True)


def test_many_empty_spaces_in_the_catalog_cost_no_adopted_page(kept_dir):
    keys = keys_of(b"A", 10)

    in_child(store_then_empty_spaces, kept_dir, keys)
    core = KVCore(64 * MB, host_memory_dir=kept_dir)
    assert core.recovery.reason == "" and core.recovery.adopted_pages == 10
    assert found(core, part_of(core), keys) == (10, True)
    with open(os.path.join(kept_dir, "catalog")) as f:
        assert len(f.read().splitlines()) == 1  # parts without pages are forgotten


def test_a_space_dropped_while_empty_and_made_again_keeps_its_pages(kept_dir):
    keys = keys_of(b"A", 10)

    in_child(store_in_a_space_made_again, kept_dir, keys)
    core = KVCore(64 * MB, host_memory_dir=kept_dir)
    assert core.recovery.adopted_pages == 10
    assert found(core, part_of(core, weights="S"), keys) == (10, True)


def test_the_catalog_is_compacted_while_the_daemon_runs(kept_dir):
    """Each part made added a line to the catalog, and only a start compacted it: a tenant making
    spaces under new names without end (about 700 bytes a line, 140 a second from one engine)
    grew a file in tmpfs, outside the budget, and the next start read it all. It is now written
    whole again once it holds twice the parts that may hold pages and some more; a part dropped
    while empty but still held keeps its line, and its pages come back after a kill."""
    keys = keys_of(b"A", 10)

    in_child(store_across_spaces_made_without_end, kept_dir, keys)
    core = KVCore(64 * MB, host_memory_dir=kept_dir)
    assert core.recovery.reason == "" and core.recovery.adopted_pages == 20
    assert found(core, part_of(core), keys) == (10, True)
    assert found(core, part_of(core, weights="H"), keys_of(b"H", 10)) == (10, True)


def test_a_slab_record_whose_sizes_overflow_is_not_adopted(kept_dir):
    from kvserver.store.pages import COMMITTED

    big = 1 << 62

    in_child(overflowing_slab_record, kept_dir, big)
    core = KVCore(64 * MB, host_memory_dir=kept_dir)
    assert core.recovery.adopted_pages == 0 and core.recovery.dropped == 2
    p = core.cache.pages
    assert (p.offset[p.state[: p.size] == COMMITTED] < core.arena.capacity).all()


@pytest.mark.skipif(os.geteuid() != 0, reason="a link of another uid needs root to make")
def test_a_link_another_user_planted_is_never_followed(kept_dir, caplog):
    target = kept_dir + "-target"
    os.mkdir(target, 0o700)  # root's own, 0700: it would pass every check were the link followed
    with open(os.path.join(target, "catalog"), "w") as f:
        f.write("root's file\n")
    os.symlink(target, kept_dir)
    os.lchown(kept_dir, 12345, 12345)
    try:
        with caplog.at_level(logging.ERROR, logger="kvserver.core.kvcore"):
            core = KVCore(16 * MB, host_memory_dir=kept_dir)
        assert core.recovery is None and "is a link" in caplog.text
        assert sorted(os.listdir(target)) == ["catalog"]
        with open(os.path.join(target, "catalog")) as f:
            assert f.read() == "root's file\n"
        # Nor below such a link.
        caplog.clear()
        with caplog.at_level(logging.ERROR, logger="kvserver.core.kvcore"):
            assert KVCore(16 * MB, host_memory_dir=os.path.join(kept_dir, "kv")).recovery is None
        assert "link of uid 12345" in caplog.text
        assert sorted(os.listdir(target)) == ["catalog"]
    finally:
        os.unlink(kept_dir)
        shutil.rmtree(target, ignore_errors=True)


def test_a_build_given_up_leaves_no_slab_in_the_pinner(kept_dir, monkeypatch):
    keys = keys_of(b"A", 10)

    in_child(store, kept_dir, keys)
    from kvserver.store import cache as cache_module

    real = cache_module.KVCache.adopt_pages

    def failing(self, ids):
        real(self, ids)
        raise RuntimeError("an adoption that fails after its slabs were taken")

    monkeypatch.setattr(cache_module.KVCache, "adopt_pages", failing)
    core = KVCore(64 * MB, host_memory_dir=kept_dir)
    assert "adopting it failed" in core.recovery.reason
    base = core.arena.address
    live = {base + s.offset for s in core.cache.slabs.slabs.values()}
    assert set(core.slab_pinner._slabs) <= live


def test_an_adoption_that_fails_leaves_nothing_to_adopt_after_a_kill(kept_dir, monkeypatch):
    """Its records still say COMMITTED once it has freed the arena's memory: the header goes first,
    so a kill before the start over never adopts the zeroed pages."""
    keys = keys_of(b"A", 10)

    in_child(store, kept_dir, keys)
    in_child(fail_adoption_then_die, kept_dir)
    core = KVCore(64 * MB, host_memory_dir=kept_dir)
    assert core.recovery.adopted_pages == 0 and core.recovery.reason == "no kept cache was found"
    assert found(core, part_of(core), keys)[0] == 0


def test_a_lookup_that_misses_on_a_full_file_system_is_a_miss_not_a_sigbus(tmp_path):
    with small_tmpfs(tmp_path, "24m") as mnt:
        code = f"""
import os, sys
sys.path.insert(0, {os.path.dirname(__file__)!r})
from test_store_kept import KVCore, MB, part_of, put, found, keys_of
core = KVCore(16 * MB, host_memory_dir={os.path.join(mnt, "kv")!r})
part = part_of(core)
put(core, part, keys_of(b"A", 4))
fd = os.open({os.path.join(mnt, "filler")!r}, os.O_RDWR | os.O_CREAT, 0o600)
try:
    while True:
        os.write(fd, b"\\0" * 65536)
except OSError:
    pass
print(core.cache.lookup(part, keys_of(b"A", 4) + [b"missing!"])[0], found(core, part, keys_of(b"B", 2))[0])
"""
        run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        assert run.returncode == 0, f"exit {run.returncode}: {run.stderr[-2000:]}"
        assert run.stdout.split() == ["4", "0"]


# ---- found by a second review (each failed before its fix) --------------------------------------


def _fill_up(path: str) -> int:
    """Fills the file system of ``path`` with a file there; returns its descriptor."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        while True:
            os.write(fd, b"\0" * 4096)
    except OSError:
        return fd


def test_a_catalog_line_the_full_file_system_cuts_short_costs_no_later_part(tmp_path):
    from kvserver.errors import NoCapacity

    with small_tmpfs(tmp_path, "24m") as mnt:
        kept = os.path.join(mnt, "kv")
        core = KVCore(16 * MB, host_memory_dir=kept)
        i = 0
        while os.path.getsize(os.path.join(kept, "catalog")) % 4096 < 3900:  # near a page's end
            part_of(core, weights=f"w{i}")
            i += 1
        before = os.path.getsize(os.path.join(kept, "catalog"))
        fd = _fill_up(os.path.join(mnt, "filler"))
        with pytest.raises(NoCapacity, match="no room"):  # a clear status, the catalog as it was
            part_of(core, weights="X")
        assert os.path.getsize(os.path.join(kept, "catalog")) == before
        os.close(fd)
        os.unlink(os.path.join(mnt, "filler"))
        part = part_of(core, weights="Y")
        put(core, part, keys_of(b"y", 8))
        asyncio.run(core.close())
        core = KVCore(16 * MB, host_memory_dir=kept)
        assert core.recovery.adopted_pages == 8 and core.recovery.dropped == 0
        assert found(core, part_of(core, weights="Y"), keys_of(b"y", 8)) == (8, True)
        asyncio.run(core.close())


def test_a_restart_on_a_full_file_system_adopts_what_is_there(tmp_path):
    with small_tmpfs(tmp_path, "40m") as mnt:
        kept = os.path.join(mnt, "kv")
        core = KVCore(16 * MB, host_memory_dir=kept)
        put(core, part_of(core), keys_of(b"a", 100))
        for i in range(3):  # parts without pages: the catalog would be compacted at the restart
            part_of(core, weights=f"w{i}")
        asyncio.run(core.close())
        fd = _fill_up(os.path.join(mnt, "filler"))
        core = KVCore(16 * MB, host_memory_dir=kept)
        assert core.recovery.reason == "" and core.recovery.adopted_pages == 100
        assert found(core, part_of(core), keys_of(b"a", 100)) == (100, True)
        assert not os.path.exists(os.path.join(kept, "catalog.tmp"))
        asyncio.run(core.close())
        os.close(fd)


def test_spaces_a_daemon_held_past_the_limit_are_all_adopted(kept_dir, monkeypatch):
    from kvserver.store import cache as cache_module

    init = cache_module.KVCache.__init__
    monkeypatch.setattr(cache_module.KVCache, "__init__",
                        lambda self, *a, **k: init(self, *a, **{**k, "max_spaces_per_tenant": 4}))
    core = KVCore(64 * MB, host_memory_dir=kept_dir)
    held = [part_of(core, weights=f"w{i}") for i in range(4)]  # empty spaces whose parts are held
    more = [part_of(core, weights=f"x{i}") for i in range(4)]  # these drop the empty ones...
    for part in held + more:  # ...which come back through their held parts, past the limit
        put(core, part, keys_of(part.space.key.weights.encode(), 4))
    asyncio.run(core.close())
    core = KVCore(64 * MB, host_memory_dir=kept_dir)
    assert core.recovery.adopted_pages == 32 and core.recovery.dropped == 0


def test_a_stamp_out_of_range_in_the_files_breaks_nothing(kept_dir):
    from kvserver.store.pages import COMMITTED

    core = KVCore(64 * MB, host_memory_dir=kept_dir)
    put(core, part_of(core), keys_of(b"a", 4))
    p = core.cache.pages
    p.stamp[int(np.flatnonzero(p.state[:8] == COMMITTED)[0])] = np.iinfo(np.int64).max - 1
    asyncio.run(core.close())
    for _ in range(2):
        core = KVCore(64 * MB, host_memory_dir=kept_dir)
        put(core, part_of(core), keys_of(b"b", 4))
        assert found(core, part_of(core), keys_of(b"a", 4)) == (4, True)
        assert core.cache.pages.stamp.max() < 1 << 20
        asyncio.run(core.close())


def test_a_catalog_kept_as_it_was_sheds_a_line_a_kill_cut_short(tmp_path):
    """A restart on a full file system keeps the old catalog (it cannot write a compacted one): a
    line the last daemon's kill cut short must not swallow the next part's line."""
    with small_tmpfs(tmp_path, "40m") as mnt:
        kept = os.path.join(mnt, "kv")
        core = KVCore(16 * MB, host_memory_dir=kept)
        put(core, part_of(core), keys_of(b"a", 10))
        part_of(core, weights="empty")  # a line the compaction would drop
        asyncio.run(core.close())
        with open(os.path.join(kept, "catalog"), "a") as f:
            f.write('{"gid": 99, "space": {"ten')  # a kill in the middle of a line
        fd = _fill_up(os.path.join(mnt, "filler"))
        core = KVCore(16 * MB, host_memory_dir=kept)
        assert core.recovery.adopted_pages == 10
        os.close(fd)
        os.unlink(os.path.join(mnt, "filler"))
        put(core, part_of(core, weights="Y"), keys_of(b"y", 8))
        asyncio.run(core.close())
        core = KVCore(16 * MB, host_memory_dir=kept)
        assert core.recovery.adopted_pages == 18 and core.recovery.dropped == 0
        assert found(core, part_of(core, weights="Y"), keys_of(b"y", 8)) == (8, True)
        asyncio.run(core.close())


def small_ext4(tmp_path, mib: int):
    """An ext4 file system of ``mib`` MiB on a loop device, mounted for the test (its path)."""
    image, path = str(tmp_path / "ext4.img"), str(tmp_path / "ext4")
    with open(image, "wb") as f:
        f.truncate(mib << 20)
    return _mounted(path, [["mkfs.ext4", "-q", "-F", image], ["mount", "-o", "loop", image, path]],
                    "an ext4 loop mount needs root, mkfs.ext4 and loop devices")


def test_a_region_the_file_system_has_no_room_for_leaves_no_blocks_taken(tmp_path):
    """ext4 keeps what a posix_fallocate took before it ran out of room: a region refused for
    want of room gives those blocks back, so the file holds no space outside its regions."""
    with small_ext4(tmp_path, 64) as mnt:
        kept = KeptDir(os.path.join(mnt, "disk"), kept_shape(aligned_capacity(256 * MB), "disk"))
        arena = DiskArena(int(kept.shape["capacity"]), kept)
        data = os.path.join(mnt, "disk", "data")
        st = os.statvfs(mnt)
        free = st.f_bavail * st.f_frsize
        with pytest.raises(NoCapacity):
            arena.reserve(free + 16 * MB)  # more than the file system has left
        assert os.stat(data).st_blocks * 512 < MB, "blocks of a refused region stayed taken"
        start = arena.reserve(8 * MB)  # a region that fits is taken whole
        assert os.stat(data).st_blocks * 512 >= 8 * MB
        arena.release(start, 8 * MB)
        kept.close()


def test_a_refused_region_stays_refused_where_its_room_cannot_be_given_back(tmp_path, monkeypatch):
    """A file system that cannot punch holes: the region's refusal (NoCapacity, which a Put turns
    into evictions or dropped keys) is what the caller sees, not the failed give-back."""
    kept = KeptDir(str(tmp_path / "disk"), kept_shape(aligned_capacity(64 * MB), "disk"))
    arena = DiskArena(int(kept.shape["capacity"]), kept)

    def full(start: int, size: int) -> None:
        raise NoCapacity("the file system is full")

    def cannot_punch(start: int, size: int) -> None:
        raise OSError(95, "punching holes is not supported")

    monkeypatch.setattr(arena, "_commit", full)
    monkeypatch.setattr(arena, "_punch", cannot_punch)
    with pytest.raises(NoCapacity):
        arena.reserve(8 * MB)
    assert arena.reserved == 0
    kept.close()


def test_a_host_cache_kept_on_a_disk_outlives_its_daemon_not_its_machine(tmp_path, kept_dir, monkeypatch,
                                                                         caplog):
    """Host pages keep no check: their commit order is whole in shared memory, but a file system
    that writes back may leave the arena and the records from different moments after a power
    cut. On such a one the files are adopted within one boot only, and the daemon says so at
    start; on tmpfs (which a reboot empties anyway) nothing changes."""
    from kvserver.host import kept as kept_mod

    keys = keys_of(b"boot", 20)
    with small_ext4(tmp_path, 128) as mnt:
        path = os.path.join(mnt, "kv")
        with caplog.at_level(logging.WARNING, logger="kvserver.host.kept"):
            core = KVCore(64 * MB, host_memory_dir=path)
        assert "not its machine" in caplog.text
        put(core, part_of(core), keys)
        asyncio.run(core.close())
        core = KVCore(64 * MB, host_memory_dir=path)  # a restart of the daemon: adopted
        assert core.recovery.adopted_pages == 20
        asyncio.run(core.close())
        monkeypatch.setattr(kept_mod, "boot_id", lambda: "a-later-boot")  # (a reboot cannot run here)
        core = KVCore(64 * MB, host_memory_dir=path)
        assert core.recovery.adopted_pages == 0 and "machine restarted" in core.recovery.reason
        assert found(core, part_of(core), keys)[0] == 0
        asyncio.run(core.close())
    monkeypatch.undo()
    core = KVCore(64 * MB, host_memory_dir=kept_dir)
    put(core, part_of(core), keys)
    asyncio.run(core.close())
    monkeypatch.setattr(kept_mod, "boot_id", lambda: "a-later-boot")
    core = KVCore(64 * MB, host_memory_dir=kept_dir)
    assert core.recovery.adopted_pages == 20 and found(core, part_of(core), keys) == (20, True)
    asyncio.run(core.close())


def test_a_host_cache_on_a_disk_whose_boot_cannot_be_told_is_never_adopted(tmp_path, monkeypatch):
    """Where neither the boot id nor the boot time can be read, every boot looked alike, and a
    cache kept on a disk was adopted after a reboot: now it starts empty at every start, and a
    header of a daemon that did not bind its files to the boot says that is why."""
    from kvserver.host import kept as kept_mod

    keys = keys_of(b"nb", 20)
    with small_ext4(tmp_path, 128) as mnt:
        path = os.path.join(mnt, "kv")
        core = KVCore(64 * MB, host_memory_dir=path)
        put(core, part_of(core), keys)
        asyncio.run(core.close())
        header = os.path.join(path, "format.json")
        with open(header) as f:
            shape = json.load(f)
        del shape["boot"]  # as a daemon before the binding wrote it
        with open(header, "w") as f:
            json.dump(shape, f)
        core = KVCore(64 * MB, host_memory_dir=path)
        assert core.recovery.adopted_pages == 0 and "did not bind" in core.recovery.reason
        put(core, part_of(core), keys)
        asyncio.run(core.close())
        monkeypatch.setattr(kept_mod, "BOOT_ID", str(tmp_path / "no-boot-id"))
        monkeypatch.setattr(kept_mod, "BOOT_TIME", str(tmp_path / "no-stat"))
        assert kept_mod.boot_id() == ""
        for _ in range(2):
            core = KVCore(64 * MB, host_memory_dir=path)
            assert core.recovery.adopted_pages == 0
            put(core, part_of(core), keys)
            asyncio.run(core.close())
