"""A soak client: one LightEngine doing random Alloc / Write / Load / Free against the daemon for a
fixed time, checking every byte it loads back and every count the daemon reports.

Runs in a forkserver child (see test_e2e_soak.py). What a host page holds is tracked as one sha256
per (page, layer) of the bytes that were written to it, keyed by the host index of the page's
first token; a load is checked page by page and layer by layer against that.
"""

from __future__ import annotations

import hashlib
import time
import traceback
from collections import Counter

import grpc
import numpy as np
from light_engine import LightEngine

from kvserver.core.epochs import EPOCH_SHIFT
from kvserver.v1 import kvserver_pb2 as pb

MAX_ERRORS = 20  # details kept per process; every error is still counted


class Soaker:
    def __init__(self, address: str, name: str, seed: int, *, layers: int = 4, num_tokens: int = 1024,
                 page_size: int = 16, host_tokens: int = 512) -> None:
        self.rng = np.random.default_rng(seed)
        self.eng = LightEngine(address, name, layers=layers, num_tokens=num_tokens, page_size=page_size,
                               host_tokens=host_tokens)
        self.cid = self.eng.client_id
        self.P = page_size
        self.L = layers
        self.num_tokens = num_tokens
        self.capacity_pages = self.eng.reg.host_tokens // page_size
        # Bytes of one token across K and V of one layer; a write or load moves this per token-layer.
        self.token_layer_bytes = 2 * self.eng.token_bytes
        self.allocated: set[int] = set()  # host index of each allocated page's first token
        self.stored: dict[int, list[bytes]] = {}  # page -> sha256 per layer of what was written
        self.freed: list[int] = []  # pages freed and not (as far as we know) allocated again
        self.ops: Counter[str] = Counter()
        self.mismatches = 0
        self.mismatch_details: list[str] = []
        self.errors = 0
        self.error_details: list[str] = []
        # What the daemon's per-client counters must say.
        self.write_ops = self.load_ops = self.bytes_written = self.bytes_loaded = 0

    # ---- bookkeeping helpers ---------------------------------------------------------------

    def error(self, what: str) -> None:
        self.errors += 1
        if len(self.error_details) < MAX_ERRORS:
            self.error_details.append(what)

    def mismatch(self, what: str) -> None:
        self.mismatches += 1
        if len(self.mismatch_details) < MAX_ERRORS:
            self.mismatch_details.append(what)

    def tokens_of(self, pages: list[int]) -> np.ndarray:
        return (np.asarray(pages, dtype=np.int64)[:, None] + np.arange(self.P, dtype=np.int64)).reshape(-1)

    def device_slots(self, num_pages: int, avoid: np.ndarray | None = None) -> np.ndarray:
        """Distinct device token slots, none in ``avoid``: whole aligned pages (a paged copy) or
        scattered tokens (a token copy)."""
        taken = np.zeros(self.num_tokens, dtype=bool)
        if avoid is not None:
            taken[avoid] = True
        free_pages = np.flatnonzero(~taken.reshape(-1, self.P).any(axis=1))
        if free_pages.size >= num_pages and self.rng.random() < 0.5:
            pages = self.rng.choice(free_pages, num_pages, replace=False)
            return (pages[:, None] * self.P + np.arange(self.P)).reshape(-1).astype(np.int64)
        return self.rng.choice(np.flatnonzero(~taken), num_pages * self.P, replace=False).astype(np.int64)

    def digests(self, dev: np.ndarray, layers=None) -> list[list[bytes]]:
        """Per page of ``dev`` (P tokens each), sha256 per layer of the device bytes there."""
        kv = self.eng.kv
        layers = range(self.L) if layers is None else layers
        return [[hashlib.sha256(kv[layer, :, dev[j:j + self.P]].tobytes()).digest() for layer in layers]
                for j in range(0, dev.size, self.P)]

    def pick(self, pool, most: int) -> list[int]:
        pool = sorted(pool)
        k = int(self.rng.integers(1, min(most, len(pool)) + 1))
        return [pool[i] for i in self.rng.choice(len(pool), k, replace=False)]

    def random_layers(self) -> list[int]:
        """A non-empty, proper (when possible), ascending subset of the layers."""
        k = int(self.rng.integers(1, max(self.L - 1, 1) + 1))
        return sorted(int(x) for x in self.rng.choice(self.L, k, replace=False))

    # ---- RPCs with their own checks --------------------------------------------------------

    def write(self, pages: list[int], dev: np.ndarray, layers: list[int] | None = None) -> None:
        nlayers = self.L if not layers else len(layers)
        resp = self.eng.stub.Write(pb.WriteRequest(
            client_id=self.cid, host_indices=self.tokens_of(pages).tolist(), device_indices=dev.tolist(),
            layers=layers or []), timeout=30)
        want = dev.size * self.token_layer_bytes * nlayers
        if resp.bytes != want:
            self.error(f"Write answered {resp.bytes} bytes, expected {want}")
        self.write_ops += 1
        self.bytes_written += want

    def load(self, pages: list[int], dev: np.ndarray, layers: list[int] | None = None,
             after_first=None) -> None:
        """Loads and checks the progress stream; ``after_first`` runs once the first message is in
        (the daemon has then checked the request and queued its copy)."""
        want_layers = layers or list(range(self.L))
        per_layer = dev.size * self.token_layer_bytes
        stream = self.eng.stub.Load(pb.LoadRequest(
            client_id=self.cid, host_indices=self.tokens_of(pages).tolist(), device_indices=dev.tolist(),
            layers=layers or []), timeout=30)
        done_seen, last_done = False, 0
        for msg in stream:
            if done_seen:
                self.error("Load sent a message after done")
            if not last_done < msg.layers_done <= len(want_layers):
                self.error(f"Load layers_done went {last_done} -> {msg.layers_done} of {len(want_layers)}")
            elif msg.last_layer != want_layers[msg.layers_done - 1]:
                self.error(f"Load last_layer {msg.last_layer} for layers_done {msg.layers_done} "
                           f"of {want_layers}")
            if msg.bytes != msg.layers_done * per_layer:
                self.error(f"Load bytes {msg.bytes} at {msg.layers_done} layers, "
                           f"expected {msg.layers_done * per_layer}")
            done_seen = msg.done
            if msg.done != (msg.layers_done == len(want_layers)):
                self.error(f"Load done={msg.done} at {msg.layers_done} of {len(want_layers)} layers")
            last_done = msg.layers_done
            if after_first is not None:
                after_first()
                after_first = None
        if not done_seen:
            self.error(f"Load stream ended without done (layers_done {last_done})")
        self.load_ops += 1
        self.bytes_loaded += per_layer * len(want_layers)

    def free(self, pages: list[int]) -> None:
        freed = self.eng.free(self.tokens_of(pages))
        if freed != len(pages) * self.P:
            self.error(f"Free answered {freed} tokens for {len(pages)} pages")
        for p in pages:
            self.allocated.discard(p)
            self.stored.pop(p, None)
            self.freed.append(p)
        del self.freed[:-64]

    def stats(self) -> pb.ClientStats:
        resp = self.eng.stub.Stats(pb.StatsRequest(client_id=self.cid), timeout=30)
        if len(resp.clients) != 1 or resp.clients[0].client_id != self.cid:
            self.error(f"Stats for one client listed {[c.client_id for c in resp.clients]}")
            return pb.ClientStats()
        return resp.clients[0]

    def check_stats(self, where: str) -> pb.ClientStats:
        c = self.stats()
        want = {
            "used_tokens": len(self.allocated) * self.P,
            "capacity_tokens": self.capacity_pages * self.P,
            "write_ops": self.write_ops, "load_ops": self.load_ops,
            "bytes_written": self.bytes_written, "bytes_loaded": self.bytes_loaded,
        }
        got = {
            "used_tokens": c.used_tokens, "capacity_tokens": c.capacity_tokens,
            "write_ops": c.transfers.write_ops, "load_ops": c.transfers.load_ops,
            "bytes_written": c.transfers.bytes_written, "bytes_loaded": c.transfers.bytes_loaded,
        }
        if got != want:
            self.error(f"Stats {where}: daemon says {got}, bookkeeping says {want}")
        if c.sessions != 1:
            self.error(f"Stats {where}: {c.sessions} sessions")
        return c

    def verify(self, pages: list[int], dev: np.ndarray, layers: list[int] | None, before, what: str):
        """``dev`` now holds ``pages`` for ``layers`` (all if None); the other layers hold
        ``before`` (digests taken before the load)."""
        got = self.digests(dev)
        loaded = set(range(self.L) if layers is None else layers)
        for j, page in enumerate(pages):
            for layer in range(self.L):
                want = self.stored[page][layer] if layer in loaded else before[j][layer]
                if got[j][layer] != want:
                    kind = "loaded" if layer in loaded else "untouched"
                    self.mismatch(f"{what}: host page {page & ((1 << EPOCH_SHIFT) - 1)} layer {layer} "
                                  f"({kind}) differs after a load of layers {layers}")

    # ---- operations ------------------------------------------------------------------------

    def op_alloc(self) -> None:
        n = int(self.rng.integers(1, 10 * self.P))
        need = -(-n // self.P)
        free_pages = self.capacity_pages - len(self.allocated)
        try:
            host = self.eng.alloc(n)
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
                raise
            self.ops["alloc_exhausted"] += 1
            if need <= free_pages:
                self.error(f"Alloc of {need} pages refused with {free_pages} of ours free: {exc.details()}")
            if self.allocated:  # a normal outcome: make room and go on
                self.free(self.pick(self.allocated, max(1, len(self.allocated) // 2)))
            return
        if need > free_pages:
            self.error(f"Alloc of {need} pages granted with only {free_pages} free")
        if host.size != need * self.P:
            self.error(f"Alloc of {n} tokens gave {host.size} indices, expected {need * self.P}")
            return
        if ((host >> EPOCH_SHIFT) != self.eng.reg.epoch).any():
            self.error("Alloc gave indices without this registration's epoch")
        rows = host.reshape(-1, self.P)
        if ((rows[:, 0] % self.P) != 0).any() or (rows != rows[:, :1] + np.arange(self.P)).any():
            self.error("Alloc gave indices that are not whole aligned pages")
        new = [int(p) for p in rows[:, 0]]
        again = self.allocated.intersection(new)
        if again or len(set(new)) != len(new):
            self.error(f"Alloc handed out pages already allocated to us: {sorted(again)[:4]}")
        self.allocated.update(new)
        self.freed = [p for p in self.freed if p not in self.allocated]

    def op_write(self) -> None:
        if not self.allocated:
            return self.op_alloc()
        pages = self.pick(self.allocated, 8)
        dev = self.device_slots(len(pages))
        self.eng.fill(dev, self.rng)
        digests = self.digests(dev)
        self.write(pages, dev)
        self.stored.update(zip(pages, digests, strict=True))

    def op_write_layers(self) -> None:
        """Overwrites some layers of fully stored pages; the other layers keep what they had."""
        if not self.stored:
            return self.op_write()
        pages = self.pick(self.stored, 8)
        layers = self.random_layers()
        dev = self.device_slots(len(pages))
        self.eng.fill(dev, self.rng)
        digests = self.digests(dev)
        self.write(pages, dev, layers)
        for page, d in zip(pages, digests, strict=True):
            for layer in layers:
                self.stored[page][layer] = d[layer]

    def op_load(self, subset: bool = False) -> None:
        if not self.stored:
            return self.op_write()
        pages = self.pick(self.stored, 8)
        layers = self.random_layers() if subset else None
        dev = self.device_slots(len(pages))
        self.eng.fill(dev, self.rng)  # fresh bytes: a copy that did not happen cannot pass
        before = self.digests(dev)
        self.load(pages, dev, layers)
        self.verify(pages, dev, layers, before, "load_layers" if subset else "load")

    def op_overwrite(self) -> None:
        """Two different contents to the same host pages back to back: the later one wins."""
        if not self.allocated:
            return self.op_alloc()
        pages = self.pick(self.allocated, 8)
        first = self.device_slots(len(pages))
        self.eng.fill(first, self.rng)
        first_digests = self.digests(first)
        self.write(pages, first)
        second = self.device_slots(len(pages))
        self.eng.fill(second, self.rng)
        second_digests = self.digests(second)
        self.write(pages, second)
        self.stored.update(zip(pages, second_digests, strict=True))
        if any(a == b for a, b in zip(first_digests, second_digests, strict=True)):
            self.error("the two contents of an overwrite were equal")
        dev = self.device_slots(len(pages))
        self.eng.fill(dev, self.rng)
        self.load(pages, dev)
        self.verify(pages, dev, None, None, "overwrite")

    def op_free(self) -> None:
        if not self.allocated:
            return self.op_alloc()
        self.free(self.pick(self.allocated, 8))

    def op_stale(self) -> None:
        """A page we freed (and hold no more) is refused, not served."""
        stale = [p for p in self.freed if p not in self.allocated]
        if not stale:
            return self.op_free()
        page = stale[int(self.rng.integers(len(stale)))]
        dev = self.device_slots(1)
        try:
            self.load([page], dev)
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.FAILED_PRECONDITION:
                raise
            return
        self.error("a Load of a freed page was served")

    def op_free_during_load(self) -> None:
        """Free of pages under a running load: the free waits, the load delivers every byte."""
        if not self.stored:
            return self.op_write()
        pages = self.pick(self.stored, 8)
        dev = self.device_slots(len(pages))
        self.eng.fill(dev, self.rng)
        host = self.tokens_of(pages).tolist()
        freeing = []
        self.load(pages, dev, None, lambda: freeing.append(self.eng.stub.Free.future(
            pb.FreeRequest(client_id=self.cid, host_indices=host), timeout=30)))
        self.verify(pages, dev, None, None, "free_during_load")
        freed = freeing[0].result().freed_tokens
        if freed != len(pages) * self.P:
            self.error(f"Free during a load answered {freed} tokens for {len(pages)} pages")
        for p in pages:
            self.allocated.discard(p)
            self.stored.pop(p, None)
            self.freed.append(p)

    def op_write_during_load(self) -> None:
        """A write to pages under a running load lands after it (copies keep arrival order): the
        load delivers the old bytes, later loads the new ones."""
        if not self.stored:
            return self.op_write()
        pages = self.pick(self.stored, 8)
        overwrite = self.pick(pages, len(pages))  # some or all of them: a smaller copy may run inline
        dev = self.device_slots(len(pages))
        src = self.device_slots(len(overwrite), avoid=dev)
        self.eng.fill(dev, self.rng)
        self.eng.fill(src, self.rng)
        new = self.digests(src)
        writing = []
        self.load(pages, dev, None, lambda: writing.append(self.eng.stub.Write.future(pb.WriteRequest(
            client_id=self.cid, host_indices=self.tokens_of(overwrite).tolist(),
            device_indices=src.tolist()), timeout=30)))
        self.verify(pages, dev, None, None, "write_during_load")
        nbytes = writing[0].result().bytes
        want = src.size * self.token_layer_bytes * self.L
        if nbytes != want:
            self.error(f"Write during a load answered {nbytes} bytes, expected {want}")
        self.write_ops += 1
        self.bytes_written += want
        self.stored.update(zip(overwrite, new, strict=True))

    def op_stats(self) -> None:
        self.check_stats("mid-soak")

    OPS = (("alloc", 20), ("write", 25), ("load", 22), ("free", 12), ("load_layers", 6),
           ("write_layers", 4), ("overwrite", 5), ("stale", 3), ("stats", 3),
           ("free_during_load", 3), ("write_during_load", 3))

    def run(self, seconds: float) -> dict:
        names = [n for n, _ in self.OPS]
        weights = np.array([w for _, w in self.OPS], dtype=float)
        weights /= weights.sum()
        t0 = time.monotonic()
        deadline = t0 + seconds
        while time.monotonic() < deadline:
            name = names[int(self.rng.choice(len(names), p=weights))]
            try:
                if name == "load_layers":
                    self.op_load(subset=True)
                else:
                    getattr(self, f"op_{name}")()
            except grpc.RpcError as exc:
                self.error(f"{name}: {exc.code().name}: {exc.details()}")
            self.ops[name] += 1
        elapsed = time.monotonic() - t0
        end = self.check_stats("at the end")
        used_at_end = end.used_tokens
        held = len(self.allocated) * self.P
        if self.allocated:
            self.free(sorted(self.allocated))
        after_free = self.stats().used_tokens
        if after_free != 0:
            self.error(f"{after_free} tokens still used after freeing everything")
        self.eng.close()  # ends the session, unregisters, closes the pool
        return {
            "ops": sum(v for k, v in self.ops.items() if k != "alloc_exhausted"),
            "by_op": dict(self.ops), "seconds": elapsed, "mismatches": self.mismatches,
            "mismatch_details": self.mismatch_details, "errors": self.errors,
            "error_details": self.error_details, "used_tokens_at_end": used_at_end, "held_at_end": held,
            "write_ops": self.write_ops, "load_ops": self.load_ops,
            "bytes_written": self.bytes_written, "bytes_loaded": self.bytes_loaded,
        }


def soak_worker(address: str, name: str, seed: int, seconds: float, out) -> None:
    """Reports ("started", name, client_id) once registered, then ("done", name, result)."""
    try:
        soaker = Soaker(address, name, seed)
        out.put(("started", name, soaker.cid))
        out.put(("done", name, soaker.run(seconds)))
    except BaseException:
        out.put(("failed", name, traceback.format_exc()))
