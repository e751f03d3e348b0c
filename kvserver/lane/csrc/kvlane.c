/* The compiled data plane: serves the fast lane's binary Write and Load (request.h) on its own
 * thread, without the GIL and without the event loop (docs/design.md, "The data plane").
 *
 * One Engine per daemon runs one thread. It watches every lane's submit doorbell with epoll; a
 * wake-up drains the doorbell and looks once at each slot it is not already serving. While it
 * spins with no copy to run (and few lanes: AWAKE_MAX_SLOTS) it says so in every ring's awake word
 * and looks at every slot itself, so that clients need not ring (docs/lane.md, "Ringing only a
 * sleeper"). A SUBMITTED slot is marked TAKEN and its request copied out of the ring. A
 * binary Write or Load that kv_accept() finds certainly valid, for a registration whose Gate is
 * open and which has no copy running on the Python side, becomes a job here: its host pages are
 * checked as allocated and marked busy under the Gate's lock (the lock Free takes), and it is
 * copied in pieces of at most PIECE_BYTES, loads before writes (a load waits only for the earlier
 * writes of its registration that touch its pages or slots, as kvserver/copies/order.py orders
 * them), publishing each load's per-layer progress in the slot and ringing its done doorbell (at
 * most once per progress interval before the end, and on a quiet ring only for a client that
 * sleeps there). A lane Get (protobuf) of a registration whose Gate knows its cache part
 * (set_cache) is served whole here too (try_get): read and checked (get.h), its keys walked in the
 * cache's index and its pages held under the cache's lock, which this thread only tries for a few
 * microseconds (cache.h), copied as a Load is, its end posted back with the pages it held
 * (take_gets); and so is the
 * engine's Lookup of that part (try_answer), walked and answered, nothing held. Everything else
 * (the other protobuf calls, Put, CUDA pools, any request the check refuses) is handed to Python
 * in arrival order through a queue and an eventfd, and answered there by the one validation. The
 * loop's copies of a registration (a Put's, a Get's) come back here to be copied (submit_copy),
 * their ends posted on the same eventfd; a lane Get's copy also answers its slot here, as a Load's
 * job does.
 *
 * Python changes what the thread uses only through commands that the thread carries out between
 * pieces and acknowledges (add or remove a lane, close a gate): once remove_lane() returns, the
 * thread no longer touches that ring or its sockets. A Gate's addresses (host region, device
 * buffers) stay valid until close_gate() returns; its jobs are stopped there.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <poll.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "../../copies/csrc/stream.h"
#include "cache.h"
#include "cuda.h"
#include "get.h"
#include "request.h"
#include "../../protocol/csrc/sources.h"

/* The ring's layout: kvserver/protocol/ring.py. */
#define HEADER_BYTES 64
#define SLOT_HEADER_BYTES 128
#define REQUEST_BYTES (64 * 1024)
#define RESPONSE_BYTES 1024
#define ERROR_BYTES (3 * 1024)
#define REQUEST_AT SLOT_HEADER_BYTES
#define RESPONSE_AT (REQUEST_AT + REQUEST_BYTES)
#define ERROR_AT (RESPONSE_AT + RESPONSE_BYTES)
#define SLOT_BYTES (ERROR_AT + ERROR_BYTES)
#define MAX_SLOTS 64
#define AWAKE_AT 32    /* ring header: nonzero while this thread looks at the slots unrung */
#define PLANE_AT 36    /* ring header: this thread reads the ring's submit doorbell: PLANE_* */
#define PLANE_ASLEEP 1  /* ... and sleeps in epoll_wait: a ring ahead of a call wakes it */
#define PLANE_RUNNING 2 /* ... and runs (copies, spins, serves): a ring ahead is not needed */
#define WAITING_AT 72  /* slot header: the client sleeps on the slot's done doorbell (quiet lanes) */
#define BUSY_AT 80     /* slot header: this thread's time on the call, in microseconds */
#define ST_SUBMITTED 1
#define ST_TAKEN 2
#define ST_DONE 3
#define RPC_PUT 3
#define RPC_GET 4
#define RPC_LOOKUP 7
#define RPC_WRITE_B 5
#define RPC_LOAD_B 6
#define RPC_COPIES_LAST 6 /* ids 1 to 6 name copies (Write, Load, Put, Get and the binary two: ring.py) */
#define FLAG_DONE 1
#define FLAG_JOB_ENDED 2
#define FLAG_PLANE_GET 4 /* a Get this thread served whole (try_get): its client's next one likely is too */
#define MAX_DRAIN 64
#define PIECE_BYTES (512 * 1024)
/* Bytes of loads copied in a row while a write waited, after which the write gets a piece: the copy
 * workers' WRITE_EVERY pieces of CHUNK_BYTES (copies/workers.py), 16 MiB. A piece here is at most
 * one (layer, part) of a job, so a count of pieces would let a write into a small load. */
#define WRITE_EVERY_BYTES (16LL << 20)
#define WRITE_TURN_BYTES (2LL << 20) /* what writes then copy before loads go first again */
#define MAX_EDGES 32
/* An answering copy of at most this many bytes, submitted while the plane has no other job (so it
 * runs at once), publishes its first step (the pages found) without ringing, and rings a sleeping
 * waiter next a progress interval later or at its end, which comes within a few hundred
 * microseconds: one wake-up of the engine for a small Get, not one for its first step, one for
 * its first layer and one for its end. */
#define QUIET_FIRST_BYTES (1LL << 20)
/* The thread says it is awake (and looks at slots unrung) only while it spins with no copy to run,
 * and only while the watched lanes have at most this many slots: a look at every slot is a cache
 * and TLB miss each (a slot is 68 KiB), and a node of many idle lanes would make each look long. */
#define AWAKE_MAX_SLOTS 256

#define CODE_NOT_FOUND 5
#define CODE_RESOURCE_EXHAUSTED 8
#define CODE_DEADLINE 4

/* ---- Gate: what the data plane may do for one registration ---------------------------------- */

typedef struct {
    PyObject_HEAD
    pthread_mutex_t mu;       /* busy marks, ownership reads, counters, closed */
    pthread_mutex_t check_mu; /* the check's scratch marks */
    int closed;
    kv_limits lim;
    PyObject *owned_obj; /* keeps the allocator's bitmap alive */
    Py_buffer owned_view;
    int32_t *busy;          /* per page: copies of this plane using it */
    int32_t *wpages, *wdev; /* per page / device token: unfinished writes touching it */
    uint32_t generation;
    char *host_base;      /* the region's first page */
    int64_t page_bytes;   /* bytes of one host page (every layer and part) */
    int64_t token_bytes;  /* bytes of one token of one (layer, part) */
    int32_t parts;
    char **dev_bases;     /* [layer * parts + part] */
    int64_t dev_stride;   /* bytes between device tokens */
    int64_t py_inflight;  /* copies of this registration on the Python side */
    int64_t c_inflight;   /* jobs of this plane */
    int64_t x_inflight;   /* the loop's copies this plane runs for it (submit_copy) */
    uint64_t bytes_written, write_ops, bytes_loaded, load_ops, served;
    int64_t last_call_ns;
    /* The plane thread's alone: what ``work()``'s pass over the jobs has seen of this gate so far. */
    uint64_t order_pass;
    int order_any, order_loads;
    /* Gets served whole on the plane (set_cache): its cache part (-1: none, every Get is the loop's),
     * the loop's name for it in their ends, its client id, its cache pages' (layer, part) chunk
     * stride, the most keys a Get may have, and the bytes from which the copy workers split a load
     * (0: never). */
    int32_t cache_gid;
    int64_t cache_token, cache_lp_stride, cache_max_keys, cache_split_bytes;
    char *client_id;
    uint64_t client_id_len;
    /* A space's gate (space_gate()): its lane carries a scheduler's Lookups of one whole space
     * (client_id holds the space id), walked in each of its nparts parts, space_gids (set_space;
     * cache_gid is the first); no pool, no copy, nothing else of this plane's. */
    int space;
    int32_t *space_gids;
    int32_t nparts;
    /* Free cache pages the loop set aside for this registration's Puts (Engine.stash): being
     * written, in no part, its tenant's; a Put of keys its part lacks takes them here (try_put).
     * The cache's lock guards them (the loop's stash and unstash, the plane's take). */
    int64_t *stash, nstash, capstash;
    int64_t stash_full; /* the pages the loop keeps it at (stash()) */
    int stash_short;    /* a Put a full stash would have held found it short (the loop fills it then) */
    /* A CUDA pool's gate (set_cuda): its Writes and Loads are put on the pool's stream through the
     * driver's entry points and completed by polling their events ("CUDA jobs" below). */
    int cuda;
    kv_cuda_driver cu;
    void *cu_ctx, *cu_stream;
    void **cu_events;       /* the layer events: [slot * num_layers + local layer] */
    int64_t cu_host_shift;  /* added to a host address of the region: the GPU's address of it */
    int64_t cu_wait_ns;     /* no progress this long: the pool's GPU work is given up on */
    int64_t cu_max_copies, cu_min_copy_bytes, cu_small_copies; /* which jobs it takes (cuda_takes) */
    /* Driver calls it has on its stream for jobs not ended (the plane thread's alone), and the most
     * it may: a stream stalled behind an engine's event that never fires fills the driver's queue,
     * and a call into a full queue waits for room, which would hold this thread for every engine. */
    int64_t cu_queued, cu_max_queued;
    /* The copy kernel (set_cuda_kernels): its CUfunction per word (8, 4, 2, 1 bytes; NULL: none, a
     * job of many small rows is the loop's), and the pinned, mapped area its arguments go in (the
     * bases and offsets a job's launches read), a ring handed out in the gate's job order. */
    void *cu_kernels[4];
    char *cu_args;
    int64_t cu_args_bytes, cu_args_shift, cu_args_head, cu_args_tail; /* head, tail: bytes ever handed out / back */
    int32_t cu_max_blocks, cu_warps;
    unsigned char (*cu_ready)[64]; /* engines' ready events the loop opened (add_ready), under mu */
    void **cu_ready_ev;
    int cu_nready;
    char cu_failed[256];    /* why its GPU work is given up on (the plane's, set once, under mu) */
    uint64_t cu_jobs;       /* CUDA jobs the plane took */
} Gate;

static void gate_dealloc(Gate *g) {
    pthread_mutex_destroy(&g->mu);
    pthread_mutex_destroy(&g->check_mu);
    if (g->owned_obj) {
        PyBuffer_Release(&g->owned_view);
        Py_DECREF(g->owned_obj);
    }
    free(g->busy);
    free(g->wpages);
    free(g->wdev);
    free(g->lim.page_mark);
    free(g->lim.dev_mark);
    free(g->dev_bases);
    free(g->client_id);
    free(g->space_gids);
    free(g->stash);
    free(g->cu_events);
    free(g->cu_ready);
    free(g->cu_ready_ev);
    Py_TYPE(g)->tp_free((PyObject *)g);
}

static int gate_init(Gate *g, PyObject *args, PyObject *kw) {
    static char *names[] = {"owned", "host_base", "page_bytes", "page_size", "token_bytes", "parts",
                            "start_layer", "num_layers", "epoch", "dev_tokens", "dev_bases",
                            "dev_stride", "max_indices", NULL};
    PyObject *owned, *bases;
    unsigned long long host_base;
    long long page_bytes, page_size, token_bytes, epoch, dev_tokens, dev_stride, max_indices;
    int parts, start_layer, num_layers;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OKLLLiiiLLOLL", names, &owned, &host_base, &page_bytes,
                                     &page_size, &token_bytes, &parts, &start_layer, &num_layers, &epoch,
                                     &dev_tokens, &bases, &dev_stride, &max_indices))
        return -1;
    if (g->owned_obj || g->space) {
        PyErr_SetString(PyExc_RuntimeError, "a Gate is made once");
        return -1;
    }
    if (page_bytes <= 0 || page_size <= 0 || token_bytes <= 0 || parts <= 0 || num_layers <= 0 ||
        dev_tokens <= 0 || dev_stride < token_bytes || max_indices <= 0 || start_layer < 0) {
        PyErr_SetString(PyExc_ValueError, "a gate's geometry must be positive");
        return -1;
    }
    if (PyObject_GetBuffer(owned, &g->owned_view, PyBUF_WRITABLE) < 0) /* release_if_idle writes it */
        return -1;
    g->owned_obj = owned;
    Py_INCREF(owned);
    int64_t num_pages = g->owned_view.len;
    Py_ssize_t nb = PySequence_Size(bases);
    if (nb != (Py_ssize_t)num_layers * parts) {
        PyErr_SetString(PyExc_ValueError, "dev_bases must hold num_layers * parts addresses");
        return -1;
    }
    g->dev_bases = calloc((size_t)nb, sizeof(char *));
    g->busy = calloc((size_t)num_pages + 1, sizeof(int32_t));
    g->wpages = calloc((size_t)num_pages + 1, sizeof(int32_t));
    g->wdev = calloc((size_t)dev_tokens, sizeof(int32_t));
    g->lim.page_mark = calloc((size_t)num_pages + 1, sizeof(uint32_t));
    g->lim.dev_mark = calloc((size_t)dev_tokens, sizeof(uint32_t));
    if (!g->dev_bases || !g->busy || !g->wpages || !g->wdev || !g->lim.page_mark || !g->lim.dev_mark) {
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < nb; i++) {
        PyObject *item = PySequence_GetItem(bases, i);
        if (!item)
            return -1;
        unsigned long long a = PyLong_AsUnsignedLongLong(item);
        Py_DECREF(item);
        if (PyErr_Occurred())
            return -1;
        g->dev_bases[i] = (char *)(uintptr_t)a;
    }
    pthread_mutex_init(&g->mu, NULL);
    pthread_mutex_init(&g->check_mu, NULL);
    g->cache_gid = -1;
    g->lim.epoch = epoch;
    g->lim.num_pages = num_pages;
    g->lim.page_size = page_size;
    g->lim.dev_tokens = dev_tokens;
    g->lim.max_indices = max_indices;
    g->lim.start_layer = start_layer;
    g->lim.num_layers = num_layers;
    g->lim.owned = (const uint8_t *)g->owned_view.buf;
    g->lim.generation = &g->generation;
    g->host_base = (char *)(uintptr_t)host_base;
    g->page_bytes = page_bytes;
    g->token_bytes = token_bytes;
    g->parts = parts;
    g->dev_stride = dev_stride;
    if ((int64_t)num_layers * parts * page_size * token_bytes > page_bytes) {
        PyErr_SetString(PyExc_ValueError, "a host page is smaller than its layers' chunks");
        return -1;
    }
    return 0;
}

/* Pages as an int64 buffer; -1 on error (set). */
static int pages_of(PyObject *obj, Py_buffer *view, Gate *g) {
    if (g->space) {
        PyErr_SetString(PyExc_TypeError, "a space's gate has no pages");
        return -1;
    }
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0)
        return -1;
    if (view->itemsize != 8) {
        PyBuffer_Release(view);
        PyErr_SetString(PyExc_TypeError, "pages must be int64");
        return -1;
    }
    const int64_t *p = view->buf;
    for (Py_ssize_t i = 0; i < view->len / 8; i++)
        if (p[i] < 0 || p[i] >= g->lim.num_pages) {
            PyBuffer_Release(view);
            PyErr_SetString(PyExc_ValueError, "page outside the region");
            return -1;
        }
    return 0;
}

/* release_if_idle(pages) -> bool: when no copy of this plane uses any of the pages, marks them
 * not allocated (the allocator's own bitmap, under the lock the plane checks it under) and says
 * True: the caller then frees them in its allocator. False: some are busy, nothing changed. */
static PyObject *gate_release_if_idle(Gate *g, PyObject *arg) {
    Py_buffer view;
    if (pages_of(arg, &view, g) < 0)
        return NULL;
    const int64_t *p = view.buf;
    Py_ssize_t n = view.len / 8;
    int idle = 1;
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&g->mu);
    for (Py_ssize_t i = 0; i < n && idle; i++)
        idle = g->busy[p[i]] == 0;
    if (idle)
        for (Py_ssize_t i = 0; i < n; i++)
            ((uint8_t *)g->lim.owned)[p[i]] = 0;
    pthread_mutex_unlock(&g->mu);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&view);
    return PyBool_FromLong(idle);
}

static PyObject *gate_py_enter(Gate *g, PyObject *unused) {
    pthread_mutex_lock(&g->mu);
    g->py_inflight++;
    int64_t c = g->c_inflight;
    pthread_mutex_unlock(&g->mu);
    return PyLong_FromLongLong(c);
}

static PyObject *gate_py_exit(Gate *g, PyObject *unused) {
    pthread_mutex_lock(&g->mu);
    if (g->py_inflight > 0)
        g->py_inflight--;
    pthread_mutex_unlock(&g->mu);
    Py_RETURN_NONE;
}

/* take_counters() -> (bytes_written, write_ops, bytes_loaded, load_ops, served, last_call_ns),
 * zeroing all but the last: what this plane did since the last take. */
static PyObject *gate_take_counters(Gate *g, PyObject *unused) {
    pthread_mutex_lock(&g->mu);
    PyObject *r = Py_BuildValue("KKKKKL", g->bytes_written, g->write_ops, g->bytes_loaded, g->load_ops,
                                g->served, (long long)g->last_call_ns);
    g->bytes_written = g->write_ops = g->bytes_loaded = g->load_ops = g->served = 0;
    pthread_mutex_unlock(&g->mu);
    return r;
}

static PyObject *gate_get_inflight(Gate *g, void *unused) {
    pthread_mutex_lock(&g->mu);
    int64_t c = g->c_inflight;
    pthread_mutex_unlock(&g->mu);
    return PyLong_FromLongLong(c);
}

static PyObject *gate_get_x_inflight(Gate *g, void *unused) {
    pthread_mutex_lock(&g->mu);
    int64_t c = g->x_inflight;
    pthread_mutex_unlock(&g->mu);
    return PyLong_FromLongLong(c);
}

static PyObject *gate_get_py_inflight(Gate *g, void *unused) {
    pthread_mutex_lock(&g->mu);
    int64_t c = g->py_inflight;
    pthread_mutex_unlock(&g->mu);
    return PyLong_FromLongLong(c);
}

static PyObject *gate_get_closed(Gate *g, void *unused) {
    return PyBool_FromLong(__atomic_load_n(&g->closed, __ATOMIC_ACQUIRE));
}

/* check(request bytes) -> bool: whether kv_accept() takes it, ownership included (for tests: the
 * differential check against the Python validation). */
static PyObject *gate_check(Gate *g, PyObject *arg) {
    Py_buffer view;
    if (g->space)
        Py_RETURN_FALSE; /* it takes no Write or Load */
    if (PyObject_GetBuffer(arg, &view, PyBUF_SIMPLE) < 0)
        return NULL;
    kv_request r;
    int ok = 0;
    int64_t *pages = NULL;
    int32_t *local = malloc(sizeof(int32_t) * (size_t)g->lim.num_layers);
    uint32_t nl = 0;
    pthread_mutex_lock(&g->check_mu);
    if (local && kv_parse(view.buf, (uint64_t)view.len, &r)) {
        pages = malloc(sizeof(int64_t) * ((size_t)r.n_pages + 1));
        if (pages && kv_accept(&r, &g->lim, pages, local, &nl)) {
            ok = 1;
            pthread_mutex_lock(&g->mu);
            for (uint32_t k = 0; k < r.n_pages; k++)
                if (!g->lim.owned[pages[k]])
                    ok = 0;
            pthread_mutex_unlock(&g->mu);
        }
    }
    pthread_mutex_unlock(&g->check_mu);
    free(pages);
    free(local);
    PyBuffer_Release(&view);
    return PyBool_FromLong(ok);
}

/* set_cache(gid, token, client_id, lp_stride, max_keys, split_bytes): this registration's lane Gets
 * may be served whole on the plane from now on (once; the loop has found that its checks all pass
 * but the request's own): its cache part `gid`, `token` in their ends (take_gets), its client id
 * (bytes), its cache pages' (layer, part) chunk stride, the most keys a Get may have there, and
 * the load bytes from which the copy workers split a copy (0: never; such a Get is the loop's). */
static PyObject *gate_set_cache(Gate *g, PyObject *args) {
    int gid;
    long long token, lp_stride, max_keys, split_bytes;
    Py_buffer id;
    if (!PyArg_ParseTuple(args, "iLy*LLL", &gid, &token, &id, &lp_stride, &max_keys, &split_bytes))
        return NULL;
    int ok = !g->space && !__atomic_load_n(&g->cuda, __ATOMIC_ACQUIRE) && gid >= 0 &&
             lp_stride >= g->lim.page_size * g->token_bytes && max_keys > 0 && split_bytes >= 0;
    if (ok && __atomic_load_n(&g->cache_gid, __ATOMIC_ACQUIRE) < 0) {
        g->client_id = malloc((size_t)id.len + 1);
        if (!g->client_id) {
            PyBuffer_Release(&id);
            return PyErr_NoMemory();
        }
        memcpy(g->client_id, id.buf, (size_t)id.len);
        g->client_id_len = (uint64_t)id.len;
        g->cache_token = token;
        g->cache_lp_stride = lp_stride;
        g->cache_max_keys = max_keys;
        g->cache_split_bytes = split_bytes;
        __atomic_store_n(&g->cache_gid, gid, __ATOMIC_RELEASE); /* last: the plane reads it first */
    }
    PyBuffer_Release(&id);
    if (!ok) {
        PyErr_SetString(PyExc_ValueError, "a cache part, a chunk stride of a page's tokens and a positive key limit");
        return NULL;
    }
    Py_RETURN_NONE;
}

/* The most (key, part) pairs a space's Lookup may walk here (the loop bounds them tighter). */
#define SPACE_MAX_PAIRS (1 << 20)

/* set_space(token, space_id, gids, max_keys) on a space's gate: its lane's Lookups of the space
 * `space_id` (bytes) may be answered on the plane from now on (once; the loop has found that the
 * space has every part, which it then keeps): walked in the parts `gids` (int32 ids, in the loop's
 * order of them), `token` in their ends (take_gets), at most max_keys keys a Lookup. */
static PyObject *gate_set_space(Gate *g, PyObject *args) {
    long long token, max_keys;
    Py_buffer id, gids;
    if (!PyArg_ParseTuple(args, "Ly*y*L", &token, &id, &gids, &max_keys))
        return NULL;
    Py_ssize_t n = gids.len / 4;
    int ok = g->space && id.len > 0 && gids.len % 4 == 0 && n >= 1 && n <= SPACE_MAX_PAIRS && max_keys > 0 &&
             max_keys <= SPACE_MAX_PAIRS / n;
    for (Py_ssize_t k = 0; ok && k < n; k++)
        ok = ((const int32_t *)gids.buf)[k] >= 0;
    if (ok && __atomic_load_n(&g->cache_gid, __ATOMIC_ACQUIRE) < 0) {
        g->client_id = malloc((size_t)id.len);
        g->space_gids = malloc((size_t)gids.len);
        if (!g->client_id || !g->space_gids) {
            free(g->client_id);
            free(g->space_gids);
            g->client_id = NULL;
            g->space_gids = NULL;
            PyBuffer_Release(&id);
            PyBuffer_Release(&gids);
            return PyErr_NoMemory();
        }
        memcpy(g->client_id, id.buf, (size_t)id.len);
        memcpy(g->space_gids, gids.buf, (size_t)gids.len);
        g->client_id_len = (uint64_t)id.len;
        g->nparts = (int32_t)n;
        g->cache_token = token;
        g->cache_max_keys = max_keys;
        __atomic_store_n(&g->cache_gid, g->space_gids[0], __ATOMIC_RELEASE); /* last: the plane reads it first */
    }
    PyBuffer_Release(&id);
    PyBuffer_Release(&gids);
    if (!ok) {
        PyErr_SetString(PyExc_ValueError, "a space's gate takes its space id, its parts' ids and a positive key limit");
        return NULL;
    }
    Py_RETURN_NONE;
}

/* A cache call the plane serves whole, as read and checked (check_cache_call). */
typedef struct {
    const unsigned char *keys; /* inside the request */
    uint64_t key_bytes, timeout_ms;
    int64_t nkeys;
    uint32_t nl;     /* a Get's layers (local[0..nl)) */
    int memory_only; /* a Lookup of host memory's pages only */
} cache_call;

/* Reads and checks `buf` (n bytes), a Get, Lookup or Put of rpc id `rpc` on the gate's lane, as
 * try_get and try_answer serve them (get.h): 1 if it is certainly valid for the gate's part; a
 * Get's and a Put's device pages into dev (room for cache_max_keys), a Get's local layers into
 * local (room for num_layers). The gate must have its part (set_cache). */
static int check_cache_call(Gate *g, uint32_t rpc, const unsigned char *buf, uint64_t n, cache_call *out,
                            int64_t *dev, int32_t *local) {
    kv_get_limits gl = {g->client_id, g->client_id_len, g->cache_max_keys};
    memset(out, 0, sizeof *out);
    if (rpc == RPC_LOOKUP) {
        kv_lookup q;
        if (!kv_lookup_parse(buf, n, &q) ||
            !(g->space ? kv_space_lookup_accept(&q, &gl, &out->nkeys) : kv_lookup_accept(&q, &gl, &out->nkeys)))
            return 0;
        out->keys = q.keys;
        out->key_bytes = q.key_bytes;
        out->memory_only = q.memory_only != 0;
        return 1;
    }
    kv_get q;
    if (g->space || !(rpc == RPC_GET ? kv_get_parse(buf, n, &q) : rpc == RPC_PUT && kv_put_parse(buf, n, &q)))
        return 0;
    pthread_mutex_lock(&g->check_mu); /* the marks are the gate's scratch */
    int ok = kv_get_accept(&q, &g->lim, &gl, dev, local, &out->nkeys, &out->nl);
    pthread_mutex_unlock(&g->check_mu);
    out->keys = q.keys;
    out->key_bytes = q.key_bytes;
    out->timeout_ms = q.timeout_ms;
    return ok;
}

/* check_call(rpc, request bytes) -> bool: whether the plane would read and take this lane Get,
 * Lookup or Put (check_cache_call; a Put it then serves if its stash holds pages for the keys not
 * stored: try_put): for tests,
 * the differential checks against protobuf and the loop's checks. False until the gate has its
 * part. */
static PyObject *gate_check_call(Gate *g, PyObject *args) {
    unsigned int rpc;
    Py_buffer view;
    if (!PyArg_ParseTuple(args, "Iy*", &rpc, &view))
        return NULL;
    int ok = 0;
    if (__atomic_load_n(&g->cache_gid, __ATOMIC_ACQUIRE) >= 0) {
        int64_t *dev = malloc(sizeof(int64_t) * (size_t)g->cache_max_keys);
        int32_t *local = malloc(sizeof(int32_t) * (size_t)(g->lim.num_layers ? g->lim.num_layers : 1));
        cache_call call;
        ok = dev && local && check_cache_call(g, rpc, view.buf, (uint64_t)view.len, &call, dev, local);
        free(dev);
        free(local);
    }
    PyBuffer_Release(&view);
    return PyBool_FromLong(ok);
}

static PyObject *gate_get_space(Gate *g, void *unused) { return PyBool_FromLong(g->space); }

/* Pages in the gate's stash (read without the cache's lock: a count the plane may be lowering). */
static PyObject *gate_get_stashed(Gate *g, void *unused) {
    return PyLong_FromLongLong(__atomic_load_n(&g->nstash, __ATOMIC_RELAXED));
}

/* Whether a Put that a full stash would have held found it short since the last stash(). */
static PyObject *gate_get_stash_short(Gate *g, void *unused) {
    return PyBool_FromLong(__atomic_load_n(&g->stash_short, __ATOMIC_RELAXED));
}

static PyObject *gate_get_cache_gid(Gate *g, void *unused) {
    return PyLong_FromLong(__atomic_load_n(&g->cache_gid, __ATOMIC_ACQUIRE));
}

/* ---- a CUDA pool's gate ----------------------------------------------------------------------- */

/* The n addresses of sequence `seq` into out[]; -1 (set) if one is not an int, or, where `what`
 * names them, is 0 (NULL). */
static int addresses(PyObject *seq, void **out, Py_ssize_t n, const char *what) {
    for (Py_ssize_t k = 0; k < n; k++) {
        PyObject *item = PySequence_GetItem(seq, k);
        if (!item)
            return -1;
        out[k] = (void *)(uintptr_t)PyLong_AsUnsignedLongLong(item);
        Py_DECREF(item);
        if (PyErr_Occurred())
            return -1;
        if (what && !out[k]) {
            PyErr_Format(PyExc_ValueError, "%s is NULL", what);
            return -1;
        }
    }
    return 0;
}

#define CU_MAX_READY 16 /* engines' ready events a gate knows: more go to the loop, which opens them */
/* Driver calls the plane may have on all gates' streams for jobs not ended (each gate at most its
 * set_cuda max_queued): past it, jobs are the loop's, whose copy workers may wait in the driver. */
#define CU_PLANE_QUEUED_MAX 16384

/* set_cuda(driver, ctx, stream, events, slots, host_shift, wait_seconds, max_copies, min_copy_bytes,
 * small_copies, max_queued): this gate's pool is a CUDA pool's, once, before its lane is added: its copies are
 * the GPU's, put on `stream` (a CUstream of context `ctx`) through `driver` (the addresses of the
 * KV_CU_ENTRY_POINTS entry points, in kv_cuda_driver's order), a load recording its layers' events
 * (`events`, slots * num_layers CUevents, slot-major), a write one of its own. `host_shift` turns a
 * host address of the region into the GPU's; no progress for `wait_seconds` gives the pool's GPU
 * work up (cuda_failed). A job of more than `max_copies` cuMemcpyAsync, or of more than
 * `small_copies` with one of fewer than `min_copy_bytes` bytes, is the copy kernel's (the loop's
 * unless set_cuda_kernels); one that would put more than `max_queued` driver calls on the stream
 * for jobs not ended is the loop's. Loads may then name event slots below `slots`, and requests carry a ready
 * event (64 bytes) the plane waits on if the loop gave it that event (add_ready). */
static PyObject *gate_set_cuda(Gate *g, PyObject *args) {
    PyObject *driver, *events;
    unsigned long long ctx, stream;
    int slots;
    long long shift, max_copies, min_copy_bytes, small_copies, max_queued;
    double wait;
    if (!PyArg_ParseTuple(args, "OKKOiLdLLLL", &driver, &ctx, &stream, &events, &slots, &shift, &wait,
                          &max_copies, &min_copy_bytes, &small_copies, &max_queued))
        return NULL;
    if (g->space || !g->owned_obj || g->cuda || g->cache_gid >= 0 || g->capstash) {
        PyErr_SetString(PyExc_RuntimeError, "set_cuda is for a new pool's gate, once, before any cache use");
        return NULL;
    }
    if (slots <= 0 || !(wait > 0) || max_copies <= 0 || min_copy_bytes < 0 || small_copies < 0 ||
        max_queued <= 0) {
        PyErr_SetString(PyExc_ValueError, "set_cuda's slots, wait and copy limits must be positive");
        return NULL;
    }
    if (PySequence_Size(driver) != KV_CU_ENTRY_POINTS) {
        PyErr_SetString(PyExc_ValueError, "the driver table has one address per entry point");
        return NULL;
    }
    Py_ssize_t ne = PySequence_Size(events);
    if (ne != (Py_ssize_t)slots * g->lim.num_layers) {
        PyErr_SetString(PyExc_ValueError, "events must hold slots * num_layers events");
        return NULL;
    }
    void *fn[KV_CU_ENTRY_POINTS];
    if (addresses(driver, fn, KV_CU_ENTRY_POINTS, "a driver entry point") < 0)
        return NULL;
    void **ev = calloc((size_t)ne, sizeof(void *));
    unsigned char(*ready)[64] = calloc(CU_MAX_READY, 64);
    void **ready_ev = calloc(CU_MAX_READY, sizeof(void *));
    if (!ev || !ready || !ready_ev) {
        free(ev);
        free(ready);
        free(ready_ev);
        return PyErr_NoMemory();
    }
    if (addresses(events, ev, ne, NULL) < 0) {
        free(ev);
        free(ready);
        free(ready_ev);
        return NULL;
    }
    memcpy(&g->cu, fn, sizeof fn); /* kv_cuda_driver is KV_CU_ENTRY_POINTS pointers, in this order */
    g->cu_ctx = (void *)(uintptr_t)ctx;
    g->cu_stream = (void *)(uintptr_t)stream;
    g->cu_events = ev;
    g->cu_ready = ready;
    g->cu_ready_ev = ready_ev;
    g->cu_host_shift = shift;
    g->cu_wait_ns = (int64_t)(wait * 1e9);
    g->cu_max_copies = max_copies;
    g->cu_min_copy_bytes = min_copy_bytes;
    g->cu_small_copies = small_copies;
    g->cu_max_queued = max_queued;
    pthread_mutex_lock(&g->check_mu);
    g->lim.max_event_slot = (uint32_t)slots - 1;
    g->lim.ready_len = 64;
    pthread_mutex_unlock(&g->check_mu);
    __atomic_store_n(&g->cuda, 1, __ATOMIC_RELEASE);
    Py_RETURN_NONE;
}

/* set_cuda_kernels(functions, args_host, args_bytes, args_shift, max_blocks, warps): a CUDA gate's
 * jobs of many small rows (past set_cuda's copy limits) are the copy kernel's launches from now on
 * (once, after set_cuda and before its lane is added): `functions`, the kernel's CUfunction for a
 * word of 8, 4, 2 and 1 bytes (media/cuda/kernels.py, loaded for the pool's device); `args_host`,
 * `args_bytes` bytes of pinned host memory mapped for the device (`args_shift` added to a host
 * address of it gives the device's), where a job's bases and offsets go; grids of at most
 * `max_blocks` blocks of `warps` warps. */
static PyObject *gate_set_cuda_kernels(Gate *g, PyObject *args) {
    PyObject *functions;
    unsigned long long host;
    long long nbytes, shift;
    int max_blocks, warps;
    if (!PyArg_ParseTuple(args, "OKLLii", &functions, &host, &nbytes, &shift, &max_blocks, &warps))
        return NULL;
    if (!g->cuda || g->cu_kernels[0]) {
        PyErr_SetString(PyExc_RuntimeError, "set_cuda_kernels is for a CUDA gate, once");
        return NULL;
    }
    if (!host || host % 16 || nbytes < 4096 || nbytes % 16 || max_blocks <= 0 || warps <= 0 || warps > 32 ||
        PySequence_Size(functions) != 4) {
        PyErr_SetString(PyExc_ValueError, "set_cuda_kernels takes 4 functions, an aligned area of 4 KiB "
                        "or more in 16-byte steps, and a positive grid");
        return NULL;
    }
    void *fn[4];
    if (addresses(functions, fn, 4, "a kernel function") < 0)
        return NULL;
    g->cu_args = (char *)(uintptr_t)host;
    g->cu_args_bytes = nbytes;
    g->cu_args_shift = shift;
    g->cu_max_blocks = max_blocks;
    g->cu_warps = warps;
    memcpy(g->cu_kernels, fn, sizeof fn); /* last: cuda_takes looks at cu_kernels[0] */
    Py_RETURN_NONE;
}

/* add_ready(handle, event) -> bool: the plane may wait on `event` (a CUevent the loop opened from
 * the engine's IPC `handle`, 64 bytes) for requests naming that handle; False if the gate knows
 * CU_MAX_READY already (those requests stay the loop's). The event must live until the gate is
 * closed and idle: the loop keeps every event it gave here open until the pool's release. */
static PyObject *gate_add_ready(Gate *g, PyObject *args) {
    Py_buffer handle;
    unsigned long long event;
    if (!PyArg_ParseTuple(args, "y*K", &handle, &event))
        return NULL;
    int added = 0, ok = g->cuda && handle.len == 64 && event;
    if (ok) {
        pthread_mutex_lock(&g->mu);
        int known = 0;
        for (int k = 0; k < g->cu_nready && !known; k++)
            known = memcmp(g->cu_ready[k], handle.buf, 64) == 0;
        if (!known && g->cu_nready < CU_MAX_READY) {
            memcpy(g->cu_ready[g->cu_nready], handle.buf, 64);
            g->cu_ready_ev[g->cu_nready++] = (void *)(uintptr_t)event;
            added = 1;
        }
        pthread_mutex_unlock(&g->mu);
    }
    PyBuffer_Release(&handle);
    if (!ok) {
        PyErr_SetString(PyExc_ValueError, "add_ready is for a CUDA gate: a 64-byte handle and its event");
        return NULL;
    }
    return PyBool_FromLong(added);
}

static PyObject *gate_get_cuda(Gate *g, void *unused) { return PyBool_FromLong(__atomic_load_n(&g->cuda, __ATOMIC_ACQUIRE)); }

static PyObject *gate_get_cuda_failed(Gate *g, void *unused) {
    pthread_mutex_lock(&g->mu);
    char why[sizeof g->cu_failed];
    memcpy(why, g->cu_failed, sizeof why);
    pthread_mutex_unlock(&g->mu);
    if (!why[0])
        Py_RETURN_NONE;
    return PyUnicode_DecodeUTF8(why, (Py_ssize_t)strnlen(why, sizeof why), "replace");
}

static PyObject *gate_get_cuda_jobs(Gate *g, void *unused) {
    return PyLong_FromUnsignedLongLong(__atomic_load_n(&g->cu_jobs, __ATOMIC_RELAXED));
}

static PyMethodDef gate_methods[] = {
    {"set_cuda", (PyCFunction)gate_set_cuda, METH_VARARGS, NULL},
    {"add_ready", (PyCFunction)gate_add_ready, METH_VARARGS, NULL},
    {"set_cuda_kernels", (PyCFunction)gate_set_cuda_kernels, METH_VARARGS, NULL},
    {"set_cache", (PyCFunction)gate_set_cache, METH_VARARGS, NULL},
    {"set_space", (PyCFunction)gate_set_space, METH_VARARGS, NULL},
    {"check_call", (PyCFunction)gate_check_call, METH_VARARGS, NULL},
    {"release_if_idle", (PyCFunction)gate_release_if_idle, METH_O, NULL},
    {"py_enter", (PyCFunction)gate_py_enter, METH_NOARGS, NULL},
    {"py_exit", (PyCFunction)gate_py_exit, METH_NOARGS, NULL},
    {"take_counters", (PyCFunction)gate_take_counters, METH_NOARGS, NULL},
    {"check", (PyCFunction)gate_check, METH_O, NULL},
    {NULL},
};

static PyGetSetDef gate_getset[] = {
    {"inflight", (getter)gate_get_inflight, NULL, NULL, NULL},
    {"x_inflight", (getter)gate_get_x_inflight, NULL, NULL, NULL},
    {"py_inflight", (getter)gate_get_py_inflight, NULL, NULL, NULL},
    {"closed", (getter)gate_get_closed, NULL, NULL, NULL},
    {"cache_gid", (getter)gate_get_cache_gid, NULL, NULL, NULL},
    {"space", (getter)gate_get_space, NULL, NULL, NULL},
    {"stashed", (getter)gate_get_stashed, NULL, NULL, NULL},
    {"stash_short", (getter)gate_get_stash_short, NULL, NULL, NULL},
    {"cuda", (getter)gate_get_cuda, NULL, NULL, NULL},
    {"cuda_failed", (getter)gate_get_cuda_failed, NULL, NULL, NULL},
    {"cuda_jobs", (getter)gate_get_cuda_jobs, NULL, NULL, NULL},
    {NULL},
};

static PyTypeObject GateType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "kvserver.lane._kvlane.Gate",
    .tp_basicsize = sizeof(Gate),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)gate_init,
    .tp_dealloc = (destructor)gate_dealloc,
    .tp_methods = gate_methods,
    .tp_getset = gate_getset,
};

/* ---- lanes, jobs, the thread ---------------------------------------------------------------- */

typedef struct Lane {
    int64_t key;
    char *ring;
    int slots;
    int submit_fd;
    int done_fd[MAX_SLOTS];
    Gate *gate; /* a reference, given back when the lane is removed */
    int slot_busy[MAX_SLOTS]; /* taken here: a job, or handed to Python until finish_slot() */
    int watching;
    int quiet; /* the client said (FEATURE_QUIET_DONE) it sets WAITING_AT before it sleeps */
    struct Lane *next;
} Lane;

typedef struct {
    int64_t host_off; /* from the (layer, part) chunk's start in the region */
    int64_t dev_tok;
    int64_t ntok;
} Run;

typedef struct Job {
    struct Job *next; /* arrival order */
    Lane *lane;
    int slot;
    Gate *gate;
    int load, dependent;
    int64_t npages, *pages;
    int64_t nruns;
    Run *runs;
    uint32_t nl;
    int32_t *local;
    int64_t arrival_ns, deadline_ns, bytes_per_layer;
    int released;  /* its gate closed: it ends at its next layer boundary */
    uint32_t li;   /* layers done */
    int part;      /* within the current layer */
    int64_t ri;    /* next run within the current (layer, part) */
    uint32_t step; /* progress updates published */
    uint32_t published; /* layers the slot's progress words say */
    int64_t last_pub_ns;
    int64_t ndev;  /* device tokens (the runs cover them) */
    char *host;        /* where the host rows' (layer 0, part 0) chunk starts */
    int64_t lp_stride; /* bytes from one (layer, part) chunk of the host rows to the next */
    /* The loop's copies (submit_copy): no slot; its stop word is read at layer boundaries, a
     * load's layers go to its progress word and eventfd, and its end is posted back (Done). */
    int ext;
    uint64_t seq; /* its place in the plane's arrival order (writes take turns by it) */
    uint64_t ticket;
    int64_t *progress;
    int signal_fd;
    int64_t interval_ns;
    const int64_t *stop;
    /* A loop's copy that also answers its lane slot (submit_copy's lane and slot: a Get the loop
     * planned): its layers and end are published in the slot as a plane Load's are, with `found`
     * in the pages word, and its end is posted back as every loop's copy's is. */
    int answers;
    int counted; /* its request's count in the gate's py_inflight, given back as it joins the jobs */
    uint32_t found;
    int stream; /* streaming stores (stream.h): a write, or a load of KV_STREAM_MIN_JOB bytes or more */
    int can_run; /* set by mark_runnable(): no earlier job of its gate holds it back */
    /* A Get the plane serves whole (try_get): an answering load whose host rows are cache pages it
     * holds, ids[0..found); its end goes back to the loop with them (GetEnd), which lets them go. */
    int get;
    int64_t *ids, misses;
    int end_kind; /* not a Get: what its end is (END_LOOKUP, END_PUT, END_LOOKUP_HOST: try_answer) */
    /* A Put the plane stores (try_put): a write into the stash's pages ids[0..nids) of the keys
     * its part lacked (words, KV_KEY_WORDS a key, key_len bytes each), `misses` the keys present
     * already; filed under the part once copied (finish_put). */
    int store;
    int64_t nids;
    uint64_t *words;
    uint8_t key_len;
    /* A CUDA job (its gate's set_cuda): put on the pool's stream whole as it is taken (cuda_issue),
     * then its events polled (cuda_poll): a load's layer events of slot cu_slot, a write's cu_done. */
    int cuda;
    int cu_quiet;   /* its slot answered already (given up on), or its lane gone: nothing more is written there */
    int cu_stalled; /* its GPU work given up on: it keeps its pages until its gate closes */
    int cu_error;   /* the CUresult that failed while it was put on the stream; cu_done is then a marker */
    uint32_t cu_slot;
    void *cu_ready, *cu_done;
    int64_t cu_progress_ns; /* its last progress: nothing for the gate's cu_wait_ns gives it up */
    int64_t cu_ops;         /* the driver calls it puts on the stream (counted in cu_queued until it ends) */
    int cu_kernel;          /* its copies are the copy kernel's launches, their arguments in the gate's area */
    int64_t cu_args_want, cu_args_pos; /* the span cuda_takes found room for (padding included), where
                                        * in the area its arguments start */
    int64_t cu_args_at, cu_args_len;   /* its span once launched: from ring position cu_args_at */
    uint32_t recorded;      /* slot word 48: a load's layer events are recorded */
} Job;

/* The latency histograms the plane keeps: Write, Load, Load's first layer, Get, Get's first layer,
 * Lookup, Put (of keys all stored already, or stored here). */
enum { H_WRITE, H_LOAD, H_FIRST, H_GET, H_GET_FIRST, H_LOOKUP, H_PUT, H_KINDS };

typedef struct {
    uint64_t ticket;
    int status; /* DONE_OK, DONE_STOPPED (its stop word), DONE_RELEASED (its gate closed), DONE_HALTED */
    uint32_t layers;
} Done;

enum { DONE_OK, DONE_STOPPED, DONE_RELEASED, DONE_HALTED };

typedef struct {
    int64_t lane_key;
    int slot;
    int counted; /* in its gate's py_inflight: a copy (handoff()) */
} Handoff;

/* The end of a Get the plane served whole: what the loop settles (take_gets): its pages' holds and
 * LRU touch, the misses, the bytes. ids is the job's, handed over. */
typedef struct {
    int64_t token, found, misses, nbytes;
    int64_t *ids, nids; /* found of them; a space's Lookup: found of each part, part after part */
    int32_t gid;
    int status; /* DONE_OK, DONE_RELEASED (its gate closed), DONE_HALTED (a deadline, the plane stopped) */
    uint32_t layers;
    int kind; /* END_GET (its pages are held), END_LOOKUP (made recent), END_PUT (all present),
               * END_LOOKUP_HOST (a Lookup of host memory only: made recent, no tier's copies),
               * END_STORE (a Put stored here: ids[0..found) filed and held, ids[found..nids) the
               * stash's pages it did not file, `misses` its keys present already) */
} GetEnd;

enum { END_GET, END_LOOKUP, END_PUT, END_LOOKUP_HOST, END_STORE };

enum { CMD_NONE, CMD_ADD, CMD_REMOVE, CMD_CLOSE_GATE, CMD_UNWATCH_ALL, CMD_PAUSE, CMD_RESUME, CMD_STOP };

typedef struct {
    PyObject_HEAD
    pthread_t thread;
    int started;
    int epfd, wake_fd, notify_fd;
    int paused; /* tests: requests are taken, no copy runs */
    int64_t progress_interval_ns;
    int64_t spin_ns;  /* after a request or a job, how long it looks again before it sleeps */
    int awake;        /* the lanes' AWAKE_AT words say 1: clients submit without ringing */
    uint32_t plane_state; /* what the watched lanes' PLANE_AT words say: PLANE_ASLEEP or PLANE_RUNNING */
    int watched_slots; /* the slots of the lanes whose doorbells it watches */
    Lane *lanes;
    Job *jobs;
    int64_t njobs;
    /* commands: one at a time (call_mu), acknowledged through cmd_cv */
    pthread_mutex_t call_mu, cmd_mu;
    pthread_cond_t cmd_cv;
    int cmd, cmd_done;
    void *cmd_arg;
    /* handoffs to Python */
    pthread_mutex_t hand_mu;
    Handoff *hand;
    size_t nhand, caphand;
    uint64_t handed, served;
    /* the loop's copies: submitted (in_mu) until the thread takes them; their ends, under hand_mu,
     * with room kept for every copy not yet posted (so a post never needs memory) */
    uint64_t next_seq, last_write; /* the arrival order; the write that last copied a piece */
    int64_t loads_in_a_row;        /* bytes of loads copied in a row while a write waited */
    int64_t write_credit;          /* bytes the waiting writes may still copy ahead of loads */
    uint64_t write_turns;          /* write pieces run ahead of waiting loads (WRITE_EVERY_BYTES) */
    pthread_mutex_t in_mu;
    Job *incoming;
    int nincoming;
    Done *done;
    size_t ndone, capdone, unposted;
    /* Gets served whole here (set_cache): the cache they walk, and their ends, under hand_mu, with
     * room kept for every one not yet posted */
    Cache *cache;
    GetEnd *gets;
    size_t ngets, capgets, unposted_gets;
    uint64_t plane_gets;    /* Gets served whole here, counted as they are taken */
    uint64_t plane_lookups; /* Lookups likewise (a space's among them) */
    uint64_t plane_space_lookups; /* of those, a scheduler's of a whole space (its space's lane) */
    uint64_t plane_puts;    /* Puts of keys all stored already, likewise */
    uint64_t plane_stores;  /* Puts that stored pages here (try_put), counted as they are answered */
    int64_t cu_progress_ns; /* when a CUDA job was last put on a stream or moved on (its polls' pace) */
    int64_t cu_queued;      /* driver calls on every gate's stream for jobs not ended (CU_PLANE_QUEUED_MAX) */
    /* latency histograms, as kvserver_operation_duration_seconds and
     * kvserver_time_to_first_layer_seconds count them (H_WRITE...) */
    pthread_mutex_t stat_mu;
    int nedges;
    double edges[MAX_EDGES];
    uint64_t hist[H_KINDS][MAX_EDGES + 1];
    double hsum[H_KINDS];
} Engine;

static void observe(Engine *e, int h, int64_t ns) {
    double s = (double)ns / 1e9;
    int b = 0;
    while (b < e->nedges && s > e->edges[b])
        b++;
    pthread_mutex_lock(&e->stat_mu);
    e->hist[h][b]++;
    e->hsum[h] += s;
    pthread_mutex_unlock(&e->stat_mu);
}

static inline char *slot_at(Lane *l, int i) { return l->ring + HEADER_BYTES + (size_t)i * SLOT_BYTES; }

static inline void put32(char *p, uint32_t v) { memcpy(p, &v, 4); }
/* A protobuf varint field (its one-byte tag, then v) at p: its length (at most 11 bytes). */
static uint32_t pb_varint_field(unsigned char *p, unsigned char tag, uint64_t v) {
    uint32_t n = 0;
    p[n++] = tag;
    do {
        unsigned char b = v & 0x7F;
        v >>= 7;
        p[n++] = b | (v ? 0x80 : 0);
    } while (v);
    return n;
}
static inline void put64(char *p, uint64_t v) { memcpy(p, &v, 8); }
static inline uint32_t state_of(char *slot) { return __atomic_load_n((uint32_t *)slot, __ATOMIC_ACQUIRE); }
static inline void set_state(char *slot, uint32_t s) { __atomic_store_n((uint32_t *)slot, s, __ATOMIC_RELEASE); }

/* Rings slot i's done doorbell after its state or step word was stored; on a quiet lane only if
 * the client sleeps on it. The client stores its waiting word, then looks at those words, then
 * sleeps; this thread stored them, then looks at the waiting word: with a full fence on each side
 * one of the two sees the other's store (docs/lane.md, "Ringing only a sleeper"). The word is the
 * client's to change: one that lies only misses its own wake-ups. */
static void ring_done(Lane *l, int i) {
    if (l->quiet) {
        __atomic_thread_fence(__ATOMIC_SEQ_CST);
        if (!__atomic_load_n((uint32_t *)(slot_at(l, i) + WAITING_AT), __ATOMIC_RELAXED))
            return;
    }
    (void)!send(l->done_fd[i], "d", 1, MSG_DONTWAIT | MSG_NOSIGNAL);
}

static void wake(int fd) {
    uint64_t one = 1;
    (void)!write(fd, &one, 8);
}

/* Answers slot i here with an error (the request never ran). */
static void answer_error(Lane *l, int i, uint32_t code, const char *message) {
    char *s = slot_at(l, i);
    uint32_t n = (uint32_t)strlen(message);
    memcpy(s + ERROR_AT, message, n);
    put32(s + 60, FLAG_JOB_ENDED);
    put32(s + 20, code);
    put32(s + 24, 0);
    put32(s + 28, n);
    memcpy(s + 64, s + 8, 8);
    __atomic_store_n(&l->slot_busy[i], 0, __ATOMIC_RELEASE);
    set_state(s, ST_DONE);
    ring_done(l, i);
}

/* Hands slot i of the lane over to the loop (Lane.take); slot -1: the peer of a space's lane has
 * closed its end of the submit doorbell (Lane.peer_closed). */
static void handoff(Engine *e, Lane *l, int i, uint32_t rpc) {
    /* A copy the loop serves keeps the plane from the registration's copies until it ends (the
     * two never copy for one registration at once); a request that copies nothing (a Lookup, an
     * id no one knows) holds nothing off. */
    int counted = !l->gate->space && rpc >= 1 && rpc <= RPC_COPIES_LAST; /* a space's lane copies nothing */
    pthread_mutex_lock(&e->hand_mu);
    if (e->nhand == e->caphand) {
        size_t cap = e->caphand ? 2 * e->caphand : 64;
        Handoff *h = realloc(e->hand, cap * sizeof(Handoff));
        if (h) {
            e->hand = h;
            e->caphand = cap;
        }
    }
    int room = e->nhand < e->caphand;
    pthread_mutex_unlock(&e->hand_mu);
    if (!room) { /* out of memory: said, not dropped (a peer gone: its process's exit is watched too) */
        if (i >= 0)
            answer_error(l, i, CODE_RESOURCE_EXHAUSTED, "the daemon is out of memory for this request: retry");
        return;
    }
    if (counted) {
        pthread_mutex_lock(&l->gate->mu);
        l->gate->py_inflight++;
        pthread_mutex_unlock(&l->gate->mu);
    }
    pthread_mutex_lock(&e->hand_mu);
    if (e->nhand < e->caphand) { /* only this thread adds: the room found above is still there */
        e->hand[e->nhand].lane_key = l->key;
        e->hand[e->nhand].slot = i;
        e->hand[e->nhand].counted = counted;
        e->nhand++;
    }
    __atomic_add_fetch(&e->handed, 1, __ATOMIC_RELAXED);
    pthread_mutex_unlock(&e->hand_mu);
    wake(e->notify_fd);
}

static void job_free(Job *j) {
    free(j->words);
    free(j->ids);
    free(j->pages);
    free(j->runs);
    free(j->local);
    free(j);
}

static int64_t layer_local_bytes(Gate *g) { return g->lim.page_size * g->token_bytes; }

/* Builds a job from an accepted request; NULL if memory ran out (then Python answers). */
static Job *make_job(Lane *l, int i, const kv_request *r, int64_t *pages, int32_t *local, uint32_t nl,
                     int64_t arrival) {
    Gate *g = l->gate;
    Job *j = calloc(1, sizeof(Job));
    if (!j) {
        free(pages);
        free(local);
        return NULL;
    }
    int64_t ps = g->lim.page_size;
    j->lane = l;
    j->slot = i;
    j->gate = g;
    j->load = r->kind == KV_KIND_LOAD;
    j->npages = r->n_pages;
    j->pages = pages;
    j->local = local;
    j->nl = nl;
    j->ndev = j->npages * ps;
    /* Runs of consecutive device tokens within a page: counted first, so that a request of whole
     * device pages costs one run a page, not one a token. */
    int contiguous = g->dev_stride == g->token_bytes;
    int64_t nr = 0;
    for (int64_t k = 0; k < j->npages; k++)
        for (int64_t t = 0; t < ps; t++)
            if (t == 0 || !contiguous || kv_dev_token(r, ps, k * ps + t) != kv_dev_token(r, ps, k * ps + t - 1) + 1)
                nr++;
    j->runs = malloc(sizeof(Run) * (size_t)nr);
    if (!j->runs) {
        job_free(j); /* pages and local with it */
        return NULL;
    }
    nr = 0;
    for (int64_t k = 0; k < j->npages; k++) {
        for (int64_t t = 0; t < ps; t++) {
            int64_t d = kv_dev_token(r, ps, k * ps + t);
            if (t > 0 && contiguous && d == j->runs[nr - 1].dev_tok + j->runs[nr - 1].ntok) {
                j->runs[nr - 1].ntok++;
                continue;
            }
            j->runs[nr].host_off = pages[k] * g->page_bytes + t * g->token_bytes;
            j->runs[nr].dev_tok = d;
            j->runs[nr].ntok = 1;
            nr++;
        }
    }
    j->nruns = nr;
    j->bytes_per_layer = j->ndev * g->token_bytes * g->parts;
    j->stream = kv_streams(j->load, j->bytes_per_layer * (int64_t)j->nl);
    j->host = g->host_base;
    j->lp_stride = layer_local_bytes(g);
    j->arrival_ns = arrival;
    j->deadline_ns = r->timeout_ms ? arrival + (int64_t)r->timeout_ms * 1000000 : 0;
    return j;
}

/* Whether every page and slot of a load is free of unfinished writes (of this plane). */
static int touches_writes(Job *j) {
    Gate *g = j->gate;
    for (int64_t k = 0; k < j->npages; k++)
        if (g->wpages[j->pages[k]])
            return 1;
    for (int64_t k = 0; k < j->nruns; k++)
        for (int64_t t = j->runs[k].dev_tok; t < j->runs[k].dev_tok + j->runs[k].ntok; t++)
            if (g->wdev[t])
                return 1;
    return 0;
}

static void mark_writes(Job *j, int by) {
    Gate *g = j->gate;
    for (int64_t k = 0; k < j->npages; k++)
        g->wpages[j->pages[k]] += by;
    for (int64_t k = 0; k < j->nruns; k++)
        for (int64_t t = j->runs[k].dev_tok; t < j->runs[k].dev_tok + j->runs[k].ntok; t++)
            g->wdev[t] += by;
}

/* Job j joins the jobs, last in arrival order. */
static void enqueue(Engine *e, Job *j) {
    Job **tail = &e->jobs;
    while (*tail)
        tail = &(*tail)->next;
    *tail = j;
    j->seq = ++e->next_seq;
    __atomic_add_fetch(&e->njobs, 1, __ATOMIC_RELAXED);
}

/* A call of the gate's that copies takes its turn here (try_get, try_put): 1 if the gate is open
 * and no copy of its registration is the loop's (its copies keep their order); then it counts
 * among the gate's jobs and renews the registration's lease. */
static int take_turn(Gate *g, int64_t arrival) {
    pthread_mutex_lock(&g->mu);
    int ok = !g->closed && g->py_inflight == 0;
    if (ok) {
        g->c_inflight++;
        g->last_call_ns = arrival;
    }
    pthread_mutex_unlock(&g->mu);
    return ok;
}

/* Whether the plane takes job j of a CUDA gate (set_cuda), and if so makes it a CUDA job: its
 * copies few enough to issue one by one, else the copy kernel's (set_cuda_kernels) with room for
 * its arguments; its driver calls within the queue bounds; its ready event one the loop opened;
 * and the pool's GPU work not given up on. */
static int cuda_takes(Engine *e, Gate *g, Job *j, const kv_request *r) {
    int64_t copies = j->nruns * (int64_t)j->nl * g->parts;
    int dma = copies <= g->cu_max_copies;
    if (dma && copies > g->cu_small_copies)
        for (int64_t k = 0; k < j->nruns && dma; k++)
            dma = j->runs[k].ntok * g->token_bytes >= g->cu_min_copy_bytes;
    int64_t ops = (r->ready_len ? 1 : 0) + (j->load ? j->nl : 1); /* the wait, the records */
    if (dma) {
        ops += copies;
    } else { /* the copy kernel's: a launch per layer (a load) or one (a write), token rows */
        if (!g->cu_kernels[0])
            return 0;
        int64_t need = 16 * ((int64_t)j->nl * g->parts + j->ndev); /* bases, offsets: both sides */
        int64_t pos = g->cu_args_head % g->cu_args_bytes;
        int64_t pad = pos + need > g->cu_args_bytes ? g->cu_args_bytes - pos : 0; /* a span never wraps */
        if (g->cu_args_head + pad + need - g->cu_args_tail > g->cu_args_bytes)
            return 0;
        j->cu_kernel = 1;
        j->cu_args_want = pad + need;
        j->cu_args_pos = pad ? 0 : pos; /* nothing else is handed out before it is launched */
        ops += j->load ? j->nl : 1;
    }
    if (g->cu_queued + ops > g->cu_max_queued || e->cu_queued + ops > CU_PLANE_QUEUED_MAX)
        return 0;
    void *ready = NULL;
    pthread_mutex_lock(&g->mu);
    int ok = !g->cu_failed[0];
    if (ok && r->ready_len) {
        for (int k = 0; k < g->cu_nready && !ready; k++)
            if (memcmp(g->cu_ready[k], r->ready, 64) == 0)
                ready = g->cu_ready_ev[k];
        ok = ready != NULL;
    }
    pthread_mutex_unlock(&g->mu);
    if (!ok)
        return 0;
    j->cuda = 1;
    j->cu_slot = r->event_slot;
    j->cu_ops = ops;
    j->cu_ready = ready;
    return 1;
}

static void cuda_issue(Engine *e, Job *j);

/* Tries to serve slot i as a job of this plane: 1 if it became one. */
static int try_job(Engine *e, Lane *l, int i, uint32_t rpc, uint32_t n) {
    Gate *g = l->gate;
    if ((rpc != RPC_WRITE_B && rpc != RPC_LOAD_B) || n > REQUEST_BYTES || __atomic_load_n(&g->closed, __ATOMIC_ACQUIRE))
        return 0;
    int64_t arrival = now_ns();
    unsigned char *buf = malloc(n ? n : 1);
    if (!buf)
        return 0;
    memcpy(buf, slot_at(l, i) + REQUEST_AT, n); /* a private copy: the peer may scribble */
    kv_request r;
    int ok = kv_parse(buf, n, &r) && (r.kind == KV_KIND_WRITE) == (rpc == RPC_WRITE_B);
    int64_t *pages = NULL;
    int32_t *local = NULL;
    uint32_t nl = 0;
    Job *j = NULL;
    if (ok) {
        pages = malloc(sizeof(int64_t) * ((size_t)r.n_pages + 1));
        local = malloc(sizeof(int32_t) * (size_t)g->lim.num_layers);
        /* The marks are the gate's scratch, shared with Gate.check (tests) under check_mu. */
        pthread_mutex_lock(&g->check_mu);
        ok = pages && local && kv_accept(&r, &g->lim, pages, local, &nl);
        pthread_mutex_unlock(&g->check_mu);
    }
    if (ok)
        j = make_job(l, i, &r, pages, local, nl, arrival); /* owns pages and local, freed or not */
    if (j && g->cuda && !cuda_takes(e, g, j, &r)) {
        job_free(j);
        j = NULL;
        ok = 0;
        pages = NULL; /* freed with the job */
        local = NULL;
    }
    free(buf);
    if (!j) {
        if (!ok) {
            free(pages);
            free(local);
        }
        return 0;
    }
    pthread_mutex_lock(&g->mu);
    ok = !g->closed && g->py_inflight == 0;
    for (int64_t k = 0; ok && k < j->npages; k++)
        ok = g->lim.owned[j->pages[k]] != 0;
    if (ok) {
        for (int64_t k = 0; k < j->npages; k++)
            g->busy[j->pages[k]]++;
        g->c_inflight++;
        g->last_call_ns = arrival;
    }
    pthread_mutex_unlock(&g->mu);
    if (!ok) {
        job_free(j);
        return 0;
    }
    enqueue(e, j);
    if (j->cuda) { /* its stream orders it: no write marks (a CUDA gate has no other kind of job) */
        cuda_issue(e, j);
        return 1;
    }
    j->dependent = j->load ? touches_writes(j) : 1;
    if (!j->load)
        mark_writes(j, 1);
    return 1;
}

static void publish_progress(Engine *e, Job *j, uint32_t flags);
static void answer_slot(Engine *e, Job *j, uint32_t code, const char *message);
static const int64_t never_stopped = 0; /* the stop word of a Get served here: its gate's close stops it */

/* Room for one more item of `size` bytes in the array *items (of *cap, *n posted), kept until it
 * is posted (*unposted counts those kept); 0: out of memory. All of them hand_mu's, which it takes. */
static int reserve_room(Engine *e, void **items, size_t *cap, const size_t *n, size_t *unposted, size_t size) {
    pthread_mutex_lock(&e->hand_mu);
    int room = 1;
    if (*cap < *n + *unposted + 1) {
        size_t more = 2 * (*n + *unposted + 1) + 16;
        void *d = realloc(*items, more * size);
        if (d) {
            *items = d;
            *cap = more;
        } else {
            room = 0;
        }
    }
    if (room)
        (*unposted)++;
    pthread_mutex_unlock(&e->hand_mu);
    return room;
}

/* The most ends of calls served here that the loop has yet to settle: past it, a call is handed to
 * the loop (which settles as it serves), so that a client calling back to back never leaves the
 * loop more ends to settle at one wake-up than this. */
#define MAX_UNSETTLED_ENDS 256

/* Room for one more GetEnd, kept until it is posted; 0: out of memory, or MAX_UNSETTLED_ENDS
 * posted already and waiting for the loop (the Gets still copying, not posted yet, do not count). */
static int reserve_get_end(Engine *e) {
    pthread_mutex_lock(&e->hand_mu);
    int full = e->ngets >= MAX_UNSETTLED_ENDS;
    pthread_mutex_unlock(&e->hand_mu);
    return !full && reserve_room(e, (void **)&e->gets, &e->capgets, &e->ngets, &e->unposted_gets, sizeof(GetEnd));
}

static void unreserve_get_end(Engine *e) {
    pthread_mutex_lock(&e->hand_mu);
    e->unposted_gets--;
    pthread_mutex_unlock(&e->hand_mu);
}

/* A Get served here has ended: its end posted back (its ids with it: the loop lets the pages go),
 * the gate's count of its jobs given back. The loop is woken by the first end it has not taken
 * (it takes every one posted by then, take_gets, after it drained the eventfd): ends posted while
 * it settles earlier ones wait for it without a wake-up each, and are settled together. */
static void post_get_end(Engine *e, Job *j, int status) {
    Gate *g = j->gate;
    pthread_mutex_lock(&e->hand_mu);
    int first = e->ngets == 0;
    GetEnd *d = &e->gets[e->ngets++]; /* room kept by reserve_get_end */
    d->token = g->cache_token;
    d->gid = g->cache_gid;
    d->found = j->found;
    d->misses = j->misses;
    d->ids = j->ids;
    d->nids = j->store ? j->nids : (int64_t)j->found * (g->space ? g->nparts : 1);
    d->status = status;
    d->layers = j->li;
    d->nbytes = status == DONE_OK ? (int64_t)j->nl * j->bytes_per_layer : 0;
    d->kind = j->get ? END_GET : j->store ? END_STORE : j->end_kind; /* a Get's pages are held; a Lookup's not */
    e->unposted_gets--;
    pthread_mutex_unlock(&e->hand_mu);
    j->ids = NULL;
    pthread_mutex_lock(&g->mu);
    g->c_inflight--;
    pthread_mutex_unlock(&g->mu);
    if (first)
        wake(e->notify_fd);
}

/* The runs of a cache page at arena offset `off` and device page `dev` (`ps` tokens of `tb` bytes a
 * (layer, part)): one where the device's tokens are contiguous, else one a token; their count. */
static int64_t page_runs(Run *runs, int64_t off, int64_t dev, int64_t ps, int64_t tb, int contiguous) {
    for (int64_t t = 0; t < (contiguous ? 1 : ps); t++)
        runs[t] = (Run){off + t * tb, dev * ps + t, contiguous ? ps : 1};
    return contiguous ? 1 : ps;
}

/* The end of a call walked here that copies nothing (a Lookup, a Put of keys all stored), posted
 * at once: its registration's lease renewed, as every call renews it, and the end counted among
 * the gate's jobs until it is posted; job j freed. */
static void post_walked(Engine *e, Job *j, int64_t arrival) {
    Gate *g = j->gate;
    pthread_mutex_lock(&g->mu);
    g->last_call_ns = arrival;
    g->c_inflight++;
    pthread_mutex_unlock(&g->mu);
    post_get_end(e, j, DONE_OK);
    job_free(j);
}

/* Tries to serve slot i, a lane Get (protobuf), whole on this thread: read and checked (get.h), its
 * keys walked in the cache and their pages held (cache.h), then copied as a Load is, answering the
 * slot with the pages found. 1 if it did (or answered a Get that found nothing); 0: the loop's. */
static int try_get(Engine *e, Lane *l, int i, uint32_t n) {
    Gate *g = l->gate;
    Cache *c = e->cache;
    int32_t gid = __atomic_load_n(&g->cache_gid, __ATOMIC_ACQUIRE);
    if (!c || gid < 0 || n > REQUEST_BYTES || __atomic_load_n(&g->closed, __ATOMIC_ACQUIRE))
        return 0;
    int64_t arrival = now_ns(), ps = g->lim.page_size, tb = g->token_bytes;
    unsigned char *buf = malloc(n ? n : 1);
    int64_t *dev = malloc(sizeof(int64_t) * (size_t)g->cache_max_keys);
    int32_t *local = malloc(sizeof(int32_t) * (size_t)g->lim.num_layers);
    uint64_t *words = NULL;
    int64_t *ids = NULL, *offs = NULL, m = -1;
    Job *j = NULL;
    int ok = buf && dev && local, reserved = 0, counted = 0;
    cache_call q = {0};
    if (ok) {
        memcpy(buf, slot_at(l, i) + REQUEST_AT, n); /* a private copy: the peer may scribble */
        ok = check_cache_call(g, RPC_GET, buf, n, &q, dev, local);
    }
    int64_t nkeys = q.nkeys;
    uint32_t nl = q.nl;
    int64_t bytes_per_layer = nkeys * ps * tb * g->parts;
    if (ok && g->cache_split_bytes && bytes_per_layer * (int64_t)nl >= g->cache_split_bytes)
        ok = 0; /* were every key found, the copy workers would split it: the loop's */
    if (ok) { /* the words before the lock: a digest of wide keys takes a while */
        words = malloc(sizeof(uint64_t) * KV_KEY_WORDS * (size_t)nkeys);
        ids = malloc(sizeof(int64_t) * (size_t)nkeys);
        offs = malloc(sizeof(int64_t) * (size_t)nkeys);
        j = calloc(1, sizeof(Job));
        ok = words && ids && offs && j && (reserved = reserve_get_end(e));
    }
    if (ok) {
        kv_keys_words(q.keys, (int64_t)q.key_bytes, nkeys, words);
        ok = counted = take_turn(g, arrival);
    }
    if (ok) {
        m = cache_walk_hold(c, words, (uint8_t)q.key_bytes, nkeys, gid, (int64_t)g->lim.num_layers * g->parts,
                            g->cache_lp_stride, ids, offs, 1, c->whole);
        ok = m >= 0;
    }
    int64_t nr = 0;
    Run *runs = NULL;
    if (ok && m > 0) { /* a run a page where the device's tokens are contiguous, else a token */
        int contiguous = g->dev_stride == tb;
        runs = malloc(sizeof(Run) * (size_t)(contiguous ? m : m * ps));
        for (int64_t k = 0; runs && k < m; k++)
            nr += page_runs(runs + nr, offs[k], dev[k], ps, tb, contiguous);
        if (!runs) /* out of memory after the holds: the pages go back with its end, the loop answers */
            ok = 0;
    }
    free(buf);
    free(words);
    free(offs);
    free(dev);
    if (!ok) {
        if (m > 0) { /* held already: its pages go back with its end, unanswered, and the loop serves it */
            j->get = 1;
            j->gate = g;
            j->ids = ids;
            j->found = (uint32_t)m;
            j->local = local;
            post_get_end(e, j, DONE_HALTED);
            job_free(j);
            handoff(e, l, i, RPC_GET);
            return 1;
        }
        if (counted) {
            pthread_mutex_lock(&g->mu);
            g->c_inflight--;
            pthread_mutex_unlock(&g->mu);
        }
        if (reserved)
            unreserve_get_end(e);
        free(ids);
        free(local);
        free(j);
        return 0;
    }
    j->lane = l;
    j->slot = i;
    j->gate = g;
    j->load = j->answers = j->get = 1;
    j->dependent = 1; /* behind every earlier job of its gate, as the loop's answering copies */
    j->ids = ids;
    j->found = (uint32_t)m;
    j->misses = nkeys - m;
    j->local = local;
    j->nl = nl;
    j->runs = runs;
    j->nruns = nr;
    j->ndev = m * ps;
    j->bytes_per_layer = m * ps * tb * g->parts;
    j->stream = kv_streams(1, j->bytes_per_layer * (int64_t)nl);
    j->host = c->arena;
    j->lp_stride = g->cache_lp_stride;
    j->stop = &never_stopped;
    j->arrival_ns = arrival;
    j->deadline_ns = q.timeout_ms ? arrival + (int64_t)q.timeout_ms * 1000000 : 0;
    __atomic_add_fetch(&e->plane_gets, 1, __ATOMIC_RELAXED);
    if (m == 0) { /* nothing found: answered now, as the loop answers one */
        j->nl = 0;
        post_get_end(e, j, DONE_OK);
        answer_slot(e, j, 0, NULL);
        job_free(j);
        return 1;
    }
    /* Step 1, the pages found, before any layer (the RPC's first message); rung only for a copy that
     * takes a while or waits behind others, as the loop's answering copies are. */
    publish_progress(e, j, 0);
    if (j->bytes_per_layer * (int64_t)j->nl > QUIET_FIRST_BYTES || e->jobs || e->paused)
        ring_done(l, i);
    else
        j->last_pub_ns = now_ns();
    enqueue(e, j);
    return 1;
}

/* Answers unary call i (its response, status OK) as the loop's Lane.answer_now does. */
static void answer_unary(Engine *e, Lane *l, int i, const unsigned char *response, uint32_t len, int64_t arrival) {
    char *s = slot_at(l, i);
    int64_t us = (now_ns() - arrival) / 1000;
    put32(s + BUSY_AT, us < 1 ? 1u : us > (int64_t)UINT32_MAX ? UINT32_MAX : (uint32_t)us);
    memcpy(s + RESPONSE_AT, response, len);
    put32(s + 60, FLAG_JOB_ENDED);
    put32(s + 20, 0);
    put32(s + 24, len);
    put32(s + 28, 0);
    memcpy(s + 64, s + 8, 8); /* done_seq: the seq the client wrote (TAKEN: it is ours) */
    __atomic_store_n(&l->slot_busy[i], 0, __ATOMIC_RELEASE);
    __atomic_add_fetch(&e->served, 1, __ATOMIC_RELAXED);
    set_state(s, ST_DONE);
    ring_done(l, i);
}

/* Tries to answer slot i, an engine's Lookup of its own part (protobuf), whole on this thread: read
 * and checked (get.h), its keys walked in the cache (nothing held) and answered with the pages
 * found; its end posted back (the loop makes them recent and counts the hits and misses). 1 if it
 * did; 0: the loop's. It copies nothing, so it waits for nothing of its registration. On a space's
 * gate, a scheduler's Lookup of the whole space, walked in each of its parts (cache_walk_space),
 * its end posted with every part's pages. */
static int try_answer(Engine *e, Lane *l, int i, uint32_t n) {
    Gate *g = l->gate;
    Cache *c = e->cache;
    int32_t gid = __atomic_load_n(&g->cache_gid, __ATOMIC_ACQUIRE);
    if (!c || gid < 0 || n > REQUEST_BYTES || __atomic_load_n(&g->closed, __ATOMIC_ACQUIRE))
        return 0;
    int64_t arrival = now_ns(), m = -1;
    unsigned char *buf = malloc(n ? n : 1);
    cache_call q = {0};
    int ok = buf != NULL;
    if (ok) {
        memcpy(buf, slot_at(l, i) + REQUEST_AT, n); /* a private copy: the peer may scribble */
        ok = check_cache_call(g, RPC_LOOKUP, buf, n, &q, NULL, NULL);
    }
    int64_t nkeys = q.nkeys, nparts = g->space ? g->nparts : 1; /* (set_space bounds nkeys * nparts) */
    uint64_t *words = ok ? malloc(sizeof(uint64_t) * KV_KEY_WORDS * (size_t)nkeys) : NULL;
    int64_t *ids = ok ? malloc(sizeof(int64_t) * (size_t)(nkeys * nparts)) : NULL;
    int64_t *offs = ok ? malloc(sizeof(int64_t) * (size_t)nkeys) : NULL;
    Job *j = ok ? calloc(1, sizeof(Job)) : NULL;
    ok = ok && words && ids && offs && j && reserve_get_end(e);
    if (ok) {
        kv_keys_words(q.keys, (int64_t)q.key_bytes, nkeys, words);
        /* A Lookup of host memory only asks no tier: its partial hit is whole too */
        int whole = c->whole && !q.memory_only;
        if (g->space)
            m = cache_walk_space(c, words, (uint8_t)q.key_bytes, nkeys, g->space_gids, g->nparts, ids, offs, whole);
        else
            m = cache_walk_hold(c, words, (uint8_t)q.key_bytes, nkeys, gid, (int64_t)g->lim.num_layers * g->parts,
                                g->cache_lp_stride, ids, offs, 0, whole);
        ok = m >= 0;
        if (!ok)
            unreserve_get_end(e);
    }
    free(buf);
    free(words);
    free(offs);
    if (!ok) {
        free(ids);
        free(j);
        return 0;
    }
    j->gate = g;
    j->ids = ids;
    j->found = (uint32_t)m;
    j->misses = nkeys - m;
    j->end_kind = q.memory_only ? END_LOOKUP_HOST : END_LOOKUP;
    post_walked(e, j, arrival); /* before the answer: a Stats after it counts the hits */
    unsigned char resp[16];
    uint32_t len = 0;
    if (m) /* LookupResponse{pages}: field 1 (nothing for 0, as protobuf writes it) */
        len = pb_varint_field(resp, 0x08, (uint64_t)m);
    observe(e, H_LOOKUP, now_ns() - arrival);
    __atomic_add_fetch(&e->plane_lookups, 1, __ATOMIC_RELAXED);
    if (g->space)
        __atomic_add_fetch(&e->plane_space_lookups, 1, __ATOMIC_RELAXED);
    answer_unary(e, l, i, resp, len, arrival);
    return 1;
}

/* PutResponse{stored, present, dropped, bytes} (fields 1 to 4; none of 0, as protobuf writes them)
 * at p: its length (at most 44 bytes). */
static uint32_t put_response(unsigned char *p, int64_t stored, int64_t present, int64_t dropped, int64_t nbytes) {
    uint32_t len = 0;
    if (stored)
        len += pb_varint_field(p + len, 0x08, (uint64_t)stored);
    if (present)
        len += pb_varint_field(p + len, 0x10, (uint64_t)present);
    if (dropped)
        len += pb_varint_field(p + len, 0x18, (uint64_t)dropped);
    if (nbytes)
        len += pb_varint_field(p + len, 0x20, (uint64_t)nbytes);
    return len;
}

/* Tries to serve slot i, a lane Put (protobuf), whole on this thread: read and checked as a Get of
 * its keys into its device pages (get.h), its keys walked in the gate's part under the cache's lock.
 * Every key stored already: answered present at once, its end counting them (END_PUT). Keys the
 * part lacks, as many as the gate's stash has pages (Engine.stash): those pages taken from it under
 * the same hold of the lock, and the keys' device pages copied into them as a write job of the gate
 * (loads first, writes in turns, after the registration's earlier copies), then filed under the part
 * and answered (finish_put). 0: the loop's, nothing taken: a key another Put is still writing (the
 * loop waits for it), a key of over 32 bytes (its bytes are the loop's to keep, for KV events), a
 * stash too small, a copy of the registration on the loop's side, the lock the loop's, or anything
 * the check refuses. */
static int try_put(Engine *e, Lane *l, int i, uint32_t n) {
    Gate *g = l->gate;
    Cache *c = e->cache;
    int32_t gid = __atomic_load_n(&g->cache_gid, __ATOMIC_ACQUIRE);
    if (!c || gid < 0 || g->space || n > REQUEST_BYTES || __atomic_load_n(&g->closed, __ATOMIC_ACQUIRE))
        return 0;
    int64_t arrival = now_ns(), ps = g->lim.page_size, tb = g->token_bytes;
    int64_t chunks = (int64_t)g->lim.num_layers * g->parts, lp = g->cache_lp_stride;
    unsigned char *buf = malloc(n ? n : 1);
    int64_t *dev = malloc(sizeof(int64_t) * (size_t)g->cache_max_keys);
    int32_t *local = malloc(sizeof(int32_t) * (size_t)g->lim.num_layers);
    cache_call q = {0};
    int ok = buf && dev && local;
    if (ok) {
        memcpy(buf, slot_at(l, i) + REQUEST_AT, n); /* a private copy: the peer may scribble */
        ok = check_cache_call(g, RPC_PUT, buf, n, &q, dev, local);
    }
    int64_t nkeys = ok ? q.nkeys : 0, present = 0, missing = 0;
    int contiguous = g->dev_stride == tb;
    uint64_t *words = ok ? malloc(sizeof(uint64_t) * KV_KEY_WORDS * (size_t)nkeys) : NULL, *mwords = NULL;
    int64_t *found = ok ? malloc(sizeof(int64_t) * (size_t)nkeys) : NULL, *taken = NULL;
    Run *runs = NULL;
    Job *j = ok ? calloc(1, sizeof(Job)) : NULL;
    int reserved = 0;
    ok = ok && words && found && j && (reserved = reserve_get_end(e));
    if (ok)
        kv_keys_words(q.keys, (int64_t)q.key_bytes, nkeys, words);
    free(buf);
    int64_t nr = 0;
    if (ok && cache_try_lock(c)) {
        ok = c->open;
        if (ok)
            kv_index_find(&c->ix, words, NULL, (uint8_t)q.key_bytes, nkeys, gid, found);
        for (int64_t k = 0; ok && k < nkeys; k++) {
            int64_t id = found[k];
            if (id < 0)
                missing++;
            else if (id >= c->pg.npages || c->pg.state[id] != KV_COMMITTED)
                ok = 0; /* being written by another Put (or a corrupt table): the loop's */
            else
                present++;
        }
        if (ok && missing) {
            ok = q.key_bytes <= KV_WORD_BYTES && missing <= g->nstash;
            if (q.key_bytes <= KV_WORD_BYTES && missing > g->nstash && missing <= g->stash_full)
                g->stash_short = 1; /* (a Put the plane would have stored: the loop fills the stash then) */
            if (ok) { /* the copy's memory before any page is taken: nothing can fail after that */
                mwords = malloc(sizeof(uint64_t) * KV_KEY_WORDS * (size_t)missing);
                taken = malloc(sizeof(int64_t) * (size_t)missing);
                runs = malloc(sizeof(Run) * (size_t)(contiguous ? missing : missing * ps));
                ok = mwords && taken && runs;
            }
            for (int64_t k = 0; ok && k < missing; k++) { /* (the loop gave them: checked all the same) */
                int64_t id = g->stash[g->nstash - 1 - k], off = id >= 0 && id < c->pg.npages ? c->pg.offset[id] : -1;
                ok = off >= 0 && off <= c->arena_bytes && (c->arena_bytes - off) / lp >= chunks;
            }
            ok = ok && take_turn(g, arrival);
            for (int64_t k = 0, m = 0; ok && k < nkeys; k++) {
                if (found[k] >= 0)
                    continue;
                int64_t id = g->stash[--g->nstash], off = c->pg.offset[id];
                taken[m] = id;
                memcpy(mwords + KV_KEY_WORDS * m, words + KV_KEY_WORDS * k, KV_WORD_BYTES);
                nr += page_runs(runs + nr, off, dev[k], ps, tb, contiguous);
                m++;
            }
        }
        pthread_mutex_unlock(&c->mu);
    } else {
        ok = 0;
    }
    free(words);
    free(found);
    free(dev);
    if (!ok) {
        if (reserved)
            unreserve_get_end(e);
        free(mwords);
        free(taken);
        free(runs);
        free(local);
        free(j);
        return 0;
    }
    j->gate = g;
    j->misses = present;
    j->arrival_ns = arrival;
    if (!missing) { /* every key stored already: nothing taken or copied, answered present now */
        j->found = (uint32_t)present;
        j->end_kind = END_PUT;
        post_walked(e, j, arrival); /* before the answer: a Stats after it counts them */
        free(local);
        unsigned char resp[48];
        observe(e, H_PUT, now_ns() - arrival);
        __atomic_add_fetch(&e->plane_puts, 1, __ATOMIC_RELAXED);
        answer_unary(e, l, i, resp, put_response(resp, 0, present, 0, 0), arrival);
        return 1;
    }
    j->lane = l;
    j->slot = i;
    j->dependent = 1; /* a write: behind every earlier job of its gate */
    j->store = 1;
    j->ids = taken;
    j->nids = missing;
    j->words = mwords;
    j->key_len = (uint8_t)q.key_bytes;
    j->local = local;
    j->nl = q.nl; /* every layer of the registration (a Put names none) */
    j->runs = runs;
    j->nruns = nr;
    j->ndev = missing * ps;
    j->bytes_per_layer = missing * ps * tb * g->parts;
    j->stream = kv_streams(0, j->bytes_per_layer * (int64_t)j->nl);
    j->host = c->arena;
    j->lp_stride = lp;
    j->stop = &never_stopped;
    j->deadline_ns = q.timeout_ms ? arrival + (int64_t)q.timeout_ms * 1000000 : 0;
    mark_writes(j, 1); /* a later Load into these device pages waits for this copy */
    enqueue(e, j);
    return 1;
}

/* Takes the lane's SUBMITTED slots; returns how many. */
static int scan(Engine *e, Lane *l) {
    int took = 0;
    for (int i = 0; i < l->slots; i++) {
        if (__atomic_load_n(&l->slot_busy[i], __ATOMIC_ACQUIRE))
            continue;
        char *s = slot_at(l, i);
        if (state_of(s) != ST_SUBMITTED)
            continue;
        uint32_t rpc, n;
        memcpy(&rpc, s + 4, 4);
        memcpy(&n, s + 16, 4);
        set_state(s, ST_TAKEN);
        l->slot_busy[i] = 1;
        took++;
        if (l->gate->space) { /* a space's lane: its Lookups only; the loop refuses anything else */
            if (!(rpc == RPC_LOOKUP && try_answer(e, l, i, n)))
                handoff(e, l, i, rpc);
            continue;
        }
        if (!try_job(e, l, i, rpc, n) && !(rpc == RPC_GET && try_get(e, l, i, n)) &&
            !(rpc == RPC_LOOKUP && try_answer(e, l, i, n)) && !(rpc == RPC_PUT && try_put(e, l, i, n)))
            handoff(e, l, i, rpc);
    }
    return took;
}

/* Every watched lane's SUBMITTED slots, rung or not. */
static int scan_all(Engine *e) {
    int took = 0;
    for (Lane *l = e->lanes; l; l = l->next)
        if (l->watching)
            took += scan(e, l);
    return took;
}

/* Tells every lane's clients whether this thread looks at their slots without being rung. */
static void set_awake(Engine *e, int awake) {
    for (Lane *l = e->lanes; l; l = l->next)
        __atomic_store_n((uint32_t *)(l->ring + AWAKE_AT), (uint32_t)awake, __ATOMIC_RELAXED);
    e->awake = awake;
}

/* The plane words of the watched lanes (asleep or running: PLANE_*), on a change. */
static void set_plane(Engine *e, uint32_t state) {
    if (e->plane_state == state)
        return;
    for (Lane *l = e->lanes; l; l = l->next)
        if (l->watching)
            __atomic_store_n((uint32_t *)(l->ring + PLANE_AT), state, __ATOMIC_RELAXED);
    e->plane_state = state;
}

static void unwatch(Engine *e, Lane *l) {
    if (!l->watching)
        return;
    epoll_ctl(e->epfd, EPOLL_CTL_DEL, l->submit_fd, NULL);
    l->watching = 0;
    __atomic_store_n((uint32_t *)(l->ring + PLANE_AT), 0u, __ATOMIC_RELAXED); /* a nudge reaches no one */
    e->watched_slots -= l->slots;
}

static void doorbell(Engine *e, Lane *l) {
    char buf[16];
    for (int k = 0; k < MAX_DRAIN; k++) {
        ssize_t got = recv(l->submit_fd, buf, sizeof buf, MSG_DONTWAIT);
        if (got < 0 && (errno == EAGAIN || errno == EINTR))
            break;
        if (got <= 0) { /* the peer closed its end: it is gone; its release cleans up */
            unwatch(e, l);
            if (l->gate->space) /* no release closes a space's lane: the loop is told (slot -1) */
                handoff(e, l, -1, 0);
            break;
        }
    }
    scan(e, l);
}

static void publish_progress(Engine *e, Job *j, uint32_t flags) {
    char *s = slot_at(j->lane, j->slot);
    Gate *g = j->gate;
    uint32_t last = (uint32_t)(g->lim.start_layer + (j->li ? j->local[j->li - 1] : 0));
    j->step++;
    put32(s + 32, j->li);
    put32(s + 36, j->li ? last : 0);
    put64(s + 40, (uint64_t)j->li * (uint64_t)j->bytes_per_layer);
    put32(s + 48, j->recorded);
    put32(s + 52, j->found);
    put32(s + 60, flags);
    /* The layer's bytes and the words above before the step a reader watches (x86 keeps store
     * order anyway; a weakly ordered CPU needs the fence, and the reader an acquire: docs/lane.md). */
    __atomic_store_n((uint32_t *)(s + 56), j->step, __ATOMIC_RELEASE);
    j->published = j->li;
}

/* An ext load's layer landed: its progress word, then its eventfd (at most once an interval, and
 * always for the last layer), as the copy kernel signals a LayerSignal. */
static void ext_layer(Job *j) {
    if (!j->progress)
        return;
    __atomic_store_n(j->progress, (int64_t)j->li, __ATOMIC_RELEASE);
    int64_t t = now_ns();
    if (j->signal_fd >= 0 && (j->li == j->nl || t - j->last_pub_ns >= j->interval_ns)) {
        j->last_pub_ns = t;
        wake(j->signal_fd);
    }
}

static void unlink_job(Engine *e, Job *j) {
    Job **pp = &e->jobs;
    while (*pp != j)
        pp = &(*pp)->next;
    *pp = j->next;
    __atomic_sub_fetch(&e->njobs, 1, __ATOMIC_RELAXED);
    job_free(j);
}

/* Ends one of the loop's copies: posted back with how it ended and how many layers landed. */
static void finish_ext(Engine *e, Job *j, int status) {
    Gate *g = j->gate;
    pthread_mutex_lock(&g->mu);
    g->x_inflight--;
    pthread_mutex_unlock(&g->mu);
    pthread_mutex_lock(&e->hand_mu);
    e->done[e->ndone].ticket = j->ticket; /* room kept at submit_copy */
    e->done[e->ndone].status = status;
    e->done[e->ndone].layers = j->li;
    e->ndone++;
    e->unposted--;
    pthread_mutex_unlock(&e->hand_mu);
    unlink_job(e, j);
    wake(e->notify_fd);
}

static void answer_slot(Engine *e, Job *j, uint32_t code, const char *message);

/* Ends a Put the plane stores (try_put). Copied (code 0): under the cache's lock, each key filed
 * under the part in the stash page it was copied into (cache_store), unless the part holds it by
 * now (counted present: another Put stored it meanwhile, or it came twice); its end posted with the
 * pages filed first and the others after (the loop settles the ones, gives the others back to the
 * stash), then its slot answered. The lock the loop's for longer than the plane waits, the cache
 * closed, or one of its keys being written by another Put by now (the loop's, which waits for that
 * copy, and stores the key itself if it fails: a Put says present only of what is or will be
 * stored): nothing filed, and the slot handed to the loop, which serves the Put anew. Stopped (a
 * deadline, its gate closed) or its lane gone: nothing filed, its end posted, its slot answered
 * with why (unless its lane is gone). */
static void finish_put(Engine *e, Job *j, uint32_t code, const char *message, int answer) {
    Gate *g = j->gate;
    Cache *c = e->cache;
    int64_t stored = 0, present = j->misses, dropped = 0, filed = 0;
    mark_writes(j, -1);
    if (code == 0 && answer && cache_try_lock(c)) {
        filed = c->open;
        for (int64_t k = 0; filed && k < j->nids; k++) { /* a key being written: all of it the loop's */
            int64_t f = kv_index_find_one(&c->ix, j->words + KV_KEY_WORDS * k, j->key_len, g->cache_gid);
            filed = f < 0 || (f < c->pg.npages && c->pg.state[f] == KV_COMMITTED);
        }
        for (int64_t k = 0; filed && k < j->nids; k++) {
            int got = cache_store(c, j->ids[k], j->words + KV_KEY_WORDS * k, j->key_len, g->cache_gid);
            if (got <= 0) {
                *(got == 0 ? &present : &dropped) += 1;
                continue;
            }
            int64_t id = j->ids[stored]; /* the filed first: ids[0..stored) */
            j->ids[stored++] = j->ids[k];
            j->ids[k] = id;
        }
        pthread_mutex_unlock(&c->mu);
    }
    int handed = !filed && code == 0 && answer;
    j->found = (uint32_t)stored;
    j->misses = handed ? 0 : present; /* counted present by its end, unless the loop serves it anew */
    j->bytes_per_layer = stored * g->lim.page_size * g->token_bytes * g->parts;
    Lane *l = j->lane;
    int slot = j->slot;
    int64_t arrival = j->arrival_ns;
    post_get_end(e, j, filed ? DONE_OK : j->released ? DONE_RELEASED : DONE_HALTED);
    if (filed) {
        unsigned char resp[48];
        uint32_t len = put_response(resp, stored, present, dropped, (int64_t)j->nl * j->bytes_per_layer);
        observe(e, H_PUT, now_ns() - arrival);
        __atomic_add_fetch(&e->plane_stores, 1, __ATOMIC_RELAXED);
        answer_unary(e, l, slot, resp, len, arrival);
    } else if (handed) {
        handoff(e, l, slot, RPC_PUT);
    } else if (answer) {
        answer_slot(e, j, code, message);
    }
    unlink_job(e, j);
}

static void cuda_forget(Engine *e, Job *j);

/* Ends a job: its pages are no longer busy, its slot answered (unless its lane is gone: silent). */
static void finish(Engine *e, Job *j, uint32_t code, const char *message, int answer) {
    cuda_forget(e, j);
    if (j->store) {
        finish_put(e, j, code, message, answer);
        return;
    }
    if (j->get) { /* a Get served here: its end posted back with its pages, then its slot answered
                   * (a Stats after the answer settles it: its counters are there) */
        post_get_end(e, j, code == 0 ? DONE_OK : j->released ? DONE_RELEASED : DONE_HALTED);
        if (answer)
            answer_slot(e, j, code, message);
        unlink_job(e, j);
        return;
    }
    if (j->ext && !j->answers) {
        finish_ext(e, j, code == 0 ? DONE_OK : DONE_HALTED);
        return;
    }
    Gate *g = j->gate;
    int ok = code == 0;
    if (j->ext) { /* an answering copy of the loop's: its slot, then its end posted back */
        if (answer)
            answer_slot(e, j, code, message);
        finish_ext(e, j, ok ? DONE_OK : (j->released ? DONE_RELEASED : DONE_HALTED));
        return;
    }
    if (!j->load && !j->cuda)
        mark_writes(j, -1);
    pthread_mutex_lock(&g->mu);
    for (int64_t k = 0; k < j->npages; k++)
        g->busy[j->pages[k]]--;
    g->c_inflight--;
    if (ok && answer) {
        if (j->load) {
            g->bytes_loaded += (uint64_t)j->nl * (uint64_t)j->bytes_per_layer;
            g->load_ops++;
        } else {
            g->bytes_written += (uint64_t)j->nl * (uint64_t)j->bytes_per_layer;
            g->write_ops++;
        }
        g->served++;
    }
    pthread_mutex_unlock(&g->mu);
    if (answer)
        answer_slot(e, j, code, message);
    unlink_job(e, j);
}

/* Answers a job's slot: a load's layers and DONE, or its status and message. */
static void answer_slot(Engine *e, Job *j, uint32_t code, const char *message) {
    int ok = code == 0;
    int64_t took = now_ns() - j->arrival_ns;
    observe(e, j->answers ? H_GET : j->store ? H_PUT : j->load ? H_LOAD : H_WRITE, took);
    Lane *l = j->lane;
    char *s = slot_at(l, j->slot);
    /* This thread's time on the call, from taking the request to this answer (its turns behind
     * other copies included), without either side's wake-ups: what the client expects its next
     * Write to take (docs/lane.md, "Napping through a long write"). At least 1: 0 says "not the
     * plane's". */
    int64_t us = took / 1000;
    put32(s + BUSY_AT, us < 1 ? 1u : us > (int64_t)UINT32_MAX ? UINT32_MAX : (uint32_t)us);
    uint32_t resp_len = 0, msg_len = 0;
    if (ok && j->load) {
        publish_progress(e, j, FLAG_DONE | FLAG_JOB_ENDED);
    } else {
        if (!ok && j->load && j->li > j->published)
            publish_progress(e, j, 0); /* the layers that landed, then why it stopped */
        put32(s + 60, FLAG_JOB_ENDED);
    }
    if (j->get) { /* said in its flags, which the client reads once it sees DONE */
        uint32_t flags;
        memcpy(&flags, s + 60, 4);
        put32(s + 60, flags | FLAG_PLANE_GET);
    }
    if (ok && !j->load) /* WriteResponse{bytes}: field 1 */
        resp_len = pb_varint_field((unsigned char *)s + RESPONSE_AT, 0x08,
                                   (uint64_t)j->nl * (uint64_t)j->bytes_per_layer);
    if (message) {
        msg_len = (uint32_t)strlen(message);
        if (msg_len > ERROR_BYTES)
            msg_len = ERROR_BYTES;
        memcpy(s + ERROR_AT, message, msg_len);
    }
    put32(s + 20, code);
    put32(s + 24, resp_len);
    put32(s + 28, msg_len);
    memcpy(s + 64, s + 8, 8); /* done_seq: the seq the client wrote (TAKEN: it is ours) */
    __atomic_store_n(&l->slot_busy[j->slot], 0, __ATOMIC_RELEASE);
    __atomic_add_fetch(&e->served, 1, __ATOMIC_RELAXED); /* counted before the client can see it */
    set_state(s, ST_DONE);
    ring_done(l, j->slot);
}

static void stop_job(Engine *e, Job *j, const char *reason, uint32_t code, int answer) {
    char msg[256];
    snprintf(msg, sizeof msg,
             "copy stopped because %s: %u of its %u layers were copied, and nothing more of it will be",
             reason, j->li, j->nl);
    finish(e, j, code, msg, answer);
}

/* ---- CUDA jobs ------------------------------------------------------------------------------
 * A CUDA pool's Write or Load (its gate's set_cuda) is put on the pool's stream whole as it is
 * taken, in arrival order (the stream keeps the registration's order on the GPU): the wait on the
 * engine's ready event, each (layer, part)'s runs by cuMemcpyAsync or the copy kernel's launches
 * (cuda_launch), a load's layer event after
 * each layer, a write's own event at its end. None of these calls waits for the GPU. Its events are
 * then polled between the plane's other work (cuda_poll): a load's layers are published as they
 * land, as a copied one's are, and it ends once its last event has. Its pages stay busy until then.
 * No progress for the gate's cu_wait_ns (--cuda-wait-seconds: an engine's ready event that never
 * fires) gives the pool's GPU work up: the slot is answered DEADLINE_EXCEEDED, the gate says why
 * (cuda_failed: the loop fails the pool, whose release waits for its stream or quarantines it),
 * and the job keeps its pages until the gate closes. A driver error while it is put on the stream
 * records a marker behind what went there; once the marker has, it ends INTERNAL. */

#define CU_SPIN_NS 100000LL /* a CUDA job's events are looked at back to back this long after progress */
#define CU_NAP_MAX_NS 1000000LL

static void cuda_give_up(Engine *e, Job *j, const char *why, int rc) {
    Gate *g = j->gate;
    char reason[sizeof g->cu_failed];
    if (rc)
        snprintf(reason, sizeof reason, "%s (CUresult %d)", why, rc);
    else
        snprintf(reason, sizeof reason, "%s", why);
    pthread_mutex_lock(&g->mu);
    if (!g->cu_failed[0])
        memcpy(g->cu_failed, reason, sizeof reason);
    pthread_mutex_unlock(&g->mu);
    j->cu_stalled = 1;
    if (!j->cu_quiet) {
        char msg[sizeof reason + 128];
        snprintf(msg, sizeof msg, "this client's GPU work is given up on: %s. The client is failed and "
                 "reclaimed; register again", reason);
        answer_slot(e, j, CODE_DEADLINE, msg);
        j->cu_quiet = 1;
    }
    /* The loop learns it from cuda_failed: the reaper's next look at the client (plane_failed)
     * fails and reclaims it, and a loop's copy of the client waiting for its turn fails at once. */
}

/* A kernel job's launches (cuda_takes gave it a span of the gate's argument area): its bases, one a
 * (layer, part) for each side, and its token rows' offsets, written into the span; the widest word
 * dividing the row and every base and offset; then a launch a layer for a load, each followed by
 * the layer's event, or one launch for a write. *enqueued: whether any launch was made. */
static int cuda_launch(Gate *g, Job *j, void *st, int *enqueued) {
    kv_cuda_driver *cu = &g->cu;
    int64_t tb = g->token_bytes, stride = g->dev_stride, nlayers = g->lim.num_layers;
    int64_t nlp = (int64_t)j->nl * g->parts, rows = j->ndev;
    j->cu_args_at = g->cu_args_head;
    j->cu_args_len = j->cu_args_want;
    g->cu_args_head += j->cu_args_len;
    uint64_t *dst_b = (uint64_t *)(g->cu_args + j->cu_args_pos), *src_b = dst_b + nlp;
    int64_t *dst_o = (int64_t *)(src_b + nlp), *src_o = dst_o + rows;
    uint64_t acc = (uint64_t)tb;
    for (uint32_t li = 0; li < j->nl; li++)
        for (int part = 0; part < g->parts; part++) {
            int64_t lp = (int64_t)j->local[li] * g->parts + part, at = (int64_t)li * g->parts + part;
            uint64_t host = (uint64_t)(uintptr_t)(j->host + lp * j->lp_stride) + (uint64_t)g->cu_host_shift;
            uint64_t dev = (uint64_t)(uintptr_t)g->dev_bases[lp];
            dst_b[at] = j->load ? dev : host;
            src_b[at] = j->load ? host : dev;
            acc |= host | dev;
        }
    int64_t row = 0;
    for (int64_t k = 0; k < j->nruns; k++)
        for (int64_t t = 0; t < j->runs[k].ntok; t++, row++) {
            int64_t h = j->runs[k].host_off + t * tb, d = (j->runs[k].dev_tok + t) * stride;
            dst_o[row] = j->load ? d : h;
            src_o[row] = j->load ? h : d;
            acc |= (uint64_t)h | (uint64_t)d;
        }
    int word = 8, which = 0;
    while (word > 1 && (acc & (uint64_t)(word - 1))) {
        word >>= 1;
        which++;
    }
    void *f = g->cu_kernels[which];
    /* The area is host memory the kernel reads over the bus: written whole before the launch. */
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    long long n = rows, row_words = tb / word;
    unsigned long long dev_args = (unsigned long long)(uintptr_t)g->cu_args + (unsigned long long)g->cu_args_shift;
    unsigned long long d_dst_o = dev_args + (unsigned long long)((char *)dst_o - g->cu_args);
    unsigned long long d_src_o = dev_args + (unsigned long long)((char *)src_o - g->cu_args);
    int rc = 0;
    for (uint32_t li = 0; !rc && li < (j->load ? j->nl : 1); li++) {
        int count = j->load ? g->parts : (int)nlp;
        int64_t first = j->load ? (int64_t)li * g->parts : 0;
        unsigned long long d_dst_b = dev_args + (unsigned long long)((char *)(dst_b + first) - g->cu_args);
        unsigned long long d_src_b = dev_args + (unsigned long long)((char *)(src_b + first) - g->cu_args);
        int64_t blocks = (rows * count + g->cu_warps - 1) / g->cu_warps;
        if (blocks > g->cu_max_blocks)
            blocks = g->cu_max_blocks;
        void *params[] = {&d_dst_b, &d_src_b, &count, &d_dst_o, &d_src_o, &n, &row_words};
        *enqueued = 1;
        rc = cu->launch_kernel(f, (unsigned)blocks, 1, 1, 32u * (unsigned)g->cu_warps, 1, 1, 0, st, params, NULL);
        if (!rc && j->load)
            rc = cu->event_record(g->cu_events[(int64_t)j->cu_slot * nlayers + j->local[li]], st);
    }
    return rc;
}

/* Puts job j on its gate's stream (see above). */
static void cuda_issue(Engine *e, Job *j) {
    Gate *g = j->gate;
    kv_cuda_driver *cu = &g->cu;
    void *st = g->cu_stream;
    int64_t tb = g->token_bytes, stride = g->dev_stride, nlayers = g->lim.num_layers;
    int rc = cu->ctx_set_current(g->cu_ctx);
    if (!rc && !j->load)
        rc = cu->event_create(&j->cu_done, KV_CU_DONE_EVENT_FLAGS);
    int enqueued = 0; /* whether anything of it may be on the stream */
    if (!rc && j->cu_ready) {
        enqueued = 1;
        rc = cu->stream_wait_event(st, j->cu_ready, 0);
    }
    if (!rc && j->cu_kernel)
        rc = cuda_launch(g, j, st, &enqueued);
    for (uint32_t li = 0; !rc && !j->cu_kernel && li < j->nl; li++) {
        for (int part = 0; !rc && part < g->parts; part++) {
            int64_t lp = (int64_t)j->local[li] * g->parts + part;
            uint64_t host = (uint64_t)(uintptr_t)(j->host + lp * j->lp_stride) + (uint64_t)g->cu_host_shift;
            uint64_t dev = (uint64_t)(uintptr_t)g->dev_bases[lp];
            for (int64_t k = 0; !rc && k < j->nruns; k++) {
                const Run *r = &j->runs[k];
                uint64_t h = host + (uint64_t)r->host_off, d = dev + (uint64_t)(r->dev_tok * stride);
                enqueued = 1;
                rc = j->load ? cu->memcpy_async(d, h, (size_t)(r->ntok * tb), st)
                             : cu->memcpy_async(h, d, (size_t)(r->ntok * tb), st);
            }
        }
        if (!rc && j->load)
            rc = cu->event_record(g->cu_events[(int64_t)j->cu_slot * nlayers + j->local[li]], st);
    }
    if (!rc && !j->load)
        rc = cu->event_record(j->cu_done, st);
    int64_t t = now_ns();
    j->cu_progress_ns = e->cu_progress_ns = t;
    __atomic_add_fetch(&g->cu_jobs, 1, __ATOMIC_RELAXED);
    g->cu_queued += j->cu_ops; /* counted whole, whatever reached the stream, until it ends */
    e->cu_queued += j->cu_ops;
    if (!rc) {
        if (j->load) { /* the engine may now make its compute stream wait on the layer events */
            j->recorded = 1;
            publish_progress(e, j, 0);
            ring_done(j->lane, j->slot);
        }
        return;
    }
    j->cu_error = rc;
    if (!enqueued) { /* nothing reached the stream: it ends here */
        if (j->cu_done)
            cu->event_destroy(j->cu_done);
        j->cu_done = NULL;
        return; /* cuda_poll ends it */
    }
    /* A marker behind what went on the stream: the pages are let go only once it has passed. */
    if (!j->cu_done && cu->event_create(&j->cu_done, KV_CU_DONE_EVENT_FLAGS) != KV_CU_SUCCESS)
        j->cu_done = NULL;
    if (j->cu_done && cu->event_record(j->cu_done, st) != KV_CU_SUCCESS) {
        cu->event_destroy(j->cu_done);
        j->cu_done = NULL;
    }
    if (!j->cu_done)
        cuda_give_up(e, j, "a copy could not be put on the GPU's stream, nor a marker behind it", rc);
}

/* A job a driver call failed to put on the stream ends INTERNAL, once what reached it has passed. */
static void cuda_end_failed_issue(Engine *e, Job *j) {
    char msg[128];
    snprintf(msg, sizeof msg, "putting the copy on the GPU's stream failed: CUresult %d", j->cu_error);
    finish(e, j, 13 /* INTERNAL */, msg, !j->cu_quiet);
}

/* An issued CUDA job's events, looked at (see above); it may end here. */
static void cuda_poll(Engine *e, Job *j, int64_t t) {
    Gate *g = j->gate;
    kv_cuda_driver *cu = &g->cu;
    if (j->cu_stalled)
        return;
    if (g->cu_failed[0]) { /* another job of the pool was given up on: so is this one, at once (this
                            * thread alone writes cu_failed) */
        cuda_give_up(e, j, g->cu_failed, 0);
        return;
    }
    if (j->cu_error && !j->cu_done) { /* nothing of it reached the stream */
        cuda_end_failed_issue(e, j);
        return;
    }
    int rc = cu->ctx_set_current(g->cu_ctx);
    uint32_t before = j->li;
    if (!rc && j->cu_done) { /* a write's end, or the marker behind a failed issue */
        rc = cu->event_query(j->cu_done);
        if (rc == KV_CU_SUCCESS) {
            cu->event_destroy(j->cu_done);
            j->cu_done = NULL;
            if (j->cu_error) {
                cuda_end_failed_issue(e, j);
                return;
            }
            j->li = j->nl;
        }
    } else if (!rc) {
        int64_t nlayers = g->lim.num_layers;
        while (j->li < j->nl &&
               (rc = cu->event_query(g->cu_events[(int64_t)j->cu_slot * nlayers + j->local[j->li]])) == KV_CU_SUCCESS)
            j->li++;
    }
    if (rc != KV_CU_SUCCESS && rc != KV_CU_NOT_READY) {
        cuda_give_up(e, j, "looking at its copies' events failed", rc);
        return;
    }
    if (j->li == before) {
        if (t - j->cu_progress_ns >= g->cu_wait_ns) {
            char why[160];
            snprintf(why, sizeof why, "its GPU copies made no progress for %.3g s (--cuda-wait-seconds): an "
                     "event they wait on, such as the engine's ready event, has not fired", (double)g->cu_wait_ns / 1e9);
            cuda_give_up(e, j, why, 0);
        }
        return;
    }
    j->cu_progress_ns = e->cu_progress_ns = t;
    if (j->load && before == 0)
        observe(e, H_FIRST, t - j->arrival_ns);
    if (j->li == j->nl) {
        finish(e, j, 0, NULL, !j->cu_quiet);
        return;
    }
    if (!j->cu_quiet) {
        publish_progress(e, j, 0);
        if (t - j->last_pub_ns >= e->progress_interval_ns) {
            j->last_pub_ns = t;
            ring_done(j->lane, j->slot);
        }
    }
}

/* A CUDA job leaves the jobs: its own event, if it still has one, goes (destroying an event
 * whose record is pending is safe: the driver frees it once it completes). */
static void cuda_forget(Engine *e, Job *j) {
    if (j->cuda) {
        j->gate->cu_queued -= j->cu_ops;
        e->cu_queued -= j->cu_ops;
        j->cu_ops = 0;
    }
    if (j->cu_kernel && j->cu_args_len) { /* its span goes back: the ring's tail is the oldest span left */
        Gate *g = j->gate;
        int64_t tail = g->cu_args_head;
        for (Job *o = e->jobs; o; o = o->next)
            if (o != j && o->gate == g && o->cu_kernel && o->cu_args_len) {
                tail = o->cu_args_at;
                break;
            }
        if (tail == g->cu_args_head) /* none left: the next span starts at the area's start */
            tail = g->cu_args_head = 0;
        g->cu_args_tail = tail;
        j->cu_args_len = 0;
    }
    if (j->cuda && j->cu_done) {
        Gate *g = j->gate;
        g->cu.ctx_set_current(g->cu_ctx);
        g->cu.event_destroy(j->cu_done);
        j->cu_done = NULL;
    }
}

/* How long the thread may nap before it looks at the CUDA jobs' events again: 0 while any job
 * has CPU work (or no CUDA job waits), or soon after the last progress; then a growing part of the
 * time since, up to CU_NAP_MAX_NS, as the loop's waits on the GPU do (media/cuda/waits.py). */
static int64_t cuda_nap_ns(Engine *e) {
    int any = 0;
    for (Job *j = e->jobs; j; j = j->next) {
        if (!j->cuda)
            return 0;
        if (!j->cu_stalled)
            any = 1;
    }
    if (!any)
        return CU_NAP_MAX_NS; /* only given-up jobs, held until their gates close */
    int64_t since = now_ns() - e->cu_progress_ns;
    if (since < CU_SPIN_NS)
        return 0;
    int64_t nap = since / 4;
    return nap < 20000 ? 20000 : nap > CU_NAP_MAX_NS ? CU_NAP_MAX_NS : nap;
}

/* mark_runnable's passes, counted across engines: a gate's marks are never read for another pass's.
 * (A gate belongs to one engine, whose thread alone reads and writes them; two engines' threads on
 * one gate would race, as on its write marks.) */
static uint64_t order_passes;

/* A registration's own copies keep their order: a job may run only if no earlier job of its gate
 * holds it back, that is any earlier one for a job that depends on its writes (every write, and a
 * load touching their pages), else an earlier load. One pass in arrival order marks every job, so
 * a piece costs O(jobs), not a scan of the earlier jobs for each one (O(jobs^2) with many engines'
 * rings full). */
static void mark_runnable(Engine *e) {
    uint64_t pass = __atomic_add_fetch(&order_passes, 1, __ATOMIC_RELAXED);
    for (Job *j = e->jobs; j; j = j->next) {
        Gate *g = j->gate;
        if (g->order_pass != pass) {
            g->order_pass = pass;
            g->order_any = g->order_loads = 0;
        }
        /* A CUDA job is on its stream from the start (cuda_issue): the stream keeps its order. */
        j->can_run = !j->cuda && !(j->dependent ? g->order_any : g->order_loads);
        g->order_any = 1;
        if (j->load)
            g->order_loads = 1;
    }
}

/* One piece of job j: runs of the current (layer, part) up to PIECE_BYTES; returns its bytes. */
/* Copies job j's runs of its current (layer, part) from run j->ri on, until `budget` bytes are
 * copied or none is left, and fences them (before any progress, end or answer can say the bytes
 * are there); returns the bytes copied. */
static int64_t copy_runs(Job *j, int64_t budget) {
    Gate *g = j->gate;
    int64_t lp = (int64_t)j->local[j->li] * g->parts + j->part;
    char *host = j->host + lp * j->lp_stride;
    char *dev = g->dev_bases[lp];
    int64_t left = budget, tb = g->token_bytes, stride = g->dev_stride;
    while (j->ri < j->nruns && left > 0) {
        Run *r = &j->runs[j->ri++];
        size_t nb = (size_t)(r->ntok * tb);
        char *h = host + r->host_off, *d = dev + r->dev_tok * stride;
        if (j->load)
            kv_copy(d, h, nb, j->stream);
        else
            kv_copy(h, d, nb, j->stream);
        left -= (int64_t)nb;
    }
    kv_copy_fence(j->stream);
    return budget - left;
}

static int64_t run_piece(Engine *e, Job *j) {
    Gate *g = j->gate;
    int64_t copied = copy_runs(j, PIECE_BYTES);
    if (j->ri < j->nruns)
        return copied;
    j->ri = 0;
    if (++j->part < g->parts)
        return copied;
    j->part = 0;
    j->li++;
    if (j->ext && !j->answers) {
        ext_layer(j);
        if (j->li == j->nl)
            finish(e, j, 0, NULL, 1);
        return copied;
    }
    if (j->load && j->li == 1)
        observe(e, j->answers ? H_GET_FIRST : H_FIRST, now_ns() - j->arrival_ns);
    if (j->li == j->nl) {
        finish(e, j, 0, NULL, 1);
        return copied;
    }
    if (j->load) {
        /* Every layer's words (a few stores: a spinning waiter sees each layer land); the
         * doorbell that wakes a sleeping waiter at most once per progress interval (each costs
         * this thread a system call and the engine a wake-up), and always at the end. */
        publish_progress(e, j, 0);
        int64_t t = now_ns();
        if (t - j->last_pub_ns >= e->progress_interval_ns) {
            j->last_pub_ns = t;
            ring_done(j->lane, j->slot);
        }
    }
    return copied;
}

/* Stops jobs whose deadline passed, at a layer boundary; runs one piece of the best job.
 * Returns whether any job is left. */
static int work(Engine *e) {
    int64_t t = 0;
    for (Job *j = e->jobs, *next; j; j = next) {
        next = j->next;
        if (j->cuda) { /* on the GPU already: it ends once the GPU is done with it, or is given up on */
            if (j->released && j->cu_stalled) {
                stop_job(e, j, "its client was unregistered or reclaimed", CODE_NOT_FOUND, !j->cu_quiet);
            } else {
                if (!t)
                    t = now_ns();
                cuda_poll(e, j, t);
            }
            continue;
        }
        if (j->part || j->ri)
            continue; /* a layer is never left half copied */
        if (j->answers) { /* its gate's close may have come before the job joined: read it here */
            /* Its stop word is set only by its client's release (no call waits on it to cancel). */
            if (j->released || __atomic_load_n(&j->gate->closed, __ATOMIC_ACQUIRE) ||
                __atomic_load_n(j->stop, __ATOMIC_RELAXED)) {
                j->released = 1;
                stop_job(e, j, "its client was unregistered or reclaimed", CODE_NOT_FOUND, 1);
            } else if (j->li == j->nl) {
                finish(e, j, 0, NULL, 1);
            } else if (j->deadline_ns) {
                if (!t)
                    t = now_ns();
                if (t >= j->deadline_ns)
                    stop_job(e, j, "its timeout_ms passed", CODE_DEADLINE, 1);
            }
            continue;
        }
        if (j->ext) { /* its gate's close may have come before the job joined: read it here */
            if (j->released || __atomic_load_n(&j->gate->closed, __ATOMIC_ACQUIRE))
                finish_ext(e, j, DONE_RELEASED);
            else if (__atomic_load_n(j->stop, __ATOMIC_RELAXED))
                finish_ext(e, j, DONE_STOPPED);
            else if (j->li == j->nl) /* no layers asked for */
                finish_ext(e, j, DONE_OK);
            continue;
        }
        if (j->released) {
            stop_job(e, j, "its client was unregistered or reclaimed", CODE_NOT_FOUND, 1);
        } else if (j->deadline_ns) {
            if (!t)
                t = now_ns();
            if (t >= j->deadline_ns)
                stop_job(e, j, "its timeout_ms passed", CODE_DEADLINE, 1);
        }
    }
    Job *best = NULL;
    if (e->paused)
        return e->jobs != NULL;
    mark_runnable(e); /* after the stops above, which may have ended jobs */
    /* A job to stop (released, past its deadline) finishes its layer first, whatever else waits:
     * a release or a deadline is never held up by other engines' loads. */
    for (Job *j = e->jobs; j && !best; j = j->next)
        if ((j->released || (j->deadline_ns && (t ? t : (t = now_ns())) >= j->deadline_ns) ||
             (j->ext && __atomic_load_n(j->stop, __ATOMIC_RELAXED))) && j->can_run)
            best = j;
    /* Loads first, but not for ever: after WRITE_EVERY_BYTES of loads in a row while a write
     * waited, writes get WRITE_TURN_BYTES (as the copy workers give a write a 2 MiB piece after
     * eight of loads), so a stream of loads never starves an offload, however many layers it has. */
    int write_turn = e->write_credit > 0;
    for (Job *j = e->jobs; j && !best && !write_turn; j = j->next)
        if (j->load && j->can_run)
            best = j;
    /* Writes take turns, a piece each, in arrival order from the one after the write that last
     * copied (the list is in arrival order): a large offload or Put of one engine never holds
     * another engine's write until it ends. A registration's own copies keep their order
     * (mark_runnable()). */
    Job *first = NULL;
    for (Job *j = e->jobs; j && !best; j = j->next)
        if (!j->load && j->can_run) {
            if (!first)
                first = j;
            if (j->seq > e->last_write)
                best = j;
        }
    if (!best)
        best = first;
    for (Job *j = e->jobs; j && !best; j = j->next) /* a write's turn, and no write to take */
        if (j->load && j->can_run)
            best = j;
    if (!best)
        return e->jobs != NULL;
    int load = best->load, writes_wait = 0, loads_wait = 0; /* runnable, besides best */
    for (Job *j = e->jobs; j && !(load ? writes_wait : loads_wait); j = j->next)
        if (j != best && j->load != load && j->can_run)
            *(j->load ? &loads_wait : &writes_wait) = 1;
    if (!load) {
        e->last_write = best->seq;
        if (write_turn && loads_wait) /* a piece run ahead of a load: counted for the tests */
            __atomic_add_fetch(&e->write_turns, 1, __ATOMIC_RELAXED);
    }
    int64_t copied = run_piece(e, best); /* best may be gone after it */
    if (load && writes_wait) {
        e->loads_in_a_row += copied;
        if (e->loads_in_a_row >= WRITE_EVERY_BYTES) {
            e->loads_in_a_row = 0;
            e->write_credit = WRITE_TURN_BYTES;
        }
    } else if (!load && loads_wait && write_turn) {
        e->write_credit -= copied; /* the writes' turn, spent piece by piece */
    } else { /* nothing waited on the other side: nothing is owed either way */
        e->loads_in_a_row = 0;
        e->write_credit = 0;
    }
    return e->jobs != NULL;
}

static void remove_lane(Engine *e, Lane *l) {
    for (Job *j = e->jobs, *next; j; j = next) {
        next = j->next;
        if (j->lane == l && j->cuda) {
            /* On the GPU: it keeps its pages until its events pass or it is given up on, released
             * or not; its ring is not written again. Its gate outlives it: the client holds the
             * gate (ClientState.gate) until its release has seen the gate idle (DataPlane.idle). */
            j->cu_quiet = 1;
            j->lane = NULL;
        }
        else if (j->lane == l)
            finish(e, j, 1, NULL, 0); /* its ring goes now: nothing is written to it */
    }
    unwatch(e, l);
    Lane **pp = &e->lanes;
    while (*pp && *pp != l)
        pp = &(*pp)->next;
    if (*pp)
        *pp = l->next;
}

static void take_incoming(Engine *e);

static void command(Engine *e) {
    pthread_mutex_lock(&e->cmd_mu);
    int cmd = e->cmd;
    void *arg = e->cmd_arg;
    pthread_mutex_unlock(&e->cmd_mu);
    if (cmd == CMD_NONE)
        return;
    if (cmd == CMD_ADD) {
        Lane *l = arg;
        struct epoll_event ev = {.events = EPOLLIN, .data.ptr = l};
        l->watching = epoll_ctl(e->epfd, EPOLL_CTL_ADD, l->submit_fd, &ev) == 0;
        if (l->watching) {
            e->watched_slots += l->slots;
            /* The client may ring ahead of a call (a nudge), so that this thread is awake when the
             * request lands: a wake-up it would otherwise wait for after writing it. */
            __atomic_store_n((uint32_t *)(l->ring + PLANE_AT), e->plane_state ? e->plane_state : PLANE_RUNNING,
                             __ATOMIC_RELAXED);
        }
        l->next = e->lanes;
        e->lanes = l;
        __atomic_store_n((uint32_t *)(l->ring + AWAKE_AT), (uint32_t)e->awake, __ATOMIC_RELAXED);
        __atomic_thread_fence(__ATOMIC_SEQ_CST);
        scan(e, l);
    } else if (cmd == CMD_REMOVE) {
        take_incoming(e); /* an answering copy submitted for this lane is ended with it */
        remove_lane(e, arg);
    } else if (cmd == CMD_CLOSE_GATE) {
        Gate *g = arg;
        pthread_mutex_lock(&g->mu);
        __atomic_store_n(&g->closed, 1, __ATOMIC_RELEASE);
        pthread_mutex_unlock(&g->mu);
        for (Job *j = e->jobs; j; j = j->next)
            if (j->gate == g)
                j->released = 1; /* ends at its next layer boundary: Python waits for inflight 0 */
    } else if (cmd == CMD_PAUSE || cmd == CMD_RESUME) {
        e->paused = cmd == CMD_PAUSE;
    } else if (cmd == CMD_UNWATCH_ALL) {
        for (Lane *l = e->lanes; l; l = l->next)
            unwatch(e, l);
    }
    pthread_mutex_lock(&e->cmd_mu);
    e->cmd = CMD_NONE;
    e->cmd_done = 1;
    pthread_cond_broadcast(&e->cmd_cv);
    pthread_mutex_unlock(&e->cmd_mu);
}

/* The loop's copies submitted since the last look join the jobs, in submission order. */
static void take_incoming(Engine *e) {
    if (!__atomic_load_n(&e->nincoming, __ATOMIC_ACQUIRE))
        return;
    pthread_mutex_lock(&e->in_mu);
    Job *in = e->incoming;
    e->incoming = NULL;
    __atomic_store_n(&e->nincoming, 0, __ATOMIC_RELEASE);
    pthread_mutex_unlock(&e->in_mu);
    Job **tail = &e->jobs;
    while (*tail)
        tail = &(*tail)->next;
    *tail = in;
    for (; in; in = in->next) {
        in->seq = ++e->next_seq;
        if (in->counted) {
            /* An answering copy's request was counted in its gate's py_inflight when it was handed
             * over, which keeps the gate's new requests off the plane. Given back here, on this
             * thread, once the copy is among the jobs: a request taken after this runs behind it
             * (mark_runnable), so the plane takes them again without waiting for the loop to
             * settle the copy's end. */
            pthread_mutex_lock(&in->gate->mu);
            if (in->gate->py_inflight > 0)
                in->gate->py_inflight--;
            pthread_mutex_unlock(&in->gate->mu);
            in->counted = 0;
        }
    }
}

static void *engine_main(void *arg) {
    Engine *e = arg;
    struct epoll_event evs[64];
    /* Until then, an idle thread looks again at once instead of sleeping: an engine's next call
     * usually follows its last answer within microseconds, and waking a sleeping thread costs
     * more than that (tens of microseconds on a virtual machine). */
    int64_t spin_until = 0;
    for (;;) {
        /* Held (tests), jobs still meet their deadlines: looked at every millisecond. */
        int timeout = e->jobs ? (e->paused ? 1 : 0) : -1;
        int spinning = timeout < 0 && spin_until && now_ns() < spin_until;
        /* While the thread spins it says so in every ring, and clients skip the doorbell: it
         * finds their slots by looking. Before it sleeps or copies (between pieces it reads the
         * doorbells: one system call, however many lanes) it takes that back, then looks once
         * more: a client that read "awake" just before stored its slot's state first, and a full
         * fence on each side makes one of the two see the other. */
        int looking = spinning && e->watched_slots <= AWAKE_MAX_SLOTS;
        if (looking != e->awake) {
            set_awake(e, looking);
            if (!looking) {
                __atomic_thread_fence(__ATOMIC_SEQ_CST);
                if (scan_all(e)) {
                    if (e->spin_ns)
                        spin_until = now_ns() + e->spin_ns;
                    continue;
                }
            }
        }
        /* Before a sleep (not a look, nor a held copy's 1 ms wait) the lanes' plane words say
         * so, and a client rings ahead of its next call (docs/lane.md, "Ringing ahead"). */
        int sleeps = !spinning && timeout < 0;
        if (sleeps)
            set_plane(e, PLANE_ASLEEP);
        /* Only CUDA jobs, waiting on the GPU: a nap (finer than epoll's milliseconds), woken early
         * by a doorbell or a command, before their events are looked at again. */
        int64_t nap = timeout == 0 ? cuda_nap_ns(e) : 0;
        if (nap > 0) {
            struct pollfd p = {.fd = e->epfd, .events = POLLIN};
            struct timespec ts = {.tv_sec = nap / 1000000000LL, .tv_nsec = nap % 1000000000LL};
            (void)ppoll(&p, 1, &ts, NULL);
        }
        int n = epoll_wait(e->epfd, evs, 64, spinning ? 0 : timeout);
        if (sleeps)
            set_plane(e, PLANE_RUNNING);
        int took = looking ? scan_all(e) : 0;
        if (spinning && n == 0 && !took) {
            sched_yield();  /* a spinning thread lets whatever else is runnable on its CPU go first */
            continue;
        }
        int stop = 0, woken = 0;
        /* Lanes first: a command may remove (and its caller free) a lane of this same batch. */
        for (int k = 0; k < n; k++) {
            if (evs[k].data.ptr == NULL) {
                woken = 1;
            } else {
                Lane *l = evs[k].data.ptr;
                if (l->watching)
                    doorbell(e, l);
            }
        }
        if ((n > 0 || took || e->jobs) && e->spin_ns)
            spin_until = now_ns() + e->spin_ns;
        if (woken) {
            uint64_t v;
            (void)!read(e->wake_fd, &v, 8);
            pthread_mutex_lock(&e->cmd_mu);
            stop = e->cmd == CMD_STOP;
            pthread_mutex_unlock(&e->cmd_mu);
            if (!stop)
                command(e);
        }
        take_incoming(e);
        if (stop)
            break;
        if (e->jobs)
            work(e);
    }
    take_incoming(e);
    while (e->jobs)
        finish(e, e->jobs, 1, NULL, 0);
    /* Stopped: no ring says this thread looks at its slots or reads its doorbell any more. */
    set_awake(e, 0);
    for (Lane *l = e->lanes; l; l = l->next)
        unwatch(e, l);
    return NULL;
}

/* Runs a command on the thread and waits for it (the GIL released meanwhile). */
static void run_command(Engine *e, int cmd, void *arg) {
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&e->call_mu);
    pthread_mutex_lock(&e->cmd_mu);
    e->cmd = cmd;
    e->cmd_arg = arg;
    e->cmd_done = 0;
    pthread_mutex_unlock(&e->cmd_mu);
    wake(e->wake_fd);
    pthread_mutex_lock(&e->cmd_mu);
    while (!e->cmd_done)
        pthread_cond_wait(&e->cmd_cv, &e->cmd_mu);
    pthread_mutex_unlock(&e->cmd_mu);
    pthread_mutex_unlock(&e->call_mu);
    Py_END_ALLOW_THREADS
}

static int engine_init(Engine *e, PyObject *args, PyObject *kw) {
    static char *names[] = {"progress_interval", "buckets", "spin", NULL};
    double interval = 0.0, spin = 0.0;
    PyObject *buckets = NULL;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "|dOd", names, &interval, &buckets, &spin))
        return -1;
    if (!(spin >= 0 && spin <= 0.01)) {
        PyErr_SetString(PyExc_ValueError, "spin must be between 0 and 10 ms");
        return -1;
    }
    if (buckets) {
        Py_ssize_t n = PySequence_Size(buckets);
        if (n < 0 || n > MAX_EDGES) {
            PyErr_SetString(PyExc_ValueError, "at most 32 bucket edges");
            return -1;
        }
        for (Py_ssize_t i = 0; i < n; i++) {
            PyObject *item = PySequence_GetItem(buckets, i);
            e->edges[i] = item ? PyFloat_AsDouble(item) : 0;
            Py_XDECREF(item);
            if (PyErr_Occurred())
                return -1;
        }
        e->nedges = (int)n;
    }
    if (e->started) {
        PyErr_SetString(PyExc_RuntimeError, "an Engine is made once");
        return -1;
    }
    e->progress_interval_ns = (int64_t)(interval * 1e9);
    e->spin_ns = (int64_t)(spin * 1e9);
    pthread_mutex_init(&e->call_mu, NULL);
    pthread_mutex_init(&e->cmd_mu, NULL);
    pthread_mutex_init(&e->hand_mu, NULL);
    pthread_mutex_init(&e->in_mu, NULL);
    pthread_mutex_init(&e->stat_mu, NULL);
    pthread_cond_init(&e->cmd_cv, NULL);
    e->epfd = epoll_create1(EPOLL_CLOEXEC);
    e->wake_fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    e->notify_fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    if (e->epfd < 0 || e->wake_fd < 0 || e->notify_fd < 0) {
        PyErr_SetFromErrno(PyExc_OSError);
        return -1;
    }
    struct epoll_event ev = {.events = EPOLLIN, .data.ptr = NULL};
    if (epoll_ctl(e->epfd, EPOLL_CTL_ADD, e->wake_fd, &ev) < 0) {
        PyErr_SetFromErrno(PyExc_OSError);
        return -1;
    }
    if (pthread_create(&e->thread, NULL, engine_main, e) != 0) {
        PyErr_SetString(PyExc_OSError, "could not start the data plane's thread");
        return -1;
    }
    e->started = 1;
    return 0;
}

static PyObject *engine_stop(Engine *e, PyObject *unused) {
    if (e->started == 1) {
        Py_BEGIN_ALLOW_THREADS
        pthread_mutex_lock(&e->call_mu);
        pthread_mutex_lock(&e->cmd_mu);
        e->cmd = CMD_STOP;
        pthread_mutex_unlock(&e->cmd_mu);
        wake(e->wake_fd);
        pthread_join(e->thread, NULL);
        pthread_mutex_unlock(&e->call_mu);
        Py_END_ALLOW_THREADS
        e->started = 2;
        while (e->lanes) { /* lanes never removed: their gate references go */
            Lane *l = e->lanes;
            e->lanes = l->next;
            Py_DECREF(l->gate);
            free(l);
        }
    }
    Py_RETURN_NONE;
}

static void engine_dealloc(Engine *e) {
    engine_stop(e, NULL);
    if (e->epfd > 0)
        close(e->epfd);
    if (e->wake_fd > 0)
        close(e->wake_fd);
    if (e->notify_fd > 0)
        close(e->notify_fd);
    free(e->hand);
    free(e->done);
    for (size_t k = 0; k < e->ngets; k++)
        free(e->gets[k].ids);
    free(e->gets);
    Py_XDECREF(e->cache);
    Py_TYPE(e)->tp_free((PyObject *)e);
}

/* add_lane(key, gate, ring address, slots, submit fd, done fds, quiet=False): quiet, the client
 * sets a slot's waiting word before it sleeps on its done doorbell (ring.FEATURE_QUIET_DONE). */
static PyObject *engine_add_lane(Engine *e, PyObject *args) {
    long long key;
    Gate *gate;
    unsigned long long ring;
    int slots, submit, quiet = 0;
    PyObject *done;
    if (!PyArg_ParseTuple(args, "LO!KiiO|p", &key, &GateType, &gate, &ring, &slots, &submit, &done, &quiet))
        return NULL;
    if (e->started != 1) {
        PyErr_SetString(PyExc_RuntimeError, "the data plane has stopped");
        return NULL;
    }
    if (slots < 1 || slots > MAX_SLOTS || PySequence_Size(done) != slots) {
        PyErr_SetString(PyExc_ValueError, "a lane has 1 to 64 slots, one done doorbell each");
        return NULL;
    }
    Lane *l = calloc(1, sizeof(Lane));
    if (!l)
        return PyErr_NoMemory();
    for (int i = 0; i < slots; i++) {
        PyObject *item = PySequence_GetItem(done, i);
        l->done_fd[i] = item ? (int)PyLong_AsLong(item) : -1;
        Py_XDECREF(item);
        if (PyErr_Occurred()) {
            free(l);
            return NULL;
        }
    }
    l->key = key;
    l->ring = (char *)(uintptr_t)ring;
    l->slots = slots;
    l->submit_fd = submit;
    l->quiet = quiet;
    l->gate = gate;
    Py_INCREF(gate);
    run_command(e, CMD_ADD, l);
    return PyLong_FromVoidPtr(l);
}

static Lane *lane_of(Engine *e, PyObject *handle) {
    void *p = PyLong_AsVoidPtr(handle);
    if (!p && PyErr_Occurred())
        return NULL;
    for (Lane *l = e->lanes; l; l = l->next)
        if (l == p)
            return l;
    PyErr_SetString(PyExc_KeyError, "no such lane");
    return NULL;
}

static PyObject *engine_remove_lane(Engine *e, PyObject *handle) {
    Lane *l = lane_of(e, handle);
    if (!l)
        return NULL;
    if (e->started == 1)
        run_command(e, CMD_REMOVE, l);
    Py_DECREF(l->gate);
    free(l);
    Py_RETURN_NONE;
}

/* finish_slot(handle, i, seq, code, response, message): the loop's answer of handed-off slot i, its
 * progress words already stored (Python writes those): the response and the message, each cut to
 * its room in the slot, the status, seq, the slot given back to the plane, DONE, then its doorbell,
 * rung on a quiet lane only for a client asleep on it (as the plane's own answers ring). */
static PyObject *engine_finish_slot(Engine *e, PyObject *args) {
    PyObject *handle;
    int i;
    unsigned long long seq;
    unsigned int code;
    Py_buffer resp, msg;
    if (!PyArg_ParseTuple(args, "OiKIy*y*", &handle, &i, &seq, &code, &resp, &msg))
        return NULL;
    PyObject *result = NULL;
    Lane *l = lane_of(e, handle);
    if (!l)
        goto done;
    if (i < 0 || i >= l->slots) {
        PyErr_SetString(PyExc_IndexError, "no such slot");
        goto done;
    }
    char *s = slot_at(l, i);
    uint32_t n = resp.len < RESPONSE_BYTES ? (uint32_t)resp.len : RESPONSE_BYTES;
    uint32_t m = msg.len < ERROR_BYTES ? (uint32_t)msg.len : ERROR_BYTES;
    memcpy(s + RESPONSE_AT, resp.buf, n);
    memcpy(s + ERROR_AT, msg.buf, m);
    put32(s + 20, code);
    put32(s + 24, n);
    put32(s + 28, m);
    uint64_t q = seq;
    memcpy(s + 64, &q, 8);
    __atomic_store_n(&l->slot_busy[i], 0, __ATOMIC_RELEASE);
    set_state(s, ST_DONE);
    ring_done(l, i);
    result = Py_None;
    Py_INCREF(result);
done:
    PyBuffer_Release(&resp);
    PyBuffer_Release(&msg);
    return result;
}

static PyObject *engine_close_gate(Engine *e, PyObject *arg) {
    if (!PyObject_TypeCheck(arg, &GateType)) {
        PyErr_SetString(PyExc_TypeError, "a Gate");
        return NULL;
    }
    if (e->started == 1)
        run_command(e, CMD_CLOSE_GATE, arg);
    else
        __atomic_store_n(&((Gate *)arg)->closed, 1, __ATOMIC_RELEASE);
    Py_RETURN_NONE;
}

/* pause(bool): tests hold the plane's copies (requests are still taken) and let them go. */
static PyObject *engine_pause(Engine *e, PyObject *arg) {
    int on = PyObject_IsTrue(arg);
    if (on < 0)
        return NULL;
    if (e->started == 1)
        run_command(e, on ? CMD_PAUSE : CMD_RESUME, NULL);
    Py_RETURN_NONE;
}

static PyObject *engine_unwatch_all(Engine *e, PyObject *unused) {
    if (e->started == 1)
        run_command(e, CMD_UNWATCH_ALL, NULL);
    Py_RETURN_NONE;
}

/* take_handoffs() -> [(lane key, slot, counted)], oldest first; drains the notify eventfd.
 * counted: the request is in its gate's py_inflight until Python's py_exit for it. */
static PyObject *engine_take_handoffs(Engine *e, PyObject *unused) {
    uint64_t v;
    (void)!read(e->notify_fd, &v, 8);
    pthread_mutex_lock(&e->hand_mu);
    size_t n = e->nhand;
    pthread_mutex_unlock(&e->hand_mu);
    /* Built before the queue is emptied: out of memory, the handoffs stay for the next call. Only
     * the plane's thread adds to the queue, at its end, so the first n entries stay as they are. */
    PyObject *out = PyList_New((Py_ssize_t)n);
    if (!out)
        return NULL;
    pthread_mutex_lock(&e->hand_mu);
    for (size_t k = 0; k < n; k++) {
        PyObject *item = Py_BuildValue("LiO", (long long)e->hand[k].lane_key, e->hand[k].slot,
                                       e->hand[k].counted ? Py_True : Py_False);
        if (!item) {
            pthread_mutex_unlock(&e->hand_mu);
            Py_DECREF(out);
            return NULL;
        }
        PyList_SET_ITEM(out, (Py_ssize_t)k, item);
    }
    if (n && e->nhand > n) /* never with a NULL queue: nothing was ever handed over */
        memmove(e->hand, e->hand + n, (e->nhand - n) * sizeof(Handoff));
    e->nhand -= n;
    pthread_mutex_unlock(&e->hand_mu);
    return out;
}

/* An int64 array's buffer (writable if asked), at least `least` items, aligned; 0 on error (set). */
static int int64s(PyObject *obj, Py_buffer *v, int writable, Py_ssize_t least, const char *name) {
    if (PyObject_GetBuffer(obj, v, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0)) < 0)
        return 0;
    const char *f = v->format ? v->format : "B";
    if (*f == '@' || *f == '=' || *f == '<')
        f++;
    if (v->itemsize != 8 || (f[0] != 'l' && f[0] != 'q') || f[1] || (uintptr_t)v->buf % 8 || v->len / 8 < least) {
        PyBuffer_Release(v);
        PyErr_Format(PyExc_ValueError, "%s: not an aligned int64 array of %zd or more", name, least);
        return 0;
    }
    return 1;
}

/* Its request's count in the gate's py_inflight, given back once no byte of it is left to copy
 * and before its answer: the engine's next call, which may come as soon as it sees the answer, is
 * then the plane's. */
static void give_back(Job *j) {
    if (!j->counted)
        return;
    pthread_mutex_lock(&j->gate->mu);
    if (j->gate->py_inflight > 0)
        j->gate->py_inflight--;
    pthread_mutex_unlock(&j->gate->mu);
    j->counted = 0;
}

/* An answering copy run whole on the calling thread (submit_copy's now: a small Get while its gate
 * has no other copy, which the plane then starts none of: the request's count keeps them off),
 * answered as the plane answers it: its layers in order, then DONE (or NOT_FOUND for a client
 * released, DEADLINE_EXCEEDED past its timeout, decided before any byte moves). Returns the
 * status it answered. */
static uint32_t copy_now(Engine *e, Job *j) {
    Gate *g = j->gate;
    char msg[256];
    const char *reason = NULL;
    uint32_t code = 0;
    if (__atomic_load_n(j->stop, __ATOMIC_RELAXED)) {
        reason = "its client was unregistered or reclaimed";
        code = CODE_NOT_FOUND;
    } else if (j->deadline_ns && now_ns() >= j->deadline_ns) {
        reason = "its timeout_ms passed";
        code = CODE_DEADLINE;
    }
    if (reason) {
        snprintf(msg, sizeof msg,
                 "copy stopped because %s: 0 of its %u layers were copied, and nothing more of it will be",
                 reason, j->nl);
        give_back(j);
        answer_slot(e, j, code, msg);
        return code;
    }
    for (; j->li < j->nl; j->li++) {
        for (j->part = 0; j->part < g->parts; j->part++) {
            j->ri = 0;
            copy_runs(j, INT64_MAX);
        }
        j->part = 0;
        if (j->li == 0)
            observe(e, H_GET_FIRST, now_ns() - j->arrival_ns);
    }
    give_back(j);
    answer_slot(e, j, 0, NULL);
    return 0;
}

/* submit_copy(ticket, gate, load, host_base, lp_stride, host_limit, offsets, tokens, layers, stop,
 *             progress=None, signal_fd=-1, interval=0.0) -> bool
 * One of the loop's copies, run by this plane's thread among its own (the loop has ordered it
 * among the registration's copies and holds its turn: no job of the gate's lane runs meanwhile).
 * Host rows: page k's (layer, part) chunk at host_base + offsets[k] + (layer * parts + part) *
 * lp_stride, its tokens token_bytes apart; device rows: tokens[k * page_size + t] of the gate's
 * buffers; layers: the registration's local layer indices, copied in that order. Every offset's
 * chunks must lie inside [host_base, host_base + host_limit), every token and layer inside the
 * gate's, or nothing is submitted (ValueError). stop (int64[1]) is read at layer boundaries;
 * progress (int64[1], loads) is stored after each layer and signal_fd bumped at most once an
 * interval and at the end. Its end is posted back (take_completions) under ticket. False: the
 * gate is closed (nothing submitted). The arrays must outlive the copy: the caller keeps them
 * until its completion is taken.
 * paged=False: tokens holds one device page for every offset instead (its page_size tokens in
 * order), each inside the gate's whole pages.
 * now=False: an answering copy is copied and answered here, on the calling thread, before this
 * returns the status it answered (0 done; NOT_FOUND for a released client, DEADLINE_EXCEEDED past
 * its timeout: nothing copied), with nothing posted back (the caller ends it); -1 (nothing done)
 * unless its gate is open and has no copy in flight on the plane (its own or the loop's) and the
 * plane is not paused: the caller then submits it. For small copies, which cost less than a
 * wake-up of the plane's thread and of the loop for their end.
 * lane=None, slot=-1, found=0, timeout_ms=0, arrival_ns=0: with a lane (its handle, of this gate),
 * the copy is a load that answers `slot`, a request the lane handed over whose slot is still
 * busy, and runs after every earlier job of the gate: step 1 (no layer yet) is published there at once, then its layers and end as a plane
 * Load's are, `found` in the pages word,
 * the status and message of a stop too (its gate closed: NOT_FOUND; `timeout_ms` after
 * `arrival_ns`, CLOCK_MONOTONIC, else now: DEADLINE_EXCEEDED; its stop word, which only its
 * client's release sets: NOT_FOUND too); `counted`: the request holds one count of the gate's
 * py_inflight (a handed-over copy), which the plane gives back once the copy joins its jobs; and the
 * slot given back; its latencies go to the Get histograms. */
static PyObject *engine_submit_copy(Engine *e, PyObject *args, PyObject *kw) {
    static char *names[] = {"ticket", "gate", "load", "host_base", "lp_stride", "host_limit", "offsets",
                            "tokens", "layers", "stop", "progress", "signal_fd", "interval", "lane", "slot",
                            "found", "timeout_ms", "arrival_ns", "counted", "paged", "now", NULL};
    unsigned long long ticket, host_base;
    Gate *g;
    int load, signal_fd = -1, slot = -1, counted = 0, paged = 0, now = 0;
    long long lp_stride, host_limit, arrival = 0;
    unsigned int found = 0, timeout_ms = 0;
    PyObject *offsets_obj, *tokens_obj, *layers_obj, *stop_obj, *progress_obj = Py_None, *lane_obj = Py_None;
    double interval = 0.0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "KO!pKLLOOOO|OidOiIILppp", names, &ticket, &GateType, &g, &load,
                                     &host_base, &lp_stride, &host_limit, &offsets_obj, &tokens_obj,
                                     &layers_obj, &stop_obj, &progress_obj, &signal_fd, &interval, &lane_obj,
                                     &slot, &found, &timeout_ms, &arrival, &counted, &paged, &now))
        return NULL;
    if (e->started != 1) {
        PyErr_SetString(PyExc_RuntimeError, "the data plane has stopped");
        return NULL;
    }
    if (g->space || __atomic_load_n(&g->cuda, __ATOMIC_ACQUIRE)) {
        PyErr_SetString(PyExc_ValueError, "a space's gate copies nothing, nor does a CUDA pool's for the loop");
        return NULL;
    }
    /* An answering copy: a load that answers slot `slot` of lane `lane` (handed over to the loop,
     * its slot still the plane's), which must be this gate's. */
    Lane *answer_lane = NULL;
    if (lane_obj != Py_None) {
        if (!(answer_lane = lane_of(e, lane_obj)))
            return NULL;
        if (!load || answer_lane->gate != g || slot < 0 || slot >= answer_lane->slots ||
            !__atomic_load_n(&answer_lane->slot_busy[slot], __ATOMIC_ACQUIRE)) {
            PyErr_SetString(PyExc_ValueError, "an answering copy is a load of a slot its gate's lane handed over");
            return NULL;
        }
    }
    Py_buffer off = {0}, tok = {0}, lay = {0}, stop = {0}, prog = {0};
    int have_off = 0, have_tok = 0, have_lay = 0, have_stop = 0, have_prog = 0;
    PyObject *result = NULL;
    Job *j = NULL;
    int64_t ps = g->lim.page_size, tb = g->token_bytes;
    if (!(have_off = int64s(offsets_obj, &off, 0, 0, "offsets")) ||
        !(have_tok = int64s(tokens_obj, &tok, 0, 0, "tokens")) ||
        !(have_lay = int64s(layers_obj, &lay, 0, 0, "layers")) ||
        !(have_stop = int64s(stop_obj, &stop, 0, 1, "stop")) ||
        (progress_obj != Py_None && !(have_prog = int64s(progress_obj, &prog, 1, 1, "progress"))))
        goto done;
    int64_t npages = off.len / 8, nl = lay.len / 8;
    const int64_t *offs = off.buf, *toks = tok.buf, *lays = lay.buf;
    int64_t chunks = (int64_t)g->lim.num_layers * g->parts;
    /* paged: tokens holds a device page for every offset, its page_size tokens in order. */
#define TOKEN_AT(k) (paged ? toks[(k) / ps] * ps + (k) % ps : toks[k])
    if (tok.len / 8 != (paged ? npages : npages * ps)) {
        PyErr_SetString(PyExc_ValueError, paged ? "tokens must hold a device page for every offset"
                                                : "tokens must hold page_size tokens for every offset");
        goto done;
    }
    if (lp_stride < ps * tb || host_limit < 0 || lp_stride > host_limit || host_base + (unsigned long long)host_limit < host_base) {
        PyErr_SetString(PyExc_ValueError, "a host chunk must hold a page's tokens, inside the host span");
        goto done;
    }
    for (int64_t k = 0; k < npages; k++) /* every chunk of the page: offset + chunks * lp_stride <= limit */
        if (offs[k] < 0 || offs[k] > host_limit || (host_limit - offs[k]) / lp_stride < chunks) {
            PyErr_Format(PyExc_ValueError, "host offset %lld: its chunks are outside the host span", (long long)offs[k]);
            goto done;
        }
    for (int64_t k = 0; k < (paged ? npages : npages * ps); k++) /* a page: all of its tokens */
        if (toks[k] < 0 || (paged ? toks[k] >= g->lim.dev_tokens / ps : toks[k] >= g->lim.dev_tokens)) {
            PyErr_Format(PyExc_ValueError, "device %s %lld is outside the pool's %lld tokens",
                         paged ? "page" : "token", (long long)toks[k], (long long)g->lim.dev_tokens);
            goto done;
        }
    for (int64_t k = 0; k < nl; k++)
        if (lays[k] < 0 || lays[k] >= g->lim.num_layers) {
            PyErr_Format(PyExc_ValueError, "local layer %lld is outside the registration's %d", (long long)lays[k],
                         g->lim.num_layers);
            goto done;
        }
    j = calloc(1, sizeof(Job));
    if (j)
        j->local = malloc(sizeof(int32_t) * (size_t)(nl ? nl : 1));
    int contiguous = g->dev_stride == tb;
    int64_t nr = 0;
    for (int64_t k = 0; k < npages * ps; k++)
        if (k % ps == 0 || !contiguous || TOKEN_AT(k) != TOKEN_AT(k - 1) + 1)
            nr++;
    if (j && j->local)
        j->runs = malloc(sizeof(Run) * (size_t)(nr ? nr : 1));
    if (!j || !j->local || !j->runs) {
        PyErr_NoMemory();
        goto done;
    }
    nr = 0;
    for (int64_t k = 0; k < npages * ps; k++) {
        int64_t t = k % ps;
        if (t > 0 && contiguous && TOKEN_AT(k) == j->runs[nr - 1].dev_tok + j->runs[nr - 1].ntok) {
            j->runs[nr - 1].ntok++;
            continue;
        }
        j->runs[nr].host_off = offs[k / ps] + t * tb;
        j->runs[nr].dev_tok = TOKEN_AT(k);
        j->runs[nr].ntok = 1;
        nr++;
    }
#undef TOKEN_AT
    for (int64_t k = 0; k < nl; k++)
        j->local[k] = (int32_t)lays[k];
    j->nruns = nr;
    j->nl = (uint32_t)nl;
    j->gate = g;
    j->load = load;
    j->ndev = npages * ps;
    j->bytes_per_layer = j->ndev * tb * g->parts;
    j->stream = kv_streams(j->load, j->bytes_per_layer * (int64_t)j->nl);
    j->host = (char *)(uintptr_t)host_base;
    j->lp_stride = lp_stride;
    j->ext = 1;
    j->ticket = ticket;
    j->progress = have_prog ? prog.buf : NULL;
    j->signal_fd = signal_fd;
    j->interval_ns = (int64_t)(interval * 1e9);
    j->stop = stop.buf;
    j->arrival_ns = arrival > 0 ? arrival : now_ns();
    if (answer_lane) {
        j->answers = 1;
        j->lane = answer_lane;
        j->slot = slot;
        j->found = found;
        j->counted = counted;
        j->deadline_ns = timeout_ms ? j->arrival_ns + (int64_t)timeout_ms * 1000000 : 0;
        /* Behind every earlier job of its gate (the plane's own may still run: the loop took it
         * with nothing else of the client in flight but those), as a Load touching their pages. */
        j->dependent = 1;
    }
    if (now) { /* copied here, now, or not at all (False: the caller submits it) */
        if (!j->answers) {
            PyErr_SetString(PyExc_ValueError, "only an answering copy is copied now");
            goto done;
        }
        pthread_mutex_lock(&g->mu);
        /* Its request's count (counted) is what keeps the plane from starting the gate's copies
         * meanwhile: without it, never copied here. */
        int idle = counted && g->py_inflight > 0 && !g->closed && !g->c_inflight && !g->x_inflight &&
                   !__atomic_load_n(&e->paused, __ATOMIC_RELAXED);
        if (idle)
            g->x_inflight++;
        pthread_mutex_unlock(&g->mu);
        uint32_t code = 0;
        if (idle) {
            code = copy_now(e, j);
            pthread_mutex_lock(&g->mu);
            g->x_inflight--;
            pthread_mutex_unlock(&g->mu);
        }
        result = PyLong_FromLong(idle ? (long)code : -1L);
        goto done;
    }
    /* room for its completion, kept until it is posted */
    if (!reserve_room(e, (void **)&e->done, &e->capdone, &e->ndone, &e->unposted, sizeof(Done))) {
        PyErr_NoMemory();
        goto done;
    }
    pthread_mutex_lock(&g->mu);
    int open = !g->closed;
    if (open)
        g->x_inflight++;
    pthread_mutex_unlock(&g->mu);
    if (!open) {
        pthread_mutex_lock(&e->hand_mu);
        e->unposted--;
        pthread_mutex_unlock(&e->hand_mu);
        result = Py_False;
        Py_INCREF(result);
        goto done;
    }
    if (j->answers) { /* step 1, the pages found, before any layer: the RPC's first message */
        publish_progress(e, j, 0);
        if (j->bytes_per_layer * (int64_t)j->nl > QUIET_FIRST_BYTES ||
            __atomic_load_n(&e->njobs, __ATOMIC_RELAXED) || __atomic_load_n(&e->paused, __ATOMIC_RELAXED))
            ring_done(j->lane, j->slot);
        else /* as if rung now: a sleeper's next ring is a progress interval away, or the end */
            j->last_pub_ns = now_ns();
    }
    __atomic_add_fetch(&e->njobs, 1, __ATOMIC_RELAXED);
    pthread_mutex_lock(&e->in_mu);
    Job **tail = &e->incoming;
    while (*tail)
        tail = &(*tail)->next;
    *tail = j;
    __atomic_store_n(&e->nincoming, 1, __ATOMIC_RELEASE);
    pthread_mutex_unlock(&e->in_mu);
    j = NULL;
    wake(e->wake_fd);
    result = Py_True;
    Py_INCREF(result);
done:
    if (j)
        job_free(j);
    if (have_off)
        PyBuffer_Release(&off);
    if (have_tok)
        PyBuffer_Release(&tok);
    if (have_lay)
        PyBuffer_Release(&lay);
    if (have_stop)
        PyBuffer_Release(&stop);
    if (have_prog)
        PyBuffer_Release(&prog);
    return result;
}

/* take_completions() -> [(ticket, status, layers done)]: the loop's copies that ended, in the order
 * they ended; status 0 done, 1 stopped by its stop word, 2 its gate closed, 3 the plane stopped. */
static PyObject *engine_take_completions(Engine *e, PyObject *unused) {
    pthread_mutex_lock(&e->hand_mu);
    size_t n = e->ndone;
    PyObject *out = PyList_New((Py_ssize_t)n);
    for (size_t k = 0; out && k < n; k++) {
        PyObject *item = Py_BuildValue("KiI", (unsigned long long)e->done[k].ticket, e->done[k].status,
                                       e->done[k].layers);
        if (!item) {
            Py_CLEAR(out);
            break;
        }
        PyList_SET_ITEM(out, (Py_ssize_t)k, item);
    }
    if (out)
        e->ndone = 0;
    pthread_mutex_unlock(&e->hand_mu);
    return out;
}

/* set_cache(cache): the node-wide cache whose Gets this plane may serve whole, for the gates given a
 * part (Gate.set_cache). Once, before any gate is. */
static PyObject *engine_set_cache(Engine *e, PyObject *arg) {
    if (!PyObject_TypeCheck(arg, &CacheType)) {
        PyErr_SetString(PyExc_TypeError, "a Cache");
        return NULL;
    }
    if (e->cache) {
        PyErr_SetString(PyExc_RuntimeError, "the plane's cache is set once");
        return NULL;
    }
    Py_INCREF(arg);
    __atomic_store_n(&e->cache, (Cache *)arg, __ATOMIC_RELEASE);
    Py_RETURN_NONE;
}

static int cmp_i64(const void *a, const void *b) {
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return (x > y) - (x < y);
}

/* stash(gate, ids, full): free cache pages (int64 ids) the loop set aside for the gate's Puts
 * (try_put): each being written, in no part, of the gate's tenant, inside the tables; appended to
 * its stash, which the loop keeps at `full` pages (a Put of at most that many that finds it short
 * says so: stash_short, cleared here once it holds that many; ids may be empty, to say `full`).
 * With the cache's lock held, on a gate given its part (set_cache), not closed. */
static PyObject *engine_stash(Engine *e, PyObject *args) {
    PyObject *go;
    Py_buffer v;
    long long full;
    if (!PyArg_ParseTuple(args, "O!y*L", &GateType, &go, &v, &full))
        return NULL;
    Gate *g = (Gate *)go;
    Cache *c = e->cache;
    PyObject *r = NULL;
    if (!c || !c->open) {
        PyErr_SetString(PyExc_RuntimeError, "the plane serves no cache");
        goto done;
    }
    if (!cache_held(c))
        goto done;
    if (v.len % 8 || g->space || __atomic_load_n(&g->cache_gid, __ATOMIC_ACQUIRE) < 0 ||
        __atomic_load_n(&g->closed, __ATOMIC_ACQUIRE)) {
        PyErr_SetString(PyExc_ValueError, "int64 page ids, for an open gate given its part");
        goto done;
    }
    const int64_t *ids = v.buf;
    int64_t n = v.len / 8;
    for (int64_t k = 0; k < n; k++)
        if (ids[k] < 0 || ids[k] >= c->pg.npages || c->pg.state[ids[k]] != 2 || c->part[ids[k]] != -1) {
            PyErr_SetString(PyExc_ValueError, "a stash takes pages being written and in no part");
            goto done;
        }
    /* No page twice (two keys would be filed in it): against the stash and one another, sorted
     * (the loop's own bookkeeping keeps a page out of two gates' stashes). */
    int64_t m = g->nstash + n;
    int64_t *all = malloc(sizeof(int64_t) * (size_t)(m ? m : 1));
    if (!all) {
        PyErr_NoMemory();
        goto done;
    }
    if (g->nstash) /* (a stash never given a page has no array yet) */
        memcpy(all, g->stash, sizeof(int64_t) * (size_t)g->nstash);
    if (n)
        memcpy(all + g->nstash, ids, sizeof(int64_t) * (size_t)n);
    qsort(all, (size_t)m, sizeof(int64_t), cmp_i64);
    int twice = 0;
    for (int64_t k = 1; k < m && !twice; k++)
        twice = all[k] == all[k - 1];
    free(all);
    if (twice) {
        PyErr_SetString(PyExc_ValueError, "a page is set aside once");
        goto done;
    }
    if (g->nstash + n > g->capstash) {
        int64_t cap = 2 * (g->nstash + n) + 16;
        int64_t *more = realloc(g->stash, sizeof(int64_t) * (size_t)cap);
        if (!more) {
            PyErr_NoMemory();
            goto done;
        }
        g->stash = more;
        g->capstash = cap;
    }
    if (n) {
        memcpy(g->stash + g->nstash, ids, sizeof(int64_t) * (size_t)n);
        g->nstash += n;
    }
    g->stash_full = full > 0 ? full : 0;
    if (g->nstash >= g->stash_full) /* (a return of a few pages leaves a short stash short) */
        g->stash_short = 0;
    r = Py_None;
    Py_INCREF(r);
done:
    PyBuffer_Release(&v);
    return r;
}

/* unstash(gate) -> bytes: the gate's stash (int64 ids), emptied. With the cache's lock held. */
static PyObject *engine_unstash(Engine *e, PyObject *arg) {
    if (!PyObject_TypeCheck(arg, &GateType)) {
        PyErr_SetString(PyExc_TypeError, "a Gate");
        return NULL;
    }
    Gate *g = (Gate *)arg;
    if (!e->cache) {
        PyErr_SetString(PyExc_RuntimeError, "the plane serves no cache");
        return NULL;
    }
    if (!cache_held(e->cache))
        return NULL;
    PyObject *r = PyBytes_FromStringAndSize((const char *)g->stash, (Py_ssize_t)(8 * g->nstash));
    if (r)
        g->nstash = 0;
    return r;
}

/* take_gets() -> [(token, gid, ids, found, misses, status, layers, bytes, kind)]: the Gets (and
 * Lookups, and Puts of keys all stored) served whole on the plane that ended, in the order they
 * ended: the gate's token and cache part, the page ids found (int64 bytes: a Get's are held, which
 * the loop lets go), the pages found and the keys missed, status 0 done, 2 its gate closed, 3
 * stopped otherwise (a deadline, the plane stopped, handed to the loop after all), the layers
 * copied and the bytes (done only), kind 0 a Get, 1 a Lookup, 2 a Put, 3 a Lookup of host memory
 * only (memory_only), 4 a Put that stored pages (END_STORE: its first `found` ids filed and held,
 * the rest its stash's pages back, `misses` its keys present). */
static PyObject *engine_take_gets(Engine *e, PyObject *unused) {
    pthread_mutex_lock(&e->hand_mu);
    size_t n = e->ngets;
    PyObject *out = PyList_New((Py_ssize_t)n);
    for (size_t k = 0; out && k < n; k++) {
        GetEnd *d = &e->gets[k];
        PyObject *item = Py_BuildValue("Liy#LLiILi", (long long)d->token, d->gid, (const char *)d->ids,
                                       (Py_ssize_t)(d->ids ? 8 * d->nids : 0), (long long)d->found,
                                       (long long)d->misses, d->status, d->layers, (long long)d->nbytes,
                                       d->kind);
        if (!item) {
            Py_CLEAR(out);
            break;
        }
        PyList_SET_ITEM(out, (Py_ssize_t)k, item);
    }
    if (out) {
        for (size_t k = 0; k < n; k++)
            free(e->gets[k].ids);
        e->ngets = 0;
    }
    pthread_mutex_unlock(&e->hand_mu);
    return out;
}

/* take_histograms() -> [(counts per bucket, +Inf last), sum in seconds] for Write, Load, Load's
 * first layer, Get, Get's first layer and Lookup, zeroed: what the plane observed since the last
 * take. */
static PyObject *engine_take_histograms(Engine *e, PyObject *unused) {
    PyObject *out = PyList_New(H_KINDS);
    if (!out)
        return NULL;
    pthread_mutex_lock(&e->stat_mu);
    for (int h = 0; h < H_KINDS; h++) {
        PyObject *counts = PyList_New(e->nedges + 1);
        for (int b = 0; counts && b <= e->nedges; b++)
            PyList_SET_ITEM(counts, b, PyLong_FromUnsignedLongLong(e->hist[h][b]));
        PyList_SET_ITEM(out, h, counts ? Py_BuildValue("(Nd)", counts, e->hsum[h]) : NULL);
        memset(e->hist[h], 0, sizeof e->hist[h]);
        e->hsum[h] = 0;
    }
    pthread_mutex_unlock(&e->stat_mu);
    return out;
}

static PyObject *engine_get_notify_fd(Engine *e, void *unused) { return PyLong_FromLong(e->notify_fd); }
static PyObject *engine_get_jobs(Engine *e, void *unused) {
    return PyLong_FromLongLong(__atomic_load_n(&e->njobs, __ATOMIC_RELAXED));
}
static PyObject *engine_get_served(Engine *e, void *unused) {
    return PyLong_FromUnsignedLongLong(__atomic_load_n(&e->served, __ATOMIC_RELAXED));
}
static PyObject *engine_get_write_turns(Engine *e, void *unused) {
    return PyLong_FromUnsignedLongLong(__atomic_load_n(&e->write_turns, __ATOMIC_RELAXED));
}
static PyObject *engine_get_plane_gets(Engine *e, void *unused) {
    return PyLong_FromUnsignedLongLong(__atomic_load_n(&e->plane_gets, __ATOMIC_RELAXED));
}
static PyObject *engine_get_plane_lookups(Engine *e, void *unused) {
    return PyLong_FromUnsignedLongLong(__atomic_load_n(&e->plane_lookups, __ATOMIC_RELAXED));
}

static PyObject *engine_get_plane_space_lookups(Engine *e, void *unused) {
    return PyLong_FromUnsignedLongLong(__atomic_load_n(&e->plane_space_lookups, __ATOMIC_RELAXED));
}
static PyObject *engine_get_plane_puts(Engine *e, void *unused) {
    return PyLong_FromUnsignedLongLong(__atomic_load_n(&e->plane_puts, __ATOMIC_RELAXED));
}
static PyObject *engine_get_plane_stores(Engine *e, void *unused) {
    return PyLong_FromUnsignedLongLong(__atomic_load_n(&e->plane_stores, __ATOMIC_RELAXED));
}
static PyObject *engine_get_handed(Engine *e, void *unused) {
    return PyLong_FromUnsignedLongLong(__atomic_load_n(&e->handed, __ATOMIC_RELAXED));
}

static PyMethodDef engine_methods[] = {
    {"add_lane", (PyCFunction)engine_add_lane, METH_VARARGS, NULL},
    {"remove_lane", (PyCFunction)engine_remove_lane, METH_O, NULL},
    {"finish_slot", (PyCFunction)engine_finish_slot, METH_VARARGS, NULL},
    {"close_gate", (PyCFunction)engine_close_gate, METH_O, NULL},
    {"unwatch_all", (PyCFunction)engine_unwatch_all, METH_NOARGS, NULL},
    {"pause", (PyCFunction)engine_pause, METH_O, NULL},
    {"take_handoffs", (PyCFunction)engine_take_handoffs, METH_NOARGS, NULL},
    {"submit_copy", (PyCFunction)(void (*)(void))engine_submit_copy, METH_VARARGS | METH_KEYWORDS, NULL},
    {"take_completions", (PyCFunction)engine_take_completions, METH_NOARGS, NULL},
    {"set_cache", (PyCFunction)engine_set_cache, METH_O, NULL},
    {"take_gets", (PyCFunction)engine_take_gets, METH_NOARGS, NULL},
    {"stash", (PyCFunction)engine_stash, METH_VARARGS, NULL},
    {"unstash", (PyCFunction)engine_unstash, METH_O, NULL},
    {"take_histograms", (PyCFunction)engine_take_histograms, METH_NOARGS, NULL},
    {"stop", (PyCFunction)engine_stop, METH_NOARGS, NULL},
    {NULL},
};

static PyGetSetDef engine_getset[] = {
    {"notify_fd", (getter)engine_get_notify_fd, NULL, NULL, NULL},
    {"jobs", (getter)engine_get_jobs, NULL, NULL, NULL},
    {"served", (getter)engine_get_served, NULL, NULL, NULL},
    {"handed", (getter)engine_get_handed, NULL, NULL, NULL},
    {"plane_gets", (getter)engine_get_plane_gets, NULL, NULL, NULL},
    {"plane_lookups", (getter)engine_get_plane_lookups, NULL, NULL, NULL},
    {"plane_space_lookups", (getter)engine_get_plane_space_lookups, NULL, NULL, NULL},
    {"plane_puts", (getter)engine_get_plane_puts, NULL, NULL, NULL},
    {"plane_stores", (getter)engine_get_plane_stores, NULL, NULL, NULL},
    {"write_turns", (getter)engine_get_write_turns, NULL, NULL, NULL},
    {NULL},
};

static PyTypeObject EngineType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "kvserver.lane._kvlane.Engine",
    .tp_basicsize = sizeof(Engine),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)engine_init,
    .tp_dealloc = (destructor)engine_dealloc,
    .tp_methods = engine_methods,
    .tp_getset = engine_getset,
};

/* space_gate() -> Gate: the gate of a scheduler's lane of one KV space (Gate.space): it answers
 * that space's Lookups once set_space gives it the space's parts, and hands every other request
 * to the loop. */
static PyObject *module_space_gate(PyObject *mod, PyObject *unused) {
    Gate *g = (Gate *)PyType_GenericNew(&GateType, NULL, NULL);
    if (!g)
        return NULL;
    pthread_mutex_init(&g->mu, NULL);
    pthread_mutex_init(&g->check_mu, NULL);
    g->cache_gid = -1;
    g->space = 1;
    return (PyObject *)g;
}

static PyMethodDef module_methods[] = {
    {"space_gate", module_space_gate, METH_NOARGS, NULL},
    {NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_kvlane", NULL, -1, module_methods};

PyMODINIT_FUNC PyInit__kvlane(void) {
    if (PyType_Ready(&GateType) < 0 || PyType_Ready(&EngineType) < 0 || PyType_Ready(&CacheType) < 0)
        return NULL;
    PyObject *m = kv_with_sources(PyModule_Create(&module));
    if (!m)
        return NULL;
    Py_INCREF(&GateType);
    Py_INCREF(&EngineType);
    PyModule_AddObject(m, "Gate", (PyObject *)&GateType);
    PyModule_AddObject(m, "Engine", (PyObject *)&EngineType);
    Py_INCREF(&CacheType);
    PyModule_AddObject(m, "Cache", (PyObject *)&CacheType);
    if (PyModule_AddIntConstant(m, "FORMAT_VERSION", KV_REQ_VERSION) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
