/* The node-wide cache as the data plane's thread sees it: the one lock that the event loop holds
 * around every change of the cache's index and pages (kvserver/store/lock.py), and the tables a Get
 * walks and holds pages in (kvserver/store/pages.py, index.py), read where the loop keeps them
 * (docs/design.md, "A Get on the data plane"), and a Put it stores files its keys in
 * (cache_store: "A Put on the data plane"), under that lock.
 *
 * The loop takes the lock (lock(), blocking, for as long as one of its cache operations runs); the
 * plane only tries it, for at most CACHE_LOCK_WAIT_NS, for one walk and its holds, and hands the Get
 * to the loop when it stays taken.
 * The tables never move (they are sized for every page the arena can hold), except the per-slab
 * counts, which grow by reallocation: the loop gives their new array (set_slabs) and the index's
 * bucket counters as they change (set_index), always with the lock held. */
#ifndef KVLANE_CACHE_H
#define KVLANE_CACHE_H

#include <Python.h>
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <time.h>

#include "../../store/csrc/hit.h"

enum { CT_WORDS, CT_LENS, CT_OWNER, CT_NEXT, CT_HEAD, CT_STATE, CT_OFFSET, CT_READERS, CT_SLAB, CT_SLAB_HOLDS,
       CT_PART, CT_COUNT, CT_STAMP, CT_SLAB_STAMP, CT_TICKS, CT_N };

typedef struct {
    PyObject_HEAD
    pthread_mutex_t mu;
    int held;   /* the loop holds mu (lock() until unlock()) */
    int open;   /* Gets may be served on the plane: tables given, the daemon not stopping */
    Py_buffer v[CT_N];
    int have[CT_N];
    kv_index ix;
    kv_pages pg;
    int32_t *readers;
    int64_t *slab_holds;
    int32_t *part;       /* per page: its part (pages.part), set as a Put stored here files it */
    int64_t *count;      /* the index's entries (KeyIndex.count's one item) */
    int64_t *stamp;      /* per page: its recency (pages.stamp), which a Lookup walked here sets */
    int64_t *slab_stamp; /* per slab: its pages' newest stamp (pages.slab_stamp), nslabs of them */
    int64_t *ticks;      /* the recency tick (pages.ticks' one item), shared with the loop's touch */
    char *arena;         /* where page offsets count from */
    int64_t arena_bytes; /* every page's chunks lie inside it */
    int whole;           /* only whole hits: a tier below or beside may hold what host memory misses */
    int64_t missed_ns;   /* when the plane last waited out CACHE_LOCK_WAIT_NS (its thread's alone) */
} Cache;

static void cache_release_view(Cache *c, int i) {
    if (c->have[i]) {
        PyBuffer_Release(&c->v[i]);
        c->have[i] = 0;
    }
}

static void cache_dealloc(Cache *c) {
    for (int i = 0; i < CT_N; i++)
        cache_release_view(c, i);
    pthread_mutex_destroy(&c->mu);
    Py_TYPE(c)->tp_free((PyObject *)c);
}

/* Cache(arena_address, arena_bytes, whole=False): whole, the plane serves only the calls whose
 * every key host memory holds (a daemon with a disk or cluster tier, where the loop reads a miss
 * back or asks the cluster), and a Lookup of host memory only (memory_only), which asks no tier:
 * any other is handed to the loop, nothing held. */
static int cache_init(Cache *c, PyObject *args, PyObject *kw) {
    static char *names[] = {"arena_address", "arena_bytes", "whole", NULL};
    unsigned long long arena;
    long long nbytes;
    int whole = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "KL|p", names, &arena, &nbytes, &whole))
        return -1;
    if (c->arena) {
        PyErr_SetString(PyExc_RuntimeError, "a Cache is made once");
        return -1;
    }
    if (!arena || nbytes <= 0) {
        PyErr_SetString(PyExc_ValueError, "the arena must have an address and a size");
        return -1;
    }
    pthread_mutex_init(&c->mu, NULL);
    c->arena = (char *)(uintptr_t)arena;
    c->arena_bytes = nbytes;
    c->whole = whole;
    return 0;
}

static int cache_held(Cache *c) {
    if (!c->held)
        PyErr_SetString(PyExc_RuntimeError, "the cache's tables change only under its lock");
    return c->held;
}

/* lock(): the loop's side, blocking (without the GIL while the plane holds it for a walk). */
static PyObject *cache_lock(Cache *c, PyObject *unused) {
    if (pthread_mutex_trylock(&c->mu) != 0) {
        Py_BEGIN_ALLOW_THREADS
        pthread_mutex_lock(&c->mu);
        Py_END_ALLOW_THREADS
    }
    c->held = 1;
    Py_RETURN_NONE;
}

static PyObject *cache_unlock(Cache *c, PyObject *unused) {
    if (!cache_held(c))
        return NULL;
    c->held = 0;
    pthread_mutex_unlock(&c->mu);
    Py_RETURN_NONE;
}

static int cache_take(Cache *c, int i, PyObject *obj, Py_ssize_t itemsize, int writable, const char *name) {
    Py_buffer v;
    if (PyObject_GetBuffer(obj, &v, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0)) < 0)
        return 0;
    if (v.itemsize != itemsize || v.len % itemsize) {
        PyBuffer_Release(&v);
        PyErr_Format(PyExc_ValueError, "%s: items of %zd bytes expected", name, itemsize);
        return 0;
    }
    cache_release_view(c, i);
    c->v[i] = v;
    c->have[i] = 1;
    return 1;
}

/* The index's bucket counters: nhead buckets in use, level, split (KeyIndex's). */
static int cache_index_state(Cache *c, Py_ssize_t nhead, unsigned long long level, unsigned long long split) {
    if (nhead < 0 || nhead > c->v[CT_HEAD].len / 4 || level == 0 || (level & (level - 1)) || split > level ||
        (Py_ssize_t)(level + split) > c->v[CT_HEAD].len / 4) {
        PyErr_SetString(PyExc_ValueError, "the index's bucket counters are not consistent with its tables");
        return 0;
    }
    c->ix.nhead = nhead;
    c->ix.level = level;
    c->ix.split = split;
    return 1;
}

/* set_tables(words, lens, owner, next, head, nhead, level, split, seeds, state, offset, readers,
 *            slab, slab_holds, part, count, stamp, slab_stamp, ticks): the index's tables and counters as
 * KeyIndex.tables() gives them, then the page tables (int8 state, int64 offset, int32 readers and
 * slab, one a page; int64 slab_holds, one a slab; int32 part, one a page), the index's count of
 * entries (int64, one item) and the pages' recency (int64 stamp, one a page; int64 slab_stamp, one
 * a slab; the tick, int64, one item). The index's tables, the states, parts and holds are written
 * here too: a Put the plane stores files its keys (cache_store); and the stamps and the tick: a
 * Lookup the plane walks makes its pages recent (cache_walk_hold). With the lock held. */
static PyObject *cache_set_tables(Cache *c, PyObject *args) {
    PyObject *o[CT_N];
    Py_ssize_t nhead;
    unsigned long long level, split, s[5];
    if (!PyArg_ParseTuple(args, "OOOOOnKK(KKKKK)OOOOOOOOOO", &o[CT_WORDS], &o[CT_LENS], &o[CT_OWNER], &o[CT_NEXT],
                          &o[CT_HEAD], &nhead, &level, &split, &s[0], &s[1], &s[2], &s[3], &s[4], &o[CT_STATE],
                          &o[CT_OFFSET], &o[CT_READERS], &o[CT_SLAB], &o[CT_SLAB_HOLDS], &o[CT_PART], &o[CT_COUNT],
                          &o[CT_STAMP], &o[CT_SLAB_STAMP], &o[CT_TICKS]))
        return NULL;
    if (!cache_held(c))
        return NULL;
    static const Py_ssize_t size[CT_N] = {8, 1, 4, 4, 4, 1, 8, 4, 4, 8, 4, 8, 8, 8, 8};
    static const char *names[CT_N] = {"words", "lens", "owner", "next", "head", "state", "offset", "readers",
                                      "slab", "slab_holds", "part", "count", "stamp", "slab_stamp", "ticks"};
    c->open = 0;
    for (int i = 0; i < CT_N; i++) /* written by a Put stored here (cache_store) but offsets and slabs */
        if (!cache_take(c, i, o[i], size[i], i != CT_OFFSET && i != CT_SLAB, names[i]))
            return NULL;
    Py_ssize_t cap = c->v[CT_LENS].len, npages = c->v[CT_STATE].len;
    if (c->v[CT_WORDS].len != 8 * KV_KEY_WORDS * cap || c->v[CT_OWNER].len != 4 * cap ||
        c->v[CT_NEXT].len != 4 * cap || c->v[CT_OFFSET].len != 8 * npages || c->v[CT_READERS].len != 4 * npages ||
        c->v[CT_SLAB].len != 4 * npages || c->v[CT_PART].len != 4 * npages || c->v[CT_COUNT].len != 8 ||
        c->v[CT_STAMP].len != 8 * npages || c->v[CT_SLAB_STAMP].len != c->v[CT_SLAB_HOLDS].len ||
        c->v[CT_TICKS].len != 8 || cap < npages) { /* (a page's id is its index entry's: a Put filed here writes both) */
        PyErr_SetString(PyExc_ValueError, "the cache's tables are not of one length");
        return NULL;
    }
    c->ix = (kv_index){c->v[CT_WORDS].buf, c->v[CT_LENS].buf, c->v[CT_OWNER].buf, c->v[CT_NEXT].buf,
                       c->v[CT_HEAD].buf, cap, 0, 1, 0, {s[0], s[1], s[2], s[3], s[4]}};
    if (!cache_index_state(c, nhead, level, split))
        return NULL;
    c->pg = (kv_pages){c->v[CT_STATE].buf, c->v[CT_OFFSET].buf, c->v[CT_SLAB].buf, npages,
                       c->v[CT_SLAB_HOLDS].len / 8};
    c->readers = c->v[CT_READERS].buf;
    c->slab_holds = c->v[CT_SLAB_HOLDS].buf;
    c->part = c->v[CT_PART].buf;
    c->count = c->v[CT_COUNT].buf;
    c->stamp = c->v[CT_STAMP].buf;
    c->slab_stamp = c->v[CT_SLAB_STAMP].buf;
    c->ticks = c->v[CT_TICKS].buf;
    c->open = 1;
    Py_RETURN_NONE;
}

/* set_index(nhead, level, split): the index's bucket counters after an insert split buckets. */
static PyObject *cache_set_index(Cache *c, PyObject *args) {
    Py_ssize_t nhead;
    unsigned long long level, split;
    if (!PyArg_ParseTuple(args, "nKK", &nhead, &level, &split) || !cache_held(c))
        return NULL;
    if (!c->have[CT_HEAD] || !cache_index_state(c, nhead, level, split)) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_RuntimeError, "set_tables first");
        c->open = 0;
        return NULL;
    }
    Py_RETURN_NONE;
}

/* set_slabs(slab_holds, slab_stamp): the per-slab arrays, grown (int64, one a slab, as many of
 * each). */
static PyObject *cache_set_slabs(Cache *c, PyObject *args) {
    PyObject *holds, *stamps;
    if (!PyArg_ParseTuple(args, "OO", &holds, &stamps) || !cache_held(c))
        return NULL;
    if (!cache_take(c, CT_SLAB_HOLDS, holds, 8, 1, "slab_holds") ||
        !cache_take(c, CT_SLAB_STAMP, stamps, 8, 1, "slab_stamp")) {
        c->open = 0;
        return NULL;
    }
    if (c->v[CT_SLAB_STAMP].len != c->v[CT_SLAB_HOLDS].len) {
        PyErr_SetString(PyExc_ValueError, "slab_holds and slab_stamp must have an entry for every slab");
        c->open = 0;
        return NULL;
    }
    c->slab_holds = c->v[CT_SLAB_HOLDS].buf;
    c->slab_stamp = c->v[CT_SLAB_STAMP].buf;
    c->pg.nslabs = c->v[CT_SLAB_HOLDS].len / 8;
    Py_RETURN_NONE;
}

/* close(): no Get is walked on the plane from now on (the daemon stops). */
static PyObject *cache_close(Cache *c, PyObject *unused) {
    if (!cache_held(c))
        return NULL;
    c->open = 0;
    Py_RETURN_NONE;
}

static PyObject *cache_get_open(Cache *c, void *unused) { return PyBool_FromLong(c->open); }
static PyObject *cache_get_held(Cache *c, void *unused) { return PyBool_FromLong(c->held); }
static PyObject *cache_get_whole(Cache *c, void *unused) { return PyBool_FromLong(c->whole); }

static PyMethodDef cache_methods[] = {
    {"lock", (PyCFunction)cache_lock, METH_NOARGS, NULL},
    {"unlock", (PyCFunction)cache_unlock, METH_NOARGS, NULL},
    {"set_tables", (PyCFunction)cache_set_tables, METH_VARARGS, NULL},
    {"set_index", (PyCFunction)cache_set_index, METH_VARARGS, NULL},
    {"set_slabs", (PyCFunction)cache_set_slabs, METH_VARARGS, NULL},
    {"close", (PyCFunction)cache_close, METH_NOARGS, NULL},
    {NULL},
};

static PyGetSetDef cache_getset[] = {
    {"open", (getter)cache_get_open, NULL, NULL, NULL},
    {"held", (getter)cache_get_held, NULL, NULL, NULL},
    {"whole", (getter)cache_get_whole, NULL, NULL, NULL},
    {NULL},
};

static PyTypeObject CacheType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "kvserver.lane._kvlane.Cache",
    .tp_basicsize = sizeof(Cache),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)cache_init,
    .tp_dealloc = (destructor)cache_dealloc,
    .tp_methods = cache_methods,
    .tp_getset = cache_getset,
};

/* The plane's side, for one Get: the leading keys (their words) filed under `owner` with a committed
 * page whose chunks lie inside the arena, those pages held (as PageTable.hold; not with hold 0, a
 * Lookup's walk, whose pages `touch` makes recent here, as the loop's Lookup does: kv_touch);
 * ids[0..m) and offsets[0..m). -1: the lock is the loop's (cache_try_lock), the
 * cache is closed, a table is corrupt, or (`whole`: the call counts on a tier below or beside host memory, as in a
 * whole-hits cache) a key is missed: nothing held, the loop serves the call. `chunks` (layer,
 * part) chunks of `lp_stride` bytes a page. */
/* The most the plane waits for the lock the loop holds before it hands a call over: the loop's
 * settle of the plane's last Get, which it takes as the engine's next one comes, holds it for
 * microseconds, and a call handed over costs the loop's whole path (a hundred microseconds and
 * more); the loop's longer holds (a step of a large Put) are handed over after this. Within
 * CACHE_LOCK_LONG_NS of a wait that ran out, the loop is likely still in that long hold: the calls
 * then try the lock once, so that a queue of them does not keep the thread (and the other lanes'
 * copies) waiting one after another. */
#define CACHE_LOCK_WAIT_NS 20000
#define CACHE_LOCK_LONG_NS 200000

/* The monotonic clock in nanoseconds: the plane's one clock (kvlane.c's too). */
static int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

/* Takes the lock within CACHE_LOCK_WAIT_NS (none, soon after a wait ran out), yielding the CPU at
 * every try; 0 if it did not. The plane's thread alone calls it. */
static int cache_try_lock(Cache *c) {
    if (pthread_mutex_trylock(&c->mu) == 0)
        return 1;
    int64_t now = now_ns(), until = now + CACHE_LOCK_WAIT_NS;
    if (c->missed_ns && now - c->missed_ns < CACHE_LOCK_LONG_NS)
        return 0;
    do {
        sched_yield();
        if (pthread_mutex_trylock(&c->mu) == 0)
            return 1;
        now = now_ns();
    } while (now < until);
    c->missed_ns = now;
    return 0;
}

static int64_t cache_walk_hold(Cache *c, const uint64_t *words, uint8_t len, int64_t n, int32_t owner,
                               int64_t chunks, int64_t lp_stride, int64_t *ids, int64_t *offsets, int hold,
                               int whole, int touch) {
    if (!cache_try_lock(c))
        return -1;
    int64_t m = -1;
    if (c->open) {
        m = kv_hit_prefix(&c->ix, &c->pg, words, len, n, owner, ids, offsets);
        for (int64_t k = 0; k < m; k++)
            if (offsets[k] < 0 || offsets[k] > c->arena_bytes || (c->arena_bytes - offsets[k]) / lp_stride < chunks)
                m = -1;
        if (whole && m < n) /* a tier may hold the rest: the loop reads it back, or asks */
            m = -1;
        for (int64_t k = 0; k < m && hold; k++) { /* every id and slab checked inside the tables by the walk */
            c->readers[ids[k]] += 1;
            c->slab_holds[c->pg.slab[ids[k]]] += 1;
        }
        if (touch && !hold && m > 0)
            kv_touch(c->stamp, c->pg.slab, c->slab_stamp, ids, m, c->ticks);
    }
    pthread_mutex_unlock(&c->mu);
    return m;
}

/* The plane's side, for a scheduler's Lookup of a whole space: the leading keys every one of the
 * space's nparts parts (gids) holds, walked as KVCache.lookup_packed walks them, each part over
 * the keys the parts before it hold, nothing held; part k's page ids into ids[k * m .. (k + 1) * m)
 * for the m it returns (ids: room for nparts * n; offsets: scratch of n). -1 as cache_walk_hold:
 * the lock is the loop's, the cache is closed, a table is corrupt, or (`whole`) a key is missed. */
static int64_t cache_walk_space(Cache *c, const uint64_t *words, uint8_t len, int64_t n, const int32_t *gids,
                                int32_t nparts, int64_t *ids, int64_t *offsets, int whole) {
    if (!cache_try_lock(c))
        return -1;
    int64_t m = c->open ? n : -1;
    for (int32_t k = 0; k < nparts && m > 0; k++)
        m = kv_hit_prefix(&c->ix, &c->pg, words, len, m, gids[k], ids + (int64_t)k * n, offsets);
    pthread_mutex_unlock(&c->mu);
    if (whole && m < n) /* a tier may hold the rest: the loop reads it back, or asks */
        return -1;
    for (int32_t k = 1; k < nparts && m > 0; k++) /* packed: part k's first m, after part k - 1's */
        memmove(ids + (int64_t)k * m, ids + (int64_t)k * n, sizeof(int64_t) * (size_t)m);
    return m;
}

/* The plane's side, for a Put whose pages it copied (slots.h's finish_put): with the lock held
 * and the cache open, files key (words w, `len` bytes) under part `owner` at page `id`, one of the
 * pages the loop gave its gate (Engine.stash: being written, in no part, inside the tables),
 * unless the part holds the key already (stored meanwhile by another Put, or an earlier key of the
 * same Put was the same; the caller has made sure none is being written): 1 filed, 0 held already,
 * -1 not filed (a bucket outside the counters: never, with set_index's checks). The page is filed
 * as the loop's Put files one (KeyIndex.insert, PageTable.commit): its entry whole before it is
 * linked (so a walk of the loop's that takes no lock, as a Lookup's settle, finds it whole or not
 * at all), its state last (so a kept record is committed only once whole), and held once (as a Get
 * holds its pages: its slab's hold of a page being written becomes a reader's), so that nothing
 * evicts it before the loop settles it (counts it, makes it recent, lets it go:
 * CacheOps._stored, KVCache.settle_stored). The index may pass its load until the loop's next
 * change splits its buckets (KeyIndex.fit): a chain is longer meanwhile, never wrong. */
static int cache_store(Cache *c, int64_t id, const uint64_t *w, uint8_t len, int32_t owner) {
    if (kv_index_find_one(&c->ix, w, len, owner) >= 0)
        return 0;
    kv_index_rw rw = {(uint64_t *)c->ix.words, (uint8_t *)c->ix.lens, (int32_t *)c->ix.owner, (int32_t *)c->ix.next,
                      (int32_t *)c->ix.head, c->ix.cap, c->ix.nhead, c->v[CT_HEAD].len / 4, c->ix.level, c->ix.split,
                      {c->ix.s[0], c->ix.s[1], c->ix.s[2], c->ix.s[3], c->ix.s[4]}};
    memcpy(rw.words + KV_KEY_WORDS * id, w, KV_WORD_BYTES);
    rw.lens[id] = len;
    rw.owner[id] = owner;
    __atomic_thread_fence(__ATOMIC_RELEASE); /* the entry whole before any chain reaches it */
    if (!kv_index_link(&rw, id)) {
        rw.owner[id] = -1;
        return -1;
    }
    c->part[id] = owner;
    c->readers[id] += 1;
    __atomic_store_n((int8_t *)&c->pg.state[id], (int8_t)KV_COMMITTED, __ATOMIC_RELEASE);
    *c->count += 1;
    return 1;
}

#endif
