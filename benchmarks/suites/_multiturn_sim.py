"""The workload and the bookkeeping of the multi-turn benchmark: the arrival trace, a tier's
prefix LRU, and the timeline that turns per-request records into TTFTs.

Client c's conversation is a fixed token sequence; in round r its prompt is its history
(r * (Q + A) tokens: earlier questions and answers) plus a new question of Q tokens, and the
answer adds A tokens. The trace serves every client's round r before any round r + 1 (clients in
a random order each round), arriving as a Poisson process; the order, and so every tier's hits
and data movement, does not depend on timing. Times are put on afterwards (``timeline``).
"""

from __future__ import annotations

import statistics
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class Workload:
    clients: int
    rounds: int
    question: int  # tokens
    answer: int
    page: int
    seed: int

    def prompt_pages(self, rnd: int) -> int:
        return (rnd * (self.question + self.answer) + self.question) // self.page

    def total_pages(self, rnd: int) -> int:
        """The client's pages once round ``rnd`` is answered."""
        return (rnd + 1) * (self.question + self.answer) // self.page

    def all_pages(self) -> int:
        return self.clients * self.total_pages(self.rounds - 1)


@dataclass(frozen=True)
class Request:
    index: int
    client: int
    round: int
    replica: int  # for the DP configurations
    unit_arrival: float  # arrival time at rate 1 request/s


def trace(w: Workload, replicas: int = 2) -> list[Request]:
    rng = np.random.default_rng(w.seed)
    gaps = rng.exponential(1.0, w.clients * w.rounds)
    arrivals = np.cumsum(gaps) - gaps[0]
    out = []
    for r in range(w.rounds):
        for c in rng.permutation(w.clients).tolist():
            i = len(out)
            out.append(Request(i, c, r, int(rng.integers(replicas)), float(arrivals[i])))
    return out


class PrefixLRU:
    """A tier of ``capacity`` page slots holding leading pages of clients' histories. A client's
    pages are evicted from its end, least recently used client first: a prefix never loses its
    middle."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.free: list[int] = list(range(capacity - 1, -1, -1))
        self.slots: OrderedDict[int, list[int]] = OrderedDict()  # client -> slot of page i

    def count(self, client: int) -> int:
        return len(self.slots.get(client, ()))

    def of(self, client: int) -> list[int]:
        return self.slots.get(client, [])

    def touch(self, client: int) -> None:
        self.slots.setdefault(client, [])
        self.slots.move_to_end(client)

    def make_room(self, n: int, keep: int) -> list[tuple[int, int, int]]:
        """Evicts until ``n`` slots are free, never from client ``keep``; returns (client, page,
        slot) of every evicted page."""
        evicted = []
        while len(self.free) < n:
            victim = next((c for c, s in self.slots.items() if c != keep and s), None)
            if victim is None:
                raise RuntimeError(f"a tier of {self.capacity} pages cannot free {n}")
            pages = self.slots[victim]
            while pages and len(self.free) < n:
                slot = pages.pop()
                self.free.append(slot)
                evicted.append((victim, len(pages), slot))
        return evicted

    def extend(self, client: int, n: int) -> list[int]:
        """``n`` free slots appended to the client's prefix (room made first)."""
        got = [self.free.pop() for _ in range(n)]
        self.touch(client)
        self.slots[client].extend(got)
        return got


@dataclass
class Record:
    """What serving one request did in one configuration; seconds are measured."""

    prompt_tokens: int
    device_hit: int  # tokens found on the engine's device
    host_hit: int  # tokens loaded from the host tier
    computed: int  # prompt tokens prefilled
    load_s: float = 0.0  # host -> device before the prefill
    write_s: float = 0.0  # device -> host after it (write-through)
    loaded_bytes: int = 0
    written_bytes: int = 0
    replica: int | None = None  # the replica that served it (DP rows; None: the trace's pick)

    @property
    def hit(self) -> int:
        return self.device_hit + self.host_hit


@dataclass
class Timeline:
    ttft: list[float] = field(default_factory=list)
    first_arrival: float = 0.0
    last_done: float = 0.0
    busy_s: float = 0.0
    engine_busy_s: list[float] = field(default_factory=list)


def timeline(reqs: list[Request], records: list[Record], rate: float, prefill, replicas: int) -> Timeline:
    """FIFO per engine in trace order. A request starts once its engine is free, it has arrived,
    and its client has its previous answer (with that answer's KV stored: in DP the next round may
    go to the other replica). TTFT = wait + load + prefill of the missing tokens; the
    write-through after the prefill keeps the engine busy but is not in the TTFT."""
    free = [0.0] * replicas
    client_ready: dict[int, float] = {}
    tl = Timeline(engine_busy_s=[0.0] * replicas)
    for req, rec in zip(reqs, records, strict=True):
        arrival = req.unit_arrival / rate
        eng = (req.replica if rec.replica is None else rec.replica) if replicas > 1 else 0
        start = max(free[eng], arrival, client_ready.get(req.client, 0.0))
        first_token = start + rec.load_s + prefill(rec.computed, rec.hit)
        done = first_token + rec.write_s
        free[eng] = done
        client_ready[req.client] = done
        tl.ttft.append(first_token - arrival)
        tl.busy_s += done - start
        tl.engine_busy_s[eng] += done - start
        tl.last_done = max(tl.last_done, done)
    tl.first_arrival = reqs[0].unit_arrival / rate
    return tl


def percentile(xs: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(xs), q))


def figures(reqs: list[Request], records: list[Record], tl: Timeline) -> dict:
    prompt = sum(r.prompt_tokens for r in records)
    span = tl.last_done - tl.first_arrival
    loads = [r.load_s for r in records if r.host_hit]
    return {
        "requests": len(records),
        "prompt_tokens": prompt,
        "hit_rate": sum(r.hit for r in records) / prompt,
        "device_hit_rate": sum(r.device_hit for r in records) / prompt,
        "host_hit_rate": sum(r.host_hit for r in records) / prompt,
        "computed_tokens": sum(r.computed for r in records),
        "ttft_p50_s": percentile(tl.ttft, 50),
        "ttft_p90_s": percentile(tl.ttft, 90),
        "ttft_p99_s": percentile(tl.ttft, 99),
        "ttft_mean_s": statistics.fmean(tl.ttft),
        "throughput_rps": len(records) / span,
        "throughput_prompt_tps": prompt / span,
        "makespan_s": span,
        "busy_s": tl.busy_s,
        # What the engines could serve if never idle: requests (prompt tokens) over the busiest
        # engine's busy time. Throughput above is bounded by the arrival rate; this is not.
        "capacity_rps": len(records) / max(tl.engine_busy_s),
        "capacity_prompt_tps": prompt / max(tl.engine_busy_s),
        "load_s_total": sum(r.load_s for r in records),
        "write_s_total": sum(r.write_s for r in records),
        "load_ms_mean_per_hit": 1e3 * statistics.fmean(loads) if loads else 0.0,
        "loaded_bytes": sum(r.loaded_bytes for r in records),
        "written_bytes": sum(r.written_bytes for r in records),
        "ttft_s": sorted(tl.ttft),
    }
