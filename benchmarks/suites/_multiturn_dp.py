"""Two DP replicas sharing the daemon's node-wide cache: each replica is an engine process with its
own device pool and KVClient; a request Gets the pages past its device prefix by content keys
(``kvclient.keys.page_keys`` of the client's tokens) and Puts what it computed (write-through),
so a client's next round finds its history whichever replica serves it.

Replica 0 lives in the benchmark's process, replica 1 in a child driven over a pipe; both time
their own Get and Put. The coordinator keeps each replica's device LRU. The child is forked before
the benchmark opens any gRPC channel (gRPC does not survive a fork with channels open; see
``child_context``, which spawns instead when forking is not safe) and builds its replica on its
first command, once the daemon is up.
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable

from _multiturn_kv import DevicePool, Geometry
from _multiturn_model import child_context
from _multiturn_sim import PrefixLRU, Record, Request, Workload

from kvclient import KVClient


class CacheReplica:
    """``resilient``: the replica rides through a daemon restart (its calls miss meanwhile and
    its client registers again by itself), as an engine does."""

    def __init__(self, address: str, geom: Geometry, pages: int, seed: int, resilient: bool = False) -> None:
        self.dev = DevicePool(geom, pages, seed)
        self.client = KVClient(address, timeout=60, resilient=resilient)
        self.client.register(model="multiturn-dp", pool=self.dev.pool, start_layer=0, end_layer=geom.layers,
                             num_layers=geom.layers, host_tokens=geom.page, page_size=geom.page)
        self.dropped = 0
        self._epoch = self.client.registration.epoch

    def registered_again(self, timeout: float = 60.0) -> float:
        """Seconds until the client has registered with a restarted daemon."""
        t0 = time.monotonic()
        while True:
            reg = self.client.registration
            if reg is not None and reg.epoch != self._epoch:
                self._epoch = reg.epoch
                return time.monotonic() - t0
            if time.monotonic() - t0 > timeout:
                raise TimeoutError(f"the replica did not register again within {timeout} s")
            time.sleep(0.01)

    def get(self, client: int, first: int, keys: bytes, slots: list[int]) -> tuple[int, float]:
        t0 = time.perf_counter()
        handle = self.client.get(keys, slots)
        got = handle.pages(timeout=60)
        handle.wait(timeout=60)
        secs = time.perf_counter() - t0
        self.dev.verify(client, first, slots[:got])
        return got, secs

    def fill_put(self, client: int, first: int, keys: bytes, slots: list[int]) -> tuple[int, float]:
        self.dev.fill(client, first, slots)
        t0 = time.perf_counter()
        r = self.client.put(keys, slots)
        secs = time.perf_counter() - t0
        self.dropped += r.dropped
        return r.stored, secs

    def checks(self) -> tuple[int, int, int]:
        return self.dev.checked, self.dev.wrong, self.dropped

    def close(self) -> None:
        try:
            self.client.unregister()
        finally:
            self.client.close()
            self.dev.close()


def _child(conn, address: str, geom: Geometry, pages: int, seed: int, resilient: bool = False) -> None:
    try:
        if conn.recv() != "start":
            return
        rep = CacheReplica(address, geom, pages, seed, resilient)
        conn.send(("ready", None))
        while True:
            cmd, args = conn.recv()
            if cmd == "stop":
                rep.close()
                conn.send(("ok", None))
                return
            conn.send(("ok", getattr(rep, cmd)(*args)))
    except BaseException:
        conn.send(("error", traceback.format_exc()))


class RemoteReplica:
    """A CacheReplica in a child process (started at once; ``start`` makes it register)."""

    def __init__(self, address: str, geom: Geometry, pages: int, seed: int, spawn: bool = False,
                 resilient: bool = False) -> None:
        ctx = child_context(spawn)
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_child, args=(child, address, geom, pages, seed, resilient),
                                daemon=True)
        self.proc.start()
        self.started = self.ready = False

    def start(self) -> None:
        if not self.started:
            self.conn.send("start")
            self.started = True

    def _answer(self):
        if not self.conn.poll(120):
            raise RuntimeError("the replica process answered nothing in 120 s")
        kind, value = self.conn.recv()
        if kind == "error":
            raise RuntimeError(f"replica process failed:\n{value}")
        return value

    def wait_ready(self) -> None:
        self.start()
        if not self.ready:
            self._answer()
            self.ready = True

    def _call(self, cmd: str, *args):
        self.wait_ready()
        self.conn.send((cmd, args))
        return self._answer()

    def get(self, *args):
        return self._call("get", *args)

    def fill_put(self, *args):
        return self._call("fill_put", *args)

    def checks(self):
        return self._call("checks")

    def registered_again(self):
        return self._call("registered_again")

    def close(self) -> None:
        try:
            if self.proc.is_alive() and self.started:
                self._call("stop")
            elif self.proc.is_alive():
                self.conn.send("no")
        finally:
            self.proc.join(30)
            if self.proc.is_alive():
                self.proc.kill()
                self.proc.join(10)


def serve_dp(w: Workload, reqs: list[Request], replicas, pages: int, keys: list[list[bytes]] | None,
             bar, restart: tuple[int, Callable[[], None]] | None = None,
             place: Callable[[Request], int] | None = None) -> list[Record]:
    """Trace order; ``replicas`` None: recompute only on two replicas (the baseline of the DP rows).
    ``restart``: (i, fn): ``fn`` runs before request i (a daemon restart; it returns once the
    replicas are registered again). ``place``: which replica serves a request (a router); default
    the trace's random pick (``Request.replica``); the records say which (``Record.replica``)."""
    lrus = [PrefixLRU(pages), PrefixLRU(pages)]
    out = []
    pb = w.page
    for i, req in enumerate(reqs):
        if restart is not None and i == restart[0]:
            restart[1]()
        c, prompt, total = req.client, w.prompt_pages(req.round), w.total_pages(req.round)
        where = place(req) if place is not None else req.replica
        lru = lrus[where]
        d = lru.count(c)
        lru.make_room(total - d, keep=c)
        slots = lru.extend(c, total - d)
        rec = Record(prompt_tokens=prompt * pb, device_hit=d * pb, host_hit=0, computed=0, replica=where)
        hit = d
        if replicas is not None:
            rep = replicas[where]
            got, rec.load_s = rep.get(c, d, b"".join(keys[c][d:prompt]), slots[: prompt - d])
            hit = d + got
            rec.loaded_bytes = got * rep_page_bytes(replicas)
            _, rec.write_s = rep.fill_put(c, hit, b"".join(keys[c][hit:total]), slots[hit - d:])
            rec.written_bytes = (total - hit) * rep_page_bytes(replicas)
        rec.host_hit = (hit - d) * pb
        rec.computed = (prompt - hit) * pb
        out.append(rec)
        bar.update(1)
    return out


def rep_page_bytes(replicas) -> int:
    return replicas[0].dev.geom.page_bytes
