"""Engines for the node-wide cache tests: a KVClient over a shared-memory pool whose pages hold
KV that is a pure function of the page's key, so any process can tell what a page must hold.

``CacheEngine`` is used in the test process and in spawned engine processes alike. Below it: the
bodies of spawned engine processes, a churning engine over raw stubs (``churn_worker``, a
``light_engine.LightEngine``), and a script mode that looks keys up as another uid.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
import traceback

import numpy as np
import torch

from kvclient import KVClient, KVLayout, ShmKVPool
from kvclient.keys import page_keys, split_keys

MODEL = "cache-model"
LAYOUT = KVLayout.mha(2, 64)  # fp16: 256 B per token and part
DTYPE = torch.float16
PAGE = 16


def sglang_pp_indices(num_layers: int, pp_rank: int, pp_size: int) -> tuple[int, int]:
    """The layer range SGLang (like vLLM) gives a PP stage without a custom partition: equal
    shares, the remainder spread one layer each over the stages before the last."""
    parts = [num_layers // pp_size] * pp_size
    for i in range(2, num_layers % pp_size + 2):
        parts[-i] += 1
    start = sum(parts[:pp_rank])
    return start, start + parts[pp_rank]


def kv_of(key: bytes, shape: tuple[int, ...], salt: bytes = b"") -> np.ndarray:
    """The bytes a page named ``key`` holds in one layer part (``salt``: which layer part)."""
    seed = int.from_bytes(hashlib.blake2b(key + salt, digest_size=8).digest(), "little")
    return np.random.default_rng(seed).integers(0, 256, shape, dtype=np.uint8)


def scattered(rng: np.random.Generator, n: int, total: int, avoid: np.ndarray | None = None) -> np.ndarray:
    """``n`` distinct device pages out of ``total``, shuffled, none in ``avoid``."""
    free = np.setdiff1d(np.arange(total), avoid if avoid is not None else [])
    return rng.permutation(free)[:n].astype(np.int64)


class CacheEngine:
    """One registered engine: layers [start, end) of a ``num_layers`` model, ``pages`` device pages
    of ``page_size`` tokens. ``raw[l][q]`` is layer l part q as uint8 [pages, page_size * token]."""

    def __init__(self, address: str, *, start: int = 0, end: int = 4, num_layers: int | None = None,
                 pages: int = 64, page_size: int = PAGE, layout: KVLayout = LAYOUT, dtype=DTYPE,
                 tp_rank: int = 0, tp_size: int = 1, pp_rank: int = 0, pp_size: int = 1,
                 model: str = MODEL, tenant_token: str | None = None, resilient: bool = False,
                 rank_salt: bool = True, host_tokens: int | None = None, weights: str = "",
                 timeout: float = 5.0, lane: str = "auto") -> None:
        self.start, self.end, self.page_size, self.num_pages = start, end, page_size, pages
        self.layout, self.dtype = layout, dtype
        # Each TP rank of an MHA model holds its own heads: its bytes differ from the other ranks'.
        self.salt = f"tp{tp_rank}".encode() if rank_salt and not layout.is_mla else b""
        self.pool = ShmKVPool(layout, dtype, end - start, pages * page_size)
        self.raw = [[b.view(torch.uint8).numpy().reshape(pages, -1) for b in layer]
                    for layer in self.pool.buffers]
        self.page_bytes = page_size * layout.token_bytes(dtype) * layout.num_parts * (end - start)
        self.client = KVClient(address, tenant_token=tenant_token, resilient=resilient, timeout=timeout,
                               lane=lane)
        try:
            self.client.register(model=model, pool=self.pool, start_layer=start, end_layer=end,
                                 num_layers=num_layers or end, host_tokens=host_tokens or page_size,
                                 page_size=page_size, weights=weights,
                                 tp_rank=tp_rank, tp_size=tp_size, pp_rank=pp_rank, pp_size=pp_size)
        except BaseException:
            self.client.close()
            self.pool.close()
            raise

    def fill(self, keys: list[bytes], pages: np.ndarray) -> None:
        """Writes into device page pages[i] the KV of keys[i], every layer and part."""
        for layer, parts in enumerate(self.raw):
            for q, buf in enumerate(parts):
                salt = self.salt + bytes([self.start + layer, q])
                for key, p in zip(keys, pages.tolist(), strict=True):
                    buf[p] = kv_of(key, buf[p].shape, salt)

    def wrong(self, keys: list[bytes], pages: np.ndarray, layers=None) -> list[int]:
        """Positions i whose device page pages[i] does not hold the KV of keys[i] (in any part of
        the global ``layers``, default all of the engine's)."""
        bad = set()
        for layer, parts in enumerate(self.raw):
            if layers is not None and self.start + layer not in layers:
                continue
            for q, buf in enumerate(parts):
                salt = self.salt + bytes([self.start + layer, q])
                for i, (key, p) in enumerate(zip(keys, pages.tolist(), strict=True)):
                    if not np.array_equal(buf[p], kv_of(key, buf[p].shape, salt)):
                        bad.add(i)
        return sorted(bad)

    def wipe(self, pages: np.ndarray | None = None) -> None:
        for parts in self.raw:
            for buf in parts:
                if pages is None:
                    buf[:] = 0
                else:
                    buf[pages] = 0

    def zero(self, pages: np.ndarray, layers=None) -> bool:
        """True if the device pages hold only zeros (in the global ``layers``, default all)."""
        return all(not buf[pages].any() for layer, parts in enumerate(self.raw) for buf in parts
                   if layers is None or self.start + layer in layers)

    def put(self, keys: list[bytes], pages: np.ndarray):
        return self.client.put(keys, pages)

    def get(self, keys: list[bytes], pages: np.ndarray, **kw) -> int:
        """Loads the stored prefix of ``keys``; returns how many pages it loaded."""
        handle = self.client.get(keys, pages, **kw)
        n = handle.pages(timeout=30)
        handle.wait(timeout=30)
        return n

    def load_checked(self, keys: list[bytes], rng: np.random.Generator) -> int:
        """Loads the stored prefix of ``keys`` into scattered wiped device pages; asserts every
        loaded byte is the key's and no page past the prefix was written; returns the pages loaded."""
        pages = scattered(rng, len(keys), self.num_pages)
        self.wipe()
        n = self.get(keys, pages)
        assert self.wrong(keys[:n], pages[:n]) == [], "a page came back with other bytes"
        assert self.zero(pages[n:]), "a page past the loaded prefix was written"
        return n

    def lookup(self, keys: list[bytes], **kw):
        return self.client.lookup(keys, **kw)

    def close(self) -> None:
        try:
            if self.client.registration is not None:
                self.client.unregister()
        finally:
            self.client.close()
            self.raw = []  # views into the mapping go before it does
            self.pool.close()

    def __enter__(self) -> CacheEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def prompt_keys(tokens: np.ndarray, page_size: int = PAGE) -> list[bytes]:
    return split_keys(page_keys(tokens, page_size))


# ---- process bodies (spawned) ------------------------------------------------------------------


def replica(address: str, tokens: np.ndarray, seed: int, steps, out, **engine) -> None:
    """A DP replica. Commands from ``steps`` (a queue), each answered on ``out``:
    ("put", n): fills and Puts the first n keys' pages; ("lookup", n); ("get", n): Gets into wiped
    scattered pages and checks every byte; ("stop",)."""
    try:
        rng = np.random.default_rng(seed)
        keys = prompt_keys(tokens, engine.get("page_size", PAGE))
        with CacheEngine(address, **engine) as eng:
            out.put(("ready", len(keys)))
            while True:
                cmd, *args = steps.get(timeout=60)
                if cmd == "stop":
                    break
                n = args[0] if args else len(keys)
                pages = scattered(rng, n, eng.num_pages)
                if cmd == "put":
                    eng.fill(keys[:n], pages)
                    r = eng.put(keys[:n], pages)
                    out.put(("put", (r.stored, r.present, r.dropped, r.bytes)))
                elif cmd == "lookup":
                    out.put(("lookup", eng.lookup(keys[:n]).pages))
                elif cmd == "get":
                    eng.wipe()
                    got = eng.get(keys[:n], pages)
                    others = np.setdiff1d(np.arange(eng.num_pages), pages[:got])
                    out.put(("get", (got, eng.wrong(keys[:got], pages[:got]), eng.zero(others))))
        out.put(("done", None))
    except BaseException:
        out.put(("error", traceback.format_exc()))


def put_and_hang(address: str, tokens: np.ndarray, out) -> None:
    """Puts every whole page of ``tokens``, says so, then waits to be killed (no Unregister)."""
    try:
        keys = prompt_keys(tokens)
        eng = CacheEngine(address, resilient=True)
        pages = scattered(np.random.default_rng(1), len(keys), eng.num_pages)
        eng.fill(keys, pages)
        r = eng.put(keys, pages)
        out.put(("put", (r.stored, r.present, r.dropped)))
    except BaseException:
        out.put(("error", traceback.format_exc()))
        return
    time.sleep(120)


def put_pin_and_hang(address: str, tokens: np.ndarray, out) -> None:
    """``put_and_hang``, then a Lookup of its pages pinned for a minute (on whatever lane the
    client takes), said; then waits to be killed."""
    try:
        keys = prompt_keys(tokens)
        eng = CacheEngine(address)
        pages = scattered(np.random.default_rng(1), len(keys), eng.num_pages)
        eng.fill(keys, pages)
        eng.put(keys, pages)
        found = eng.client.lookup(keys, pin_ms=60_000)
        out.put(("pinned", (found.pages, bool(found.lease_id))))
    except BaseException:
        out.put(("error", traceback.format_exc()))
        return
    time.sleep(120)


# ---- another user (run as root: python cache_engine.py UID SOCKET KEYS_HEX) ----------------------


def lookup_as(uid: int, socket: str, keys: bytes) -> dict:
    """Becomes ``uid`` (in group 0, so a 0660 root socket lets it in) after every import, then asks a
    scheduler's view of the default space how many of ``keys`` are stored."""
    from kvclient import CacheView

    os.setgroups([0])
    os.setgid(uid)
    os.setuid(uid)
    with CacheView(f"unix://{socket}", model=MODEL, layout=LAYOUT, dtype=DTYPE, page_size=PAGE,
                   num_layers=4) as view:
        pages = view.lookup(keys).pages  # the view opens its space on first use
        return {"uid": os.getuid(), "tenant": view.tenant, "pages": pages}


if __name__ == "__main__":
    print(json.dumps(lookup_as(int(sys.argv[1]), sys.argv[2], bytes.fromhex(sys.argv[3]))))


# ---- a churning engine over raw stubs (forkserver children of test_core_cache_concurrency) -----------

CHURN_PAGES = 64  # device pages of a churning engine


def churn_worker(address: str, name: str, seed: int, seconds: float, docs: list[list[bytes]], out) -> None:
    """Puts and Gets overlapping prefixes of ``docs`` (plus keys of its own) for ``seconds``, checking
    every page a Get loads against the bytes its key names. Reports counts on ``out``."""
    from light_engine import LightEngine

    from kvserver.v1 import kvserver_pb2 as pb

    report = {"name": name, "puts": 0, "gets": 0, "pinned_gets": 0, "pages_checked": 0,
              "corrupt": 0, "short_pinned": 0, "bad_counts": 0, "untouched_violations": 0, "errors": []}
    try:
        rng = np.random.default_rng(seed)
        eng = LightEngine(address, name, layers=4, num_tokens=CHURN_PAGES * PAGE, page_size=PAGE,
                          host_tokens=PAGE)
        kv = eng.kv.reshape(4, 2, CHURN_PAGES, PAGE, -1)
        shape = (4, 2, PAGE, kv.shape[-1])
        out.put(("started", name, None))
        deadline = time.monotonic() + seconds
        mine = 0
        while time.monotonic() < deadline:
            doc = docs[int(rng.integers(len(docs)))]
            keys = doc[:int(rng.integers(1, len(doc) + 1))]
            extra = int(rng.integers(0, 9))
            keys = keys + [hashlib.blake2b(f"{name}/{mine + i}".encode(), digest_size=16).digest()
                           for i in range(extra)]
            mine += extra
            pages = rng.permutation(CHURN_PAGES)[:len(keys)]
            for key, p in zip(keys, pages.tolist(), strict=True):
                kv[:, :, p] = kv_of(key, shape)
            r = eng.stub.Put(pb.PutRequest(client_id=eng.client_id, keys=b"".join(keys), key_bytes=16,
                                           device_pages=pages.tolist()), timeout=30)
            report["puts"] += 1
            if r.stored + r.present + r.dropped != len(keys):
                report["bad_counts"] += 1
            kv[:] = 0
            pin = rng.random() < 0.3
            look = eng.stub.Lookup(pb.LookupRequest(client_id=eng.client_id, keys=b"".join(keys),
                                                    key_bytes=16, pin_ms=2000 if pin else 0), timeout=30)
            pages = rng.permutation(CHURN_PAGES)[:len(keys)]
            msgs = list(eng.stub.Get(pb.GetRequest(
                client_id=eng.client_id, keys=b"".join(keys), key_bytes=16, device_pages=pages.tolist(),
                lease_id=look.lease_id if pin else ""), timeout=30))
            got = msgs[-1].pages if msgs else 0
            report["gets"] += 1
            if not msgs or not msgs[-1].done or any(m.pages != got for m in msgs):
                report["bad_counts"] += 1
            if pin:
                report["pinned_gets"] += 1
                report["short_pinned"] += got < look.pages
            for key, p in zip(keys[:got], pages[:got].tolist(), strict=True):
                report["pages_checked"] += 1
                if not np.array_equal(kv[:, :, p], kv_of(key, shape)):
                    report["corrupt"] += 1
            if kv[:, :, pages[got:]].any():
                report["untouched_violations"] += 1
        del kv  # a numpy view pins the mapping: it goes before the mapping does
        eng.close()
    except BaseException:
        report["errors"].append(traceback.format_exc())
    out.put(("done", name, report))
