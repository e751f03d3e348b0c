"""The KV events' memory and cost bounds, with real components (the daemon's ZmqPublisher read by
real ZMQ sockets, the EventBook the Events call reads): a batch's encoded payload stays within
BATCH_BYTES however small its records (so the sockets' high-water marks, counted in batches, bound
bytes), in the records' order; a read finds its place in a log at once, at its tail as at its
head; a log of one-key events is bounded by its events, not only its keys; and silent replay
peers share the replay buffer's bytes rather than each queueing copies."""

from __future__ import annotations

import gc
import os
import time
import tracemalloc

import msgspec
import pytest
import zmq
from cache_engine import DTYPE, LAYOUT, MODEL, PAGE

from kvserver.events import book, schema
from kvserver.events.publisher import BATCH_BYTES, ZmqPublisher
from kvserver.protocol.layout import dtype_named
from kvserver.store import Keys, SpaceKey

RECORDS = 1 << 15  # one-key records into a log: four times the events it keeps (MAX_LOG_EVENTS)
A = SpaceKey("tenantA", MODEL, LAYOUT, dtype_named(str(DTYPE)), PAGE, 4, 1, 1)
decode = msgspec.msgpack.Decoder(type=schema.KVEventBatch).decode


@pytest.fixture
def ctx():
    c = zmq.Context()
    yield c
    c.destroy(linger=0)


def key(i: int) -> bytes:
    """A 32-byte key whose vLLM int block hash (its low 64 bits) is ``2**40 + i`` (9 bytes as msgpack)."""
    return bytes(24) + ((1 << 40) + i).to_bytes(8, "big")


def read_batches(sub: zmq.Socket, hashes: int, timeout: float = 20.0) -> list[bytes]:
    """Payloads received until their events carry ``hashes`` block hashes in all."""
    payloads, seen = [], 0
    deadline = time.monotonic() + timeout
    while seen < hashes:
        assert time.monotonic() < deadline, f"{seen} of {hashes} hashes in {len(payloads)} batches"
        if sub.poll(100):
            _, _, payload = sub.recv_multipart()
            payloads.append(payload)
            seen += sum(len(getattr(ev, "block_hashes", ())) for ev in decode(payload).events)
    return payloads


@pytest.mark.parametrize("int_hashes", [True, False])
def test_batches_of_many_one_key_records_stay_within_the_byte_bound_in_order(ctx, int_hashes):
    """A decode-heavy full cache: each step stores a page and evicts one (two one-key records),
    then a run of evictions. Before: each record's event (~125 bytes of fields) was not counted,
    and a batch of one-key records reached 260 KB against the 64 KiB said."""
    p = ZmqPublisher("tcp://127.0.0.1:0", int_hashes=int_hashes, start=False)  # records wait for start()
    sub = ctx.socket(zmq.SUB)
    sub.connect(p.endpoint)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    time.sleep(0.3)  # the subscription reaches the publisher
    try:
        pairs, removals = 4000, 3000
        sent: list[tuple[bool, int]] = []  # (stored, i), in the order recorded
        for i in range(pairs):
            for stored, k in ((False, 2 * i), (True, 2 * i + 1)):
                p.record(A, stored, "CPU", "LOCAL", Keys.of([key(k)]), time.time())
                sent.append((stored, k))
        for k in range(2 * pairs, 2 * pairs + removals):
            p.record(A, False, "CPU", "LOCAL", Keys.of([key(k)]), time.time())
            sent.append((False, k))
        p.start()
        payloads = read_batches(sub, len(sent))
        sizes = [len(x) for x in payloads]
        assert max(sizes) <= BATCH_BYTES, f"largest payload {max(sizes)} bytes, {len(sizes)} batches"
        got, events = [], []
        for x in payloads:
            for ev in decode(x).events:
                events.append(ev)
                if isinstance(ev, schema.AllBlocksCleared):
                    continue
                for h in ev.block_hashes:
                    i = (h & 0xFFFFFFFF) if int_hashes else int.from_bytes(h[-4:], "big")
                    got.append((isinstance(ev, schema.BlockStored), i))
        assert got == sent, "every record's key, in the order recorded"
        assert isinstance(events[0], schema.AllBlocksCleared)
        # Stores stay one event a record (a BlockStored's hashes may be read as a chain); a run
        # of removals shares events, none of which takes a batch past its bound.
        stores = [ev for ev in events if isinstance(ev, schema.BlockStored)]
        assert len(stores) == pairs and all(len(ev.block_hashes) == 1 for ev in stores)
        assert len(events) < 1 + 2 * pairs + removals // 100
    finally:
        p.close()


def full_log(records: int) -> tuple[book.EventBook, str]:
    """A book whose one log got ``records`` one-key records, alternately stored and removed (so
    none joins the one before), read after each: a reader that keeps up, as an engine does."""
    b = book.EventBook()
    log_id = b.read(A, "", 0)[0]
    for j in range(records):
        b.record(A, bool(j & 1), "CPU", "LOCAL", Keys.of([key(j)]))
    return b, log_id


def test_a_read_finds_its_place_at_the_tail_of_a_full_log_as_fast_as_at_its_head():
    """Before: a read skipped to its place through the log's deque (islice), so a caught-up
    reader's read of a log of 131,072 one-key events took 0.65 ms of the event loop."""
    b, log_id = full_log(RECORDS)
    first = b.read(A, log_id, 0, 1)[1][0].seq  # the oldest event the log holds
    last = RECORDS

    def cost(after: int) -> float:
        best = float("inf")
        for _ in range(5):
            t = time.perf_counter()
            for _ in range(200):
                _, got, _, _ = b.read(A, log_id, after, 1)
                assert len(got) == 1 and got[0].seq == after + 1
            best = min(best, time.perf_counter() - t)
        return best

    head, tail = cost(first), cost(last - 1)
    assert tail < 10 * head + 200 * 5e-6, f"tail {tail * 5:.4f} ms a read, head {head * 5:.4f} ms"


def test_a_log_of_one_key_events_stays_within_its_bound():
    """Before: only keys were counted, and an event costs ~0.45 KB beyond its 33-byte key: a log
    of 131,072 one-key events took ~60 MB where 4 MB of keys were said."""
    gc.collect()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        b, log_id = full_log(RECORDS)
        grown = tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()
    bound = 8 << 20  # MAX_LOG_EVENTS (8,192) of ~0.5 KB with their keys, twice over
    assert grown <= bound, f"{grown >> 10} KiB for a log of one-key events; bound {bound >> 10} KiB"
    _, evs, _, gap = b.read(A, log_id, 0, book.MAX_READ_KEYS)
    assert gap and len(evs) == book.MAX_LOG_EVENTS


def rss_mib() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") >> 20


def test_many_silent_replay_peers_share_the_replay_buffers_bytes(ctx):
    """64 peers ask for a replay from 0 and never read. Before: each peer's queue held up to 64
    copied batches, even after a 33rd request ended its answer (~1.4 MiB a peer, with no bound on
    the peers); now each queued batch refers to the one frame the replay buffer keeps."""
    p = ZmqPublisher("tcp://127.0.0.1:0", "tcp://127.0.0.1:0", int_hashes=False)
    try:
        p.record(A, True, "CPU", "LOCAL", Keys.unpack(os.urandom(32 * 100_000), 32, 100_000), time.time())
        deadline = time.monotonic() + 20
        while p.sent < 100:  # batches of ~64 KiB: ~6 MiB kept for replay
            assert time.monotonic() < deadline, p.sent
            time.sleep(0.05)
        time.sleep(0.3)
        gc.collect()
        base = rss_mib()
        peers = []
        for i in range(64):
            d = ctx.socket(zmq.DEALER)
            d.setsockopt(zmq.RCVHWM, 1)
            d.setsockopt(zmq.RCVBUF, 4096)
            d.connect(p.replay_endpoint)
            d.send_multipart((b"", (0).to_bytes(8, "big")))
            peers.append(d)
            if i % 16 == 15:
                time.sleep(0.5)  # the publisher fills their queues
        time.sleep(1.5)
        grown = rss_mib() - base
        assert grown < 30, f"RSS grew {grown} MiB for 64 silent replay peers"
        # A peer that reads still gets its whole answer, in order.
        d = ctx.socket(zmq.DEALER)
        d.connect(p.replay_endpoint)
        d.send_multipart((b"", (1).to_bytes(8, "big")))
        seqs = []
        while True:
            assert d.poll(5000), f"no end of the replay after {len(seqs)} batches"
            _, topic, seq, payload = d.recv_multipart()
            if payload == b"":
                break
            seqs.append(int.from_bytes(seq, "big"))
        assert seqs == list(range(1, p.sent + 1))
    finally:
        p.close()


def test_reads_walk_every_log_at_most_once_a_second_and_an_idle_log_still_starts_again():
    """Every read walked every space's log for those nobody read for IDLE_SECONDS (3.4 ms of the
    event loop at 64 Ki logs, each read): the walk is made at most once a second, and a log idle
    that long is still started again on its own next read, whenever the last walk was."""
    now = [0.0]
    b = book.EventBook(clock=lambda: now[0])

    class Walked(dict):
        walks = 0

        def items(self):
            Walked.walks += 1
            return super().items()

    b._logs = Walked()
    spaces = [SpaceKey(f"t{i}", MODEL, LAYOUT, dtype_named(str(DTYPE)), PAGE, 4, 1, 1) for i in range(3)]
    first = b.read(spaces[0], "", 0)[0]
    for _ in range(100):  # a busy second of readers
        for s in spaces:
            b.read(s, "", 0)
    assert Walked.walks == 1
    now[0] = book.IDLE_SECONDS - 0.5
    b.read(spaces[1], "", 0)  # a walk now: spaces[0]'s log, read at 0, is not idle long enough yet
    assert Walked.walks == 2
    now[0] = book.IDLE_SECONDS + 0.2  # within a second of that walk: no walk, but idle past its bound
    again, events, _, gap = b.read(spaces[0], first, 0)
    assert Walked.walks == 2 and again != first and events == [] and gap is True
