/* A Gate's Python methods: what the loop tells the plane of a registration (its pages, its cache
 * part, its space's parts) and the checks it asks of it. A part of kvlane.c. */

static void gate_dealloc(Gate *g) {
    pthread_mutex_destroy(&g->mu);
    pthread_mutex_destroy(&g->check_mu);
    if (g->owned_obj) {
        PyBuffer_Release(&g->owned_view);
        Py_DECREF(g->owned_obj);
    }
    kv_zbatch marks = {0};
    kv_zadd(&marks, g->busy, g->page_marks, sizeof(int32_t));
    kv_zadd(&marks, g->wpages, g->page_marks, sizeof(int32_t));
    kv_zadd(&marks, g->wdev, g->dev_marks, sizeof(int32_t));
    kv_zadd(&marks, g->lim.page_mark, g->page_marks, sizeof(uint32_t));
    kv_zadd(&marks, g->lim.dev_mark, g->dev_marks, sizeof(uint32_t));
    kv_zfree_batch(&marks);
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
    g->page_marks = (size_t)num_pages + 1;
    g->dev_marks = (size_t)dev_tokens;
    g->busy = kv_zalloc(g->page_marks, sizeof(int32_t));
    g->wpages = kv_zalloc(g->page_marks, sizeof(int32_t));
    g->wdev = kv_zalloc(g->dev_marks, sizeof(int32_t));
    g->lim.page_mark = kv_zalloc(g->page_marks, sizeof(uint32_t));
    g->lim.dev_mark = kv_zalloc(g->dev_marks, sizeof(uint32_t));
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

/* take_lookups() -> (hits, misses): those of the Lookups the plane answered and settled itself
 * (serve_get.h's try_answer) since the last take, zeroed: the loop counts them in the gate's
 * part's space and tenant. */
static PyObject *gate_take_lookups(Gate *g, PyObject *unused) {
    pthread_mutex_lock(&g->mu);
    PyObject *r = Py_BuildValue("KK", (unsigned long long)g->lookup_hits, (unsigned long long)g->lookup_misses);
    if (r)
        g->lookup_hits = g->lookup_misses = 0;
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

/* shut(): the gate takes no new request from now on (DataPlane.close_gate, on the loop, before
 * the plane's thread takes the close: that command, after the piece under way, releases the
 * copies). A copy reads `closed` under the gate's mutex as it is counted (take_turn, try_job);
 * a request read just before is served as one taken before a close. */
static PyObject *gate_shut(Gate *g, PyObject *unused) {
    pthread_mutex_lock(&g->mu);
    __atomic_store_n(&g->closed, 1, __ATOMIC_RELEASE);
    pthread_mutex_unlock(&g->mu);
    Py_RETURN_NONE;
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
