/* kvserver.store._kvindex: the key index's lookups and changes in C (index.h), called by
 * KeyIndex.find, insert and remove with the index's own arrays; a request's keys as the index
 * keeps them (hit.h's kv_keys_words: padded, or past 32 bytes digested as digest.h does), called
 * by Keys.unpack; the digests alone (for tests); the page table's hold and touch (PageTable's);
 * and a Get's hit from its packed keys to its held pages in one call (hit.h,
 * PageTable.hold_hit). Every array is taken through the buffer protocol, its type, alignment and
 * length checked against the others before a key is read or an entry changed. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

#include "digest.h"
#include "hit.h"
#include "index.h"
#include "../../protocol/csrc/sources.h"

typedef struct {
    Py_buffer v;
    int held;
} view;

/* Takes obj's buffer as an aligned, C-contiguous array of `kind` items: 'i' and 'u' signed and
 * unsigned integers of `itemsize` bytes (the struct module's codes numpy gives them). */
static int take(PyObject *obj, view *out, char kind, Py_ssize_t itemsize, int writable, const char *name) {
    int flags = PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(obj, &out->v, flags) < 0)
        return 0;
    out->held = 1;
    const char *f = out->v.format ? out->v.format : "B";
    if (*f == '@' || *f == '=' || *f == '<')
        f++;
    char code = f[0] && !f[1] ? f[0] : 0;
    int ok = out->v.itemsize == itemsize && !((uintptr_t)out->v.buf % (uintptr_t)itemsize);
    if (kind == 'u')
        ok &= itemsize == 1 ? code == 'B' : itemsize == 4 ? code == 'I' : code == 'L' || code == 'Q';
    else
        ok &= itemsize == 1 ? code == 'b' : itemsize == 4 ? code == 'i' : code == 'l' || code == 'q';
    if (!ok) {
        PyErr_Format(PyExc_ValueError, "%s: not an aligned array of %zd-byte %s integers", name, itemsize,
                     kind == 'u' ? "unsigned" : "signed");
        return 0;
    }
    return 1;
}

/* find(out, words, lens, owner, ewords, elens, eowner, next, head, nhead, level, split, seeds)
 *   out: int64[n] (written), words: uint64[n, KV_KEY_WORDS], lens: uint8[n]: the keys asked about;
 *   ewords: uint64[cap, KV_KEY_WORDS], elens: uint8[cap], eowner, next: int32[cap], head:
 *   int32[>= nhead]: the index's tables; level, split: its linear-hashing state; seeds: its five
 *   hash seeds (a tuple). */
static PyObject *find(PyObject *self, PyObject *args) {
    PyObject *objs[8];
    int owner;
    Py_ssize_t nhead;
    unsigned long long level, split, s[5];
    if (!PyArg_ParseTuple(args, "OOOiOOOOOnKK(KKKKK)", &objs[0], &objs[1], &objs[2], &owner, &objs[3],
                          &objs[4], &objs[5], &objs[6], &objs[7], &nhead, &level, &split, &s[0], &s[1],
                          &s[2], &s[3], &s[4]))
        return NULL;
    static const Py_ssize_t size[8] = {8, 8, 1, 8, 1, 4, 4, 4};
    static const char kind[8] = {'i', 'u', 'u', 'u', 'u', 'i', 'i', 'i'};
    static const char *names[8] = {"out", "words", "lens", "ewords", "elens", "eowner", "next", "head"};
    view v[8] = {{{0}}};
    PyObject *result = NULL;
    for (int i = 0; i < 8; i++)
        if (!take(objs[i], &v[i], kind[i], size[i], i == 0, names[i]))
            goto done;
    Py_ssize_t n = v[0].v.len / 8, cap = v[4].v.len;
    if (v[1].v.len != 8 * KV_KEY_WORDS * n || v[2].v.len != n) {
        PyErr_SetString(PyExc_ValueError, "out, words and lens must hold the same keys");
        goto done;
    }
    if (v[3].v.len != 8 * KV_KEY_WORDS * cap || v[5].v.len != 4 * cap || v[6].v.len != 4 * cap) {
        PyErr_SetString(PyExc_ValueError, "the index's entry tables must be of one length");
        goto done;
    }
    if (nhead < 0 || nhead > v[7].v.len / 4 || level == 0 || (level & (level - 1)) || split > level) {
        PyErr_SetString(PyExc_ValueError, "the index's buckets are not consistent");
        goto done;
    }
    kv_index ix = {v[3].v.buf, v[4].v.buf, v[5].v.buf, v[6].v.buf, v[7].v.buf, cap, nhead, level, split,
                   {s[0], s[1], s[2], s[3], s[4]}};
    kv_index_find(&ix, v[1].v.buf, v[2].v.buf, 0, n, owner, v[0].v.buf);
    result = Py_None;
    Py_INCREF(result);
done:
    for (int i = 0; i < 8; i++)
        if (v[i].held)
            PyBuffer_Release(&v[i].v);
    return result;
}

/* The index's tables for a change: ewords, elens, eowner, next, head (writable) and its state,
 * checked as find checks them, and the head table's length as the room for splits. */
static int rw_tables(PyObject **objs, view *v, Py_ssize_t nhead, unsigned long long level,
                     unsigned long long split, const unsigned long long s[5], kv_index_rw *w) {
    static const Py_ssize_t size[5] = {8, 1, 4, 4, 4};
    static const char kind[5] = {'u', 'u', 'i', 'i', 'i'};
    static const char *names[5] = {"ewords", "elens", "eowner", "next", "head"};
    for (int i = 0; i < 5; i++)
        if (!take(objs[i], &v[i], kind[i], size[i], 1, names[i]))
            return 0;
    Py_ssize_t cap = v[1].v.len;
    if (v[0].v.len != 8 * KV_KEY_WORDS * cap || v[2].v.len != 4 * cap || v[3].v.len != 4 * cap ||
        cap > INT32_MAX) {
        PyErr_SetString(PyExc_ValueError, "the index's entry tables must be of one length");
        return 0;
    }
    if (nhead < 0 || nhead > v[4].v.len / 4 || level == 0 || (level & (level - 1)) || split > level ||
        (unsigned long long)nhead != level + split) {
        PyErr_SetString(PyExc_ValueError, "the index's buckets are not consistent");
        return 0;
    }
    kv_index_rw t = {v[0].v.buf, v[1].v.buf, v[2].v.buf, v[3].v.buf, v[4].v.buf, cap, nhead, v[4].v.len / 4,
                     level, split, {s[0], s[1], s[2], s[3], s[4]}};
    *w = t;
    return 1;
}

/* Entry ids as int64[n], each in [0, cap): checked before any is used. */
static int entry_ids(PyObject *obj, view *v, const kv_index_rw *w) {
    if (!take(obj, v, 'i', 8, 0, "ids"))
        return 0;
    const int64_t *ids = v->v.buf;
    for (Py_ssize_t i = 0; i < v->v.len / 8; i++)
        if (ids[i] < 0 || ids[i] >= w->cap) {
            PyErr_Format(PyExc_ValueError, "entry id %lld is outside the index's %lld entries",
                         (long long)ids[i], (long long)w->cap);
            return 0;
        }
    return 1;
}

/* link(ids, ewords, elens, eowner, next, head, nhead, level, split, seeds) -> int
 *   files entries ids (their keys and owners already written, none of them filed) at the heads of
 *   their buckets' chains (KeyIndex.insert; the split that may follow is split()).
 * unlink(the same) -> int
 *   takes entries ids out of their chains and marks them gone (KeyIndex.remove).
 * Both return how many of the ids they filed or found (all, in a consistent index). */
static PyObject *change(PyObject *args, int (*one)(kv_index_rw *, int64_t)) {
    PyObject *objs[6];
    Py_ssize_t nhead;
    unsigned long long level, split, s[5];
    if (!PyArg_ParseTuple(args, "OOOOOOnKK(KKKKK)", &objs[0], &objs[1], &objs[2], &objs[3], &objs[4],
                          &objs[5], &nhead, &level, &split, &s[0], &s[1], &s[2], &s[3], &s[4]))
        return NULL;
    view v[6] = {{{0}}};
    kv_index_rw w;
    PyObject *result = NULL;
    if (!rw_tables(objs + 1, v + 1, nhead, level, split, s, &w) || !entry_ids(objs[0], &v[0], &w))
        goto done;
    const int64_t *ids = v[0].v.buf;
    long long n = 0;
    for (Py_ssize_t i = 0; i < v[0].v.len / 8; i++)
        n += one(&w, ids[i]);
    result = PyLong_FromLongLong(n);
done:
    for (int i = 0; i < 6; i++)
        if (v[i].held)
            PyBuffer_Release(&v[i].v);
    return result;
}

static PyObject *link_(PyObject *self, PyObject *args) { return change(args, kv_index_link); }
static PyObject *unlink_(PyObject *self, PyObject *args) { return change(args, kv_index_unlink); }

/* split(count, load, ewords, elens, eowner, next, head, nhead, level, split, seeds)
 *   -> (nhead, level, split): buckets split until count entries average at most load a bucket. */
static PyObject *split_(PyObject *self, PyObject *args) {
    PyObject *objs[5];
    Py_ssize_t nhead, count, load;
    unsigned long long level, split, s[5];
    if (!PyArg_ParseTuple(args, "nnOOOOOnKK(KKKKK)", &count, &load, &objs[0], &objs[1], &objs[2], &objs[3],
                          &objs[4], &nhead, &level, &split, &s[0], &s[1], &s[2], &s[3], &s[4]))
        return NULL;
    view v[5] = {{{0}}};
    kv_index_rw w;
    PyObject *result = NULL;
    if (!rw_tables(objs, v, nhead, level, split, s, &w))
        goto done;
    if (count < 0 || load < 1) {
        PyErr_SetString(PyExc_ValueError, "count must be >= 0 and load >= 1");
        goto done;
    }
    if (!kv_index_split_to(&w, count, load)) {
        PyErr_SetString(PyExc_ValueError, "the head table has no room for the buckets the entries need");
        goto done;
    }
    result = Py_BuildValue("nKK", (Py_ssize_t)w.nhead, (unsigned long long)w.level, (unsigned long long)w.split);
done:
    for (int i = 0; i < 5; i++)
        if (v[i].held)
            PyBuffer_Release(&v[i].v);
    return result;
}

/* The checks digests() and words() share, made before a byte is read or written: out (its view
 * taken into `out`) an aligned uint64 array of `per_key` bytes for each of the n keys of key_bytes
 * (1 to max_bytes) bytes packed in `in`. n, or -1 with a Python error. */
static Py_ssize_t packed_keys(PyObject *out_obj, view *out, const Py_buffer *in, Py_ssize_t key_bytes,
                              Py_ssize_t max_bytes, Py_ssize_t per_key, const char *each) {
    if (!take(out_obj, out, 'u', 8, 1, "out"))
        return -1;
    if (key_bytes < 1 || key_bytes > max_bytes) {
        PyErr_Format(PyExc_ValueError, "key_bytes must be in [1, %zd], got %zd", max_bytes, key_bytes);
        return -1;
    }
    Py_ssize_t n = in->len / key_bytes;
    if (in->len != n * key_bytes || out->v.len % per_key || out->v.len / per_key != n) {
        PyErr_Format(PyExc_ValueError, "packed must hold whole keys, and out %s for each", each);
        return -1;
    }
    return n;
}

/* digests(out, packed, key_bytes, lanes=0)
 *   packed: n keys of key_bytes (1 to 128) bytes each, back to back; out: uint64[n, 2] (written),
 *   each key's 16-byte digest (digest.h). lanes: 0 picks the widest path the CPU has; 1, 4 or 8
 *   force the scalar, AVX2 or AVX-512 path (tests; refused where the CPU lacks it).
 *   The GIL is kept: a step of keys takes tens of microseconds, and a thread that gives the GIL
 *   up on the event loop may wait a whole switch interval (5 ms) to get it back. */
static PyObject *digests(PyObject *self, PyObject *args) {
    PyObject *out_obj;
    Py_buffer in;
    Py_ssize_t key_bytes;
    int lanes = 0;
    if (!PyArg_ParseTuple(args, "Oy*n|i", &out_obj, &in, &key_bytes, &lanes))
        return NULL;
    view out = {{0}};
    PyObject *result = NULL;
    Py_ssize_t n = packed_keys(out_obj, &out, &in, key_bytes, KV_DIGEST_MAX_INPUT, KV_DIGEST_BYTES, "a digest");
    if (n < 0)
        goto done;
    if (lanes && ((lanes != 1 && lanes != 4 && lanes != 8) || !(kv_digest_lanes() & lanes))) {
        PyErr_Format(PyExc_ValueError, "lanes must be 0 or a path this CPU has (%d), got %d", kv_digest_lanes(),
                     lanes);
        goto done;
    }
    kv_digests(in.buf, (size_t)key_bytes, (size_t)n, out.v.buf, lanes);
    result = Py_None;
    Py_INCREF(result);
done:
    if (out.held)
        PyBuffer_Release(&out.v);
    PyBuffer_Release(&in);
    return result;
}

/* words(out, packed, key_bytes)
 *   packed: n keys of key_bytes (1 to 64) bytes each, back to back; out: uint64[n, KV_KEY_WORDS]
 *   (written), each key as the index keeps it (hit.h's kv_keys_words): whole and zero-padded up to
 *   32 bytes, else its digest, zero-padded. */
static PyObject *words_(PyObject *self, PyObject *args) {
    PyObject *out_obj;
    Py_buffer in;
    Py_ssize_t key_bytes;
    if (!PyArg_ParseTuple(args, "Oy*n", &out_obj, &in, &key_bytes))
        return NULL;
    view out = {{0}};
    PyObject *result = NULL;
    Py_ssize_t n = packed_keys(out_obj, &out, &in, key_bytes, 64, KV_WORD_BYTES, "the words");
    if (n >= 0) {
        kv_keys_words(in.buf, key_bytes, n, out.v.buf);
        result = Py_None;
        Py_INCREF(result);
    }
    if (out.held)
        PyBuffer_Release(&out.v);
    PyBuffer_Release(&in);
    return result;
}

/* digest_lanes(): the paths this CPU has, as a mask of their widths (1 | 4 | 8). */
static PyObject *digest_lanes(PyObject *self, PyObject *unused) { return PyLong_FromLong(kv_digest_lanes()); }

/* The tables hold and touch take, in this order: a per-page table of `item`-byte signed integers
 * (written), `slab` (int32, an entry for every page), a per-slab int64 table (written) and the
 * page ids (int64). Every id, and its slab, is checked inside the tables before anything is
 * changed; 0 with a Python error if one is not (the views taken so far are released by the caller). */
static int page_tables(PyObject **objs, Py_ssize_t item, const char *first, const char *per_slab, view *v) {
    const Py_ssize_t size[4] = {item, 4, 8, 8};
    const char *names[4] = {first, "slab", per_slab, "ids"};
    for (int i = 0; i < 4; i++)
        if (!take(objs[i], &v[i], 'i', size[i], i == 0 || i == 2, names[i]))
            return 0;
    Py_ssize_t pages = v[0].v.len / item, slabs = v[2].v.len / 8, n = v[3].v.len / 8;
    const int32_t *slab = v[1].v.buf;
    const int64_t *ids = v[3].v.buf;
    if (v[1].v.len / 4 < pages) {
        PyErr_SetString(PyExc_ValueError, "slab must have an entry for every page");
        return 0;
    }
    for (Py_ssize_t k = 0; k < n; k++)
        if (ids[k] < 0 || ids[k] >= pages || slab[ids[k]] < 0 || slab[ids[k]] >= slabs) {
            PyErr_Format(PyExc_ValueError, "page id %lld, or its slab, is outside the tables", (long long)ids[k]);
            return 0;
        }
    return 1;
}

static void release_views(view *v, int n) {
    for (int i = 0; i < n; i++)
        if (v[i].held)
            PyBuffer_Release(&v[i].v);
}

/* hold(counts, slab, slab_holds, ids, n): counts[id] += n and slab_holds[slab[id]] += n for each id
 *   (repeats count each time), as PageTable.hold's np.add.at pair. counts, slab: int32[pages];
 *   slab_holds: int64[slabs]; ids: int64. Out of its table (page_tables), nothing is changed. */
static PyObject *hold(PyObject *self, PyObject *args) {
    PyObject *objs[4];
    long long by;
    if (!PyArg_ParseTuple(args, "OOOOL", &objs[0], &objs[1], &objs[2], &objs[3], &by))
        return NULL;
    view v[4] = {{{0}}};
    PyObject *result = NULL;
    if (page_tables(objs, 4, "counts", "slab_holds", v)) {
        int32_t *counts = v[0].v.buf;
        const int32_t *slab = v[1].v.buf;
        int64_t *holds = v[2].v.buf;
        const int64_t *ids = v[3].v.buf;
        for (Py_ssize_t k = 0, n = v[3].v.len / 8; k < n; k++) {
            counts[ids[k]] += (int32_t)by;
            holds[slab[ids[k]]] += by;
        }
        result = Py_None;
        Py_INCREF(result);
    }
    release_views(v, 4);
    return result;
}

/* touch(stamp, slab, slab_stamp, ids, ticks) -> the tick after: the pages made recent, the first
 *   the most (kv_touch, as PageTable.touch's numpy), the recency tick ticks[0] (int64[1], shared
 *   with the data plane's thread) raised by len(ids). stamp, slab_stamp: int64; slab: int32; ids:
 *   int64; checked as hold checks them. */
static PyObject *touch(PyObject *self, PyObject *args) {
    PyObject *objs[5];
    if (!PyArg_ParseTuple(args, "OOOOO", &objs[0], &objs[1], &objs[2], &objs[3], &objs[4]))
        return NULL;
    view v[5] = {{{0}}};
    PyObject *result = NULL;
    if (page_tables(objs, 8, "stamp", "slab_stamp", v) && take(objs[4], &v[4], 'i', 8, 1, "ticks")) {
        if (v[4].v.len != 8) {
            PyErr_SetString(PyExc_ValueError, "ticks must be one int64");
        } else {
            int64_t *ticks = v[4].v.buf;
            kv_touch(v[0].v.buf, v[1].v.buf, v[2].v.buf, v[3].v.buf, v[3].v.len / 8, ticks);
            result = PyLong_FromLongLong(__atomic_load_n(ticks, __ATOMIC_RELAXED));
        }
    }
    release_views(v, 5);
    return result;
}

/* hit(ids, offsets, packed, key_bytes, owner, ewords, elens, eowner, next, head, nhead, level, split,
 *     seeds, state, offset, readers, slab, slab_holds, hold=True) -> m
 *   KVCache.prepare_get's walk and holds for the keys packed in `packed` (key_bytes each, 1 to 64):
 *   the leading m of them filed under `owner` with a committed page (hit.h), their page ids and
 *   offsets in ids[:m] and offsets[:m] (int64, one entry a key; what follows m in them means
 *   nothing), and each of those pages
 *   held once (readers and its slab's slab_holds, as PageTable.hold; not with hold False: a Put's
 *   check that its keys are all stored already). The index's tables and state
 *   as find takes them; state: int8, offset: int64, readers, slab: int32, one entry a page each;
 *   slab_holds: int64, one a slab. Nothing is changed unless every table is consistent (else
 *   ValueError), every page of the hit included. The keys are taken 64 at a time (padded, or
 *   digested past KV_WORD_BYTES, then looked up): a walk that ends early reads no key past the
 *   64 it ended in. */
static PyObject *hit(PyObject *self, PyObject *args) {
    PyObject *objs[12];
    Py_buffer in;
    Py_ssize_t key_bytes, nhead;
    int owner;
    unsigned long long level, split, s[5];
    int hold = 1;
    if (!PyArg_ParseTuple(args, "OOy*niOOOOOnKK(KKKKK)OOOOO|p", &objs[0], &objs[1], &in, &key_bytes, &owner,
                          &objs[2], &objs[3], &objs[4], &objs[5], &objs[6], &nhead, &level, &split, &s[0],
                          &s[1], &s[2], &s[3], &s[4], &objs[7], &objs[8], &objs[9], &objs[10], &objs[11],
                          &hold))
        return NULL;
    static const Py_ssize_t size[12] = {8, 8, 8, 1, 4, 4, 4, 1, 8, 4, 4, 8};
    static const char kind[12] = {'i', 'i', 'u', 'u', 'i', 'i', 'i', 'i', 'i', 'i', 'i', 'i'};
    static const char *names[12] = {"ids", "offsets", "ewords", "elens", "eowner", "next", "head",
                                    "state", "offset", "readers", "slab", "slab_holds"};
    view v[12] = {{{0}}};
    PyObject *result = NULL;
    for (int i = 0; i < 12; i++)
        if (!take(objs[i], &v[i], kind[i], size[i], i < 2 || i == 9 || i == 11, names[i]))
            goto done;
    if (key_bytes < 1 || key_bytes > 64 || in.len % key_bytes) {
        PyErr_SetString(PyExc_ValueError, "packed must hold whole keys of 1 to 64 bytes");
        goto done;
    }
    Py_ssize_t n = in.len / key_bytes, cap = v[3].v.len, npages = v[7].v.len;
    if (v[0].v.len != 8 * n || v[1].v.len != 8 * n) {
        PyErr_SetString(PyExc_ValueError, "ids and offsets must have an entry for every key");
        goto done;
    }
    if (v[2].v.len != 8 * KV_KEY_WORDS * cap || v[4].v.len != 4 * cap || v[5].v.len != 4 * cap ||
        nhead < 0 || nhead > v[6].v.len / 4 || level == 0 || (level & (level - 1)) || split > level) {
        PyErr_SetString(PyExc_ValueError, "the index's tables are not consistent");
        goto done;
    }
    if (v[8].v.len != 8 * npages || v[9].v.len != 4 * npages || v[10].v.len != 4 * npages) {
        PyErr_SetString(PyExc_ValueError, "the page tables must be of one length");
        goto done;
    }
    kv_index ix = {v[2].v.buf, v[3].v.buf, v[4].v.buf, v[5].v.buf, v[6].v.buf, cap, nhead, level, split,
                   {s[0], s[1], s[2], s[3], s[4]}};
    kv_pages pg = {v[7].v.buf, v[8].v.buf, v[10].v.buf, npages, v[11].v.len / 8};
    int64_t *ids = v[0].v.buf, *offsets = v[1].v.buf;
    const uint8_t *keys = in.buf;
    int64_t m = 0;
    enum { BLOCK = 64 }; /* keys a step: their words on the stack */
    uint64_t words[BLOCK * KV_KEY_WORDS];
    for (Py_ssize_t at = 0; at < n;) {
        Py_ssize_t k = n - at < BLOCK ? n - at : BLOCK;
        kv_keys_words(keys + at * key_bytes, key_bytes, k, words);
        int64_t got = kv_hit_prefix(&ix, &pg, words, (uint8_t)key_bytes, k, owner, ids + at, offsets + at);
        if (got < 0) {
            PyErr_SetString(PyExc_ValueError, "the index names a page outside the page tables");
            goto done;
        }
        m += got;
        if (got < k)
            break;
        at += k;
    }
    int32_t *readers = v[9].v.buf;
    const int32_t *slab = v[10].v.buf;
    int64_t *holds = v[11].v.buf;
    for (int64_t k = 0; k < m && hold; k++) { /* every id and slab checked inside the tables by the walk */
        readers[ids[k]] += 1;
        holds[slab[ids[k]]] += 1;
    }
    result = PyLong_FromLongLong(m);
done:
    release_views(v, 12);
    PyBuffer_Release(&in);
    return result;
}

static PyMethodDef methods[] = {
    {"hit", hit, METH_VARARGS, "A Get's leading stored keys, from its packed keys, their pages held."},
    {"hold", hold, METH_VARARGS, "Adds n to the counts of pages, and of their slabs' holds."},
    {"touch", touch, METH_VARARGS, "Stamps pages as used, in order, and their slabs with them."},
    {"find", find, METH_VARARGS, "Entry ids of keys under an owner in the index's tables, -1 where absent."},
    {"link", link_, METH_VARARGS, "Files entries at the heads of their buckets' chains."},
    {"unlink", unlink_, METH_VARARGS, "Takes entries out of their chains and marks them gone."},
    {"split", split_, METH_VARARGS, "Splits buckets until the entries average at most load a bucket."},
    {"digests", digests, METH_VARARGS, "The 16-byte digests of wide keys (BLAKE2b, as keys.py's)."},
    {"words", words_, METH_VARARGS, "Keys as the index keeps them: whole up to 32 bytes, else their digests."},
    {"digest_lanes", digest_lanes, METH_NOARGS, "The digest paths this CPU has: a mask of 1, 4 and 8."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_kvindex", NULL, -1, methods};

PyMODINIT_FUNC PyInit__kvindex(void) { return kv_with_sources(PyModule_Create(&module)); }
