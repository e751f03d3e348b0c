"""A cache that survives its daemon: what is kept beside the page table, and adopting it at start.

With --host-memory-dir the arena, the page table's records (state, arena offset, slab, recency) and
the index's entries (key, part) are files (``kvserver.host.kept``); this module keeps the rest: a
record per slab (``slabs``: where it lies, its page size and count) and the catalog of parts (one
JSON line per part: its space's key and its own, under the part's number). A number is given again
once no line names it: no committed host record can name it then (a part's line is written before
its pages, a start drops the lines of parts with no page left), but a power cut may leave disk
records whose line was lost, so the disk's page checks name the part's identity, not its number
(``part_identity``).

Why a page found in the files is never a torn one: the cache writes a page's record in the order
its life goes. A new page is marked being written (WRITING) before its bytes are copied and
committed only once the copy is over (``complete_put``); a page is freed (its key's owner cleared,
then FREE) before it is handed out again. Every store lands in the files' shared memory as it is
made, so whatever ends the process, the files say COMMITTED only of a page whose bytes are whole
and whose key, part and offset are those bytes'. Adoption takes only those, and only if everything
about them agrees (``adopt``): the slab record is live and sane, the slab's pages are exactly its
pages, the part is in the catalog with the slab's page size, one tenant per slab, one page per key.

Primitives: ``Keep`` (``slab_added`` / ``slab_removed`` / ``part_added``), ``adopt`` and
``Recovery``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvserver.config import format_size
from kvserver.errors import KVError, NoCapacity
from kvserver.host.arena import REGION_ALIGN
from kvserver.host.kept import KeptDir
from kvserver.protocol.layout import KV_DTYPES_BY_NAME, KVLayout
from kvserver.store.keys import DIGEST_BYTES, MAX_KEY_BYTES, WORD_BYTES
from kvserver.store.pages import COMMITTED, MAX_SLAB_PAGES, MIN_PAGE_BYTES, UNUSED, WRITING, max_pages
from kvserver.store.spaces import Part, PartKey, SpaceKey

logger = logging.getLogger(__name__)

SLAB_RECORD = np.dtype([("offset", "<i8"), ("nbytes", "<i8"), ("page_bytes", "<i8"), ("pages", "<i4"),
                        ("live", "<i4")])
CATALOG = "catalog"


@dataclass(slots=True)
class Recovery:
    """What a start found of a kept cache."""

    path: str
    what: str = "host cache"  # the tier: "host cache" or "disk cache"
    adopted_pages: int = 0
    adopted_bytes: int = 0
    seconds: float = 0.0
    torn: int = 0  # pages being written when the last daemon stopped: never served, dropped
    dropped: int = 0  # committed pages that failed a check: dropped
    evicted: int = 0  # adopted pages evicted at once: their tenant's quota is smaller now
    reason: str = ""  # why nothing was adopted ("" if the files were)

    def line(self) -> str:
        if self.reason:
            return f"{self.what} in {self.path} starts empty: {self.reason}"
        return (f"{self.what} adopted from {self.path}: {self.adopted_pages} pages, "
                f"{format_size(self.adopted_bytes)}, in {self.seconds:.3f} s; dropped {self.torn} torn "
                f"(being written at the stop) and {self.dropped} that failed a check"
                + (f"; evicted {self.evicted} over their tenants' quotas" if self.evicted else ""))


def kept_shape(capacity: int, kind: str = "host") -> dict[str, int | str]:
    """What kept files must have been made for to be adopted by a cache of ``capacity`` bytes
    (``kind``: "host" memory, or "disk" with a check kept per page; a host shape names no kind, as
    before the disk tier, so that its files are adopted across that upgrade)."""
    # The disk's page checks are seeded with their part's identity (2), once with its number.
    shape: dict[str, int | str] = {"kind": kind, "check": 2} if kind != "host" else {}
    return {**shape, "capacity": capacity, "pages": max_pages(capacity), "slab_record": SLAB_RECORD.itemsize}


def space_json(key: SpaceKey) -> dict[str, Any]:
    lay = key.layout
    return {"tenant": key.tenant, "model": key.model, "weights": key.weights,
            "layout": [lay.is_mla, lay.num_heads, lay.head_dim, lay.rope_dim],
            "dtype": key.dtype.name, "page_size": key.page_size,
            "num_layers": key.num_layers, "tp_size": key.tp_size, "pp_size": key.pp_size}


def _space_of(d: dict[str, Any]) -> SpaceKey:
    is_mla, heads, dim, rope = d["layout"]
    dtype = KV_DTYPES_BY_NAME.get(d["dtype"]) if isinstance(d["dtype"], str) else None
    if dtype is None:
        raise ValueError(f"not a dtype: {d['dtype']!r}")
    layout = KVLayout(bool(is_mla), int(heads), int(dim), int(rope))
    return SpaceKey(str(d["tenant"]), str(d["model"]), layout, dtype, int(d["page_size"]),
                    int(d["num_layers"]), int(d["tp_size"]), int(d["pp_size"]), str(d["weights"]))


def part_record(part: Part) -> str:
    """What ``part`` is, in one canonical JSON form: its space's fields (the weights' identity
    among them), its TP shard, PP stage, layer range and page bytes; never its number."""
    k = part.key
    return json.dumps({"space": space_json(part.space.key),
                       "part": [k.tp_shard, k.pp_rank, k.start_layer, k.end_layer, k.page_bytes]},
                      sort_keys=True, separators=(",", ":"))


def part_identity(part: Part) -> int:
    """A 64-bit digest of ``part_record``: the disk tier seeds each page's check with it, so that
    records a number given again (or a changed catalog line) ascribes to another part fail their
    check instead of serving that part."""
    digest = hashlib.blake2b(part_record(part).encode(), digest_size=8, person=b"kvserver-disk")
    return int.from_bytes(digest.digest(), "little")


def _line(part: Part) -> str:
    k = part.key
    return json.dumps({"gid": part.gid, "space": space_json(part.space.key),
                       "part": [k.tp_shard, k.pp_rank, k.start_layer, k.end_layer, k.page_bytes]}) + "\n"


class Keep:
    """The slab records and the catalog of a kept cache."""

    def __init__(self, kept: KeptDir, capacity: int) -> None:
        self.kept = kept
        n = capacity // REGION_ALIGN + 1  # slab ids stay below the most slabs there can be at once
        self.slabs = kept.array("slabs", n, SLAB_RECORD)
        if not kept.allocate("slabs", 0, n * SLAB_RECORD.itemsize):
            raise OSError(f"no room in {kept.path} for {n} slab records")
        self._catalog = -1
        self.catalog_lines = 0  # lines in the catalog (written whole, then appended)
        self.compacted = 0  # lines the last compaction kept

    def slab_added(self, sid: int, offset: int, nbytes: int, page_bytes: int, pages: int) -> None:
        r = self.slabs[sid : sid + 1]
        r["offset"], r["nbytes"], r["page_bytes"], r["pages"] = offset, nbytes, page_bytes, pages
        r["live"] = 1  # last: the record is whole before it counts

    def slab_removed(self, sid: int) -> None:
        self.slabs["live"][sid] = 0

    def part_added(self, part: Part) -> None:
        """Files the part in the catalog before any page of it is written; NoCapacity, the catalog
        as it was, if the file system has no room for its line."""
        if self._catalog < 0:
            self._catalog = self.kept.appender(CATALOG, fresh=not self.kept.adopting)
        end = os.lseek(self._catalog, 0, os.SEEK_END)
        data = _line(part).encode()
        try:
            while data:
                data = data[os.write(self._catalog, data):]
        except OSError as exc:  # a line cut short would swallow the next one: it goes whole
            os.ftruncate(self._catalog, end)
            raise NoCapacity(f"no room in {self.kept.path} to file a new part of the kept cache "
                             f"({exc.strerror})") from None
        self.catalog_lines += 1

    def compact(self, parts: Iterable[Part]) -> None:
        """The catalog written whole again with the lines of ``parts`` only (every part that may
        hold a page: a line per part made stayed until the next start, so a tenant making spaces
        without end grew the file without end). A file system without room keeps the old one."""
        lines = [_line(part) for part in parts]
        try:
            self._catalog = self.kept.replace_text(CATALOG, "".join(lines))
        except OSError as exc:
            logger.warning("the kept catalog in %s was not compacted: %s", self.kept.path, exc.strerror)
            self.compacted = self.catalog_lines  # not again before it doubles
            return
        self.catalog_lines = self.compacted = len(lines)

    def read_catalog(self) -> dict[int, tuple[SpaceKey, PartKey, str]]:
        """gid -> (space key, part key, its line), of every line that reads whole."""
        out = {}
        for line in self.kept.read_text(CATALOG).splitlines():
            try:
                d = json.loads(line)
                gid, (shard, pp, start, end, page_bytes) = int(d["gid"]), d["part"]
                out[gid] = (_space_of(d["space"]), PartKey(int(shard), int(pp), int(start), int(end),
                                                            int(page_bytes)), line + "\n")
            except (ValueError, KeyError, TypeError, AttributeError, RecursionError):
                continue  # a line cut short by a kill, or not ours: its pages are dropped
        return out

    def rewrite_catalog(self, lines: list[str]) -> None:
        """The catalog with ``lines`` only; if the file system has no room for the new one, the
        old one stays (its other lines name parts no page refers to: harmless)."""
        try:
            self._catalog = self.kept.replace_text(CATALOG, "".join(lines))
            self.catalog_lines = len(lines)
        except OSError as exc:
            if not self.kept.adopting:
                raise
            logger.warning("the kept catalog in %s was not compacted: %s", self.kept.path, exc.strerror)
            if self._catalog < 0:
                self._catalog = self.kept.appender(CATALOG, fresh=False)
            text = self.kept.read_text(CATALOG)
            if text and not text.endswith("\n"):  # a line a kill cut short: the next starts afresh
                os.ftruncate(self._catalog, len(text[: text.rfind("\n") + 1].encode()))


def adopt(cache: Any, keep: Keep) -> Recovery:
    """Takes back into ``cache`` (the KVCache, which imports this module) what the files of a kept
    cache hold, as far as every check passes; the rest is dropped and its memory freed. Then the
    directory is sealed for the next start."""
    t0 = time.perf_counter()
    rec = Recovery(keep.kept.path, what=cache.what, reason=keep.kept.reason)
    if keep.kept.adopting:
        try:
            _adopt(cache, keep, rec)
        except BaseException:
            keep.kept.unseal()  # what the files say is no longer to be trusted, nor adopted again
            raise
        cache.arena.discard_free()  # what the last daemon left outside adopted slabs
    else:
        keep.rewrite_catalog([])
        keep.kept.seal()  # (an adopted directory has its header: the same shape, nothing to write)
    rec.seconds = time.perf_counter() - t0
    return rec


def _sane_slabs(keep: Keep, capacity: int) -> np.ndarray:
    """Ids of the live slab records that lie inside the arena, aligned, apart from each other."""
    s = keep.slabs
    sids = np.flatnonzero(s["live"] == 1)
    off, nb, pb, n = (s[f][sids].astype(np.int64) for f in ("offset", "nbytes", "page_bytes", "pages"))
    # Each bounded first, so that no sum or product below can wrap around.
    ok = ((off >= 0) & (off <= capacity) & (nb > 0) & (nb <= capacity) & (pb >= MIN_PAGE_BYTES)
          & (pb <= capacity) & (n >= 1) & (n <= MAX_SLAB_PAGES))
    off, nb, pb, n = (np.where(ok, a, 0) for a in (off, nb, pb, n))
    ok &= (off % REGION_ALIGN == 0) & (nb % REGION_ALIGN == 0) & (off + nb <= capacity) & (n * pb <= nb)
    sids, off, nb = sids[ok], off[ok], nb[ok]
    order = np.argsort(off, kind="stable")
    sids, off, nb = sids[order], off[order], nb[order]
    overlap = np.zeros(len(sids), bool)
    if len(sids) > 1:
        clash = off[1:] < off[:-1] + nb[:-1]
        overlap[1:] |= clash
        overlap[:-1] |= clash
    return sids[~overlap]


def _padded(words: np.ndarray, ids: np.ndarray, lens: np.ndarray) -> np.ndarray:
    """Whether each entry's key words are zero past its key (up to 32 bytes) or past its digest
    (a wider key), as every key the index files is: an entry that is not was not written by a
    daemon, and is not adopted (another key's page could otherwise pass for it). In chunks: a few
    MiB of temporaries at a time, whatever the table."""
    out = np.empty(len(ids), bool)
    col = np.arange(WORD_BYTES)
    for start in range(0, len(ids), 1 << 16):
        at = ids[start : start + (1 << 16)]
        n = lens[start : start + (1 << 16)].astype(np.int64)
        used = np.where(n > WORD_BYTES, DIGEST_BYTES, n)
        rows = words[at].view(np.uint8).reshape(len(at), WORD_BYTES)
        out[start : start + len(at)] = ~((rows != 0) & (col >= used[:, None])).any(axis=1)
    return out


def _adopt(cache: Any, keep: Keep, rec: Recovery) -> None:
    p, slabs, arena = cache.pages, keep.slabs, cache.arena
    top = min(p.size, keep.kept.extent("pages.state"))
    if not p.allocate(top):  # every record written below has its memory first: no SIGBUS
        raise OSError(f"no room in {keep.kept.path} for the records of {top} pages")
    catalog = keep.read_catalog()
    gids = np.array(sorted(catalog), np.int64)
    names = sorted({catalog[g][0].tenant for g in catalog})
    part_bytes = np.array([catalog[g][1].page_bytes for g in gids.tolist()], np.int64)
    part_tenant = np.array([names.index(catalog[g][0].tenant) for g in gids.tolist()], np.int64)
    cache.next_gid(max(catalog, default=-1) + 1)  # numbers in the files are never given again

    used = np.flatnonzero(p.state[:top] != UNUSED)
    rec.torn = int(np.count_nonzero(p.state[used] == WRITING))
    # Slabs whose pages are exactly their pages (count, offsets, page size).
    sane = np.isin(p.slab[used], _sane_slabs(keep, arena.capacity))
    rec.dropped += int(np.count_nonzero(p.state[used[~sane]] == COMMITTED))
    in_sane = used[sane]
    in_sane = in_sane[np.argsort(p.slab[in_sane], kind="stable")]
    sids, starts = np.unique(p.slab[in_sane], return_index=True)
    whole: list[tuple[int, np.ndarray]] = []
    for sid, ids in zip(sids.tolist(), np.split(in_sane, starts[1:]) if len(in_sane) else [], strict=True):
        r = slabs[sid]
        n, pb = int(r["pages"]), int(r["page_bytes"])
        rel = p.offset[ids] - int(r["offset"])
        if len(ids) == n and rel.min() >= 0 and rel.max() < n * pb and not (rel % pb).any() \
                and np.unique(rel // pb).size == n:
            whole.append((sid, ids))
        else:
            rec.dropped += int(np.count_nonzero(p.state[ids] == COMMITTED))
    ids = np.concatenate([w[1] for w in whole]) if whole else np.empty(0, np.int64)
    sid_of = np.repeat(np.array([w[0] for w in whole], np.int64), [len(w[1]) for w in whole])
    # Committed pages whose part is known with the slab's page size and whose key is sane.
    com = p.state[ids] == COMMITTED
    cids, csid = ids[com], sid_of[com]
    owners, lens = p.index.owner[cids].astype(np.int64), p.index.lens[cids]
    at = np.minimum(np.searchsorted(gids, owners), max(len(gids) - 1, 0))
    good = (lens >= 1) & (lens <= MAX_KEY_BYTES) & _padded(p.index.words, cids, lens)
    if len(gids):
        good &= (gids[at] == owners) & (part_bytes[at] == slabs["page_bytes"][csid])
    else:
        good[:] = False
    tenant = part_tenant[at] if len(gids) else np.zeros(len(cids), np.int64)
    # A slab holds one tenant's pages: one with two is not to be trusted.
    pairs = np.unique(np.stack([csid[good], tenant[good]]), axis=1)
    mixed = pairs[0][np.flatnonzero(np.diff(pairs[0]) == 0)]
    good &= ~np.isin(csid, mixed)
    # One page per key of a part (the index's invariant): later duplicates go.
    g = np.flatnonzero(good)
    words = p.index.words[cids[g]]
    order = np.lexsort((lens[g], *(words[:, i] for i in range(words.shape[1] - 1, -1, -1)), owners[g]))
    same = np.zeros(len(g), bool)
    if len(g) > 1:
        o = order
        same[o[1:]] = ((owners[g][o[1:]] == owners[g][o[:-1]]) & (words[o[1:]] == words[o[:-1]]).all(axis=1)
                       & (lens[g][o[1:]] == lens[g][o[:-1]]))
    good[g[same]] = False
    # The parts of the pages left, under their numbers (parts without pages are forgotten).
    parts, lines = {}, []
    for gid in np.unique(owners[good]).tolist():
        space_key, part_key, line = catalog[gid]
        try:
            parts[gid] = cache.adopt_part(space_key, part_key, gid)
            lines.append(line)
        except KVError as exc:  # the tenant's spaces are at their limit, or a clash: its pages go
            logger.warning("kept part %d of %s not adopted: %s", gid, space_key.model, exc)
    good &= np.isin(owners, np.fromiter(parts, np.int64, len(parts)))
    rec.dropped += int(np.count_nonzero(~good))
    # Slabs with at least one good page are adopted; everything else is let go: its records
    # here, its memory in ``adopt``.
    keep_sids = np.unique(csid[good])
    keep_mask = np.isin(sid_of, keep_sids)
    keep_ids = ids[keep_mask]
    p.state[np.setdiff1d(used, keep_ids, assume_unique=True)] = UNUSED
    for sid in np.setdiff1d(np.flatnonzero(slabs["live"] == 1), keep_sids).tolist():
        keep.slab_removed(sid)
    p.restore_ids(keep_ids)
    adopted, a_sid = cids[good], csid[good]  # grouped by slab, as ``whole`` is
    slab_tenant = dict(zip(a_sid.tolist(), tenant[good].tolist(), strict=True))
    first, last = np.searchsorted(a_sid, keep_sids), np.searchsorted(a_sid, keep_sids, side="right")
    by_slab = {sid: adopted[a:b] for sid, a, b in zip(keep_sids.tolist(), first.tolist(), last.tolist(),
                                                         strict=True)}
    for sid, sids_ids in whole:
        if sid not in slab_tenant:
            continue
        r = slabs[sid]
        mine = by_slab[sid]
        cache.slabs.adopt(sid, int(r["offset"]), int(r["nbytes"]), int(r["page_bytes"]),
                          cache.tenants.get(names[slab_tenant[sid]]).tid, sids_ids,
                          np.setdiff1d(sids_ids, mine, assume_unique=True))
        rec.adopted_bytes += len(mine) * int(r["page_bytes"])
    cache.adopt_pages(adopted)
    rec.adopted_pages = len(adopted)
    cache.slabs.adopted()
    p.restore_stamps()
    keep.rewrite_catalog(lines)
    rec.evicted = cache.trim_to_quotas()
